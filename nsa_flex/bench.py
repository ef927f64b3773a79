"""The benchmark harness the scripts in experiments/ share: timing, a per-phase time limit, a
timing lock for processes side by side, CSV rows, a plot figure, and the tile-table overrides.

    with kernel_overrides(band={192: {...}}, pack_rows=32):   # the tables restored on exit
        ms = median_ms(fn, "cuda")                               # do_bench median (CUDA events)

Timing: on CUDA the median of `triton.testing.do_bench` (CUDA events, L2 flushed before every
call; CUDA events alone where triton is missing), elsewhere the median wall clock of `reps`
calls. The timed function rotates its own inputs (`Rot`), so repeated calls never just hit a
cache. torch.cuda, triton, fcntl and matplotlib are imported only where they are used.
"""

import contextlib
import csv
import signal
import statistics
import time
import traceback

import torch

from . import kernel_options

REFIRE_S = 5.0  # after a phase's limit, SIGALRM again every REFIRE_S until the phase ends


class Clock:
    """Timestamped progress lines, seconds since the clock was made, flushed at once (a log cut
    off by an outer `timeout` still shows where the time went)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)


# ---- per-phase wall-clock limit

class PhaseTimeout(TimeoutError):
    """A phase ran past its limit (raised from the SIGALRM handler); `phase` names the phase."""

    phase = ""


class _Alarm:
    fired = False

    def __call__(self, signum, frame):
        self.fired = True
        raise PhaseTimeout()


@contextlib.contextmanager
def time_limit(seconds: float, refire: float = REFIRE_S):
    """Raise PhaseTimeout in the main thread after `seconds` (0: no limit), then every `refire`
    seconds until the block ends, in case a broad `except Exception` (e.g. in autotuning)
    swallows it. Yields the alarm; `.fired` tells whether it went off. Python runs the handler
    only between bytecodes: a hang inside one C call is not interrupted (use an outer `timeout`
    as well). The previous SIGALRM handler is restored on exit."""
    alarm = _Alarm()
    if not seconds:
        yield alarm
        return
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, refire)
    try:
        yield alarm
    finally:
        for _ in range(3):  # a re-fire landing in here raises once more: disarm again
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
                break
            except PhaseTimeout:
                pass


def phase(what: str, fn, limit: float, log=print):
    """fn() under `limit` seconds, between a start and an end line; (result, seconds). An error
    raised after the alarm fired is a timeout too (compilers wrap what they catch)."""
    log(f"start {what}")
    t0 = time.perf_counter()
    alarm = None
    try:
        with time_limit(limit) as alarm:
            out = fn()
    except BaseException as e:
        log(f"fail  {what} after {time.perf_counter() - t0:.1f}s: {type(e).__name__}")
        if alarm is not None and alarm.fired and not isinstance(e, PhaseTimeout):
            raise PhaseTimeout(f"surfaced as {type(e).__name__}") from e
        raise
    dt = time.perf_counter() - t0
    log(f"done  {what} in {dt:.1f}s")
    return out, dt


# ---- the timing lock

class TimingLock:
    """A file several benchmark processes lock: shared around setup and compile, exclusive
    around timing. Processes side by side then compile together, but nobody times while another
    sets up, compiles or autotunes. An empty path locks nothing."""

    def __init__(self, path: str = ""):
        self.path = path

    @contextlib.contextmanager
    def hold(self, exclusive: bool):
        if not self.path:
            yield
            return
        import fcntl

        with open(self.path, "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield

    def shared(self, fn, *args):
        """fn(*args) under the shared side of the lock (setup, compile)."""
        with self.hold(exclusive=False):
            return fn(*args)


# ---- timing

def sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def first_call(fn, dev) -> float:
    """Seconds of the first call of fn (compile and autotuning included), synchronized."""
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def kernel_ms(fn, calls: int = 3) -> list[tuple[str, int, float]]:
    """GPU kernels of `calls` calls of fn (torch.profiler): (name, launches per call, ms per call),
    largest first -- where a timed item's time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, d = tot.get(e.name, (0, 0.0))
            tot[e.name] = (n + 1, d + e.device_time_total / 1e3)
    return [(name, n // calls, d / calls) for name, (n, d) in sorted(tot.items(), key=lambda kv: -kv[1][1])]


def median_ms(fn, dev, reps: int = 3, warmup: int = 10, rep_ms: int | None = None,
              lock: TimingLock | None = None) -> float:
    """Median milliseconds of one fn() call. CUDA: triton's do_bench (`warmup`, `rep_ms` ms of
    repetitions, default max(50, 10 reps)) under the exclusive side of `lock`, CUDA events with
    a flushed L2 where triton is missing; elsewhere the median wall clock of `reps` calls."""
    if torch.device(dev).type != "cuda":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    rep_ms = rep_ms or max(50, reps * 10)
    with (lock or TimingLock()).hold(exclusive=True):
        try:
            from triton.testing import do_bench
        except ImportError:
            return _event_median_ms(fn, warmup, reps)
        return do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median")


def _event_median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(max(1, warmup // 10)):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        flush.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def capture_graph(fn, warmup: int = 2):
    """(CUDA graph of one fn() call, its output): warm-up calls on a side stream first, as
    torch.cuda.graphs asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class Rot:
    """Cycle through k input sets so repeated calls don't just hit the cache. Call it outside
    compiled code: traced, its counter would be a guarded constant (a recompile every call)."""

    def __init__(self, make, k: int = 3):
        self.sets = [make() for _ in range(k)]
        self.i = 0

    def __call__(self):
        self.i += 1
        return self.sets[self.i % len(self.sets)]


class Lazy:
    """A setup value made on first use and shared by items; a failure (timeout included) is kept,
    so the items that need it fail at once instead of each retrying it."""

    def __init__(self, make):
        self.make, self.done, self.val, self.err = make, False, None, None

    def __call__(self):
        if self.err:
            raise RuntimeError(f"shared setup failed before: {self.err}")
        if not self.done:
            try:
                self.val = self.make()
            except BaseException as e:
                self.err = f"{type(e).__name__}: {str(e)[:150]}".rstrip(": ")
                raise
            self.done = True
        return self.val


def error_line(what: str, e: BaseException, limit: float = 0, log_path: str = "",
               title: str = "") -> str:
    """One CSV line for a failed measurement ("fwd timeout after 150s (first call)", "fwd
    ValueError: ..."); the whole traceback appended to `log_path` under `title`."""
    if isinstance(e, PhaseTimeout):
        msg = f"{what} timeout after {limit:g}s" + (f" ({e.phase})" if e.phase else "")
    else:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        msg = f"{what} {type(e).__name__}: {first}".rstrip(": ")
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"==== {title} {what}: {msg}\n{traceback.format_exc()}\n")
    return msg


# ---- results

def write_csv(rows: list[dict], path: str, first: tuple = (), fields: list | None = None) -> None:
    """Rewrite `path` with all rows (call it after every row: a killed run keeps what it
    measured). Columns: `fields` if given, else every key of the rows, those in `first` first
    (in that order) and the rest sorted, or without `first` in the order they appear."""
    if fields is None:
        fields = []
        for r in rows:
            fields += [k for k in r if k not in fields]
        if first:
            fields.sort(key=lambda k: (first.index(k) if k in first else len(first), k))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


@contextlib.contextmanager
def figure(path: str, ncols: int = 1, size=(12, 4.5)):
    """A matplotlib figure (Agg) with `ncols` axes, saved to `path` on exit; yields None (and
    saves nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        yield None
        return
    fig, axes = plt.subplots(1, ncols, figsize=size)
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# ---- tile-table overrides

@contextlib.contextmanager
def kernel_overrides(band: dict | None = None, packed: dict | None = None,
                     pack_rows: int = 0, log=print):
    """Override flex's tile tables for the block, restoring them on exit: `band` / `packed`
    ({head dim: kernel_options}) replace entries of kernel_options.BAND_OPTIONS / PACKED_OPTIONS,
    `pack_rows` sets kernel_options.PACK_ROWS (a positive multiple of 16). Empty / 0 leaves a
    setting as it is. (The selected op's settings are a record passed to it, not tables:
    `nsa_flex.ops.SelectedTuning`, `NSAAttention(cfg, sel_tuning=...)`.)"""
    if pack_rows and (pack_rows < 0 or pack_rows % 16):
        raise ValueError(f"pack_rows must be a positive multiple of 16, got {pack_rows}")
    saved = [(kernel_options, "BAND_OPTIONS", dict(kernel_options.BAND_OPTIONS)),
             (kernel_options, "PACKED_OPTIONS", dict(kernel_options.PACKED_OPTIONS)),
             (kernel_options, "PACK_ROWS", kernel_options.PACK_ROWS)]
    try:
        kernel_options.BAND_OPTIONS.update(band or {})
        kernel_options.PACKED_OPTIONS.update(packed or {})
        if band or packed:
            log(f"kernel_options: band {kernel_options.BAND_OPTIONS}, "
                f"packed {kernel_options.PACKED_OPTIONS}")
        if pack_rows:
            kernel_options.PACK_ROWS = pack_rows
            log(f"kernel_options: PACK_ROWS {pack_rows}")
        yield
    finally:
        for mod, name, value in saved:
            if isinstance(value, dict):  # in place: modules that imported the dict see it too
                table = getattr(mod, name)
                table.clear()
                table.update(value)
            else:
                setattr(mod, name, value)
