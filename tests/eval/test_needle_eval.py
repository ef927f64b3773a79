"""nsa_flex.eval, the needle evaluation (CLI `python -m nsa_flex.eval`, also run as
experiments/needle_eval.py): prompts (the training passkey document exactly; multi-key; FineWeb
filler), scoring, both decode paths, checkpoint loading, the CSV / summary / heatmap outputs, the
ablation table, and the errors that name the bad flag."""

import csv
import re
import json
import os
import random
from pathlib import Path

import pytest
import torch

from nsa_flex.data.passkey import PasskeyCorpus
from nsa_flex.titan.tokenizer import ByteTokenizer, build_tokenizer_from_name

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
FINEWEB = SHARED / "fineweb_sample_2800.parquet"
TIKTOKEN = SHARED / "tiktoken_cache"

import nsa_flex.apps.eval.needle as ne  # noqa: E402

BYTE = ByteTokenizer()


pytestmark = pytest.mark.usefixtures("single_thread")  # hundreds of tiny ops per token


def _tokenizers():
    toks = [BYTE]
    if TIKTOKEN.is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN))
        toks.append(build_tokenizer_from_name("gpt2"))
    return toks


# ---------------------------------------------------------------------- prompts
@pytest.mark.parametrize("tok", _tokenizers(), ids=lambda t: type(t).__name__)
def test_passkey_prompt_is_the_training_document(tok):
    """Synthetic filler: prompt + answer + EOS == the training corpus's document for the same key,
    depth and filler passage; and the corpus's own documents are build(key, depth, filler) of their
    seeded draws (the filler a repeated passage of the document's own seed)."""
    from nsa_flex.data.passkey import synthetic_filler

    syn = ne.Filler("synthetic", tok)
    for L in (300, 1000, 4096):
        corpus = PasskeyCorpus(tok, L + 1, seed=5)
        for i in range(3):  # document(i) = build(key, depth) of the seeded draw
            rng = random.Random(f"passkey:train:5:{i}")
            key, depth = rng.randint(10000, 99999), rng.random()
            toks, ans, k = corpus.document(i)
            fill = synthetic_filler(tok, L + 1, f"train:5:{i}")
            assert k == key and (toks, ans) == corpus.build(key, depth, fill)
        for d in (0, 30, 100):
            p = ne.make_prompt(tok, "passkey", L, d, 0, syn)
            toks, ans = corpus.build(int(p["expected"]), d / 100, syn.tokens(L + 1, 0))
            assert p["tokens"] == toks[:ans] and len(toks) == L + 1
            assert p["answer_tokens"] == len(toks) - 1 - ans
            assert tok.decode(toks[ans:-1]) == " " + p["expected"] + "."
            text = tok.decode(p["tokens"])
            assert text.endswith("What is the pass key? The pass key is:")
            pos = text.index(f"The pass key is: {p['expected']}.")
            if L >= 1000:  # the needle sits at d% of the filler
                assert abs(pos / len(text) - d / 100) < 0.15, (L, d, pos / len(text))


@pytest.mark.parametrize("tok", _tokenizers(), ids=lambda t: type(t).__name__)
def test_prompt_needle_positions_are_the_asked_key(tok):
    """make_prompt's "needle": the positions of the asked key's tokens (both statements in its
    needle), the tokens whose blocks the selection must pick at the question."""
    filler = ne.Filler("synthetic", tok)
    for kind in ("passkey", "multikey"):
        it = ne.make_prompt(tok, kind, 700, 40, 0, filler)
        pos = it["needle"]
        assert pos and all(b > a for a, b in zip(pos, pos[1:]))
        text = tok.decode([it["tokens"][p] for p in pos])
        assert text.replace(" ", "") == it["expected"] * 2, (kind, text)


@pytest.mark.parametrize("tok", _tokenizers(), ids=lambda t: type(t).__name__)
def test_multikey_prompt(tok):
    syn = ne.Filler("synthetic", tok)
    for d in (0, 50, 100):
        p = ne.make_prompt(tok, "multikey", 1500, d, 1, syn, n_keys=4, seed=3)
        assert len(p["tokens"]) + p["answer_tokens"] + 1 == 1501
        text = tok.decode(p["tokens"])
        needles = [(text.index(m), m) for m in re.findall(r"The pass key of \w+ is: \d+\. Remember", text)]
        assert len(needles) == 4
        names = {re.search(r"of (\w+) is", m).group(1) for _, m in needles}
        keys = {re.search(r"is: (\d+)\.", m).group(1) for _, m in needles}
        assert len(names) == 4 and len(keys) == 4 and p["expected"] in keys
        asked = re.search(r"What is the pass key of (\w+)\? The pass key of \1 is:$", text).group(1)
        pos = text.index(f"The pass key of {asked} is: {p['expected']}.")
        assert abs(pos / len(text) - d / 100) < 0.2, (d, pos / len(text))
    assert ne.make_prompt(tok, "multikey", 1500, 100, 1, syn, 4, 3) == p  # deterministic
    assert ne.make_prompt(tok, "multikey", 1500, 100, 2, syn, 4, 3)["expected"] != p["expected"]


@pytest.mark.skipif(not FINEWEB.is_file(), reason=f"{FINEWEB} not found")
def test_fineweb_filler_haystack_per_trial():
    fw = ne.Filler(ne.Filler.resolve("auto", str(FINEWEB)), BYTE, str(FINEWEB))
    assert fw.kind == "fineweb"
    a = ne.make_prompt(BYTE, "passkey", 3000, 20, 0, fw)
    b = ne.make_prompt(BYTE, "passkey", 3000, 80, 0, fw)
    c = ne.make_prompt(BYTE, "passkey", 3000, 20, 1, fw)
    strip = lambda p: BYTE.decode(p["tokens"]).replace(f" The pass key is: {p['expected']}. Remember it. "
                                                       f"The pass key is: {p['expected']}. ", "")
    assert strip(a) == strip(b) != strip(c)  # same haystack for every depth of a trial
    assert "grass is green" not in strip(a) and len(a["tokens"]) == len(b["tokens"])
    assert ne.Filler.resolve("auto", "/nonexistent.parquet") == "synthetic"
    # a model trained on the passkey corpus alone gets its training filler under auto
    assert ne.Filler.resolve("auto", str(FINEWEB), text_trained=False) == "synthetic"
    assert ne.Filler.resolve("fineweb", str(FINEWEB), text_trained=False) == "fineweb"


def test_pysource_filler_and_docs_are_the_validation_packages():
    """--filler pysource / --docs pysource: source of the validation split only (never trained on);
    auto picks it for a model trained on pysource."""
    from nsa_flex.data.pysource import SPLIT_SALT, split_of
    from nsa_flex.apps.eval.docs import read_texts

    assert ne.Filler.resolve("auto", "/nonexistent.parquet", code_trained=True) == "pysource"
    with pytest.raises(ne.EvalError, match="--filler: 'code' not in"):
        ne.Filler.resolve("code", "")
    texts = read_texts("pysource")
    assert texts and all(t.startswith("# file: ") for t in texts[:20])
    pkgs = {t.split("# file: ", 1)[1].split("/", 1)[0] for t in texts}
    assert all(split_of(p) == "validation" for p in pkgs), (SPLIT_SALT, pkgs)
    fill = ne.Filler("pysource", BYTE)
    p = ne.make_prompt(BYTE, "passkey", 3000, 50, 0, fill)
    text = BYTE.decode(p["tokens"])  # the filler's own cue tokens (":") are taken out
    assert "# file " in text and len(p["tokens"]) < 3000
    assert text.count(":") == 3  # the needle's two and the question's


def test_score():
    assert ne.score("12345.", "12345") == (True, "12345")
    assert ne.score(" 12345. The", "12345")[0]
    assert not ne.score("1234.", "12345")[0] and not ne.score("123456", "12345")[0]
    assert ne.score("x12345", "12345") == (False, "")
    assert ne.digit_score(" 12345.", "12345") == 1.0 and ne.digit_score(" 19945.", "12345") == 0.6
    assert ne.digit_score("1234", "12345") == 0.8 and ne.digit_score("wide", "12345") == 0.0


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("argv,match", [
    (["--lengths", "256,abc"], r"--lengths: 'abc' is not an integer"),
    (["--depths", "0,120"], r"--depths: 120 is outside 0..100"),
    (["--kinds", "passkey,bogus"], r"--kinds: \['bogus'\]"),
    (["--lengths", "40"], r"--lengths: 40 is too short for a passkey prompt"),
    (["--kinds", "multikey", "--lengths", "200", "--n-keys", "4"], r"--lengths: 200 is too short for a 4-key"),
    (["--n-keys", "1", "--kinds", "multikey"], r"--n-keys: 1 is outside"),
    (["--trials", "0"], r"--trials: 0"),
    (["--filler", "fineweb", "--fineweb", "/nope.parquet"], r"--fineweb '/nope.parquet' does not exist"),
    (["--filler", "grass"], r"--filler: 'grass'"),
    (["--checkpoint", "/no/such/ckpt"], r"--checkpoint '/no/such/ckpt': no such file"),
    (["--config", "/no/such.toml"], r"--config '/no/such.toml': no such file"),
])
def test_errors_name_the_flag(argv, match, tmp_path):
    with pytest.raises(ne.EvalError, match=match):
        ne.main(["--quick", "--out", str(tmp_path), "--depths", "0", *argv])


def test_checkpoint_required_without_quick(tmp_path):
    with pytest.raises(ne.EvalError, match="--checkpoint is required"):
        ne.main(["--config", str(ROOT / "titan_configs" / "debug_nsa.toml"), "--out", str(tmp_path),
                 "--device", "cpu"])
    with pytest.raises(ne.EvalError, match="--out is required"):
        ne.main(["--quick"])


# ---------------------------------------------------------------------- model paths
def _debug_model(masks="nsa"):
    from nsa_flex.apps.generate import build_model, load_job_config

    job = load_job_config(str(ROOT / "titan_configs" / "debug_nsa.toml"), [f"--nsa.masks={masks}"])
    model, tok = build_model(job)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
        for blk in model.layers.values():
            blk.attention.gate.weight.normal_(0, 0.3)
    return model.eval(), tok


def test_decode_paths_agree_and_fallback():
    model, tok = _debug_model("nsa")
    assert ne.decode_mode(model, "auto") == "cache"
    prompts = [tok.encode("hello there, the pass key is", add_bos=True), tok.encode("abc" * 30, add_bos=True)]
    cached = ne.generate_batch(model, prompts, 6, "cache", None, "cpu")
    full = ne.generate_batch(model, prompts, 6, "full", None, "cpu")
    assert cached == full and all(len(g) == 6 for g in cached)
    model, _ = _debug_model("random_selection")
    assert ne.decode_mode(model, "auto") == "full"  # no decode rule for random draws
    with pytest.raises(ne.EvalError, match="--decode cache"):
        ne.decode_mode(model, "cache")


def test_quick_run_outputs(tmp_path, monkeypatch):
    """End to end on random weights, with the model's answers replaced by the right key at depth
    >= 50 (so the scoring, CSV, summary and heatmap see both outcomes)."""
    real = ne.generate_batch
    calls = []

    def fake(model, prompts, max_new, mode, eos_id, device):
        gens = real(model, prompts, 2, mode, eos_id, device)  # the real path runs, then is overridden
        calls.append(mode)
        out = []
        for p, g in zip(prompts, gens):
            text = BYTE.decode([t for t in p if t < 256])
            key = re.findall(r"The pass key (?:of \w+ )?is: (\d+)\.", text)
            asked = re.search(r"pass key of (\w+)\? ", text)
            if asked:
                key = re.findall(rf"The pass key of {asked.group(1)} is: (\d+)\.", text)
            # depth 100: the asked needle is right before the question
            depth_ok = re.search(rf"is: {key[0]}\. \nWhat is", text) is not None
            out.append(BYTE.encode(f"{key[0]}." if depth_ok else "00000.") + [BYTE.eos_id])
        return out

    monkeypatch.setattr(ne, "generate_batch", fake)
    res = ne.main(["--quick", "--out", str(tmp_path), "--depths", "0,100", "--lengths", "300,600",
                   "--trials", "2", "--batch-size", "3"])
    rows = list(csv.DictReader(open(tmp_path / "needle.csv")))
    assert list(rows[0]) == list(ne.FIELDS) and len(rows) == 2 * 2 * 2 * 2
    for r in rows:
        assert r["correct"] == ("1" if r["depth"] == "100" else "0"), r
        assert r["answer"] == (r["expected"] + "." if r["depth"] == "100" else "00000.")
    # selection recall at the question (QuestionPicks): a forced needle block is always picked;
    # at depth 0 of 600 the needle lies in free blocks
    for r in rows:
        assert 0 <= float(r["sel_recall"]) <= 1 and r["needle_forced"] in ("0", "1"), r
        assert r["needle_forced"] == "0" or float(r["sel_recall"]) == 1.0, r
        layers = [float(h) for h in r["sel_recall_layers"].split()]  # per layer; their mean is the recall
        assert len(layers) >= 2 and abs(sum(layers) / len(layers) - float(r["sel_recall"])) < 0.01, r
    assert {r["needle_forced"] for r in rows if r["depth"] == "0" and r["length"] == "600"} == {"0"}
    summ = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [(s["kind"], s["length"], s["accuracy"]) for s in summ] == [
        ("multikey", "300", "0.5"), ("multikey", "600", "0.5"), ("passkey", "300", "0.5"), ("passkey", "600", "0.5")]
    meta = json.load(open(tmp_path / "meta.json"))
    assert meta["decode"] == "cache" and meta["backend"] == {"300": "reference", "600": "reference"}
    assert calls == ["cache"] * 8  # 4 prompts per (kind, length), batches of 3
    if res["heatmap"]:
        assert (tmp_path / "needle_heatmap.png").stat().st_size > 1000


def test_checkpoint_is_loaded(tmp_path):
    """A DCP checkpoint (torchtitan's flattened layout) of the random-init weights gives the same
    answers as --random-init with the same seed; other weights give other answers."""
    import torch.distributed.checkpoint as dcp

    from nsa_flex.apps.generate import build_model, load_job_config

    cfg = str(ROOT / "titan_configs" / "debug_nsa.toml")
    model, _ = build_model(load_job_config(cfg))
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    dcp.save(dict(model.state_dict()), checkpoint_id=str(tmp_path / "ckpt" / "step-3"))
    args = ["--quick", "--depths", "0,50,100", "--lengths", "300", "--kinds", "passkey"]
    a = ne.main(args + ["--out", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "ckpt")])
    b = ne.main(args + ["--out", str(tmp_path / "b")])
    assert a["meta"]["model"].endswith("step-3") and b["meta"]["model"].endswith("random weights")
    assert [r["answer"] for r in a["rows"]] == [r["answer"] for r in b["rows"]]
    c = ne.main(args + ["--out", str(tmp_path / "c"), "--seed", "1"])
    assert [r["answer"] for r in c["rows"]] != [r["answer"] for r in b["rows"]]


def test_checkpoint_of_a_model_with_more_parameters_is_refused(tmp_path):
    """A checkpoint trained with other [nsa] settings (phi = "mlp": more parameters under the same
    modules) into a model built without them: DCP alone loads the common keys and ignores the rest;
    refused, naming an extra key and the remedy. Optimizer state beside the model's keys is fine."""
    import torch.distributed.checkpoint as dcp

    from nsa_flex.apps.generate import CheckpointKeysError, build_model, load_checkpoint, load_job_config

    cfg = str(ROOT / "titan_configs" / "debug_nsa.toml")
    mlp, _ = build_model(load_job_config(cfg, ["--nsa.phi=mlp"]))
    avg, _ = build_model(load_job_config(cfg))
    extra = sorted(set(mlp.state_dict()) - set(avg.state_dict()))
    assert extra and all(".phi_" in k for k in extra)
    dcp.save(dict(mlp.state_dict()), checkpoint_id=str(tmp_path / "mlp"))
    with pytest.raises(CheckpointKeysError, match=r"holds model keys this model lacks .*phi_.*--override"):
        load_checkpoint(avg, str(tmp_path / "mlp"))
    load_checkpoint(mlp, str(tmp_path / "mlp"))  # the matching model loads
    sd = {k: v for k, v in avg.state_dict().items()}
    dcp.save({**sd, "optimizer.state.0.exp_avg": torch.zeros(3)}, checkpoint_id=str(tmp_path / "full"))
    load_checkpoint(avg, str(tmp_path / "full"))
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "nested"))  # nested under "model"
    load_checkpoint(avg, str(tmp_path / "nested"))


def test_collect_ablation_table(tmp_path):
    for run, acc in (("nsa", [1, 1, 0]), ("full_causal", [1, 0, 0])):
        d = tmp_path / run
        (d / "needle").mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            for s, loss in ((1, 10.0), (5, 4.0), (10, 3.5)):
                f.write(json.dumps({"step": s, "loss_metrics/global_avg_loss": loss, "throughput(tps)": 100 * s}) + "\n")
            f.write(json.dumps({"step": 10, "nsa/gate_mean/sel": 0.5}) + "\n")
        (d / "train_seconds").write_text("42\n")
        with open(d / "needle" / "needle.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=ne.FIELDS)
            w.writeheader()
            for L, c in zip((256, 512, 1024), acc):
                w.writerow({"kind": "passkey", "length": L, "depth": 0, "trial": 0, "correct": c,
                            "answer": "1.", "expected": "1"})
    (tmp_path / "sliding_only").mkdir()  # a failed run: no metrics, no eval
    table = ne.main(["--collect", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "ablation.csv")))
    assert len(rows) == len(table) == 3 + 3 + 1
    nsa = [r for r in rows if r["run"] == "nsa"]
    assert [(r["length"], r["accuracy"]) for r in nsa] == [("256", "1.0"), ("512", "1.0"), ("1024", "0.0")]
    assert nsa[0]["final_loss"] == "3.5" and nsa[0]["steps"] == "10" and nsa[0]["train_s"] == "42"
    assert nsa[0]["tps"] == "1000"  # mean over logged steps after the first two (compile)
    assert nsa[0]["loss_last5"] == str(round((10 + 4 + 3.5) / 3, 5)) and nsa[0]["gate_sel"] == "0.5"
    assert nsa[0]["gate_cmp"] == ""
    assert [r for r in rows if r["run"] == "sliding_only"][0]["n"] == "0"


# ---------------------------------------------------------------------- ablation configs and script
def test_ablation_config_takes_every_masks_preset():
    """titan_configs/ablation.toml with --nsa.masks NAME (as ablation_runs.sh runs it): every
    preset, nothing else changed; the recipe of the ablation runs."""
    import dataclasses

    from torchtitan.config import ConfigManager

    from masks import PRESETS
    from nsa_flex.titan.args import nsa_flex_args

    path = ROOT / "titan_configs" / "ablation.toml"
    cfgs = {}
    for p in PRESETS:
        c = ConfigManager().parse_args(["--job.config_file", str(path), "--nsa.masks", p])
        d = dataclasses.asdict(c)
        assert d["nsa"].pop("masks") == p
        cfgs[p] = d
        args = nsa_flex_args[c.model.flavor]
        args.update_from_config(c)  # the [nsa] section is valid for the 30M_kv4 flavor
        assert args.masks == p and (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (256, 4, 16, 4)
    ref = cfgs["nsa"]
    assert all(d == ref for d in cfgs.values())
    t = ref["training"]
    assert (t["dataset"], t["passkey_mix"], t["passkey_questions"], t["seq_len"]) == ("fineweb_edu", 0.9, 4, 1024)
    assert ref["model"]["tokenizer"] == "byte" and t["local_batch_size"] == 16
    assert ref["compile"]["enable"] and ref["checkpoint"]["enable"] and ref["nsa"]["telemetry_every"] > 0
    assert ref["training"]["mixed_precision_param"] == "bfloat16"


@pytest.mark.slow
def test_ablation_script_checks_its_arguments(tmp_path):
    import subprocess

    script = ROOT / "experiments" / "ablation_runs.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run(["bash", str(script), str(tmp_path / "o"), str(tmp_path), "10"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "has no fineweb_sample_2800.parquet" in r.stderr
    r = subprocess.run(["bash", str(script), str(tmp_path / "o"), str(tmp_path), "ten"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "STEPS must be a positive integer, got 'ten'" in r.stderr
    (tmp_path / "fineweb_sample_2800.parquet").write_bytes(b"")
    (tmp_path / "tiktoken_cache").mkdir()
    r = subprocess.run(["bash", str(script), str(tmp_path / "o"), str(tmp_path), "10"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PRESETS": "nsa bogus"})
    assert r.returncode == 2 and "'bogus' is not a masks preset" in r.stderr
    for presets, msg in [("v=bogus:--nsa.n_sel=16", "'bogus' is not a masks preset"),
                         ("v=nsa:--nsa.n_sel", "flag '--nsa.n_sel' must look like --section.field=value"),
                         ("a/b=nsa:--nsa.n_sel=16", "run name 'a/b' must be")]:
        r = subprocess.run(["bash", str(script), str(tmp_path / "o"), str(tmp_path), "10"], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "PRESETS": f"nsa {presets}"})
        assert r.returncode == 2 and msg in r.stderr, (presets, r.stderr)


def test_out_of_memory_halves_the_batch(tmp_path, monkeypatch):
    sizes = []

    def fake(model, prompts, max_new, mode, eos_id, device):
        sizes.append(len(prompts))
        if len(prompts) > 1:
            raise torch.OutOfMemoryError("fake")
        return [BYTE.encode("12345.")]

    monkeypatch.setattr(ne, "generate_batch", fake)
    res = ne.main(["--quick", "--out", str(tmp_path / "a"), "--depths", "0,50,100", "--lengths", "300",
                   "--kinds", "passkey", "--batch-size", "3"])
    assert sizes == [3, 1, 2, 1, 1] and len(res["rows"]) == 3
    monkeypatch.setattr(ne, "generate_batch", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    with pytest.raises(ne.EvalError, match="--lengths 300: out of memory for one prompt"):
        ne.main(["--quick", "--out", str(tmp_path / "b"), "--depths", "0", "--lengths", "300",
                 "--kinds", "passkey"])


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["-m", "nsa_flex.eval"], ["experiments/needle_eval.py"]])
def test_cli_user_error_exit_code(cmd):
    """Both entry points run the same CLI: a user error is one line on stderr, exit code 2."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, *cmd, "--quick"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "python -m nsa_flex.eval: error: --out is required" in r.stderr, r.stderr


def test_time_limit_then_resume(tmp_path, monkeypatch):
    """--time-limit stops between batches (complete: false, the scored rows summarised); --resume
    keeps them, evaluates only the missing prompts, and ends with every row once; a needle.csv of
    other settings is refused."""
    calls = []
    clock = iter(range(0, 10 ** 6, 10))  # every perf_counter call advances 10 s

    def fake(model, prompts, max_new, mode, eos_id, device):
        calls.append(len(prompts))
        return [BYTE.encode("12345.")] * len(prompts)

    monkeypatch.setattr(ne, "generate_batch", fake)
    monkeypatch.setattr(ne.time, "perf_counter", lambda: next(clock))
    args = ["--quick", "--out", str(tmp_path), "--depths", "0,50,100", "--lengths", "300,400",
            "--kinds", "passkey", "--batch-size", "1"]
    a = ne.main(args + ["--time-limit", "45"])
    assert not a["meta"]["complete"] and 0 < len(a["rows"]) < 6 and len(calls) == len(a["rows"])
    first = list(csv.DictReader(open(tmp_path / "needle.csv")))
    assert len(first) == len(a["rows"])
    with open(tmp_path / "needle.csv", "a") as f:
        f.write("passkey,400,100,0,")  # a line cut by a kill
    calls.clear()
    monkeypatch.setattr(ne.time, "perf_counter", lambda: 0.0)
    b = ne.main(args + ["--resume"])
    rows = list(csv.DictReader(open(tmp_path / "needle.csv")))
    assert b["meta"]["complete"] and b["meta"]["resumed_rows"] == len(first)
    assert len(calls) == 6 - len(first) and len(rows) == 6
    assert sorted((r["length"], r["depth"]) for r in rows) == sorted(
        (L, d) for L in ("300", "400") for d in ("0", "50", "100"))
    assert rows[: len(first)] == first
    summ = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [s["n"] for s in summ] == ["3", "3"]
    with pytest.raises(ne.EvalError, match=r"--resume: .* expects .*\(other --seed"):
        ne.main(args + ["--resume", "--seed", "5"])


def test_summary_wilson_interval():
    from nsa_flex.apps.eval.report import summarize, wilson

    lo, hi = wilson(18, 20)
    assert abs(lo - 0.6990) < 1e-3 and abs(hi - 0.9721) < 1e-3
    assert wilson(0, 20)[0] == 0.0 and wilson(20, 20)[1] == 1.0
    rows = [{"kind": "passkey", "length": 4096, "correct": int(i < 18), "answer": "1", "expected": "1"}
            for i in range(20)]
    s = summarize(rows)[0]
    assert (s["n"], s["correct"], s["accuracy"], s["ci_lo"], s["ci_hi"]) == (20, 18, 0.9, 0.699, 0.9721)


def test_question_picks_are_each_rows_last_position_in_the_first_forward():
    """QuestionPicks records, per selecting layer, the picks at each right-padded prompt's last
    position in the batch's first forward (what one prompt alone gets there), and its recall is
    the share of (layer, KV group) holding a needle block; a needle in block 0 is forced."""
    model, tok, _ = ne.load(ne.parse_args(["--quick", "--out", "/tmp/unused"]))
    prompts = [ne.make_prompt(BYTE, "passkey", L, 30, 0, ne.Filler("synthetic", BYTE)) for L in (200, 300)]
    toks = [p["tokens"] for p in prompts]
    batch = torch.zeros(2, max(map(len, toks)), dtype=torch.long)
    for b, t in enumerate(toks):
        batch[b, :len(t)] = torch.tensor(t)
    with torch.no_grad(), ne.QuestionPicks(model, [len(t) for t in toks]) as qp:
        model(batch)
        model(batch[:, :10])  # a later forward (a decode step) is not recorded
    assert len(qp.picks) == len(model.layers)
    for b, t in enumerate(toks):
        with torch.no_grad(), ne.QuestionPicks(model, [len(t)]) as alone:
            model(torch.tensor([t]))
        for i in qp.picks:
            assert torch.equal(qp.picks[i][b], alone.picks[i][0])
        l_sel = model.layers["0"].attention.cfg.l_sel
        rec, forced, layers = qp.recall(b, [3])
        assert (rec, forced) == (1.0, 1) and layers == [1.0] * len(qp.picks)  # block 0: forced
        blk = (len(t) // 2) // l_sel
        want = sum(bool((p[b] == blk).any(-1)[g]) for p in qp.picks.values() for g in range(p.shape[1]))
        want /= sum(p.shape[1] for p in qp.picks.values())
        rec, forced, layers = qp.recall(b, [blk * l_sel])
        assert forced == 0 and rec == pytest.approx(want)
        assert layers == pytest.approx([float((p[b] == blk).any(-1).float().mean()) for _, p in sorted(qp.picks.items())])
    assert all(att.select_topn is ne_orig for att, ne_orig in zip(qp.layers, qp.saved))  # restored
