"""Flex backward candidates: one small config is added only where inductor's own do not fit the
mask's sparse blocks (else every flex backward autotunes over several candidates)."""

import pytest
import torch

from nsa_flex.kernel_options import (
    _caller_block_sizes, _fits, flex_kernel_options, install_small_block_bwd_configs,
    needs_small_block_bwd_configs, packed_block_size, with_small_block_configs,
)
from torch._inductor.choices import InductorChoices
from torch._inductor.template_heuristics.triton import FlexBwDConfig

SM90_192 = FlexBwDConfig(64, 64, 64, 64, 2, 4)  # inductor's sm90 default for head_dim 192


@pytest.mark.parametrize("qb,kb,added", [(128, 128, 0), (64, 64, 0), (16, 64, 1), (16, 32, 1),
                                         (16, 16, 1), (32, 64, 1)])
def test_small_config_only_when_defaults_do_not_fit(qb, kb, added):
    out = with_small_block_configs([SM90_192], 192, (qb, kb))
    assert out[0] == SM90_192 and len(out) == 1 + added
    assert any(_fits(c, qb, kb) for c in out)
    if added:
        assert _fits(out[-1], qb, kb) and out[-1].block_m1 == 16


def test_unknown_block_sizes_append_all_small_configs():
    out = with_small_block_configs([SM90_192], 192, None)
    assert out[0] == SM90_192 and len(out) == 4 and out[1].block_n1 == 64


def test_block_sizes_read_from_the_lowering_frame():
    def lowering(SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE):
        import sys
        return _caller_block_sizes(sys._getframe(0))

    def nested():
        import sys
        return _caller_block_sizes(sys._getframe(0))

    assert lowering(16, 64) == (16, 64)
    assert nested() is None


@pytest.mark.slow
def test_import_installs_nothing_and_only_old_torch_needs_the_wrapper():
    """`import nsa_flex` leaves inductor as it is; building a flex layer installs the wrapper,
    on the torch versions that filter before kernel_options (#176025) only."""
    import subprocess
    import sys

    code = ("import nsa_flex; from torch._inductor.choices import InductorChoices as C; "
            "f = C.get_flex_attention_bwd_configs; print(f.__module__); "
            "nsa_flex.NSAAttention(nsa_flex.NSAConfig(backend='flex')); "
            "print(C.get_flex_attention_bwd_configs.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert out[0] == "torch._inductor.choices"
    assert out[1] == ("nsa_flex.kernel_options" if needs_small_block_bwd_configs()
                      else "torch._inductor.choices")
    assert needs_small_block_bwd_configs("2.11.0+cu128") and needs_small_block_bwd_configs("2.13.0")
    assert not needs_small_block_bwd_configs("2.14.0") and not needs_small_block_bwd_configs("3.0.0")


def test_hook_installed_on_inductor_choices():
    if not install_small_block_bwd_configs():
        pytest.skip("this torch applies kernel_options before filtering (#184797)")
    def lowering(SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE):
        return InductorChoices().get_flex_attention_bwd_configs(192, torch.bfloat16, "cpu")

    big, small = lowering(128, 128), lowering(16, 64)
    assert len(small) == len(big) + (0 if any(_fits(c, 16, 64) for c in big) else 1)
    assert any(_fits(c, 16, 64) for c in small)


def test_kernel_options_tiles_divide_packed_blocks():
    class Spec:
        kv_block = 64
    qb, kb = packed_block_size(16, Spec)
    assert (qb, kb) == (16, 64)
    assert flex_kernel_options(torch.empty(1), (qb, kb)) is None  # CPU: inductor's own choice

    class CudaQ:
        device = torch.device("cuda", 0)
        dtype = torch.bfloat16
        shape = (1, 64, 4096, 192)
    opts = flex_kernel_options(CudaQ, (qb, kb))
    _check_tiles(opts, qb, kb)


def _check_tiles(opts, qb, kb):
    """What inductor's flex templates need of explicit tiles for (q block, kv block) sizes."""
    assert qb % opts.get("fwd_BLOCK_M", 16) == 0 and kb % opts.get("fwd_BLOCK_N", 16) == 0
    assert kb % opts["bwd_BLOCK_N1"] == 0 and opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0
    assert qb % opts["bwd_BLOCK_M2"] == 0 and kb % opts["bwd_BLOCK_N2"] == 0
    assert opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0


def test_packed_options_override_by_head_dim(monkeypatch):
    import nsa_flex.kernel_options as ko

    class CudaQ:
        device = torch.device("cuda", 0)
        dtype = torch.bfloat16
        shape = (1, 64, 4096, 192)
    monkeypatch.setattr(ko, "PACKED_OPTIONS", {192: {"bwd_num_stages": 3}})
    got = ko.flex_kernel_options(CudaQ, (16, 64))
    assert got["bwd_num_stages"] == 3 and got["bwd_BLOCK_M1"] == 16
    monkeypatch.setattr(ko, "PACKED_OPTIONS", {128: {"bwd_num_stages": 3}})
    assert "bwd_num_stages" not in ko.flex_kernel_options(CudaQ, (16, 64))


def test_band_options_fit_the_128_blocks():
    """The measured BAND_OPTIONS serve flex calls with 128 x 128 sparse blocks."""
    from nsa_flex.kernel_options import BAND_OPTIONS

    for opts in BAND_OPTIONS.values():
        _check_tiles(opts, 128, 128)


def test_band_kernel_options_by_head_dim(monkeypatch):
    """Non-packed flex calls get BAND_OPTIONS of their head dim on CUDA (a copy), else None."""
    from types import SimpleNamespace

    from nsa_flex import kernel_options as ko

    monkeypatch.setattr(ko, "BAND_OPTIONS", {192: {"bwd_num_warps": 8}})
    cuda_q = lambda d: SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16,
                                       shape=(1, 4, 8, d))
    got = ko.band_kernel_options(cuda_q(192))
    assert got == {"bwd_num_warps": 8} and got is not ko.BAND_OPTIONS[192]
    assert ko.band_kernel_options(cuda_q(128)) is None
    assert ko.band_kernel_options(torch.zeros(1, 4, 8, 192)) is None  # CPU: never


@pytest.mark.parametrize("G,rows,expect", [(16, 16, (16, 64)), (16, 32, (32, 64)),
                                           (16, 64, (64, 64)), (8, 16, (16, 64)),
                                           (8, 64, (64, 64)), (4, 16, (16, 64)),
                                           (32, 16, (32, 64))])
def test_pack_rows_sets_positions_per_q_block(G, rows, expect):
    """q block = lcm(G, rows) rows; the tiles the options give divide both blocks."""
    class Spec:
        kv_block = 64

    class CudaQ:
        device = torch.device("cuda", 0)
        dtype = torch.bfloat16
        shape = (1, 64, 4096, 128)  # a head dim without PACKED_OPTIONS overrides
    bs = packed_block_size(G, Spec, rows=rows)
    assert bs == expect
    opts = flex_kernel_options(CudaQ, bs)
    _check_tiles(opts, *bs)
    assert opts["bwd_BLOCK_M2"] == min(bs[0], 64) and opts["bwd_BLOCK_N2"] == min(bs[0], bs[1], 64)


@pytest.mark.parametrize("rows", [16, 32, 64])
def test_pack_rows_same_attention(rows, monkeypatch):
    """Larger packed q blocks (the union of several positions' selections, mask_mod exact per
    row) give the same selected attention as the reference backend (CPU flex, forward)."""
    import nsa_flex.kernel_options as ko
    from masks import selection
    from nsa_flex.attention import attend_flex, attend_reference

    monkeypatch.setattr(ko, "PACK_ROWS", rows)
    torch.manual_seed(0)
    B, Hq, Hkv, T, D, ls = 1, 16, 1, 256, 32, 16
    q, k, v = (torch.randn(B, h, T, D) for h in (Hq, Hkv, Hkv))
    g = torch.randint(0, T // ls, (B, Hkv, T, 4))
    t = torch.arange(T).view(1, 1, T, 1)
    spec = selection(torch.where(g * ls <= t, g, -1), ls)
    ref = attend_reference(q, k, v, spec)[0]
    torch.testing.assert_close(attend_flex(q, k, v, spec)[0], ref, atol=1e-5, rtol=1e-5)


def test_wide_dtypes_get_narrow_tiles_or_inductors_own():
    """4/8-byte elements: the packed call's explicit tiles are narrowed and unpipelined, the band
    calls above head dim 64 take small explicit tiles (inductor's fp32 default at d_k 192 did not
    fit shared memory on the H100), at 64 inductor's own; 2-byte elements keep the measured tiles."""
    from types import SimpleNamespace

    from nsa_flex import kernel_options as ko

    q = lambda dt, d=192: SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=dt,  # noqa
                                          shape=(1, 4, 8, d))
    assert ko.band_kernel_options(q(torch.bfloat16)) == ko.BAND_OPTIONS[192]
    for dt in (torch.float32, torch.float64):
        for d in (128, 192):
            got = ko.band_kernel_options(q(dt, d))
            assert got == ko.WIDE_ELEMENT_OPTIONS and got is not ko.WIDE_ELEMENT_OPTIONS
            _check_tiles(got, 128, 128)  # the band masks' 128-blocks
        assert ko.band_kernel_options(q(dt, 64)) is None
    wide = ko.flex_kernel_options(q(torch.float32), (16, 64))
    _check_tiles(wide, 16, 64)
    assert wide["fwd_BLOCK_N"] == 32 and wide["bwd_num_stages"] == 1 and wide["fwd_num_stages"] == 1
    narrow = ko.flex_kernel_options(q(torch.bfloat16), (16, 64))
    assert narrow["fwd_BLOCK_N"] == 64 and narrow["bwd_num_stages"] == 3  # PACKED_OPTIONS[192]


def test_auto_scorer_only_for_kernel_dtypes():
    from types import SimpleNamespace

    from nsa_flex.selection import use_triton_scorer

    cfg = SimpleNamespace(scorer="auto")
    lse = torch.zeros(1)
    for dt, want in ((torch.bfloat16, True), (torch.float32, True), (torch.float64, False)):
        q = SimpleNamespace(is_cuda=True, dtype=dt)
        assert use_triton_scorer(cfg, q, lse) == (want and __import__("nsa_flex.ops").ops.HAS_TRITON)
