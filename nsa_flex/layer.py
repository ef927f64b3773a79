"""NSAAttention: the drop-in attention layer.

x -> projections (shared q; own k/v per branch) -> RoPE -> compress -> score -> masks
  -> three attention calls (compressed, selected, window) -> per-head sigmoid gate -> out
The projections are methods (`project_q`, `project_kv`) so decode projects one token the same way.
What does not depend on the layer (RoPE's cos / sin, the documents, the compressed and window
masks) is a `StepMasks`: a model builds it once a forward for all its layers (`step_masks`), a
layer called alone builds its own.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from masks import MaskContext, MaskSpec, at_offset, builder_info, doc_start

from .attention import FLEX_BLOCK, BranchPlan, mix_branches, plan_branch
from .compression import PHI
from .config import RECOMPUTED, NSAConfig, resolve_backend
from .context_parallel import NO_SHARD, SeqShard, gather_seq, gather_seq_nograd, with_halo
from .distill import attach_loss, block_kl, distill_kl, selected_target
from .indexer import BlockIndexer
from .kernel_options import install_flex_patches
from .ops import DEFAULT_TUNING, SelectedTuning
from .rope import apply_rope, rope_cos_sin
from .rules import BRANCHES, all_blocks, random_draw_step
from .selection import select_topn
from .telemetry import STATS_SIZE, layer_stats


def check_inputs(x: Tensor, doc_ids: Tensor | None, dim: int, shards: int = 1) -> None:
    """One ValueError for a bad layer input: x [B, T, dim] with B, T >= 1; doc_ids [B, T * shards]
    (the whole sequence's when x is one of `shards` shards) of integers, non-decreasing along T
    (checked in eager mode only: a value check would sync and break a compiled graph)."""
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"NSAAttention: x must be [batch, seq_len, dim={dim}], got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"NSAAttention: x has an empty batch or sequence (shape {tuple(x.shape)}): "
                         "batch and seq_len must be >= 1")
    if doc_ids is None:
        return
    want = (x.shape[0], x.shape[1] * shards)
    if tuple(doc_ids.shape) != want or doc_ids.is_floating_point() or doc_ids.is_complex():
        whole = " (the whole sequence's: x is one of the shards)" if shards > 1 else ""
        raise ValueError(f"NSAAttention: doc_ids must be integers of shape [batch, seq_len] = "
                         f"{want}{whole}, got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    if not torch.compiler.is_compiling() and doc_ids.shape[1] > 1:
        down = doc_ids[:, 1:] < doc_ids[:, :-1]
        if bool(down.any()):
            b, t = (int(i) for i in down.nonzero()[0])
            raise ValueError(f"NSAAttention: doc_ids must be non-decreasing along the sequence (packed "
                             f"documents in order); row {b} goes from {int(doc_ids[b, t])} at position {t} "
                             f"to {int(doc_ids[b, t + 1])} at position {t + 1}")


# the scorer's compressed keys and lse (Eq. 8) come from this mask where the compressed branch is off
SCORER_MASK = "compressed_causal"


def branch_builders(cfg: NSAConfig) -> dict[str, str]:
    """The mask builder each branch runs: the config's (`NSAConfig.branch_masks`), and the scorer's
    compressed-causal mask for a compressed branch that is off where the selection builder scores
    (`masks.builder_info(...).scores`). Branches that run nothing are left out."""
    names = cfg.branch_masks()
    out = {b: n for b, n in names.items() if n != "none"}
    if "cmp" not in out and builder_info(names["sel"]).scores:
        out["cmp"] = SCORER_MASK
    return {b: out[b] for b in BRANCHES if b in out}


def branch_runners(cfg: NSAConfig, sel_tuning: SelectedTuning = DEFAULT_TUNING
                   ) -> tuple[dict[str, Callable], dict[str, BranchPlan]]:
    """The mask builder function and the executor plan of every branch that runs
    (`branch_builders`): what a layer holds, and what a model builds its `StepMasks` with."""
    run = branch_builders(cfg)
    return ({b: builder_info(n).fn for b, n in run.items()},
            {b: plan_branch(cfg, n, sel_tuning) for b, n in run.items()})


def shares_mask(branch: str, builder: str) -> bool:
    """Whether a branch's mask is the same in every layer of a step: not the selection (its
    top-n reads the layer's own scores), and a builder that reads neither the scores nor the
    step's random draw (`masks.builder_info`): its mask is a function of the config, the shape
    and the documents alone."""
    info = builder_info(builder)
    return branch != "sel" and not (info.scores or info.step)


def window_halo(cfg: NSAConfig, shard: SeqShard, local_len: int) -> int | None:
    """Keys before its shard the window branch reads where a halo suffices (context parallelism):
    window - 1 for the `sliding_window` builder when the previous rank holds them all; None
    (all-gather the sequence): no shard, another builder (it may read any key), or a window
    longer than a shard."""
    h = cfg.window - 1
    if not shard.sharded or cfg.branch_masks()["win"] != "sliding_window" or h > local_len:
        return None
    return h


def branch_mask(b: str, build: Callable, ctx: MaskContext, halo: int | None) -> tuple[MaskSpec, int]:
    """Branch b's mask for the queries of `ctx` (at its q_offset) and the length of the keys it
    reads: the compressed keys of the whole sequence, its keys, or for a window with a halo the
    keys from `base` = q_offset - halo on (the mask sees positions from there: a window's mask
    depends on differences of positions)."""
    q0, Tq, T = ctx.q_offset, ctx.q_len or ctx.seq_len, ctx.seq_len
    if b == "win" and halo is not None:
        base = max(0, q0 - halo)
        wctx = ctx if base == 0 else MaskContext(
            ctx.cfg, ctx.batch, q0 + Tq - base, ctx.device, q_offset=q0 - base, q_len=Tq,
            doc_ids=None if ctx.doc_ids is None else ctx.doc_ids[:, base:q0 + Tq])
        return at_offset(build(wctx), q0 - base), q0 + Tq - base
    return at_offset(build(ctx), q0), ctx.cfg.num_cmp(T) if b == "cmp" else T


@dataclass(frozen=True)
class StepMasks:
    """What the NSA layers of one forward share (`step_masks`). cos, sin: RoPE's [T, d_qk] in
    fp32 at the queries' positions (`apply_rope` casts them to q's dtype, the cast a layer's own
    did); doc_ids [B, T] and starts (each position's document start, `masks.doc_start`) of the
    whole sequence, None without documents; specs: branch -> mask of the branches `shares_mask`
    names, with the BlockMask their flex call reads built (`BranchPlan.prebuild`), and "dense":
    the dense causal mask the indexer and the distillation read, where they run; kv_lens: the
    length of the keys each reads; shard: the queries' sequence shard (context parallelism),
    halo: `window_halo`.
    Bit-identical to a layer's own: the same ops, run once."""
    cos: Tensor
    sin: Tensor
    doc_ids: Tensor | None
    starts: Tensor | None
    specs: dict[str, MaskSpec]
    kv_lens: dict[str, int]
    # no defaults: a layer builds its own in its (compiled) forward, and torch 2.11's dynamo
    # binds a dataclass __init__'s defaults even when passed, failing on a SeqShard one
    shard: SeqShard
    halo: int | None


def step_masks(cfg: NSAConfig, builders: dict[str, Callable], plans: dict[str, BranchPlan],
               B: int, T: int, device, doc_ids: Tensor | None = None,
               shard: SeqShard = NO_SHARD) -> StepMasks:
    """The `StepMasks` of a step of B sequences of T query tokens (this rank's shard of T *
    shard.size under context parallelism; doc_ids [B, T * shard.size] or None), for layers of
    config `cfg` whose branches run `builders` and `plans` (`branch_runners`)."""
    q0, whole = shard.offset(T), T * shard.size
    cos, sin = rope_cos_sin(torch.arange(q0, q0 + T, device=device), cfg.d_qk, cfg.rope_theta)
    starts = None if doc_ids is None else doc_start(doc_ids.long())
    ctx = MaskContext(cfg, B, whole, device, doc_ids=doc_ids, starts=starts, q_offset=q0, q_len=T)
    halo = window_halo(cfg, shard, T)
    names, specs, kv_lens = branch_builders(cfg), {}, {}
    for b, build in builders.items():
        if shares_mask(b, names[b]):
            spec, kv_lens[b] = branch_mask(b, build, ctx, halo)
            specs[b] = spec if spec is None else plans[b].prebuild(spec, B, T, kv_lens[b], device,
                                                                  doc_ids is not None)
    if (cfg.sel_scores == "indexer" or cfg.sel_distill > 0) and not shard.sharded:
        # the dense causal mask the indexer and the selection's teacher read (nsa_flex.distill)
        dense = builder_info("causal").fn(ctx)
        if resolve_backend(cfg.backend, device) == "flex":  # the BlockMask attend_flex reads
            dense = dense.with_block_mask(B, T, T, device, FLEX_BLOCK)
        specs["dense"], kv_lens["dense"] = dense, T
    return StepMasks(cos, sin, doc_ids, starts, specs, kv_lens, shard, halo)


class NSAAttention(nn.Module):
    """The NSA layer. Each branch's executor is chosen here, once (`plans`: branch ->
    `nsa_flex.attention.BranchPlan`); sel_tuning: the selected op's settings (benchmarks and
    tuning sweeps pass their own)."""

    def __init__(self, cfg: NSAConfig, sel_tuning: SelectedTuning = DEFAULT_TUNING):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        if cfg.backend != "reference":  # flex runs inside the compiled forward: install it now
            install_flex_patches()
        H, Hkv, dk, dv, dim = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v, cfg.dim
        self.wq = nn.Linear(dim, H * dk, bias=False)
        # paper §3.3.3: independent keys and values for each branch
        self.wk = nn.ModuleDict({b: nn.Linear(dim, Hkv * dk, bias=False) for b in BRANCHES})
        self.wv = nn.ModuleDict({b: nn.Linear(dim, Hkv * dv, bias=False) for b in BRANCHES})
        self.phi_k = PHI[cfg.phi](cfg.l, cfg.d, dk)
        self.phi_v = PHI[cfg.phi](cfg.l, cfg.d, dv)
        self.gate = nn.Linear(dim, 3 * H, bias=True)  # paper Eq. 5: g = sigmoid(MLP(x))
        # optional (not in the paper): block scores from per-token keys of their own
        self.indexer = BlockIndexer(cfg) if cfg.sel_scores == "indexer" else None
        self.wo = nn.Linear(H * dv, dim, bias=False)
        self.branch_names = cfg.branch_masks()
        self.builders, self.plans = branch_runners(cfg, sel_tuning)
        self.draws = builder_info(self.branch_names["sel"]).step  # the selection reads ctx.step
        # the top-n selection (Eq. 8-11, nsa_flex.selection): an instance attribute, so a probe
        # can wrap it for one layer (experiments/retrieval_probe.py records and overrides picks)
        self.select_topn = select_topn
        # the dense warm-up (NSAConfig.sel_dense_steps): while set, a training forward selects every
        # earlier block; the trainer sets it per step (`set_dense_selection`)
        self.dense_selection = False
        # telemetry (nsa_flex/telemetry.py): set before the first (compiled) call; when on, every
        # forward writes its gate / mask statistics into this buffer (no state dict, no grad)
        self.telemetry = False
        # context parallelism (nsa_flex.context_parallel): this rank's shard of the sequence for
        # a forward that builds its own masks (`set_seq_shard` sets it; a model's StepMasks carry
        # their shard)
        self.shard = NO_SHARD
        self.register_buffer("telemetry_stats", torch.zeros(STATS_SIZE), persistent=False)

    # ------------------------------------------------------------------ init
    def init_weights(self, init_std: float = 0.02):
        for lin in [self.wq, *self.wk.values(), *self.wv.values()]:
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)  # gates start at 0.5 each
        self.phi_k.init_weights(init_std)
        self.phi_v.init_weights(init_std)
        if self.indexer is not None:
            self.indexer.init_weights()
        self.telemetry_stats.zero_()

    def reset_parameters(self):
        self.init_weights()

    # ------------------------------------------------------------------ projections
    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, T, dim] -> q [B, H, T, d_qk] with RoPE (cos, sin broadcastable to it)."""
        B, T, _ = x.shape
        # contiguous: every branch reads (and saves for its backward) this one tensor; the
        # selected op would otherwise keep a contiguous copy beside flex's strided view
        q = self.wq(x).view(B, T, self.cfg.n_heads, -1).transpose(1, 2)
        return apply_rope(q, cos, sin).contiguous()

    def project_kv(self, x: Tensor, branch: str, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, dim] -> the branch's own k [B, Hkv, T, d_qk] (with RoPE; keys are rotated
        before compression) and v [B, Hkv, T, d_v] (paper §3.3.3)."""
        B, T, _ = x.shape
        Hkv = self.cfg.n_kv_heads
        k = self.wk[branch](x).view(B, T, Hkv, -1).transpose(1, 2)
        v = self.wv[branch](x).view(B, T, Hkv, -1).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def read_kv(self, x: Tensor, branch: str, cos: Tensor, sin: Tensor, shard: SeqShard,
                halo: int | None = None) -> tuple[Tensor, Tensor]:
        """The branch's k, v over the keys it reads: this shard's projections, all-gathered along
        the sequence (`nsa_flex.context_parallel.gather_seq`; no shard: as they are), or with
        `halo` = h only the previous rank's last h keys before them (`with_halo`). Compression
        runs after the gather: a compressed block straddles shards."""
        k, v = self.project_kv(x, branch, cos, sin)
        if halo is None:
            return gather_seq(k, shard, 2), gather_seq(v, shard, 2)
        return with_halo(k, shard, halo, 2), with_halo(v, shard, halo, 2)

    def branch(self, b: str, spec, x: Tensor, q: Tensor, cos: Tensor, sin: Tensor, docs: bool,
               shard: SeqShard = NO_SHARD, halo: int | None = None):
        """One branch's attention: its own keys and values (compressed by phi for "cmp"), then
        its planned executor (`self.plans[b]`; docs: the step has documents) -> (out, lse, k). A
        branch named by `cfg.recompute` runs under activation checkpointing: its backward
        rebuilds k, v and out from x and q (kept anyway; with a shard it gathers them again).
        shard, halo: the keys it reads (`read_kv`)."""
        def run(x, q):
            k, v = self.read_kv(x, b, cos, sin, shard, halo)
            if b == "cmp":
                k, v = self.phi_k(k), self.phi_v(v)
            o, lse = self.plans[b].attend(q, k, v, spec, docs)
            return o, lse, k

        if b in RECOMPUTED[self.cfg.recompute] and torch.is_grad_enabled():
            # nothing random inside a branch (a random selection is drawn before): no RNG state
            return checkpoint(run, x, q, use_reentrant=False, preserve_rng_state=False)
        return run(x, q)

    # ------------------------------------------------------------------ forward
    def step_masks(self, B: int, T: int, device, doc_ids: Tensor | None = None,
                   shard: SeqShard = NO_SHARD) -> StepMasks:
        """This layer's `StepMasks` for a step (`step_masks` with its own builders and plans)."""
        return step_masks(self.cfg, self.builders, self.plans, B, T, device, doc_ids, shard)

    def forward(self, x: Tensor, doc_ids: Tensor | None = None,
                masks: StepMasks | None = None) -> Tensor:
        """x [B, T, dim] -> [B, T, dim]; doc_ids [B, T] (optional): document ids, non-decreasing
        along T (packed documents attend only within themselves). masks: what the layers of a
        forward share, built once by the model (`step_masks`, holding the step's doc_ids and
        sequence shard: pass doc_ids or masks); None: the layer builds its own, for its shard
        (`self.shard`). Under context parallelism (`nsa_flex.context_parallel`) x holds positions
        q0 .. q0 + T - 1 of a sequence of T * shard.size tokens, doc_ids are the whole sequence's."""
        if masks is None:
            check_inputs(x, doc_ids, self.cfg.dim, self.shard.size)
            masks = self.step_masks(x.shape[0], x.shape[1], x.device, doc_ids, self.shard)
        else:
            check_inputs(x, masks.doc_ids, self.cfg.dim, masks.shard.size)
            if doc_ids is not None or masks.cos.shape[0] != x.shape[1]:
                raise ValueError(f"NSAAttention: masks for T={masks.cos.shape[0]} with x of "
                                 f"T={x.shape[1]}, or doc_ids passed beside masks (they hold the "
                                 "step's doc_ids)")
        B, Tq, _ = x.shape
        cfg, names, shard, halo = self.cfg, self.branch_names, masks.shard, masks.halo
        distilling = cfg.sel_distill > 0 and self.training and torch.is_grad_enabled()
        if (distilling or self.indexer is not None) and shard.sharded:
            raise ValueError("NSAConfig.sel_distill > 0 and sel_scores='indexer' do not run under "
                             "context parallelism (dense over every query of the sequence); set "
                             "sel_distill = 0 and sel_scores = 'cmp'")
        doc_ids, cos, sin = masks.doc_ids, masks.cos, masks.sin
        T, q0 = Tq * shard.size, shard.offset(Tq)  # the whole sequence; this shard's first position
        q = self.project_q(x, cos, sin)
        k_cmp = lse_cmp = None  # set by the compressed branch below, read by the scorer
        p_idx = None  # the indexer's block scores (sel_scores = "indexer"), for its distillation

        def topn():  # selection scorer (Eq. 8-10) and top-n over the whole sequence's blocks
            nonlocal p_idx
            if self.dense_selection and self.training:  # the warm-up: every block, no scores
                starts = masks.starts if masks.starts is not None else torch.zeros(
                    1, T, dtype=torch.long, device=x.device)
                return all_blocks(cfg, B, T, starts, x.device, q0, q0 + Tq)
            if self.indexer is not None:  # scores from the indexer's own per-token keys
                p_idx = self.indexer(x, masks.specs["dense"], cfg)
                return self.select_topn(q.detach(), None, None, cfg, masks.starts, seq_len=T,
                                        scores=p_idx.detach())
            kc = k_cmp
            if kc is None:  # the compressed branch is off: the whole sequence's keys, compressed
                kc = self.phi_k(gather_seq_nograd(self.project_kv(x, "cmp", cos, sin)[0].detach(),
                                                  shard, 2))
            lse = None if lse_cmp is None else lse_cmp.detach()
            return self.select_topn(q.detach(), kc.detach(), lse, cfg, masks.starts,  # no gradient
                                    q_offset=q0, seq_len=T)

        # the draw hashes each token's input: the whole sequence's steps, as one process draws
        step = gather_seq_nograd(random_draw_step(x, cfg.seed), shard, 2) if self.draws else 0
        ctx = MaskContext(cfg, B, T, x.device, doc_ids=doc_ids, topn=topn, step=step,
                          starts=masks.starts, q_offset=q0, q_len=Tq)

        def mask(b):  # (mask, key length): the step's shared one, else the layer's own
            if b in masks.specs:
                return masks.specs[b], masks.kv_lens[b]
            return branch_mask(b, self.builders[b], ctx, halo)

        docs = doc_ids is not None
        out, specs = {}, {}  # branch -> output; branch -> (MaskSpec, kv length), for telemetry

        # compressed branch (§3.3.1): phi over blocks of l keys / values, attend; its lse feeds
        # the scorer. A scoring selection runs it for the compressed keys when the branch is off.
        if "cmp" in self.builders:
            spec = cmp_spec = mask("cmp")[0]
            oc, lse_cmp, k_cmp = self.branch("cmp", spec, x, q, cos, sin, docs, shard)
            if names["cmp"] != "none":
                out["cmp"], specs["cmp"] = oc, (spec, k_cmp.shape[2])

        # selected (§3.3.2) and sliding-window (§3.3.3, its keys a halo where one suffices)
        k_sel = None  # the selected branch's keys: the distillation's target reads them
        for b in ("sel", "win"):
            if b in self.builders:
                specs[b] = mask(b)
                out[b], _, k = self.branch(b, specs[b][0], x, q, cos, sin, docs, shard,
                                           halo if b == "win" else None)
                k_sel = k if b == "sel" else k_sel

        # gate (Eq. 5): per head, per branch sigmoid, mixing the branch outputs
        g = torch.sigmoid(self.gate(x)).view(B, Tq, -1, 3)  # [B, T, H, 3]
        on = [i for i, b in enumerate(BRANCHES) if b in out]
        o = mix_branches(g if len(on) == 3 else g[..., on], [out[BRANCHES[i]] for i in on],
                         cfg.backend)  # [B, T, H * d_v]
        y = self.wo(o)

        # optional (not in the paper): teach the scorer -- the compressed keys, or the indexer --
        # where the selected branch's dense attention would look, through y's backward
        # (nsa_flex.distill)
        kl = None
        if distilling and self.indexer is not None:  # the indexer's scores toward the same target
            causal = masks.specs["dense"]  # the step's dense causal mask (`step_masks`)
            if p_idx is None:  # not scored this step (the dense warm-up)
                p_idx = self.indexer(x, causal, cfg)
            kl = block_kl(selected_target(q, k_sel, cfg, causal), p_idx, cfg, masks.starts)
            y = attach_loss(y, cfg.sel_distill * kl)
        elif distilling:
            kc = self.phi_k(self.project_kv(x.detach(), "cmp", cos, sin)[0])
            kl = distill_kl(q, kc, k_sel, cfg, cmp_spec, masks.specs["dense"], masks.starts)
            y = attach_loss(y, cfg.sel_distill * kl)
        if self.telemetry:
            with torch.no_grad():
                enabled = tuple(b in out for b in BRANCHES)
                self.telemetry_stats.copy_(layer_stats(g.permute(0, 2, 1, 3), enabled, specs,
                                                       cfg.l_sel, Tq, kl))
        return y
