"""Whole-model decode as one CUDA graph replay per token.

Eager decode of the model is host-bound (hundreds of small kernel launches per step from Python,
the GPU idle most of the step). The step
is built for capture (cache.py: static shapes, per-row state in device tensors, no host sync;
`emit_compressed` is branch-free), so `GraphedDecodeStep` captures one step of the model (the
`model_decode_step` of inference/model.py, passed in: this module is below it) and replays it; the host keeps only its counters (each layer cache's host_max_len, the model cache's
steps), which the wrapper advances itself.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from .decode_fused import resolve_decode_backend


@dataclass
class DecodeState:
    """What a decode step advances besides the K/V streams: device tensors (the shared lengths,
    every layer's doc_start) with saved copies, and the host counters."""
    tensors: list[tuple[Tensor, Tensor]]  # (live tensor, saved copy)
    host_max_len: list[int]
    steps: int


def snapshot_state(cache) -> DecodeState:
    """Save the decode state of a ModelCache (device tensors cloned, host ints copied)."""
    live: dict[int, Tensor] = {}
    for t in (cache.lengths, *(c.lengths for c in cache.layers),
              *(c.doc_start for c in cache.layers)):
        live.setdefault(id(t), t)  # the layers share one lengths tensor: save it once
    return DecodeState([(t, t.clone()) for t in live.values()],
                       [c.host_max_len for c in cache.layers], cache.steps)


def restore_state(cache, state: DecodeState) -> None:
    """Put a ModelCache back to `state` (device tensors by copy_, host ints by assignment).
    The K/V streams are not restored: a step writes its own position before it reads, so what
    a step at the saved position wrote is rewritten by the next step there (see
    GraphedDecodeStep)."""
    for t, saved in state.tensors:
        t.copy_(saved)
    for c, n in zip(cache.layers, state.host_max_len):
        c.host_max_len = n
    cache.steps = state.steps


def check_tokens(tokens, batch: int, device) -> None:
    """A clear ValueError unless tokens is a long tensor [batch] on `device`."""
    if not isinstance(tokens, Tensor):
        raise ValueError(f"tokens must be a tensor, got {type(tokens).__name__}")
    if tuple(tokens.shape) != (batch,):
        raise ValueError(f"tokens must have shape ({batch},) (one per row), got "
                         f"{tuple(tokens.shape)}")
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be torch.long, got {tokens.dtype}")
    if tokens.device != torch.device(device):
        raise ValueError(f"tokens must be on {device} (the graph's device), got {tokens.device}")


def _backends(cache, device) -> tuple[str, ...]:
    return tuple(resolve_decode_backend(c.decode_backend, device) for c in cache.layers)


class GraphedDecodeStep:
    """`decode(model, tokens, cache)` (`inference.model.model_decode_step`) as one CUDA graph replay.

    step = GraphedDecodeStep(model, cache, batch, model_decode_step)   # after the prefill
    logits = step(tokens)                           # tokens [B] long -> logits [B, V]

    The graph is bound to this cache's tensors (a prefill writes them in place, so it stays
    valid across prefills into the same cache; a new cache needs a new graph). The returned
    logits are the graph's static output buffer, overwritten by the next call: clone them to keep
    them. Each call points every layer cache's reads / last_selection at the graph's buffers
    (that step's counters; an eager step in between re-points them at its own).

    Capturing runs the step (one eager step, `warmup` steps on a side stream, the capture); each
    starts from the state saved before, which is restored after (`snapshot_state`). The K/V
    writes of these runs are harmless: they all write the position cache.lengths (the ring slots
    p % window and p % l too, whose previous tokens are out of that position's reach), and the
    next real step writes that same position before it reads anything. Steps run from advanced
    state would not be: a write at lengths + 1 evicts a ring token the step at lengths still
    reads, hence the restore before every run.
    decode_backend "auto" falls back to torch on a failed Triton step (decode.py `_fall_back`):
    the eager step makes it happen before the capture; a fallback during the capture is refused.
    """

    def __init__(self, model, cache, batch: int, decode, warmup: int = 2):
        dev = next(model.parameters()).device
        if dev.type != "cuda":
            raise ValueError(f"GraphedDecodeStep needs a CUDA model; its parameters are on {dev}")
        if cache.lengths.device != dev:
            raise ValueError(f"the cache is on {cache.lengths.device}, the model on {dev}")
        if cache.lengths.shape[0] != batch:
            raise ValueError(f"batch {batch} != the cache's batch {cache.lengths.shape[0]}")
        for c in cache.layers:
            c.check_room(1)  # the capture runs a step
        self.model, self.cache, self.batch, self.device = model, cache, batch, dev
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)  # static input

        def step():
            return decode(model, self.tokens, cache)

        state = snapshot_state(cache)
        try:
            step()  # eager: compiles the Triton kernels; an "auto" fallback happens here
            restore_state(cache, state)
            used = _backends(cache, dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
                for _ in range(warmup):
                    step()
                    restore_state(cache, state)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph):
                    self.logits = step()  # static output
            except Exception as e:
                if _backends(cache, dev) != used:
                    raise ValueError(self._fallback_message(used)) from e
                raise
            if _backends(cache, dev) != used:
                raise ValueError(self._fallback_message(used))
            self._outputs = [(c, c.reads, c.last_selection) for c in cache.layers]
        finally:
            restore_state(cache, state)  # the capture advanced the host counters

    def _fallback_message(self, used) -> str:
        now = _backends(self.cache, self.device)
        bad = [f"layer {i}: {c.fallback_reason}" for i, (c, u, n)
               in enumerate(zip(self.cache.layers, used, now)) if u != n]
        return ("the decode backend fell back from triton to torch during the CUDA graph capture "
                f"({'; '.join(bad)}); the graph would mix both paths. Use decode_backend='torch' "
                "(capturable) or fix the Triton failure")

    def __call__(self, tokens: Tensor) -> Tensor:
        """tokens [B] long on the model's device -> logits [B, V] (the static buffer, overwritten
        by the next call); advances the cache as model_decode_step does."""
        check_tokens(tokens, self.batch, self.device)
        cache = self.cache
        for c in cache.layers:
            c.check_room(1)  # as decode_step, before any device work
        self.tokens.copy_(tokens)
        self.graph.replay()  # advances cache.lengths (and doc_start) on the device
        for c, reads, selection in self._outputs:
            c.host_max_len += 1
            c.reads, c.last_selection = reads, selection
        cache.steps += 1
        return self.logits
