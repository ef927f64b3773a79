"""The issue-14 report scripts: titan.csv from torchtitan logs, layer.csv from bench CSVs."""

import csv

from tests.experiments.scripts import load_script


def _line(step, mem, tps):  # torchtitan's step line, with its colour codes
    return (f"[rank0]:[titan] 2026-11-23 18:21:00,126 - root - INFO - \x1b[31mstep: {step:2d}  "
            f"\x1b[32mloss:  7.7  \x1b[38;2;54;234;195mmemory: {mem:5.2f}GiB(38.64%)  "
            f"\x1b[34mtps: {tps:,}  \x1b[36mtflops: 75.82  \x1b[35mmfu: 7.67%\x1b[39m\n")


def test_titan_csv_median_after_warmup_and_peak(tmp_path):
    m = load_script("titan_perf_csv")
    log = tmp_path / "nsa_125M_32768.log"
    lines = ["[titan] CUDA capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory\n"]
    lines += [_line(s, 20.0 + s / 10, 1000 if s <= 10 else 60000 + s) for s in range(1, 16)]
    log.write_text("".join(lines))
    (tmp_path / "full_125M_32768.log").write_text(_line(1, 5.0, 10))  # nothing after warm-up
    out = tmp_path / "titan.csv"
    rows = m.main([str(log), str(tmp_path / "full_125M_32768.log"), "--out", str(out)])
    assert len(rows) == 1
    got = list(csv.DictReader(out.open()))
    assert got == [dict(seq_len="32768", flavor="125M", attention="nsa", tokens_per_s="60013",
                        peak_GiB="21.5", device="NVIDIA H100 80GB HBM3")]


FIELDS = ["config", "T", "stage", "fwd_ms", "fwd_bwd_ms", "peak_GiB", "fwd_first_s",
          "fwd_bwd_first_s", "device", "error", "selection"]


def bench_runs(tmp_path, m):
    """run(name, rows): a bench_attention.py CSV of those rows (paper config, H100 by default),
    read back by perf_report.read."""
    def run(name, rows):
        p = tmp_path / name
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow({"config": "paper", "device": "H100", **r})
        return m.read(str(p))
    return run


def test_layer_csv_takes_each_T_from_the_run_that_timed_the_layer(tmp_path):
    m = load_script("perf_report")
    run = bench_runs(tmp_path, m)

    r1 = run("run1.csv", [dict(T=64, stage="nsa_layer", fwd_ms=2, fwd_bwd_ms=9),
                          dict(T=64, stage="full_layer", fwd_ms=3, fwd_bwd_ms=12),
                          dict(T=64, stage="attn_selected", fwd_ms=1, fwd_bwd_ms=4)])
    r2 = run("run2.csv", [dict(T=64, stage="sdpa_causal", fwd_ms=2.5, fwd_bwd_ms=10),
                          dict(T=64, stage="nsa_layer", fwd_ms=1.5, fwd_bwd_ms=6,
                               fwd_bwd_first_s=80),
                          dict(T=16, stage="full_layer", fwd_ms=1, fwd_bwd_ms=2),
                          dict(T=16, stage="nsa_layer", error="timeout")])
    r3 = run("run3.csv", [dict(T=64, stage="full_layer", error="timeout")])
    rows = m.layer_rows([r1, r2, r3])
    # each (T, item) from the last run that timed it; an untimed item keeps its error row
    assert [(r["T"], r["item"]) for r in rows] == [(16, "nsa_layer"), (16, "full_layer"),
                                                   (64, "nsa_layer"), (64, "full_layer"),
                                                   (64, "sdpa")]
    assert rows[2]["fwd_bwd_ms"] == "6.00" and rows[2]["compile_s"] == "80.0"
    assert rows[3]["fwd_bwd_ms"] == "12.00"  # run 3's failure does not hide run 1's time
    assert rows[0]["fwd_ms"] == ""  # the timed-out layer stays visible, without a time


def test_layer_csv_keeps_configs_and_selections_apart(tmp_path):
    """A trained-selection NSA row does not replace the random one (nor a 125M row a paper row);
    baselines have no selection and the last run that timed them wins."""
    m = load_script("perf_report")
    run = bench_runs(tmp_path, m)
    r1 = run("random.csv", [dict(config="titan_125M", T=64, stage="nsa_layer", fwd_ms=2,
                                 fwd_bwd_ms=9, selection="random"),
                            dict(config="titan_125M", T=64, stage="full_layer", fwd_ms=3,
                                 fwd_bwd_ms=12, selection="random"),
                            dict(config="paper", T=64, stage="nsa_layer", fwd_ms=5, fwd_bwd_ms=20)])
    r2 = run("trained.csv", [dict(config="titan_125M", T=64, stage="nsa_layer", fwd_ms=1,
                                  fwd_bwd_ms=8, selection="trained:x.npz:layer6"),
                             dict(config="titan_125M", T=64, stage="full_layer", fwd_ms=3,
                                  fwd_bwd_ms=11, selection="trained:x.npz:layer6")])
    rows = m.layer_rows([r1, r2])
    got = [(r["config"], r["item"], r["selection"], r["fwd_bwd_ms"]) for r in rows]
    assert got == [("paper", "nsa_layer", "random", "20.00"),
                   ("titan_125M", "nsa_layer", "random", "9.00"),
                   ("titan_125M", "nsa_layer", "trained", "8.00"),
                   ("titan_125M", "full_layer", "", "11.00")]
