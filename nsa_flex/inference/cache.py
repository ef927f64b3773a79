"""Per-branch decode caches of one NSAAttention layer.

Batch layout: RIGHT padding with per-row lengths. Row b holds tokens at positions
0 .. lengths[b]-1 (its own positions: RoPE angles and block boundaries are those of the unpadded
sequence, so every row is exactly its own single-sequence computation). A decode step appends one
token per row at position lengths[b]; rows advance together, so rows keep their offsets.
Everything per-row lives in tensors (`lengths`, `doc_start`): a decode step never syncs with the
host and has static shapes (CUDA-graph / torch.compile friendly).

Tensors ([B, Hkv, ., D] unless noted):
  k_sel, v_sel   [.., capacity, D]   selection branch: every token (capacity rounded up to l_sel)
  k_win, v_win   [.., window, D]     window branch: rolling ring, position p in slot p % window
  k_raw, v_raw   [.., l, D]          compressed branch raw keys/values: ring of the last l tokens,
                                     position p in slot p % l (what the next block needs)
  k_cmp, v_cmp   [.., n_cmp, D]      compressed stream: block i (tokens [i d, i d + l)) is emitted
                                     into slot i when token i d + l - 1 arrives
  lengths        [B] long            tokens in the cache per row (= position of the next token)
  doc_start      [B] long            first position of the next token's document (doc masking)

Read counters of the last decode step (set by `decode_step`, computed from the very masks the
attention used, as tensors, no host sync):
  reads["cmp"] [B]       compressed blocks visible
  reads["sel"] [B, Hkv]  distinct key tokens of the selected blocks at or before the position
  reads["win"] [B]       window tokens visible (min(window, S) without document masking)

decode_backend picks the implementation of the decode step (`nsa_flex.inference.decode`): the
torch reference (`decode_reference`) or the fused Triton kernels (`decode_fused`); both read and
write these same tensors.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..config import NSAConfig


DECODE_BACKENDS = ("auto", "torch", "triton")


def check_decode_backend(name: str) -> str:
    if name not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend={name!r}: allowed values are {DECODE_BACKENDS}")
    return name


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class NSACache:
    cfg: NSAConfig
    capacity: int
    k_sel: Tensor | None
    v_sel: Tensor | None
    k_win: Tensor | None
    v_win: Tensor | None
    k_raw: Tensor | None
    v_raw: Tensor | None
    k_cmp: Tensor | None
    v_cmp: Tensor | None
    lengths: Tensor
    doc_start: Tensor
    reads: dict = field(default_factory=dict)
    # selected blocks [B, Hkv, n_sel] of the last decode step (-1 unused; None without top-n)
    last_selection: Tensor | None = None
    # host-side upper bound of lengths (never read from the device): capacity checks without sync
    host_max_len: int = 0
    # decode implementation: "auto" (the fused Triton kernels on CUDA, else torch), "torch" (the
    # naive reference, any device), "triton" (the fused kernels; an error where they cannot run)
    decode_backend: str = "auto"
    # why an "auto" cache left the Triton path (None while it has not): see inference/decode.py
    fallback_reason: str | None = None

    def __post_init__(self):
        check_decode_backend(self.decode_backend)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def n_cmp_slots(self) -> int:
        """Compressed blocks the cache can hold."""
        return 0 if self.k_cmp is None else self.k_cmp.shape[2]

    @classmethod
    def empty(cls, cfg: NSAConfig, batch: int, capacity: int, device=None, dtype=torch.float32,
              branches: tuple[str, ...] = ("cmp", "sel", "win"), lengths: Tensor | None = None,
              decode_backend: str = "auto") -> "NSACache":
        """Allocate caches for `capacity` tokens per row. `branches` lists the key/value streams to
        keep ("cmp" also serves the top-n scorer). `lengths` may be a tensor shared between the
        caches of several layers (the model-level cache advances it once per step).
        decode_backend: see the field (validated here)."""
        check_decode_backend(decode_backend)
        H, dk, dv = cfg.n_kv_heads, cfg.d_qk, cfg.d_v
        cap = round_up(max(capacity, 1), cfg.l_sel)
        kw = dict(device=device, dtype=dtype)

        def two(n):
            return torch.zeros(batch, H, n, dk, **kw), torch.zeros(batch, H, n, dv, **kw)

        k_sel = v_sel = k_win = v_win = k_raw = v_raw = k_cmp = v_cmp = None
        if "sel" in branches:
            k_sel, v_sel = two(cap)
        if "win" in branches:
            k_win, v_win = two(cfg.window)
        if "cmp" in branches:
            k_raw, v_raw = two(cfg.l)
            k_cmp, v_cmp = two(cfg.num_cmp(cap))
        if lengths is None:
            lengths = torch.zeros(batch, dtype=torch.long, device=device)
        doc_start = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(cfg, cap, k_sel, v_sel, k_win, v_win, k_raw, v_raw, k_cmp, v_cmp, lengths,
                   doc_start, decode_backend=decode_backend)

    def tensors(self) -> dict[str, Tensor]:
        names = ("k_sel", "v_sel", "k_win", "v_win", "k_raw", "v_raw", "k_cmp", "v_cmp")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def check_room(self, new_tokens: int = 1) -> None:
        if self.host_max_len + new_tokens > self.capacity:
            raise RuntimeError(f"NSACache full: {self.host_max_len} + {new_tokens} tokens > capacity "
                               f"{self.capacity}; allocate a larger cache")

    @torch.no_grad()
    def random_fill_(self, length: int | Tensor, generator: torch.Generator | None = None,
                     std: float = 1.0) -> "NSACache":
        """Fill every stream with random normal data (never zeros) as if `length` tokens had been
        processed (benchmarks and counter tests: a cache at context S without a real prefill).
        The compressed stream is random too (not the compression of the random raw keys)."""
        for t in self.tensors().values():
            t.normal_(0.0, std, generator=generator)
        if isinstance(length, int):
            self.lengths.fill_(length)
            self.host_max_len = length
        else:
            self.lengths.copy_(length)
            self.host_max_len = int(length.max())
        self.doc_start.zero_()
        return self
