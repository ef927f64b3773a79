"""The quality study's pieces that need no model: loss-vs-tokens curves from metrics.jsonl, the
multi-run position-loss figure, and the shared TOML of the three variants."""

import json
from pathlib import Path

import pytest

from nsa_flex.apps.eval.report import loss_curves, plot_loss_vs_tokens, plot_position_loss, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_loss_curves_tokens_seen(tmp_path):
    p = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss_metrics/global_avg_loss": 9.0, "n_tokens_seen": 4096},
             {"step": 10, "loss_metrics/global_avg_loss": 5.0, "n_tokens_seen": 40960},
             {"step": 10, "validation_metrics/loss": 5.5},  # same step: merged, tokens known
             {"step": 20, "validation_metrics/loss": 5.2},  # validation only: step x tokens per step
             {"step": 30, "loss_metrics/global_avg_loss": 4.0, "n_tokens_seen": 122880}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    c = loss_curves(read_metrics(str(p)))
    assert c["train"] == [(4096, 9.0), (40960, 5.0), (122880, 4.0)]
    assert c["validation"] == [(40960, 5.5), (81920, 5.2)]
    assert plot_loss_vs_tokens({"a": str(p), "b": str(p)}, str(tmp_path / "l.png"))
    assert (tmp_path / "l.png").stat().st_size > 1000


def test_position_loss_figure_several_runs(tmp_path):
    rows = lambda off: [{"pos_mid": m, "loss": 5 - 0.1 * i + off, "loss_sem": 0.05} for i, m in enumerate((1, 4, 16))]
    assert plot_position_loss({"nsa": rows(0), "full": rows(0.2)}, str(tmp_path / "p.png"), marks={"window": 8})
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert plot_position_loss({"nsa": rows(0), "full": rows(0.2)}, str(tmp_path / "d.png"), baseline="full")
    assert (tmp_path / "d.png").stat().st_size > (tmp_path / "p.png").stat().st_size  # the second panel


def test_quality_toml():
    from nsa_flex.apps.generate import load_job_config

    path = str(ROOT / "titan_configs" / "quality_125m_16k.toml")
    for masks in ("nsa", "full_causal", "sliding_only"):
        c = load_job_config(path, [f"--nsa.masks={masks}"])
        assert c.nsa.masks == masks and c.model.flavor == "125M" and c.training.seq_len == 16384
    t = c.training
    assert t.steps * t.local_batch_size * t.seq_len >= 100_000_000  # the issue: at least 100M tokens
    assert f"{t.steps} x {t.local_batch_size} x {t.seq_len} = {t.steps * t.local_batch_size * t.seq_len / 1e6:.1f}M" \
        in open(path).read()  # the header states the tokens of what ran
    assert c.training.dataset == "pysource" == c.validation.dataset
    assert 0.1 <= t.passkey_mix <= 0.2 and c.validation.enable and c.validation.seq_len == 16384
    assert c.checkpoint.enable and c.checkpoint.interval < t.steps and c.ops.halt_on_sigterm
    assert c.nsa.telemetry_every > 0 and c.metrics.jsonl_file == "metrics.jsonl"


def test_per_position_goal_from_the_paired_difference():
    """The report's goal line for distant context: NSA's token-weighted loss minus sliding_only's
    on the same buckets past the 512-token window (MET below 0); not measured without buckets
    there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality_report", ROOT / "experiments" / "quality_report.py")
    qr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qr)
    rows = lambda shift, his: [{"bucket_lo": lo, "bucket_hi": hi, "n_tokens": hi - lo, "loss": 2.0 + shift}  # noqa: E731
                               for lo, hi in his]
    buckets = [(16, 512), (512, 1024), (1024, 4096)]
    got = {"nsa": {"position": rows(0.0, buckets)}, "sliding_only": {"position": rows(0.1, buckets)}}
    d = qr.paired(got, "nsa")
    assert d["in"] == pytest.approx(-0.1) and d["out"] == pytest.approx(-0.1)
    line = qr.goals([], {}, 16384, 65536, got)[-1]
    assert "-0.1000 nats: goal < 0 MET" in line
    got["sliding_only"]["position"] = rows(-0.05, buckets)
    assert "+0.0500 nats: goal < 0 MISSED by 0.0500" in qr.goals([], {}, 16384, 65536, got)[-1]
    short = {v: {"position": rows(0.0, buckets[:1])} for v in ("nsa", "sliding_only")}
    assert "not measured" in qr.goals([], {}, 16384, 65536, short)[-1]
