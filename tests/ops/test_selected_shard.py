"""The selected-attention op on a sequence shard (context parallelism, issue 42): q of Tq rows at
positions q0 .. q0 + Tq - 1 against the whole sequence's T keys, the selection's rows the shard's
(block ids global). Under Triton's interpreter (a subprocess, as tests/ops/test_selected_triton.py)
the shard's out, lse, dQ equal the whole sequence's rows q0 .. q0 + Tq - 1 of the op and of the
dense reference, and its dK, dV (over all T keys, 0 where no row of the shard reads) equal the
whole sequence's gradients of those rows alone; offsets 0 (rank 0: fewer queries than keys), one
inside a q block and at a block boundary, with documents crossing q0. On CUDA (`gpu`): bf16 at the
125M shape against flex on the same shard.
"""

import random

import pytest
import torch

from masks import MaskContext, at_offset, get_mask_builder
from masks.builders import doc_start
from nsa_flex.attention import attend_flex, attend_reference
from nsa_flex.config import NSAConfig
from nsa_flex.ops import HAS_TRITON, triton_interpreted
from nsa_flex.rules import random_topn
from tests.ops.test_selected_triton import op_plan, rel


def shard_case(seed: int, q0: int, Tq: int, T: int, shape=(4, 2, 32, 16), l_sel=16, docs=True,
               device="cpu"):
    """(cfg, B, whole spec, the shard's spec): random picks of a T-token sequence, documents cut
    around q0 (one starts before the shard and runs into it)."""
    rng = random.Random(seed)
    G, Hkv, dk, dv = shape
    B = 2
    cfg = NSAConfig(dim=16, n_heads=G * Hkv, n_kv_heads=Hkv, d_qk=dk, d_v=dv, l=l_sel // 2,
                    d=l_sel // 4, l_sel=l_sel, n_sel=4, n_local=1, n_init=1, window=32)
    doc_ids = None
    if docs:
        cuts = sorted({max(1, q0 - rng.randint(1, l_sel)), q0 + rng.randint(1, Tq - 1)})
        doc_ids = torch.tensor([[sum(c <= t for c in cuts) for t in range(T)]] * B, device=device)
    starts = doc_start(doc_ids) if doc_ids is not None else torch.zeros(1, T, dtype=torch.long,
                                                                       device=device)
    idx = random_topn(cfg, B, T, starts, seed, device)
    dev = torch.device(device)
    whole = get_mask_builder("topn")(MaskContext(cfg, B, T, dev, doc_ids=doc_ids,
                                                 topn=lambda: idx))
    ctx = MaskContext(cfg, B, T, dev, doc_ids=doc_ids, topn=lambda: idx[:, :, q0:q0 + Tq],
                      q_offset=q0, q_len=Tq)
    return cfg, B, whole, at_offset(get_mask_builder("topn")(ctx), q0)


def check_shard(seed: int, q0: int, Tq: int, T: int, **kw):
    """Shard vs whole sequence (op and fp64 reference) in fp32: out, lse and every gradient of a
    random linear function of the shard's out and lse."""
    cfg, B, whole, shard = shard_case(seed, q0, Tq, T, **kw)
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(B, h, T, d, generator=gen) for h, d in
         ((cfg.n_heads, cfg.d_qk), (cfg.n_kv_heads, cfg.d_qk), (cfg.n_kv_heads, cfg.d_v))]
    rows = slice(q0, q0 + Tq)
    do = torch.randn(B, cfg.n_heads, Tq, cfg.d_v, generator=gen)
    dl = torch.randn(B, cfg.n_heads, Tq, generator=gen)

    def run(attend, q, k, v, spec, r=slice(None)):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = attend(q, k, v, spec)
        o, lse = o[:, :, r], lse[:, :, r]
        fin = torch.isfinite(lse)
        ((o * do.to(o.dtype)).sum() + (torch.where(fin, lse, 0.0) * dl.to(lse.dtype)).sum()
         ).backward()
        return dict(out=o.detach(), lse=lse.detach(), dq=q.grad[:, :, r], dk=k.grad, dv=v.grad)

    op = op_plan().attend
    got = run(op, x[0][:, :, rows], x[1], x[2], shard)
    want_op = run(op, *x, whole, rows)
    want_ref = run(attend_reference, *(t.double() for t in x), whole, rows)
    errs = {n: (rel(got[n], want_op[n]), rel(got[n], want_ref[n])) for n in got}
    assert all(max(e) <= 2e-5 for e in errs.values()), (seed, q0, Tq, T, errs)
    keys = q0 + Tq  # no key after the shard's last position is read
    assert not got["dk"][:, :, keys:].any() and not got["dv"][:, :, keys:].any()
    return errs


def _interpreter_main():
    torch.set_num_threads(1)
    assert triton_interpreted(), "run with TRITON_INTERPRET=1"
    n = 0
    # (seed, q0, Tq, T): rank 0 of 2 and of 3, inside a q block (G = 4: 4 positions a block), at
    # a selection-block boundary, the last shard, a shard ending before the keys' end
    for seed, q0, Tq, T in ((0, 0, 32, 64), (1, 32, 32, 64), (2, 21, 24, 64), (3, 48, 32, 80),
                            (4, 16, 16, 96)):
        check_shard(seed, q0, Tq, T)
        n += 1
    check_shard(5, 37, 27, 64, docs=False)  # no band: the kernels' own causal bound
    check_shard(6, 35, 29, 64, shape=(16, 1, 48, 32))  # the paper's group: dQ kernel, d_k split
    n += 2
    print(f"OK {n} shards")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_shard_matches_whole_sequence_under_interpreter():
    from tests.ops.triton_harness import assert_interpreted_ok

    assert_interpreted_ok(__file__, "OK 7 shards", timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("q0", [0, 512, 520])
def test_cuda_shard_bf16_matches_flex(q0):
    """The op on a shard in bf16 at the 125M head shape (G = 8, d 64) against flex on the same
    shard, forward and gradients."""
    Tq, T = 512, 1536
    cfg, B, _, shard = shard_case(q0 + 1, q0, Tq, T, shape=(8, 2, 64, 64), l_sel=64,
                                  device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(q0)
    shapes = ((B, cfg.n_heads, Tq, 64), (B, 2, T, 64), (B, 2, T, 64))
    x = [torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in shapes]
    do = torch.randn(B, cfg.n_heads, Tq, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    res = []
    for attend in (op_plan().attend, attend_flex):
        inp = [t.clone().requires_grad_() for t in x]
        o, _ = attend(*inp, shard)
        (o * do).sum().backward()
        res.append([o.detach()] + [t.grad for t in inp])
    errs = [rel(a, b) for a, b in zip(*res)]
    assert max(errs) <= 2e-2, errs


if __name__ == "__main__":
    _interpreter_main()
