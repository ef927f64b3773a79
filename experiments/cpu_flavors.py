"""Extra tiny flavors for CPU retrieval checks, registered on import (`Flavors.add`).

    PYTHONPATH=experiments nsa-train --job.config_file titan_configs/debug_nsa.toml \
        --experimental.custom_import cpu_flavors --model.flavor debug4l ...

Importing this module registers the nsa_flex TrainSpec (as nsa_flex.titan.train_spec does) and adds
``debug4l`` (the debugmodel with 4 layers) and ``debug4l128`` (4 layers, dim 128, 8 heads) to the
flavor table; an evaluation process must import it too before building the model.
"""

import dataclasses

import nsa_flex.titan.train_spec  # noqa: F401  (registers the spec, CPU shim)
from nsa_flex.titan.args import nsa_flex_args

_base = nsa_flex_args["debugmodel"]
nsa_flex_args.add("debug4l", dataclasses.replace(_base, n_layers=4))
nsa_flex_args.add("debug4l128", dataclasses.replace(_base, n_layers=4, dim=128, n_heads=8))
# debugmodel with the paper's compression/selection block sizes (l=32, d=16, l_sel=64): does the
# compressed branch still copy a 5-digit key when a compressed token averages 32 tokens?
# n_sel=4 = block 0 + 2 local + 1 free slot (as debugmodel)
nsa_flex_args.add("debug_l32", dataclasses.replace(
    _base, l=32, d=16, l_sel=64, n_sel=4, window=64, max_seq_len=512))
