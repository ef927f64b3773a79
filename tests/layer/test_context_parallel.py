"""Context parallelism of the layer (issue 42): two gloo processes, each holding one contiguous
shard of the sequence, give the one-process output, input gradient and (summed over the ranks)
parameter gradients, in fp32 on the reference backend, for every preset, with documents that
cross the shard boundary and a compressed block that straddles it; the window reads its halo from
the previous rank (or, longer than a shard, the whole sequence); a range of positions reaches
every rank exactly (`range_of_seq_nograd`, the validator's logits at the answers). Under Triton's
interpreter the shards run the fast paths instead: the Triton scorer / top-n and the selection
branch on our selected op, against one process on the torch scorer and the reference backend."""

import contextlib
import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex.attention import BranchPlan
from nsa_flex.context_parallel import SeqShard, range_of_seq_nograd, split_seq
from nsa_flex.layer import window_halo
from nsa_flex.ops import HAS_TRITON

BASE = dict(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=8, d=4, l_sel=16, n_sel=3,
            window=12, backend="reference")
B, T, N = 2, 64, 2
# (preset, documents, extra config): T/N = 32; the compressed block at 28..35 straddles the
# boundary; documents cut at 30 and 41 (row 0) and 17 (row 1) cross it; window 12: a halo of 11
CASES = [("nsa", False, {}), ("nsa", True, {}), ("no_compressed", True, {}),
         ("random_selection", True, {}), ("local_selection", False, {}),
         ("full_causal", True, {}), ("sliding_only", False, {}),
         ("nsa", True, {"recompute": "all"}),
         # a window longer than a shard: the window's keys all-gathered, not a halo
         ("sliding_only", True, {"window": 40})]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer_for(preset: str, extra: dict, seed: int = 0) -> NSAAttention:
    torch.manual_seed(seed)
    layer = NSAAttention(NSAConfig(**{**BASE, "masks": preset, **extra}))
    layer.init_weights()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # O(1) outputs and gates away from 0.5: tight comparisons
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.5))
    return layer


def inputs(docs: bool):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, T, BASE["dim"], generator=g)
    w = torch.randn(B, T, BASE["dim"], generator=g)  # the loss's weights: sum(w * out)
    if not docs:
        return x, w, None
    pos = torch.arange(T)
    doc_ids = torch.stack([(pos >= 30).long() + (pos >= 41).long(), (pos >= 17).long()])
    return x, w, doc_ids


def one_process(layer, x, w, doc_ids):
    x = x.clone().requires_grad_(True)
    out = layer(x, doc_ids)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def sharded(layer, x, w, doc_ids, shard, shared: bool):
    """The shard's output, input gradient and (summed) parameter gradients; shared: the layer
    reads a model's `StepMasks` of the shard (built once a step), else builds its own."""
    xs = split_seq(x, shard).clone().requires_grad_(True)
    if shared:
        out = layer(xs, masks=layer.step_masks(xs.shape[0], xs.shape[1], xs.device, doc_ids, shard))
    else:
        layer.shard = shard
        out = layer(xs, doc_ids)
    (out * split_seq(w, shard)).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        if p.grad is not None:  # each rank holds its share: the sum is the whole gradient
            dist.all_reduce(p.grad)
            grads[n] = p.grad
    return out.detach(), xs.grad, grads


@contextlib.contextmanager
def gloo_shard(rank: int, port: int):
    """This spawned process in a gloo group of N: its SeqShard. Where the block's checks pass, the
    group is torn down and the process ends at once (os._exit): gloo's threads left to the
    interpreter's exit abort it now and then ("terminate called without an active exception",
    SIGABRT), which fails a test whose checks all passed. A failing check raises (mp.spawn reports
    it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=N)
    try:
        yield SeqShard(dist.group.WORLD, rank, N)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    os._exit(0)


def assert_shard_equal(got, ref, shard: SeqShard, what: str, rtol: float = 1e-5, atol: float = 1e-5):
    """A shard's (output, input gradient, summed parameter gradients) against one process's."""
    torch.testing.assert_close(got[0], split_seq(ref[0], shard), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(got[1], split_seq(ref[1], shard), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} input gradient: {m}")
    assert got[2].keys() == ref[2].keys(), what
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} gradient of {n}: {m}")


def worker(rank: int, port: int):
    with gloo_shard(rank, port) as shard:
        for (preset, docs, extra), shared in itertools.product(CASES, (False, True)):
            x, w, doc_ids = inputs(docs)
            ref = one_process(layer_for(preset, extra), x, w, doc_ids)
            got = sharded(layer_for(preset, extra), x, w, doc_ids, shard, shared)
            assert_shard_equal(got, ref, shard, f"{preset} docs={docs} {extra} shared masks={shared}")
        # a range of positions (logits at the answers) reaches every rank exactly: across the
        # boundary, on one rank, on the other
        whole = torch.randn(B, T, 5, generator=torch.Generator().manual_seed(0))
        for start, stop in ((28, 40), (3, 9), (50, 64)):
            got = range_of_seq_nograd(split_seq(whole, shard), shard, start, stop, 1)
            assert torch.equal(got, whole[:, start:stop]), (start, stop)


def test_two_shards_equal_one_process():
    mp.spawn(worker, args=(free_port(),), nprocs=N, join=True)


def on_fast_paths(layer: NSAAttention) -> NSAAttention:
    """The layer with the Triton scorer / top-n and the selection branch on our selected op (the
    other branches on the reference backend): what a GPU shard runs for the selection."""
    layer.cfg = NSAConfig(**{**layer.cfg.to_dict(), "scorer": "triton"})
    layer.plans["sel"] = BranchPlan("flex", "selected", "selected", strict=True)
    return layer


def fast_worker(rank: int, port: int):
    with gloo_shard(rank, port) as shard:
        dims = {"d_qk": 16, "d_v": 16}  # the selected op's smallest head dims
        for docs in (False, True):
            x, w, doc_ids = inputs(docs)
            ref = one_process(layer_for("nsa", dims), x, w, doc_ids)
            got = sharded(on_fast_paths(layer_for("nsa", dims)), x, w, doc_ids, shard, True)
            # the op's fp32 sums run in another order
            assert_shard_equal(got, ref, shard, f"fast paths docs={docs}", rtol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_two_shards_on_the_fast_paths_equal_one_process(monkeypatch):
    """Each rank's shard on the Triton scorer and our selected op (Triton's interpreter: set
    before the spawned processes import triton) equals one process on the torch paths."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mp.spawn(fast_worker, args=(free_port(),), nprocs=N, join=True)


def test_split_seq_refuses_an_uneven_length():
    with pytest.raises(ValueError, match="not divisible by the 2"):
        split_seq(torch.zeros(1, 5), SeqShard(None, 0, 2))


def test_the_window_reads_a_halo_where_one_suffices():
    two = SeqShard(None, 1, 2)
    assert window_halo(layer_for("nsa", {}).cfg, two, 32) == 11  # window 12: the 11 keys before
    assert window_halo(layer_for("nsa", {}).cfg, SeqShard(), 32) is None  # no shard
    assert window_halo(layer_for("nsa", {"window": 40}).cfg, two, 32) is None  # longer than a shard
    assert window_halo(layer_for("nsa", {"win_mask": "causal"}).cfg, two, 32) is None  # any key
