"""``python -m nsa_flex.plot``: one PNG of loss, tokens/s, memory and NSA telemetry from runs'
metrics.jsonl files (synthetic records in torchtitan's / nsa_flex's key names)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_flex.apps import plot

ROOT = Path(__file__).resolve().parents[1]


def _write_run(folder: Path, n: int, telemetry: bool, loss0: float = 6.0) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for s in range(1, n + 1):
        lines.append({"step": s, "time": 1000.0 + s, "loss_metrics/global_avg_loss": loss0 - 0.1 * s,
                      "throughput(tps)": 1000 + s, "memory/max_reserved(GiB)": 0.5, "grad_norm": 1.0})
        if telemetry and (s == 1 or s % 2 == 0):  # a telemetry record of its own
            lines.append({"step": s, "time": 1000.0 + s, "nsa/gate_mean/cmp": 0.3, "nsa/gate_mean/sel": 0.5,
                          "nsa/gate_mean/win": 0.7, "nsa/sel_dist_mean": 3.0 + s})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_read_metrics_merges_steps_and_honours_resume(tmp_path):
    f = tmp_path / "m.jsonl"
    recs = [{"step": 1, "loss_metrics/global_avg_loss": 5.0}, {"step": 1, "nsa/gate_mean/cmp": 0.2},
            {"step": 2, "loss_metrics/global_avg_loss": 4.0}, {"step": 3, "loss_metrics/global_avg_loss": 3.0},
            {"step": 2, "event": "resume", "checkpoint_step": 2},
            {"step": 3, "loss_metrics/global_avg_loss": 3.5}]
    f.write_text("\n".join(map(json.dumps, recs)) + "\n")
    run = plot.read_metrics(str(f))
    assert run[1] == {"step": 1, "loss_metrics/global_avg_loss": 5.0, "nsa/gate_mean/cmp": 0.2}
    assert run[3]["loss_metrics/global_avg_loss"] == 3.5 and sorted(run) == [1, 2, 3]


def test_a_line_cut_short_is_skipped_with_a_warning(tmp_path, capsys):
    """A last line cut short by a full disk or a kill (and one an older version appended onto)
    does not stop the plot: the line is skipped and named on stderr."""
    f = _write_run(tmp_path / "run", 3, telemetry=False) / "metrics.jsonl"
    text = f.read_text().splitlines(keepends=True)
    f.write_text(text[0] + text[1][:25] + text[2] + text[2][:30])  # step 3 appended onto the cut step 2
    run = plot.read_metrics(str(f))
    assert sorted(run) == [1]
    err = capsys.readouterr().err
    assert f"nsa_flex.plot: warning: {f}: skipped 2 line(s) that are not JSON (a write cut short), line 2, 3" in err


def test_plot_draws_every_panel_for_two_runs(tmp_path):
    a = _write_run(tmp_path / "nsa", 10, telemetry=True)
    b = _write_run(tmp_path / "full_causal", 10, telemetry=False, loss0=6.5)
    out = tmp_path / "fig.png"
    fig = plot.plot([str(a), str(b / "metrics.jsonl")], str(out))
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "tokens/s", "memory", "NSA gate mean", "NSA selected-block distance"]
    loss_ax = fig.axes[0]
    assert sorted(line.get_label() for line in loss_ax.get_lines()) == ["full_causal", "nsa"]
    gate_lines = fig.axes[3].get_lines()
    assert sorted(l.get_label() for l in gate_lines) == ["nsa cmp", "nsa sel", "nsa win"]
    assert list(gate_lines[0].get_xdata()) == [1, 2, 4, 6, 8, 10]  # the telemetry steps only


def test_plot_without_telemetry_has_three_panels(tmp_path):
    run = _write_run(tmp_path / "r", 3, telemetry=False)
    fig = plot.plot([str(run)], str(tmp_path / "x.png"))
    assert [ax.get_title() for ax in fig.axes] == ["loss", "tokens/s", "memory"]
    # one run, one series a panel: nothing for a legend to tell; one row, no empty cell
    assert [ax.get_legend() for ax in fig.axes] == [None, None, None]
    assert [ax.get_subplotspec().rowspan.start for ax in fig.axes] == [0, 0, 0]


def test_panels_fill_their_rows():
    assert [plot.row_sizes(n) for n in range(1, 7)] == [[1], [2], [3], [2, 2], [3, 2], [3, 3]]


def test_one_run_with_telemetry_names_the_series_not_the_run(tmp_path):
    fig = plot.plot([str(_write_run(tmp_path / "nsa", 10, telemetry=True))], str(tmp_path / "x.png"))
    assert sorted(l.get_label() for l in fig.axes[3].get_lines()) == ["cmp", "sel", "win"]
    assert fig.axes[0].get_legend() is None  # the training loss alone


def test_plot_command_and_its_errors(tmp_path):
    run = _write_run(tmp_path / "r", 4, telemetry=True)
    r = subprocess.run([sys.executable, "-m", "nsa_flex.plot", str(run), "-o", str(tmp_path / "o.png")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o.png").is_file() and "NSA gate mean" in r.stdout
    r = subprocess.run([sys.executable, "-m", "nsa_flex.plot", str(tmp_path / "nothing")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("python -m nsa_flex.plot: error:") and "no metrics.jsonl" in r.stderr
    assert "Traceback" not in r.stderr


def test_retrieval_panels_draw_the_near_and_far_exact_answers(tmp_path):
    run = _write_run(tmp_path / "nsa", 4, telemetry=False)
    recs = [{"step": s, "retrieval/passkey_answer_loss": 3.0 - s, "retrieval/passkey_exact": 0.1 * s,
             "retrieval/passkey_exact_near": 0.2 * s, "retrieval/passkey_exact_far": 0.0} for s in (2, 4)]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    fig = plot.plot([str(run)], str(tmp_path / "x.png"))
    titles = [ax.get_title() for ax in fig.axes]
    exact = fig.axes[titles.index("retrieval: exact answers (validation)")]
    assert sorted(l.get_label() for l in exact.get_lines()) == ["passkey", "passkey far", "passkey near"]
    loss = fig.axes[titles.index("retrieval: answer loss (validation)")]
    assert len(loss.get_lines()) == 1
