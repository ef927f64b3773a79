"""Which compiled path misreads batch rows after the first (experiments/NOTES.md 91): the layer
compiled on the flex backend at B rows against each row alone on the reference backend, fp32 (tf32
off), once as configured and once with each route swapped for another, so the variant whose rows
all match names the faulty piece.

    python experiments/batch_rows_diag.py [--out DIR]      (a CUDA GPU; ~2-4 min on an H200)

Variants: as configured; cmp_kernel / sel_kernel "flex" (flex instead of the cuDNN compressed op /
our selected op); the indexer's and the distillation's block masses with materialized values (the
one-hot is otherwise expanded over batch and heads, stride 0); and the layer without documents.
Each for sel_scores "cmp" and "indexer". Prints per row: the share of positions off by > 1e-3 of
the row's largest output and the largest error; writes DIR/batch_rows.csv."""

import argparse
import csv
import os
from dataclasses import replace

import torch

import nsa_flex.distill as distill
from nsa_flex import NSAAttention, NSAConfig

B, T = 3, 1024
SHAPE = dict(n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, dim=256, l=32, d=16, l_sel=64, n_sel=8,
             window=256, phi="mlp")
INDEXER = dict(sel_scores="indexer", sel_distill=1.0, indexer_heads=2, indexer_dim=64)


def docs(device) -> torch.Tensor:
    d = torch.zeros(B, T, dtype=torch.long, device=device)
    d[1, 300:] = 1
    d[2, 100:] = 1
    d[2, 700:] = 2
    return d


def materialized_block_mass(q, k, values, spec, backend):
    """block_mass with the values copied out per batch row and head (no stride-0 dims)."""
    B_, H = q.shape[:2]
    Hkv, S = k.shape[1], k.shape[2]
    v = values.expand(B_, Hkv, S, values.shape[-1]).contiguous()
    attend = distill.attend_reference if distill.resolve_backend(backend, q.device) == "reference" \
        else distill.attend_flex
    out, _ = attend(q, k, v, spec)
    return out.float().view(B_, Hkv, H // Hkv, q.shape[2], -1).mean(2)


def run(cfg, with_docs: bool, device) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    ref = NSAAttention(replace(cfg, backend="reference")).to(device)
    ref.init_weights()
    with torch.no_grad():
        sharp = [ref.wq, ref.wk["sel"]] + ([ref.indexer.wq, ref.indexer.wk] if ref.indexer
                                           else [ref.wk["cmp"]])
        for lin in sharp:
            lin.weight.normal_(0, 2 * cfg.dim ** -0.5)
    flex = NSAAttention(replace(cfg, backend="flex")).to(device)
    flex.load_state_dict(ref.state_dict())
    ref.eval(), flex.eval()
    x = torch.randn(B, T, cfg.dim, device=device)
    d = docs(device) if with_docs else None
    rows = []
    with torch.no_grad():
        got = torch.compile(flex, fullgraph=True, dynamic=False)(x, d)
        for b in range(B):
            want = ref(x[b:b + 1], None if d is None else d[b:b + 1])[0]
            err = (got[b] - want).abs().amax(-1) / want.abs().max()
            rows.append((float((err > 1e-3).float().mean()), float(err.max())))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for batch_rows.csv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("batch_rows_diag.py: needs a CUDA GPU (the compiled flex routes run there only)")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    variants = [("as configured", {}, True), ("cmp_kernel flex", {"cmp_kernel": "flex"}, True),
                ("sel_kernel flex", {"sel_kernel": "flex"}, True),
                ("materialized block-mass values", "materialize", True), ("no documents", {}, False)]
    table = []
    for scores in ("cmp", "indexer"):
        for name, change, with_docs in variants:
            cfg = NSAConfig(**SHAPE, **(INDEXER if scores == "indexer" else {}))
            saved = distill.block_mass
            try:
                if change == "materialize":
                    distill.block_mass = materialized_block_mass
                    import nsa_flex.indexer as indexer
                    indexer.block_mass = materialized_block_mass
                else:
                    cfg = replace(cfg, **change)
                rows = run(cfg, with_docs, dev)
            except Exception as e:  # a variant that cannot run here is reported, the rest go on
                rows = [(float("nan"), float("nan"))] * B
                print(f"{scores:8s} {name:32s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            finally:
                distill.block_mass = saved
                import nsa_flex.indexer as indexer
                indexer.block_mass = saved
            print(f"{scores:8s} {name:32s} " + "  ".join(
                f"row {b}: off {off:.3f} max {mx:.1e}" for b, (off, mx) in enumerate(rows)), flush=True)
            table += [dict(sel_scores=scores, variant=name, row=b, share_off=f"{off:.4f}", max_err=f"{mx:.3e}")
                      for b, (off, mx) in enumerate(rows)]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "batch_rows.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)


if __name__ == "__main__":
    main()
