"""Bad inputs and configs rejected at the entry with one message: the layer's input shapes and
document order, n_sel against the sequence's block count, all branches off; the dense selection
mask_mod's cost capped at the block count; tokenizer errors are user errors."""

import pytest
import torch

from masks.builders import selection
from nsa_flex.config import NSAConfig, NSAConfigError
from nsa_flex.errors import UserError
from nsa_flex.layer import NSAAttention

SMALL = dict(dim=32, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=8, d=4, l_sel=8, n_sel=4, n_local=1,
             window=8, backend="reference", scorer="torch")


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    m = NSAAttention(NSAConfig(**SMALL))
    m.init_weights()
    return m


@pytest.mark.parametrize("x, doc_ids, msg", [
    (torch.randn(16, 32), None, r"x must be \[batch, seq_len, dim=32\], got shape \(16, 32\)"),
    (torch.randn(1, 16, 31), None, r"x must be \[batch, seq_len, dim=32\], got shape \(1, 16, 31\)"),
    (torch.randn(0, 16, 32), None, r"empty batch or sequence \(shape \(0, 16, 32\)\)"),
    (torch.randn(2, 0, 32), None, r"empty batch or sequence \(shape \(2, 0, 32\)\)"),
    (torch.randn(2, 16, 32), torch.zeros(2, 15, dtype=torch.long),
     r"doc_ids must be integers of shape \[batch, seq_len\] = \(2, 16\), got torch.int64 \(2, 15\)"),
    (torch.randn(2, 16, 32), torch.zeros(16, dtype=torch.long), r"got torch.int64 \(16,\)"),
    (torch.randn(2, 16, 32), torch.zeros(2, 16), r"got torch.float32 \(2, 16\)"),
    (torch.randn(2, 16, 32), torch.tensor([[0] * 16, [0] * 5 + [1] * 5 + [0] * 6]),
     r"non-decreasing .* row 1 goes from 1 at position 9 to 0 at position 10"),
])
def test_layer_input_checks(layer, x, doc_ids, msg):
    with pytest.raises(ValueError, match=msg):
        layer(x, doc_ids)


def test_layer_accepts_good_inputs(layer):
    x = torch.randn(2, 16, 32)
    out = layer(x, torch.tensor([[0] * 16, [0] * 5 + [3] * 11]))
    assert out.shape == (2, 16, 32) and torch.isfinite(out).all()


def test_n_sel_against_block_count_and_all_branches_off():
    NSAConfig(**SMALL).validate(seq_len=32)  # 4 blocks of 8: n_sel 4 fits
    NSAConfig(**SMALL).validate(seq_len=25)  # ceil(25 / 8) = 4
    with pytest.raises(NSAConfigError) as e:
        NSAConfig(**SMALL).validate(seq_len=24)
    assert e.value.errors == ["n_sel=4: must be <= ceil(seq_len / l_sel) = 3, the number of selection "
                              "blocks of a 24-token sequence"]
    with pytest.raises(NSAConfigError, match=r"n_sel=10000: must be <= ceil\(seq_len / l_sel\) = 32,"):
        NSAConfig(**{**SMALL, "n_sel": 10000}).validate(seq_len=256)
    NSAConfig(**{**SMALL, "n_sel": 10000})  # without a seq_len (the layer API): accepted
    with pytest.raises(NSAConfigError) as e:
        NSAConfig(**{**SMALL, "masks": "full_causal", "sel_mask": "none"})
    assert e.value.errors == ["cmp_mask=None, sel_mask='none', win_mask=None with masks='full_causal': every "
                              "branch is 'none'; keep at least one branch"]
    with pytest.raises(NSAConfigError, match="every branch is 'none'"):
        NSAConfig(**{**SMALL, "cmp_mask": "none", "sel_mask": "none", "win_mask": "none"})


def test_selection_mask_mod_capped_at_block_count():
    T, l_sel = 20, 8  # 3 blocks
    torch.manual_seed(0)
    base = torch.stack([torch.randperm(3)[:2] for _ in range(T)]).view(1, 1, T, 2)
    wide = torch.cat([base, torch.full((1, 1, T, 998), -1), base[..., :1]], dim=-1)  # n = 1000, repeats
    small, big = selection(base, l_sel), selection(wide, l_sel)
    assert big.name == "selection(n=3,l'=8)"
    q = torch.arange(T).view(T, 1)
    kv = torch.arange(T).view(1, T)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(big.mask_mod(zero, zero, q, kv), small.mask_mod(zero, zero, q, kv))


def test_tokenizer_error_is_a_user_error(tmp_path):
    from nsa_flex.titan.tokenizer import TokenizerError, build_tokenizer_from_name

    bad = tmp_path / "bad.tiktoken"
    bad.write_text("garbage\n")
    for path in (bad, tmp_path / "missing.tiktoken"):
        with pytest.raises(TokenizerError) as e:
            build_tokenizer_from_name(str(path))
        assert isinstance(e.value, UserError) and str(path) in str(e.value)
