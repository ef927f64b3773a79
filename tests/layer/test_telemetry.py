"""NSA telemetry (nsa_flex/telemetry.py, NSAAttention.telemetry, the metrics processor):

* the math: log2 distance bins, binary entropy, per-layer stats against brute force over the dense
  masks and against closed forms of the tokens each branch reads, for every mask preset;
* recording inside torch.compile(fullgraph=True) with activation checkpointing gives the eager values,
  and switching it on changes no output;
* the gate-collapse monitor's streak rule and the [nsa] settings' errors;
* a short CPU training through torchtitan's trainer with telemetry_every=1 and the window gate forced
  open (bias 20): the JSONL records hold the gate / entropy / reads / distance-histogram values (exact
  at step 1), the TensorBoard file the scalars and the histogram, and the collapse warning comes at
  step gate_collapse_steps, once per layer, for that branch only.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_flex import NSAAttention, NSAConfig
from nsa_flex import telemetry as tm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"
DBG = dict(dim=64, n_heads=4, n_kv_heads=2, d_qk=16, d_v=16, l=8, d=4, l_sel=16, n_sel=4, window=32,
           backend="reference")


def _layer(masks="nsa", seed=0, **kw):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**{**DBG, "masks": masks, **kw}))
    m.init_weights()
    with torch.no_grad():
        m.gate.weight.normal_(0, 0.5)  # gates away from 0.5, different per position
    return m


# ---------------------------------------------------------------------- math
def test_distance_bins_and_labels():
    d = torch.tensor([0, 1, 2, 3, 4, 7, 8, 15, 16, 511, 512, 1023, 1024, 5000])
    assert tm.distance_bins(d).tolist() == [0, 1, 2, 2, 3, 3, 4, 4, 5, 9, 10, 10, 11, 11]
    labels = tm.bin_labels()
    assert len(labels) == tm.N_BINS
    assert labels[:5] == ["0", "1", "2-3", "4-7", "8-15"] and labels[-1] == "1024+"
    for k in range(1100):  # every label's range maps to its bin
        lab = labels[int(tm.distance_bins(torch.tensor(k)))]
        lo, _, hi = lab.rstrip("+").partition("-")
        assert int(lo) <= k and (lab.endswith("+") or k <= int(hi or lo)), (k, lab)


def test_binary_entropy_bits():
    g = torch.tensor([0.0, 1.0, 0.5, 0.11, 0.89, 0.25])
    h = tm.binary_entropy_bits(g)
    ref = [0.0, 0.0, 1.0] + [-(p * math.log2(p) + (1 - p) * math.log2(1 - p)) for p in (0.11, 0.89, 0.25)]
    assert torch.allclose(h, torch.tensor(ref), atol=1e-6)
    assert torch.isfinite(h).all()


def test_query_positions():
    assert tm.query_positions(5) == [0, 1, 2, 3, 4]
    q = tm.query_positions(256)
    assert len(q) == tm.N_QUERIES and q[-1] == 255 and q == sorted(set(q))


def _brute(m: NSAAttention, x: torch.Tensor):
    """Recompute a layer's telemetry from the full dense masks and python loops."""
    from masks import MaskContext

    cfg = m.cfg
    B, T, _ = x.shape
    H = cfg.n_heads
    with torch.no_grad():
        g = torch.sigmoid(m.gate(x)).view(B, T, H, 3).double()
    enabled = [m.branch_names[b] != "none" for b in tm.BRANCHES]
    q = tm.query_positions(T)
    specs = {}
    captured = {}

    def spy(name, fn):
        def f(ctx):
            s = fn(ctx)
            captured.setdefault(name, s)
            return s
        return f

    m.builders = {b: spy(b, fn) for b, fn in m.builders.items()}
    m(x)
    for b in tm.BRANCHES:
        if enabled[tm.BRANCHES.index(b)]:
            specs[b] = captured[b]
    reads, hist, dsum, cnt = {}, [0.0] * tm.N_BINS, 0.0, 0.0
    for b, spec in specs.items():
        kv = T if b != "cmp" else (T - cfg.l) // cfg.d + 1
        dense = spec.dense(B, T, kv).expand(B, spec.heads, T, kv)
        rows = dense[:, :, q]
        reads[b] = rows.sum(-1).double().mean().item()
        if b == "sel":
            for bb in range(B):
                for h in range(spec.heads):
                    for i, t in enumerate(q):
                        blocks = {int(s) // cfg.l_sel for s in torch.nonzero(rows[bb, h, i]).flatten()}
                        for blk in blocks:
                            dist = t // cfg.l_sel - blk
                            hist[int(tm.distance_bins(torch.tensor(dist)))] += 1
                            dsum += dist
                            cnt += 1
    on = torch.tensor(enabled, dtype=torch.double)
    share = (g * on / (g * on).sum(-1, keepdim=True)).mean((0, 1, 2))
    return g.mean((0, 1, 2)), tm.binary_entropy_bits(g).double().mean((0, 1, 2)), share, reads, hist, dsum, cnt


@pytest.mark.parametrize("masks", ["nsa", "full_causal", "sliding_only", "random_selection",
                                   "local_selection", "no_compressed"])
def test_layer_stats_match_brute_force(masks, single_thread):
    m = _layer(masks)
    x = torch.randn(2, 100, 64, generator=torch.Generator().manual_seed(1))
    m.telemetry = True
    with torch.no_grad():
        m(x)
    st = m.telemetry_stats.double()
    mean, ent, share, reads, hist, dsum, cnt = _brute(m, x)
    assert torch.allclose(st[tm.GATE_MEAN], mean, atol=1e-5)
    assert torch.allclose(st[tm.GATE_ENTROPY], ent, atol=1e-5)
    assert torch.allclose(st[tm.GATE_SHARE], share, atol=1e-5)
    for j, b in enumerate(tm.BRANCHES):
        assert st[tm.READS][j].item() == pytest.approx(reads.get(b, 0.0), abs=1e-4), b
    assert st[tm.HIST].tolist() == hist
    assert st[tm.DIST_SUM].item() == pytest.approx(dsum) and st[tm.DIST_CNT].item() == cnt


def test_reads_closed_forms(single_thread):
    """Tokens read per query, independent of the learned scores: NSA's top-n always takes
    min(n, blocks so far) blocks incl. the current one; the window min(t+1, w); compressed blocks
    ending at or before t; full attention t+1."""
    T = 256
    q = tm.query_positions(T)
    l, d, ls, n, w = 8, 4, 16, 4, 32
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2))
    expect = {
        "cmp": sum((t - l + 1) // d + 1 if t >= l - 1 else 0 for t in q) / len(q),
        "sel": sum((min(n, t // ls + 1) - 1) * ls + t % ls + 1 for t in q) / len(q),
        "win": sum(min(t + 1, w) for t in q) / len(q),
    }
    m = _layer("nsa")
    m.telemetry = True
    with torch.no_grad():
        m(x)
    st = m.telemetry_stats
    assert st[tm.READS].tolist() == pytest.approx([expect["cmp"], expect["sel"], expect["win"]])
    # the current block (distance 0) is forced, once per (batch, group, query)
    n_blocks = sum(min(n, t // ls + 1) for t in q)
    assert st[tm.DIST_CNT].item() == 2 * 2 * n_blocks
    assert st[tm.HIST][0].item() == 2 * 2 * len(q)
    m = _layer("full_causal")
    m.telemetry = True
    with torch.no_grad():
        m(x)
    st = m.telemetry_stats
    assert st[tm.READS].tolist() == pytest.approx([0.0, sum(t + 1 for t in q) / len(q), 0.0])
    metrics = tm.telemetry_metrics(st[None], [(False, True, False)])
    assert "nsa/layer0/gate_mean/sel" in metrics and "nsa/layer0/gate_mean/win" not in metrics
    assert metrics["nsa/layer0/gate_share/sel"] == pytest.approx(1.0)


def test_telemetry_changes_no_output(single_thread):
    x = torch.randn(1, 80, 64)
    m = _layer("nsa")
    with torch.no_grad():
        y0 = m(x)
    assert not m.telemetry_stats.any()  # off: never written
    m.telemetry = True
    with torch.no_grad():
        y1 = m(x)
    assert torch.equal(y0, y1) and m.telemetry_stats.any()
    assert "telemetry_stats" not in m.state_dict()


def test_telemetry_compiled_with_activation_checkpointing(single_thread):
    """torchtitan's parallelize_fn: selective AC (every 2nd block) + per-block torch.compile with
    fullgraph=True (a graph break would raise); the buffers hold the eager values after a training
    step (forward + checkpoint recompute in backward)."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from nsa_flex.titan.args import nsa_flex_args
    from nsa_flex.titan.model import NSATransformer
    from nsa_flex.titan.parallelize import parallelize_nsa

    def job(*a):
        return ConfigManager().parse_args(["--job.custom_config_module", "nsa_flex.titan.job_config", *a])

    args = nsa_flex_args["debugmodel"]
    args.update_from_config(job("--training.seq_len", "64"))

    def build():
        torch.manual_seed(0)
        m = NSATransformer(args)
        with torch.no_grad():
            m.init_weights()
            for blk in m.layers.values():
                blk.attention.gate.weight.normal_(0, 0.3)
        for mod in m.modules():
            if isinstance(mod, NSAAttention):
                mod.telemetry = True
        return m

    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    ref = build()
    ref(x).float().sum().backward()
    ref_stats = [b.attention.telemetry_stats.clone() for b in ref.layers.values()]
    torch._dynamo.reset()
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    # torchtitan's default AC (selective, every 2nd block): one checkpointed, one plain block
    m = parallelize_nsa(build(), pd, job("--compile.enable", "--compile.backend", "aot_eager"))
    assert [type(b).__name__ for b in m.layers.values()] == ["OptimizedModule"] * 2
    assert sum("checkpoint" in type(b._orig_mod).__name__.lower() for b in m.layers.values()) == 1
    m(x).float().sum().backward()
    layers = [mod for mod in m.modules() if isinstance(mod, NSAAttention)]
    assert len(layers) == len(ref_stats)
    for got, want in zip(layers, ref_stats):
        torch.testing.assert_close(got.telemetry_stats, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- host side
def test_gate_collapse_monitor_streaks():
    mon = tm.GateCollapseMonitor(0.95, 3)
    k = (0, "win")
    assert mon.update(1, {k: 0.99}) == [] and mon.update(2, {k: 0.99}) == []
    (msg,) = mon.update(3, {k: 0.99})
    assert "layer 0 branch 'win'" in msg and "since step 1" in msg and "gate_collapse_steps=3" in msg
    assert mon.update(4, {k: 0.99}) == [] and mon.collapsed == 1  # once per streak
    assert mon.update(5, {k: 0.95}) == [] and mon.collapsed == 0  # not above: re-armed
    assert mon.update(6, {k: 0.97}) == [] and mon.update(7, {k: 0.97}) == []
    assert len(mon.update(8, {k: 0.97})) == 1
    # telemetry every 10 steps: the streak spans steps 10..20 (11 steps) at the second reading
    mon = tm.GateCollapseMonitor(0.95, 5)
    assert mon.update(10, {(1, "cmp"): 0.96, (1, "sel"): 0.2}) == []
    out = mon.update(20, {(1, "cmp"): 0.96, (1, "sel"): 0.2})
    assert len(out) == 1 and "layer 1 branch 'cmp'" in out[0]
    # a single reading is enough with steps=1
    assert len(tm.GateCollapseMonitor(0.5, 1).update(7, {(0, "sel"): 0.6})) == 1


def test_settings_errors_name_the_fields():
    tm.validate_settings(0, 0.95, 10)
    tm.validate_settings(5, 0.5, 1)
    with pytest.raises(ValueError) as e:
        tm.validate_settings(-1, 1.5, 0)
    msg = str(e.value)
    assert "nsa.telemetry_every=-1" in msg and "nsa.gate_collapse_threshold=1.5" in msg
    assert "nsa.gate_collapse_steps=0" in msg
    with pytest.raises(ValueError, match="gate_collapse_threshold=0"):
        tm.validate_settings(1, 0, 3)


def test_histogram_raw_and_metrics():
    row = torch.zeros(tm.STATS_SIZE)
    row[tm.HIST.start:tm.HIST.start + 4] = torch.tensor([2.0, 1.0, 0.0, 1.0])
    row[tm.DIST_SUM], row[tm.DIST_SQ], row[tm.DIST_CNT] = 6.0, 26.0, 4.0
    h = tm.histogram_raw(row)
    assert h["num"] == 4 and h["sum"] == 6 and h["sum_squares"] == 26
    assert h["min"] == 0 and h["max"] == 7 and h["bucket_limits"][:4] == [0.5, 1.5, 3.5, 7.5]
    assert h["bucket_counts"][:4] == [2, 1, 0, 1] and len(h["bucket_limits"]) == tm.N_BINS
    met = tm.telemetry_metrics(torch.stack([row, row]), [(True, True, True), (True, False, True)])
    assert met["nsa/layer0/sel_dist/0"] == 0.5 and met["nsa/layer0/sel_dist/4-7"] == 0.25
    assert met["nsa/layer0/sel_dist_mean"] == 1.5 and "nsa/layer1/sel_dist/0" not in met
    assert tm.histogram_raw(torch.zeros(tm.STATS_SIZE)) is None


# ---------------------------------------------------------------------- trainer
HOOK = '''
import torch
import nsa_flex.titan.train_spec  # noqa: F401  (registers nsa_flex, CPU shim)
from nsa_flex.layer import NSAAttention

_init = NSAAttention.init_weights


def init_weights(self, init_std=0.02):
    _init(self, init_std)
    with torch.no_grad():
        self.gate.bias.view(-1, 3)[:, 2].fill_(20.0)  # the window gate of every head stuck open


NSAAttention.init_weights = init_weights
'''


@pytest.mark.slow
def test_training_logs_telemetry_and_warns_on_collapse(tmp_path):
    (tmp_path / "collapse_hook.py").write_text(HOOK)
    dump = tmp_path / "run"
    K, STEPS = 3, 5
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--job.config_file", str(CONFIG),
           "--job.dump_folder", str(dump), "--training.steps", str(STEPS), "--metrics.log_freq", "2",
           "--metrics.enable_tensorboard", "--nsa.telemetry_every", "1",
           "--nsa.gate_collapse_steps", str(K), "--experimental.custom_import", "collapse_hook"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    recs = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs.setdefault(r["step"], {}).update(r)
    assert sorted(recs) == list(range(1, STEPS + 1))
    for s, r in recs.items():
        assert ("loss_metrics/global_avg_loss" in r) == (s == 1 or s % 2 == 0), s
        for i in (0, 1):
            for b in ("cmp", "sel", "win"):
                for key in ("gate_mean", "gate_entropy", "gate_share", "reads"):
                    assert f"nsa/layer{i}/{key}/{b}" in r, (s, i, b, key)
            fr = [r[f"nsa/layer{i}/sel_dist/{lab}"] for lab in tm.bin_labels()]
            assert sum(fr) == pytest.approx(1.0) and min(fr) >= 0
    r1 = recs[1]
    q = tm.query_positions(256)  # debug_nsa.toml: seq 256, l 8, d 4, l' 16, n 4, w 32
    for i in (0, 1):
        assert r1[f"nsa/layer{i}/gate_mean/cmp"] == 0.5 and r1[f"nsa/layer{i}/gate_mean/sel"] == 0.5
        assert r1[f"nsa/layer{i}/gate_entropy/cmp"] == pytest.approx(1.0)
        assert r1[f"nsa/layer{i}/gate_mean/win"] > 0.999 and r1[f"nsa/layer{i}/gate_entropy/win"] < 1e-6
        assert r1[f"nsa/layer{i}/reads/win"] == pytest.approx(sum(min(t + 1, 32) for t in q) / len(q))
        assert r1[f"nsa/layer{i}/reads/sel"] == pytest.approx(
            sum((min(4, t // 16 + 1) - 1) * 16 + t % 16 + 1 for t in q) / len(q))
        assert r1[f"nsa/layer{i}/sel_dist/0"] == pytest.approx(len(q) / sum(min(4, t // 16 + 1) for t in q))
    assert [recs[s]["nsa/gate_collapsed"] for s in range(1, STEPS + 1)] == [0, 0, 2, 2, 2]
    warnings = [line for line in log.splitlines() if "NSA gate collapse" in line]
    assert len(warnings) == 2, warnings  # once per layer, for the window branch only
    assert all("branch 'win'" in w and "since step 1" in w and f"({K} steps" in w for w in warnings)
    assert {w.split("layer ")[1][0] for w in warnings} == {"0", "1"}
    assert "NSA telemetry step 3:" in log and "sel dist 0:" in log
    # TensorBoard: the scalars and the distance histogram
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = list((dump / "tb").iterdir())
    ea = EventAccumulator(str(tb), size_guidance={"histograms": 0, "scalars": 0})
    ea.Reload()
    tags = ea.Tags()
    assert "nsa/layer1/gate_entropy/win" in tags["scalars"] and "nsa/reads/sel" in tags["scalars"]
    assert len(ea.Scalars("nsa/layer0/gate_mean/cmp")) == STEPS
    h = ea.Histograms("nsa/layer0/sel_dist_hist")
    assert len(h) == STEPS and h[0].histogram_value.num == pytest.approx(
        2 * 4 * sum(min(4, t // 16 + 1) for t in q))  # batch 4 x 2 groups x selected blocks
