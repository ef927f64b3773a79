"""Context parallelism: one sequence over the ranks of a process group.

Contiguous shards: rank r of N holds positions [r T/N, (r+1) T/N) of every row (no zig-zag:
NSA's selected and window branches read a bounded number of keys per query and the compressed
branch T/d, so contiguous shards are nearly balanced). Each rank projects its own queries and its
own per-branch keys and values; the keys and values a branch reads are all-gathered along the
sequence with torch's autograd-aware functional collective (`all_gather_tensor_autograd`: its
backward is a reduce-scatter, so every K/V gradient returns, summed, to the rank that owns the
position). Queries stay local: the masks see their rows at the shard's offset
(`masks.core.MaskSpec.q_offset`). Per layer and branch the all-gather moves
[B, n_kv_heads, T, d] of k and of v (see docs/context_parallel.md); parameters' gradients are
each rank's share and sum over the ranks (FSDP / DDP reduce over the data-and-context mesh).
"""

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor


@dataclass(frozen=True)
class SeqShard:
    """Where this rank's queries lie: shard `rank` of `size` equal contiguous shards of the
    sequence, the ranks of `group` (a ProcessGroup or DeviceMesh; None: one rank, no shard)."""
    group: object = None
    rank: int = 0
    size: int = 1

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def offset(self, local_len: int) -> int:
        """Position of this shard's first token."""
        return self.rank * local_len


NO_SHARD = SeqShard()


def shard_of(group) -> SeqShard:
    """The SeqShard of this process in `group` (a ProcessGroup; None: NO_SHARD)."""
    if group is None:
        return NO_SHARD
    import torch.distributed as dist

    return SeqShard(group, dist.get_rank(group), dist.get_world_size(group))


def gather_seq(x: Tensor, shard: SeqShard, dim: int) -> Tensor:
    """The whole sequence of x (this shard along `dim`), rank order; the gradient of the result
    flows back to each shard's owner (reduce-scatter)."""
    if not shard.sharded:
        return x
    return funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=dim, group=shard.group)


def with_halo(x: Tensor, shard: SeqShard, h: int, dim: int) -> Tensor:
    """x (this shard along `dim`) after the previous rank's last h entries (rank 0: x alone): what
    a sliding window of h + 1 keys reads. Every rank sends its last h entries (an all-gather of
    N * h entries, autograd-aware: a halo's gradient returns to its owner); rank 0 keeps an empty
    slice of them, so its backward joins the collective too. h <= x's length."""
    if not shard.sharded or h == 0:
        return x
    tails = gather_seq(x.narrow(dim, x.shape[dim] - h, h), shard, dim)
    prev = tails.narrow(dim, (shard.rank - 1) * h, h) if shard.rank else tails.narrow(dim, 0, 0)
    return torch.cat([prev, x], dim)


def gather_seq_nograd(x: Tensor, shard: SeqShard, dim: int) -> Tensor:
    """`gather_seq` of a tensor without gradient (token ids, draw steps)."""
    if not shard.sharded:
        return x
    return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), gather_dim=dim,
                                                       group=shard.group))


def range_of_seq_nograd(x: Tensor, shard: SeqShard, start: int, stop: int, dim: int) -> Tensor:
    """Positions [start, stop) of the whole sequence of x (this shard along `dim`), on every rank,
    without gathering the rest (logits at a few positions: the whole sequence's would not fit).
    Each rank writes its own positions of the range into zeros and one all-reduce sums them: exact,
    every entry is one rank's value plus zeros. Every rank passes the same start and stop."""
    if not shard.sharded:
        return x.narrow(dim, start, stop - start)
    n = x.shape[dim]
    lo = shard.offset(n)
    shape = list(x.shape)
    shape[dim] = stop - start
    out = x.new_zeros(shape)
    a, b = max(start, lo), min(stop, lo + n)
    if a < b:
        out.narrow(dim, a - start, b - a).copy_(x.narrow(dim, a - lo, b - a))
    return funcol.wait_tensor(funcol.all_reduce(out, "sum", group=shard.group))


def split_seq(x: Tensor, shard: SeqShard, dim: int = 1) -> Tensor:
    """This rank's shard of a whole-sequence tensor along `dim` (its length divisible by size)."""
    if not shard.sharded:
        return x
    if x.shape[dim] % shard.size:
        raise ValueError(f"split_seq: length {x.shape[dim]} is not divisible by the "
                         f"{shard.size} context-parallel ranks")
    return x.chunk(shard.size, dim=dim)[shard.rank]
