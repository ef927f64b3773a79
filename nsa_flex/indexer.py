"""The block indexer (optional, `NSAConfig.sel_scores = "indexer"`; not in the paper).

NSA scores the selection blocks from its compressed attention (Eq. 8-10): one key per l tokens at
stride d. A block that matters because of one or two of its tokens (a passkey's digits) is then
scored through a pooled key that need not resolve them, and the selection distillation
(nsa_flex/distill.py), which asks the compressed keys for the selected branch's dense block mass,
stalls where they cannot express it. DeepSeek-V3.2's lightning indexer scores every token with a
small attention of its own; here the same, summed per selection block:

    p_idx[t, j] = the mean over the KV group's `indexer_heads` heads of the mass that
                  softmax_s(q_h[t] . k[s] / sqrt(indexer_dim)) over the tokens s <= t of t's
                  document puts on block j's tokens

q and k are projections of the layer's input, detached (the indexer never trains the model), with
RoPE (the layer's base) as the selected branch's: its target mixes content and position, and
without RoPE the indexer cannot express the positional part (fitted to the target of fixed random
weights on fresh inputs, experiments/indexer_fit.py: ~1.1 nats stay, with RoPE 0.07). Its block
masses take p_slc's place in the top-n rule (Eq. 11: forced blocks first, then by score; the same
`select_topn`), and the distillation trains it toward the selected branch's dense block mass (its
only gradient: `sel_distill` > 0 is required).

Cost: about one causal attention over the sequence (`indexer_heads` heads a KV group, head dim
`indexer_dim`, values the one-hot selection blocks: `distill.token_block_mass`), as the
distillation's target costs, and the [B, Hkv, T, Ns] fp32 scores; unlike the distillation it also
runs in evaluation (decoding refuses it: nsa_flex.inference.decode.branch_modes).
"""

import torch
from torch import Tensor, nn

from masks import MaskSpec

from .distill import token_block_mass
from .rope import apply_rope, rope_cos_sin


class BlockIndexer(nn.Module):
    """Per-token keys and queries of its own, scores per selection block (module docstring)."""

    def __init__(self, cfg):
        super().__init__()
        self.heads, self.head_dim, self.n_kv = cfg.indexer_heads, cfg.indexer_dim, cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.indexer_heads * cfg.indexer_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.indexer_dim, bias=False)

    def init_weights(self, init_std: float = 0.02):
        for lin in (self.wq, self.wk):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)

    def forward(self, x: Tensor, causal_spec: MaskSpec, cfg) -> Tensor:
        """x [B, T, dim] (detached here) -> block masses [B, Hkv, T, Ns] fp32, with a gradient to
        the indexer's weights only. causal_spec: causal over the T tokens, documents included
        (the layer's `causal` builder)."""
        x = x.detach()
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_kv * self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(torch.arange(T, device=x.device), self.head_dim, cfg.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return token_block_mass(q, k, causal_spec, cfg.l_sel, cfg.backend)
