"""Model-level prefill / decode / generation for nsa_flex.titan.model.NSATransformer.

Uses the model's documented layout (tok_embeddings, layers[i] with .attention, norm, output)
and runs each block's own forward with its attention call swapped for one on the layer's cache:
    h = block(h, attend=lambda y: decode_step(block.attention, y, cache))
Batch layout: right padding with per-row lengths; all layers share one `lengths` tensor.
Document masking (model_args.doc_masking): a document ends at (and includes) an EOS token, as in
`doc_ids_from_tokens`; the decode keeps each row's document start.
"""

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..data.documents import doc_ids_from_tokens
from .cache import NSACache
from .decode import decode_step, new_cache
from .graphs import GraphedDecodeStep, restore_state, snapshot_state  # noqa: F401 (re-exported)
from .prefill import prefill as layer_prefill


def _blocks(model):
    return list(model.layers.values())


@dataclass
class ModelCache:
    layers: list[NSACache]
    lengths: Tensor  # shared by every layer cache
    eos_id: int = -1
    doc_masking: bool = False
    steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def reads(self) -> dict[str, Tensor]:
        """Per-branch reads of the last step summed over layers ([B]; sel: per-group max)."""
        tot = {}
        for c in self.layers:
            for k, v in c.reads.items():
                v = v.amax(-1) if v.dim() == 2 else v
                tot[k] = tot.get(k, 0) + v
        return tot


def new_model_cache(model, batch: int, capacity: int, device=None, dtype=None,
                    decode_backend: str = "auto") -> ModelCache:
    """Caches of every layer, sharing one lengths tensor. decode_backend: "auto" | "torch" |
    "triton" (see nsa_flex.inference.decode)."""
    w = model.output.weight if model.output is not None else next(model.parameters())
    device = device or w.device
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    caches = [new_cache(blk.attention, batch, capacity, device, dtype, lengths=lengths,
                        decode_backend=decode_backend)
              for blk in _blocks(model)]
    args = getattr(model, "model_args", None)
    return ModelCache(caches, lengths, eos_id=getattr(args, "eos_id", -1),
                      doc_masking=bool(getattr(args, "doc_masking", False)))


@torch.no_grad()
def model_prefill(model, tokens: Tensor, cache: ModelCache, lengths=None) -> Tensor:
    """Right-padded prompts tokens [B, T] (per-row lengths, default T) -> logits [B, T, V] (rows
    past their length are padding) and filled caches."""
    B, T = tokens.shape
    dev = tokens.device
    lengths = torch.as_tensor(lengths if lengths is not None else [T] * B, dtype=torch.long,
                              device=dev)
    doc_ids = None
    if cache.doc_masking:
        doc_ids = doc_ids_from_tokens(tokens, cache.eos_id)
    h = model.tok_embeddings(tokens)
    for blk, c in zip(_blocks(model), cache.layers):
        h = blk(h, attend=lambda y, blk=blk, c=c: layer_prefill(blk.attention, y, c, lengths, doc_ids))
    if cache.doc_masking:
        # the next token starts a new document when the last prompt token is EOS
        last = tokens.gather(1, (lengths - 1).clamp_min(0).view(B, 1)).view(B)
        ds = torch.where(last == cache.eos_id, lengths, cache.layers[0].doc_start)
        for c in cache.layers:
            c.doc_start.copy_(ds)
    cache.steps = 0
    return model.output(model.norm(h))


@torch.no_grad()
def model_decode_step(model, tokens: Tensor, cache: ModelCache) -> Tensor:
    """tokens [B] (one per row, at positions cache.lengths) -> logits [B, V]; advances the cache."""
    B = tokens.shape[0]
    h = model.tok_embeddings(tokens.view(B, 1))
    for blk, c in zip(_blocks(model), cache.layers):
        h = blk(h, attend=lambda y, blk=blk, c=c: decode_step(blk.attention, y, c, commit=False))
    logits = model.output(model.norm(h))[:, 0]
    # advance the shared lengths once, and every layer's host bound
    cache.lengths.add_(1)
    for c in cache.layers:
        c.host_max_len += 1
    if cache.doc_masking:
        ds = torch.where(tokens == cache.eos_id, cache.lengths, cache.layers[0].doc_start)
        for c in cache.layers:
            c.doc_start.copy_(ds)
    cache.steps += 1
    return logits


# ---------------------------------------------------------------------- sampling
def sample(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
           generator: torch.Generator | None = None) -> Tensor:
    """logits [B, V] -> token ids [B]. Greedy (or temperature 0): argmax. Else temperature and
    nucleus (top-p) sampling: keep the smallest set of tokens whose probability reaches top_p."""
    if greedy or temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p  # tokens before which the mass is still < top_p
        keep[..., 0] = True
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return torch.multinomial(probs, 1, generator=generator).view(-1)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, greedy: bool = False, eos_id: int | None = None,
             generator: torch.Generator | None = None, device=None,
             decode_backend: str = "auto", cuda_graphs: bool = False) -> dict:
    """Generate for a batch of prompts (token id lists of any lengths). Returns {"tokens": list of
    generated id lists (cut after EOS), "prefill_s", "decode_s", "capture_s", "new_tokens",
    "tokens_per_s"}. decode_backend: "auto" | "torch" | "triton" (see nsa_flex.inference.decode).
    cuda_graphs: decode by one CUDA graph replay per token (`GraphedDecodeStep`, CUDA only; eager
    decode is host-bound); its capture takes capture_s, outside decode_s."""
    device = device or next(model.parameters()).device
    if cuda_graphs and torch.device(device).type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got {device}")
    B = len(prompts)
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    T = max(lens)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    cache = new_model_cache(model, B, T + max_new_tokens, decode_backend=decode_backend)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    lengths = torch.tensor(lens, device=device)
    logits = model_prefill(model, tokens, cache, lengths)
    last = logits.gather(1, (lengths - 1).view(B, 1, 1).expand(B, 1, logits.shape[-1]))[:, 0]
    nxt = sample(last, temperature, top_p, greedy, generator)
    sync()
    t1 = time.perf_counter()
    step = lambda tok: model_decode_step(model, tok, cache)  # noqa: E731
    if cuda_graphs and max_new_tokens > 1:
        step = GraphedDecodeStep(model, cache, B, model_decode_step)  # its logits are overwritten by the next step
        sync()
    t1c = time.perf_counter()
    out = [nxt]
    for _ in range(max_new_tokens - 1):
        nxt = sample(step(nxt), temperature, top_p, greedy, generator)
        out.append(nxt)
    sync()
    t2 = time.perf_counter()
    gen = torch.stack(out, 1).tolist() if max_new_tokens > 0 else [[] for _ in range(B)]
    if eos_id is not None and eos_id >= 0:
        gen = [g[: g.index(eos_id) + 1] if eos_id in g else g for g in gen]
    n_new = B * max(0, max_new_tokens - 1)
    return {"tokens": gen, "prefill_s": t1 - t0, "decode_s": t2 - t1c, "capture_s": t1c - t1,
            "new_tokens": B * max_new_tokens,
            "tokens_per_s": n_new / (t2 - t1c) if t2 > t1c and n_new else float("nan"),
            "cache": cache}
