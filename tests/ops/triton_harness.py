"""Compile a Triton kernel for an H100 (sm_90) without a GPU, with the launch arguments a wrapper
passes: catches what the interpreter does not check (types across branches, constexpr-only
globals, dot shapes, fp64 scalars)."""

import pytest
import torch

TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}


def cuda_compiler():
    """(triton, ASTSource, GPUTarget), or skip when triton has no CUDA backend."""
    triton = pytest.importorskip("triton")
    from triton.compiler import ASTSource

    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton without its CUDA backend: {e}")
    return triton, ASTSource, GPUTarget


class Launches(list):
    """The launches of wrapped kernels, [(kernel, args, kwargs)], instead of running them:
    ``wrap(kernel)[grid](*args, **kw)`` records."""

    def wrap(self, kernel):
        launches = self

        class Record:
            def __getitem__(self, grid):
                return lambda *args, **kw: launches.append((kernel, args, kw))

        return Record()


def compile_for_h100(kernel, args: tuple, kw: dict):
    """Compile one recorded launch for sm_90; every Python float is typed fp64, as Inductor types
    it inside torch.compile (eager Triton says fp32): the kernels must compile either way."""
    triton, ASTSource, GPUTarget = cuda_compiler()
    kw = dict(kw)
    opts = {o: kw.pop(o) for o in ("num_warps", "num_stages") if o in kw}
    vals = dict(zip(kernel.arg_names, args), **kw)
    assert len(args) + len(kw) == len(kernel.arg_names) and not set(kw) & set(kernel.arg_names[:len(args)]), \
        (kernel.__name__, "launch arguments do not bind one-to-one to the parameters")
    sig, const = {}, {}
    for name, param in zip(kernel.arg_names, kernel.params):
        v = vals[name]
        if param.is_constexpr:
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = TYPES[v.dtype]
        else:
            sig[name] = "fp64" if isinstance(v, float) else "i32"
    compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                              options=opts)
    assert compiled.asm.get("cubin"), kernel.__name__


def run_interpreted(script: str, *args: str, timeout: int = 600):
    """Run a test file as a script under Triton's interpreter (TRITON_INTERPRET=1 must be set
    before triton decorates the kernels, so it needs a fresh process), the repository on the path;
    the CompletedProcess (stdout, stderr as text)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)
