"""The packages depend one way: `nsa_flex.titan` (trainer glue) -> the library (`nsa_flex`) ->
`masks` -> `nsa_flex.rules` (a leaf). Imports are read from the source (ast), at any depth, so an
import inside a function counts too."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# applications on top of both (`nsa_flex.apps`) and the `python -m` aliases that run them
APPS = ("nsa_flex.apps", "nsa_flex.generate", "nsa_flex.eval", "nsa_flex.plot")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of the modules `source` (the code of `module`) imports anywhere."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            pkg = base[:len(base) - node.level + 1] if node.level else []
            name = ".".join(pkg + ([node.module] if node.module else []))
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def violations(module: str, imported: set[str]) -> list[str]:
    """The direction rules broken by `module` importing `imported`."""
    bad = []
    for m in sorted(imported):
        if module.startswith("masks") and m.startswith("nsa_flex") and m not in ("nsa_flex", "nsa_flex.rules") \
                and not m.startswith("nsa_flex.rules."):
            bad.append(f"{module} imports {m}: masks may import only the leaf nsa_flex.rules")
        if module == "nsa_flex.rules" and (m.startswith("nsa_flex") or m.startswith("masks")):
            bad.append(f"nsa_flex.rules imports {m}: the rules are a leaf")
        if module.startswith("nsa_flex") and not module.startswith("nsa_flex.titan") \
                and not module.startswith(APPS) and m.startswith("nsa_flex.titan"):
            bad.append(f"{module} imports {m}: the library never imports the trainer glue")
    return bad


def test_the_checker_catches_each_direction():
    assert violations("masks.builders", imports("from nsa_flex.config import NSAConfig", "masks.builders"))
    assert not violations("masks.builders", imports("from nsa_flex.rules import is_forced", "masks.builders"))
    src = "def f():\n    from ..titan.model import doc_ids_from_tokens\n"
    assert imports(src, "nsa_flex.inference.model") >= {"nsa_flex.titan.model"}
    assert violations("nsa_flex.inference.model", imports(src, "nsa_flex.inference.model"))
    assert not violations("nsa_flex.titan.ops", imports("from nsa_flex.layer import NSAAttention", "x"))
    assert violations("nsa_flex.rules", {"masks"})
    assert imports("from . import rules", "nsa_flex", is_package=True) >= {"nsa_flex.rules"}


FILES = sorted(p for pkg in ("nsa_flex", "masks") for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    mod = module_name(path)
    assert violations(mod, imports(path.read_text(), mod, path.name == "__init__.py")) == []
