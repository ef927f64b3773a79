"""Datasets of the torchtitan integration: passkey corpus, local files (FineWeb parquet), packing,
DP sharding, checkpointable streaming, and the errors for bad names, paths and files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_flex.titan.data import (
    DATASET_CHOICES,
    DatasetError,
    PackedTokenDataset,
    build_source,
    passkey_document,
)
from nsa_flex.titan.tokenizer import ByteTokenizer, build_tokenizer_from_name

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
FINEWEB = SHARED / "fineweb_sample_2800.parquet"
TIKTOKEN_CACHE = SHARED / "tiktoken_cache"
needs_shared = pytest.mark.skipif(
    not (FINEWEB.is_file() and TIKTOKEN_CACHE.is_dir()),
    reason=f"shared sample data not found at {SHARED} (FineWeb parquet + tiktoken cache)",
)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


# ----------------------------------------------------------------------------- passkey
@pytest.mark.parametrize("seq_len", [128, 256, 1000, 8192])
def test_passkey_documents_exact_length_and_answer(seq_len):
    tok = ByteTokenizer()
    for i in range(5):
        toks, ans, key = passkey_document(tok, seq_len, i, seed=3)
        assert len(toks) == seq_len + 1
        assert toks[0] == tok.bos_id and toks[-1] == tok.eos_id
        text = tok.decode(toks)
        assert text.count(f"The pass key is: {key}. Remember it. The pass key is: {key}.") == 1
        assert text.count(":") == 3  # the cue: two needle mentions and the question
        assert text.endswith(f"What is the pass key? The pass key is: {key}.")
        assert tok.decode(toks[ans:-1]) == f" {key}."  # the space before the key is the answer's
        assert 10000 <= key <= 99999
        # deterministic
        assert passkey_document(tok, seq_len, i, seed=3) == (toks, ans, key)


@needs_shared
@pytest.mark.parametrize("name", ["byte", "gpt2", "cl100k_base"])
def test_passkey_answer_tokens_copy_the_needle(name, offline):
    """The answer's key tokens occur verbatim (same ids) in the needle, for byte and BPE tokenizers:
    retrieval is a plain copy. (With the question ending in "is " and the answer "12345." encoded
    alone, gpt2 gave "12","345" after a lone " " while the needle had " 12","345" -- never a copy.)"""
    tok = build_tokenizer_from_name(name)
    for seq_len in (256, 2048):
        for i in range(200):
            toks, ans, key = passkey_document(tok, seq_len, i)
            key_toks = toks[ans:-2]  # the answer without "." and EOS
            assert tok.decode(key_toks) == f" {key}"
            hits = [j for j in range(ans - len(key_toks)) if toks[j:j + len(key_toks)] == key_toks]
            assert len(hits) >= 2, (name, seq_len, i, key)  # both needle mentions


def test_passkey_depth_covers_both_ends():
    """Depth 0 puts the needle right after the head, depth 1 (the evaluation's 100%) right before
    the question, and a training draw just below 1 reaches that insertion point too (it never did
    with int(depth * n_fill): no training document had the needle next to the question)."""
    from nsa_flex.titan.data import PASSKEY_NEEDLE, PASSKEY_QUESTION, PasskeyCorpus

    tok = ByteTokenizer()
    c = PasskeyCorpus(tok, 257)
    needle_q = PASSKEY_NEEDLE.format(key=12345) + PASSKEY_QUESTION
    assert needle_q in tok.decode(c.build(12345, 1.0)[0])
    assert c.build(12345, 1 - 1e-9) == c.build(12345, 1.0)
    assert needle_q not in tok.decode(c.build(12345, 0.5)[0])
    assert tok.decode(c.build(12345, 0.0)[0][1:]).startswith(PASSKEY_NEEDLE.format(key=12345))


def test_passkey_varies_with_index_seed_and_split():
    tok = ByteTokenizer()
    keys = [passkey_document(tok, 512, i)[2] for i in range(20)]
    assert len(set(keys)) > 15
    assert passkey_document(tok, 512, 0, seed=1) != passkey_document(tok, 512, 0, seed=2)
    assert passkey_document(tok, 512, 0, split="train") != passkey_document(tok, 512, 0, split="validation")
    # the needle's depth varies
    depths = {tok.decode(passkey_document(tok, 2048, i)[0]).index("The pass key is") for i in range(10)}
    assert len(depths) > 5


@pytest.mark.parametrize("seq_len", [256, 300, 512, 2048])
def test_passkey_questions_asks_q_times_after_the_needle(seq_len):
    """passkey_questions=q: the same document but q question+answer pairs (q-1 at random points after
    the needle, the last at the end), exact length, deterministic; q=1 is the plain document."""
    from nsa_flex.titan.data import PASSKEY_QUESTION

    tok = ByteTokenizer()
    for i in range(20):  # at 256 / 300 the intro is dropped (it was, with extra questions, a wrong length)
        toks, ans, key = passkey_document(tok, seq_len, i, questions=2 if seq_len < 512 else 4)
        assert len(toks) == seq_len + 1 and toks[-1] == tok.eos_id
        text = tok.decode(toks)
        qa = PASSKEY_QUESTION + f" {key}."
        assert text.count(qa) == (2 if seq_len < 512 else 4) and text.endswith(qa)
        assert text.index(qa) > text.index(f"The pass key is: {key}. Remember it.")
        assert tok.decode(toks[ans:-1]) == f" {key}."
        assert passkey_document(tok, seq_len, i, questions=2 if seq_len < 512 else 4) == (toks, ans, key)
        one = passkey_document(tok, seq_len, i)
        assert one[2] == key and tok.decode(one[0]).count(qa) == 1
    # the extra questions sit at different distances from the needle
    gaps = {tok.decode(passkey_document(tok, seq_len, i, questions=2)[0]).index(PASSKEY_QUESTION)
            for i in range(10)}
    assert len(gaps) > 5


def test_synthetic_filler_is_a_repeated_passage_per_document():
    """The filler of a document repeats one passage of random sentences (period 3..100 sentences),
    different per document (seed) and deterministic; so most filler tokens are copies of earlier ones."""
    from nsa_flex.titan.data import synthetic_filler

    tok = ByteTokenizer()
    periods = set()
    for i in range(30):
        f = synthetic_filler(tok, 4000, f"train:0:{i}")
        assert len(f) >= 4000 and f == synthetic_filler(tok, 4000, f"train:0:{i}")
        text = tok.decode(f)
        period = next(p for p in range(20, len(text)) if text[p:p + 200] == text[:200])
        assert text[:len(text) - period] == text[period:]  # periodic
        periods.add(period)
    assert len(periods) > 20 and min(periods) < 300 and max(periods) > 1500
    docs = [tok.decode(passkey_document(tok, 1024, i)[0]) for i in range(5)]
    assert len({d[200:300] for d in docs}) == 5  # each document its own passage


@pytest.mark.parametrize("bad", [0, 17, 2.0, True, "4"])
def test_passkey_questions_out_of_range_errors(bad):
    with pytest.raises(DatasetError, match=r"training.passkey_questions=.*must be an integer in \[1, 16\]"):
        passkey_document(ByteTokenizer(), 512, 0, questions=bad)
    with pytest.raises(DatasetError, match=r"passkey_questions=8 \(needs seq_len >= \d+"):
        passkey_document(ByteTokenizer(), 256, 0, questions=8)


def test_passkey_too_short_sequence_errors():
    with pytest.raises(DatasetError, match=r"seq_len=32 is too short.*needs seq_len >= \d+"):
        passkey_document(ByteTokenizer(), 32, 0)


@needs_shared
def test_passkey_with_gpt2_any_length(offline):
    tok = build_tokenizer_from_name("gpt2")
    for seq_len in (200, 4096, 32768):
        toks, ans, key = passkey_document(tok, seq_len, 7)
        assert len(toks) == seq_len + 1 and toks[-1] == tok.eos_id
        assert tok.decode(toks[ans:-1]) == f" {key}."  # the space before the key is the answer's


def test_passkey_samples_are_whole_documents():
    tok = ByteTokenizer()
    ds = PackedTokenDataset(build_source("passkey", None, tok, 300, seed=5), 300)
    for i, (x, y) in enumerate(take(ds, 4)):
        doc = torch.tensor(passkey_document(tok, 300, i, seed=5)[0])
        assert torch.equal(x["input"], doc[:-1]) and torch.equal(y, doc[1:])


# ----------------------------------------------------------------------------- packing, sharding, resume
def test_dp_sharding_keeps_the_global_batch():
    """Rank r of W keeps packed sequences k % W == r: the union over ranks is the 1-rank stream."""
    tok = ByteTokenizer()
    one = [y for _, y in take(PackedTokenDataset(build_source("passkey", None, tok, 200), 200), 8)]
    r0 = [y for _, y in take(PackedTokenDataset(build_source("passkey", None, tok, 200), 200, 0, 2), 4)]
    r1 = [y for _, y in take(PackedTokenDataset(build_source("passkey", None, tok, 200), 200, 1, 2), 4)]
    for i in range(4):
        assert torch.equal(r0[i], one[2 * i]) and torch.equal(r1[i], one[2 * i + 1])


def _fineweb_loader(tok, seq_len=512, batch=2):
    from torchtitan.components.dataloader import ParallelAwareDataloader

    src = build_source("fineweb_edu", str(FINEWEB), tok, seq_len)
    return ParallelAwareDataloader(PackedTokenDataset(src, seq_len), dp_rank=0, dp_world_size=1, batch_size=batch)


@needs_shared
def test_local_fineweb_parquet_streams_with_gpt2_offline(offline):
    import datasets
    import pyarrow.parquet as pq
    import tiktoken

    tok = build_tokenizer_from_name("gpt2")
    assert tok.get_vocab_size() == 50257 and tok.eos_id == 50256
    src = build_source("fineweb_edu", str(FINEWEB), tok, 512)
    assert isinstance(src._data, datasets.IterableDataset)  # streaming, not materialized
    texts = pq.read_table(FINEWEB, columns=["text"]).slice(0, 40).column("text").to_pylist()
    enc = tiktoken.get_encoding("gpt2")
    stream = []
    for t in texts:
        stream += enc.encode_ordinary(t) + [50256]
    (x0, y0), (x1, y1), (x2, y2) = take(PackedTokenDataset(src, 512), 3)
    expect = torch.tensor(stream[: 3 * 513]).view(3, 513)
    for (x, y), e in zip([(x0, y0), (x1, y1), (x2, y2)], expect):
        assert torch.equal(x["input"], e[:-1]) and torch.equal(y, e[1:])
    assert tok.decode(x0["input"][:20].tolist()) == enc.decode(stream[:20])


@needs_shared
def test_loader_resume_continues_stream_without_repeats(offline):
    tok = build_tokenizer_from_name("gpt2")
    a = _fineweb_loader(tok)
    it = iter(a)
    first = [next(it) for _ in range(5)]
    state = a.state_dict()
    rest = [next(it) for _ in range(5)]
    b = _fineweb_loader(tok)
    b.load_state_dict(state)
    resumed = [batch for _, batch in zip(range(5), b)]
    for (xr, yr), (xs, ys) in zip(rest, resumed):
        assert torch.equal(xr["input"], xs["input"]) and torch.equal(yr, ys)
    seen = {tuple(row.tolist()) for _, y in first for row in y}
    assert not any(tuple(row.tolist()) in seen for _, y in resumed for row in y)


def test_local_jsonl_and_txt(tmp_path):
    tok = ByteTokenizer()
    docs = [f"document number {i} " * (i + 3) for i in range(30)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    stream = [t for d in docs for t in tok.encode(d, add_bos=True, add_eos=True)]
    got = take(PackedTokenDataset(build_source("local", str(jl), tok, 64), 64), 5)
    for i, (x, y) in enumerate(got):
        assert x["input"].tolist() == stream[i * 65 : i * 65 + 64]
    # a folder of txt files: one document per paragraph, files in name order
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha one\n\nalpha two\n")
    (folder / "b.txt").write_text("beta\n")
    src = build_source("local", str(folder), tok, 8)
    texts = [tok.decode(t) for t in src]
    assert [s.strip() for s in texts] == ["alpha one", "alpha two", "beta"]
    # a glob
    src = build_source("local", str(folder / "b*.txt"), tok, 8)
    assert [tok.decode(t).strip() for t in src] == ["beta"]


# ----------------------------------------------------------------------------- errors
def test_unknown_dataset_lists_choices():
    with pytest.raises(DatasetError) as e:
        build_source("c4", None, ByteTokenizer(), 64)
    for name in DATASET_CHOICES:
        assert name in str(e.value)
    assert "'c4'" in str(e.value)


def test_missing_path_names_path_and_choices(tmp_path):
    missing = str(tmp_path / "nope.parquet")
    for name in ("local", "fineweb_edu"):
        with pytest.raises(DatasetError) as e:
            build_source(name, missing, ByteTokenizer(), 64)
        assert missing in str(e.value)
        assert all(c in str(e.value) for c in DATASET_CHOICES)
    with pytest.raises(DatasetError, match="needs dataset_path"):
        build_source("local", None, ByteTokenizer(), 64)
    with pytest.raises(DatasetError, match="leave dataset_path unset"):
        build_source("passkey", str(tmp_path), ByteTokenizer(), 256)
    with pytest.raises(DatasetError, match="matches no file"):
        build_source("local", str(tmp_path / "*.parquet"), ByteTokenizer(), 64)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported data file"):
        build_source("local", str(tmp_path / "x.csv"), ByteTokenizer(), 64)


def test_corrupt_files_are_named(tmp_path):
    tok = ByteTokenizer()
    bad_pq = tmp_path / "bad.parquet"
    bad_pq.write_bytes(b"PAR1 this is not a parquet file at all" * 10)
    with pytest.raises(DatasetError) as e:
        build_source("local", str(bad_pq), tok, 64)
    assert str(bad_pq) in str(e.value) and "corrupt" in str(e.value)

    bad_jl = tmp_path / "bad.jsonl"
    bad_jl.write_text('{"text": "fine"\n')
    with pytest.raises(DatasetError) as e:
        build_source("local", str(bad_jl), tok, 64)
    assert str(bad_jl) in str(e.value)

    # corruption after a valid first record surfaces while streaming, still naming the file
    late = tmp_path / "late.jsonl"
    late.write_text(json.dumps({"text": "ok " * 10}) + "\n" + "{{{ not json\n")
    src = build_source("local", str(late), tok, 16)
    with pytest.raises(DatasetError) as e:
        list(src)
    assert str(late) in str(e.value)

    no_col = tmp_path / "nocol.jsonl"
    no_col.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DatasetError, match="no field 'text'"):
        build_source("local", str(no_col), tok, 64)


@needs_shared
def test_truncated_parquet_is_named(tmp_path):
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(FINEWEB.read_bytes()[: 1 << 20])
    with pytest.raises(DatasetError) as e:
        build_source("fineweb_edu", str(cut), ByteTokenizer(), 64)
    assert str(cut) in str(e.value)


@pytest.mark.slow
def test_trainer_reports_unknown_dataset():
    """Through the stock trainer (nsa-train): a bad dataset name fails with the list of choices."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    p = subprocess.run(
        [sys.executable, "-m", "nsa_flex.titan.cli", "--training.dataset", "c4_test", "--training.steps", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode != 0
    assert "unknown dataset 'c4_test'; choices: ['passkey', 'fineweb_edu', 'local']" in p.stdout + p.stderr


def test_validation_loader_restarts_each_pass():
    from torchtitan.config import ConfigManager

    from nsa_flex.titan.data import build_validation_dataloader

    cfg = ConfigManager().parse_args(["--job.custom_config_module", "nsa_flex.titan.job_config",
                                      "--validation.seq_len", "128", "--validation.steps", "2",
                                      "--validation.local_batch_size", "2"])
    loader = build_validation_dataloader(1, 0, ByteTokenizer(), cfg)
    first = [y for _, (_, y) in zip(range(3), loader)]
    second = [y for _, (_, y) in zip(range(3), loader)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    doc = torch.tensor(passkey_document(ByteTokenizer(), 128, 0, split="validation")[0])
    assert torch.equal(first[0][0], doc[1:])
    cfg.validation.steps = -1
    with pytest.raises(DatasetError, match="validation.steps > 0"):
        build_validation_dataloader(1, 0, ByteTokenizer(), cfg)


# ----------------------------------------------------------------------------- empty / small sources
def _zero_row_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), path)


EMPTY_SOURCES = {
    "empty.txt": (lambda p: p.write_text(""), "empty (0 bytes)"),
    "blank.txt": (lambda p: p.write_text("\n\n  \n\n"), "only blank lines"),
    "empty.jsonl": (lambda p: p.write_text(""), "empty (0 bytes)"),
    "blank_texts.jsonl": (lambda p: p.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": " "}) + "\n"),
                          "2 record(s), every 'text' text empty or blank"),
    "zero_rows.parquet": (_zero_row_parquet, "0 rows"),
}


@pytest.mark.parametrize("name", sorted(EMPTY_SOURCES))
def test_empty_sources_fail_fast_naming_file_and_reason(tmp_path, name):
    """A source that yields no token fails at once instead of re-looping forever."""
    import time

    make, reason = EMPTY_SOURCES[name]
    path = tmp_path / name
    make(path)
    t0 = time.time()
    with pytest.raises(DatasetError) as e:
        take(PackedTokenDataset(build_source("local", str(path), ByteTokenizer(), 64), 64), 1)
    assert time.time() - t0 < 30
    assert str(path) in str(e.value) and reason in str(e.value), str(e.value)


def test_empty_files_beside_real_ones_are_skipped(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "some real text " * 20}) + "\n")
    with caplog.at_level("WARNING"):
        src = build_source("local", str(tmp_path), ByteTokenizer(), 64)
    assert src.files == [str(tmp_path / "b.jsonl")]
    assert "skipping 1 empty file(s)" in caplog.text and "a.jsonl" in caplog.text


def test_small_source_warns_once_with_tokens_per_pass(tmp_path, caplog):
    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps({"text": "tiny"}) + "\n")  # 4 bytes + BOS + EOS = 6 tokens a pass
    with caplog.at_level("WARNING"):
        take(PackedTokenDataset(build_source("local", str(path), ByteTokenizer(), 64), 64), 3)  # ~33 passes
    msgs = [r.getMessage() for r in caplog.records if "re-looped" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "one pass gives 6 tokens" in msgs[0] and str(path) in msgs[0]


@pytest.mark.slow
def test_nsa_train_empty_file_exits_with_one_message(tmp_path):
    """Through nsa-train: an empty data file stops within seconds, one line, exit code 2."""
    import time

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "nsa_flex.titan.cli", "--training.dataset", "local", "--training.dataset_path",
         str(empty), "--training.steps", "2", "--job.dump_folder", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert time.time() - t0 < 30
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"nsa-train: error: no training text in dataset_path '{empty}'" in p.stderr
    assert "the file is empty (0 bytes)" in p.stderr and "Traceback" not in p.stdout + p.stderr


def test_fineweb_edu_offline_fails_fast(monkeypatch):
    """The hub unreachable: the hint at once, not after ~30 s of retries."""
    import time

    import huggingface_hub.constants as hc

    import nsa_flex.titan.data as data

    probe = data.hub_unreachable
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)  # the real probe: offline mode, no request
    assert probe() == "HF_HUB_OFFLINE is set"
    monkeypatch.setattr(data, "hub_unreachable", lambda timeout=5.0: "test: no network")
    t0 = time.time()
    with pytest.raises(DatasetError, match=r"hub is unreachable \(test: no network\).*dataset_path"):
        build_source("fineweb_edu", None, ByteTokenizer(), 64)
    assert time.time() - t0 < 5
