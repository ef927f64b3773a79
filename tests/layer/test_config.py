"""NSAConfig validation: every rule raises NSAConfigError naming the field and the allowed values;
all violated rules appear in one error."""

import re

import pytest

from masks import PRESETS, list_mask_builders
from nsa_flex import NSAAttention, NSAConfig, NSAConfigError

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = dict(dim=16, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=8, d=4, l_sel=16, n_sel=3,
            window=16)


def errors_of(**kw) -> list[str]:
    with pytest.raises(NSAConfigError) as ei:
        NSAConfig(**{**TINY, **kw})
    msg = str(ei.value)
    assert msg.startswith("invalid NSAConfig")
    return [line.strip()[2:] for line in msg.splitlines()[1:]]


def test_paper_defaults():
    c = NSAConfig()
    assert (c.l, c.d, c.l_sel, c.n_sel, c.n_init, c.n_local, c.window) == (32, 16, 64, 16, 1, 2, 512)
    assert (c.n_heads, c.n_kv_heads, c.d_qk, c.d_v, c.dim) == (64, 4, 192, 128, 2560)
    assert c.phi == "avg" and c.backend == "auto" and c.masks == "nsa"
    assert c.group_size == 16
    assert c.branch_masks() == {"cmp": "compressed_causal", "sel": "topn", "win": "sliding_window"}


def test_valid_tiny_and_roundtrip():
    c = NSAConfig(**TINY)
    assert NSAConfig.from_dict(c.to_dict()) == c
    assert c.num_cmp(7) == 0 and c.num_cmp(8) == 1 and c.num_cmp(11) == 1 and c.num_cmp(12) == 2


POSITIVE = ("dim", "n_heads", "n_kv_heads", "d_qk", "d_v", "l", "d", "l_sel", "n_sel", "window",
            "score_chunk")


@pytest.mark.parametrize("field", POSITIVE)
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4"])
def test_positive_fields(field, bad):
    errs = errors_of(**{field: bad})
    assert any(e.startswith(f"{field}=") and "positive integer" in e for e in errs), errs


@pytest.mark.parametrize("field", ["n_init", "n_local"])
@pytest.mark.parametrize("bad", [-1, 1.0, None])
def test_non_negative_fields(field, bad):
    errs = errors_of(**{field: bad})
    assert any(e.startswith(f"{field}=") and "non-negative" in e for e in errs), errs


def test_n_init_at_most_one():
    errs = errors_of(n_init=2, n_sel=5)
    assert len(errs) == 1 and errs[0].startswith("n_init=2") and "0 or 1" in errs[0]


# one violated relation each: (overrides, field the message must start with, words it must hold)
RELATIONS = [
    (dict(n_heads=6, n_kv_heads=4), "n_heads=6", "multiple of n_kv_heads"),
    (dict(l=10, d=4), "l=10", "d must divide"),
    (dict(l_sel=18, d=4), "l_sel=18", "d must divide"),
    (dict(n_sel=2), "n_sel=2", "n_init + n_local = 3"),
    (dict(n_sel=1, n_init=0, n_local=2), "n_sel=1", "n_init + n_local = 2"),
    (dict(d_qk=7), "d_qk=7", "even"),
    (dict(phi="max"), "phi='max'", "('avg', 'mlp')"),
    (dict(backend="cuda"), "backend='cuda'", "('auto', 'flex', 'reference')"),
    (dict(recompute="sel"), "recompute='sel'", "('none', 'win', 'cmp_win', 'all')"),
    (dict(rope_theta=0.0), "rope_theta=0.0", "positive"),
    (dict(rope_theta="big"), "rope_theta='big'", "positive"),
    (dict(masks="nope"), "masks='nope'", lambda: str(sorted(PRESETS))),
    # the registry may grow (tests register builders too): read the allowed names at run time
    (dict(cmp_mask="sliding_window"), "cmp_mask='sliding_window'",
     lambda: str(list_mask_builders("compressed"))),
    (dict(sel_mask="compressed_causal"), "sel_mask='compressed_causal'",
     lambda: str(list_mask_builders("selection"))),
    (dict(win_mask="topn"), "win_mask='topn'", lambda: str(list_mask_builders("token"))),
]


@pytest.mark.parametrize("kw,head,words", RELATIONS, ids=[r[1] for r in RELATIONS])
def test_each_rule_names_its_field(kw, head, words):
    errs = errors_of(**kw)
    words = words() if callable(words) else words
    assert len(errs) == 1, errs
    assert errs[0].startswith(head) and words in errs[0], errs


def test_nsa_config_error_is_value_error():
    assert issubclass(NSAConfigError, ValueError)


def test_all_violations_in_one_error():
    errs = errors_of(dim=0, n_heads=6, n_kv_heads=4, l=10, l_sel=18, d_qk=7, phi="max",
                     backend="x", masks="nope", win_mask="topn", n_local=-1)
    fields = sorted({re.match(r"(\w+)=", e).group(1) for e in errs})
    assert fields == sorted(["dim", "n_heads", "l", "l_sel", "d_qk", "phi", "backend", "masks",
                             "win_mask", "n_local"]), errs


def test_relations_still_reported_next_to_a_size_error():
    # a bad size elsewhere must not hide the relational rules of the valid fields
    errs = errors_of(dim=0, l=10, n_heads=6, n_kv_heads=4, window=-1)
    fields = sorted(re.match(r"(\w+)=", e).group(1) for e in errs)
    assert fields == ["dim", "l", "n_heads", "window"], errs


def test_from_dict_unknown_field():
    with pytest.raises(NSAConfigError, match=r"unknown NSAConfig field\(s\) \['bogus'\]"):
        NSAConfig.from_dict({**TINY, "bogus": 1})


def test_mutated_config_rejected_by_layer():
    c = NSAConfig(**TINY)
    c.l_sel = 18
    with pytest.raises(NSAConfigError, match=r"l_sel=18"):
        NSAAttention(c)


def test_branch_overrides():
    c = NSAConfig(**TINY, masks="full_causal", win_mask="sliding_window")
    assert c.branch_masks() == {"cmp": "none", "sel": "causal", "win": "sliding_window"}
    c = NSAConfig(**TINY, cmp_mask="none", sel_mask="local_selection")
    assert c.branch_masks() == {"cmp": "none", "sel": "local_selection", "win": "sliding_window"}
