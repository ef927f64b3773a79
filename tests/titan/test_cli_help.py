"""``nsa-train --help`` and argument errors are answered before torch is imported (in well under a
second on an idle machine; the bounds below are generous for a loaded 2-core box), and lead with
this project's options; ``python -m nsa_flex.eval`` without ``--out`` fails the same way."""

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.titan.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _in_fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)


PROBE = """
import sys
from nsa_flex.titan import cli
try:
    cli.main({argv!r})
except SystemExit as e:
    print("exit", e.code)
print("torch imported:", "torch" in sys.modules)
"""


def test_help_without_torch_and_fast():
    t0 = time.perf_counter()
    r = _in_fresh_python(PROBE.format(argv=["--help"]))
    elapsed = time.perf_counter() - t0
    assert r.stdout.rstrip().endswith("exit 0\ntorch imported: False"), r.stdout[-500:] + r.stderr
    assert elapsed < 3 * 3, f"--help took {elapsed:.1f} s"  # ~0.3 s idle; 3x headroom for a loaded box
    out = r.stdout
    assert out.startswith("usage: nsa-train")
    for flag in ("--preflight", "--preflight-full", "--job.config_file", "--help-all", "--nsa.builder_modules",
                 "--nsa.win_mask", "--nsa.telemetry_every", "--ops.halt_file", "--ops.long_run_steps"):
        assert flag in out, flag
    assert out.index("--preflight") < out.index("[nsa]") < out.index("[ops]")


def test_help_lists_every_nsa_and_ops_field():
    from nsa_flex.titan import job_config
    from nsa_flex.titan.usage import usage

    text = usage()
    for cls, prefix in ((job_config.NSA, "nsa"), (job_config.Ops, "ops")):
        for f in dataclasses.fields(cls):
            assert f"--{prefix}.{f.name} " in text or f"--{prefix}.{f.name}\n" in text, f.name


def test_help_lists_every_dataset():
    from nsa_flex.data.sources import DATASET_CHOICES
    from nsa_flex.titan.usage import usage

    assert f"dataset\n({' | '.join(DATASET_CHOICES)})" in usage()


def test_flavors_read_without_torch_are_the_table():
    from nsa_flex.titan.args import nsa_flex_args
    from nsa_flex.titan.usage import flavor_names

    assert flavor_names() == list(nsa_flex_args)


def test_argument_errors_without_torch():
    for argv, msg in ((["foo"], "unexpected argument 'foo'"),
                      (["--trainingsteps", "3"], "unknown option '--trainingsteps'"),
                      (["--job.config_file", "no/such.toml"], "'no/such.toml' does not exist"),
                      (["--preflight-full"], "--preflight-full is an option of --preflight"),
                      (["--model.flavor", "7B"], "[model] flavor='7B': unknown nsa_flex flavor; allowed values are "
                                                 "['125M', '1B', '30M', '30M_kv4', '350M', 'debugmodel']")):
        r = _in_fresh_python(PROBE.format(argv=argv))
        assert r.stdout.rstrip().endswith("exit 2\ntorch imported: False"), (argv, r.stdout, r.stderr)
        assert r.stderr.strip() == f"nsa-train: error: {r.stderr.strip().split('error: ', 1)[1]}"
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_busy_dump_folder_refused_without_torch(tmp_path):
    from nsa_flex.titan.runlock import lock_dump_folder

    held = tmp_path / "run"
    held.mkdir()
    lock = lock_dump_folder(str(held))  # held by a live process on this host: this test's (a kernel lock)
    try:
        toml = tmp_path / "run.toml"
        toml.write_text(f'[job]\ndump_folder = "{held}"\n')
        for argv in (["--job.dump_folder", str(held)], ["--job.config_file", str(toml)]):
            r = _in_fresh_python(PROBE.format(argv=argv))
            assert r.stdout.rstrip().endswith("exit 2\ntorch imported: False"), (argv, r.stdout, r.stderr)
            assert r.stderr.startswith(f"nsa-train: error: dump folder {held} is in use by another run "
                                       f"(pid {os.getpid()}")
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        lock.release()


def test_negative_values_pass_the_flag_check():
    from nsa_flex.titan.flags import check_flags

    check_flags(["--training.steps", "-1", "--optimizer.lr=-3e-4", "--nsa.builder_modules", "a", "b",
                 "--checkpoint.enable", "--job.config-file", "x.toml", "--preflight"])


def test_eval_without_out_fails_fast():
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "import runpy, sys\nsys.argv = ['x', '--quick']\n"
                        "try:\n    runpy.run_module('nsa_flex.eval', run_name='__main__')\n"
                        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - t0 < 9
    assert r.stdout.strip() == "exit 2 False" and "--out is required" in r.stderr, (r.stdout, r.stderr)


def _torchrun2(tmp_path, *extra):
    env = {k: v for k, v in ENV.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    port = free_port()  # torchrun's --master_port=0 hangs the rendezvous
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                           "-m", "nsa_flex.titan.cli", "--training.steps", "2", "--training.local_batch_size", "2",
                           "--job.dump_folder", str(tmp_path), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a 2-process training run
def test_default_fsdp_on_cpu_processes_runs_ddp_with_one_warning(tmp_path):
    """torchrun --nproc_per_node=2 on the CPU with the default (FSDP over every rank): DDP instead,
    one warning line from rank 0; no gloo PREMUL_SUM error."""
    r = _torchrun2(tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    warnings = [l for l in out.splitlines() if l.startswith("nsa-train: warning:")]
    assert len(warnings) == 1 and "DDP instead of the default FSDP" in warnings[0], out[-3000:]
    assert "Applied DDP to the model" in out and "PREMUL_SUM" not in out.replace(warnings[0], "")
    assert (tmp_path / "metrics.jsonl").read_text().count('"step": 2') == 1


def test_explicit_fsdp_on_cpu_processes_is_one_error_line(tmp_path):
    r = _torchrun2(tmp_path, "--parallelism.data_parallel_shard_degree", "2")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    errors = [l for l in out.splitlines() if l.startswith("nsa-train: error:")]
    assert len(errors) == 1, out[-3000:]
    assert ("2 processes without CUDA (gloo) cannot use FSDP" in errors[0]
            and "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"
            in errors[0]), errors
    assert "PREMUL_SUM with Gloo" not in out and not (tmp_path / "metrics.jsonl").exists()


def test_cpu_data_parallel_rule():
    from types import SimpleNamespace as NS

    from nsa_flex.titan.parallelize import cpu_data_parallel_problem

    assert cpu_data_parallel_problem(NS(data_parallel_shard_degree=-1), 1, cuda=False) is None
    assert cpu_data_parallel_problem(NS(data_parallel_shard_degree=-1), 4, cuda=True) is None
    assert cpu_data_parallel_problem(NS(data_parallel_shard_degree=1), 4, cuda=False) is None
    assert "replicate_degree 4" in cpu_data_parallel_problem(NS(data_parallel_shard_degree=-1), 4, cuda=False)
