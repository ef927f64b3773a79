"""NSAAttention: the drop-in attention layer.

x -> projections (shared q; own k/v per branch) -> RoPE -> compress -> score -> masks
  -> three attention calls (compressed, selected, window) -> per-head sigmoid gate -> out
"""

import torch
from torch import Tensor, nn

from masks import MaskContext, doc_start, get_mask_builder

from .attention import attend
from .compression import PHI
from .config import NSAConfig
from .kernel_options import install_small_block_bwd_configs
from .rope import apply_rope, rope_cos_sin
from .selection import select_topn
from .telemetry import STATS_SIZE, layer_stats

BRANCHES = ("cmp", "sel", "win")


class NSAAttention(nn.Module):
    def __init__(self, cfg: NSAConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        if cfg.backend != "reference":  # flex runs inside the compiled forward: install it now
            install_small_block_bwd_configs()
        H, Hkv, dk, dv, dim = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v, cfg.dim
        self.wq = nn.Linear(dim, H * dk, bias=False)
        # paper §3.3.3: independent keys and values for each branch
        self.wk = nn.ModuleDict({b: nn.Linear(dim, Hkv * dk, bias=False) for b in BRANCHES})
        self.wv = nn.ModuleDict({b: nn.Linear(dim, Hkv * dv, bias=False) for b in BRANCHES})
        self.phi_k = PHI[cfg.phi](cfg.l, cfg.d, dk)
        self.phi_v = PHI[cfg.phi](cfg.l, cfg.d, dv)
        self.gate = nn.Linear(dim, 3 * H, bias=True)  # paper Eq. 5: g = sigmoid(MLP(x))
        self.wo = nn.Linear(H * dv, dim, bias=False)
        self.builders = {b: get_mask_builder(n) for b, n in cfg.branch_masks().items()}
        self.branch_names = cfg.branch_masks()
        # the top-n selection (Eq. 8-11, nsa_flex.selection): an instance attribute, so a probe
        # can wrap it for one layer (experiments/retrieval_probe.py records and overrides picks)
        self.select_topn = select_topn
        # telemetry (nsa_flex/telemetry.py): set before the first (compiled) call; when on, every
        # forward writes its gate / mask statistics into this buffer (no state dict, no grad)
        self.telemetry = False
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

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_qk, cfg.d_v
        enabled = {b for b, n in self.branch_names.items() if n != "none"}
        need_cmp = "cmp" in enabled or self.branch_names["sel"] == "topn"

        # projections and RoPE (keys are rotated before compression)
        cos, sin = rope_cos_sin(torch.arange(T, device=x.device), dk, cfg.rope_theta, x.dtype)
        q = apply_rope(self.wq(x).view(B, T, H, dk).transpose(1, 2), cos, sin)

        def kv(branch):
            k = self.wk[branch](x).view(B, T, Hkv, dk).transpose(1, 2)
            v = self.wv[branch](x).view(B, T, Hkv, dv).transpose(1, 2)
            return apply_rope(k, cos, sin), v

        starts = doc_start(doc_ids.long()) if doc_ids is not None else None
        ctx = MaskContext(cfg, B, T, x.device, doc_ids=doc_ids)
        out = {}
        specs = {}  # branch -> (MaskSpec, kv length) of the enabled branches, for telemetry

        # compressed branch: compress -> attend (its lse feeds the scorer)
        topn = None
        if need_cmp:
            k, v = kv("cmp")
            k_cmp, v_cmp = self.phi_k(k), self.phi_v(v)
            cmp_builder = self.builders["cmp"] if "cmp" in enabled else \
                get_mask_builder("compressed_causal")
            spec = cmp_builder(ctx)
            o, lse_cmp = attend(q, k_cmp, v_cmp, spec, cfg.backend)
            if "cmp" in enabled:
                out["cmp"] = o
                specs["cmp"] = (spec, k_cmp.shape[2])

            # selection scorer (Eq. 8-10), no gradient through the top-n
            def topn():
                lse = None if lse_cmp is None else lse_cmp.detach()
                return self.select_topn(q.detach(), k_cmp.detach(), lse, cfg, starts)
        else:
            # a custom selection builder may still ask for the scorer (registry contract):
            # compressed keys on demand, the scorer computes its own lse
            def topn():
                k, _ = kv("cmp")
                return self.select_topn(q.detach(), self.phi_k(k).detach(), None, cfg, starts)

        step = 0
        if self.branch_names["sel"] == "random_selection":
            # a fresh draw per token, keyed by a hash of that token's own input (causal): the same
            # draw when activation checkpointing recomputes the forward or a resumed run replays
            h = x.detach().float().sum(-1).view(torch.int32).long()  # [B, T]
            step = h.view(B, 1, T, 1) + cfg.seed * 1_000_003
        ctx = MaskContext(cfg, B, T, x.device, doc_ids=doc_ids, topn=topn, step=step)

        for b in ("sel", "win"):
            if b in enabled:
                k, v = kv(b)
                specs[b] = (self.builders[b](ctx), T)
                out[b], _ = attend(q, k, v, specs[b][0], cfg.backend)

        # gate (Eq. 5): per head, per branch sigmoid, mixing the branch outputs
        g = torch.sigmoid(self.gate(x)).view(B, T, H, 3).permute(0, 2, 1, 3)  # [B, H, T, 3]
        o = sum(g[..., i : i + 1] * out[b] for i, b in enumerate(BRANCHES) if b in out)
        if self.telemetry:
            with torch.no_grad():
                on = tuple(b in out for b in BRANCHES)
                self.telemetry_stats.copy_(layer_stats(g, on, specs, cfg.l_sel, T))
        o = o.transpose(1, 2).reshape(B, T, H * dv)
        return self.wo(o.to(x.dtype))
