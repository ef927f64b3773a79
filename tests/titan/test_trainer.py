"""NSATrainer (nsa_flex/titan/trainer.py) and the torchtitan patches that remain.

* unit: the halt logic (halt file, SIGTERM, first Ctrl-C) stops the loop through
  ``should_continue_training`` and forces a full checkpoint of the halt step, never touching
  ``training.steps``; a halt file left from before the run is removed at its start; the non-finite
  guard raises before the save, naming the step and the checkpoint to resume from (the one before
  the step is set aside); the version gate;
* upstream guards: each remaining patch has a test asserting that torchtitan still lacks what the
  patch works around (it fails, and the patch can go, once upstream has it).
"""

import dataclasses
import inspect
import os
import signal
import sys
import time
import types

import pytest
import torch

from nsa_flex.titan import checkpoint as ck
from nsa_flex.titan import ops
from nsa_flex.titan.job_config import Ops
from nsa_flex.titan.trainer import NSATrainer, VersionError, check_versions


def _jc(tmp_path, steps=10, **ops_over):
    return types.SimpleNamespace(
        ops=Ops(stall_timeout_s=0.0, dump_on_sigusr1=False, halt_on_sigterm=False, **ops_over),
        job=types.SimpleNamespace(dump_folder=str(tmp_path)), training=types.SimpleNamespace(steps=steps),
        checkpoint=types.SimpleNamespace(enable=True, last_save_model_only=True, folder="checkpoint"))


class _Manager(ck.NSACheckpointManager):
    """The subclass's save logic on a manager without torchtitan's state (no DCP)."""

    def __init__(self, last_save_model_only=True):
        self.last_save_model_only = last_save_model_only
        self.saved = []


def _trainer(jc, model=None):
    """An NSATrainer with the run-control state only (torchtitan's __init__ builds a whole run)."""
    tr = NSATrainer.__new__(NSATrainer)
    tr.init_run_control(jc)
    tr.step = 0
    tr.model_parts = [model] if model is not None else []
    tr.checkpointer = _Manager()
    tr.ops = ops.OpsMonitor(jc)
    return tr


def test_halt_file_and_signals_stop_after_the_step_with_a_full_checkpoint(tmp_path, monkeypatch):
    saves = []
    monkeypatch.setattr(ck, "save_checked", lambda m, orig, step, last: saves.append(
        (step, last, m.last_save_model_only)))
    jc = _jc(tmp_path, steps=5)
    tr = _trainer(jc)
    tr.step = 1
    tr.end_of_step(1)
    assert tr.halted_at is None and tr.should_continue_training()
    (tmp_path / "HALT").write_text("")
    tr.end_of_step(5)  # the last step: nothing to cut, the file is consumed
    assert tr.halted_at is None and not (tmp_path / "HALT").exists()

    jc.training.steps = 10
    (tmp_path / "HALT").write_text("")
    tr.step = 6
    tr.end_of_step(6)
    assert tr.halted_at == 6 and tr.halt_reason == f"halt file {tmp_path / 'HALT'}"
    assert jc.training.steps == 10 and not (tmp_path / "HALT").exists()  # the config is never rewritten
    assert not tr.should_continue_training()
    tr.checkpointer.save(6, last_step=False)  # the loop's save of the halt step: full, "last step"
    tr.checkpointer.save(4, last_step=False)
    assert saves == [(6, True, False), (4, False, False)]

    for sig, step in ((signal.SIGTERM, 7), (signal.SIGINT, 8)):  # a first Ctrl-C = SIGTERM
        tr2 = _trainer(jc)
        tr2.on_signal(sig, None)
        tr2.step = step
        tr2.end_of_step(step)
        assert (tr2.halted_at, tr2.halt_reason, tr2.checkpointer.halt_step) == (step, sig.name, step)
        assert not tr2.should_continue_training() and jc.training.steps == 10


def test_halt_message_names_the_checkpoint_only_once_it_is_written(tmp_path, caplog):
    """The run's last line after a halt points to the halt step's checkpoint only where DCP
    finished it (.metadata, written last); a save that failed says so and where a rerun resumes."""
    jc = _jc(tmp_path)
    path = tmp_path / "checkpoint" / "step-6"
    for written in (False, True):
        if written:
            path.mkdir(parents=True)
            (path / ".metadata").write_bytes(b"")
        caplog.clear()
        tr = _trainer(jc)
        tr.halted_at, tr.halt_reason = 6, "SIGTERM"
        tr.stop_run_control()
        expect = (f"ops: halted after step 6 (SIGTERM); checkpoint: {path}; rerun the same command to resume"
                  if written else f"ops: halted after step 6 (SIGTERM); its checkpoint {path} was not written")
        assert expect in caplog.text, caplog.text


def test_halt_file_left_from_before_the_run_is_removed_at_its_start(tmp_path, caplog):
    jc = _jc(tmp_path)
    (tmp_path / "HALT").write_text("")
    tr = _trainer(jc)
    try:
        tr.start_run_control()
    finally:
        tr.stop_run_control()
    assert not (tmp_path / "HALT").exists()
    assert f"ops: halt file {tmp_path / 'HALT'} was left from before this run" in caplog.text
    tr.end_of_step(1)
    assert tr.halted_at is None and tr.should_continue_training()


def test_nonfinite_gradients_stop_before_the_save(tmp_path):
    """A NaN gradient after the optimizer step: a dump of that step, NonFiniteError naming the step
    and the last complete checkpoint; finite gradients pass; the guard off trains on."""
    jc = _jc(tmp_path)
    for step in (2, 4):
        (tmp_path / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").write_text("")
    (tmp_path / "checkpoint" / "step-6").mkdir()  # partial: not named as the last checkpoint
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    tr = _trainer(jc, model)
    tr.end_of_step(4)  # finite
    model.weight.grad[0, 1] = float("inf")
    with pytest.raises(ops.NonFiniteError) as e:
        tr.end_of_step(5)
    dump = tmp_path / "stalls" / "step-5-rank-0.txt"
    assert "step 5: the loss or the gradient norm is not finite" in str(e.value)
    # step 4's checkpoint holds the state whose next loss was not finite: set aside, step 2 is the
    # resume point (its next step's loss was finite)
    aside = tmp_path / "checkpoint" / "nonfinite" / "step-4"
    assert f"the checkpoint of step 4 led to it and is set aside as {aside}" in str(e.value)
    assert f"resume point: {tmp_path / 'checkpoint' / 'step-2'} (the last checkpoint" in str(e.value)
    assert (aside / ".metadata").exists() and not (tmp_path / "checkpoint" / "step-4").exists()
    assert str(dump) in str(e.value) and dump.read_text().startswith("nsa-flex ops dump: non-finite")
    jc.ops.halt_on_nonfinite = False
    tr.end_of_step(6)
    assert tr.halted_at is None


def test_version_gate():
    check_versions()  # the installed versions are the supported ones
    with pytest.raises(VersionError, match=r"torchtitan 0\.3\.0 is installed, nsa_flex.titan needs torchtitan==0\.2\.2"):
        check_versions(titan_version="0.3.0")
    with pytest.raises(VersionError, match=r"torch 2\.15\.0 is installed, nsa_flex.titan needs torch>=2\.11,<2\.15"):
        check_versions(torch_version="2.15.0")
    with pytest.raises(VersionError, match=r"torch 2\.10\.1\+cu126"):
        check_versions(torch_version="2.10.1+cu126")


# ----------------------------------------------------------------------------- upstream guards
def test_upstream_builds_the_checkpoint_manager_inline():
    """checkpoint.adopt: torchtitan's Trainer builds CheckpointManager itself, with no TrainSpec or
    Trainer hook for another class. When a hook appears, build NSACheckpointManager through it."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.protocols.train_spec import TrainSpec
    from torchtitan.train import Trainer

    assert "CheckpointManager(" in inspect.getsource(Trainer.__init__)
    assert not [f.name for f in dataclasses.fields(TrainSpec) if "checkpoint" in f.name]
    assert not [n for n in dir(Trainer) if "checkpoint" in n and callable(getattr(Trainer, n))]
    m = CheckpointManager.__new__(CheckpointManager)
    assert isinstance(ck.adopt(m), ck.NSACheckpointManager) and type(m) is ck.NSACheckpointManager


def test_upstream_main_takes_no_arguments():
    """train.titan_parses: torchtitan's main(trainer_class) has no argv parameter and parse_args'
    default is sys.argv[1:] bound at import time (pytorch/torchtitan PR 3725 reads it at call time)."""
    from torchtitan.config import ConfigManager
    from torchtitan.train import main

    from nsa_flex.titan.train import titan_parses

    assert list(inspect.signature(main).parameters) == ["trainer_class"]
    assert "config_manager.parse_args()" in inspect.getsource(main)
    default = inspect.signature(ConfigManager.parse_args).parameters["args"].default
    assert isinstance(default, list)
    with titan_parses(["--x"]):
        assert ConfigManager.parse_args.__defaults__ == (["--x"],)
    assert ConfigManager.parse_args.__defaults__ == (default,)


def test_upstream_validator_reads_only_its_dataset_table():
    """validate.NSAValidator sets Validator.__init__'s state itself: torchtitan's Validator builds
    its loader with build_text_validation_dataloader, unexposed to the TrainSpec (pytorch/torchtitan
    PR 1362). The state must stay the same set of attributes (plus our retrieval documents and
    recall count)."""
    import re

    from torchtitan.components.validate import Validator

    from nsa_flex.titan.validate import NSAValidator

    upstream = inspect.getsource(Validator.__init__)
    ours = inspect.getsource(NSAValidator.__init__)
    assert "build_text_validation_dataloader(" in upstream
    attrs = lambda src: set(re.findall(r"self\.(\w+) =", src))  # noqa: E731
    assert attrs(upstream) | {"retrieval_docs", "recall_docs"} == attrs(ours)


def test_upstream_validate_shards_its_own_way():
    """validate.NSAValidator.validate replaces torchtitan's loop: under context parallelism
    upstream's builds its ring-attention context (zig-zag shards, the model's freqs_cis) and
    divides each rank's loss by the token count of its own shard, not the whole batch's."""
    from torchtitan.components.validate import Validator

    src = inspect.getsource(Validator.validate)
    assert "create_context_parallel_ctx(" in src
    assert src.index("self.post_dataloading_process(") < src.index("local_valid_tokens += (labels")
    assert "prepare_context_parallel_input(" in inspect.getsource(Validator.post_dataloading_process)


def test_upstream_model_log_line_and_no_cudagraphs_by_default():
    """console.ConsoleFilter rewrites torchtitan's "Building <model> <flavor>with {json}" line;
    parallelize.check_no_cudagraphs relies on inductor's cudagraphs being off by default and
    llama3's apply_compile passing no mode."""
    import torch._inductor.config as inductor_config
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.train import Trainer

    from nsa_flex.titan.parallelize import CompileConfigError, check_no_cudagraphs

    src = inspect.getsource(Trainer.__init__)
    assert 'f"Building {job_config.model.name} {job_config.model.flavor}"' in src
    assert "json.dumps(dataclasses.asdict(model_args)" in src
    assert "mode=" not in inspect.getsource(apply_compile)
    check_no_cudagraphs("inductor")
    with pytest.raises(CompileConfigError, match="compile.backend='cudagraphs'"):
        check_no_cudagraphs("cudagraphs")
    saved = inductor_config.triton.cudagraphs
    inductor_config.triton.cudagraphs = True
    try:
        with pytest.raises(CompileConfigError, match="triton.cudagraphs is on"):
            check_no_cudagraphs("inductor")
    finally:
        inductor_config.triton.cudagraphs = saved


def _keep_handlers(*sigs):
    return {s: signal.getsignal(s) for s in sigs}


def _restore(saved):
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_repeated_sigterm_is_the_same_request_and_a_second_ctrl_c_stops_at_once(tmp_path, monkeypatch):
    """`timeout` and schedulers signal the trainer and then its process group: no later SIGTERM,
    however late, may take a "stop at once" path, which ends the run without its halt checkpoint.
    Ctrl-C twice still stops at once; the halt's console line lists the signals."""
    from nsa_flex.titan import trainer as trainer_mod
    saved = _keep_handlers(signal.SIGTERM, signal.SIGCHLD)
    kills, now = [], [100.0]
    monkeypatch.setattr(trainer_mod.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr(trainer_mod.time, "monotonic", lambda: now[0])
    try:
        tr = _trainer(_jc(tmp_path))
        tr.on_signal(signal.SIGTERM, None)
        now[0] += 0.01
        tr.on_signal(signal.SIGTERM, None)  # the group-wide copy
        now[0] += 30.0
        tr.on_signal(signal.SIGTERM, None)  # late, during the halt's save: still the same request
        assert kills == [] and tr.halt_requested == "SIGTERM"
        assert [n for n, _ in tr._signals] == ["SIGTERM"] * 3
        tr2 = _trainer(_jc(tmp_path))
        tr2.on_signal(signal.SIGINT, None)
        now[0] += 0.05
        tr2.on_signal(signal.SIGINT, None)  # Ctrl-C again, however soon: stop at once
        assert kills == [signal.SIGINT]
    finally:
        _restore(saved)


def test_a_child_exit_pending_with_the_stop_signal_raises_nothing(tmp_path, monkeypatch):
    """SIGCHLD (a compile worker ended by the group's SIGTERM) pending when the stop signal's
    handler runs: CPython runs the handlers in signal order (SIGTERM 15 first); one that set SIGCHLD
    to SIG_DFL made the pending SIGCHLD raise OSError ("Signal 17 ignored due to race condition")
    wherever the main thread was (CPython reports it as unraisable, a traceback on stderr, and goes on)."""
    saved = _keep_handlers(signal.SIGTERM, signal.SIGCHLD)
    children, unraisable = [], []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    try:
        signal.signal(signal.SIGCHLD, lambda s, f: children.append(s))  # as torch's loader installs
        tr = _trainer(_jc(tmp_path))
        signal.signal(signal.SIGTERM, tr.on_signal)
        both = {signal.SIGTERM, signal.SIGCHLD}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        try:
            os.kill(os.getpid(), signal.SIGCHLD)
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # the handlers run here
        for _ in range(3):  # let CPython's pending-signal check run
            time.sleep(0.01)
        assert tr.halt_requested == "SIGTERM"
        assert unraisable == []
    finally:
        _restore(saved)


def test_one_process_skips_torchtitans_closing_wait(monkeypatch):
    """torchtitan's loop ends with rank 0 sleeping 2 s "for other ranks to complete": skipped in a
    run of one process (every CPU test run and single-GPU run saved 2 s), kept with several, and
    torchtitan.train's ``time`` is the time module again afterwards. Upstream guard: the closing
    wait is still torchtitan.train's only sleep (else the no-op would skip another one)."""
    import torchtitan.train as titan_train
    from torchtitan.train import Trainer

    source = inspect.getsource(titan_train)
    assert source.count("time.sleep(") == 1 and 'Sleeping 2 seconds for other ranks' in source
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)

    def loop(self):  # torchtitan's loop, reduced to its last line and a timer read
        titan_train.time.perf_counter()
        titan_train.time.sleep(2)

    monkeypatch.setattr(Trainer, "train", loop)
    trainer = object.__new__(NSATrainer)
    trainer.world = 1
    trainer.train()
    assert slept == [] and titan_train.time is time
    trainer.world = 2
    trainer.train()
    assert slept == [2]
