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
    # what the launch would ask for: an H100 block has at most 227 KiB of shared memory
    assert compiled.metadata.shared <= H100_SHARED, (kernel.__name__, compiled.metadata.shared)


H100_SHARED = 232448  # bytes of shared memory an H100 gives one block at most (227 KiB)


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


def assert_interpreted_ok(script: str, expect: str, timeout: int = 600) -> None:
    """`run_interpreted(script)` exits 0 and prints `expect` (the script's own count of the cases it
    checked); else the assertion shows the ends of its output."""
    r = run_interpreted(script, timeout=timeout)
    assert r.returncode == 0 and expect in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def written_args(kernel, args: tuple, kw: dict) -> list[str]:
    """The tensor arguments torch's Triton mutation analysis (TTIR, what triton_op/wrap_triton
    functionalize with) says one recorded launch writes, analysed for sm_90 without a GPU. When the
    analysis gives up it reports every tensor argument: a kernel must write only its outputs, or
    torch.compile copies the inputs back (and fails on a leaf input that requires grad)."""
    cuda_compiler()
    from torch._higher_order_ops import triton_kernel_wrap as tkw
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Target:  # generate_ttir asks the active driver for the target only
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    kw = {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")}
    kwargs = dict(zip(kernel.arg_names, args), **kw)
    saved = driver._active  # restored as it was (reset_active would create a driver: none without a GPU)
    driver.set_active(Target())
    try:
        if hasattr(tkw, "identify_accessed_tensors"):  # torch >= 2.12
            acc = tkw.identify_accessed_tensors(kernel, kwargs, {})
            return sorted(dep.name for dep in acc.read_writes.writes)
        return sorted(tkw.identify_mutated_tensors(kernel, kwargs, {}))  # torch 2.11
    finally:
        driver._active = saved
