"""nsa_flex.bench, the harness of the benchmark scripts: the timing lock, the per-phase limit,
CSV columns, CPU timing and the tile-table overrides (set inside, restored after, errors too)."""

import csv
import fcntl
import os
import signal
import time
from pathlib import Path

import pytest

from nsa_flex import bench, kernel_options

ROOT = Path(__file__).resolve().parents[2]


def test_timing_lock_shared_for_compile_exclusive_for_timing(tmp_path):
    """Side-by-side processes: compiles (shared) overlap, a timing (exclusive) excludes both
    other timings and other compiles; without a path nothing is locked."""
    path = str(tmp_path / "timing.lock")

    def can(kind):  # another process's attempt, from a separate open file description
        with open(path, "a") as f:
            try:
                fcntl.flock(f, kind | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True

    with bench.TimingLock("").hold(exclusive=True):  # no path: a no-op
        assert can(fcntl.LOCK_EX)
    lock = bench.TimingLock(path)
    with lock.hold(exclusive=False):
        assert can(fcntl.LOCK_SH) and not can(fcntl.LOCK_EX)
    with lock.hold(exclusive=True):
        assert not can(fcntl.LOCK_SH) and not can(fcntl.LOCK_EX)
    assert can(fcntl.LOCK_EX)  # released
    assert lock.shared(lambda a: a + 1, 1) == 2


def test_phase_timeout_and_handler_restored():
    def busy():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 5:
            pass

    old = signal.getsignal(signal.SIGALRM)
    lines = []
    t0 = time.perf_counter()
    with pytest.raises(bench.PhaseTimeout):
        bench.phase("slow", busy, 0.2, lines.append)
    assert time.perf_counter() - t0 < 3
    assert lines[0] == "start slow" and lines[1].startswith("fail  slow after 0.")
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is old
    out, dt = bench.phase("fast", lambda: 7, 5, lines.append)
    assert out == 7 and 0 <= dt < 1 and lines[-1].startswith("done  fast in ")
    e = bench.PhaseTimeout()
    e.phase = "timing"
    assert bench.error_line("fwd", e, 1.5) == "fwd timeout after 1.5s (timing)"
    assert bench.error_line("setup", ValueError("bad\nmore")) == "setup ValueError: bad"


def test_median_ms_on_cpu():
    calls = []
    ms = bench.median_ms(lambda: (calls.append(1), time.sleep(0.01)), "cpu", reps=3)
    assert len(calls) == 3 and 9 <= ms < 200


def test_write_csv_columns(tmp_path):
    rows = [dict(b=1, T=2), dict(a=3, stage="x")]
    bench.write_csv(rows, tmp_path / "a.csv")  # the order keys appear in
    bench.write_csv(rows, tmp_path / "b.csv", first=("T", "stage"))  # first, then sorted
    heads = [next(csv.reader(open(tmp_path / n))) for n in ("a.csv", "b.csv")]
    assert heads == [["b", "T", "a", "stage"], ["T", "stage", "a", "b"]]


def test_kernel_overrides_set_inside_restored_after():
    band0, packed0 = dict(kernel_options.BAND_OPTIONS), dict(kernel_options.PACKED_OPTIONS)
    rows0 = kernel_options.PACK_ROWS
    with pytest.raises(RuntimeError):
        with bench.kernel_overrides(band={192: {"fwd_num_warps": 2}}, packed={64: {"x": 1}},
                                    pack_rows=48, log=lambda m: None):
            assert kernel_options.BAND_OPTIONS[192] == {"fwd_num_warps": 2}
            assert kernel_options.PACKED_OPTIONS[64] == {"x": 1}
            assert kernel_options.PACK_ROWS == 48
            raise RuntimeError("the run failed")
    assert kernel_options.BAND_OPTIONS == band0 and kernel_options.PACKED_OPTIONS == packed0
    assert kernel_options.PACK_ROWS == rows0
    with pytest.raises(ValueError, match="pack_rows must be a positive multiple of 16"):
        with bench.kernel_overrides(pack_rows=20):
            pass


def _selected_gpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("selected_gpu", ROOT / "experiments" / "selected_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_selected_gpu_layouts_parsed_or_refused():
    pytest.importorskip("triton")
    sg = _selected_gpu()
    from nsa_flex.ops import SelectedTuning

    assert sg.parse_layouts("16,32:1") == [SelectedTuning(rows=16), SelectedTuning(rows=32, dq_atomic=True)]
    assert [sg.layout_name(t) for t in sg.parse_layouts("16,32:0")] == ["16", "32:0"]
    for bad in ("20", "16:2", "0", "16:1:1", "x:1"):
        with pytest.raises(SystemExit, match="must be ROWS"):
            sg.parse_layouts(bad)


@pytest.mark.slow
def test_selected_gpu_runs_interpreted(tmp_path):
    """experiments/selected_gpu.py end to end on the CPU (Triton's interpreter, tiny shapes): the
    check against the reference for two layouts (the defaults; dQ in the dK/dV pass), then the
    timing rows, a trained selection that does not fit the shape skipped."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    trace = ROOT / "experiments" / "results" / "quality" / "selection_traces" / "nsa_L32768.npz"
    r = subprocess.run([sys.executable, "experiments/selected_gpu.py", "--out", str(tmp_path),
                        "--check-len", "40", "--check-shapes", "g2", "--shapes", "g2:64",
                        "--layouts", "16,16:1", "--trace", f"{trace}:6"], cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check = list(csv.DictReader(open(tmp_path / "selected_check.csv")))
    assert {c["layout"] for c in check} == {"16", "16:1"} and all(c["ok"] == "True" for c in check)
    times = list(csv.DictReader(open(tmp_path / "selected_time.csv")))
    assert {(t["layout"], t["executor"], t["mode"]) for t in times} >= {
        ("16", "op_only", "fwd_bwd"), ("16:1", "op_only", "fwd_bwd"), ("16:1", "mask_build", "fwd")}
    assert all(t["error"] == "" for t in times if t["executor"] == "op_only")
    assert "no trained selection" in r.stdout


@pytest.mark.slow
def test_tune_selected_runs_interpreted(tmp_path):
    """experiments/tune_selected.py --quick end to end on the CPU (Triton's interpreter, tiny
    shape): every config of the grids checked against the default config and timed (a forward
    config with other q block rows runs on its own lists; each config a tuning record passed to
    the op), one that
    cannot compile (24 gathered rows: not a power of two) recorded with its error and skipped, the
    trained selection that does not fit the shape skipped, the best config printed; --max-minutes
    stops the sweep cleanly."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "experiments/tune_selected.py", "--quick", "--out",
                        str(tmp_path), "--dkv", "128:8:2,16:4:1,24:4:1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "tune_selected.csv")))
    timed = [x for x in rows if x["selection"] == "random"]
    assert [(x["kernel"], x["config"]) for x in timed] == [
        ("fwd", "w8:s2"), ("fwd", "r32:w2:s1"), ("dkv", "r128:w8:s2"), ("dkv", "r16:w4:s1"),
        ("dkv", "r24:w4:s1")]
    good, bad = timed[:4] + timed[5:], timed[4]
    assert all(x["error"] == "" and float(x["ms"]) > 0 and float(x["err"]) < 1e-4 for x in good)
    assert "power of 2" in bad["error"] and bad["ms"] == "nan"
    assert [x["selection"] for x in rows if x not in timed] == ["trained"]
    assert "no trained selection" in r.stdout
    assert "best tiny T=96 random dkv: " in r.stdout and "(default r128:w8:s2: " in r.stdout
    r = subprocess.run([sys.executable, "experiments/tune_selected.py", "--quick", "--out",
                        str(tmp_path), "--max-minutes", "0.0001"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "--max-minutes reached" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert list(csv.DictReader(open(tmp_path / "tune_selected.csv"))) == []


def test_saved_memory_runs_on_cpu(tmp_path):
    """experiments/saved_memory.py on the CPU (reference backend, tiny shape): one summary row per
    layer, NSA's saved tensors listed and more of them than full attention's; recompute cmp_win
    keeps less than none."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "experiments/saved_memory.py", "--out", str(tmp_path),
                        "--configs", "tiny", "--T", "256", "--recompute", "none,cmp_win"], cwd=ROOT,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = {s["layer"]: s for s in csv.DictReader(open(tmp_path / "saved_memory.csv"))}
    assert set(summary) == {"nsa", "nsa_recompute_cmp_win", "full_causal"}
    assert float(summary["nsa"]["saved_MiB"]) > float(summary["full_causal"]["saved_MiB"]) > 0
    assert float(summary["nsa"]["saved_MiB"]) > float(summary["nsa_recompute_cmp_win"]["saved_MiB"])
    rows = list(csv.DictReader(open(tmp_path / "saved_tensors.csv")))
    assert sum(r["layer"] == "nsa" for r in rows) == int(summary["nsa"]["saved_tensors"])


def test_saved_memory_live_at_peak_replays_the_trace():
    """saved_memory.py --at-peak: the allocator's trace replayed -- the peak is the largest sum of
    live blocks (not the last), blocks freed before it are not listed, blocks are summed by where
    they were allocated (torch's own frames skipped)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("saved_memory", ROOT / "experiments" / "saved_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    MiB = 2 ** 20

    def alloc(addr, mib, where):
        frames = [{"filename": "/site/torch/nn/functional.py", "line": 9, "name": "linear"},
                  {"filename": f"/src/{where}.py", "line": 3, "name": where}]
        return dict(action="alloc", addr=addr, size=int(mib * MiB), frames=frames)

    free = lambda addr: dict(action="free_requested", addr=addr, size=0)  # noqa: E731
    trace = [alloc(1, 4, "gate"), alloc(2, 8, "dq"), free(1), alloc(3, 2, "dq"), alloc(4, 1, "lse"),
             free(2), free(3), alloc(5, 1, "late")]
    peak, blocks = mod.live_at_peak({"device_traces": [trace]})
    assert peak == 12 and blocks == [(8.0, "dq.py:3:dq | "), (4.0, "gate.py:3:gate | ")]
    trace.insert(4, alloc(6, 5, "gate"))  # now the peak is later: dq 10 + lse 1 + gate 5
    peak, blocks = mod.live_at_peak({"device_traces": [trace]})
    assert peak == 16 and blocks == [(10.0, "dq.py:3:dq | "), (5.0, "gate.py:3:gate | "),
                                     (1.0, "lse.py:3:lse | ")]


def test_host_overhead_refuses_clearly_on_cpu(tmp_path):
    """experiments/host_overhead.py times the host's launches of GPU kernels: without CUDA it stops
    with a message saying so, and a bad --inductor item names itself (before any GPU work)."""
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = lambda *a: subprocess.run([sys.executable, "experiments/host_overhead.py", "--out",
                                     str(tmp_path), *a], cwd=ROOT, env=env, capture_output=True,
                                    text=True, timeout=300)
    r = run()
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr[-2000:]
    r = run("--inductor", "no_such_option=1")
    assert r.returncode == 2 and "--inductor 'no_such_option=1'" in r.stderr, r.stderr[-2000:]
    assert not any(tmp_path.iterdir())
