"""``nsa-train --preflight --job.config_file X.toml [overrides]``: check a launch in seconds.

Parses the config exactly as the run would (same TOML, same overrides), then prints a checklist and
exits 0 only when every item passes:

  config       every problem of the config at once (unknown flavor, [nsa] rules, [ops] fields,
               dataset / dtype / parallelism / schedule settings), each naming the field
  tokenizer    loads without network (HF_HUB_OFFLINE=1; tiktoken from TIKTOKEN_CACHE_DIR)
  dataset      opens and yields one batch of [local_batch_size, seq_len] token ids < vocab size
  dump folder  writable (and its stalls/ folder); no leftover halt file
  checkpoint   which checkpoint a run would resume from (full or model-only), or a fresh start
  long run     runs of >= [ops] long_run_steps steps save checkpoints at an interval below steps
  device       CUDA devices (or the CPU shim) and the configured dtypes supported there
  memory       the training step's estimated memory per rank (parameter, gradient and AdamW states,
               activations, logits; :mod:`nsa_flex.titan.estimate`) against the memory available
               on the device: fails before anything is allocated when it does not fit
  NSA layer    one forward+backward of one decoder block (NSA attention + SwiGLU) at the
               configured [local_batch_size, seq_len, dim], compiled when [compile] covers the
               model: first-call seconds (compile + run), steady seconds, peak memory. Its time
               and memory are estimated first: over LAYER_CHECK_S seconds or the free memory, it
               is skipped with the estimate (this does not fail the preflight; ``--preflight-full``
               runs it anyway). Progress is printed per pass; Ctrl-C stops the preflight.

Checks that depend on a failed one are reported as skipped (and the preflight fails).
"""

import os
import re
import resource
import sys
import tempfile
import threading
import time
import traceback

import torch

from nsa_flex import telemetry as tm
from nsa_flex.config import NSAConfig, NSAConfigError
from nsa_flex.data.errors import DatasetError
from nsa_flex.data.passkey import check_keys, check_min_gap, check_min_gap_share, check_questions

from . import console
from . import estimate as est
from . import ops
from .args import apply_nsa_section, nsa_flex_args, parallelism_problems
from .data import DATASET_CHOICES, build_dataloader, passkey_mix_of
from .model import NSATransformer, NSATransformerBlock
from .ops import STALLS_DIR
from .parallelize import cpu_data_parallel_problem
from .tokenizer import build_tokenizer

OK, FAIL, SKIP = "ok", "FAIL", "skip"
LAYER_CHECK_S = 60.0  # the layer check runs when its estimate is below this (and fits in memory)
PASS_OVERHEAD_S = 0.5  # per forward+backward pass: mask building, Python, allocator (tiny shapes)
MEMORY_SHARE = 0.9  # share of the available memory a training step may be estimated to use
DTYPES = ("float32", "bfloat16", "float16")
AC_MODES = ("none", "full", "selective", "memory_budget")


class Checklist:
    def __init__(self, out=None):
        self.items: list[tuple[str, str, str, list[str]]] = []
        self.out = out or sys.stdout

    def add(self, status: str, name: str, detail: str = "", problems: list[str] | None = None,
            blocking: bool = True) -> None:
        """``blocking=False``: a skip that does not fail the preflight (a check left out by choice)."""
        self.items.append((status, name, detail, list(problems or []), blocking))
        print(f"[{status:^4}] {name}: {detail}", file=self.out, flush=True)
        for p in problems or []:
            print(f"         - {p}", file=self.out, flush=True)

    @property
    def passed(self) -> bool:
        return all(s == OK or not blocking for s, _, _, _, blocking in self.items)

    def summary(self) -> str:
        n = {s: sum(1 for x in self.items if x[0] == s) for s in (OK, FAIL, SKIP)}
        return f"preflight: {n[OK]} passed, {n[FAIL]} failed, {n[SKIP]} skipped -> {'PASS' if self.passed else 'FAIL'}"


def _timed(fn, timeout_s: float):
    """fn() in a daemon thread; raises TimeoutError when it does not return in time (a hung network
    read must not hang the preflight)."""
    box: dict = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "e" in box:
        raise box["e"]
    return box["v"]


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- config
def range_problems(jc) -> list[str]:
    """The numbers a run needs in range (also checked by every training run before torchtitan
    starts: torchtitan and torch fail on them with a raw error)."""
    t, opt, ck = jc.training, jc.optimizer, jc.checkpoint
    probs = [f"{name}={v!r}: must be an integer >= 1"
             for name, v in (("training.steps", t.steps), ("training.local_batch_size", t.local_batch_size),
                             ("training.seq_len", t.seq_len), ("metrics.log_freq", jc.metrics.log_freq))
             if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    probs += [f"optimizer.{name}={v!r}: must be a number >= 0"
              for name in ("lr", "eps", "weight_decay")
              if not isinstance(v := getattr(opt, name), (int, float)) or not v >= 0]
    if ck.enable and (not isinstance(ck.interval, int) or ck.interval < 1):
        probs.append(f"checkpoint.interval={ck.interval!r}: must be an integer >= 1")
    return probs


def config_problems(jc) -> list[str]:
    """Every problem of a parsed JobConfig that can be found without building anything."""
    probs: list[str] = []
    m, t, par = jc.model, jc.training, jc.parallelism
    if m.name != "nsa_flex" and not m.name.startswith("nsa_flex"):
        probs.append(f"model.name={m.name!r}: must be 'nsa_flex' (the TrainSpec registered by nsa_flex.titan.train_spec)")
    l_sel = NSAConfig.l_sel  # the selection block length, for the context-parallel rule
    if m.flavor not in nsa_flex_args:
        probs.append(f"model.flavor={m.flavor!r}: choices {sorted(nsa_flex_args)}")
    else:
        args = nsa_flex_args[m.flavor]
        args.max_seq_len = t.seq_len
        apply_nsa_section(args, jc.nsa)
        l_sel = args.l_sel
        try:
            args.nsa_config()
        except (NSAConfigError, ValueError, TypeError) as e:
            lines = [p.strip().lstrip("- ").strip() for p in re.split(r";\s*|\n", str(e))]
            probs.extend(f"[nsa] {p}" for p in lines if p and not p.endswith(":"))
    try:
        tm.validate_settings(jc.nsa.telemetry_every, jc.nsa.gate_collapse_threshold, jc.nsa.gate_collapse_steps)
    except ValueError as e:
        probs.append(str(e))
    probs.extend(ops.validate(jc.ops))
    probs.extend(range_problems(jc))
    if t.dataset.lower() not in DATASET_CHOICES:
        probs.append(f"training.dataset={t.dataset!r}: choices {list(DATASET_CHOICES)}")
    mix = passkey_mix_of(t)
    if not 0.0 <= float(mix) <= 1.0:
        probs.append(f"training.passkey_mix={t.passkey_mix!r}: must be in [0, 1]")
    elif mix > 0 and t.dataset.lower() == "passkey":
        probs.append("training.passkey_mix > 0 needs a text dataset (fineweb_edu, local), not 'passkey'")
    for check, field, default in ((check_questions, "passkey_questions", 1), (check_keys, "passkey_keys", 1),
                                  (check_min_gap, "passkey_min_gap", 0),
                                  (check_min_gap_share, "passkey_min_gap_share", 1.0)):
        try:  # the data's own rules (nsa_flex.data.passkey), the errors the run would stop with
            check(getattr(t, field, default))
        except DatasetError as e:
            probs.append(str(e))
    for name, v in (("training.mixed_precision_param", t.mixed_precision_param),
                    ("training.mixed_precision_reduce", t.mixed_precision_reduce), ("training.dtype", t.dtype)):
        if v not in DTYPES:
            probs.append(f"{name}={v!r}: choices {list(DTYPES)}")
    probs.extend(parallelism_problems(par, t.seq_len, l_sel, jc.validation))
    if jc.activation_checkpoint.mode not in AC_MODES:
        probs.append(f"activation_checkpoint.mode={jc.activation_checkpoint.mode!r}: choices {list(AC_MODES)}")
    bad = [c for c in jc.compile.components if c not in ("model", "loss")]
    if bad:
        probs.append(f"compile.components={jc.compile.components!r}: choices 'model', 'loss'")
    v = jc.validation
    if v.enable and v.dataset.lower() == "passkey" and v.steps == -1:
        probs.append("validation.steps=-1: validation on the endless 'passkey' corpus needs validation.steps > 0")
    return probs


# ----------------------------------------------------------------------------- checks
def check_tokenizer(cl: Checklist, jc):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    try:
        tok = _timed(lambda: build_tokenizer(jc), 60)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        cl.add(FAIL, "tokenizer", f"{jc.model.tokenizer!r} does not load offline", [_err(e)])
        return None
    cl.add(OK, "tokenizer", f"{jc.model.tokenizer!r} loaded offline (vocab {tok.get_vocab_size()}, eos {tok.eos_id}) "
           f"in {time.perf_counter() - t0:.1f} s")
    return tok


def check_dataset(cl: Checklist, jc, tok) -> None:
    t = jc.training
    if tok is None:
        cl.add(SKIP, "dataset", "needs the tokenizer")
        return
    t0 = time.perf_counter()
    try:
        inputs, labels = _timed(lambda: next(iter(build_dataloader(1, 0, tok, jc))), 120)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        cl.add(FAIL, "dataset", f"{t.dataset!r} ({t.dataset_path or 'no path'}) does not yield a batch", [_err(e)])
        return
    x = inputs["input"]
    want = (t.local_batch_size, t.seq_len)
    probs = []
    if tuple(x.shape) != want or tuple(labels.shape) != want:
        probs.append(f"input {tuple(x.shape)}, labels {tuple(labels.shape)}: expected {want}")
    if x.dtype != torch.long:
        probs.append(f"input dtype {x.dtype}: expected torch.int64")
    hi = int(max(x.max(), labels.max()))
    if hi >= tok.get_vocab_size() or int(min(x.min(), labels.min())) < 0:
        probs.append(f"token ids outside [0, {tok.get_vocab_size()}): max {hi}")
    cl.add(FAIL if probs else OK, "dataset",
           f"{t.dataset!r}{' ' + t.dataset_path if t.dataset_path else ''}: one batch input {list(x.shape)} "
           f"{str(x.dtype).replace('torch.', '')} in {time.perf_counter() - t0:.1f} s", probs)


def check_dump_folder(cl: Checklist, jc) -> None:
    d = jc.job.dump_folder
    probs = []
    try:
        os.makedirs(os.path.join(d, STALLS_DIR), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".preflight-"):
            pass
    except OSError as e:
        probs.append(f"job.dump_folder={d!r} is not writable: {_err(e)}")
    halt = os.path.join(d, jc.ops.halt_file) if jc.ops.halt_file else None
    if halt and os.path.exists(halt):
        probs.append(f"halt file {halt} exists, left from before this run: the run removes it at its start with a "
                     "warning (a halt asked for now would be lost; remove it)")
    cl.add(FAIL if probs else OK, "dump folder", f"{os.path.abspath(d)} writable (dumps in {STALLS_DIR}/)"
           if not probs else os.path.abspath(d), probs)


def _checkpoint_kind(path: str) -> str:
    try:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    except Exception as e:  # noqa: BLE001
        return f"unreadable metadata ({type(e).__name__})"
    full = any(k.startswith(("optimizer", "dataloader", "train_state", "lr_scheduler")) for k in keys)
    return "full: resumes training" if full else "model only: loads weights, cannot resume the data/optimizer state"


def check_checkpoint(cl: Checklist, jc) -> None:
    ck = jc.checkpoint
    if not ck.enable:
        cl.add(OK, "checkpoint", "disabled: the run starts from step 0 and saves nothing")
        return
    folder = os.path.join(jc.job.dump_folder, ck.folder)
    steps = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            m = re.fullmatch(r"step-(\d+)", name)
            if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
                steps.append(int(m.group(1)))
    if ck.load_step != -1:
        if ck.load_step not in steps:
            cl.add(FAIL, "checkpoint", f"checkpoint.load_step={ck.load_step}: no complete step-{ck.load_step} in "
                   f"{folder} (found {sorted(steps) or 'none'})")
            return
        step = ck.load_step
    elif steps:
        step = max(steps)
    else:
        init = ck.initial_load_path
        if init and not os.path.exists(init):
            cl.add(FAIL, "checkpoint", f"checkpoint.initial_load_path={init!r} does not exist")
        else:
            cl.add(OK, "checkpoint", f"no checkpoint in {folder}: fresh start"
                   + (f" from {init}" if init else "") + f"; saves every {ck.interval} steps")
        return
    path = os.path.join(folder, f"step-{step}")
    cl.add(OK, "checkpoint", f"would resume from {path} ({_checkpoint_kind(path)}); saves every {ck.interval} steps")


def check_long_run(cl: Checklist, jc) -> None:
    n, lim, ck = jc.training.steps, jc.ops.long_run_steps, jc.checkpoint
    if not lim or n < lim:
        cl.add(OK, "long run", f"{n} steps < ops.long_run_steps={lim}: no checkpoint interval needed"
               if lim else "check off (ops.long_run_steps = 0)")
    elif not ck.enable:
        cl.add(FAIL, "long run", f"{n} steps >= ops.long_run_steps={lim} without checkpoints",
               ["set [checkpoint] enable = true (and interval < training.steps) so a crash or halt can resume"])
    elif ck.interval >= n:
        cl.add(FAIL, "long run", f"checkpoint.interval={ck.interval} >= training.steps={n}: only the final step saves",
               [f"set checkpoint.interval below {n}"])
    else:
        cl.add(OK, "long run", f"{n} steps, checkpoint every {ck.interval} steps"
               + ("" if not ck.last_save_model_only else " (final save model-only; halt checkpoints are full)"))


def check_device(cl: Checklist, jc) -> bool:
    t = jc.training
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    probs = []
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0)
        if n < local:
            probs.append(f"{local} local ranks but {n} CUDA devices")
        if "bfloat16" in (t.mixed_precision_param, t.dtype) and not torch.cuda.is_bf16_supported():
            probs.append(f"{name} does not support bfloat16 (training.mixed_precision_param / dtype)")
        cl.add(FAIL if probs else OK, "device", f"{n} x {name}, torch {torch.__version__}, "
               f"param {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}", probs)
        return not probs
    par = jc.parallelism
    problem = cpu_data_parallel_problem(par, world, cuda=False)
    if problem:
        probs.append(problem)
    if t.mixed_precision_param == "float16":
        probs.append("training.mixed_precision_param='float16' is not supported on the CPU")
    note = "; bf16 autocast is ~25x slower here, use float32" if t.mixed_precision_param == "bfloat16" else ""
    cl.add(FAIL if probs else OK, "device", f"no CUDA: CPU shim (nsa_flex.titan.cpu), {os.cpu_count()} cores, "
           f"torch {torch.__version__}, param {t.mixed_precision_param}{note}", probs)
    return not probs


def _peak_rss_gib() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r * (1 if sys.platform == "darwin" else 1024) / 2**30


def _model_args(jc):
    args = nsa_flex_args[jc.model.flavor]
    args.update_from_config(jc)  # as the trainer does: [nsa] overrides, vocab, flex -> reference on CPU
    return args


def _device_dtype(jc):
    cuda = torch.cuda.is_available()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(jc.training.mixed_precision_param,
                                                                       torch.float32)
    return torch.device("cuda" if cuda else "cpu"), dtype


def check_memory(cl: Checklist, jc) -> None:
    """The training step's estimated memory per rank against the device's available memory."""
    t, par = jc.training, jc.parallelism
    args = _model_args(jc)
    dev, dtype = _device_dtype(jc)
    with torch.device("meta"):
        nparams = sum(p.numel() for p in NSATransformer(args).parameters())
    world = int(os.environ.get("WORLD_SIZE", 1))
    cp = max(1, par.context_parallel_degree)
    # FSDP shards over data and context ranks (torchtitan's "fsdp" mesh)
    shards = world // max(1, par.data_parallel_replicate_degree) if par.data_parallel_shard_degree == -1 \
        else max(1, par.data_parallel_shard_degree) * cp
    need = est.training_bytes(args, nparams, t.local_batch_size, t.seq_len, dtype.itemsize,
                              jc.activation_checkpoint.mode, shards, cp)
    have = est.available_bytes(dev)
    parts = (f"states {est.fmt_bytes(need['states'])}, activations {est.fmt_bytes(need['activations'])}, "
             f"logits {est.fmt_bytes(need['logits'])}")
    what = (f"one training step estimated at {est.fmt_bytes(need['total'])} per rank ({parts}; "
            f"{nparams / 1e6:.1f}M parameters, batch {t.local_batch_size} x {t.seq_len}, backend {args.backend}, "
            f"activation_checkpoint {jc.activation_checkpoint.mode}); {est.fmt_bytes(have)} available on {dev.type}")
    if need["total"] > MEMORY_SHARE * have:
        cl.add(FAIL, "memory", what, [
            "the run would run out of memory: lower training.local_batch_size or training.seq_len, set "
            "activation_checkpoint.mode = \"full\" or nsa.recompute = \"cmp_win\" (or \"all\")"
            + (", or run on a GPU (the CPU's reference backend materializes [B, H, T, T] scores)"
               if dev.type == "cpu" else "")])
    else:
        cl.add(OK, "memory", what)


def layer_estimate(jc, args, dev, dtype) -> tuple[float, float]:
    """(seconds, bytes) of the layer check (two forward+backward passes of one block)."""
    t = jc.training
    rate = est.matmul_flops_per_s(dev, dtype)
    flops = 2 * est.block_flops(args, t.local_batch_size, t.seq_len)
    # the reference backend's softmax and masks are memory-bound: half the matmul rate
    seconds = flops / (rate * (0.5 if args.backend == "reference" else 1.0)) + 2 * PASS_OVERHEAD_S
    nbytes = est.block_activation_bytes(args, t.local_batch_size, t.seq_len, dtype.itemsize)
    return seconds, nbytes


def check_layer(cl: Checklist, jc, full: bool = False) -> None:
    """One decoder block (NSA attention + SwiGLU) forward+backward at the configured shape, after
    an estimate of its time and memory (skipped when over the limits, unless ``full``)."""

    t = jc.training
    args = _model_args(jc)
    dev, dtype = _device_dtype(jc)
    cuda = dev.type == "cuda"
    compiled = jc.compile.enable and "model" in jc.compile.components
    shape = [t.local_batch_size, t.seq_len, args.dim]
    what = (f"1 block forward+backward at {shape} {str(dtype).replace('torch.', '')}, backend {args.backend}, "
            f"{'compiled (fullgraph)' if compiled else 'eager'}")
    seconds, nbytes = layer_estimate(jc, args, dev, dtype)
    have = est.available_bytes(dev)
    guess = f"estimated ~{seconds:.0f} s{' + compile' if compiled else ''} and {est.fmt_bytes(nbytes)} " \
            f"({est.fmt_bytes(have)} available on {dev.type})"
    if not full and (seconds > LAYER_CHECK_S or nbytes > MEMORY_SHARE * have):
        why = "over the memory available" if nbytes > MEMORY_SHARE * have else f"over {LAYER_CHECK_S:.0f} s"
        cl.add(SKIP, "NSA layer", f"{what}: {guess}: {why}, not run here (--preflight-full runs it)",
               blocking=False)
        return
    print(f"         NSA layer: {what}, {guess} ...", flush=True)
    try:
        torch.manual_seed(0)
        block = NSATransformerBlock(0, args).to(dev)
        with torch.no_grad():
            block.init_weights()
        block = block.to(dtype)
        fn = torch.compile(block, fullgraph=True) if compiled else block
        doc_ids = torch.zeros(shape[:2], dtype=torch.long, device=dev) if args.doc_masking else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(2):
            x = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
            t0 = time.perf_counter()
            y = fn(x, doc_ids)
            print(f"         NSA layer: pass {i + 1}/2 forward {time.perf_counter() - t0:.1f} s", flush=True)
            y.float().square().mean().backward()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            print(f"         NSA layer: pass {i + 1}/2 forward+backward {times[-1]:.1f} s", flush=True)
            if not torch.isfinite(x.grad).all():
                raise FloatingPointError("non-finite input gradient")
        peak = (f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated" if cuda
                else f"process peak RSS {_peak_rss_gib():.2f} GiB")
    except Exception as e:  # noqa: BLE001 - Ctrl-C (KeyboardInterrupt) is not caught: it stops the preflight
        tb = traceback.format_exc().strip().splitlines()
        cl.add(FAIL, "NSA layer", what, [_err(e)] + tb[-3:-1])
        return
    cl.add(OK, "NSA layer", f"{what}: first call {times[0]:.2f} s ({'compile + ' if compiled else ''}run), "
           f"then {times[1]:.3f} s; {peak}")


# ----------------------------------------------------------------------------- entry point
def main(args: list[str], full: bool = False) -> int:
    """Run every check for the config given by ``args`` (torchtitan's command line); 0 = all pass,
    130 = interrupted (Ctrl-C). ``full`` (``--preflight-full``): run the layer check even when its
    estimate exceeds the limits."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    console.setup()  # the training run's console filters (torchdata's set_vital warning, ...)
    print(f"nsa-train preflight: {' '.join(args)}", flush=True)
    cl = Checklist()
    t_all = time.perf_counter()
    try:
        return _checks(cl, args, full, t_all)
    except KeyboardInterrupt:
        print(f"preflight: interrupted (Ctrl-C) after {time.perf_counter() - t_all:.1f} s", flush=True)
        return 130


def _checks(cl: Checklist, args: list[str], full: bool, t_all: float) -> int:
    import importlib

    from torchtitan.config import ConfigManager

    try:
        jc = ConfigManager().parse_args(list(args))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - tyro exits with SystemExit on a bad option
        cl.add(FAIL, "config", "cannot be parsed (see the message above)", [_err(e)])
        print(cl.summary())
        return 1
    try:
        if jc.experimental.custom_import:  # registers the TrainSpec; on a machine without CUDA, the CPU shim
            importlib.import_module(jc.experimental.custom_import)
    except Exception as e:  # noqa: BLE001
        cl.add(FAIL, "config", f"experimental.custom_import={jc.experimental.custom_import!r} fails", [_err(e)])
    probs = config_problems(jc)
    cl.add(FAIL if probs else OK, "config",
           f"{len(probs)} problem(s)" if probs else
           f"valid: {jc.model.name} {jc.model.flavor}, seq_len {jc.training.seq_len}, local batch "
           f"{jc.training.local_batch_size}, {jc.training.steps} steps", probs)
    tok = check_tokenizer(cl, jc)
    check_dataset(cl, jc, tok)
    check_dump_folder(cl, jc)
    check_checkpoint(cl, jc)
    check_long_run(cl, jc)
    device_ok = check_device(cl, jc)
    if probs or tok is None or not device_ok:
        cl.add(SKIP, "memory", "needs a valid config, the tokenizer and the device")
        cl.add(SKIP, "NSA layer", "needs a valid config, the tokenizer and the device")
    else:
        check_memory(cl, jc)
        check_layer(cl, jc, full)
    print(f"{cl.summary()} ({time.perf_counter() - t_all:.1f} s)", flush=True)
    return 0 if cl.passed else 1
