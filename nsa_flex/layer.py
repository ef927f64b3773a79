"""NSAAttention: the drop-in attention layer.

x -> projections (shared q; own k/v per branch) -> RoPE -> compress -> score -> masks
  -> three attention calls (compressed, selected, window) -> per-head sigmoid gate -> out
The projections are methods (`project_q`, `project_kv`) so decode projects one token the same way.
"""

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from masks import MaskContext, at_offset, builder_info, doc_start

from .attention import mix_branches, plan_branch
from .compression import PHI
from .config import RECOMPUTED, NSAConfig
from .context_parallel import NO_SHARD, SeqShard, gather_seq, gather_seq_nograd, with_halo
from .kernel_options import install_flex_patches
from .ops import DEFAULT_TUNING, SelectedTuning
from .rope import apply_rope, rope_cos_sin
from .rules import BRANCHES, random_draw_step
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
        self.wo = nn.Linear(H * dv, dim, bias=False)
        self.branch_names = cfg.branch_masks()
        run = branch_builders(cfg)
        self.builders = {b: builder_info(n).fn for b, n in run.items()}
        self.plans = {b: plan_branch(cfg, n, sel_tuning) for b, n in run.items()}
        self.draws = builder_info(self.branch_names["sel"]).step  # the selection reads ctx.step
        # the top-n selection (Eq. 8-11, nsa_flex.selection): an instance attribute, so a probe
        # can wrap it for one layer (experiments/retrieval_probe.py records and overrides picks)
        self.select_topn = select_topn
        # telemetry (nsa_flex/telemetry.py): set before the first (compiled) call; when on, every
        # forward writes its gate / mask statistics into this buffer (no state dict, no grad)
        self.telemetry = False
        # context parallelism (nsa_flex.context_parallel): this rank's shard of the sequence, set
        # with the model's (`nsa_flex.titan.model.set_seq_shard`); a forward's own argument wins
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

    def window_halo(self, shard: SeqShard, local_len: int) -> int | None:
        """Keys before its shard the window branch reads where a halo suffices: window - 1 for
        the `sliding_window` builder when the previous rank holds them all; None (all-gather the
        sequence): no shard, another builder (it may read any key), or a window longer than a
        shard."""
        h = self.cfg.window - 1
        if not shard.sharded or self.branch_names["win"] != "sliding_window" or h > local_len:
            return None
        return h

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
    def forward(self, x: Tensor, doc_ids: Tensor | None = None,
                shard: SeqShard | None = None) -> Tensor:
        """x [B, T, dim] -> [B, T, dim]; doc_ids [B, T] (optional): document ids, non-decreasing
        along T (packed documents attend only within themselves). shard (context parallelism,
        `nsa_flex.context_parallel`): x holds positions shard.offset(T) .. + T - 1 of a sequence
        of T * shard.size tokens, doc_ids are that whole sequence's [B, T * shard.size]."""
        shard = self.shard if shard is None else shard
        check_inputs(x, doc_ids, self.cfg.dim, shard.size)
        cfg, names = self.cfg, self.branch_names
        B, Tq, _ = x.shape
        T, q0 = Tq * shard.size, shard.offset(Tq)  # the whole sequence; this shard's first position
        cos, sin = rope_cos_sin(torch.arange(q0, q0 + Tq, device=x.device), cfg.d_qk,
                                cfg.rope_theta, x.dtype)
        q = self.project_q(x, cos, sin)
        k_cmp = lse_cmp = None  # set by the compressed branch below, read by the scorer

        def topn():  # selection scorer (Eq. 8-10) and top-n, when the selection builder asks
            if k_cmp is None:
                kc = gather_seq_nograd(self.project_kv(x, "cmp", cos, sin)[0].detach(), shard, 2)
                kc = self.phi_k(kc)
            else:
                kc = k_cmp
            lse = None if lse_cmp is None else lse_cmp.detach()
            starts = None if doc_ids is None else doc_start(doc_ids.long())
            return self.select_topn(q.detach(), kc.detach(), lse, cfg, starts,  # no gradient
                                    q_offset=q0, seq_len=T)

        # the draw hashes each token's input: the whole sequence's steps, as one process draws
        step = gather_seq_nograd(random_draw_step(x, cfg.seed), shard, 2) if self.draws else 0
        ctx = MaskContext(cfg, B, T, x.device, doc_ids=doc_ids, topn=topn, step=step,
                          q_offset=q0, q_len=Tq)
        docs = doc_ids is not None
        out, specs = {}, {}  # branch -> output; branch -> (MaskSpec, kv length), for telemetry

        # compressed branch (§3.3.1): phi over blocks of l keys / values, attend; its lse feeds
        # the scorer. A scoring selection runs it for the compressed keys when the branch is off.
        if "cmp" in self.builders:
            spec = at_offset(self.builders["cmp"](ctx), q0)
            oc, lse_cmp, k_cmp = self.branch("cmp", spec, x, q, cos, sin, docs, shard)
            if names["cmp"] != "none":
                out["cmp"], specs["cmp"] = oc, (spec, k_cmp.shape[2])

        # selected branch (§3.3.2)
        if "sel" in self.builders:
            specs["sel"] = (at_offset(self.builders["sel"](ctx), q0), T)
            out["sel"], _, _ = self.branch("sel", specs["sel"][0], x, q, cos, sin, docs, shard)

        # sliding-window branch (§3.3.3); with a halo its keys start at position `base`: the
        # mask sees positions from there (a window's mask depends on differences of positions)
        if "win" in self.builders:
            halo = self.window_halo(shard, Tq)
            base = 0 if halo is None else max(0, q0 - halo)
            wctx = ctx if base == 0 else MaskContext(
                cfg, B, q0 + Tq - base, x.device, q_offset=q0 - base, q_len=Tq,
                doc_ids=None if doc_ids is None else doc_ids[:, base:q0 + Tq])
            kv_len = T if halo is None else q0 + Tq - base
            specs["win"] = (at_offset(self.builders["win"](wctx), q0 - base), kv_len)
            out["win"], _, _ = self.branch("win", specs["win"][0], x, q, cos, sin, docs, shard,
                                           halo)

        # gate (Eq. 5): per head, per branch sigmoid, mixing the branch outputs
        g = torch.sigmoid(self.gate(x)).view(B, Tq, -1, 3)  # [B, T, H, 3]
        on = [i for i, b in enumerate(BRANCHES) if b in out]
        o = mix_branches(g if len(on) == 3 else g[..., on], [out[BRANCHES[i]] for i in on],
                         cfg.backend)  # [B, T, H * d_v]
        if self.telemetry:
            with torch.no_grad():
                enabled = tuple(b in out for b in BRANCHES)
                self.telemetry_stats.copy_(layer_stats(g.permute(0, 2, 1, 3), enabled, specs,
                                                       cfg.l_sel, Tq))
        return self.wo(o)
