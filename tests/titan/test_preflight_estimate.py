"""nsa-train --preflight on shapes too big for the device: the training step's memory and the layer
check's time and memory are estimated before anything is allocated (nsa_flex.titan.estimate); an
oversized layer check is skipped with its estimate, --preflight-full runs it with progress, and
Ctrl-C stops it. Every shipped config passes its own long-run check."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_flex.titan import estimate as est
from nsa_flex.titan.args import nsa_flex_args
from nsa_flex.titan.preflight import OK, SKIP, Checklist

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "titan_configs" / "debug_nsa.toml"


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _args(flavor="debugmodel", backend="reference"):
    a = nsa_flex_args[flavor]
    a.backend = backend
    return a


def test_block_estimate_quadratic_on_reference_linear_on_flex():
    ref, flex = _args(), _args(backend="flex")
    r1, r2 = (est.block_activation_bytes(ref, 1, T, 4) for T in (1024, 2048))
    f1, f2 = (est.block_activation_bytes(flex, 1, T, 4) for T in (1024, 2048))
    assert 3.5 < r2 / r1 <= 4.0  # dense [B, H, T, T] scores dominate
    assert f2 / f1 == pytest.approx(2.0, rel=0.05)
    # the reference backend keeps fp32 scores, probabilities and their gradient per token branch
    H, T = ref.n_heads, 2048
    assert r2 > 2 * (12 * H * T * T)
    assert est.block_flops(ref, 1, 2048) > est.block_flops(flex, 1, 2048)


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_recompute_lowers_the_estimate(backend):
    """nsa.recompute: a block keeps less (all < cmp_win < win < none), one block's backward holds the
    rebuilt branches again, and the whole step's activations shrink."""
    import dataclasses

    a = _args("125M", backend=backend)
    runs = {rc: dataclasses.replace(a, recompute=rc) for rc in ("none", "win", "cmp_win", "all")}
    kept = {rc: est.block_activation_bytes(x, 1, 4096, 2) for rc, x in runs.items()}
    again = {rc: est.block_activation_bytes(x, 1, 4096, 2, recomputed=True) for rc, x in runs.items()}
    assert kept["all"] < kept["cmp_win"] < kept["win"] < kept["none"]
    assert again["none"] == 0 < again["win"] < again["cmp_win"] < again["all"]
    acts = {rc: est.training_bytes(x, 160_000_000, 1, 4096, 2, "none", 1)["activations"]
            for rc, x in runs.items()}
    assert acts["all"] < acts["cmp_win"] < acts["win"] < acts["none"]


def test_training_bytes_parts():
    a = _args("125M", backend="flex")
    none = est.training_bytes(a, 160_000_000, 4, 8192, 2, "none", 1)
    full = est.training_bytes(a, 160_000_000, 4, 8192, 2, "full", 1)
    sharded = est.training_bytes(a, 160_000_000, 4, 8192, 2, "none", 8)
    assert none["states"] == 160_000_000 * 16 and sharded["states"] == none["states"] / 8
    assert full["activations"] < none["activations"] / 4
    assert none["logits"] == 4 * 8192 * a.vocab_size * 10
    assert none["total"] == none["states"] + none["activations"] + none["logits"]


def test_skip_by_choice_does_not_fail_the_checklist():
    cl = Checklist(out=open(os.devnull, "w"))
    cl.add(OK, "config")
    cl.add(SKIP, "NSA layer", "estimated ~900 s", blocking=False)
    assert cl.passed and "1 skipped -> PASS" in cl.summary()
    cl.add(SKIP, "dataset", "needs the tokenizer")
    assert not cl.passed


def test_oversized_config_fails_memory_and_skips_layer_in_seconds(tmp_path):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "nsa_flex.titan.cli", "--preflight", "--job.config_file",
                        str(CONFIG), "--model.flavor", "125M", "--training.seq_len", "8192",
                        "--job.dump_folder", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr[-2000:]
    mem = [l for l in out.splitlines() if l.startswith("[FAIL] memory:")]
    assert len(mem) == 1 and "per rank (states" in mem[0] and "available on cpu" in mem[0], out
    assert "lower training.local_batch_size or training.seq_len" in out
    layer = [l for l in out.splitlines() if l.startswith("[skip] NSA layer:")]
    assert len(layer) == 1 and "estimated ~" in layer[0] and "(--preflight-full runs it)" in layer[0], out
    assert "pass 1/2" not in out  # nothing was allocated
    assert time.perf_counter() - t0 < 120


def test_layer_check_progress_and_ctrl_c(tmp_path):
    # forced past its estimate: a layer check of several seconds per pass, interrupted after the first line
    cmd = [sys.executable, "-m", "nsa_flex.titan.cli", "--preflight", "--preflight-full", "--job.config_file",
           str(CONFIG), "--training.seq_len", "2048", "--training.local_batch_size", "4",
           "--job.dump_folder", str(tmp_path)]
    # Ctrl-C's default action in the child: a shell's background job (`cmd &`) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.strip().startswith("NSA layer: 1 block"):
                assert "estimated ~" in line
                p.send_signal(signal.SIGINT)
                break
        rest, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(lines) + rest
    assert p.returncode == 130, out + err[-2000:]
    assert "preflight: interrupted (Ctrl-C)" in out and "Traceback" not in err, out + err[-2000:]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "titan_configs").glob("*.toml")))
def test_shipped_configs_pass_their_long_run_check(name):
    from torchtitan.config import ConfigManager

    from nsa_flex.titan.preflight import check_long_run

    jc = ConfigManager().parse_args(["--job.config_file", str(ROOT / "titan_configs" / name)])
    cl = Checklist(out=open(os.devnull, "w"))
    check_long_run(cl, jc)
    assert cl.items[0][0] == OK, cl.items


def test_compressed_branch_on_cudnn_keeps_its_packed_copies():
    """cmp_kernel auto / cudnn: the compiled graph keeps the compressed branch's packed query and
    output besides what flex keeps (d_qk + d_v values per head and token); not when the branch is
    recomputed, nor with cudnn_lean (our op keeps no packed copies)."""
    import dataclasses

    a = _args("125M", backend="flex")
    B, T, elem = 1, 4096, 2
    kept = {(k, rc): est.block_activation_bytes(dataclasses.replace(a, cmp_kernel=k, recompute=rc),
                                                B, T, elem)
            for k in ("auto", "flex", "cudnn_lean") for rc in ("none", "cmp_win")}
    extra = B * a.n_heads * T * (a.d_qk + a.d_v) * elem
    assert kept[("auto", "none")] - kept[("flex", "none")] == extra
    assert kept[("auto", "cmp_win")] == kept[("flex", "cmp_win")]
    assert kept[("cudnn_lean", "none")] == kept[("flex", "none")]
