"""The selected-attention op's tuning as data: one frozen record, `SelectedTuning`, passed to the op
(`nsa_flex.ops.selected_triton.selected_attention(..., tuning=...)`), never a module setting that
a script rewrites. Pure Python (no triton): the layer's plan holds one (`nsa_flex.attention`).

What it sets, for the op's three passes (see `selected_triton`'s docstring for the passes):
  * q blocks of the forward and the dQ pass: `rows` rows of positions x G heads (a position's G
    heads take next_power_of_2(G) rows, a block at least 16 rows), `fwd_wide_rows` for the
    forward where G >= 16 (several positions on the union of their picks, whose K/V loads they
    share); the dQ pass then runs hybrid, a wide block's dQ as one tile or as its narrow blocks,
    whichever walks fewer steps counting a wide step as `wide_dq_cost` narrow ones;
  * dQ accumulated by atomics in the dK/dV pass instead of its own pass (`dq_atomic`; None: by
    shape, where G x d_k <= `atomic_max_row`: few atomics per step, and no second gather of K/V);
  * the dK/dV pass: `dkv_rows` gathered rows a step, each head's `heavy` most-read kv blocks split
    into shares of at most `split_tiles` positions;
  * launch options (num_warps, num_stages) per kernel: `QC_LAUNCH` by q block rows for the
    query-centric kernels in 16-bit, 8 warps for the dK/dV pass and for fp32; `fwd_launch`,
    `dq_launch`, `dkv_launch` override them (tuning sweeps: experiments/tune_selected.py).
The defaults were chosen on the H100 (measured by experiments/tune_selected.py; the log of those runs is kept with the experiments).
"""

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

import torch

# (num_warps, num_stages) of the query-centric kernels in 16-bit by (kernel, q block rows): 2 warps
# cover 16 or 32 rows, 64 rows take 4 (a warp group), the dQ pass there 1 stage
QC_LAUNCH = MappingProxyType({("fwd", 16): (2, 2), ("fwd", 32): (2, 2), ("fwd", 64): (4, 2),
                              ("dq", 16): (2, 2), ("dq", 32): (2, 2), ("dq", 64): (4, 1)})
KERNELS = ("fwd", "dq", "dkv")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_group(G: int) -> int:
    """Rows one position takes in a q block: its G heads as a power of two."""
    return _next_pow2(G)


def tile_positions(G: int, rows: int) -> int:
    """Positions per q block of `rows` rows: rows // padded_group(G), at least 1 and at least 16
    rows. With one position per q block (G >= 16) the BlockMask's lists are the selection itself
    (no union over positions)."""
    gp = padded_group(G)
    return max(1, rows // gp, -(-16 // gp))


@dataclass(frozen=True)
class SelectedTuning:
    rows: int = 16
    fwd_wide_rows: int = 64
    wide_dq_cost: int = 2
    dq_atomic: bool | None = None
    atomic_max_row: int = 512
    heavy: int = 16
    split_tiles: int = 256
    dkv_rows: int = 128
    fwd_launch: tuple[int, int] | None = None  # (num_warps, num_stages) over the defaults
    dq_launch: tuple[int, int] | None = None
    dkv_launch: tuple[int, int] | None = None

    def fwd_rows(self, G: int) -> int:
        """Rows of the forward's q blocks: fwd_wide_rows at G >= 16, else (and at least) rows."""
        return max(self.rows, self.fwd_wide_rows if G >= 16 else self.rows)

    def fuse_dq(self, G: int, d_qk: int) -> bool:
        """Whether the backward accumulates dQ in the dK/dV pass (dq_atomic, or by shape)."""
        return self.dq_atomic if self.dq_atomic is not None else G * d_qk <= self.atomic_max_row

    def dq_hybrid(self, G: int, rows_wide: int, rows: int) -> int:
        """Wide q blocks' positions per narrow one when the dQ pass runs hybrid (0: not): where
        the forward's q blocks (`rows_wide`) hold a power-of-two multiple of the dQ pass's."""
        kw, r = divmod(tile_positions(G, rows_wide), tile_positions(G, rows))
        return kw if kw > 1 and r == 0 and kw & (kw - 1) == 0 else 0

    def launch_opts(self, kernel: str, dtype, rows: int = 16) -> dict:
        """num_warps / num_stages of `kernel` (fwd, dq, dkv; `rows`: the query-centric kernels' q
        block rows): the override, else fp32 and dK/dV 8 warps, else QC_LAUNCH (4 warps, 2 stages
        for rows it does not list)."""
        over = getattr(self, f"{kernel}_launch")
        if over is not None:
            w, st = over
        elif dtype == torch.float32 or kernel == "dkv":  # fp32 tiles take twice the registers
            w, st = 8, 2
        else:
            w, st = QC_LAUNCH.get((kernel, rows), (4, 2))
        return {"num_warps": w, "num_stages": st}

    # a torch.library op takes tensors and scalars only: the record crosses it as a list of ints
    def encode(self) -> list[int]:
        out = []
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if f.name.endswith("_launch"):
                out += [0, 0] if x is None else list(x)
            else:
                out.append(-1 if x is None else int(x))
        return out

    @classmethod
    def decode(cls, xs) -> "SelectedTuning":
        xs, kw = list(xs), {}
        for f in dataclasses.fields(cls):
            if f.name.endswith("_launch"):
                w, st = xs.pop(0), xs.pop(0)
                kw[f.name] = None if w == 0 else (w, st)
            elif f.name == "dq_atomic":
                x = xs.pop(0)
                kw[f.name] = None if x < 0 else bool(x)
            else:
                kw[f.name] = xs.pop(0)
        return cls(**kw)


DEFAULT_TUNING = SelectedTuning()
