"""NSA training telemetry: per-layer gate statistics, selected-block distances, tokens read per branch.

Design (cheap, compile- / FSDP- / activation-checkpointing-safe):

* Recording. ``NSAAttention.telemetry`` is a plain bool, off by default. When it is on (set once,
  before the first -- possibly compiled -- call; the trainer's metrics processor does it for every
  ``NSAAttention`` when ``[nsa] telemetry_every > 0``), every forward computes a small float32
  vector (:data:`STATS_SIZE` numbers, :func:`layer_stats`) under ``no_grad`` and writes it with one
  in-place ``copy_`` into the layer's non-persistent buffer ``telemetry_stats``. That is tensor
  computation only: torch.compile(fullgraph=True) traces it like a BatchNorm running-stat update
  (dynamo guards on the bool, so there is one graph, no recompiles), activation checkpointing's
  recompute writes the same values again, FSDP2 leaves buffers alone, and nothing reaches the
  state dict or the checkpoint. Cost: a few reductions over the gate tensor [B, H, T, 3] plus each
  enabled branch's mask evaluated for :data:`N_QUERIES` query rows (B x heads x 64 x T booleans),
  negligible next to the attention itself. With gradient accumulation the buffer holds the last
  microbatch; a validation forward overwrites it after the step's metrics were read.
* Reading. Every ``telemetry_every`` steps the metrics processor (``nsa_flex.titan.metrics``) stacks
  the layers' buffers, averages them over the data-parallel ranks (one all-reduce of
  n_layers x STATS_SIZE floats), turns them into named scalars (:func:`telemetry_metrics`) that go
  through torchtitan's metric loggers (TensorBoard, and the JSONL file), prints one line per layer,
  adds a TensorBoard histogram of the selected-block distances, and feeds :class:`GateCollapseMonitor`.

Quantities (per layer; branches ``cmp``, ``sel``, ``win``; only enabled branches are reported):

* ``gate_mean/<b>``: mean over batch, positions and heads of the branch's sigmoid gate g.
* ``gate_entropy/<b>``: mean binary entropy of g in bits, H(g) = -g log2 g - (1-g) log2(1-g):
  1 at g = 0.5 (the initialisation), 0 for a saturated gate.
* ``gate_share/<b>``: mean of g_b / sum over the enabled branches of g: how the mix is split.
* ``reads/<b>``: keys the branch attends to per query (compressed tokens for ``cmp``), from the
  branch's own mask evaluated at N_QUERIES evenly spaced query positions (the last one included).
* ``sel_dist/<bin>``: fraction of the selection branch's selected blocks (blocks of l' keys with at
  least one visible key) at a distance, in blocks, of 0, 1, 2-3, 4-7, ... from the query's own block
  (log2 bins, the last one open); ``sel_dist_mean`` is the mean distance.
* ``sel_distill_kl``: the selection-distillation loss (``NSAConfig.sel_distill > 0``,
  :mod:`nsa_flex.distill`) of the training forward; absent where it is off.
* gate collapse: a branch whose gate mean stays above ``gate_collapse_threshold`` at every telemetry
  step over at least ``gate_collapse_steps`` training steps (from the first such step to the
  current one, inclusive) gets one warning; the streak re-arms once the mean drops back.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .rules import BRANCHES
N_BINS = 12  # distance bins: 0, 1, 2-3, 4-7, ..., 512-1023, >= 1024 blocks
N_QUERIES = 64  # query positions at which the masks are evaluated

# layout of one layer's stats vector
GATE_MEAN = slice(0, 3)
GATE_ENTROPY = slice(3, 6)
GATE_SHARE = slice(6, 9)
READS = slice(9, 12)
DIST_SUM, DIST_SQ, DIST_CNT = 12, 13, 14
HIST = slice(15, 15 + N_BINS)
DISTILL = 15 + N_BINS  # the selection-distillation KL (nsa_flex/distill.py); -1 where it is off
STATS_SIZE = 16 + N_BINS


def bin_labels() -> list[str]:
    out = ["0", "1"]
    for k in range(1, N_BINS - 2):
        out.append(f"{2 ** k}-{2 ** (k + 1) - 1}")
    out.append(f"{2 ** (N_BINS - 2)}+")
    return out


def distance_bins(dist: Tensor) -> Tensor:
    """Log2 bin of non-negative integer distances: 0 -> 0, 1 -> 1, 2..3 -> 2, 4..7 -> 3, ...,
    >= 2^(N_BINS-2) -> N_BINS-1. Integer comparisons only (exact, traceable)."""
    b = torch.zeros_like(dist)
    for k in range(N_BINS - 1):
        b = b + (dist >= 2 ** k).to(dist.dtype)
    return b


def binary_entropy_bits(g: Tensor) -> Tensor:
    """H(g) = -g log2 g - (1-g) log2(1-g), elementwise, 0 at g in {0, 1}."""
    g = g.float()
    return -(torch.special.xlogy(g, g) + torch.special.xlogy(1 - g, 1 - g)) / math.log(2.0)


def query_positions(T: int, n: int = N_QUERIES) -> list[int]:
    """n (at most T) evenly spaced query positions, ending at T - 1."""
    S = min(T, n)
    return [((i + 1) * T) // S - 1 for i in range(S)]


def mask_rows(spec, B: int, q_pos: Tensor, kv_len: int) -> Tensor:
    """The mask of ``spec`` at query rows ``q_pos`` [S]: bool [B, heads, S, kv_len] (mask_mod only)."""
    dev = q_pos.device
    H = spec.heads
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    q = q_pos.view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=dev).view(1, 1, 1, kv_len)
    return spec.mask_mod(b, h, q, kv).expand(B, H, q_pos.numel(), kv_len)


def selection_distance_counts(rows: Tensor, q_pos: Tensor, l_sel: int) -> Tensor:
    """rows [B, H, S, T] visible keys of the selection branch -> [N_BINS + 3]: histogram counts of
    the selected blocks' distances (in l'-blocks from the query's block), then their sum, sum of
    squares and count."""
    B, H, S, T = rows.shape
    nblk = -(-T // l_sel)
    pad = nblk * l_sel - T
    if pad:
        rows = torch.cat([rows, rows.new_zeros(B, H, S, pad)], -1)
    blocks = rows.view(B, H, S, nblk, l_sel).any(-1)
    cnt = blocks.float().sum((0, 1))  # [S, nblk]
    dist = (q_pos // l_sel).view(S, 1) - torch.arange(nblk, device=rows.device).view(1, nblk)
    dist = dist.clamp_min(0)  # blocks after the query's own are never visible (causal masks)
    hist = torch.zeros(N_BINS, device=rows.device).scatter_add_(
        0, distance_bins(dist).flatten(), cnt.flatten())
    df = dist.float()
    tail = torch.stack([(cnt * df).sum(), (cnt * df * df).sum(), cnt.sum()])
    return torch.cat([hist, tail])


def layer_stats(g: Tensor, enabled: tuple[bool, bool, bool], specs: dict, l_sel: int,
                T: int, distill: Tensor | None = None) -> Tensor:
    """One layer's telemetry vector [STATS_SIZE] (float32).

    g: the sigmoid gates [B, H, T, 3] (branch order BRANCHES); enabled: which branches feed the
    output; specs: branch -> (MaskSpec, kv_len) of the enabled branches. A sequence shard
    (context parallelism): the statistics of its rows, whose positions are the spec's
    (`MaskSpec.q_offset`). distill: the step's selection-distillation KL, None where it is off."""
    g = g.detach().float()
    B = g.shape[0]
    dev = g.device
    mean = g.mean((0, 1, 2))
    ent = binary_entropy_bits(g).mean((0, 1, 2))
    on = torch.tensor([float(e) for e in enabled], device=dev)
    ge = g * on
    share = (ge / ge.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)).mean((0, 1, 2))
    q_rows = torch.tensor(query_positions(T), device=dev, dtype=torch.long)
    reads = []
    dist = torch.zeros(N_BINS + 3, device=dev)
    for name in BRANCHES:
        if name not in specs:
            reads.append(torch.zeros((), device=dev))
            continue
        spec, kv_len = specs[name]
        if kv_len == 0:
            reads.append(torch.zeros((), device=dev))
            continue
        q_pos = q_rows + spec.q_offset
        rows = mask_rows(spec, B, q_pos, kv_len)
        reads.append(rows.sum(-1).float().mean())
        if name == "sel":
            dist = selection_distance_counts(rows, q_pos, l_sel)
    kl = torch.full((1,), -1.0, device=dev) if distill is None else distill.detach().float().view(1)
    return torch.cat([mean, ent, share, torch.stack(reads), dist[N_BINS:], dist[:N_BINS], kl])


# ---------------------------------------------------------------------- host side
def telemetry_metrics(stats: Tensor, enabled: list[tuple[bool, bool, bool]]) -> dict[str, float]:
    """stats [L, STATS_SIZE] (one row per layer, DP-averaged) -> named scalars:
    ``nsa/layer{i}/{gate_mean,gate_entropy,gate_share,reads}/{branch}``, ``nsa/layer{i}/sel_dist/{bin}``
    (fractions), ``nsa/layer{i}/sel_dist_mean``, ``nsa/layer{i}/sel_distill_kl`` (where the
    selection distillation runs), and the means over layers ``nsa/{...}/{branch}``."""
    stats = stats.detach().float().cpu()
    out: dict[str, float] = {}
    labels = bin_labels()
    sums: dict[str, list[float]] = {}
    for i, row in enumerate(stats):
        on = enabled[i]
        for key, sl in (("gate_mean", GATE_MEAN), ("gate_entropy", GATE_ENTROPY),
                        ("gate_share", GATE_SHARE), ("reads", READS)):
            vals = row[sl].tolist()
            for j, b in enumerate(BRANCHES):
                if on[j]:
                    out[f"nsa/layer{i}/{key}/{b}"] = vals[j]
                    sums.setdefault(f"nsa/{key}/{b}", []).append(vals[j])
        cnt = float(row[DIST_CNT])
        if on[1] and cnt > 0:
            hist = (row[HIST] / cnt).tolist()
            for lab, v in zip(labels, hist):
                out[f"nsa/layer{i}/sel_dist/{lab}"] = v
            out[f"nsa/layer{i}/sel_dist_mean"] = float(row[DIST_SUM]) / cnt
            sums.setdefault("nsa/sel_dist_mean", []).append(float(row[DIST_SUM]) / cnt)
        if float(row[DISTILL]) >= 0:
            out[f"nsa/layer{i}/sel_distill_kl"] = float(row[DISTILL])
            sums.setdefault("nsa/sel_distill_kl", []).append(float(row[DISTILL]))
    for k, v in sums.items():
        out[k] = sum(v) / len(v)
    return out


def format_layer_line(i: int, row: Tensor, on: tuple[bool, bool, bool]) -> str:
    """One console line of layer i's telemetry."""
    row = row.float().cpu()
    gm, ge, rd = row[GATE_MEAN].tolist(), row[GATE_ENTROPY].tolist(), row[READS].tolist()
    parts = [f"{b} {gm[j]:.3f} (H {ge[j]:.2f}b)" for j, b in enumerate(BRANCHES) if on[j]]
    reads = " ".join(f"{b} {rd[j]:.1f}" for j, b in enumerate(BRANCHES) if on[j])
    line = f"layer {i}: gate {' '.join(parts)} | reads {reads}"
    cnt = float(row[DIST_CNT])
    if on[1] and cnt > 0:
        hist = (row[HIST] / cnt).tolist()
        last = max(k for k, v in enumerate(hist) if v > 0)
        line += " | sel dist " + " ".join(f"{lab}:{100 * v:.0f}%" for lab, v in
                                           zip(bin_labels()[: last + 1], hist[: last + 1]))
        line += f" (mean {float(row[DIST_SUM]) / cnt:.1f} blocks)"
    if float(row[DISTILL]) >= 0:
        line += f" | distill KL {float(row[DISTILL]):.4g}"
    return line


def histogram_raw(row: Tensor) -> dict | None:
    """Arguments of SummaryWriter.add_histogram_raw for one layer's selected-block distances."""
    row = row.float().cpu()
    cnt = float(row[DIST_CNT])
    if cnt <= 0:
        return None
    counts = row[HIST].tolist()
    # right bucket edges of the bins 0 | 1 | 2-3 | 4-7 | ...; the last (open) bin ends at its max
    limits = [0.5] + [2.0 ** k - 0.5 for k in range(1, N_BINS)]
    nz = [k for k, c in enumerate(counts) if c > 0]
    lo = 0.0 if nz[0] == 0 else float(2 ** (nz[0] - 1))
    hi = limits[nz[-1]] - 0.5 if nz[-1] < N_BINS - 1 else float(2 ** (N_BINS - 1))
    return dict(min=lo, max=hi, num=cnt, sum=float(row[DIST_SUM]), sum_squares=float(row[DIST_SQ]),
                bucket_limits=limits, bucket_counts=counts)


class GateCollapseMonitor:
    """Warns once when a (layer, branch) gate mean stays above ``threshold`` at every telemetry step
    over at least ``steps`` training steps; re-arms when the mean drops back to or below it."""

    def __init__(self, threshold: float, steps: int):
        self.threshold = threshold
        self.steps = steps
        self.since: dict[tuple[int, str], int] = {}
        self.warned: set[tuple[int, str]] = set()

    def update(self, step: int, means: dict[tuple[int, str], float]) -> list[str]:
        out = []
        for key, v in means.items():
            if not v > self.threshold:
                self.since.pop(key, None)
                self.warned.discard(key)
                continue
            s0 = self.since.setdefault(key, step)
            if step - s0 + 1 >= self.steps and key not in self.warned:
                self.warned.add(key)
                layer, branch = key
                out.append(
                    f"NSA gate collapse: layer {layer} branch {branch!r} gate mean {v:.4f} > "
                    f"gate_collapse_threshold={self.threshold} at every telemetry step since step {s0} "
                    f"({step - s0 + 1} steps >= gate_collapse_steps={self.steps})")
        return out

    @property
    def collapsed(self) -> int:
        return len(self.warned)


def validate_settings(telemetry_every, threshold, steps) -> None:
    """Raise ValueError naming every bad [nsa] telemetry field."""
    errs = []
    if not isinstance(telemetry_every, int) or isinstance(telemetry_every, bool) or telemetry_every < 0:
        errs.append(f"nsa.telemetry_every={telemetry_every!r}: must be an integer >= 0 (0 = off)")
    if (not isinstance(threshold, (int, float)) or isinstance(threshold, bool)
            or not 0.0 < float(threshold) < 1.0):
        errs.append(f"nsa.gate_collapse_threshold={threshold!r}: must be a number in (0, 1)")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        errs.append(f"nsa.gate_collapse_steps={steps!r}: must be an integer >= 1")
    if errs:
        raise ValueError("invalid [nsa] telemetry settings: " + "; ".join(errs))
