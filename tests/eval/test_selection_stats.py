"""nsa_flex.apps.eval.selection_stats: the statistics on a hand-made selection, and the CLI's traces."""

import csv
import json
import math

import numpy as np
import pytest
import torch

import nsa_flex.apps.eval.selection_stats as ss
from nsa_flex.apps.eval.__main__ import run
from nsa_flex.apps.eval.prompts import EvalError

pytestmark = pytest.mark.usefixtures("single_thread")

# 1 head, 8 positions, n_sel 3, l_sel 2 (query blocks 0,0,1,1,2,2,3,3), -1 = no pick
HAND = [[[0, -1, -1], [0, -1, -1], [0, 1, -1], [0, 1, -1], [0, 1, 2], [0, 2, 1], [0, 3, 2], [3, 0, 1]]]


def test_statistics_of_a_hand_made_selection():
    s = ss.selection_stats(np.array(HAND), l_sel=2, n_init=1, n_local=1, tile=4)
    close = lambda a, b: math.isclose(a, b, abs_tol=1e-12)
    assert close(s["picks"], 18 / 8)
    # |S_t & S_t-1| / |S_t| for t = 1..7: 1, 1/2, 1, 2/3, 1, 2/3, 2/3
    assert close(s["adjacent_share"], (1 + 0.5 + 1 + 2 / 3 + 1 + 2 / 3 + 2 / 3) / 7)
    # tile rows 0-3: union {0,1}, mean size 1.5, common {0}; rows 4-7: union {0,1,2,3}, 3, {0}
    assert close(s["tile_union"], 3.0) and close(s["tile_density"], 0.75)
    assert close(s["tile_common"], (1 / 1.5 + 1 / 3) / 2)
    # free picks (block 0 and the query's own block removed): {} x4, {1}, {1}, {2}, {1}
    assert close(s["picks_free"], 0.5) and close(s["adjacent_share_free"], (0 + 1 + 0 + 0) / 4)
    assert close(s["tile_union_free"], 2.0) and close(s["tile_density_free"], 0.5)
    assert close(s["tile_common_free"], 0.0)
    # distances in blocks: 0 x8, 1 x5, 2 x3, 3 x2
    assert close(s["dist/0"], 8 / 18) and close(s["dist/1"], 5 / 18) and close(s["dist/2-3"], 5 / 18)
    assert close(s["dist/4-7"], 0.0)
    assert s["blocks"] == [8, 5, 3, 2]
    # identical rows: everything shared
    same = np.array([[[0, 1]] * 8])
    t = ss.selection_stats(same, l_sel=100, n_init=0, n_local=0, tile=4)
    assert (t["adjacent_share"], t["tile_union"], t["tile_density"], t["tile_common"]) == (1.0, 2.0, 1.0, 1.0)


def test_sorted_rows_int16():
    r = ss.sorted_rows(torch.tensor(HAND))
    assert r.dtype == np.int16 and r[0, 5].tolist() == [0, 1, 2] and r[0, 7].tolist() == [0, 1, 3]
    assert r[0, 0].tolist() == [0, -1, -1]
    with pytest.raises(EvalError, match="int16"):
        ss.sorted_rows(torch.tensor([[[40000]]]))


def test_cli_traces_and_stats(tmp_path):
    docs = tmp_path / "docs.jsonl"  # its own held-out document: 256 byte tokens and more
    docs.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 8}) + "\n")
    res = run(["--task", "selection", "--quick", "--out", str(tmp_path), "--lengths", "256,192",
               "--trace-layers", "1", "--docs", str(docs)])
    rows = list(csv.DictReader(open(tmp_path / "selection_stats.csv")))
    assert [(r["length"], r["layer"]) for r in rows] == [("192", "0"), ("192", "1"), ("256", "0"), ("256", "1")]
    for L in (192, 256):
        z = np.load(tmp_path / f"selection_L{L}.npz")
        assert sorted(z.files) == ["l_sel", "layer1", "n_sel", "tokens"]
        tr = z["layer1"]
        assert tr.dtype == np.int16 and tr.shape == (2, L, 4) and z["tokens"].shape == (L,)
        key = np.where(tr < 0, 2 ** 15, tr.astype(np.int32))
        step = np.diff(key, axis=-1)
        assert ((step > 0) | ((step == 0) & (key[..., 1:] == 2 ** 15))).all()  # sorted, distinct, -1 last
        assert (tr[:, :, 0] == 0).all()  # block 0 is forced
        # the CSV's numbers are the statistics of the saved trace
        s = ss.selection_stats(tr, 16, 1, 2, 64)
        r = [r for r in rows if r["length"] == str(L) and r["layer"] == "1"][0]
        for k in ("picks", "adjacent_share", "tile_union", "tile_common_free", "dist/1"):
            assert math.isclose(float(r[k]), s[k], abs_tol=1e-5), k
        blocks = [b for b in res["blocks"] if b["length"] == L and b["layer"] == 1]
        assert [b["picks"] for b in blocks] == s["blocks"]
    assert float(rows[0]["gate_sel"]) == 0.5  # zero-initialised gates
    assert (tmp_path / "selection.png").stat().st_size > 1000
    with pytest.raises(EvalError, match="'full_causal' have no top-n selection"):
        run(["--task", "selection", "--quick", "--out", str(tmp_path / "f"), "--docs", str(docs),
             "--override=--nsa.masks=full_causal"])
