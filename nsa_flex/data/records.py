"""The records of local data files, each with its real location (file and line or row).

``read_records`` is the document stream of a local dataset: one ``{text_column: str}`` per record, in file
order. A bad record -- a line that is not JSON, a record without the text field, a null or non-string
text, undecodable UTF-8, an unreadable parquet row group -- stops the stream with one
:class:`DatasetError` naming the file and the line (jsonl, txt: 1-based, as editors count) or the row
(parquet: 0-based, as pyarrow and pandas count); with ``skip_bad`` it is skipped instead, logged with
its location (the first ``LOG_FIRST`` of a file) and counted per file at the end of the file.

``check_local_file`` runs the same reader over the head of a file before training starts (the first
``SCAN_BYTES`` of a jsonl / json / txt source, shared by its files, at least ``SCAN_MIN_BYTES`` each;
every row group's null count of a parquet file, from its footer), so a bad record there fails in
seconds, not after thousands of steps.
"""

import json
import logging
import os
from typing import Iterator

from .errors import DatasetError

logger = logging.getLogger(__name__)

SCAN_BYTES = 64 << 20
SCAN_MIN_BYTES = 1 << 20
LOG_FIRST = 10
SKIP_HINT = "fix or remove it, or set [training] skip_bad_records = true to skip bad records"


def _check_text(rec, text_column: str) -> tuple[object, str | None]:
    if not isinstance(rec, dict):
        return None, f"a JSON {type(rec).__name__}, not an object"
    if text_column not in rec:
        return None, f"no field {text_column!r} (fields: {sorted(rec)[:8]})"
    text = rec[text_column]
    if text is None:
        return None, f"{text_column!r} is null"
    if not isinstance(text, str):
        return None, f"{text_column!r} is {type(text).__name__} {str(text)[:40]!r}, not a string"
    return text, None


def _json_lines(path: str, text_column: str, limit: int | None) -> Iterator[tuple[str, object, str | None]]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith(b"["):  # one JSON array of records
            try:
                recs = json.load(f)
            except (ValueError, UnicodeDecodeError) as e:
                raise DatasetError(f"corrupt JSON file {path!r}: {e}") from e
            for i, rec in enumerate(recs):
                yield f"record {i} of the array", *_check_text(rec, text_column)
            return
        read = 0
        for n, line in enumerate(f, 1):
            read += len(line)
            if line.strip():
                try:
                    rec = json.loads(line)
                except (ValueError, UnicodeDecodeError) as e:
                    yield f"line {n}", None, f"not valid JSON ({e})"
                else:
                    yield f"line {n}", *_check_text(rec, text_column)
            if limit is not None and read >= limit:
                return


def _paragraphs(path: str, limit: int | None) -> Iterator[tuple[str, object, str | None]]:
    """One record per paragraph (lines up to a blank line), located at its first line."""
    para, start, bad, read = [], 0, None, 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            read += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                line = raw.decode("utf-8", errors="replace")
                bad = bad or f"not UTF-8 at line {n} ({e.reason} at byte {e.start} of the line)"
            if line.strip():
                if not para:
                    start = n
                para.append(line)
            elif para:
                yield f"line {start}", "".join(para).rstrip("\n"), bad
                para, bad = [], None
            if limit is not None and read >= limit:
                return
        if para:
            yield f"line {start}", "".join(para).rstrip("\n"), bad


def _parquet_rows(path: str, text_column: str) -> Iterator[tuple[str, object, str | None]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DatasetError(f"corrupt or unreadable data file {path!r}: {type(e).__name__}: {e}") from e
    import pyarrow as pa

    row0 = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        try:  # as bytes: Arrow does not check UTF-8, each value is decoded (and judged) on its own
            col = pf.read_row_group(g, columns=[text_column]).column(text_column).cast(pa.large_binary()).to_pylist()
        except Exception as e:
            why = f"unreadable row group {g} (rows {row0}..{row0 + n - 1}): {type(e).__name__}: {e}"
            for i in range(n):  # every row of it is lost: each one counts
                yield f"row {row0 + i}", None, why
            row0 += n
            continue
        for i, raw in enumerate(col):
            text, why = None, f"{text_column!r} is null"
            if raw is not None:
                try:
                    text, why = raw.decode("utf-8"), None
                except UnicodeDecodeError as e:
                    why = f"not UTF-8 ({e.reason} at byte {e.start})"
            yield f"row {row0 + i}", text, why
        row0 += n


def raw_records(path: str, fmt: str, text_column: str, limit: int | None = None):
    """(location, text, why-bad or None) of every record of one file; ``limit``: stop after about
    that many bytes (jsonl, txt)."""
    if fmt == "parquet":
        return _parquet_rows(path, text_column)
    if fmt == "json":
        return _json_lines(path, text_column, limit)
    return _paragraphs(path, limit)


def read_records(files: list[str], fmt: str, text_column: str = "text", skip_bad: bool = False):
    """``{text_column: str}`` per good record of ``files`` (in order), see the module docstring. A
    generator function of module level: ``datasets.IterableDataset.from_generator`` shards it by
    ``files``."""
    for path in files:
        bad = 0
        try:
            for where, text, why in raw_records(path, fmt, text_column):
                if why is None:
                    yield {text_column: text}
                    continue
                if not skip_bad:
                    raise DatasetError(f"data file {path!r}, {where}: bad record: {why}; {SKIP_HINT}")
                bad += 1
                if bad <= LOG_FIRST:
                    logger.warning(f"Skipping bad record {bad} of {path!r}, {where}: {why}")
        except OSError as e:
            raise DatasetError(f"cannot read data file {path!r}: {e}") from e
        if bad:
            logger.warning(f"Data file {path!r}: {bad} bad record(s) skipped in this pass")


def check_local_file(fmt: str, path: str, text_column: str, skip_bad: bool = False,
                     limit: int | None = None) -> str | None:
    """Up-front check of one data file (see the module docstring). Raises DatasetError naming the
    file and the location; returns why the file holds no documents (empty, 0 rows, blank lines
    only) or None. ``limit``: bytes to check (default SCAN_BYTES)."""
    limit = SCAN_BYTES if limit is None else limit
    try:
        if os.path.getsize(path) == 0:
            return "the file is empty (0 bytes)"
        if fmt == "parquet":
            return _check_parquet(path, text_column, skip_bad)
        first, bad, where0 = True, 0, None
        for where, text, why in raw_records(path, fmt, text_column, limit=limit):
            if first and fmt == "json" and why and why.startswith("no field"):
                raise DatasetError(f"data file {path!r}: first record ({where}) has no field "
                                   f"{text_column!r}; set [training] dataset_text_column")
            first = False
            if why:
                if not skip_bad:
                    raise DatasetError(f"data file {path!r}, {where}: bad record: {why}; {SKIP_HINT}")
                bad, where0 = bad + 1, where0 or where
        if first:
            return "the file holds only blank lines (no records)" if fmt == "json" else \
                "the file holds only blank lines (no text)"
        if bad:
            logger.warning(f"Data file {path!r}: {bad} bad record(s) in its first {limit / (1 << 20):g} MiB "
                           f"(the first at {where0}) will be skipped (skip_bad_records)")
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(f"corrupt or unreadable data file {path!r}: {type(e).__name__}: {e}") from e
    return None


def _check_parquet(path: str, text_column: str, skip_bad: bool) -> str | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    if text_column not in schema.names:
        raise DatasetError(
            f"data file {path!r} has no column {text_column!r} (columns: {schema.names}); "
            "set [training] dataset_text_column"
        )
    typ = schema.field(text_column).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise DatasetError(f"data file {path!r}: column {text_column!r} holds {typ}, not strings; "
                           "set [training] dataset_text_column to a text column")
    if pf.metadata.num_rows == 0:
        return "the parquet file has 0 rows"
    idx = schema.get_field_index(text_column)
    nulls, row0 = 0, 0
    for g in range(pf.num_row_groups):
        rg = pf.metadata.row_group(g)
        st = rg.column(idx).statistics
        n = st.null_count if st is not None and st.has_null_count else 0
        if n and not skip_bad:
            col = pf.read_row_group(g, columns=[text_column]).column(text_column)
            first = next(i for i, v in enumerate(col.to_pylist()) if v is None)
            raise DatasetError(f"data file {path!r}, row {row0 + first}: bad record: {text_column!r} is "
                               f"null; {SKIP_HINT}")
        nulls += n
        row0 += rg.num_rows
    if nulls:
        logger.warning(f"Data file {path!r}: {nulls} null {text_column!r} row(s) will be skipped (skip_bad_records)")
    return None
