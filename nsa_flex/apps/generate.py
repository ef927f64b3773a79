"""Text generation from a torchtitan DCP checkpoint of the nsa_flex model.

    python -m nsa_flex.generate --config titan_configs/debug_nsa.toml \
        --checkpoint outputs/debug_nsa/checkpoint/step-50 --prompt "The passkey is" \
        [--max-new-tokens 64] [--temperature 0.8 --top-p 0.95 | --greedy] [--seed 0] \
        [--cuda-graphs]

The model (flavor + [nsa] overrides) and the tokenizer come from the TOML config, as in training.
--checkpoint is a DCP step folder (`<dump_folder>/<checkpoint.folder>/step-N`) or a checkpoint
folder holding step-N folders (the latest is used). torchtitan 0.2.2 saves the model's state dict
*flattened* at the top level of the DCP state dict (keys "tok_embeddings.weight", "layers.0...",
next to "optimizer", "lr_scheduler", "train_state", ...; model-only last-step checkpoints hold the
model keys alone); a nested {"model": {...}} layout is accepted too. Only the model keys are read.
Prefill runs the model's own forward; decoding uses the per-branch caches (nsa_flex.inference).
"""

import argparse
import os
import re
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torchtitan.config import ConfigManager

from nsa_flex.errors import UserError, user_error
from nsa_flex.inference.model import generate
from nsa_flex.titan.args import nsa_flex_args
from nsa_flex.titan.checkpoint import extra_model_keys
from nsa_flex.titan.model import NSATransformer
from nsa_flex.titan.tokenizer import build_tokenizer


PROG = "python -m nsa_flex.generate"


class CheckpointNotFound(UserError, FileNotFoundError):
    """--checkpoint names no DCP checkpoint (nor a folder of step-N ones)."""


class CheckpointKeysError(UserError, KeyError):
    """The checkpoint's model keys are not the model's: it lacks some (another model, or not a
    training checkpoint) or holds more (a model trained with other settings, e.g. ``[nsa] phi``)."""


def resolve_checkpoint(path: str) -> str:
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    steps = []
    if os.path.isdir(path):
        for name in os.listdir(path):
            m = re.fullmatch(r"step-(\d+)", name)
            if m and os.path.isfile(os.path.join(path, name, ".metadata")):
                steps.append((int(m.group(1)), name))
    if not steps:
        raise CheckpointNotFound(f"--checkpoint {path!r}: neither a DCP checkpoint folder (no .metadata) "
                                 "nor a folder of step-N checkpoints")
    return os.path.join(path, max(steps)[1])


def load_job_config(config_file: str, overrides: list[str] | None = None):
    """The run's JobConfig from its TOML and extra flags; a missing or unparsable one is a UserError."""
    if not os.path.isfile(config_file):
        raise UserError(f"--config {config_file!r}: no such file")
    try:
        return ConfigManager().parse_args(["--job.config_file", config_file, *(overrides or [])])
    except (ValueError, TypeError) as e:  # a TOML syntax error, an unknown field, a bad value
        raise UserError(f"--config {config_file!r}: {e}") from None


def build_model(job_config, device="cpu", dtype=torch.float32):
    """NSATransformer + tokenizer per the job config (flavor, [nsa] section, tokenizer)."""
    if torch.device(device).type != "cuda":  # inference on the CPU: the reference backend, quietly
        job_config.nsa.backend = "reference"
    args = nsa_flex_args[job_config.model.flavor]
    args.update_from_config(job_config)
    if torch.device(device).type != "cuda":
        args.backend = "reference"
    with torch.device(device):
        model = NSATransformer(args)
    model = model.to(dtype)
    return model, build_tokenizer(job_config)


def load_checkpoint(model: torch.nn.Module, checkpoint: str) -> str:
    """Load the model weights of a DCP checkpoint (flattened or nested under "model")."""
    path = resolve_checkpoint(checkpoint)
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    sd = model.state_dict()
    missing = [k for k in sd if k not in keys]
    if missing and not all(f"model.{k}" in keys for k in sd):
        raise CheckpointKeysError(f"--checkpoint {path!r} lacks model keys {missing[:5]}... (has e.g. "
                                  f"{sorted(keys)[:5]})")
    extra = extra_model_keys(sd, {k[len("model."):] for k in keys if k.startswith("model.")} if missing else keys)
    if extra:
        raise CheckpointKeysError(f"--checkpoint {path!r} holds model keys this model lacks {extra[:5]}: it was "
                                  "trained with other model settings (flavor, [nsa] phi, ...); pass the run's "
                                  "TOML and the flags it was trained with (--override)")
    with warnings.catch_warnings():  # one process, no process group: what DCP warns about is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load({"model": sd} if missing else sd, checkpoint_id=path)
    model.load_state_dict(sd)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="torchtitan TOML config of the run")
    p.add_argument("--checkpoint", required=True, help="DCP step folder (or folder of step-N)")
    p.add_argument("--prompt", required=True, action="append",
                   help="prompt text (repeat for a batch of prompts of any lengths)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode by one CUDA graph replay per token (CUDA only; eager decode is "
                        "host-bound)")
    p.add_argument("--override", action="append", default=[],
                   help="extra torchtitan config flag, e.g. --override=--nsa.window=64")
    a = p.parse_args(argv)
    if a.cuda_graphs and torch.device(a.device).type != "cuda":
        p.error(f"--cuda-graphs needs a CUDA --device, got {a.device}")
    try:
        return run(a)
    except UserError as e:
        sys.exit(user_error(str(e), prog=PROG))


def run(a: argparse.Namespace) -> dict:
    """Load the run's model and checkpoint, generate from each prompt and print the texts."""
    job_config = load_job_config(a.config, a.override)
    path = resolve_checkpoint(a.checkpoint)  # a wrong path is said before the model is built
    model, tok = build_model(job_config, a.device, getattr(torch, a.dtype))
    load_checkpoint(model, path)
    model.eval()
    prompts = [tok.encode(t, add_bos=not a.no_bos and tok.bos_id is not None) for t in a.prompt]
    t0 = time.perf_counter()  # warm-up (first-call allocations, kernel selection): timed on its own
    generate(model, [prompts[0][:8]], 1, greedy=True, eos_id=None, device=a.device)
    warmup_s = time.perf_counter() - t0
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    r = generate(model, prompts, a.max_new_tokens, a.temperature, a.top_p, a.greedy,
                 eos_id=tok.eos_id, generator=gen, device=a.device, cuda_graphs=a.cuda_graphs)
    print(f"# checkpoint {path}  ({'greedy' if a.greedy else f'T={a.temperature} top_p={a.top_p}'})")
    for text, ids in zip(a.prompt, r["tokens"]):
        print(f"--- prompt: {text!r}")
        print(text + tok.decode(ids))
    print(f"# warm-up {warmup_s:.2f}s; prefill {sum(map(len, prompts))} tokens in {r['prefill_s']:.3f}s; decode "
          f"{r['new_tokens']} new tokens, {r['tokens_per_s']:.1f} tokens/s "
          f"(batch {len(prompts)}, {a.device})", file=sys.stderr)
    r.pop("cache")
    return r


if __name__ == "__main__":
    main()
