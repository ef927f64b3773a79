"""experiments/bench_attention.py on CPU: item order, --only / --modes, and the per-phase
--item-limit (a slow item ends as a timeout row and the sweep goes on)."""

import csv
import os
import signal
import time

import pytest
import torch

from nsa_flex.bench import _Alarm
from tests.experiments.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench():
    mod = load_script("bench_attention")
    yield mod
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left armed
    assert not isinstance(signal.getsignal(signal.SIGALRM), _Alarm)  # the handler restored


META = dict(config="fake", T=1, device="cpu")


def busy(seconds):
    """Pure Python work (no C call to hang in): interrupted between bytecodes by the alarm."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def test_items_stages_first_layer_last(bench):
    names = [n for n, _, _ in bench.build_items("tiny", 256, "cpu", torch.float32, False)]
    assert names[:len(bench.STAGES)] == bench.STAGES
    assert names[len(bench.STAGES):-1] == [n for n in bench.BASELINES if n in names]
    assert names[-1] == "nsa_layer"


def test_item_limit_timeout_row_and_sweep_goes_on(bench):
    w = torch.ones(3, requires_grad=True)
    rows = []
    slow = lambda: (lambda: (busy(5), w * 2)[1])
    bench.timed("slow", slow, True, "cpu", rows, META, limit=0.3)
    # fast inference forward, slow only in grad mode: fwd passes, fwd+bwd times out
    slow_bwd = lambda: (lambda: (torch.is_grad_enabled() and busy(5), w * 2)[1])
    bench.timed("slow_bwd", slow_bwd, True, "cpu", rows, META, limit=0.3)
    bench.timed("fast", lambda: (lambda: w * 2), True, "cpu", rows, META, limit=5)

    def wraps():  # a compiler that catches the alarm and raises its own error: still a timeout
        try:
            busy(5)
        except TimeoutError as e:
            raise RuntimeError("backend compiler failed") from e

    bench.timed("wrapped", lambda: wraps, False, "cpu", rows, META, limit=0.3)
    slow_row, bwd_row, fast_row, wrapped_row = rows
    assert wrapped_row["error"] == "fwd(no_grad) timeout after 0.3s (compile+first call)"
    assert slow_row["error"].startswith("fwd(no_grad) timeout after 0.3s (compile+first call)")
    assert "fwd+bwd timeout after 0.3s" in slow_row["error"]
    assert "fwd(grad)" not in slow_row["error"]  # no grad-mode retry of a timed-out forward
    assert "fwd_ms" not in slow_row and slow_row["item_s"] < 3
    assert bwd_row["error"] == "fwd+bwd timeout after 0.3s (compile+first call)"
    assert "fwd_ms" in bwd_row and "fwd_bwd_ms" not in bwd_row
    assert "error" not in fast_row
    assert {"fwd_ms", "fwd_bwd_ms", "fwd_first_s", "fwd_bwd_first_s"} <= set(fast_row)


def test_shared_setup_failure_is_kept(bench):
    calls = []

    def make():
        calls.append(1)
        raise ValueError("no weights")

    shared = bench.Lazy(make)
    rows = []
    for name in ("a", "b"):
        bench.timed(name, lambda: (shared(), None)[1], False, "cpu", rows, META)
    assert len(calls) == 1
    assert rows[0]["error"] == "setup ValueError: no weights"
    assert rows[1]["error"].startswith("setup RuntimeError: shared setup failed before")


def test_main_only_modes_item_limit(bench, tmp_path, monkeypatch):
    rows = bench.main(["--quick", "--only", "projections,sdpa_causal", "--modes", "fwd",
                       "--item-limit", "120", "--out", str(tmp_path)])
    # T=128 has no stages; at T=256 the stage comes before the baseline
    assert [(r["T"], r["stage"]) for r in rows] == [(128, "sdpa_causal"), (256, "projections"),
                                                    (256, "sdpa_causal")]
    assert all("error" not in r and r["fwd_first_s"] >= 0 for r in rows)
    with open(tmp_path / "bench.csv") as f:
        assert [r["stage"] for r in csv.DictReader(f)] == [r["stage"] for r in rows]
    for bad in (["--only", "nsa_layerx"], ["--modes", "bwd"]):
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--out", str(tmp_path)] + bad)

    # a slow item through main: a timeout row, then the next item still runs
    def fake_items(cname, T, dev, dtype, compile_=True):
        return [("projections", False, lambda: (lambda: busy(5))),
                ("nsa_layer", False, lambda: (lambda: torch.zeros(1)))]

    monkeypatch.setattr(bench, "build_items", fake_items)
    rows = bench.main(["--quick", "--item-limit", "0.3", "--out", str(tmp_path / "slow")])
    assert [(r["T"], r["stage"]) for r in rows] == [(128, "nsa_layer"), (256, "projections"),
                                                    (256, "nsa_layer")]
    assert rows[1]["error"] == "fwd(no_grad) timeout after 0.3s (compile+first call)"
    assert "error" not in rows[2] and "fwd_ms" in rows[2]
    assert "timeout" in (tmp_path / "slow" / "errors.log").read_text()


def test_tile_flags_apply_during_the_run_and_are_restored(bench, tmp_path, monkeypatch):
    """--band-options / --packed-options / --pack-rows / --inductor hold while the sweep runs (for
    the head dim of each --configs entry) and the library's tables and inductor's config are as
    before once main returns."""
    from nsa_flex import kernel_options

    before = (dict(kernel_options.BAND_OPTIONS), dict(kernel_options.PACKED_OPTIONS),
              kernel_options.PACK_ROWS)
    seen = {}

    import torch._inductor.config as inductor

    fusion = inductor.epilogue_fusion

    def fake_sweep(args, only, modes):
        seen.update(band=dict(kernel_options.BAND_OPTIONS),
                    packed=dict(kernel_options.PACKED_OPTIONS), rows=kernel_options.PACK_ROWS, lock=bench.LOCK.path,
                    fusion=inductor.epilogue_fusion)
        return []

    monkeypatch.setattr(bench, "sweep", fake_sweep)
    bench.main(["--configs", "paper,titan_125M", "--band-options", '{"bwd_num_warps": 4}',
                "--packed-options", '{"fwd_num_stages": 1}', "--pack-rows", "32",
                "--timing-lock", str(tmp_path / "lk"), "--out", str(tmp_path),
                "--inductor", f"epilogue_fusion={not fusion}"])
    assert seen["fusion"] is (not fusion) and inductor.epilogue_fusion is fusion  # restored
    assert seen["band"][192] == seen["band"][64] == {"bwd_num_warps": 4}
    assert seen["packed"][192] == {"fwd_num_stages": 1} and seen["rows"] == 32
    assert seen["lock"] == str(tmp_path / "lk")
    assert (dict(kernel_options.BAND_OPTIONS), dict(kernel_options.PACKED_OPTIONS),
            kernel_options.PACK_ROWS) == before
    with pytest.raises(SystemExit):
        bench.main(["--pack-rows", "24", "--out", str(tmp_path)])
    for bad in ("no_such_option=1", "epilogue_fusion", "epilogue_fusion=maybe"):
        with pytest.raises(SystemExit):
            bench.main(["--inductor", bad, "--out", str(tmp_path)])


def test_static_titan_config_matches_the_flavor():
    """bench_attention's static titan_125M entry (used where torchtitan is not installed) is the
    125M flavor's attention."""
    from dataclasses import asdict

    from nsa_flex.titan.args import nsa_flex_args

    bench = load_script("bench_attention")
    c = asdict(nsa_flex_args["125M"].nsa_config())
    assert bench.CONFIGS["titan_125M"] == {k: c[k] for k in bench.CONFIGS["titan_125M"]}
    for k in ("l", "d", "l_sel", "n_sel", "window"):  # the rest are the NSAConfig defaults
        assert c[k] == getattr(bench.NSAConfig(), k)


def test_selection_trace_replaces_the_random_picks(bench, tmp_path, monkeypatch):
    """--selection-trace: the selection items and the layer attend the trace's picks (their first
    T positions); a trace shorter than T skips the config with a message; bad files are one-line
    errors."""
    import numpy as np

    from nsa_flex.apps.eval.prompts import EvalError
    from nsa_flex.apps.eval.selection_stats import load_trace

    T, n = 256, 4
    rows = np.full((2, T, n), -1, dtype=np.int16)
    own = np.arange(T) // 16
    rows[:, :, 0] = 0
    rows[:, :, 1] = np.where(own > 0, own, -1)  # block 0 and the own block: no random scorer gives that
    path = tmp_path / "selection_L256.npz"
    np.savez_compressed(path, layer3=rows, tokens=np.zeros(T, np.int32), l_sel=16, n_sel=n)
    idx, info = load_trace(str(path))
    assert idx.shape == (1, 2, T, n) and idx.dtype == torch.int64 and info["layer"] == 3
    with pytest.raises(EvalError, match="layer 0 not saved; saved: \\[3\\]"):
        load_trace(str(path), 0)
    with pytest.raises(EvalError, match="no such file"):
        load_trace(str(tmp_path / "none.npz"))
    from nsa_flex.apps.eval.selection_stats import load_trace_arg

    same, label = load_trace_arg(f"{path}:3")
    assert torch.equal(same, idx) and label == "trained:selection_L256.npz:layer3"
    assert load_trace_arg(str(path))[1] == label  # no layer: the first saved

    monkeypatch.setattr(bench, "TRACE", (idx, "trained:test"))
    seen = []
    import nsa_flex.attention as attention

    orig = attention.attend_flex

    def spy(q, k, v, spec, *a, **kw):
        if spec.selection is not None:
            seen.append(spec.selection.idx.clone())
        return orig(q, k, v, spec, *a, **kw)

    monkeypatch.setattr(attention, "attend_flex", spy)  # where the planned op hands CPU tensors
    items = dict((nm, mk) for nm, _, mk in bench.build_items("tiny", T, "cpu", torch.float32, False))
    items["attn_selected"]()()
    assert seen and torch.equal(seen[0].reshape(-1, n).sort(-1).values, idx.reshape(-1, n).sort(-1).values)
    monkeypatch.setattr(bench, "TRACE_RAW", (idx, "trained:test"))
    rows_out = []
    bench.run_config("tiny", 512, "cpu", torch.float32, rows_out, stages=True, baselines=False,
                     compile_=False)
    assert rows_out == []  # T=512 is longer than the trace's 256: skipped
    bench.run_config("tiny", 128, "cpu", torch.float32, rows_out, stages=True, baselines=False,
                     compile_=False, only={"attn_selected"})
    # a shorter T: the trace's first 128 positions
    assert rows_out and {r["selection"] for r in rows_out} == {"trained:test[:128]"}
    assert torch.equal(bench.TRACE[0], idx[:, :, :128])


def test_trace_layers_stack_and_fit(tmp_path):
    """NPZ:3+5 stacks two layers' KV heads (the paper shape's four from two of two); fit_trace
    crops to T and refuses other heads, n, or a longer T."""
    import numpy as np

    from nsa_flex.apps.eval.prompts import EvalError
    from nsa_flex.apps.eval.selection_stats import fit_trace, load_trace_arg

    T, n = 64, 4
    a = np.arange(2 * T * n, dtype=np.int16).reshape(2, T, n) % 7
    path = tmp_path / "selection_L64.npz"
    np.savez_compressed(path, layer3=a, layer5=a + 1, l_sel=16, n_sel=n)
    idx, label = load_trace_arg(f"{path}:3+5")
    assert idx.shape == (1, 4, T, n) and label == "trained:selection_L64.npz:layer3+5"
    assert torch.equal(idx[0, 2:], torch.from_numpy(a + 1).long())
    cut, lab = fit_trace(idx, label, 4, 40, n)
    assert torch.equal(cut, idx[:, :, :40]) and lab == label + "[:40]"
    assert fit_trace(idx, label, 4, T, n)[1] == label
    for bad in ((2, 40, n), (4, 65, n), (4, 40, 8)):
        with pytest.raises(ValueError, match="does not fit"):
            fit_trace(idx, label, *bad)
    with pytest.raises(EvalError, match="joined by"):
        load_trace_arg(f"{path}:3,5")


def test_cmp_kernel_reaches_the_layer_and_the_rows(bench, tmp_path, monkeypatch):
    """--cmp-kernel sets the NSA layer's NSAConfig.cmp_kernel and every row's cmp_kernel column;
    a value NSAConfig does not allow is refused before anything runs."""
    seen = []

    def fake_items(cname, T, dev, dtype, compile_=True):
        seen.append(bench.layer_config(cname).cmp_kernel)
        return [("nsa_layer", False, lambda: (lambda: torch.zeros(1)))]

    monkeypatch.setattr(bench, "build_items", fake_items)
    rows = bench.main(["--quick", "--cmp-kernel", "cudnn_lean", "--out", str(tmp_path)])
    assert rows and all(r["cmp_kernel"] == "cudnn_lean" for r in rows)
    assert seen and set(seen) == {"cudnn_lean"}
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cmp-kernel", "cuda", "--out", str(tmp_path)])
