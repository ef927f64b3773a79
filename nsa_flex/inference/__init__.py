"""Inference for nsa_flex: per-branch KV caches, prefill + token-by-token decode, read counters,
model-level generation. Batch layout: right padding with per-row lengths (see cache.py)."""

from .cache import NSACache
from .decode import decode_attention, decode_step, new_cache, prefill

__all__ = ["NSACache", "decode_attention", "decode_step", "new_cache", "prefill"]
