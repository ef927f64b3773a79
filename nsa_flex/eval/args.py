"""Command line of ``python -m nsa_flex.eval`` (:mod:`nsa_flex.eval.needle`), parsed without
importing torch: a missing ``--out`` or a bad option fails at once."""

import argparse
import os

from .prompts import EvalError

DESCRIPTION = "Passkey retrieval and multi-key needle-in-a-haystack evaluation of an nsa_flex checkpoint."
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_FINEWEB = os.path.join(os.path.dirname(ROOT), "shared", "data", "fineweb_sample_2800.parquet")
DEFAULT_CONFIG = os.path.join(ROOT, "titan_configs", "debug_nsa.toml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nsa_flex.eval", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="torchtitan TOML of the run (default with --quick: debug_nsa.toml)")
    p.add_argument("--checkpoint", help="DCP step-N folder, or a folder of step-N folders (latest)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: debug model (random weights unless --checkpoint), lengths 256,512, "
                        "depths 0,50,100, 1 trial, 2 keys")
    p.add_argument("--random-init", action="store_true", help="evaluate random weights (no checkpoint)")
    p.add_argument("--lengths", help="context lengths, comma separated (default 1024,...,65536)")
    p.add_argument("--depths", help="needle depths in %% (default 0,10,...,100)")
    p.add_argument("--trials", type=int, help="prompts per (kind, length, depth) (default 2)")
    p.add_argument("--kinds", default="passkey,multikey", help="passkey,multikey")
    p.add_argument("--n-keys", type=int, help="needles in a multikey prompt (default 4; --quick: 2)")
    p.add_argument("--filler", default="auto", help="auto | synthetic | fineweb")
    p.add_argument("--fineweb", default=DEFAULT_FINEWEB, help="FineWeb parquet for --filler fineweb/auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--backend", default="auto", help="auto | reference | flex (prefill attention)")
    p.add_argument("--decode", default="auto", choices=("auto", "cache", "full"),
                   help="cache: prefill + NSA caches; full: a full forward per token; auto: cache when supported")
    p.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="decode step of the NSA caches (nsa_flex.inference): auto = the fused Triton kernel "
                        "on CUDA, torch = the reference path")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generation call (upper bound)")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="share of the free GPU memory the dense reference attention may use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="label for the heatmap titles")
    p.add_argument("--out", help="output folder")
    p.add_argument("--override", action="append", default=[],
                   help="extra torchtitan config flag, e.g. --override=--nsa.window=64")
    p.add_argument("--resume", action="store_true",
                   help="keep the scored rows of OUT/needle.csv and evaluate only the missing prompts")
    p.add_argument("--time-limit", type=float, default=0,
                   help="stop (cleanly, summary written) after this many seconds; 0 = no limit")
    p.add_argument("--collect", metavar="DIR", help="only build DIR/ablation.csv + .png from DIR/<run>/")
    a = p.parse_args(argv)
    if a.collect:
        return a
    if not a.out:
        raise EvalError("--out is required")
    if a.quick:
        a.config = a.config or DEFAULT_CONFIG
        a.device = a.device or "cpu"
        a.lengths = a.lengths or "256,512"
        a.n_keys = 2 if a.n_keys is None else a.n_keys
        a.depths = a.depths or "0,50,100"
        a.trials = 1 if a.trials is None else a.trials
        a.random_init = a.random_init or a.checkpoint is None
    if not a.config:
        raise EvalError("--config is required (or --quick)")
    a.lengths = a.lengths or "1024,2048,4096,8192,16384,32768,65536"
    a.depths = a.depths or ",".join(str(d) for d in range(0, 101, 10))
    a.trials = 2 if a.trials is None else a.trials
    a.n_keys = 4 if a.n_keys is None else a.n_keys
    return a
