"""Each Triton form of a paper rule (`nsa_flex.ops.rules_triton`) equals its torch rule
(`nsa_flex.rules`) on every input of a small grid, under the Triton interpreter (TRITON_INTERPRET=1
must be set before triton decorates the helpers: a fresh subprocess runs `_worker`)."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
triton = pytest.importorskip("triton")
tl = triton.language

from nsa_flex.ops.rules_triton import block_keys, cmp_visible, key_block, overlap_weight  # noqa: E402


@triton.jit
def visible_kernel(I, T, OUT, N, L: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    ok = o < N
    i = tl.load(I + o, mask=ok)
    t = tl.load(T + o, mask=ok)
    tl.store(OUT + o, cmp_visible(i, t, L, D).to(tl.int32), mask=ok)


@triton.jit
def overlap_kernel(OUT, LO, N, R: tl.constexpr, QN: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(OUT + o, overlap_weight(LO + o, R, QN), mask=o < N)


@triton.jit
def keys_kernel(S, OUT, BLK, pos, start, NS, LS: tl.constexpr, N_LOCAL: tl.constexpr,
                N_INIT: tl.constexpr, BLOCK: tl.constexpr):
    jj = tl.arange(0, BLOCK).to(tl.int64)
    score = tl.load(S + jj, mask=jj < NS, other=0.0)
    key = block_keys(jj, score, pos, start, NS, LS, N_LOCAL, N_INIT)
    tl.store(OUT + jj, key)
    tl.store(BLK + jj, key_block(key, NS))


def _worker() -> dict:
    from nsa_flex import rules

    out = {}
    # cmp_visible: every (i, t) of a grid, several (l, d)
    bad = 0
    for l, d in ((4, 2), (8, 4), (32, 16), (6, 3)):
        i, t = torch.meshgrid(torch.arange(12), torch.arange(40), indexing="ij")
        i, t = i.reshape(-1).contiguous(), t.reshape(-1).contiguous()
        got = torch.empty_like(i, dtype=torch.int32)
        visible_kernel[(1,)](i, t, got, i.numel(), L=l, D=d, BLOCK=triton.next_power_of_2(i.numel()))
        bad += int((got.bool() != rules.cmp_visible(i, t, l, d)).sum())
    out["cmp_visible_mismatches"] = bad
    # overlap_weight: the positive part over m in [-(QN-1), R-1] is rules.overlap_kernel
    bad = 0
    for l, d, ls in ((32, 16, 64), (8, 4, 16), (8, 2, 4), (12, 4, 8)):
        r, qn = ls // d, l // d
        ref = rules.overlap_kernel(l, d, ls)
        got = torch.empty(ref.numel(), dtype=torch.int32)
        overlap_kernel[(1,)](got, -(qn - 1), ref.numel(), R=r, QN=qn, BLOCK=64)
        bad += int((got.float() != ref).sum())
        outside = torch.empty(8, dtype=torch.int32)  # offsets past either end weigh nothing
        overlap_kernel[(1,)](outside, r, 8, R=r, QN=qn, BLOCK=8)
        bad += int((outside > 0).sum())
    out["overlap_mismatches"] = bad
    # block_keys + key_block: n picks by max-reduction equal pick_blocks on random scores
    gen = torch.Generator().manual_seed(0)
    bad, cases = 0, 0
    for ns, ls, n_init, n_local, n in ((10, 4, 1, 2, 4), (7, 8, 0, 1, 3), (16, 4, 1, 0, 5),
                                       (5, 4, 1, 2, 8)):
        for pos in range(0, ns * ls, 3):
            for start in sorted({0, pos // 2, pos}):
                scores = torch.rand(ns, generator=gen)
                scores[torch.randint(0, ns, (2,), generator=gen)] = 0.5  # ties
                keys = torch.empty(16, dtype=torch.int64)
                blks = torch.empty(16, dtype=torch.int64)
                keys_kernel[(1,)](scores, keys, blks, pos, start, ns, LS=ls, N_LOCAL=n_local,
                                  N_INIT=n_init, BLOCK=16)
                order = torch.sort(keys, descending=True).values[:n]
                picked = [int(ns - 1 - (k & 0xFFFFFFFF)) if k >= 0 else -1 for k in order.tolist()]
                picked_tr = [int(blks[(keys == k).nonzero()[0, 0]]) for k in order.tolist()]
                valid, forced = rules.block_rules(torch.tensor([[pos]]), torch.tensor([[start]]),
                                                  ns, ls, n_init, n_local)
                ref = rules.pick_blocks(scores.view(1, ns), valid, forced, n).view(-1).tolist()
                bad += (picked_tr != ref) + (picked != ref)
                cases += 1
    out["topn_mismatches"], out["topn_cases"] = bad, cases
    return out


@pytest.mark.slow
def test_triton_rules_equal_torch_rules():
    from tests.ops.triton_harness import run_interpreted

    p = run_interpreted(__file__, "--worker", timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["topn_cases"] > 100, r
    assert r == {**r, "cmp_visible_mismatches": 0, "overlap_mismatches": 0, "topn_mismatches": 0}


def test_cmp_visible_is_the_end_of_the_block():
    from nsa_flex.rules import cmp_visible, num_cmp

    t = torch.arange(50).view(-1, 1)
    i = torch.arange(20).view(1, -1)
    # token t sees exactly the blocks counted by num_cmp(t + 1): the first num_cmp(t + 1) ones
    assert torch.equal(cmp_visible(i, t, 8, 4).sum(-1), num_cmp(t.view(-1) + 1, 8, 4))
    assert cmp_visible(0, 7, 8, 4) and not cmp_visible(0, 6, 8, 4) and not cmp_visible(1, 10, 8, 4)


if __name__ == "__main__" and "--worker" in sys.argv:
    print(json.dumps(_worker()))
