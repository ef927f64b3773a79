"""torchtitan JobConfig extension for nsa-flex (``[job] custom_config_module = "nsa_flex.titan.job_config"``).

torchtitan 0.2.2 merges the ``JobConfig`` dataclass exported here into its own: sections that exist in
both are merged field by field (a field defined here overrides torchtitan's default), new sections are
added. Every field can also be set on the command line (``--nsa.l 16``, ``--model.tokenizer gpt2``).

NOTE: no ``from __future__ import annotations`` here: torchtitan's merge needs real types, not strings.

Sections:
  [nsa]       NSA attention settings. ``None`` (the default) keeps the value of the model flavor;
              plus telemetry: ``telemetry_every``, ``gate_collapse_threshold``, ``gate_collapse_steps``.
  [model]     + ``tokenizer``; defaults name="nsa_flex", flavor="debugmodel".
  [training]  + ``dataset_config``, ``dataset_text_column``, ``dataset_seed``, ``passkey_mix``, ``passkey_questions``,
              ``skip_bad_records``; default
              dataset "passkey".
  [validation] default dataset "passkey" (validation stream uses its own seed); + ``retrieval_docs``,
              ``retrieval_recall_docs``.
  [metrics]   + ``jsonl_file``: per-step metrics (full-precision loss, grad norm, tps, memory) as JSONL.
  [checkpoint] + ``allow_config_change`` (resume across a model / data-stream change).
  [experimental] default custom_import = "nsa_flex.titan.train_spec".
  [compile]   + ``combo_kernels`` (inductor's combo kernels for the compiled blocks; default on),
              ``cudagraphs`` (inductor's CUDA graphs for them: "auto", on for one CUDA process).
  [curriculum] short-then-long training from one TOML (nsa_flex/titan/curriculum.py).
  [ops]       operating long runs (nsa_flex/titan/ops.py): stall watchdog, SIGUSR1 dumps, HALT file /
              SIGTERM halt, data-wait telemetry; preflight thresholds.
"""

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Annotated, get_args, get_origin

import tyro

from nsa_flex.config import MODEL_DIMS, NSAConfig


def _section_field(f):
    """An NSAConfig field as an [nsa] field: same name and help, optional, default None (a tuple
    field as a list: what a TOML array gives)."""
    typ = list[get_args(f.type)[0]] if get_origin(f.type) is tuple else f.type
    return f.name, Annotated[typ | None, tyro.conf.arg(help=f.metadata["help"])], field(default=None)


# the NSAConfig fields a run sets in [nsa] (the model dims come from the [model] flavor)
_NSAKnobs = make_dataclass("_NSAKnobs", [_section_field(f) for f in fields(NSAConfig)
                                         if f.name not in MODEL_DIMS])


@dataclass
class NSA(_NSAKnobs):
    """[nsa] NSA attention knobs (see nsa_flex.config.NSAConfig). None keeps the flavor's value."""

    doc_masking: bool | None = None
    """restrict attention to the current document (documents split at the tokenizer's EOS)"""
    telemetry_every: int = 0
    """log NSA telemetry (per-layer gate mean / entropy / share per branch, tokens read per branch,
    selected-block distance histogram) every N steps and at step 1; 0 = off (nsa_flex/telemetry.py)"""
    gate_collapse_threshold: float = 0.95
    """telemetry: warn when a branch's gate mean stays above this (0 < x < 1) ..."""
    gate_collapse_steps: int = 10
    """... at every telemetry step over at least this many training steps"""


@dataclass
class Model:
    name: str = "nsa_flex"
    flavor: str = "debugmodel"
    hf_assets_path: str = "."
    """unused by nsa_flex (its tokenizers need no HF assets); "." silences torchtitan's missing-path warning"""
    tokenizer: str = "byte"
    """byte (built in, no files) | gpt2 | r50k_base | cl100k_base | path/to/file.tiktoken.
    tiktoken encodings load offline from TIKTOKEN_CACHE_DIR (nsa-train defaults it to
    ../shared/data/tiktoken_cache when that folder exists)."""


@dataclass
class Training:
    dataset: str = "passkey"
    """passkey (built in, generated) | fineweb_edu (HF streaming, or dataset_path) | local (dataset_path) |
    pysource (the Python source of installed packages, split by package)"""
    dataset_config: str = "sample-10BT"
    """HF config name of fineweb_edu (e.g. sample-10BT, sample-100BT, default)"""
    dataset_text_column: str = "text"
    """text column of parquet/jsonl files"""
    dataset_seed: int = 0
    """seed of the generated passkey corpus"""
    passkey_mix: float | None = None
    """fraction (0..1) of the training sequences of a text dataset replaced by generated retrieval
    documents, chosen per sequence index by a seeded hash: passkey documents (fineweb_edu / local),
    passkey and multi-key needles in source-code filler (pysource). Unset: 0.15 for pysource, 0 else"""
    skip_bad_records: bool = False
    """skip data records that cannot be used (a line that is not JSON, a record without the text
    field, a null or non-string text, undecodable UTF-8), each logged with its file and line / row
    and counted per file; false = stop at the first with its file and line / row"""
    passkey_questions: int = 1
    """training passkey documents ask the question this many times (1..16): the extra question +
    answer pairs replace filler at random points after the needle (more retrieval targets per
    document, at shorter distances too; passkey, passkey_mix and pysource documents alike);
    validation and evaluation documents ask once"""
    passkey_filler: str = "sentences"
    """the passage that generated passkey documents repeat as filler: sentences (random sentences of
    a small vocabulary) | words (random pseudo-words: predictable only by copying, the strongest
    signal for the induction circuit that retrieval uses; passages of ~120 tokens, so a 512-token
    window sees most repeats) | far_words (the same words, passages of 16 .. half the document
    tokens: repeats at every distance, beyond the window too); training, validation and retrieval
    metrics alike"""
    passkey_min_gap: int = 0
    """generated single-key training documents (passkey, passkey_mix, pysource): every answer lies
    at least this many filler tokens after the copy of its key before it (the needle, or the
    previous question's answer), so no answer is a copy within that distance: e.g. 512 with NSA's
    512-token window (every answer then copies from beyond the window); 0 = anywhere. The
    passkey_questions gaps must fit the document (one error says the seq_len they need);
    validation documents ask once, anywhere"""
    passkey_min_gap_share: float = 1.0
    """the share (0..1) of those single-key training documents laid out with passkey_min_gap; the
    others ask passkey_questions times anywhere (near copies too: full attention forms its copy
    from near answers first, NSA's window answers those itself); 1 = every document"""
    passkey_keys: int = 1
    """generated retrieval documents (dataset passkey, passkey_mix of a text dataset): 1 = single-key
    passkey documents; K in 2..16 = half of them multi-key documents with K needles naming different
    people (the needle evaluation's multikey format), whose questions name different people, so
    each answer's nearest earlier copy of its key is its own needle, at any distance (in a
    single-key document every answer after the first copies the previous answer, nearby);
    training, validation and retrieval metrics alike (pysource's retrieval documents are half 4-key
    whatever this says)"""


@dataclass
class Validation:
    dataset: str = "passkey"
    retrieval_docs: int = 16
    """held-out retrieval documents of the training data (its validation split, at the validation
    seq_len) scored at every validation step: teacher-forced answer loss and exact answers per kind,
    logged as retrieval/* (0..1024; 0 = off; off too when the training data holds no retrieval
    documents)"""
    retrieval_recall_docs: int = 0
    """NSA's selection recall at every validation step: over the first this many of those documents
    whose needle lies beyond the sliding window (and outside block 0), the share of (layer, KV
    group) whose selection at the question holds the needle's block, logged as
    retrieval/<kind>_sel_recall (0..1024; 0 = off). It runs the model eagerly (its compiled blocks'
    graphs trace no probe; FlexAttention then materializes its scores: short sequences only, a
    few seconds a validation at 2048)"""


@dataclass
class Metrics:
    jsonl_file: str = "metrics.jsonl"
    """per-step metrics file, relative to job.dump_folder ("" disables); written by rank 0, appended"""


@dataclass
class Checkpoint:
    allow_config_change: bool = False
    """resume from a checkpoint made with another model or data stream ([model], [nsa], the
    dataset fields, seq_len, batch size); without it such a resume is refused, naming each field"""


@dataclass
class Experimental:
    custom_import: str = "nsa_flex.titan.train_spec"


@dataclass
class Compile:
    combo_kernels: bool = True
    """inductor's combo_kernels for the compiled blocks (backend "inductor"): independent small
    kernels (NSA's per-step mask and block-list building, the gate) launched together as one
    kernel, fewer launches for the host to issue; false = each kernel its own launch"""
    cudagraphs: str = "auto"
    """inductor's CUDA graphs for the compiled blocks: each block's forward and backward replay as
    one graph launch instead of ~100 kernel launches each, where the host's launch rate bounds a
    step (short sequences). "auto" (default): on where they can run -- backend "inductor", one
    process, CUDA -- else off; "on": on, an error where they cannot run (several processes: FSDP
    gathers the parameters into new memory every step, which a replay cannot follow; another
    backend); "off". A TOML true / false reads as "on" / "off". Costs the graphs' private memory
    pool (0.1-0.4 GiB in torchtitan 125M at 8k-32k)"""


@dataclass
class Ops:
    """[ops] operating long runs (nsa_flex/titan/ops.py). Files go under job.dump_folder."""

    stall_timeout_s: float = 600.0
    """stall watchdog: when no training step completes within this many seconds (after the first
    step of this process), every rank dumps all Python thread stacks (+ CUDA memory summary) to
    <dump_folder>/stalls/step-N-rank-R.txt and logs one line. Covers the step plus the checkpoint
    save / validation after it. 0 = watchdog off"""
    stall_timeout_first_s: float = 1800.0
    """the same limit until the first step of this process completes (model build, checkpoint load,
    torch.compile); must be >= stall_timeout_s"""
    stall_exit_code: int = 0
    """after a stall dump, exit the process with this code (1..255, e.g. 75) so a scheduler can
    restart from the last checkpoint; 0 = keep waiting (dump once per stalled step)"""
    dump_on_sigusr1: bool = True
    """SIGUSR1 (kill -USR1 PID of a rank) writes the same dump without stopping the run"""
    halt_file: str = "HALT"
    """creating <dump_folder>/<halt_file> makes every rank stop after the current step, save a
    (full, resumable) checkpoint and exit with code 4; the file is removed (one found at the start,
    left from before the run, is removed with a warning). "" = off"""
    halt_on_sigterm: bool = True
    """SIGTERM and a first Ctrl-C (SIGINT) do the same as the halt file (a second one stops at once)"""
    halt_on_nonfinite: bool = True
    """stop the run when the loss or the gradient norm is not finite: nothing of that step is
    saved, an ops dump is written, nsa-train exits with code 3"""
    data_wait_warn_share: float = 0.25
    """warn when waiting for the data loader takes more than this share (0 < x <= 1) of the step
    time ..."""
    data_wait_warn_steps: int = 20
    """... for this many consecutive steps (>= 1)"""
    long_run_steps: int = 1000
    """preflight: runs of at least this many steps must save checkpoints (checkpoint.enable with an
    interval below training.steps); 0 = no such check"""


@dataclass
class Curriculum:
    """[curriculum] short-then-long training from one TOML (nsa_flex/titan/curriculum.py)"""

    short: list[str] = field(default_factory=list)
    """the short phase's settings, "section.field=value" each (or a boolean flag "section.field" /
    "section.no-field"), over the TOML and the command line; empty = no curriculum"""
    short_folder: str = "short"
    """the short phase's dump folder, inside job.dump_folder"""
    phase: str = ""
    """"" (nsa-train runs the short phase, then the long one) | short | long: run one phase"""


@dataclass
class JobConfig:
    nsa: NSA = field(default_factory=NSA)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    experimental: Experimental = field(default_factory=Experimental)
    compile: Compile = field(default_factory=Compile)
    ops: Ops = field(default_factory=Ops)
    curriculum: Curriculum = field(default_factory=Curriculum)
