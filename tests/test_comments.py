"""Library comments say what and why: the measurements behind a choice, and the NOTES entries that
hold them, live in experiments/NOTES.md, not in the code's comments and docstrings (read with
tokenize and ast)."""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"\bNOTES\b|\d+(?:\.\d+)? ?ms\b")  # a NOTES entry, a timing in milliseconds


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of ``source``."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def history(source: str) -> list[str]:
    return [f"line {n}: {m.group(0)!r}" for n, text in prose(source) for m in HISTORY.finditer(text)]


def test_the_reader_sees_comments_and_docstrings_only():
    src = ('"""Chosen on the H100 (experiments/NOTES.md 27)."""\n'
           'X = "a 3 ms string"  # 2.58 ms against 3.98\n'
           'def f():\n    """from 20.9 to 9.4 ms"""\n')
    assert sorted(history(src)) == ["line 1: 'NOTES'", "line 2: '2.58 ms'", "line 4: '9.4 ms'"]


def test_library_comments_hold_no_measurement_history():
    files = sorted(p for pkg in ("nsa_flex", "masks") for p in (ROOT / pkg).rglob("*.py"))
    found = {str(p.relative_to(ROOT)): history(p.read_text()) for p in files}
    assert {k: v for k, v in found.items() if v} == {}
