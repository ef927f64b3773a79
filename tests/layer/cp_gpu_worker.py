"""torchrun worker of tests/layer/test_context_parallel_gpu.py: one NSA layer (the 125M shape),
bf16, flex backend, B = 1, T tokens with documents crossing the shard boundary; every rank runs the
one-GPU reference itself (with the shard's executors: flex, the torch scorer), then its shard; relative errors (norm of the difference over the norm of
the reference) of the output, input gradient and the rank-summed parameter gradients must stay
under TOL. Prints "cp_gpu_worker: ok" on rank 0."""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nsa_flex import NSAAttention, NSAConfig  # noqa: E402
from nsa_flex.context_parallel import SeqShard, split_seq  # noqa: E402

TOL = 2e-2  # bf16: other tile orders and reductions (the K/V gradients are reduce-scattered)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nsa")
    ap.add_argument("--seq", type=int, default=32768)
    a = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    N = dist.get_world_size()
    shard = SeqShard(dist.group.WORLD, dist.get_rank(), N)
    # the executors a shard runs (flex, the torch scorer) for the one-GPU reference too: the
    # comparison is of the sharding, not of our ops against flex (in bf16 a near-tie in the
    # scorer picks another block)
    cfg = NSAConfig(dim=768, n_heads=16, n_kv_heads=2, d_qk=64, d_v=64, masks=a.preset,
                    backend="flex", scorer="torch", sel_kernel="flex", cmp_kernel="flex")
    torch.manual_seed(0)
    layer = NSAAttention(cfg).cuda()
    layer.init_weights()
    with torch.no_grad():  # gates away from 0.5
        layer.gate.weight.normal_(0, 0.02)
    layer = layer.bfloat16()
    T = a.seq
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, cfg.dim, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(1, T, cfg.dim, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.arange(T, device="cuda")
    cuts = torch.tensor([T // 2 - 1000, T // 2 + 300, 3 * T // 4], device="cuda")
    doc_ids = (pos.unsqueeze(-1) >= cuts).sum(-1).unsqueeze(0)

    def run(xs, sh):
        layer.zero_grad(set_to_none=True)
        xs = xs.clone().requires_grad_(True)
        layer.shard = sh
        out = layer(xs, doc_ids)
        (out.float() * split_seq(w, sh).float()).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in layer.named_parameters() if p.grad is not None}
        return out.detach(), xs.grad, grads

    ref = run(x, SeqShard())
    got = run(split_seq(x, shard), shard)
    errs = {"output": rel(got[0], split_seq(ref[0], shard)),
            "input grad": rel(got[1], split_seq(ref[1], shard))}
    for n, gr in got[2].items():
        dist.all_reduce(gr)
        errs[f"grad {n}"] = rel(gr, ref[2][n])
    bad = {k: v for k, v in errs.items() if not v < TOL}
    print(f"rank {shard.rank}: worst {max(errs, key=errs.get)} {max(errs.values()):.2e}", flush=True)
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"rank {shard.rank}: relative errors over {TOL}: {bad}")
    if shard.rank == 0:
        print("cp_gpu_worker: ok", flush=True)


if __name__ == "__main__":
    main()
