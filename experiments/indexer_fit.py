"""Can the block indexer (nsa_flex/indexer.py) express the distillation's target? Fits one layer's
indexer alone (Adam, lr 1e-2) to the target of fixed random weights (the selected branch's dense
block mass: q and keys of std 0.5 weights, RoPE), on a fresh batch of random inputs every step, and
prints the KL every 100 steps; `--nope` takes RoPE off the indexer's q and k (monkeypatched) to
show what it buys. On the CPU, ~1 min:

    OMP_NUM_THREADS=1 python experiments/indexer_fit.py [--nope]
"""

import argparse

import torch

import nsa_flex.indexer as indexer
from nsa_flex import NSAAttention, NSAConfig
from nsa_flex import telemetry as tm

p = argparse.ArgumentParser()
p.add_argument("--nope", action="store_true", help="no RoPE on the indexer's q and k")
p.add_argument("--steps", type=int, default=400)
args = p.parse_args()
if args.nope:
    indexer.apply_rope = lambda x, cos, sin: x

cfg = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16, n_sel=3,
                window=16, backend="reference", n_local=1, sel_scores="indexer", sel_distill=1.0,
                indexer_heads=2, indexer_dim=16)
torch.manual_seed(0)
m = NSAAttention(cfg)
m.init_weights()
with torch.no_grad():
    m.wq.weight.normal_(0, 0.5)
    m.wk["sel"].weight.normal_(0, 0.5)
opt = torch.optim.Adam(m.indexer.parameters(), lr=1e-2)
m.telemetry = True
for i in range(args.steps + 1):
    opt.zero_grad()
    (0 * m(torch.randn(4, 256, 64))).sum().backward()  # only the distillation's gradient
    opt.step()
    if i % 100 == 0:
        print(f"{'nope' if args.nope else 'rope'} step {i} KL {float(m.telemetry_stats[tm.DISTILL]):.3f}",
              flush=True)
