"""nsa_flex.apps.eval.position_loss (``python -m nsa_flex.eval --task position-loss``): bucket edges,
documents to sequences, and the CSV against a direct per-token loss of the same checkpoint."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nsa_flex.apps.eval.position_loss as pl
from nsa_flex.apps.eval.__main__ import run, split_task
from nsa_flex.apps.eval.docs import read_texts, token_sequences
from nsa_flex.apps.eval.prompts import EvalError
from nsa_flex.titan.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
CFG = str(ROOT / "titan_configs" / "debug_nsa.toml")
BYTE = ByteTokenizer()

pytestmark = pytest.mark.usefixtures("single_thread")


def test_bucket_edges():
    assert pl.bucket_edges(16, per_octave=1) == [1, 2, 4, 8, 16]
    assert pl.bucket_edges(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert pl.bucket_edges(20, per_octave=1) == [1, 2, 4, 8, 16, 20]
    assert pl.bucket_edges(10, width=4) == [1, 4, 8, 10]
    e = pl.bucket_edges(16384)
    assert e[0] == 1 and e[-1] == 16384 and 8192 in e and 512 in e and len(e) == 28
    with pytest.raises(EvalError, match="--bucket-width: 0"):
        pl.bucket_edges(10, width=0)
    with pytest.raises(EvalError, match="--seq-len: 1 must be >= 2"):
        pl.bucket_edges(1)


def test_documents_to_sequences(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in ["a" * 10, "b" * 40, "", "c" * 30]) + "\n")
    texts = read_texts(str(p))
    assert texts == ["a" * 10, "b" * 40, "c" * 30]
    s = token_sequences(texts, BYTE, 25, 8, join=False)
    assert [BYTE.decode([t for t in x if t < 256]) for x in s] == ["b" * 24, "c" * 24]
    assert all(x[0] == BYTE.bos_id and len(x) == 25 for x in s)
    j = token_sequences(texts, BYTE, 25, 8, join=True)
    flat = [t for t in sum(j, [])]
    assert len(j) == (3 * 2 + 80) // 25 and flat[11] == BYTE.eos_id and flat[12] == BYTE.bos_id
    with pytest.raises(EvalError, match="no document has 100 tokens .the longest has 41."):
        token_sequences(texts, BYTE, 100, 8, join=False)
    with pytest.raises(EvalError, match=r"--docs '/no.parquet': no such file"):
        read_texts("/no.parquet")
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(EvalError, match="cannot read a 'text' column.*no 'text' field"):
        read_texts(str(bad))


def _checkpoint(tmp_path):
    """A DCP checkpoint of the debug model with non-trivial gates; the model itself."""
    import torch.distributed.checkpoint as dcp

    from nsa_flex.apps.generate import build_model, load_job_config

    model, _ = build_model(load_job_config(CFG))
    torch.manual_seed(3)
    with torch.no_grad():
        model.init_weights()
        for blk in model.layers.values():
            blk.attention.gate.weight.normal_(0, 0.3)
    dcp.save(dict(model.state_dict()), checkpoint_id=str(tmp_path / "ckpt" / "step-7"))
    return model.eval()


def test_csv_equals_direct_per_token_loss(tmp_path, monkeypatch):
    model = _checkpoint(tmp_path)
    docs = tmp_path / "docs.jsonl"
    rng = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "pass", "key", "river", "stone"]
    with open(docs, "w") as f:
        for i in range(3):
            idx = torch.randint(len(words), (80,), generator=rng).tolist()
            f.write(json.dumps({"text": " ".join(words[k] for k in idx)}) + "\n")
    monkeypatch.setattr(pl, "CE_CHUNK", 37)  # several cross-entropy chunks
    T = 200
    res = run(["--task", "position-loss", "--config", CFG, "--checkpoint", str(tmp_path / "ckpt"),
               "--device", "cpu", "--docs", str(docs), "--seq-len", str(T), "--out", str(tmp_path / "o"),
               "--batch-size", "2", "--per-octave", "1"])
    rows = list(csv.DictReader(open(tmp_path / "o" / "position_loss.csv")))
    assert list(rows[0]) == list(pl.FIELDS)
    # direct: the same sequences through the same weights, one forward, no chunks
    seqs = token_sequences(read_texts(str(docs)), BYTE, T, 16, join=False)
    assert seqs == res["sequences"] and len(seqs) == 3
    toks = torch.tensor(seqs)
    with torch.no_grad():
        logits = model(toks)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1),
                         reduction="none").view(3, T - 1)
    edges = [1, 2, 4, 8, 16, 32, 64, 128, 200]
    assert [(int(r["bucket_lo"]), int(r["bucket_hi"])) for r in rows] == list(zip(edges, edges[1:]))
    for r in rows:
        lo, hi = int(r["bucket_lo"]), int(r["bucket_hi"])
        pos = torch.arange(1, T)
        sel = ce[:, (pos >= lo) & (pos < hi)]
        assert int(r["n_tokens"]) == sel.numel() == 3 * (hi - lo)
        assert math.isclose(float(r["loss"]), float(sel.double().mean()), abs_tol=2e-5), (lo, r["loss"])
        per_doc = sel.double().mean(1)
        assert math.isclose(float(r["loss_sem"]), float(per_doc.std() / math.sqrt(3)), abs_tol=2e-5)
    meta = json.load(open(tmp_path / "o" / "position_loss_meta.json"))
    assert meta["model"].endswith("step-7") and meta["n_sequences"] == 3
    assert math.isclose(meta["mean_loss"], float(ce.double().mean()), abs_tol=2e-5)
    assert (tmp_path / "o" / "position_loss.png").stat().st_size > 1000


def test_task_dispatch_and_errors(tmp_path):
    assert split_task(["--quick", "--task=position-loss", "--out", "x"]) == ("position-loss", ["--quick", "--out", "x"])
    assert split_task(["--quick"]) == ("needle", ["--quick"])
    with pytest.raises(EvalError, match=r"--task: 'bogus' not in \['needle', 'position-loss', 'selection'\]"):
        split_task(["--task", "bogus"])
    with pytest.raises(EvalError, match="--max-docs: 0 must be >= 1"):
        run(["--task", "position-loss", "--quick", "--out", str(tmp_path), "--max-docs", "0"])
