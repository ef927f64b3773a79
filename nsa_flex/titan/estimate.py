"""Memory and time estimates of a training config from its shapes, before anything is allocated
(used by ``nsa-train --preflight``).

Rough on purpose (within ~2x): they answer "will this fit / finish on this device", not "how much
exactly". Memory counts what autograd keeps for the backward pass:

* per decoder block, per token: the linear layers' inputs and outputs (norms, q/k/v, the three
  branch outputs, the gate, SwiGLU's hidden activations);
* the attention core: the ``reference`` backend (the CPU's) materializes each branch's scores and
  probabilities in fp32 and a boolean mask, ``[B, H, T, S]`` (S = T for the token branches, the
  number of compressed blocks for the compressed one); ``flex`` keeps only outputs and log-sum-exps
  (and the compressed branch on cuDNN, ``nsa.cmp_kernel`` auto / cudnn, its packed query and output;
  cudnn_lean keeps none);
* ``nsa.recompute``: the branches it names are not kept; one block's backward holds them again;
* the model: parameters, gradients and AdamW's two moments (fp32, sharded over the data-parallel
  ranks of FSDP), every block's activations (activation checkpointing keeps one block's plus each
  block's input), the fp32 logits and their gradient.

Time is the fp32/bf16 matmul rate measured on the device times the FLOPs of the shapes, with the
reference backend's dense attention counted in full.
"""

import os
import time

from masks import PRESETS
from nsa_flex.config import RECOMPUTED

GiB = 2**30


def ffn_hidden(args) -> int:
    """SwiGLU hidden size as torchtitan's FeedForward computes it from 4 x dim."""
    h = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        h = int(args.ffn_dim_multiplier * h)
    return args.multiple_of * ((h + args.multiple_of - 1) // args.multiple_of)


def _num_cmp(args, T: int) -> int:
    return 0 if T < args.l else (T - args.l) // args.d + 1


def _branches(args, T: int) -> list[tuple[str, int, float]]:
    """(branch, key count S, mean keys a query reads) of each enabled branch: compressed blocks
    for the compressed branch, tokens for the others (the selected blocks / the window bound the
    reach; a branch of another builder is counted as causal)."""
    cmp, sel, win = PRESETS[args.masks]
    names = (args.cmp_mask or cmp, args.sel_mask or sel, args.win_mask or win)
    reach = {"sliding_window": args.window, "topn": args.n_sel * args.l_sel,
             "random_selection": args.n_sel * args.l_sel, "local_selection": args.n_sel * args.l_sel}
    nc = _num_cmp(args, T)
    out = [("cmp", nc, nc / 2)] if names[0] != "none" else []
    return out + [(b, T, min(T / 2, reach.get(n, T)))
                  for b, n in zip(("sel", "win"), names[1:]) if n != "none"]


def _recomputed(args) -> tuple[str, ...]:
    return RECOMPUTED[getattr(args, "recompute", None) or "none"]


def block_activation_bytes(args, B: int, T: int, elem: int, recomputed: bool = False) -> float:
    """Bytes one decoder block keeps for its backward pass (plus the attention core's transient
    scores on the reference backend) at batch B, length T, activations of ``elem`` bytes.
    ``recomputed``: instead, the bytes of the branches ``recompute`` names, which a block keeps
    only while its own backward rebuilds them."""
    H, Hkv = args.n_heads, args.n_kv_heads
    again = _recomputed(args)
    parts = _branches(args, T)
    rebuilt = [b for b in parts if b[0] in again]
    if recomputed:
        branches, linear = rebuilt, 0
    else:
        branches = [b for b in parts if b[0] not in again]
        per_token = (6 * args.dim + 2 * H * args.d_qk + 2 * Hkv * (args.d_qk + args.d_v)
                     + (5 - len(rebuilt)) * H * args.d_v + 3 * H + 3 * ffn_hidden(args))
        linear = B * T * per_token * elem
    if args.backend == "reference":  # fp32 scores + probabilities (+ their gradient) and a bool mask
        core = sum(B * H * T * S * (3 * 4) + B * Hkv * T * S for _, S, _ in branches)
    else:  # flex: outputs and log-sum-exps per branch
        core = len(branches) * B * H * T * (args.d_v * elem + 4)
        if any(b[0] == "cmp" for b in branches) and \
                getattr(args, "cmp_kernel", "auto") in ("auto", "cudnn"):
            core += B * H * T * (args.d_qk + args.d_v) * elem  # cuDNN's packed q and output
    return linear + core


def block_flops(args, B: int, T: int) -> float:
    """FLOPs of one block's forward + backward (3x the forward)."""
    H, Hkv = args.n_heads, args.n_kv_heads
    weights = (args.dim * (H * args.d_qk + Hkv * (args.d_qk + args.d_v)) + H * args.d_v * args.dim
               + 3 * args.dim * ffn_hidden(args) + 3 * H * args.dim)
    linear = 2 * B * T * weights
    dense = args.backend == "reference"  # every (query, key) pair; flex: the pairs a query reads
    core = sum(2 * B * H * T * (S if dense else r) * (args.d_qk + args.d_v)
               for _, S, r in _branches(args, T))
    return 3 * (linear + core)


def training_bytes(args, nparams: int, B: int, T: int, elem: int, ac_mode: str, shards: int,
                   cp: int = 1) -> dict:
    """Per-rank bytes of one training step: parameter/gradient/AdamW states, activations, logits.
    With context parallelism (cp ranks, each T / cp positions) a rank's activations and logits
    are those of its shard, plus the whole sequence's all-gathered k, v of each branch, which
    every attention call keeps for its backward (per layer whose activations are kept)."""
    states = nparams * (4 + 4 + 8) / max(1, shards)
    Tq = T // max(1, cp)
    block = block_activation_bytes(args, B, Tq, elem)
    again = block_activation_bytes(args, B, Tq, elem, recomputed=True)  # one block's backward
    gathered = 3 * B * args.n_kv_heads * (T - Tq) * (args.d_qk + args.d_v) * elem
    if ac_mode == "full":
        acts = args.n_layers * B * Tq * args.dim * elem + block + again + gathered
    elif ac_mode in ("selective", "memory_budget"):
        acts = args.n_layers * (block + gathered) / 2 + block / 2 + again
    else:
        acts = args.n_layers * (block + gathered) + again
    logits = B * Tq * args.vocab_size * (4 + 4 + elem)
    return {"states": states, "activations": acts, "logits": logits, "total": states + acts + logits}


def available_bytes(device) -> float:
    """Memory free for this process on ``device`` (CUDA: free device memory; CPU: MemAvailable)."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def matmul_flops_per_s(device, dtype, n: int = 512, reps: int = 3) -> float:
    """Measured matmul rate (FLOP/s) of an n x n x n product, best of ``reps`` (quick on a CPU)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ a).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / max(best, 1e-9)


def fmt_bytes(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 10 else f"{b / 2**20:.0f} MiB"
