"""The packages depend one way, followed transitively: the apps (`nsa_flex.apps`: generate, eval,
plot) -> the trainer glue (`nsa_flex.titan`) -> the library (`nsa_flex`) -> `masks` -> the leaves
`nsa_flex.rules` and `nsa_flex.errors`; and the graph of the project's modules has no cycle.
Imports are read from the source (ast), at any depth, so an import inside a function counts too."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEAVES = ("nsa_flex.rules", "nsa_flex.errors")
# `python -m nsa_flex.generate` / `eval` / `plot`: aliases that run an app by name (runpy)
ALIASES = ("nsa_flex.generate", "nsa_flex.eval", "nsa_flex.plot")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names `source` (the code of `module`) imports anywhere: each module, and each
    `module.name` of a `from module import name` (name may be a submodule)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            pkg = base[:len(base) - node.level + 1] if node.level else []
            name = ".".join(pkg + ([node.module] if node.module else []))
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def project_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the project modules it imports}, from {module: (source, is_package)}; an imported
    name resolves to the longest project module it starts with (`masks.core.MaskSpec` -> `masks.core`)."""
    graph = {}
    for mod, (src, is_pkg) in sources.items():
        edges = set()
        for name in imports(src, mod, is_pkg):
            parts = name.split(".")
            hit = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in sources),
                       None)
            if hit and hit != mod:
                edges.add(hit)
        graph[mod] = edges
    return graph


def reach(graph: dict[str, set[str]], mod: str) -> set[str]:
    """Every module `mod` imports, directly or through others."""
    seen, todo = set(), list(graph.get(mod, ()))
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def layer(mod: str) -> int:
    """0 the leaves, 1 masks, 2 the library, 3 the trainer glue, 4 the apps, 5 the aliases."""
    under = lambda *pkgs: any(mod == p or mod.startswith(p + ".") for p in pkgs)
    if mod in LEAVES:
        return 0
    if under("masks"):
        return 1
    if under(*ALIASES):
        return 5
    if under("nsa_flex.apps"):
        return 4
    if under("nsa_flex.titan"):
        return 3
    return 2


def violations(graph: dict[str, set[str]], mod: str) -> list[str]:
    """The direction rules `mod` breaks through any chain of imports."""
    names = ["a leaf (nsa_flex.rules / nsa_flex.errors)", "masks", "the library", "the trainer glue (nsa_flex.titan)",
             "an app (nsa_flex.apps)", "an alias module"]
    out = []
    for m in sorted(reach(graph, mod)):
        if layer(m) > layer(mod) or (layer(mod) == 0 and m != mod):
            out.append(f"{mod} ({names[layer(mod)]}) reaches {m} ({names[layer(m)]})"
                       + (f" through {sorted(graph[mod] & ({m} | {x for x in graph[mod] if m in reach(graph, x)}))}"
                          if m not in graph[mod] else ""))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected group of two or more modules (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_follows_imports_transitively():
    g = project_graph({"nsa_flex.inference.model": ("from ..data import documents\n", False),
                       "nsa_flex.data.documents": ("def f():\n    from nsa_flex.titan.model import X\n", False),
                       "nsa_flex.titan.model": ("from nsa_flex.layer import NSAAttention\n", False),
                       "nsa_flex.layer": ("import masks\n", False),
                       "masks": ("from .core import MaskSpec\n", True),
                       "masks.core": ("from nsa_flex.rules import num_cmp\n", False),
                       "nsa_flex.rules": ("", False)})
    assert g["nsa_flex.inference.model"] == {"nsa_flex.data.documents"}
    bad = violations(g, "nsa_flex.inference.model")  # two steps away, inside a function
    assert bad == ["nsa_flex.inference.model (the library) reaches nsa_flex.titan.model (the trainer glue "
                   "(nsa_flex.titan)) through ['nsa_flex.data.documents']"]
    assert violations(g, "nsa_flex.titan.model") == [] and violations(g, "masks") == []
    assert violations(project_graph({"nsa_flex.rules": ("from nsa_flex import errors\n", False),
                                     "nsa_flex.errors": ("", False)}), "nsa_flex.rules")
    assert violations(project_graph({"nsa_flex.titan.cli": ("from nsa_flex.apps import plot\n", False),
                                     "nsa_flex.apps.plot": ("", False)}), "nsa_flex.titan.cli")


def test_the_checker_finds_a_cycle_behind_a_function_level_import():
    g = project_graph({"nsa_flex.inference.model": ("from .graphs import G\n", False),
                       "nsa_flex.inference.graphs": ("def f():\n    from .model import step\n", False),
                       "nsa_flex.inference.cache": ("", False)})
    assert cycles(g) == [["nsa_flex.inference.graphs", "nsa_flex.inference.model"]]


FILES = sorted(p for pkg in ("nsa_flex", "masks") for p in (ROOT / pkg).rglob("*.py"))
GRAPH = project_graph({module_name(p): (p.read_text(), p.name == "__init__.py") for p in FILES})


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    assert violations(GRAPH, module_name(path)) == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


# The only modules that import the project inside a function, and why (docs/ARCHITECTURE.md):
INNER_IMPORTS = {
    "nsa_flex.titan.cli": "nsa-train answers --help and argument errors before torch is imported",
    "nsa_flex.inference.decode_fused": "nsa_flex.ops.decode_triton needs triton, which may be missing",
    "nsa_flex.bench": "nsa_flex.ops.selected_triton needs triton, which may be missing",
    "nsa_flex.ops.selected_triton": "masks.core in the backward: left for the op's rewrite (issue 44.8)",
}


def inner_imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """The project modules `source` imports inside a function."""
    funcs = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return {m for f in funcs for m in imports(ast.unparse(f), module, is_package)
            if m.split(".")[0] in ("nsa_flex", "masks")}


def test_the_inner_import_reader():
    src = "import os\ndef f():\n    from .graphs import G\n    import json\n"
    assert inner_imports(src, "nsa_flex.inference.model") >= {"nsa_flex.inference.graphs"}
    assert not inner_imports("from .graphs import G\n", "nsa_flex.inference.model")


def test_function_level_imports_only_where_said():
    found = {module_name(p) for p in FILES if inner_imports(p.read_text(), module_name(p), p.name == "__init__.py")}
    assert found <= set(INNER_IMPORTS), sorted(found - set(INNER_IMPORTS))
