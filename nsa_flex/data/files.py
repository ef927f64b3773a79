"""Local data files: which files a ``dataset_path`` (a file, a folder or a glob) names, and their format."""

import glob
import os
import stat

from .errors import DatasetError

LOCAL_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
_NOT_A_FILE = "the loader opens a data file by name more than once (a check, then every pass) and " \
              "resumes at a position in it, which {what} cannot serve; write the data to a regular file"


def special_file_kind(path: str) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a folder (a FIFO,
    /dev/zero, ...), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, what in ((stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device (such as /dev/zero)"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None


def _check_special(path: str, field: str = "dataset_path") -> None:
    what = special_file_kind(path)
    if what:
        raise DatasetError(f"{field} {path!r} is {what}, not a regular file: " + _NOT_A_FILE.format(what=what))


def looks_local(path: str) -> bool:
    """Whether ``path`` names local files rather than a hub dataset id ("owner/name")."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or any(ch in path for ch in "*?[")
        or os.path.splitext(path)[1].lower() in LOCAL_FORMATS
        or os.path.exists(path)
        or path.count("/") != 1  # a hub id is exactly "owner/name"
    )


def resolve_local_files(path: str, choices=()) -> tuple[str, list[str]]:
    """The format ("parquet", "json" or "text") and the sorted files of a local file, folder or glob.
    ``choices``: the dataset names, for the message of a missing path."""
    p = os.path.expanduser(path)
    if any(ch in p for ch in "*?["):
        files = sorted(f for f in glob.glob(p, recursive=True) if not os.path.isdir(f))
        if not files:
            raise DatasetError(f"dataset_path {path!r}: the glob matches no file")
    elif os.path.isdir(p):
        files = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(p)
            for f in names
            if os.path.splitext(f)[1].lower() in LOCAL_FORMATS
        )
        if not files:
            raise DatasetError(
                f"dataset_path {path!r}: folder holds no {sorted(LOCAL_FORMATS)} file"
            )
    elif os.path.isfile(p):
        files = [p]
    else:
        _check_special(p)
        raise DatasetError(
            f"dataset_path {path!r} does not exist. Give a local {sorted(LOCAL_FORMATS)} file, a folder "
            f"or a glob of them" + (f" (datasets: {list(choices)})" if choices else "")
        )
    for f in files:
        _check_special(f, "data file")
    kinds = {LOCAL_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds:
        bad = [f for f in files if os.path.splitext(f)[1].lower() not in LOCAL_FORMATS]
        raise DatasetError(f"unsupported data file {bad[0]!r}: supported extensions {sorted(LOCAL_FORMATS)}")
    if len(kinds) > 1:
        raise DatasetError(f"dataset_path {path!r} mixes formats {sorted(kinds)}; use one format")
    return kinds.pop(), files
