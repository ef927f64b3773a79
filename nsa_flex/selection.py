"""Selection scorer (paper Eq. 8-10): compressed attention probabilities -> block importance ->
top-n blocks per (position, GQA group).

Eq. 8  p_cmp = softmax(q . K_cmp^T) over the compressed blocks visible to the query. We reuse
       the compressed branch's log-sum-exp: p = exp(s - lse), no second softmax pass.
Eq. 9  p_slc[j] = sum_i w[i, j] p_cmp[i], w the overlap of compressed block i and selection
       block j in strides of d (`nsa_flex.rules.map_to_selection_blocks`; a compressed block
       straddling two selection blocks shares its score between them in proportion).
Eq. 10 summed over the heads of each GQA group, so a group shares one selection.
Top-n (`nsa_flex.rules.pick_blocks` on `forced_and_valid`): block 0 (of the query's document)
and the n_local most recent blocks always; ties to the lower index; never a block that starts
after the query; -1 pads rows with fewer valid blocks.

Memory: queries are processed in chunks of `chunk`, so the largest temporary is
[B, H, chunk, num_cmp], never [B, H, T, num_cmp]. The result has no gradient.

Two implementations of `block_scores`, chosen by `cfg.scorer`: the torch code below (the naive
reference: per-head probabilities [B, Hkv, G, chunk, Nc] in memory) and the fused Triton kernel
`nsa_flex.ops.group_slc_scores` (Eq. 8, 10 and 9 in one pass, only [B, Hkv, chunk, Ns] written,
compressed blocks beyond the causal bound never visited). "auto" takes the kernel on CUDA tensors
when triton imports and the compressed branch's lse is given.
"""

import torch
from torch import Tensor

from .ops import HAS_TRITON, group_slc_scores, topn_blocks, triton_interpreted
from .rules import cmp_visible, forced_and_valid, map_to_selection_blocks, pick_blocks


SCORER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_triton_scorer(cfg, q: Tensor, lse: Tensor | None) -> bool:
    """Whether `block_scores` runs the fused Triton kernel (cfg.scorer: auto | torch | triton);
    either scores a sequence shard (context parallelism) as well as a whole sequence."""
    if cfg.scorer == "torch":
        return False
    if cfg.scorer == "auto":  # the kernel accumulates in fp32: not for fp64 inputs
        return HAS_TRITON and lse is not None and q.is_cuda and q.dtype in SCORER_DTYPES
    if not HAS_TRITON or lse is None or not (q.is_cuda or triton_interpreted()):
        why = ("triton is not importable" if not HAS_TRITON else
               "it needs the compressed branch's lse (none given: e.g. the compressed branch is "
               "off or the backend returns no lse)" if lse is None else
               f"it needs CUDA tensors (got {q.device.type}; on CPU only under TRITON_INTERPRET=1)")
        raise RuntimeError(f"NSAConfig.scorer='triton' cannot run here: {why}; "
                           "use scorer='auto' or 'torch'")
    return True


@torch.no_grad()
def block_scores(q: Tensor, k_cmp: Tensor, lse: Tensor | None, cfg, doc_starts: Tensor | None,
                 t0: int, t1: int, q_offset: int = 0, seq_len: int | None = None) -> Tensor:
    """Group importance p_slc [B, Hkv, t1-t0, Ns] of the selection blocks for query rows t0..t1-1.

    q [B, Hq, T, Dk] (after RoPE), k_cmp [B, Hkv, Nc, Dk], lse [B, Hq, T] (natural log) of the
    compressed attention of the same queries. cfg.scorer picks the fused Triton kernel or the
    torch code below (the reference). A sequence shard (context parallelism): row r is position
    r + q_offset of a seq_len-token sequence, doc_starts [B|1, seq_len] are the whole sequence's."""
    B, Hq, T, Dk = q.shape
    Hkv, Nc = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    ns = -(-(seq_len or T) // cfg.l_sel)
    C = t1 - t0
    if Nc == 0:
        return q.new_zeros(B, Hkv, C, ns, dtype=torch.float32)
    if use_triton_scorer(cfg, q, lse):
        return group_slc_scores(q, k_cmp.to(q.dtype), lse, doc_starts, t0, t1, cfg.l, cfg.d,
                                cfg.l_sel, q_offset=q_offset, seq_len=seq_len or T)
    # q.K_cmp in the inputs' dtype (bf16 tensor cores on GPU), fp32 from there on
    qc = q[:, :, t0:t1].reshape(B, Hkv, G, C, Dk)
    s = torch.einsum("bhgtd,bhnd->bhgtn", qc, k_cmp.to(q.dtype)).float() * (Dk ** -0.5)
    p0, p1 = t0 + q_offset, t1 + q_offset  # positions of the rows
    t = torch.arange(p0, p1, device=q.device).view(C, 1)
    i = torch.arange(Nc, device=q.device).view(1, Nc)
    vis = cmp_visible(i, t, cfg.l, cfg.d)  # compressed causal
    if doc_starts is not None:
        vis = vis.unsqueeze(0) & (i * cfg.d >= doc_starts[:, p0:p1].unsqueeze(-1))  # [B, C, Nc]
        vis = vis.view(-1, 1, 1, C, Nc)
    if lse is None:  # backend gave no lse: compute it (same rows, same mask)
        l_ = torch.logsumexp(s.masked_fill(~vis, float("-inf")), dim=-1, keepdim=True)
    else:
        l_ = lse[:, :, t0:t1].float().view(B, Hkv, G, C, 1)
    # rows that see no block have lse = -inf: exp(s - lse) would be inf, masked to 0 here
    p = torch.where(vis, torch.exp(s - torch.where(torch.isfinite(l_), l_, 0.0)), 0.0)
    p = p.sum(2)  # Eq. 10: sum over the heads of each group -> [B, Hkv, C, Nc]
    return map_to_selection_blocks(p, ns, cfg.l, cfg.d, cfg.l_sel)  # Eq. 9


@torch.no_grad()
def select_topn(q: Tensor, k_cmp: Tensor | None, lse: Tensor | None, cfg,
                doc_starts: Tensor | None = None, chunk: int | None = None, q_offset: int = 0,
                seq_len: int | None = None, scores: Tensor | None = None) -> Tensor:
    """Top-n selection block indices [B, Hkv, T, n_sel] (int64, -1 for unused slots). A sequence
    shard (context parallelism): q's row r is position r + q_offset of seq_len tokens, k_cmp the
    whole sequence's compressed keys, doc_starts [B|1, seq_len] the whole sequence's. scores
    [B, Hkv, T, Ns]: block scores from elsewhere (the indexer, `sel_scores = "indexer"`) in place
    of Eq. 8-10's (k_cmp and lse unused), under the same top-n rule."""
    B, Hq, T, _ = q.shape
    S = seq_len or T
    starts = doc_starts if doc_starts is not None else torch.zeros(1, S, dtype=torch.long,
                                                                   device=q.device)
    chunk = chunk or cfg.score_chunk
    if scores is not None:
        out = []
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            valid, forced = forced_and_valid(cfg, S, starts, q.device, t0 + q_offset, t1 + q_offset)
            out.append(pick_blocks(scores[:, :, t0:t1], valid.unsqueeze(1), forced.unsqueeze(1),
                                   cfg.n_sel))
        return torch.cat(out, dim=2)
    Hkv, Nc = k_cmp.shape[1], k_cmp.shape[2]
    fused = use_triton_scorer(cfg, q, lse) and Nc > 0
    if fused:
        # the fused kernel keeps only [B, Hkv, chunk, Ns] fp32: as few chunks as SCORE_BUFFER_MAX
        # allows (each chunk is a scorer and a top-n launch), at most MAX_CHUNKS
        Ns = -(-S // cfg.l_sel)
        n = min(MAX_CHUNKS, max(1, -(-B * Hkv * T * Ns * 4 // SCORE_BUFFER_MAX)))
        chunk = max(chunk, -(-T // n))
    out = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        p = block_scores(q, k_cmp, lse, cfg, doc_starts, t0, t1, q_offset, S)
        if fused:  # the same rule as pick_blocks, without [.., Ns] int64 keys in memory
            out.append(topn_blocks(p, doc_starts, t0 + q_offset, cfg.l_sel, cfg.n_sel, cfg.n_init,
                                   cfg.n_local))
            continue
        valid, forced = forced_and_valid(cfg, S, starts, q.device, t0 + q_offset, t1 + q_offset)
        out.append(pick_blocks(p, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel))
    return torch.cat(out, dim=2)


MAX_CHUNKS = 8  # score chunks of the Triton scorer per call at most (its buffer is one chunk)
# the Triton scorer's chunk buffer at most (bytes) where MAX_CHUNKS allows: one chunk at the 125M
# shape up to 16k, two at 32k
SCORE_BUFFER_MAX = 64 * 2**20


class QuestionPicks:
    """The blocks every selecting layer of ``model`` picks at each row's position ``lengths[b] - 1``
    (a prompt's last position: the question's cue, where the answer's first token is predicted),
    in the first forward of a batch: the layers' ``select_topn`` wrapped while the context is open
    (the training code path). An eager forward: a compiled one traced the unwrapped function."""

    def __init__(self, model, lengths: list[int]):
        self.layers = [m for m in model.modules() if "sel" in getattr(m, "builders", ())]
        self.saved = [a.select_topn for a in self.layers]
        self.lengths = lengths
        self.picks: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, n_sel] int64, CPU

    def __enter__(self):
        for i, att in enumerate(self.layers):
            def wrapped(*a, _orig=att.select_topn, _i=i, **k):
                idx = _orig(*a, **k)  # [B, Hkv, T, n_sel]
                if _i not in self.picks:
                    last = torch.tensor(self.lengths, device=idx.device) - 1
                    self.picks[_i] = idx[torch.arange(idx.shape[0], device=idx.device), :, last].cpu()
                return idx
            att.select_topn = wrapped
        return self

    def __exit__(self, *exc):
        for att, orig in zip(self.layers, self.saved):
            att.select_topn = orig

    def recall(self, b: int, needle: list[int]) -> tuple[float, int, list[float]] | None:
        """(the fraction of (layer, KV group) whose picks at row b's question hold a block of the
        needle's key tokens, whether such a block is forced there: block 0 or a local block, picked
        whatever the scores, and that fraction per selecting layer, in model order: a copy made by
        one layer needs only that layer's picks); None without a selecting layer."""
        if not self.picks or not needle:
            return None
        cfg = self.layers[0].cfg
        blocks = torch.tensor(sorted({p // cfg.l_sel for p in needle}))
        t = self.lengths[b] - 1
        _, forced = forced_and_valid(cfg, t + 1, torch.zeros(1, t + 1, dtype=torch.long), "cpu", t, t + 1)
        hits = torch.stack([torch.isin(self.picks[i][b], blocks).any(-1).float().mean()
                            for i in sorted(self.picks)])
        return float(hits.mean()), int(bool(forced[0, 0, blocks].any())), hits.tolist()
