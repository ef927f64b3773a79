"""Selection statistics and traces of a checkpoint: which blocks the top-n selection picks, how
much adjacent positions and the positions of one tile share, and the gates at a given length.

    python -m nsa_flex.eval --task selection --config titan_configs/quality_125m_16k.toml \\
        --checkpoint outputs/quality_nsa/checkpoint --docs VAL.parquet --lengths 32768,65536 --out OUT
    python -m nsa_flex.eval --task selection --quick --out /tmp/sel      # CPU: debug model, 256

One sequence per length from --docs (the first document with that many tokens; --join: the
documents concatenated), one forward; each layer's top-n indices [kv heads, T, n_sel] are recorded
by wrapping the layer's ``select_topn`` (the training code path: selection_L<T>.npz keeps --trace-layers,
default the first, middle and last layer).

Statistics (per length and layer, over kv heads and positions; a row's set = its valid picks,
-1 slots excluded; "free" = without the forced blocks: block 0 when n_init = 1 and the n_local
blocks ending at the query's own):
  picks            mean valid picks per row
  adjacent_share   mean over rows t >= 1 of |S_t & S_t-1| / |S_t|
  tile_union       mean over --tile-row tiles (rows [64k, 64k+64)) of |union of the tile's S_t|:
                   the distinct blocks a tile of the attention kernel loads
  tile_density     mean over tiles of (mean |S_t|) / |union|: 1 = every row picks the same blocks
  tile_common      mean over tiles of |intersection| / (mean |S_t|)
  *_free           the same on the free picks
  gate_<b>         mean sigmoid gate of branch b at this length (the layer's telemetry)
  dist/<bin>       share of picks at a distance, in blocks, from the query's block (the training
                   telemetry's log2 bins: nsa_flex.telemetry)

Outputs under --out: selection_stats.csv (length, layer, the statistics), selection_blocks.csv
(length, layer, block, picks: the block pick histogram by absolute block index),
selection_L<T>.npz (compressed; ``layer<i>`` int16 [kv heads, T, n_sel], each row sorted, -1 last;
``tokens`` int32 [T]; ``l_sel``, ``n_sel``), selection.png, selection_meta.json.
"""

import csv
import json
import os
import time

import numpy as np
import torch

from nsa_flex.telemetry import GATE_MEAN, N_BINS, bin_labels, distance_bins

from .cli import add_docs_args, add_run_args, resolve_common, task_parser
from .docs import read_texts, token_sequences
from .needle import load, pick_backend, set_backend
from .prompts import EvalError, int_list
from .report import plot_selection

STATS = ("picks", "adjacent_share", "tile_union", "tile_density", "tile_common")


# ---------------------------------------------------------------------- statistics
def forced_mask(idx: torch.Tensor, l_sel: int, n_init: int, n_local: int) -> torch.Tensor:
    """idx [H, T, n] -> bool [H, T, n]: the pick is a forced block (block 0 when n_init = 1, or one
    of the n_local blocks ending at the query's own block)."""
    T = idx.shape[1]
    own = (torch.arange(T) // l_sel).view(1, T, 1)
    forced = (own - idx >= 0) & (own - idx < n_local)
    if n_init:
        forced |= idx == 0
    return forced & (idx >= 0)


def set_stats(idx: torch.Tensor, keep: torch.Tensor, n_blocks: int, tile: int) -> dict[str, float]:
    """The STATS of the picks idx [H, T, n] (int, -1 = none) where ``keep`` [H, T, n] is True."""
    H, T, n = idx.shape
    keep = keep & (idx >= 0)
    size = keep.sum(-1).double()  # [H, T]
    rows = size > 0
    out = {"picks": float(size.mean())}
    # adjacent rows: |S_t & S_t-1| / |S_t| (a row's valid picks are distinct)
    a, ka = idx[:, 1:], keep[:, 1:]
    b, kb = idx[:, :-1], keep[:, :-1]
    inter = ((a.unsqueeze(-1) == b.unsqueeze(-2)) & ka.unsqueeze(-1) & kb.unsqueeze(-2)).sum((-1, -2))
    both = rows[:, 1:]
    out["adjacent_share"] = float((inter[both] / size[:, 1:][both]).mean()) if both.any() else float("nan")
    # tiles of `tile` rows: per-block pick counts [H, tiles, n_blocks]
    n_tiles = -(-T // tile)
    t_of = (torch.arange(T) // tile).view(1, T, 1).expand(H, T, n)
    flat = (torch.arange(H).view(H, 1, 1) * n_tiles + t_of) * n_blocks + idx.clamp_min(0)
    counts = torch.zeros(H * n_tiles * n_blocks, dtype=torch.long)
    counts.index_add_(0, flat[keep], torch.ones(int(keep.sum()), dtype=torch.long))
    counts = counts.view(H, n_tiles, n_blocks)
    union = (counts > 0).sum(-1).double()
    pad = n_tiles * tile - T
    sz = torch.cat([size, size.new_zeros(H, pad)], 1).view(H, n_tiles, tile)
    n_rows = torch.full((n_tiles,), float(tile), dtype=torch.double)
    n_rows[-1] = tile - pad
    mean_sz = sz.sum(-1) / n_rows
    common = (counts == n_rows.long().view(1, n_tiles, 1)).sum(-1).double()
    ok = union > 0
    out["tile_union"] = float(union[ok].mean()) if ok.any() else 0.0
    out["tile_density"] = float((mean_sz[ok] / union[ok]).mean()) if ok.any() else float("nan")
    out["tile_common"] = float((common[ok] / mean_sz[ok]).mean()) if ok.any() else float("nan")
    return out


def selection_stats(idx, l_sel: int, n_init: int, n_local: int, tile: int = 64) -> dict:
    """All statistics of one layer's picks idx [H, T, n] (int, -1 = none): STATS, STATS_free,
    dist/<bin> (shares of picks per distance bin) and "blocks" (picks per absolute block index)."""
    idx = torch.as_tensor(np.asarray(idx)).long()
    H, T, n = idx.shape
    n_blocks = max(-(-T // l_sel), int(idx.max()) + 1)
    valid = idx >= 0
    out = set_stats(idx, valid, n_blocks, tile)
    free = set_stats(idx, valid & ~forced_mask(idx, l_sel, n_init, n_local), n_blocks, tile)
    out |= {f"{k}_free": v for k, v in free.items()}
    own = (torch.arange(T) // l_sel).view(1, T, 1)
    dist = distance_bins((own - idx).clamp_min(0)[valid])
    hist = torch.bincount(dist, minlength=N_BINS).double()
    out |= {f"dist/{lab}": float(h / max(1.0, float(hist.sum()))) for lab, h in zip(bin_labels(), hist)}
    out["blocks"] = torch.bincount(idx[valid], minlength=n_blocks).tolist()
    return out


def sorted_rows(idx: torch.Tensor) -> np.ndarray:
    """int16 copy of idx [..., n] with each row sorted ascending and -1 slots last."""
    if int(idx.max()) >= 2 ** 15:
        raise EvalError(f"selection traces are int16: block index {int(idx.max())} does not fit")
    big = torch.where(idx < 0, torch.full_like(idx, 2 ** 15), idx)
    s = big.sort(-1).values
    return torch.where(s == 2 ** 15, -1, s).to(torch.int16).numpy()


def load_trace(path: str, layer: int | None = None) -> tuple[torch.Tensor, dict]:
    """A recorded selection as the layer's ``select_topn`` returns it: int64 [1, Hkv, T, n_sel] (-1
    for unused slots) from selection_L<T>.npz, its ``layer`` (default: the first one saved), and
    {"layer", "l_sel", "n_sel", "T"}. Used to time the kernels on trained selections."""
    if not os.path.isfile(path):
        raise EvalError(f"selection trace {path!r}: no such file")
    with np.load(path) as z:
        layers = sorted(int(k[5:]) for k in z.files if k.startswith("layer"))
        if not layers:
            raise EvalError(f"selection trace {path!r}: no layer<i> arrays (files: {z.files})")
        if layer is None:
            layer = layers[0]
        if layer not in layers:
            raise EvalError(f"selection trace {path!r}: layer {layer} not saved; saved: {layers}")
        idx = torch.from_numpy(z[f"layer{layer}"].astype(np.int64)).unsqueeze(0)
        info = {"layer": layer, "l_sel": int(z["l_sel"]), "n_sel": int(z["n_sel"]), "T": idx.shape[2]}
    return idx, info


def load_trace_arg(spec: str) -> tuple[torch.Tensor, str]:
    """`load_trace` of a command-line argument NPZ[:LAYER[+LAYER...]]: (picks, a label for result
    rows, "trained:<file>:layer<i>[+<j>...]"). Several layers stack their KV heads (a recorded
    model's picks as the selection of a shape with more KV heads, e.g. the paper's four from two
    layers of two)."""
    path, _, lay = spec.partition(":")
    if not lay:
        idx, info = load_trace(path)
        return idx, f"trained:{os.path.basename(path)}:layer{info['layer']}"
    try:
        layers = [int(x) for x in lay.split("+")]
    except ValueError:
        raise EvalError(f"selection trace {spec!r}: layers must be integers joined by '+' "
                        "(NPZ:6 or NPZ:6+7)") from None
    idx = torch.cat([load_trace(path, i)[0] for i in layers], dim=1)
    return idx, f"trained:{os.path.basename(path)}:layer{'+'.join(map(str, layers))}"


def fit_trace(idx: torch.Tensor, label: str, Hkv: int, T: int, n: int) -> tuple[torch.Tensor, str]:
    """A trace's picks [1, Hkv', T', n'] as the selection of a shape (Hkv, T, n): its first T
    positions (a position's picks never lie after it, so they are a selection of T positions;
    the label gets "[:T]"). ValueError when the heads or n differ or T' < T."""
    if idx.shape[1] != Hkv or idx.shape[3] != n or idx.shape[2] < T:
        raise ValueError(f"the selection trace (Hkv, T, n) = {tuple(idx.shape[1:])} does not fit "
                         f"Hkv={Hkv}, T={T}, n={n}")
    if idx.shape[2] == T:
        return idx, label
    return idx[:, :, :T], f"{label}[:{T}]"


# ---------------------------------------------------------------------- recording
@torch.no_grad()
def record(model, tokens: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, list[float]]]:
    """One forward of tokens [1, T]: ({layer: picks [Hkv, T, n_sel] (int64, CPU)}, {layer: gate
    means per branch (cmp, sel, win)}) of every layer."""
    picks: dict[int, list] = {}
    atts = [blk.attention for blk in model.layers.values()]
    saved = []
    for i, att in enumerate(atts):
        orig = att.select_topn

        def wrapped(*a, _orig=orig, _i=i, **k):
            out = _orig(*a, **k)
            picks.setdefault(_i, []).append(out[0].cpu())
            return out

        saved.append((att, orig, att.telemetry))
        att.select_topn = wrapped
        att.telemetry = True
    try:
        model(tokens)
    finally:
        for att, orig, tel in saved:
            att.select_topn = orig
            att.telemetry = tel
    gates = {i: att.telemetry_stats[GATE_MEAN].float().cpu().tolist() for i, att in enumerate(atts)}
    return {i: torch.cat(v, 1) if len(v) > 1 else v[0] for i, v in picks.items()}, gates


# ---------------------------------------------------------------------- CLI
def evaluate(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    lengths = sorted(int_list(args.lengths, "--lengths", lo=2))
    if args.tile < 1:
        raise EvalError(f"--tile: {args.tile} must be >= 1")
    texts = read_texts(args.docs, args.text_column, "--docs")
    t0 = time.perf_counter()
    model, tok, desc = load(args)
    cfg = model.layers["0"].attention.cfg
    n_layers = len(model.layers)
    trace_layers = (sorted(int_list(args.trace_layers, "--trace-layers", lo=0, hi=n_layers - 1))
                    if args.trace_layers else sorted({0, n_layers // 2, n_layers - 1}))
    stats_rows, block_rows, meta = [], [], {"config": args.config, "checkpoint": args.checkpoint,
                                            "model": desc, "docs": args.docs, "join": args.join,
                                            "l_sel": cfg.l_sel, "n_sel": cfg.n_sel, "tile": args.tile,
                                            "trace_layers": trace_layers, "traces": {}}
    for L in lengths:
        seq = token_sequences(texts, tok, L, 1, args.join, "--docs")[0]
        backend = pick_backend(model, L, args.backend, args.device)
        set_backend(model, backend)
        tL = time.perf_counter()
        picks, gates = record(model, torch.tensor([seq], device=args.device))
        if not picks:
            raise EvalError(f"--config {args.config!r}: masks {model.model_args.masks!r} have no top-n "
                            "selection branch to record")
        for i in sorted(picks):
            s = selection_stats(picks[i], cfg.l_sel, cfg.n_init, cfg.n_local, args.tile)
            blocks = s.pop("blocks")
            stats_rows.append({"length": L, "layer": i, **{k: round(v, 5) for k, v in s.items()},
                               **{f"gate_{b}": round(g, 5) for b, g in zip(("cmp", "sel", "win"), gates[i])}})
            block_rows += [{"length": L, "layer": i, "block": j, "picks": c} for j, c in enumerate(blocks)]
            r = stats_rows[-1]
            print(f"  L={L} layer {i}: picks {r['picks']:.1f}, adjacent share {r['adjacent_share']:.3f} "
                  f"(free {r['adjacent_share_free']:.3f}), tile union {r['tile_union']:.1f} blocks "
                  f"(density {r['tile_density']:.3f})", flush=True)
        npz = os.path.join(args.out, f"selection_L{L}.npz")
        np.savez_compressed(npz, tokens=np.asarray(seq, dtype=np.int32), l_sel=cfg.l_sel, n_sel=cfg.n_sel,
                            **{f"layer{i}": sorted_rows(picks[i]) for i in trace_layers if i in picks})
        meta["traces"][L] = {"file": os.path.basename(npz), "bytes": os.path.getsize(npz),
                             "backend": backend, "seconds": round(time.perf_counter() - tL, 2)}
    for name, rows in (("selection_stats.csv", stats_rows), ("selection_blocks.csv", block_rows)):
        with open(os.path.join(args.out, name), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    plot_selection(stats_rows, block_rows, os.path.join(args.out, "selection.png"), args.tag)
    meta["seconds"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(args.out, "selection_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    traces = ", ".join(f"{v['file']} ({v['bytes'] / 2 ** 20:.2f} MiB)" for v in meta["traces"].values())
    print(f"# wrote selection_stats.csv, selection_blocks.csv, traces {traces} ({meta['seconds']:.1f}s)",
          flush=True)
    return {"stats": stats_rows, "blocks": block_rows, "meta": meta}


def parse_args(argv=None):
    p = task_parser(__doc__, "CPU smoke run: debug model, random weights, length 256",
                    prog="python -m nsa_flex.eval --task selection")
    add_docs_args(p)
    p.add_argument("--lengths", help="sequence lengths (default 32768,65536; --quick 256)")
    p.add_argument("--trace-layers", help="layers saved in the traces (default first, middle, last)")
    p.add_argument("--tile", type=int, default=64, help="rows per tile for the tile statistics")
    add_run_args(p, tag_help="figure title", override_example="--nsa.n_sel=8")
    a = resolve_common(p.parse_args(argv))
    if a.dtype not in ("float32", "bfloat16"):
        raise EvalError(f"--dtype: {a.dtype!r} not in ['float32', 'bfloat16']")
    if a.quick:
        a.lengths = a.lengths or "256"
    a.lengths = a.lengths or "32768,65536"
    return a


def main(argv=None):
    return evaluate(parse_args(argv))
