"""``nsa-train --help``: this project's own options, answered without importing torch.

The [nsa] fields and their help are read from ``NSAConfig`` (``nsa_flex/config.py``, after those
of its base ``LayerShape`` in ``nsa_flex/rules.py``: each ``knob(default, help[, paper])``) and the [nsa] / [ops] extras from ``nsa_flex/titan/job_config.py`` (the
attribute docstrings), by parsing the source: importing those modules would import torch (~15 s).
torchtitan's own 1,000 options stay behind ``--help-all``.
"""

import ast
import os
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_PY = os.path.join(os.path.dirname(HERE), "config.py")
RULES_PY = os.path.join(os.path.dirname(HERE), "rules.py")
JOB_CONFIG_PY = os.path.join(HERE, "job_config.py")
SOURCES_PY = os.path.join(os.path.dirname(HERE), "data", "sources.py")
ARGS_PY = os.path.join(HERE, "args.py")

HEAD = """\
usage: nsa-train [--job.config_file FILE.toml] [--preflight [--preflight-full]] [--SECTION.FIELD VALUE ...]

Trains an nsa_flex model with torchtitan 0.2.2's trainer (one process; under torchrun one per rank).
Configuration comes from the TOML file and --SECTION.FIELD overrides (e.g. --training.steps 100).

options of nsa-train:
  --job.config_file FILE  the run's TOML (also spelled --job.config-file); default:
                          titan_configs/debug_nsa.toml (byte tokenizer, generated data, tiny model)
  --preflight             check the launch (config, tokenizer, data, dump folder, checkpoint, device,
                          memory, one layer) instead of training; exit 0 only when every check passes
  --preflight-full        with --preflight: run the layer check even when its estimate exceeds the
                          time or memory limit
  -h, --help              this help (no torch import)
  --help-all              torchtitan's full list of options (~1,000 lines; imports torch first)
"""

TAIL = """\
Sections of torchtitan used most: [training] steps, local_batch_size, seq_len, dataset
({datasets}), dataset_path; [model] flavor
({flavors}), tokenizer; [checkpoint] enable, interval;
[parallelism]; [compile] enable. Every field of every section: nsa-train --help-all.
"""


def _fields(path: str, cls: str) -> list[tuple[str, str, str]]:
    """(name, default source, help) of the annotated fields of class ``cls`` in ``path``: help from
    ``knob(default, help)`` or from the string statement after the field."""
    tree = ast.parse(open(path).read())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = []
    body = node.body
    for i, st in enumerate(body):
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
            continue
        default, help_ = (ast.unparse(st.value) if st.value is not None else ""), ""
        v = st.value
        if isinstance(v, ast.Call) and getattr(v.func, "id", "") == "knob" and len(v.args) == 2:
            default, help_ = ast.unparse(v.args[0]), ast.literal_eval(v.args[1])
            paper = next((ast.literal_eval(k.value) for k in v.keywords if k.arg == "paper"), None)
            help_ = f"{help_} (paper {paper})" if paper else help_  # as nsa_flex.rules.knob
        elif i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and isinstance(body[i + 1].value, ast.Constant) \
                and isinstance(body[i + 1].value.value, str):
            help_ = body[i + 1].value.value
        out.append((st.target.id, default, " ".join(help_.split())))
    return out


def _section(title: str, rows: list[tuple[str, str, str]], prefix: str) -> str:
    lines = [title]
    for name, default, help_ in rows:
        flag = f"  --{prefix}.{name}"
        text = f"{help_} (default {default})" if default not in ("", "None") else help_
        wrapped = textwrap.wrap(text, 100 - 30) or [""]
        lines.append(f"{flag:<30}{wrapped[0]}" if len(flag) < 30 else f"{flag}\n{'':<30}{wrapped[0]}")
        lines.extend(f"{'':<30}{w}" for w in wrapped[1:])
    return "\n".join(lines) + "\n"


def _constant(path: str, name: str):
    tree = ast.parse(open(path).read())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == name for t in n.targets))


def flavor_names() -> list[str]:
    """The flavors of ``nsa_flex_args`` (titan/args.py: ``Flavors({name: NSAModelArgs(...)})``), in order."""
    tree = ast.parse(open(ARGS_PY).read())
    table = next(n.value.args[0] for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", "") == "nsa_flex_args" for t in n.targets))
    return [ast.literal_eval(k) for k in table.keys]


def nsa_fields() -> list[tuple[str, str, str]]:
    """The [nsa] section: NSAConfig's knobs (without the model dims the flavor sets) and the
    section's extras."""
    dims = _constant(CONFIG_PY, "MODEL_DIMS")
    fields = _fields(RULES_PY, "LayerShape") + _fields(CONFIG_PY, "NSAConfig")  # base first
    knobs = [(n, "", h) for n, _, h in fields if n not in dims]
    return knobs + _fields(JOB_CONFIG_PY, "NSA")


def usage() -> str:
    return "\n".join([
        HEAD,
        _section("[nsa] NSA attention (TOML section [nsa] or --nsa.FIELD; unset fields keep the "
                 "model flavor's value):", nsa_fields(), "nsa"),
        _section("[ops] operating long runs (--ops.FIELD):", _fields(JOB_CONFIG_PY, "Ops"), "ops"),
        TAIL.format(datasets=" | ".join(_constant(SOURCES_PY, "DATASET_CHOICES")), flavors=", ".join(flavor_names())),
    ])
