"""Datasets of the torchtitan integration: passkey corpus, local files (FineWeb parquet), packing,
DP sharding, checkpointable streaming, and the errors for bad names, paths and files."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.packing import PackedTokenDataset
from nsa_flex.data.passkey import passkey_document
from nsa_flex.data.sources import DATASET_CHOICES, build_source
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


def test_passkey_samples_are_whole_documents():
    tok = ByteTokenizer()
    ds = PackedTokenDataset(build_source("passkey", None, tok, 300, seed=5), 300)
    for i, (x, y) in enumerate(take(ds, 4)):
        doc = torch.tensor(passkey_document(tok, 300, i, seed=5)[0])
        assert torch.equal(x["input"], doc[:-1]) and torch.equal(y, doc[1:])


# ----------------------------------------------------------------------------- packing, sharding, resume
def test_dp_sharding_keeps_the_global_batch():
    """Passkey: rank r of W reads documents k * W + r: the union over ranks is the 1-rank stream."""
    tok = ByteTokenizer()
    one = [y for _, y in take(PackedTokenDataset(build_source("passkey", None, tok, 200), 200), 8)]
    r0 = [y for _, y in take(PackedTokenDataset(build_source("passkey", None, tok, 200), 200, 0, 2), 4)]
    r1 = [y for _, y in take(PackedTokenDataset(build_source("passkey", None, tok, 200), 200, 1, 2), 4)]
    for i in range(4):
        assert torch.equal(r0[i], one[2 * i]) and torch.equal(r1[i], one[2 * i + 1])


@pytest.mark.parametrize("n_files", [1, 4])
def test_two_ranks_read_disjoint_documents_and_resume_exactly(tmp_path, n_files):
    """split_dataset_by_node: 2 ranks read disjoint documents that together are the whole corpus
    (whole files per rank when 2 divides their number, else every other record); each rank's stream
    resumes exactly from its state."""
    tok = ByteTokenizer()
    for f in range(n_files):
        with open(tmp_path / f"part{f}.jsonl", "w") as fh:
            for i in range(f, 48, n_files):
                fh.write(json.dumps({"text": f"<doc {i:02d}> " + "words " * (i % 7 + 2)}) + "\n")

    def stream(rank, n=None, state=None):
        ds = PackedTokenDataset(build_source("local", str(tmp_path), tok, 32), 32, rank, 2, infinite=False)
        if state is not None:
            ds.load_state_dict(state)
        it = iter(ds)
        got = [x["input"].tolist() + y[-1:].tolist() for x, y in (it if n is None else (next(it) for _ in range(n)))]
        return got, ds

    docs = []
    for rank in (0, 1):
        seqs, _ = stream(rank)
        text = tok.decode([t for s in seqs for t in s])
        docs.append({int(m) for m in re.findall(r"<doc (\d\d)>", text)})
        head, ds = stream(rank, 3)
        state = ds.state_dict()
        rest, _ = stream(rank, state=state)
        assert head + rest == seqs
    assert not docs[0] & docs[1]
    assert len(docs[0]) > 15 and len(docs[1]) > 15 and len(docs[0] | docs[1]) >= 46  # cut at the end


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
    assert isinstance(src.ds, datasets.IterableDataset)  # streaming, not materialized
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

    # corruption after a valid first record: found by the up-front check, with its line
    late = tmp_path / "late.jsonl"
    late.write_text(json.dumps({"text": "ok " * 10}) + "\n" + "{{{ not json\n")
    with pytest.raises(DatasetError, match=f"data file '{late}', line 2: bad record: not valid JSON"):
        build_source("local", str(late), tok, 16)

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
    assert "unknown dataset 'c4_test'; choices: ['passkey', 'fineweb_edu', 'local', 'pysource']" in p.stdout + p.stderr


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

    import nsa_flex.data.sources as data

    probe = data.hub_unreachable
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)  # the real probe: offline mode, no request
    assert probe() == "HF_HUB_OFFLINE is set"
    monkeypatch.setattr(data, "hub_unreachable", lambda timeout=5.0: "test: no network")
    t0 = time.time()
    with pytest.raises(DatasetError, match=r"hub is unreachable \(test: no network\).*dataset_path"):
        build_source("fineweb_edu", None, ByteTokenizer(), 64)
    assert time.time() - t0 < 5


@pytest.mark.slow
def test_nsa_train_bad_record_names_file_and_line_then_skips(tmp_path):
    """Through nsa-train: a broken line deep in a jsonl stops before step 1 with its file and line
    (exit 2, no traceback); ``--training.skip_bad_records`` trains on, logging the skip."""
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for i in range(1, 3001):
            f.write('{"text": "cut\n' if i == 2500 else json.dumps({"text": f"document {i} " * 5}) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--training.dataset", "local", "--training.dataset_path",
           str(path), "--training.steps", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--job.dump_folder", str(tmp_path / "out"), "--checkpoint.no-enable"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"nsa-train: error: data file '{path}', line 2500: bad record: not valid JSON" in p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    p = subprocess.run(cmd + ["--training.skip_bad_records"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"'{path}': 1 bad record(s) in its first 64 MiB (the first at line 2500) will be skipped" in (
        p.stdout + p.stderr)
