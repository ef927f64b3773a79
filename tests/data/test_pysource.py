"""The pysource corpus (nsa_flex/data/pysource.py): documents per module directory, the split by
package (disjoint, deterministic, independent of the other packages), the retrieval mix and its
share in the trainer's loader, the token-count report, and its errors."""

import os
import random
import re

import pytest
from torchtitan.config import ConfigManager

from nsa_flex.data import pysource
from nsa_flex.data.errors import DatasetError
from nsa_flex.data.passkey import multikey_document
from nsa_flex.data.sources import build_source
from nsa_flex.titan.data import build_dataloader
from nsa_flex.titan.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
NAMES = [f"pkg{i}" for i in range(30)]
HEADER = re.compile(r"# file:? (\w+)/")  # the filler's own ":" is taken out (the cue)


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder of 30 packages: __init__.py, core.py, util/__init__.py, util/helpers.py each, plus
    a dist-info folder, a __pycache__ and a data-only folder (no document)."""
    root = tmp_path_factory.mktemp("site")
    for name in NAMES:
        body = "".join(f"def {name}_f{j}(x):\n    return x + {j}  # {name}\n\n" for j in range(40))
        _write(root / name / "__init__.py", f"from .core import Thing  # {name}\n")
        _write(root / name / "core.py", f"class Thing:\n    '''{name} core'''\n" + body)
        _write(root / name / "util" / "__init__.py", "")
        _write(root / name / "util" / "helpers.py", f"from ..core import Thing\n" + body)
        _write(root / name / "__pycache__" / "core.cpython-311.py", "cached")
        _write(root / name / "data" / "table.csv", "a,b\n")
    _write(root / "pkg0-1.0.dist-info" / "METADATA", "Name: pkg0\n")
    return str(root)


def test_split_rule_is_fixed_and_by_package(site):
    assert {n: pysource.split_of(n) for n in ("torch", "triton", "numpy", "jax", "transformers")} == dict.fromkeys(
        ("torch", "triton", "numpy", "jax", "transformers"), "train")
    assert pysource.split_of("moto") == pysource.split_of("Moto") == "validation"
    val = [n for n in NAMES if pysource.split_of(n) == "validation"]
    assert 0 < len(val) < 10  # ~10% of the names
    share = sum(pysource.split_of(f"package_{i}") == "validation" for i in range(2000)) / 2000
    assert 0.08 < share < 0.12


def test_documents_per_directory_split_disjoint_and_deterministic(site, tmp_path):
    train = pysource.list_units("train", [site])
    val = pysource.list_units("validation", [site])
    assert len(train) + len(val) == 2 * len(NAMES)  # the package dir and util/ of each; no cache, no data dir
    assert not {u[1] for u in train} & {u[1] for u in val}
    for split, units in (("train", train), ("validation", val)):
        assert all(pysource.split_of(rel.split(os.sep)[0]) == split for _, rel in units)
    assert train == pysource.list_units("train", [site])  # deterministic
    assert train != sorted(train)  # hashed order, packages interleaved
    assert pysource.list_units("train", [site], seed=1) != train
    # another installed package changes no split and no relative order
    other = tmp_path / "other"
    _write(other / "zzz_extra" / "__init__.py", "x = 1\n")
    more = pysource.list_units("train", [site, str(other)]) + pysource.list_units("validation", [site, str(other)])
    assert [u for u in more if not u[1].startswith("zzz_extra")] == train + val
    # the document of a directory: __init__.py first, then by name, each under its path
    doc = pysource.read_unit(*next(u for u in train if os.sep not in u[1]))
    files = HEADER.findall(doc)
    assert re.findall(r"# file: (\S+)", doc)[0].endswith("__init__.py") and len(files) == 2
    assert "class Thing" in doc and "Thing  #" in doc.split("# file:")[1]


def test_source_streams_only_its_split(site):
    for split in pysource.SPLITS:
        src = build_source("pysource", site, TOK, 128, split=split)
        pkgs = {p for toks in src for p in HEADER.findall(TOK.decode(toks))}
        assert pkgs == {n for n in NAMES if pysource.split_of(n) == split}


def test_multikey_document_is_the_evaluations_prompt():
    """The training multi-key document, cut before its answer, is the needle evaluation's prompt."""
    from nsa_flex.apps.eval.prompts import NAMES as EVAL_NAMES, Filler, make_prompt

    filler = Filler("synthetic", TOK)
    for length, depth, trial in ((600, 0, 1), (1000, 50, 2), (2048, 100, 3)):
        rng = random.Random(f"needle:0:multikey:{length}:{depth}:{trial}")
        names = rng.sample(EVAL_NAMES, 4)
        keys = rng.sample(range(10000, 100000), 4)
        depths = [depth / 100.0] + [rng.random() for _ in range(3)]
        toks, ans = multikey_document(TOK, length + 1, names, keys, depths, filler.tokens(length + 1, trial))
        want = make_prompt(TOK, "multikey", length, depth, trial, filler)
        assert toks[:ans] == want["tokens"] and TOK.decode(toks[ans:-1]) == f" {want['expected']}."


def _job(site, *args):
    return ConfigManager().parse_args([
        "--job.custom_config_module", "nsa_flex.titan.job_config", "--training.dataset", "pysource",
        "--training.dataset_path", site, "--training.seq_len", "512", "--training.local_batch_size", "8", *args])


def test_loader_mixes_retrieval_documents_at_the_default_share(site):
    loader = build_dataloader(1, 0, TOK, _job(site))
    ds = loader.dataset
    assert ds.passkey_mix == 0.15
    rows = [row.tolist() for _, (x, _y) in zip(range(40), loader) for row in x["input"]]
    kinds = {"passkey": 0, "multikey": 0}
    n_retrieval = 0
    for g, row in enumerate(rows):
        text = TOK.decode(row)
        if ds.is_passkey(g):
            n_retrieval += 1
            toks, ans, key = ds.passkey.document(g)
            assert row == toks[:-1] and len(toks) == 513 and TOK.decode(toks[ans:-1]) == f" {key}."
            kinds[ds.passkey.kind(g)] += 1
            assert text.count("What is the pass key") == 1
            # the haystack is source of training packages only
            assert all(pysource.split_of(p) == "train" for p in HEADER.findall(text))
        else:
            assert "pass key" not in text
    assert 0.09 < n_retrieval / len(rows) < 0.22, n_retrieval
    assert kinds["passkey"] > 3 and kinds["multikey"] > 3
    assert build_dataloader(1, 0, TOK, _job(site, "--training.passkey_mix", "0.5")).dataset.passkey_mix == 0.5
    assert build_dataloader(1, 0, TOK, _job(site, "--training.passkey_mix", "0")).dataset.passkey is None
    with pytest.raises(DatasetError, match=r"seq_len=256 is too short for a 4-key document"):
        build_dataloader(1, 0, TOK, _job(site, "--training.seq_len", "256"))


def test_retrieval_documents_ask_passkey_questions_and_hold_the_only_cues(site):
    """``[training] passkey_questions`` reaches the pysource retrieval documents (passkey and
    multi-key alike), and the cue ":" before every key occurs only in needles and questions, though
    the source-code filler is full of it."""
    loader = build_dataloader(1, 0, TOK, _job(site, "--training.passkey_mix", "0.6",
                                              "--training.passkey_questions", "4",
                                              "--training.seq_len", "1024"))
    ds = loader.dataset
    assert ds.passkey.questions == 4
    seen = {"passkey": 0, "multikey": 0}
    for g, (row, *_rest) in zip(range(60), ((r.tolist(),) for _, (x, _y) in zip(range(8), loader)
                                            for r in x["input"])):
        if not ds.is_passkey(g):
            continue
        kind = ds.passkey.kind(g)
        seen[kind] += 1
        toks, ans, key = ds.passkey.document(g)
        text = TOK.decode(toks)
        assert text.count("What is the pass key") == 4 and TOK.decode(toks[ans:-1]) == f" {key}."
        assert text.count(":") == (2 + 4 if kind == "passkey" else 2 * ds.passkey.n_keys + 4), text
        assert "return x + " in text  # the haystack is source code
    assert seen["passkey"] >= 2 and seen["multikey"] >= 2, seen


def test_token_report_counts_and_extrapolates(site):
    exact = pysource.token_report(str.split, [site], sample=1.0, long_tokens=100)
    for split in pysource.SPLITS:
        units = pysource.list_units(split, [site])
        texts = [pysource.read_unit(*u) for u in units]
        r = exact[split]
        assert r["documents"] == len(units) and r["chars"] == sum(map(len, texts))
        assert r["tokens"] == sum(len(t.split()) for t in texts) == r["sampled_tokens"]
        assert r["packages"] == sorted(n for n in NAMES if pysource.split_of(n) == split)
        assert r["long_share"] == sum(len(t) for t in texts if len(t) * r["tokens"] / r["chars"] > 100) / r["chars"]
    half = pysource.token_report(str.split, [site], sample=0.5)["train"]
    assert 0 < half["sampled_chars"] < exact["train"]["chars"]
    assert abs(half["tokens"] - exact["train"]["tokens"]) < 0.1 * exact["train"]["tokens"]


def test_token_report_cli(site, capsys, monkeypatch):
    cache = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "tiktoken_cache")
    if not os.path.isdir(cache):
        pytest.skip("tiktoken cache not found")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache)
    assert pysource.main(["--path", site, "--sample", "1"]) == 0
    out = capsys.readouterr().out
    n_val = sum(pysource.split_of(n) == "validation" for n in NAMES)
    assert re.search(rf"train\s+{len(NAMES) - n_val} packages\s+{2 * (len(NAMES) - n_val)} documents", out)
    assert "validation packages: " + ", ".join(sorted(n for n in NAMES if pysource.split_of(n) == "validation")) in out


def test_errors_name_the_path_and_the_split(tmp_path, site):
    with pytest.raises(DatasetError, match=r"no training text in dataset 'pysource' \(train split\): no Python package"):
        build_source("pysource", str(tmp_path), TOK, 64)
    val_only = tmp_path / "v"
    _write(val_only / "moto" / "__init__.py", "x = 1\n")
    with pytest.raises(DatasetError, match=r"none of the 1 packages under .* is in the train split"):
        build_source("pysource", str(val_only), TOK, 64)
    with pytest.raises(DatasetError, match=r"dataset_path '/dev/zero' for dataset 'pysource' is a character device"):
        build_source("pysource", "/dev/zero", TOK, 64)
    with pytest.raises(DatasetError, match=r"is not a folder"):
        build_source("pysource", str(tmp_path / "missing"), TOK, 64)
    bad = tmp_path / "b"
    (bad / "broken").mkdir(parents=True)
    (bad / "broken" / "__init__.py").write_bytes(b"x = 1\ny = '\xff'\n")
    assert pysource.split_of("broken") == "train"
    with pytest.raises(DatasetError, match=rf"python source file '{bad}/broken/__init__.py', line 2: bad record"):
        list(build_source("pysource", str(bad), TOK, 64))


def test_example_toml_trains_and_validates_on_the_two_splits(site):
    from nsa_flex.titan.data import build_validation_dataloader

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    job = ConfigManager().parse_args([
        "--job.config_file", os.path.join(root, "titan_configs", "nsa_125m_pysource_16k.toml"),
        "--training.dataset_path", site, "--validation.dataset_path", site, "--training.seq_len", "512",
        "--validation.seq_len", "512"])
    assert (job.training.dataset, job.validation.dataset, job.validation.enable) == ("pysource", "pysource", True)
    seen = {}
    for split, loader in (("train", build_dataloader(1, 0, TOK, job)),
                          ("validation", build_validation_dataloader(1, 0, TOK, job))):
        rows = [row.tolist() for _, (x, _y) in zip(range(10), loader) for row in x["input"]]
        seen[split] = {p for row in rows for p in HEADER.findall(TOK.decode(row))}
        assert seen[split] and all(pysource.split_of(p) == split for p in seen[split])
    assert loader.dataset.passkey is None  # no retrieval mix in validation
