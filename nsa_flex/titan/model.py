"""NSATransformer: a Llama-style decoder (RMSNorm, SwiGLU, RoPE) whose attention is NSAAttention.

Same module layout as torchtitan's llama3 ``Transformer`` (``tok_embeddings``, ``layers`` ModuleDict of
blocks with ``attention`` / ``attention_norm`` / ``feed_forward`` / ``ffn_norm``, ``norm``, ``output``),
so torchtitan's ``apply_ac`` / ``apply_compile`` / ``apply_fsdp`` work on it unchanged. RoPE is applied
inside ``NSAAttention`` (positions 0..T-1). What every layer shares (RoPE's cos / sin, the
documents, the compressed and window masks: ``nsa_flex.layer.StepMasks``) is built outside the
compiled blocks, once a forward (without documents once while the shape stays), and passed to each
block; each layer builds its own selection.
"""

from typing import Callable

import torch
from torch import nn

from torchtitan.models.llama3.model.model import FeedForward
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.model import ModelProtocol

from nsa_flex.context_parallel import NO_SHARD, SeqShard, gather_seq_nograd
from nsa_flex.data.documents import doc_ids_from_tokens
from nsa_flex.layer import NSAAttention, StepMasks, branch_runners, step_masks

from .args import NSAModelArgs


class NSATransformerBlock(nn.Module):
    def __init__(self, layer_id: int, model_args: NSAModelArgs):
        super().__init__()
        self.dim = model_args.dim
        self.attention = NSAAttention(model_args.nsa_config())
        self.feed_forward = FeedForward(
            dim=model_args.dim,
            hidden_dim=4 * model_args.dim,
            multiple_of=model_args.multiple_of,
            ffn_dim_multiplier=model_args.ffn_dim_multiplier,
        )
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        if model_args.depth_init:
            self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        else:
            self.weight_init_std = 0.02 / (2 * model_args.n_layers) ** 0.5

    def forward(self, x: torch.Tensor, masks: StepMasks | None = None,
                attend: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """x + attention(attention_norm(x)), then + feed_forward(ffn_norm(.)). masks: the step's
        shared masks (``NSATransformer.step_masks``); attend: the attention call on the normed
        input, in place of ``self.attention(., masks=masks)`` (prefill and decode pass one that
        reads and fills the layer's cache)."""
        y = self.attention_norm(x)
        h = x + (self.attention(y, masks=masks) if attend is None else attend(y))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class NSATransformer(ModelProtocol):
    def __init__(self, model_args: NSAModelArgs):
        super().__init__(model_args)
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict(
            {str(i): NSATransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        # every layer has this config: the step's shared masks are built with its builders and plans
        self.nsa_config = model_args.nsa_config()
        self.mask_builders, self.mask_plans = branch_runners(self.nsa_config)
        # the last step's masks without documents, a function of (B, T, device, shard) alone:
        # reused while they stay (every training step), rebuilt when they change
        self.fixed_masks: tuple[tuple, StepMasks] | None = None
        self.seq_shard = NO_SHARD  # context parallelism: `set_seq_shard`
        # the blocks run in inductor's CUDA graphs ([compile] cudagraphs; `compile_blocks`): a
        # forward without grad (validation) copies each block's output out of the graph's pool
        self.graph_blocks = False

    def step_masks(self, tokens: torch.Tensor) -> StepMasks:
        """What every layer shares this step (``nsa_flex.layer.StepMasks``), from the model's input:
        token ids [B, T] (documents split at the EOS id when ``doc_masking``; with a sequence shard
        the whole sequence's, all-gathered: a document may start on an earlier rank), or the hidden
        states of a stage without the embedding (no documents). Built outside the compiled blocks:
        once, not once a layer; without documents once while the shape stays (`fixed_masks`)."""
        B, T = tokens.shape[:2]
        shard = self.seq_shard
        if self.model_args.doc_masking and self.tok_embeddings is not None:
            doc_ids = doc_ids_from_tokens(gather_seq_nograd(tokens, shard, 1), self.model_args.eos_id)
            return step_masks(self.nsa_config, self.mask_builders, self.mask_plans, B, T,
                              tokens.device, doc_ids, shard)
        key = (B, T, tokens.device, shard)
        if self.fixed_masks is None or self.fixed_masks[0] != key:
            self.fixed_masks = key, step_masks(self.nsa_config, self.mask_builders,
                                               self.mask_plans, B, T, tokens.device, None, shard)
        return self.fixed_masks[1]

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize parameters (and buffers) in place; called after ``to_empty`` under no_grad."""
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is None:
                continue
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.model_args.dim**-0.5
            trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
        # NSA builds its masks inside every layer (they depend on the layer's own scores).
        # TypeError is what torchtitan's validator expects from models without external masks.
        raise TypeError("nsa_flex builds its attention masks inside NSAAttention")

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions=None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]. With a sequence shard (`set_seq_shard`) tokens
        are this rank's contiguous shard; document ids come from the whole sequence's tokens
        (all-gathered: a document may start on an earlier rank)."""
        if positions is not None:
            raise NotImplementedError("nsa_flex uses positions 0..T-1 (no position ids); under "
                                      "context parallelism its trainer shards inputs itself")
        masks = self.step_masks(tokens)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, masks)
            if self.graph_blocks and not torch.is_grad_enabled():
                # without a pending backward every block call starts a new graph generation, which
                # may overwrite the previous block's output before the next block reads it
                h = h.clone()
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def set_seq_shard(model: NSATransformer, shard: SeqShard) -> None:
    """Context parallelism: every layer of `model` reads positions shard.offset(T) .. + T - 1 of
    a sequence of T * shard.size tokens (`nsa_flex.context_parallel`)."""
    model.seq_shard = shard
    for block in model.layers.values():
        block.attention.shard = shard


def set_dense_selection(model: nn.Module, step: int) -> bool:
    """The selection's dense warm-up (`NSAConfig.sel_dense_steps`): every NSA layer of `model`
    selects every earlier block in training step `step` (1-based) iff step <= its sel_dense_steps.
    Returns whether any layer is dense (False for a model without NSA layers)."""
    dense = False
    for m in model.modules():
        if isinstance(m, NSAAttention):
            m.dense_selection = step <= m.cfg.sel_dense_steps
            dense = dense or m.dense_selection
    return dense
