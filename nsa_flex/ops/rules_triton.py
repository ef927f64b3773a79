"""The rules of `nsa_flex.rules` that the Triton kernels apply, as `triton.jit` helpers (inlined
where they are called). Each names its torch rule; tests/ops/test_rules_triton.py checks them
against it under the Triton interpreter."""

import triton
import triton.language as tl


@triton.jit
def cmp_visible(i, t, L, D):
    """`rules.cmp_visible`: compressed block i (tokens [i D, i D + L)) has ended by token t."""
    return i * D + L - 1 <= t


@triton.jit
def overlap_weight(m, R, QN):
    """`rules.overlap_kernel`'s c[m] (Eq. 9): |[m, m + QN) ∩ [0, R)| in strides of d, for the
    offset m = i - j R of compressed block i from selection block j (<= 0 outside the kernel)."""
    return tl.minimum(m + QN, R) - tl.maximum(m, 0)


@triton.jit
def block_keys(jj, score, pos, start, NS, LS: tl.constexpr, N_LOCAL: tl.constexpr,
               N_INIT: tl.constexpr):
    """One int64 top-n key per selection block jj, the keys of `rules.pick_blocks` (pos / start
    broadcast against jj): score bits << 32 | reversed block index (ties to the lower block);
    forced blocks (the document's first block when N_INIT, the N_LOCAL most recent) get +inf
    score bits, blocks without a visible token -1, padding (jj >= NS) -(1 << 62), below every
    real key."""
    valid = (jj < NS) & (jj * LS <= pos) & ((jj + 1) * LS - 1 >= start)
    cur = pos // LS
    if N_LOCAL > 0:
        forced = (jj > cur - N_LOCAL) & (jj <= cur)
    else:
        forced = jj < 0
    if N_INIT > 0:
        forced = forced | (jj == start // LS)
    forced = forced & valid
    bits = tl.maximum(score, 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    bits = tl.where(forced, 2139095040, bits)  # 0x7F800000 (+inf): forced blocks first
    bits = tl.where(valid, bits, -1)
    key = bits * 4294967296 + (NS - 1 - jj).to(tl.int64)
    return tl.where(jj < NS, key, -4611686018427387904)


@triton.jit
def key_block(key, NS):
    """The block of a `block_keys` key, -1 for a key below every valid block's (`pick_blocks`'
    -1 pads)."""
    return tl.where(key < 0, -1, NS - 1 - (key & 4294967295))
