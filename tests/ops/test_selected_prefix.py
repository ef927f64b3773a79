"""The selected op's output at position t does not depend on anything after t, bit for bit, at the
paper's group (G = 16), where the forward's 64-row q blocks hold four positions and walk the union
of their picks: changing the later positions' q, k, v and selections leaves out and lse of every
position <= t bit-identical (a position's output is fixed by what is at or before it).

What made it depend on them (issue 43): a q block lists a kv block as partial (masked) or full
(every position of the block sees all its keys), and the forward walked the partial list, then
the full one. A later position that drops a block its neighbours picked turns it from full to
partial, so position t added its own blocks in another order (fp32 rounding). The forward now
walks both lists as one increasing list: a row adds its blocks in the order of its own selection,
and a block it does not see is an exact no-op (p = 0, running max and sum unchanged).

On the CPU under Triton's interpreter in a subprocess (fp32, small T): a hand-made case where
block 1 turns from full to partial for the q block of t, and a random one. On CUDA (`gpu`): the
paper shape in fp32 and bf16 on random selections.
"""

import random

import pytest
import torch

from masks import MaskContext, get_mask_builder
from nsa_flex.config import NSAConfig
from nsa_flex.ops import DEFAULT_TUNING, HAS_TRITON, triton_interpreted
from nsa_flex.ops.selected_tuning import tile_positions
from nsa_flex.rules import random_topn
from tests.ops.test_selected_triton import op_plan


def nested_selection(T: int, Hkv: int, l_sel: int, n_sel: int, t0: int,
                     drop: bool) -> torch.Tensor:
    """[1, Hkv, T, n_sel]: every position picks blocks 0 .. its own (at most n_sel); with drop, the
    positions after t0 leave out block 1 (for t0's q block: full before, partial after)."""
    sel = torch.full((1, 1, T, n_sel), -1, dtype=torch.int32)
    for t in range(T):
        picks = [j for j in range(min(t // l_sel + 1, n_sel)) if not (drop and t > t0 and j == 1)]
        sel[0, 0, t, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
    return sel.expand(1, Hkv, T, n_sel)


def run_op(cfg: NSAConfig, inputs, idx, device, dtype):
    """(out, lse) of the op on fp32 inputs (q, k, v) cast to dtype, selections idx."""
    T = idx.shape[2]
    idx = idx.to(device)
    ctx = MaskContext(cfg, 1, T, torch.device(device), topn=lambda: idx)
    return op_plan().attend(*(a.to(device, dtype) for a in inputs), get_mask_builder("topn")(ctx))


def check_prefix(cfg: NSAConfig, T: int, t0s, device="cpu", dtype=torch.float32, seed=0,
                 kind="nested"):
    """For each t0: out and lse at positions <= t0 bit-identical when q, k, v and the selections
    after t0 are replaced (kind: "nested" selections, or a second `random_topn` draw)."""
    G, Hkv = cfg.n_heads // cfg.n_kv_heads, cfg.n_kv_heads
    assert tile_positions(G, DEFAULT_TUNING.fwd_rows(G)) == 4  # the forward's union of 4 positions
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(1, h, T, d, generator=gen)
         for h, d in ((G * Hkv, cfg.d_qk), (Hkv, cfg.d_qk), (Hkv, cfg.d_v))]
    starts = torch.zeros(1, T, dtype=torch.long)
    if kind == "nested":
        sel = nested_selection(T, Hkv, cfg.l_sel, cfg.n_sel, 0, False)
    else:
        sel = random_topn(cfg, 1, T, starts, 2 * seed, "cpu")
    o, lse = run_op(cfg, x, sel, device, dtype)
    for t0 in t0s:
        y = [a.clone() for a in x]
        for a in y:
            a[:, :, t0 + 1:] = torch.randn(a[:, :, t0 + 1:].shape, generator=gen)
        if kind == "nested":
            sel2 = nested_selection(T, Hkv, cfg.l_sel, cfg.n_sel, t0, True)
        else:
            sel2 = random_topn(cfg, 1, T, starts, 2 * seed + 1, "cpu")
            sel2[:, :, : t0 + 1] = sel[:, :, : t0 + 1]
        o2, lse2 = run_op(cfg, y, sel2, device, dtype)
        assert torch.equal(o[:, :, : t0 + 1], o2[:, :, : t0 + 1]), \
            (kind, t0, (o[:, :, : t0 + 1] - o2[:, :, : t0 + 1]).abs().max().item())
        assert torch.equal(lse[:, :, : t0 + 1], lse2[:, :, : t0 + 1]), (kind, t0)


def small_cfg(n_sel: int) -> NSAConfig:
    return NSAConfig(dim=16, n_heads=16, n_kv_heads=1, d_qk=16, d_v=16, l=8, d=4, l_sel=16,
                     n_sel=n_sel, n_local=1, n_init=1, window=32)


def _interpreter_main():
    torch.set_num_threads(1)
    assert triton_interpreted(), "run with TRITON_INTERPRET=1"
    # q block of positions 40..43: blocks 0, 1 full, block 2 partial; after t0 block 1 dropped
    check_prefix(small_cfg(3), 48, (40, 42), kind="nested")
    # q block of 52..55: one free pick each among blocks 1, 2 (0 and the own block are forced)
    check_prefix(small_cfg(3), 64, (52,), kind="random")
    print("OK prefix")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_prefix_bit_identical_under_interpreter():
    from tests.ops.triton_harness import assert_interpreted_ok

    assert_interpreted_ok(__file__, "OK prefix", timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_prefix_bit_identical_paper_shape(dtype):
    """The paper's layer shape (G = 16, 4 KV heads, d_k 192, d_v 128, l' 64, 16 picks) at T 2048:
    t0 at each place in a q block of four positions, and the nested case."""
    cfg = NSAConfig(dim=16, n_heads=64, n_kv_heads=4, d_qk=192, d_v=128, l=32, d=16, l_sel=64,
                    n_sel=16, n_local=2, n_init=1, window=512)
    check_prefix(cfg, 2048, (1024, 1025, 1026, 1027, 1500), "cuda", dtype, kind="random")
    check_prefix(cfg, 256, (192, 193, 194), "cuda", dtype, kind="nested")


if __name__ == "__main__":
    _interpreter_main()
