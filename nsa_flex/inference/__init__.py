"""Inference for nsa_flex: per-branch KV caches, prefill + token-by-token decode, read counters,
model-level generation. Batch layout: right padding with per-row lengths (see cache.py)."""

from .cache import DECODE_BACKENDS, NSACache
from .decode import decode_attention, decode_step, new_cache, resolve_decode_backend
from .prefill import prefill

__all__ = ["DECODE_BACKENDS", "NSACache", "decode_attention", "decode_step", "new_cache", "prefill",
           "resolve_decode_backend"]
