"""Every test that needs CUDA carries the `gpu` mark, so that `pytest -m gpu` runs them all (and
conftest skips them without a device): a test skipped on CUDA's absence by a bare ``skipif`` is
missed by ``-m gpu``. Read from the test sources (ast)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent


def unmarked_cuda_tests(source: str) -> list[str]:
    """Test functions of ``source`` that skip without CUDA (a skipif naming cuda / CUDA) and lack
    the gpu mark (on themselves or in the module's ``pytestmark``)."""
    tree = ast.parse(source)
    module_gpu = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and "gpu" in ast.unparse(n.value) for n in tree.body)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test"):
            decos = [ast.unparse(d) for d in n.decorator_list]
            needs_cuda = any("skipif" in d and "cuda" in d.lower() for d in decos)
            if needs_cuda and not module_gpu and not any(d == "pytest.mark.gpu" for d in decos):
                out.append(n.name)
    return out


def test_the_check_sees_a_bare_skipif():
    src = ("import pytest, torch\n"
           "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_a(): pass\n"
           "@pytest.mark.gpu\n@pytest.mark.skipif(not CUDA, reason='triton')\ndef test_b(): pass\n"
           "def test_c(): pass\n")
    assert unmarked_cuda_tests(src) == ["test_a"]
    assert unmarked_cuda_tests("import pytest\npytestmark = [pytest.mark.gpu]\n" + src) == []


def test_every_cuda_test_is_marked_gpu():
    bad = {str(p.relative_to(ROOT)): unmarked_cuda_tests(p.read_text()) for p in sorted(ROOT.rglob("test_*.py"))}
    assert {k: v for k, v in bad.items() if v} == {}
