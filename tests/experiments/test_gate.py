"""The retrieval gate's tools: experiments/gate_report.py (curves from metrics.jsonl or, for a run
cut before its metrics were copied, the console log) and experiments/retrieval_gate.sh's checks."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import gate_report as gr  # noqa: E402


def test_report_reads_logs_and_metrics_and_finds_the_thresholds(tmp_path, capsys):
    log = tmp_path / "full" / "train.log"
    log.parent.mkdir()
    lines = []
    for step, loss, exact in ((100, 4.2, 0), (200, 2.1, 40), (300, 0.3, 96)):
        lines += [f"[titan] 2026 - root - INFO - validate step: {step}  loss:  1.5  memory: 1GiB  tps: 9",
                  f"[titan] 2026 - root - INFO - validate step: {step}  retrieval: passkey loss {loss} exact {exact}%"]
    log.write_text("\n".join(lines) + "\n")
    jl = tmp_path / "nsa" / "metrics.jsonl"
    jl.parent.mkdir()
    recs = [{"step": 100, "retrieval/passkey_answer_loss": 4.0, "retrieval/passkey_exact": 0.0},
            {"step": 100, "validation_metrics/loss": 2.0},
            {"step": 200, "retrieval/passkey_answer_loss": 1.0, "retrieval/passkey_exact": 0.6,
             "retrieval/passkey_exact_near": 1.0, "retrieval/passkey_exact_far": 0.2,
             "retrieval/passkey_sel_recall": 0.75, "retrieval/passkey_sel_recall_best": 0.9},
            {"step": 200, **{f"nsa/layer{i}/gate_share/{b}": v for i in (0, 1)
                             for b, v in (("cmp", 0.25), ("sel", 0.5), ("win", 0.25))},
             "nsa/layer1/sel_dist_mean": 7.5, "nsa/layer0/sel_distill_kl": 0.125}]
    jl.write_text("\n".join(map(json.dumps, recs)) + "\n{\"step\": 3\n")  # a cut last line: skipped
    assert gr.main([str(tmp_path), "--tokens-per-step", "10"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "50% at step 300, 95% at step 300" in out
    assert "nsa" in out and "50% at step 200, 95% at step None" in out
    rows = list(csv.DictReader(open(tmp_path / "gate.csv")))
    assert [(r["variant"], r["step"], r["tokens"], r["exact"]) for r in rows] == [
        ("full", "100", "1000", "0.0000"), ("full", "200", "2000", "0.4000"), ("full", "300", "3000", "0.9600"),
        ("nsa", "100", "1000", "0.0000"), ("nsa", "200", "2000", "0.6000")]
    assert rows[0]["val_loss"] == "1.5000" and rows[3]["val_loss"] == "2.0000" and rows[4]["val_loss"] == ""
    assert (rows[4]["exact_near"], rows[4]["exact_far"]) == ("1.0000", "0.2000")  # beyond the window apart
    assert rows[0]["exact_far"] == "" and rows[3]["exact_far"] == ""  # a log, a record without them
    assert rows[4]["sel_recall"] == "0.7500" and rows[3]["sel_recall"] == ""  # with retrieval_recall_docs
    assert rows[4]["sel_recall_best"] == "0.9000"  # the best layer's
    assert (tmp_path / "gate.png").stat().st_size > 1000
    layers = list(csv.DictReader(open(tmp_path / "gate_layers.csv")))  # the telemetry, per layer
    assert [(r["variant"], r["step"], r["layer"], r["share_sel"]) for r in layers] == [
        ("nsa", "200", "0", "0.5000"), ("nsa", "200", "1", "0.5000")]
    assert (layers[0]["sel_distill_kl"], layers[0]["sel_dist_mean"]) == ("0.1250", "")
    assert (layers[1]["sel_distill_kl"], layers[1]["sel_dist_mean"]) == ("", "7.5000")


def test_gate_script_needs_a_short_phase(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text("[training]\nsteps = 1\n")
    r = subprocess.run(["bash", str(ROOT / "experiments/retrieval_gate.sh"), str(tmp_path / "o"), str(tmp_path)],
                       env={"TOML": str(toml), "PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "has no training.seq_len in [curriculum] short" in r.stderr
    r = subprocess.run(["bash", str(ROOT / "experiments/retrieval_gate.sh")], capture_output=True, text=True)
    assert r.returncode != 0 and "usage: retrieval_gate.sh OUT DATA" in r.stderr


def _gate(tmp_path, gpus, **env):
    return subprocess.run(["bash", str(ROOT / "experiments/retrieval_gate.sh"), str(tmp_path / "o"), str(tmp_path)],
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "RUNS": str(tmp_path / "runs"),
                               "GPUS": gpus, "PLAN": "nsa nsa_dp", **env},
                          capture_output=True, text=True, cwd=ROOT)


def test_gate_entry_over_several_gpus_keeps_the_global_batch(tmp_path):
    """An entry's GPUs "0,1": the short phase's local batch sizes halved in RUNS/NAME.toml (the
    same global batch), everything else as the TOML has it; a count that does not divide them is
    named and nothing trains. TRAIN_S=0: the script stops before launching."""
    r = _gate(tmp_path, "0,1", TRAIN_S="0")
    assert r.returncode == 0, r.stderr
    toml = (tmp_path / "runs" / "nsa_dp.toml").read_text()
    orig = (ROOT / "titan_configs/quality_curriculum.toml").read_text()
    assert '"training.local_batch_size=8"' in toml and '"validation.local_batch_size=8"' in toml
    assert '"training.local_batch_size=16"' in orig
    assert toml == orig.replace("local_batch_size=16", "local_batch_size=8")
    assert "no time left to train" in (tmp_path / "o" / "progress.txt").read_text()
    r = _gate(tmp_path, "0,1,2", TRAIN_S="600")
    progress = (tmp_path / "o" / "progress.txt").read_text()
    assert "training.local_batch_size=16 is not divisible by 3 GPUs" in progress
    assert not (tmp_path / "o" / "nsa_dp" / "train.log").exists()


def test_gate_steps_val_freq_and_ckpt_every_set_the_short_phase(tmp_path):
    """STEPS / VAL_FREQ / CKPT_EVERY: the short phase's training.steps (its cosine ends there) /
    validation.freq / checkpoint.interval in RUNS/NAME.toml, the rest as the TOML has it; a value
    that is no count is named and nothing trains."""
    orig = (ROOT / "titan_configs/quality_curriculum.toml").read_text()
    assert '"training.steps=7000"' in orig and '"validation.freq=100"' in orig
    assert '"checkpoint.interval=500"' in orig
    r = _gate(tmp_path, "0", TRAIN_S="0", STEPS="6000")
    assert r.returncode == 0, r.stderr
    toml = (tmp_path / "runs" / "nsa_dp.toml").read_text()
    assert toml == orig.replace('"training.steps=7000"', '"training.steps=6000"')
    r = _gate(tmp_path, "0", TRAIN_S="0", VAL_FREQ="250")
    assert r.returncode == 0, r.stderr
    toml = (tmp_path / "runs" / "nsa_dp.toml").read_text()
    assert toml == orig.replace('"validation.freq=100"', '"validation.freq=250"')
    r = _gate(tmp_path, "0", TRAIN_S="0", CKPT_EVERY="2000", STEPS="8000")
    assert r.returncode == 0, r.stderr
    toml = (tmp_path / "runs" / "nsa_dp.toml").read_text()
    assert toml == orig.replace('"checkpoint.interval=500"', '"checkpoint.interval=2000"').replace(
        '"training.steps=7000"', '"training.steps=8000"')
    # an entry's own --training.steps=N: its TOML's, over STEPS; the flag is not passed on
    r = _gate(tmp_path, "0", TRAIN_S="0", STEPS="6000", PLAN="full_causal full --training.steps=12000")
    assert r.returncode == 0, r.stderr
    toml = (tmp_path / "runs" / "full.toml").read_text()
    assert toml == orig.replace('"training.steps=7000"', '"training.steps=12000"')
    # its flags for other short-phase items: into its TOML (the phase's items override the command
    # line); other flags pass on
    r = _gate(tmp_path, "0", TRAIN_S="0", PLAN="nsa gap --training.passkey_questions=2 --nsa.phi=avg "
              "--training.passkey_min_gap=256")
    assert r.returncode == 0, r.stderr
    toml = (tmp_path / "runs" / "gap.toml").read_text()
    assert toml == orig.replace('"training.passkey_questions=3"', '"training.passkey_questions=2"').replace(
        '"training.passkey_min_gap=512"', '"training.passkey_min_gap=256"')
    for knob, bad in (("STEPS", "7k"), ("VAL_FREQ", "0"), ("CKPT_EVERY", "-5")):
        r = _gate(tmp_path, "0", TRAIN_S="600", **{knob: bad})
        assert f"{knob}='{bad}': allowed a whole number >= 1" in (tmp_path / "o" / "progress.txt").read_text()
        assert not (tmp_path / "o" / "nsa_dp" / "train.log").exists()


def test_report_tables_the_final_evaluation_by_depth(tmp_path, capsys):
    """OUT/<variant>/needle/needle.csv -> gate_depth.csv: right answers and the mean selection
    recall per depth (full attention has no recall); a variant without an evaluation is left out;
    a run lost before its final evaluation is tabled from its newest needle_step-N (EVAL_EACH_CKPT),
    named in "evaluated"."""
    for name, sub, rows in (("nsa", "needle", [(0, 0, 1.0), (0, 0, 1.0), (100, 1, 1.0), (100, 0, 0.5)]),
                            ("full", "needle", [(0, 1, ""), (100, 1, "")]),
                            ("lost", "needle_step-2000", [(50, 0, 0.25)]),
                            ("lost", "needle_step-10000", [(50, 1, 0.5)])):
        d = tmp_path / name / sub
        d.mkdir(parents=True)
        lines = ["kind,length,depth,trial,correct,answer,expected,sel_recall,needle_forced"]
        lines += [f"passkey,2048,{dep},{i},{c}, 1.,1,{rec},0" for i, (dep, c, rec) in enumerate(rows)]
        (d / "needle.csv").write_text("\n".join(lines) + "\n")
        (tmp_path / name / "train.log").write_text(
            "validate step: 100  retrieval: passkey loss 1.0 exact 50%\n")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "train.log").write_text("validate step: 100  retrieval: passkey loss 3.0 exact 0%\n")
    assert gr.main([str(tmp_path)]) == 0
    assert "nsa                      (final) depth  100%: 1/2 right, selection recall 0.750" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "gate_depth.csv")))
    assert [(r["variant"], r["evaluated"], r["depth"], r["prompts"], r["correct"], r["sel_recall"])
            for r in rows] == [
        ("full", "final", "0", "1", "1", ""), ("full", "final", "100", "1", "1", ""),
        ("lost", "step-10000", "50", "1", "1", "0.500"),  # the newest by step, not by name
        ("nsa", "final", "0", "2", "0", "1.000"), ("nsa", "final", "100", "2", "1", "0.750")]


def test_report_tables_the_evaluation_beyond_the_training_length(tmp_path, capsys):
    """OUT/<variant>/needle_long/needle.csv (LONG_LENGTHS) -> gate_lengths.csv: right answers and
    the mean selection recall per length; a variant without one is left out."""
    for name, rows in (("nsa", [(4096, 1, 1.0), (4096, 0, 0.5), (16384, 0, 0.0)]),
                       ("full", [(4096, 1, ""), (16384, 1, "")]), ("short_only", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.log").write_text("validate step: 100  retrieval: passkey loss 1.0 exact 50%\n")
        if rows:
            d = tmp_path / name / "needle_long"
            d.mkdir()
            lines = ["kind,length,depth,trial,correct,answer,expected,sel_recall,needle_forced"]
            lines += [f"passkey,{n},50,{i},{c}, 1.,1,{rec},0" for i, (n, c, rec) in enumerate(rows)]
            (d / "needle.csv").write_text("\n".join(lines) + "\n")
    assert gr.main([str(tmp_path)]) == 0
    assert "nsa                      (final) length   4096: 1/2 right, selection recall 0.750" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "gate_lengths.csv")))
    assert [(r["variant"], r["length"], r["prompts"], r["correct"], r["sel_recall"]) for r in rows] == [
        ("full", "4096", "1", "1", ""), ("full", "16384", "1", "1", ""),
        ("nsa", "4096", "2", "1", "0.750"), ("nsa", "16384", "1", "0", "0.000")]


def test_report_reads_reach_and_recall_from_logs_and_plots_a_reference(tmp_path, capsys):
    log = tmp_path / "run" / "nsa" / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "- INFO - validate step: 250  retrieval: passkey loss 0.846 exact 42% (near 73%, far 35%) sel recall 0.39"
        " | multikey loss 3.446 exact 0% (near 0%, far 0%) sel recall 0.42\n"
        "- INFO - validate step: 500  retrieval: passkey loss 0.5 exact 60%\n"
        "- INFO - validate step: 750  retrieval: passkey loss 0.4 exact 70% (near 90%, far 60%) sel recall 0.41"
        " (best layer 7 0.95) | multikey loss 3.0 exact 0% (near 0%, far 0%) sel recall 0.40 (best layer 2 0.5)\n")
    ref = tmp_path / "old" / "gate.csv"
    ref.parent.mkdir()
    ref.write_text("variant,step,tokens,answer_loss,exact,exact_near,exact_far,val_loss,sel_recall\n"
                   "full,250,8192000,3.0,0.1,0.2,0.05,4.3,\nnsa,250,8192000,3.0,0.0,,,4.4,0.5\n")
    assert gr.main([str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--reference", f"{ref}:full"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "o" / "gate.csv")))
    assert [r["variant"] for r in rows] == ["nsa"] * 3  # the reference is plotted, not tabled
    assert (rows[0]["exact_near"], rows[0]["exact_far"], rows[0]["sel_recall"]) == ("0.7300", "0.3500", "0.3900")
    assert (rows[1]["exact_far"], rows[1]["sel_recall"]) == ("", "")
    assert (rows[0]["sel_recall_best"], rows[2]["sel_recall"], rows[2]["sel_recall_best"]) == ("", "0.4100", "0.9500")
    assert gr.read_reference(f"{ref}:full") == ("full (old)", [
        {"step": 250, "answer_loss": 3.0, "exact": 0.1, "exact_near": 0.2, "exact_far": 0.05, "val_loss": 4.3}])
    with pytest.raises(SystemExit, match="no rows of variant 'sliding'"):
        gr.main([str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--reference", f"{ref}:sliding"])
    with pytest.raises(SystemExit, match="expected GATE_CSV:VARIANT"):
        gr.main([str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--reference", "nowhere.csv:full"])


FAKE_PYTHON = """#!/bin/bash
# the gate's python: the trainer and the evaluation faked, anything else the real interpreter
args=" $* "
if [[ $args == *" -m nsa_flex.titan.cli "* ]]; then
  dump=$(sed -E 's/.*--job.dump_folder ([^ ]+).*/\\1/' <<< "$args")
  ck=$dump/short/checkpoint
  mkdir -p $ck/step-100 && touch $ck/step-100/.metadata && echo '{"step": 100}' > $dump/short/metrics.jsonl
  sleep 2
  mkdir -p $ck/step-200 && touch $ck/step-200/.metadata && echo '{"step": 200}' >> $dump/short/metrics.jsonl
  mkdir -p $ck/step-300  # cut while saving: no .metadata
  sleep 2
  exit 4
elif [[ $args == *" -m nsa_flex.eval "* ]]; then
  out=$(sed -E 's/.*--out ([^ ]+).*/\\1/' <<< "$args"); ck=$(sed -E 's/.*--checkpoint ([^ ]+).*/\\1/' <<< "$args")
  lengths=$(sed -E 's/.*--lengths ([^ ]+).*/\\1/' <<< "$args")
  mkdir -p $out && for L in ${lengths//,/ }; do echo "length $L: 7/10 right, from $(basename $ck)"; done
else
  exec REAL "$@"
fi
"""


def _stand_in_python(tmp_path, script: str) -> str:
    """An executable stand-in for python from ``script`` (REAL: the real interpreter)."""
    fake = tmp_path / "python"
    fake.write_text(script.replace("REAL", sys.executable))
    fake.chmod(0o755)
    return str(fake)


def test_gate_evaluates_each_completed_checkpoint_while_training(tmp_path):
    """EVAL_EACH_CKPT=1: while the run trains, its metrics are copied into OUT and each checkpoint
    whose save completed is evaluated into OUT/NAME/needle_step-N; a checkpoint cut while saving
    (no .metadata) is never read; the final evaluation reads the newest complete one."""
    fake = _stand_in_python(tmp_path, FAKE_PYTHON)
    r = _gate(tmp_path, "0", TRAIN_S="600", EVAL_EACH_CKPT="1", POLL_S="0.5", PYTHON=fake)
    assert r.returncode == 0, r.stderr
    progress = (tmp_path / "o" / "progress.txt").read_text()
    run = tmp_path / "o" / "nsa_dp"
    assert "needle_step-100 of step-100 rc=0 length 2048: 7/10 right, from step-100" in progress, progress
    assert (run / "needle_step-100").is_dir() and not (run / "needle_step-300").exists()
    assert "training rc=4" in progress and "checkpoint step-200" in progress
    assert "nsa_dp: needle of step-200 rc=0 length 2048: 7/10 right, from step-200" in progress
    assert (run / "metrics.jsonl").read_text().count("step") == 2
    for off in ({}, {"EVAL_EACH_CKPT": "0"}):  # off: the final evaluation alone
        r = _gate(tmp_path, "0", TRAIN_S="600", POLL_S="0.5", PYTHON=fake, **off)
        progress = (tmp_path / "o" / "progress.txt").read_text().split("training (masks")[-1]
        assert "needle_step" not in progress and not (run / "needle_step-100").exists(), off
        assert "needle of step-200" in progress
    r = _gate(tmp_path, "0", TRAIN_S="600", EVAL_EACH_CKPT="yes", PYTHON=fake)
    assert r.returncode == 2 and "EVAL_EACH_CKPT=yes: allowed 0 or 1" in r.stderr


def test_gate_long_lengths_evaluate_the_final_checkpoint_beyond_its_length(tmp_path):
    """LONG_LENGTHS: after the final evaluation at the training length, the final checkpoint's
    passkey evaluation at those lengths into OUT/NAME/needle_long, each length's line in the
    progress; unset, none."""
    fake = _stand_in_python(tmp_path, FAKE_PYTHON)
    r = _gate(tmp_path, "0", TRAIN_S="600", LONG_LENGTHS="4096,8192", PYTHON=fake)
    assert r.returncode == 0, r.stderr
    progress = (tmp_path / "o" / "progress.txt").read_text()
    assert "nsa_dp: needle of step-200 rc=0 length 2048: 7/10 right, from step-200" in progress, progress
    assert ("nsa_dp: needle_long of step-200 rc=0 length 4096: 7/10 right, from step-200;"
            "length 8192: 7/10 right, from step-200") in progress, progress
    assert (tmp_path / "o" / "nsa_dp" / "needle_long").is_dir()
    r = _gate(tmp_path, "0", TRAIN_S="600", PYTHON=fake)
    assert "needle_long" not in (tmp_path / "o" / "progress.txt").read_text().split("training (masks")[-1]
    assert not (tmp_path / "o" / "nsa_dp" / "needle_long").exists()


HALT_FILE_PYTHON = """#!/usr/bin/env bash
# a stand-in for python: the trainer waits for its halt file (a SIGTERM is recorded, not obeyed),
# the evaluation does nothing, anything else is the real python
if [ "$1 $2" = "-m nsa_flex.titan.cli" ]; then
  while [ $# -gt 0 ]; do [ "$1" = "--job.dump_folder" ] && d=$2; shift; done
  trap 'echo TERM >> "$d/signals"' TERM
  for i in $(seq 1 300); do
    if [ -f "$d/short/HALT" ]; then rm "$d/short/HALT"; echo halted >> "$d/signals"; exit 4; fi
    sleep 0.1
  done
  exit 9
elif [ "$1 $2" = "-m nsa_flex.eval" ]; then exit 0
fi
exec REAL "$@"
"""


def test_gate_time_limit_halts_through_the_halt_file_not_a_signal(tmp_path):
    """At TRAIN_S the script writes the trainer's halt file (the trainer stops after its step and
    saves; no signal involved); timeout's SIGTERM only HALT_GRACE_S later, where the trainer has
    not stopped."""
    r = _gate(tmp_path, "0", TRAIN_S="3", MIN_TRAIN_S="1", HALT_GRACE_S="20",
              PYTHON=_stand_in_python(tmp_path, HALT_FILE_PYTHON))
    assert r.returncode == 0, r.stderr
    progress = (tmp_path / "o" / "progress.txt").read_text()
    assert f"nsa_dp: time limit: halt file {tmp_path / 'runs' / 'nsa_dp' / 'short' / 'HALT'} written" in progress
    assert "nsa_dp: training rc=4" in progress, progress
    assert (tmp_path / "runs" / "nsa_dp" / "signals").read_text() == "halted\n"  # no SIGTERM came


def test_halt_after_writes_the_halt_files_only_while_the_run_lives(tmp_path):
    """experiments/halt_after.sh: after SECONDS, each halt file (its folder made) where the run's
    process still lives; nothing where it ended first, nothing when stopped by SIGTERM."""
    script = str(ROOT / "experiments/halt_after.sh")
    run = subprocess.Popen(["sleep", "30"])
    try:
        files = [tmp_path / "a" / "short" / "HALT", tmp_path / "a" / "HALT"]
        r = subprocess.run(["bash", script, "0.2", str(run.pid), *map(str, files)], capture_output=True, text=True)
        assert r.returncode == 0 and all(f.is_file() for f in files)
        assert r.stdout.splitlines() == [f"time limit: halt file {f} written" for f in files]
        w = subprocess.Popen(["bash", script, "30", str(run.pid), str(tmp_path / "b" / "HALT")],
                             stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        w.terminate()
        assert w.wait(timeout=5) == 0 and w.stdout.read() == "" and not (tmp_path / "b").exists()
    finally:
        run.kill()
        run.wait()
    r = subprocess.run(["bash", script, "0.1", str(run.pid), str(tmp_path / "c" / "HALT")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "" and not (tmp_path / "c").exists()
    r = subprocess.run(["bash", script, "1", str(run.pid)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: halt_after.sh SECONDS PID HALT_FILE" in r.stderr


def test_formation_table_finds_each_copy_and_skips_repeated_runs(tmp_path, capsys):
    import gate_formation

    head = "variant,step,tokens,answer_loss,exact,exact_near,exact_far,val_loss\n"
    (tmp_path / "gate_run3").mkdir()
    (tmp_path / "gate_run3" / "gate.csv").write_text(head + "nsa,100,1,1.0,0.1,,,4.0\n")  # no near / far
    (tmp_path / "gate_run4").mkdir()
    (tmp_path / "gate_run4" / "gate.csv").write_text(
        head + "nsa,100,1,3.0,0.0,0.1,0.0,4.4\nnsa,200,2,2.0,0.3,0.6,0.1,2.4\nnsa,300,3,1.0,0.5,0.9,0.3,1.3\n"
        + "full,100,1,3.0,0.0,0.0,0.0,4.4\n")
    (tmp_path / "gate_run5").mkdir()
    (tmp_path / "gate_run5" / "gate.csv").write_text(  # run 4's nsa again, beside a new run
        head + "nsa_run4,100,1,3.0,0.0,0.1,0.0,4.4\nnsa_run4,200,2,2.0,0.3,0.6,0.1,2.4\n"
        + "nsa_run4,300,3,1.0,0.5,0.9,0.3,1.3\nnsa,100,1,3.0,0.0,0.7,0.25,2.0\n")
    out = tmp_path / "f.csv"
    assert gate_formation.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    rows = [(r["run"], r["variant"], r["filler_copy_step"], r["near_copy_step"], r["far_copy_step"], r["last_step"])
            for r in csv.DictReader(open(out))]
    assert rows == [("4", "nsa", "200", "200", "300", "300"), ("4", "full", "", "", "", "100"),
                    ("5", "nsa", "100", "100", "100", "100")]
    with pytest.raises(SystemExit, match="no gate_run"):
        gate_formation.main(["--results", str(tmp_path / "none")])
