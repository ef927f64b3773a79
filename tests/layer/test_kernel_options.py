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


@pytest.mark.parametrize("wide", [False, True])
def test_kernel_options_tiles_divide_packed_blocks(wide, monkeypatch):
    import nsa_flex.kernel_options as ko

    monkeypatch.setattr(ko, "_wide_dq_installed", wide)

    class Spec:
        kv_block = 64
    qb, kb = packed_block_size(16, Spec)
    assert (qb, kb) == (16, 64)
    assert flex_kernel_options(torch.empty(1), (qb, kb)) is None  # CPU: inductor's own choice

    class CudaQ:
        device = torch.device("cuda", 0)
        shape = (1, 64, 4096, 192)
    opts = flex_kernel_options(CudaQ, (qb, kb))
    _check_tiles(opts, qb, kb, wide)


def _check_tiles(opts, qb, kb, wide: bool):
    """What inductor's flex templates need of explicit tiles for (q block, kv block) sizes; wide:
    whether the template allows N2 > M2 (`install_wide_dq_tiles`)."""
    assert qb % opts.get("fwd_BLOCK_M", 16) == 0 and kb % opts.get("fwd_BLOCK_N", 16) == 0
    assert kb % opts["bwd_BLOCK_N1"] == 0 and opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0
    assert qb % opts["bwd_BLOCK_M2"] == 0 and kb % opts["bwd_BLOCK_N2"] == 0
    assert wide or opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0


def test_packed_options_override_by_head_dim(monkeypatch):
    import nsa_flex.kernel_options as ko

    class CudaQ:
        device = torch.device("cuda", 0)
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
        _check_tiles(opts, 128, 128, wide=False)


def test_band_kernel_options_by_head_dim(monkeypatch):
    """Non-packed flex calls get BAND_OPTIONS of their head dim on CUDA (a copy), else None."""
    from types import SimpleNamespace

    from nsa_flex import kernel_options as ko

    monkeypatch.setattr(ko, "BAND_OPTIONS", {192: {"bwd_num_warps": 8}})
    cuda_q = lambda d: SimpleNamespace(device=SimpleNamespace(type="cuda"), shape=(1, 4, 8, d))
    got = ko.band_kernel_options(cuda_q(192))
    assert got == {"bwd_num_warps": 8} and got is not ko.BAND_OPTIONS[192]
    assert ko.band_kernel_options(cuda_q(128)) is None
    assert ko.band_kernel_options(torch.zeros(1, 4, 8, 192)) is None  # CPU: never


@pytest.mark.parametrize("G,rows,expect", [(16, 16, (16, 64)), (16, 32, (32, 64)),
                                           (16, 64, (64, 64)), (8, 16, (16, 64)),
                                           (8, 64, (64, 64)), (4, 16, (16, 64)),
                                           (32, 16, (32, 64))])
@pytest.mark.parametrize("wide", [False, True])
def test_pack_rows_sets_positions_per_q_block(G, rows, expect, wide, monkeypatch):
    """q block = lcm(G, rows) rows; the tiles the options give divide both blocks."""
    import nsa_flex.kernel_options as ko

    monkeypatch.setattr(ko, "_wide_dq_installed", wide)

    class Spec:
        kv_block = 64

    class CudaQ:
        device = torch.device("cuda", 0)
        shape = (1, 64, 4096, 128)  # a head dim without PACKED_OPTIONS overrides
    bs = packed_block_size(G, Spec, rows=rows)
    assert bs == expect
    opts = flex_kernel_options(CudaQ, bs)
    _check_tiles(opts, *bs, wide)
    n2 = min(bs[1], 64) if wide else min(bs[0], bs[1], 64)  # wide dQ steps once allowed
    assert opts["bwd_BLOCK_M2"] == min(bs[0], 64) and opts["bwd_BLOCK_N2"] == n2


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


def _dq_template_hash():
    from torch._inductor.kernel.flex import flex_attention as fa
    return fa.flex_attention_backward_template._hash


@pytest.mark.slow
def test_wide_dq_not_installed_at_import():
    import subprocess
    import sys

    code = ("import nsa_flex, nsa_flex.kernel_options as ko; print(ko._wide_dq_installed); "
            "nsa_flex.NSAAttention(nsa_flex.NSAConfig(backend='flex')); print(ko._wide_dq_installed)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert out == ["False", "True"]


def test_wide_dq_drops_only_the_assert(monkeypatch):
    """The patched flex backward template is torch's source without the BLOCK_M2 % BLOCK_N2
    assert, and the packed call then asks for dQ steps as wide as its kv block."""
    import nsa_flex.kernel_options as ko
    from torch._inductor.kernel.flex.common import load_flex_template

    source = load_flex_template("flex_backwards") + load_flex_template("utilities")
    if source.count(ko._DQ_ASSERT) != 1:
        pytest.skip("this torch's flex backward template has no such assert")
    monkeypatch.setattr(ko, "_wide_dq_installed", False)
    from torch._inductor.kernel.flex import flex_attention as fa
    tmpl = fa.flex_attention_backward_template
    import hashlib
    # start from torch's own template (an earlier test may have installed the patch already)
    monkeypatch.setattr(tmpl, "template", tmpl._template_from_string(source))
    monkeypatch.setattr(tmpl, "_hash", hashlib.sha256(source.encode()).hexdigest())
    before = _dq_template_hash()

    class CudaQ:
        device = torch.device("cuda", 0)
        shape = (1, 64, 4096, 192)
    assert ko.flex_kernel_options(CudaQ, (16, 64))["bwd_BLOCK_N2"] == 16
    assert ko.install_wide_dq_tiles() and ko.install_wide_dq_tiles()  # idempotent
    assert _dq_template_hash() != before
    patched = source.replace(ko._DQ_ASSERT, "pass  # N2 > M2 allowed (nsa_flex.kernel_options)")
    assert _dq_template_hash() == hashlib.sha256(patched.encode()).hexdigest()
    opts = ko.flex_kernel_options(CudaQ, (16, 64))
    assert opts["bwd_BLOCK_M2"] == 16 and opts["bwd_BLOCK_N2"] == 64
    _check_tiles(opts, 16, 64, wide=True)


def test_wide_dq_leaves_other_templates_alone(monkeypatch):
    import nsa_flex.kernel_options as ko
    import torch._inductor.kernel.flex.common as common

    monkeypatch.setattr(ko, "_wide_dq_installed", False)
    monkeypatch.setattr(common, "load_flex_template", lambda name: "no assert here")
    before = _dq_template_hash()
    assert not ko.install_wide_dq_tiles()
    assert _dq_template_hash() == before and not ko._wide_dq_installed
