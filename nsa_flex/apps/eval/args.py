"""Command line of ``python -m nsa_flex.eval`` (:mod:`nsa_flex.apps.eval.needle`), parsed without
importing torch: a missing ``--out`` or a bad option fails at once."""

import os

from .cli import DEFAULT_CONFIG, ROOT, add_run_args, resolve_common, task_parser  # noqa: F401

DESCRIPTION = "Passkey retrieval and multi-key needle-in-a-haystack evaluation of an nsa_flex checkpoint."
DEFAULT_FINEWEB = os.path.join(os.path.dirname(ROOT), "shared", "data", "fineweb_sample_2800.parquet")


def parse_args(argv=None):
    p = task_parser(DESCRIPTION, "CPU smoke run: debug model (random weights unless --checkpoint), "
                                 "lengths 256,512, depths 0,50,100, 1 trial, 2 keys",
                    prog="python -m nsa_flex.eval")
    p.add_argument("--lengths", help="context lengths, comma separated (default 1024,...,65536)")
    p.add_argument("--depths", help="needle depths in %% (default 0,10,...,100)")
    p.add_argument("--trials", type=int, help="prompts per (kind, length, depth) (default 2)")
    p.add_argument("--kinds", default="passkey,multikey", help="passkey,multikey")
    p.add_argument("--n-keys", type=int, help="needles in a multikey prompt (default 4; --quick: 2)")
    p.add_argument("--filler", default="auto", help="auto | synthetic | words | far_words | fineweb | pysource (auto: the training data's kind; synthetic: generated sentences; words, far_words: generated pseudo-words, as [training] passkey_filler)")
    p.add_argument("--fineweb", default=DEFAULT_FINEWEB, help="FineWeb parquet for --filler fineweb/auto")
    p.add_argument("--decode", default="auto", choices=("auto", "cache", "full"),
                   help="cache: prefill + NSA caches; full: a full forward per token; auto: cache when supported")
    p.add_argument("--decode-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="decode step of the NSA caches (nsa_flex.inference): auto = the fused Triton kernel "
                        "on CUDA, torch = the reference path")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generation call (upper bound)")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="share of the free GPU memory the dense reference attention may use")
    add_run_args(p, tag_help="label for the heatmap titles", override_example="--nsa.window=64",
                 backend_help="auto | reference | flex (prefill attention)",
                 seed_help="prompt generation and random-init seed")
    p.add_argument("--resume", action="store_true",
                   help="keep the scored rows of OUT/needle.csv and evaluate only the missing prompts")
    p.add_argument("--time-limit", type=float, default=0,
                   help="stop (cleanly, summary written) after this many seconds; 0 = no limit")
    p.add_argument("--collect", metavar="DIR", help="only build DIR/ablation.csv + .png from DIR/<run>/")
    a = p.parse_args(argv)
    if a.collect:
        return a
    resolve_common(a, device=False)  # torch is not imported yet: the device is chosen by needle
    if a.quick:
        a.lengths = a.lengths or "256,512"
        a.n_keys = 2 if a.n_keys is None else a.n_keys
        a.depths = a.depths or "0,50,100"
        a.trials = 1 if a.trials is None else a.trials
    a.lengths = a.lengths or "1024,2048,4096,8192,16384,32768,65536"
    a.depths = a.depths or ",".join(str(d) for d in range(0, 101, 10))
    a.trials = 2 if a.trials is None else a.trials
    a.n_keys = 4 if a.n_keys is None else a.n_keys
    return a
