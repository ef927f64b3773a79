"""The Python source of installed packages as a long-document corpus (``[training] dataset = "pysource"``).

Every machine that runs the trainer has it, offline: the ``.py`` files under site-packages (torch,
triton, numpy, ... whatever is installed; ``dataset_path`` names other folders of packages instead).

Documents. One document per module directory: the ``.py`` files of one directory of one package,
``__init__.py`` first and then by name, each preceded by a ``# file: package/dir/name.py`` line. A
directory is the unit whose files import each other and share names (a class defined in one file,
subclassed and called in its siblings), so a document carries dependencies thousands of tokens
apart; one file is mostly too short for that (the median file is a few hundred tokens), and a whole
package (torch: ~46 MB of source) is one stream of unrelated subsystems with no document boundary.
The documents are ordered by a hash of (``dataset_seed``, their path): stable across machines,
packages interleaved.

Split by package. A package (the top-level folder's name, lower-cased) is in the validation split
when ``sha256("pysource-validation:" + name) % 100 < VALIDATION_PERCENT`` (10), else in training: no
file of a validation package is ever trained on, and the assignment of a package never depends on
what else is installed (torch, triton, numpy, jax, transformers are training packages; e.g. moto,
markdown, tomli, orjson are validation ones). ``python -m nsa_flex.data.pysource`` lists the packages
of each split on this machine and reports the token count.

Retrieval mix: :func:`pysource_retrieval` gives the passkey / multi-key documents whose haystack is
source of the same split (nsa_flex/data/retrieval.py).
"""

import argparse
import hashlib
import logging
import os
import site
import sysconfig
import tokenize

from datasets import IterableDataset

from .errors import DatasetError
from .files import special_file_kind
from .records import LOG_FIRST, SKIP_HINT
from .retrieval import RetrievalCorpus
from .text_source import HFTextSource

logger = logging.getLogger(__name__)

VALIDATION_PERCENT = 10
SPLIT_SALT = "pysource-validation"
SPLITS = ("train", "validation")


def split_of(package: str) -> str:
    """The split of a package: "validation" for the hashed VALIDATION_PERCENT of names, else "train"."""
    h = int(hashlib.sha256(f"{SPLIT_SALT}:{package.lower()}".encode()).hexdigest()[:8], 16)
    return "validation" if h % 100 < VALIDATION_PERCENT else "train"


def site_roots() -> list[str]:
    """This interpreter's site-packages folders (purelib, platlib, site and user site), existing ones."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        paths.append(site.getusersitepackages())
    out = []
    for p in paths:
        p = os.path.realpath(p)
        if os.path.isdir(p) and p not in out:
            out.append(p)
    return out


def parse_roots(path: str | None) -> list[str]:
    """``dataset_path`` (folders of packages, joined by os.pathsep) or this interpreter's site-packages."""
    if not path:
        return site_roots()
    roots = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
    for r in roots:
        what = special_file_kind(r)
        if what or not os.path.isdir(r):
            raise DatasetError(f"dataset_path {r!r} for dataset 'pysource' "
                               + (f"is {what}" if what else "is not a folder")
                               + ": give folders of Python packages (joined by ':'), or leave it unset for "
                               "this interpreter's site-packages")
    return roots


def find_packages(roots: list[str]) -> dict[str, str]:
    """{package name: folder} of the top-level package folders under ``roots`` (an identifier name;
    the first root that has a name wins)."""
    found: dict[str, str] = {}
    for root in roots:
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.isidentifier() and name not in found and os.path.isdir(path):
                found[name] = path
    return found


def _py_files(folder: str) -> list[str]:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py") and os.path.isfile(os.path.join(folder, n)))
    return sorted(names, key=lambda n: n != "__init__.py")


def list_units(split: str, roots: list[str], seed: int = 0) -> list[tuple[str, str]]:
    """The documents of ``split``: (package folder's parent, directory relative to it), in hashed order."""
    units = []
    for name, path in find_packages(roots).items():
        if split_of(name) != split:
            continue
        parent = os.path.dirname(path)
        for folder, dirs, _ in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            if _py_files(folder):
                units.append((parent, os.path.relpath(folder, parent)))
    return sorted(units, key=lambda u: hashlib.sha256(f"{seed}:{u[1]}".encode()).hexdigest())


def read_unit(parent: str, rel: str, max_chars: int | None = None, skip_bad: bool = False) -> str:
    """The document of one directory (see the module docstring); ``max_chars``: stop after the file
    that reaches it. A file that is not decodable source is a bad record (skipped with skip_bad)."""
    parts, n = [], 0
    for name in _py_files(os.path.join(parent, rel)):
        path = os.path.join(parent, rel, name)
        try:
            with tokenize.open(path) as f:  # the PEP 263 encoding
                src = f.read()
        except (SyntaxError, UnicodeDecodeError) as e:
            line = getattr(e, "lineno", None)
            if isinstance(e, UnicodeDecodeError):
                with open(path, "rb") as f:
                    line = f.read()[: e.start].count(b"\n") + 1
            why = f"python source file {path!r}, line {line}: bad record: not decodable source ({e})"
            if not skip_bad:
                raise DatasetError(f"{why}; {SKIP_HINT}") from None
            logger.warning(f"Skipping {why}")
            continue
        except OSError as e:
            raise DatasetError(f"cannot read python source file {path!r}: {e}") from e
        parts.append(f"# file: {os.path.join(rel, name)}\n{src}\n")
        n += len(parts[-1])
        if max_chars is not None and n >= max_chars:
            break
    return "".join(parts)


def read_units(units: list[tuple[str, str]], skip_bad: bool = False):
    """``{"text": document}`` per unit: the generator ``IterableDataset.from_generator`` shards by unit."""
    for parent, rel in units:
        text = read_unit(parent, rel, skip_bad=skip_bad)
        if text:
            yield {"text": text}


def _units_or_error(split: str, roots: list[str], seed: int) -> list[tuple[str, str]]:
    if split not in SPLITS:
        raise DatasetError(f"dataset 'pysource': split {split!r} not in {list(SPLITS)}")
    units = list_units(split, roots, seed)
    if not units:
        names = sorted(find_packages(roots))
        raise DatasetError(
            f"no training text in dataset 'pysource' ({split} split): "
            + (f"no Python package (a folder with .py files) under {roots}" if not names else
               f"none of the {len(names)} packages under {roots} is in the {split} split (validation: "
               f"sha256('{SPLIT_SALT}:' + name) % 100 < {VALIDATION_PERCENT})"))
    return units


def pysource_source(tokenizer, split: str = "train", seed: int = 0, path: str | None = None,
                    skip_bad: bool = False) -> HFTextSource:
    """The document source of the ``split`` packages (training: everything but validation)."""
    roots = parse_roots(path)
    units = _units_or_error(split, roots, seed)
    ds = IterableDataset.from_generator(read_units, gen_kwargs={"units": units, "skip_bad": skip_bad})
    logger.info(f"Dataset pysource ({split}): {len(units)} module directories of "
                f"{len({u[1].split(os.sep)[0] for u in units})} packages under {roots}")
    return HFTextSource(ds, tokenizer, "text", name=f"pysource:{split}", skip_bad=skip_bad)


def pysource_retrieval(tokenizer, length: int, split: str = "train", seed: int = 0, path: str | None = None,
                       multikey_share: float = 0.5, questions: int = 1, min_gap: int = 0,
                       min_gap_share: float = 1.0) -> RetrievalCorpus:
    """Passkey / multi-key documents of ``length`` tokens whose filler is source of the ``split``
    packages, each asking ``questions`` times (single-key ones ``min_gap`` apart in a ``min_gap_share``
    of them: PasskeyCorpus)."""
    units = _units_or_error(split, parse_roots(path), seed)
    return RetrievalCorpus(tokenizer, length, lambda i, n: read_unit(*units[i], max_chars=n, skip_bad=True),
                           len(units), seed=seed, split=split, multikey_share=multikey_share,
                           questions=questions, min_gap=min_gap, min_gap_share=min_gap_share)


def pysource_texts(split: str = "validation", path: str | None = None, seed: int = 0) -> list[str]:
    """The documents of ``split`` as strings, in the corpus order (evaluation's ``--docs pysource``)."""
    return [t for t in (read_unit(*u, skip_bad=True) for u in _units_or_error(split, parse_roots(path), seed)) if t]


# ----------------------------------------------------------------------------- token count
def token_report(encode, roots: list[str], sample: float = 1.0, long_tokens: int = 16384) -> dict:
    """Per split: packages, documents, characters, and tokens -- counted on the documents whose
    hashed path falls in the ``sample`` fraction (all of them at 1.0) and extrapolated by characters;
    ``long_share``: the estimated share of tokens in documents longer than ``long_tokens`` tokens."""
    out = {}
    for split in SPLITS:
        units = list_units(split, roots)
        chars, s_chars, s_tokens, sizes = 0, 0, 0, []
        for parent, rel in units:
            text = read_unit(parent, rel, skip_bad=True)
            chars += len(text)
            sizes.append(len(text))
            if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) < sample * 16 ** 8:
                s_chars += len(text)
                s_tokens += len(encode(text))
        ratio = s_tokens / s_chars if s_chars else 0.0
        out[split] = {
            "packages": sorted({rel.split(os.sep)[0] for _, rel in units}),
            "documents": len(units),
            "chars": chars,
            "sampled_chars": s_chars,
            "sampled_tokens": s_tokens,
            "tokens": round(chars * ratio),
            "long_share": sum(c for c in sizes if c * ratio > long_tokens) / chars if chars else 0.0,
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nsa_flex.data.pysource", description=(
        "List the packages of the pysource corpus per split on this machine and count its tokens."))
    p.add_argument("--encoding", default="gpt2", help="tiktoken encoding (offline: set TIKTOKEN_CACHE_DIR)")
    p.add_argument("--sample", type=float, default=1.0,
                   help="fraction of documents tokenized, the count extrapolated by characters (0 < x <= 1)")
    p.add_argument("--path", default=None, help="folders of packages (':'-joined); default: site-packages")
    p.add_argument("--seq-len", type=int, default=16384, help="report the token share of longer documents")
    a = p.parse_args(argv)
    if not 0 < a.sample <= 1:
        p.error(f"--sample {a.sample}: must be in (0, 1]")
    import tiktoken

    try:
        roots = parse_roots(a.path)
        enc = tiktoken.get_encoding(a.encoding)
    except (DatasetError, ValueError, OSError) as e:
        p.error(str(e))
    rep = token_report(enc.encode_ordinary, roots, a.sample, a.seq_len)
    print(f"pysource under {roots} ({a.encoding}, {100 * a.sample:g}% of documents tokenized):")
    for split, r in rep.items():
        print(f"  {split:10s} {len(r['packages']):4d} packages {r['documents']:6d} documents "
              f"{r['chars'] / 1e6:8.1f} M chars ~{r['tokens'] / 1e6:8.1f} M tokens "
              f"({100 * r['long_share']:.0f}% in documents > {a.seq_len} tokens)")
    print("  validation packages: " + ", ".join(rep["validation"]["packages"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
