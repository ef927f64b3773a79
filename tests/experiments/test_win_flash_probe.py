"""experiments/win_flash_probe.py (GPU-only: FlashAttention-2's local kernels): its fp32 reference,
against which it checks FA2, is the library's sliding-window mask (strictly causal, `window` keys
per query) on the reference backend."""

import math

import pytest
import torch

from masks import sliding_window
from nsa_flex.attention import attend_reference

from .scripts import load_script


@pytest.mark.parametrize("w", [1, 5, 64])
def test_probe_reference_is_the_window_mask(w):
    probe = load_script("win_flash_probe")
    g = torch.Generator().manual_seed(w)
    q, k, v = (torch.randn(1, h, 37, d, generator=g) for h, d in ((4, 16), (2, 16), (2, 8)))
    scale = 1 / math.sqrt(16)
    out, lse = probe.ref(q, k, v, w, scale)
    r_out, r_lse = attend_reference(q, k, v, sliding_window(w), scale)
    torch.testing.assert_close(out, r_out)
    torch.testing.assert_close(lse, r_lse)
