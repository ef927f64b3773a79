"""The command-line options the evaluation tasks share (run config and checkpoint, --quick,
held-out documents, device / dtype / backend, output) and the defaults they resolve to, so each
task's parser adds only its own options."""

import argparse
import os

from nsa_flex.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT_CONFIG = os.path.join(ROOT, "titan_configs", "debug_nsa.toml")
DEFAULT_DOCS = os.path.join(os.path.dirname(ROOT), "shared", "data", "fineweb_edu_sample_150.parquet")


class EvalError(UserError, ValueError):
    """A bad argument or input of an evaluation, named in the message."""


def task_parser(doc: str, quick_help: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` with the model options: --config,
    --checkpoint, --quick (``quick_help`` says what it sets) and --random-init."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="torchtitan TOML of the run (default with --quick: debug_nsa.toml)")
    p.add_argument("--checkpoint", help="DCP step-N folder, or a folder of step-N folders (latest)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--random-init", action="store_true", help="evaluate random weights (no checkpoint)")
    return p


def add_docs_args(p: argparse.ArgumentParser) -> None:
    """--docs (default: the FineWeb-Edu sample), --text-column, --join."""
    p.add_argument("--docs", default=DEFAULT_DOCS, help="held-out documents: parquet / jsonl / txt")
    p.add_argument("--text-column", default="text")
    p.add_argument("--join", action="store_true", help="concatenate the documents (EOS after each)")


def add_run_args(p: argparse.ArgumentParser, tag_help: str, override_example: str,
                 backend_help: str = "auto | reference | flex", seed_help: str = "random-init seed") -> None:
    """--device, --dtype, --backend, --seed, --tag, --out and --override."""
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--backend", default="auto", help=backend_help)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--tag", default="", help=tag_help)
    p.add_argument("--out", help="output folder")
    p.add_argument("--override", action="append", default=[],
                   help=f"extra torchtitan config flag, e.g. --override={override_example}")


def resolve_common(a: argparse.Namespace, device: bool = True) -> argparse.Namespace:
    """Checks and fills the shared options in place: --out is required; --quick means the debug
    config, the CPU and random weights unless --checkpoint is given; --config is required
    otherwise; with ``device``, the device defaults to CUDA when there is one (this imports torch;
    without it the task decides later). Returns ``a``."""
    if not a.out:
        raise EvalError("--out is required")
    if a.quick:
        a.config = a.config or DEFAULT_CONFIG
        a.device = a.device or "cpu"
        a.random_init = a.random_init or a.checkpoint is None
    if not a.config:
        raise EvalError("--config is required (or --quick)")
    if device:
        import torch

        a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return a
