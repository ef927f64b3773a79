"""The gate's mix op (`nsa_flex.ops.gate_mix`, paper Eq. 5) against its torch math
(`nsa_flex.attention.gate_mix_reference`).

On the CPU the kernels run under Triton's interpreter in a subprocess: output and every gradient
(gates and branch outputs) equal an fp64 reference for 1, 2 and 3 outputs, fp32 and bf16, a head
dim that is not a power of two, T not a multiple of the tile, strided gates (a view of the gate
projection) and strided outputs and output gradients. The kernels compile for an H100 and write
only their outputs. On CUDA (`gpu`): the same comparison at the paper and 125M shapes, also
under torch.compile(fullgraph=True) (the interpreter's kernels cannot be traced).
"""

import pytest
import torch

from nsa_flex.attention import gate_mix_reference, mix_branches
from nsa_flex.ops import HAS_TRITON, triton_interpreted


def rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_mix(B, T, H, Dv, n, dtype, device="cpu", compiled=False, seed=0):
    """Op vs fp64 reference: out, dg, d out_i (a random linear function of the output). The gates
    are a strided view of a [B, T, H*3] projection (as in the layer); the outputs a [B, T, H, Dv]
    buffer seen as [B, H, T, Dv]; the output gradient a transposed buffer."""
    from nsa_flex.ops import gate_mix

    gen = torch.Generator().manual_seed(seed)
    g64 = torch.rand(B, T, H * 3, generator=gen, dtype=torch.float64).view(B, T, H, 3)[..., :n]
    o64 = [torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64).transpose(1, 2)
           for _ in range(n)]
    do64 = torch.randn(H * Dv, B, T, generator=gen, dtype=torch.float64).permute(1, 2, 0)
    ref_in = [x.clone().requires_grad_() for x in (g64, *o64)]
    ref = gate_mix_reference(ref_in[0], ref_in[1:])
    ref.backward(do64)
    g = g64.to(device, dtype).requires_grad_()
    outs = [x.to(device, dtype).requires_grad_() for x in o64]
    fn = torch.compile(gate_mix, fullgraph=True) if compiled else gate_mix
    o = fn(g, outs)
    assert o.shape == (B, T, H * Dv) and o.dtype == dtype
    o.backward(do64.to(device, dtype))
    errs = dict(out=rel(o, ref), dg=rel(g.grad, ref_in[0].grad),
                **{f"d_out{i}": rel(x.grad, r.grad) for i, (x, r) in enumerate(zip(outs, ref_in[1:]))})
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert all(e <= tol for e in errs.values()), (B, T, H, Dv, n, dtype, errs)
    return errs


def _interpreter_main():
    torch.set_num_threads(1)
    assert triton_interpreted(), "run with TRITON_INTERPRET=1"
    n_cases = 0
    for n in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            check_mix(2, 45, 3, 24, n, dtype, seed=n)  # T % 32 != 0, Dv padded to 32
            n_cases += 1
    # a wrong gate column must show: the check is not vacuous
    from nsa_flex.ops import gate_mix

    g = torch.rand(1, 5, 2, 3)
    outs = [torch.randn(1, 2, 5, 8) for _ in range(3)]
    assert rel(gate_mix(g, outs), gate_mix_reference(g.flip(-1), outs)) > 1e-2
    print(f"OK {n_cases} cases")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_op_matches_reference_under_interpreter():
    from tests.ops.triton_harness import assert_interpreted_ok

    assert_interpreted_ok(__file__, "OK 6 cases", timeout=600)


@pytest.mark.skipif(not HAS_TRITON or triton_interpreted(), reason="needs triton, not interpreted")
@pytest.mark.parametrize("dv", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 3])
def test_kernels_compile_for_h100(monkeypatch, dv, dtype, n):
    from tests.ops.triton_harness import Launches, compile_for_h100, cuda_compiler, written_args

    cuda_compiler()
    import nsa_flex.ops.gate_triton as M

    calls = Launches()
    monkeypatch.setattr(M, "wrap_triton", calls.wrap)
    B, T, H = 1, 100, 4
    g = torch.rand(B, T, H, 3, dtype=dtype)[..., :n]
    outs = [torch.randn(B, H, T, dv, dtype=dtype) for _ in range(n)] + [None] * (3 - n)
    o = M.gate_mix_fwd._init_fn(g, *outs)
    M.gate_mix_bwd._init_fn(torch.randn_like(o), g, *outs)
    assert [c[0].__name__ for c in calls] == ["_mix_fwd_kernel", "_mix_bwd_kernel"]
    for c in calls:
        compile_for_h100(*c)
    # torch's mutation analysis sees only the outputs written (else compile copies inputs back)
    assert [written_args(*c) for c in calls] == [["O"], ["DA", "DB", "DC"][:n] + ["DG"]]


def test_routing_and_errors():
    """The reference backend mixes with torch math; the op refuses a gate count that does not
    match the outputs."""
    g = torch.rand(1, 4, 2, 3)
    outs = [torch.randn(1, 2, 4, 8) for _ in range(3)]
    assert torch.equal(mix_branches(g, outs, "reference"), gate_mix_reference(g, outs))
    if HAS_TRITON:
        from nsa_flex.ops import gate_mix

        with pytest.raises(ValueError, match="one gate column each"):
            gate_mix(g[..., :2], outs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 128), (16, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(shape, dtype):
    H, Dv = shape
    for n in (2, 3):
        check_mix(2, 1000, H, Dv, n, dtype, device="cuda")
    check_mix(1, 777, H, Dv, 3, dtype, device="cuda", compiled=True)


if __name__ == "__main__":
    _interpreter_main()
