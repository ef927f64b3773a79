"""nsa_flex.bench, the harness of the benchmark scripts: the timing lock, the per-phase limit,
CSV columns, CPU timing and the tile-table overrides (set inside, restored after, errors too)."""

import csv
import fcntl
import signal
import time

import pytest

from nsa_flex import bench, kernel_options


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


def test_kernel_overrides_sel_rows():
    pytest.importorskip("triton")
    from nsa_flex.ops import selected_triton

    rows0 = selected_triton.ROWS
    with bench.kernel_overrides(sel_rows=rows0 * 2, log=lambda m: None):
        assert selected_triton.ROWS == rows0 * 2
    assert selected_triton.ROWS == rows0


def test_kernel_overrides_sel_layout_and_dq_mode():
    pytest.importorskip("triton")
    from nsa_flex.ops import selected_triton

    before = selected_triton.PAD_HEADS, selected_triton.DQ_ATOMIC
    msgs = []
    with bench.kernel_overrides(sel_pad_heads=not before[0], sel_dq_atomic=not before[1], log=msgs.append):
        assert (selected_triton.PAD_HEADS, selected_triton.DQ_ATOMIC) == (not before[0], not before[1])
    assert (selected_triton.PAD_HEADS, selected_triton.DQ_ATOMIC) == before
    assert f"DQ_ATOMIC {not before[1]}" in msgs[-1]
