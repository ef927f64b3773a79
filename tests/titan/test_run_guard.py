"""Run robustness, in process: the dump-folder lock, writable folders, the checkpoint config record
and resume check, the lr schedule rebuilt on resume, a full disk during a save, partial folders,
the free-space check, the non-finite model check before a save."""

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from nsa_flex.titan import checkpoint as ck
from nsa_flex.titan import run_record
from nsa_flex.titan.ops import NonFiniteError
from nsa_flex.titan.runlock import LOCK_NAME, DumpLock, FolderNotWritable, RunLockError, check_writable
from tests.titan.helpers import fill, tmpfs


# ----------------------------------------------------------------------------- lock
def _write_lock(folder, pid, host=None):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK_NAME), "w") as f:
        json.dump({"pid": pid, "host": host or socket.gethostname(), "started": time.time() - 60}, f)


def test_lock_held_then_released(tmp_path):
    lock = DumpLock(str(tmp_path)).acquire()
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert abs(holder["started"] - time.time()) < 60
    DumpLock(str(tmp_path)).acquire()  # the same process again: no error
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def _holder(folder, ready):
    """A real second process holding the run lock of ``folder`` (it prints once it holds it)."""
    code = ("import sys, time; from nsa_flex.titan.runlock import DumpLock; DumpLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == ready
    return p


def test_live_holder_refuses_a_second_run(tmp_path):
    other = _holder(tmp_path, "held")
    try:
        with pytest.raises(RunLockError) as e:
            DumpLock(str(tmp_path)).acquire()
        msg = str(e.value)
        assert str(tmp_path) in msg and f"pid {other.pid} on host {socket.gethostname()}" in msg
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == other.pid  # untouched
    finally:
        other.kill()
        other.wait()
    DumpLock(str(tmp_path)).acquire().release()  # killed (SIGKILL): its lock went with it


def test_lock_of_a_reused_pid_or_an_empty_file_is_taken_over(tmp_path):
    """A lock file naming a live process that does not hold it (its pid reused), or an empty one
    (a run that could not write it), strands nothing: the next run takes it over."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, other.pid)  # a live pid, no lock held
        lock = DumpLock(str(tmp_path)).acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        other.kill()
        other.wait()
    (tmp_path / LOCK_NAME).write_text("")
    lock = DumpLock(str(tmp_path)).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_stale_lock_taken_over_other_host_refused(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, dead.pid)
    lock = DumpLock(str(tmp_path)).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    _write_lock(tmp_path, dead.pid, host="some-other-host")  # liveness unknown there: refused
    with pytest.raises(RunLockError, match="some-other-host"):
        DumpLock(str(tmp_path)).acquire()


# ----------------------------------------------------------------------------- writable
def _jc(dump, enable=True):
    return SimpleNamespace(job=SimpleNamespace(dump_folder=str(dump)),
                           checkpoint=SimpleNamespace(enable=enable, folder="checkpoint"))


def test_unwritable_folders_named(tmp_path):
    check_writable(_jc(tmp_path / "new"))  # the dump folder is created, the checkpoint folder not:
    # torchtitan loads checkpoint.initial_load_path only while the checkpoint folder is missing
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "checkpoint").exists()
    from nsa_flex.titan.runlock import existing_folder

    assert existing_folder(str(tmp_path / "new" / "checkpoint" / "step-1")) == str(tmp_path / "new")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FolderNotWritable, match=f"job.dump_folder {blocker}/run is not writable"):
        check_writable(_jc(blocker / "run"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "checkpoint").write_text("x")
    with pytest.raises(FolderNotWritable, match="checkpoint.folder .*d/checkpoint is not writable"):
        check_writable(_jc(tmp_path / "d"))
    check_writable(_jc(tmp_path / "d", enable=False))  # checkpointing off: not checked


# ----------------------------------------------------------------------------- config record
def _job(**over):
    from nsa_flex.titan.train import merged_job_config as _merged_job_config

    jc = _merged_job_config()()
    for key, v in over.items():
        sec, name = key.split("__")
        setattr(getattr(jc, sec), name, v)
    return jc


def test_config_record_compare():
    old = run_record.record(_job())
    assert old["model.flavor"] == "debugmodel" and "nsa.window" in old and "optimizer.lr" in old
    json.dumps(old)
    new = run_record.record(_job(nsa__window=64, model__flavor="x", optimizer__lr=0.1, training__steps=99,
                                 nsa__telemetry_every=5, training__dataset="local",
                                 nsa__recompute="cmp_win", nsa__sel_kernel="flex", nsa__sel_distill=0.5,
                                 nsa__sel_dense_steps=100))
    refused, applied = run_record.compare(old, new)
    assert refused == ["model.flavor 'debugmodel' -> 'x'", "nsa.window None -> 64",
                       "training.dataset 'passkey' -> 'local'"]
    # how the same function is computed may change on resume (recompute after an out-of-memory), and
    # training-only settings (the selection distillation and dense warm-up)
    assert [a.split()[0] for a in applied] == ["nsa.recompute", "nsa.sel_dense_steps", "nsa.sel_distill",
                                               "nsa.sel_kernel", "nsa.telemetry_every",
                                               "optimizer.lr", "training.steps"]
    assert run_record.compare(old, old) == ([], [])
    # a record from before a field existed: its default is no change, another value is
    default = run_record.defaults(_job())
    assert default["training.passkey_min_gap"] == 0 and default["nsa.window"] is None
    older = {k: v for k, v in old.items() if k != "training.passkey_min_gap"}
    assert run_record.compare(older, old, default) == ([], [])
    assert run_record.compare(older, old) == (["training.passkey_min_gap '<absent>' -> 0"], [])
    gapped = run_record.record(_job(training__passkey_min_gap=512))
    assert run_record.compare(older, gapped, default) == (["training.passkey_min_gap '<absent>' -> 512"], [])


class _Manager:
    """The parts of torchtitan's CheckpointManager the wrappers use."""

    def __init__(self, folder, job_config=None, params=None):
        self.folder, self.enable, self.load_only = str(folder), True, False
        model = torch.nn.Linear(4, 4)
        if params is not None:
            with torch.no_grad():
                model.weight.fill_(params)
        self.states = {"model": SimpleNamespace(model=[model]), "train_state": SimpleNamespace(job_config=job_config)}
        self.purged = 0

    def _should_save(self, step, last_step=False):
        return True

    def _purge_stale_checkpoints(self):
        self.purged += 1


def _fake_ckpt(folder, step, complete=True):
    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    if complete:
        (d / ".metadata").write_bytes(b"m")
    return d


def test_resume_refuses_model_change_and_allows_with_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "check_dcp_folder", lambda path: None)
    d = _fake_ckpt(tmp_path, 4)
    run_record.write(str(d), _job())
    loads = []
    m = _Manager(tmp_path, _job(nsa__n_sel=8, model__tokenizer="gpt2"))
    with pytest.raises(ck.ConfigChangeError) as e:
        ck.load_checked(m, lambda man, s: loads.append(s) or True)
    assert str(d) in str(e.value)
    assert "model.tokenizer 'byte' -> 'gpt2'" in str(e.value) and "nsa.n_sel None -> 8" in str(e.value)
    assert loads == []  # nothing loaded
    m.states["train_state"].job_config.checkpoint.allow_config_change = True
    assert ck.load_checked(m, lambda man, s: loads.append(s) or True) and loads == [4]


def test_schedule_rebuilt_from_new_config():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=3e-4)

    def lam(step):  # warmup 2 steps, then linear decay to 0 at step 20
        return (step + 1) / 2 if step < 2 else max(0.0, (20 - step) / 18)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    for _ in range(10):
        opt.step()
        sched.step()
    assert run_record.rebuild_schedule([sched], SimpleNamespace(lr=3e-4, weight_decay=None, eps=None)) == []
    changed = run_record.rebuild_schedule([sched], SimpleNamespace(lr=0.1, weight_decay=0.5, eps=None))
    assert changed == [(3e-4 * lam(10), 0.1 * lam(10))]
    g = opt.param_groups[0]
    assert g["lr"] == 0.1 * lam(10) and g["initial_lr"] == 0.1 and g["weight_decay"] == 0.5
    sched.step()
    assert g["lr"] == 0.1 * lam(11)  # the new schedule goes on, no jump back


# ----------------------------------------------------------------------------- save / disk
def _dcp_exception(error):
    """DCP's wrapper of a rank's write error, as torch.distributed.checkpoint.save raises it."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise error
    except OSError as e:
        return CheckpointException("CheckpointException ranks:dict_keys([0])", {0: _wrap_exception(e)})


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("unexpected pos 704 vs 598"),
                                   _dcp_exception(OSError(errno.ENOSPC, "No space left on device"))],
                         ids=["ENOSPC", "unexpected-pos", "CheckpointException"])
def test_disk_full_during_save(tmp_path, error):
    prev = _fake_ckpt(tmp_path, 2)
    before = sorted(p.name for p in prev.iterdir())

    def writer(man, step, last):  # a DCP save cut short: data file written, no .metadata
        _fake_ckpt(tmp_path, step, complete=False)
        raise error

    with pytest.raises(ck.DiskSpaceError) as e:
        ck.save_checked(_Manager(tmp_path, _job()), writer, 4)
    msg = str(e.value)
    assert f"checkpoint folder {tmp_path}: the disk is full (" in msg and "GiB free) while saving step 4" in msg
    assert not (tmp_path / "step-4").exists()
    assert sorted(p.name for p in prev.iterdir()) == before  # the previous checkpoint is intact


def test_save_records_config_purges_after_last_step_and_refuses_nan(tmp_path):
    m = _Manager(tmp_path, _job(optimizer__lr=0.25))
    ck.save_checked(m, lambda man, step, last: _fake_ckpt(tmp_path, step), 4, last_step=True)
    assert run_record.read(str(tmp_path / "step-4"))["optimizer.lr"] == 0.25
    assert m.purged == 1
    ck.save_checked(m, lambda man, step, last: _fake_ckpt(tmp_path, step), 6)
    assert m.purged == 1  # torchtitan purges after interval saves itself
    called = []
    with pytest.raises(NonFiniteError, match="step 8: the model holds non-finite weights"):
        ck.save_checked(_Manager(tmp_path, _job(), params=float("nan")), lambda *a: called.append(a), 8)
    assert called == [] and not (tmp_path / "step-8").exists()


def test_partial_folder_removed_at_start_and_free_space_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "check_dcp_folder", lambda path: None)
    _fake_ckpt(tmp_path, 2)
    _fake_ckpt(tmp_path, 4, complete=False)
    loads = []
    assert ck.load_checked(_Manager(tmp_path, _job()), lambda man, s: loads.append(s) or True)
    assert loads == [2] and not (tmp_path / "step-4").exists() and (tmp_path / "step-2").exists()

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: SimpleNamespace(free=50))
    with pytest.raises(ck.DiskSpaceError, match=f"checkpoint folder {tmp_path}: 0.00 GiB free"):
        ck.load_checked(_Manager(tmp_path, _job()), lambda man, s: True)
    empty = tmp_path / "empty"
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: SimpleNamespace(free=3 * 20 * 4 - 1))
    with pytest.raises(ck.DiskSpaceError):  # no checkpoint yet: model + 2 AdamW moments (Linear 4x4 + 4)
        ck.check_free_space(_Manager(empty, _job()))
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: SimpleNamespace(free=3 * 20 * 4))
    ck.check_free_space(_Manager(empty, _job()))


def test_disk_full_at_start_is_one_message_and_leaves_no_lock(tmp_path):
    """A real full disk (a tmpfs filled to the last byte): the writable check and the lock say so
    as one FolderNotWritable; no empty lock file strands the folder, the next run takes it."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        fill(disk)
        with pytest.raises(FolderNotWritable, match="No space left on device"):
            check_writable(_jc(disk, enable=False))
        with pytest.raises(FolderNotWritable, match=f"cannot write the run lock {disk / LOCK_NAME} "
                                                    r"\(No space left on device\): the disk is full"):
            DumpLock(str(disk)).acquire()
        assert sorted(os.listdir(disk)) == ["filler"]
        (disk / "filler").unlink()
        DumpLock(str(disk)).acquire().release()


def test_checkpoint_past_training_steps_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "check_dcp_folder", lambda path: None)
    _fake_ckpt(tmp_path, 6)
    loads = []
    with pytest.raises(ck.CheckpointError, match=rf"checkpoint {tmp_path}/step-6 is at step 6, past "
                                                 r"--training.steps=4: pass --training.steps above 6"):
        ck.load_checked(_Manager(tmp_path, _job(training__steps=4)), lambda man, s: loads.append(s) or True)
    assert loads == []
    assert ck.load_checked(_Manager(tmp_path, _job(training__steps=6)), lambda man, s: loads.append(s) or True)


# ----------------------------------------------------------------------------- checksums
def _dcp_ckpt(folder, step, value):
    """A real DCP checkpoint (one tensor) with its checksums, as a save writes them."""
    import torch.distributed.checkpoint as dcp

    path = folder / f"step-{step}"
    dcp.save({"w": torch.full((64, 64), float(value))}, checkpoint_id=str(path))
    ck.write_checksums(str(path))
    return path


def _flip_bytes_inside_the_tensor(path):
    """A same-size corruption inside the stored tensor's bytes (found from the DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    info = next(iter(FileSystemReader(str(path)).read_metadata().storage_data.values()))
    f = path / info.relative_path
    data = bytearray(f.read_bytes())
    size = len(data)
    data[info.offset + info.length // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert f.stat().st_size == size
    return f


def test_same_size_corruption_is_caught_by_the_checksum_and_the_previous_step_loaded(tmp_path, caplog):
    import torch.distributed.checkpoint as dcp

    _dcp_ckpt(tmp_path, 2, 2.0)
    bad = _dcp_ckpt(tmp_path, 4, 4.0)
    _flip_bytes_inside_the_tensor(bad)
    state = {"w": torch.zeros(64, 64)}
    dcp.load(state, checkpoint_id=str(bad))  # DCP itself loads the changed bytes without a word
    assert not torch.equal(state["w"], torch.full((64, 64), 4.0))
    why = ck.check_dcp_folder(str(bad))
    assert why and "does not match its SHA-256 recorded at save" in why and "__0_0.distcp" in why
    loads = []
    assert ck.load_checked(_Manager(tmp_path, _job()), lambda man, s: loads.append(s) or True)
    assert loads == [2] and (tmp_path / "damaged" / "step-4").is_dir() and not bad.exists()
    assert f"Resuming from the newest healthy checkpoint {tmp_path / 'step-2'} (1 newer one(s) damaged" \
        in caplog.text
    with pytest.raises(ck.CheckpointError, match="load_step=2: .* is damaged: data file .* does not match"):
        _flip_bytes_inside_the_tensor(tmp_path / "step-2")
        ck.load_checked(_Manager(tmp_path, _job()), lambda man, s: True, 2)


# ----------------------------------------------------------------------------- purge
def test_old_checkpoint_that_cannot_be_removed_is_said(tmp_path, caplog):
    """A real removal failure (the checkpoint folder's filesystem turned read-only): a warning saying
    so, never "deleted"."""
    caplog.set_level(logging.INFO)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        for step in (1, 2, 3):
            _fake_ckpt(disk, step)
        _fake_ckpt(disk, 4, complete=False)
        r = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip()}")
        assert ck.remove_partial(str(disk)) == []
        assert ck.purge(str(disk), keep=3) == []
        assert sorted(os.listdir(disk)) == ["step-1", "step-2", "step-3", "step-4"]
        assert f"Could not remove the partial checkpoint {disk / 'step-4'} (Read-only file system" in caplog.text
        assert f"Could not delete the old checkpoint {disk / 'step-1'} (Read-only file system" in caplog.text
        assert "Deleted" not in caplog.text and "Removed" not in caplog.text
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        assert ck.purge(str(disk), keep=3) == [str(disk / "step-1")]
        assert f"Deleted the old checkpoint {disk / 'step-1'}" in caplog.text


# ----------------------------------------------------------------------------- checkpoint folder lock
def test_a_checkpoint_folder_is_locked_across_dump_folders(tmp_path):
    """Two runs with different dump folders and one absolute --checkpoint.folder: a real second
    process holds the first run's locks, the second run is refused naming the checkpoint folder."""
    shared = tmp_path / "shared_ckpt"
    code = ("import sys, time, types; from nsa_flex.titan.runlock import lock_run; "
            "n = types.SimpleNamespace; lock_run(n(job=n(dump_folder=sys.argv[1]), "
            "checkpoint=n(enable=True, folder=sys.argv[2]))); print('held', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "a"), str(shared)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        from nsa_flex.titan.runlock import lock_run

        jc = SimpleNamespace(job=SimpleNamespace(dump_folder=str(tmp_path / "b")),
                             checkpoint=SimpleNamespace(enable=True, folder=str(shared)))
        with pytest.raises(RunLockError, match=f"checkpoint folder {shared} is in use by another run "
                                               rf"\(pid {other.pid} .*Use another --checkpoint.folder"):
            lock_run(jc)
        assert not (tmp_path / "b" / LOCK_NAME).exists()  # the dump folder's lock is given back
        assert not shared.exists()  # not created: torchtitan's initial_load_path needs it missing
    finally:
        other.kill()
        other.wait()


def test_initial_load_with_more_model_keys_is_refused(tmp_path):
    """checkpoint.initial_load_path (the curriculum's long phase) holding parameters the model lacks
    under its own modules (a run with other [nsa] settings): refused before DCP would load the
    common weights alone; optimizer entries beside the model's keys and a matching checkpoint load."""
    import torch.distributed.checkpoint as dcp

    def manager(init):
        m = _Manager(tmp_path / "new" / "checkpoint")
        m.states["model"] = SimpleNamespace(model=[torch.nn.Sequential(torch.nn.Linear(4, 4))])
        m.initial_load_path = str(init)
        return m

    sd = dict(torch.nn.Sequential(torch.nn.Linear(4, 4)).state_dict())
    dcp.save({**sd, "0.phi.pos": torch.zeros(2)}, checkpoint_id=str(tmp_path / "more"))
    loads = []
    with pytest.raises(ck.CheckpointError, match=r"initial_load_path=.*more.* holds model keys this model lacks \(0\.phi\.pos\)"):
        ck.load_checked(manager(tmp_path / "more"), lambda man, s: loads.append(s) or True)
    assert loads == []
    dcp.save({**sd, "optimizer.state.0": torch.zeros(2)}, checkpoint_id=str(tmp_path / "same"))
    assert ck.load_checked(manager(tmp_path / "same"), lambda man, s: loads.append(s) or True) and loads == [-1]
    assert ck.extra_model_keys({"layers.0.w", "norm.w"}, {"layers.0.w", "layers.0.phi", "optimizer.x", "norm.w"}) \
        == ["layers.0.phi"]
