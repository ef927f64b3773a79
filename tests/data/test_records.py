"""Bad records in local data files (nsa_flex/data/records.py): every error names the file and the real
line (jsonl, txt) or row (parquet), wherever the record sits; ``skip_bad`` skips them with a count in
the log; FIFOs and devices as data paths are named as such."""

import json
import os

import pytest

from nsa_flex.data import records, sources
from nsa_flex.data.errors import DatasetError
from nsa_flex.data.packing import PackedTokenDataset
from nsa_flex.data.sources import build_source
from nsa_flex.data.text_source import HFTextSource
from nsa_flex.titan.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _texts(src):
    return [TOK.decode(t[1:-1]) for t in src]  # without BOS / EOS


def _jsonl(path, n, bad: dict):
    """n lines of {"text": "doc i"}; ``bad`` maps a 1-based line number to its raw replacement."""
    with open(path, "w") as f:
        for line in range(1, n + 1):
            f.write(bad.get(line, json.dumps({"text": f"doc {line}"})) + "\n")
    return path


BAD_LINES = {
    "broken": ('{"text": "cut', r"not valid JSON"),
    "null": ('{"text": null}', r"'text' is null"),
    "int": ('{"text": 5}', r"'text' is int '5', not a string"),
    "list": ('["a"]', r"a JSON list, not an object"),
    "nofield": ('{"body": "x"}', r"no field 'text'"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
@pytest.mark.parametrize("line", [2, 25001])
def test_bad_jsonl_line_fails_up_front_with_file_and_line(tmp_path, kind, line):
    raw, why = BAD_LINES[kind]
    path = _jsonl(tmp_path / "d.jsonl", 25010, {line: raw})
    with pytest.raises(DatasetError, match=rf"data file '{path}', line {line}: bad record: {why}.*"
                                           r"skip_bad_records = true"):
        build_source("local", str(path), TOK, 64)


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_jsonl_line_past_the_checked_head_fails_while_streaming_at_its_line(tmp_path, monkeypatch, kind):
    raw, why = BAD_LINES[kind]
    path = _jsonl(tmp_path / "d.jsonl", 3000, {2500: raw})
    monkeypatch.setattr(sources, "SCAN_BYTES", 1000)  # the up-front check reads ~90 lines
    monkeypatch.setattr(sources, "SCAN_MIN_BYTES", 1000)
    src = build_source("local", str(path), TOK, 64)
    with pytest.raises(DatasetError, match=rf"data file '{path}', line 2500: bad record: {why}") as e:
        _texts(src)
    assert src.records == 2499  # the records before it were read


def test_skip_bad_records_skips_and_counts_in_the_log(tmp_path, caplog):
    bad = {3: '{"text": null}', 7: '{"text": 12}', 8: "{{{", 20: '{"other": "x"}'}
    path = _jsonl(tmp_path / "d.jsonl", 30, bad)
    with caplog.at_level("WARNING"):
        src = build_source("local", str(path), TOK, 64, skip_bad=True)
        got = _texts(src)
    assert got == [f"doc {i}" for i in range(1, 31) if i not in bad]
    log = caplog.text
    assert "4 bad record(s) in its first 64 MiB (the first at line 3) will be skipped" in log
    assert f"Data file '{path}': 4 bad record(s) skipped in this pass" in log
    assert f"Skipping bad record 2 of '{path}', line 7: 'text' is int" in log


def test_skip_bad_records_logs_the_first_ones_and_the_count(tmp_path, caplog):
    path = _jsonl(tmp_path / "d.jsonl", 100, {i: "nope" for i in range(1, 100, 2)})
    with caplog.at_level("WARNING"):
        got = _texts(build_source("local", str(path), TOK, 64, skip_bad=True))
    assert got == [f"doc {i}" for i in range(2, 101, 2)]
    assert caplog.text.count("Skipping bad record") == records.LOG_FIRST
    assert "50 bad record(s) skipped in this pass" in caplog.text


def test_skip_resumes_exactly(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", 200, {i: '{"text": null}' for i in range(5, 200, 9)})

    def packed():
        return PackedTokenDataset(build_source("local", str(path), TOK, 16, skip_bad=True), 16, infinite=False)

    full = [y.tolist() for _, y in packed()]
    ds = packed()
    it = iter(ds)
    head = [next(it)[1].tolist() for _ in range(10)]
    again = packed()
    again.load_state_dict(ds.state_dict())
    assert head + [y.tolist() for _, y in again] == full


def _parquet(path, texts, row_group_size=10):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path, row_group_size=row_group_size)
    return path


def test_parquet_null_row_named_by_row_and_skipped(tmp_path, caplog):
    texts = [f"row {i}" for i in range(45)]
    texts[37] = None
    path = _parquet(tmp_path / "d.parquet", texts)
    with pytest.raises(DatasetError, match=rf"data file '{path}', row 37: bad record: 'text' is null"):
        build_source("local", str(path), TOK, 64)
    with caplog.at_level("WARNING"):
        got = _texts(build_source("local", str(path), TOK, 64, skip_bad=True))
    assert got == [t for t in texts if t is not None]
    assert "1 null 'text' row(s) will be skipped" in caplog.text


def test_parquet_bad_utf8_value_skips_its_row_only(tmp_path, caplog):
    """One value of a row group that is not UTF-8 (Arrow stores it unchecked) is one bad record:
    the other rows of its row group are read, the count is 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = [f"row {i}".encode() for i in range(25)]
    raw[13] = b"bad \xff\xfe"
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"text": pa.array(raw, type=pa.binary()).view(pa.string())}), path, row_group_size=10)
    with pytest.raises(DatasetError, match=rf"data file '{path}', row 13: bad record: not UTF-8 \(invalid start "
                                           r"byte at byte 4\)"):
        list(records.read_records([str(path)], "parquet"))
    with caplog.at_level("WARNING"):
        got = [r["text"] for r in records.read_records([str(path)], "parquet", skip_bad=True)]
    assert got == [r.decode() for i, r in enumerate(raw) if i != 13]
    assert f"Data file '{path}': 1 bad record(s) skipped in this pass" in caplog.text


def test_parquet_non_string_column_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2, 3])}), path)
    with pytest.raises(DatasetError, match=rf"data file '{path}': column 'text' holds int64, not strings"):
        build_source("local", str(path), TOK, 64)


def test_txt_non_utf8_paragraph_named_by_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"first para\n\nsecond\npara \xff here\n\nthird\n")
    with pytest.raises(DatasetError, match=rf"data file '{path}', line 3: bad record: not UTF-8 at line 4"):
        build_source("local", str(path), TOK, 64)
    assert _texts(build_source("local", str(path), TOK, 64, skip_bad=True)) == ["first para", "third"]


def test_hub_stream_null_and_non_string_texts_are_bad_records(caplog):
    from datasets import IterableDataset

    def gen():
        yield from ({"text": t} for t in ["a b", None, "c d", 7, "e f"])

    ds = IterableDataset.from_generator(gen)
    with pytest.raises(DatasetError, match=r"dataset hub/x, record 1 of this pass: bad record: 'text' is null"):
        list(HFTextSource(ds, TOK, "text", name="hub/x"))
    with caplog.at_level("WARNING"):
        got = _texts(HFTextSource(ds, TOK, "text", name="hub/x", skip_bad=True))
    assert got == ["a b", "c d", "e f"]
    assert "record 3 of this pass: 'text' is int, not a string" in caplog.text


def test_fifo_and_dev_zero_are_named_not_missing(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for name in ("local", "fineweb_edu"):
        with pytest.raises(DatasetError, match=rf"dataset_path '{fifo}' is a FIFO \(named pipe\), not a regular file"):
            build_source(name, str(fifo), TOK, 64)
    with pytest.raises(DatasetError, match=r"dataset_path '/dev/zero' is a character device \(such as /dev/zero\)"):
        build_source("local", "/dev/zero", TOK, 64)
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DatasetError, match=rf"data file '{fifo}' is a FIFO"):  # inside a folder
        build_source("local", str(tmp_path), TOK, 64)


def test_the_checked_head_is_shared_by_the_files(tmp_path, monkeypatch, caplog):
    """Many files share SCAN_BYTES (at least SCAN_MIN_BYTES each): a bad line early in the fourth
    file is found up front, one past its share only while streaming."""
    monkeypatch.setattr(sources, "SCAN_BYTES", 8000)
    monkeypatch.setattr(sources, "SCAN_MIN_BYTES", 500)
    for i in range(4):
        _jsonl(tmp_path / f"p{i}.jsonl", 200, {})
    _jsonl(tmp_path / "p3.jsonl", 200, {10: "{{"})  # ~19 bytes a line: inside the 2000-byte share
    with pytest.raises(DatasetError, match=r"p3.jsonl', line 10: bad record"):
        build_source("local", str(tmp_path), TOK, 64)
    _jsonl(tmp_path / "p3.jsonl", 200, {150: "{{"})
    with caplog.at_level("WARNING"):
        src = build_source("local", str(tmp_path), TOK, 64, skip_bad=True)
    assert "bad record" not in caplog.text  # not seen up front
    with pytest.raises(DatasetError, match=r"p3.jsonl', line 150: bad record"):
        _texts(build_source("local", str(tmp_path), TOK, 64))
    assert len(_texts(src)) == 799


def test_a_checkpoint_of_another_dataset_is_named(tmp_path):
    text = build_source("local", str(_jsonl(tmp_path / "d.jsonl", 5, {})), TOK, 64)
    passkey = build_source("passkey", None, TOK, 256)
    with pytest.raises(DatasetError, match=r"data state \['data'\] is not that of passkey.*another dataset"):
        passkey.load_state_dict(text.state_dict())
    with pytest.raises(DatasetError, match=rf"data state \['doc_idx'\] is not that of data file '{tmp_path}"):
        text.load_state_dict(passkey.state_dict())
