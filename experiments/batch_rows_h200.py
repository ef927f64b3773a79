"""The check that found the compiled layer's batch-row fault (experiments/NOTES.md 91), as run on
one H200: `gpu_kl_pair`'s layers (tests/layer/distill_helpers.py: the block-indexer configuration,
B = 2 x 1024 tokens, a document boundary at 300), compiled flex against the reference in fp32, per
batch row; then eager flex, row 1 alone, the rows swapped, and no documents. The same comparison,
route by route, is tests/layer/test_batch_rows_gpu.py.

    python experiments/batch_rows_h200.py      (from the repository root, a CUDA GPU)"""

import os
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "layer"))
from distill_helpers import gpu_kl_pair  # noqa: E402

SHAPE = dict(dim=256, n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, l=32, d=16, l_sel=64, n_sel=8,
             window=256, phi="mlp", sel_scores="indexer", sel_distill=1.0, indexer_heads=2,
             indexer_dim=64)


def rows(got, want) -> list[str]:
    """Per batch row: the share of positions off by > 1e-2 of the largest output, the largest."""
    e = (got - want).abs().amax(-1) / want.abs().amax()
    return [f"row {i}: off {float((e[i] > 1e-2).float().mean()):.3f} max {float(e[i].max()):.2e}"
            for i in range(e.shape[0])]


def main():
    if not torch.cuda.is_available():
        raise SystemExit("batch_rows_h200.py: needs a CUDA GPU")
    ref, flex, x, doc_ids = gpu_kl_pair(SHAPE, lambda m: (m.wq, m.wk["sel"], m.indexer.wq, m.indexer.wk))
    ref.telemetry = flex.telemetry = False
    c = torch.compile(flex, fullgraph=True)
    with torch.no_grad():
        want = ref(x, doc_ids)
        print("compiled, B=2  ", rows(c(x, doc_ids), want))
        print("eager flex, B=2", rows(flex(x, doc_ids), want))
        print("compiled, row 1", rows(c(x[1:], doc_ids[1:]), want[1:]))
        swap = [1, 0]
        print("compiled, swap ", rows(c(x[swap], doc_ids[swap]), want[swap]))
        none = torch.zeros_like(doc_ids)
        print("compiled, no documents", rows(c(x, none), ref(x, none)))


if __name__ == "__main__":
    main()
