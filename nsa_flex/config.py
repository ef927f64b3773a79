"""NSAConfig: every knob of one NSA attention layer, with paper defaults and validation.

Paper (arXiv 2502.11089) defaults: compression block l=32, stride d=16, selection block l'=64,
n=16 selected blocks (1 initial + 2 local always included), window w=512, 64 query heads in 4 GQA
groups, d_k=192, d_v=128, hidden size 2560.
"""

import logging
import math
from dataclasses import asdict, dataclass, fields

import torch

from masks import PRESETS, builder_info, import_builder_modules, list_mask_builders

from .errors import UserError
from .rules import LayerShape, knob

PHI_CHOICES = ("avg", "mlp")
BACKEND_CHOICES = ("auto", "flex", "reference")
SCORER_CHOICES = ("auto", "torch", "triton")
SEL_KERNEL_CHOICES = ("auto", "flex", "triton")
CMP_KERNEL_CHOICES = ("auto", "flex", "cudnn", "cudnn_lean")
SEL_SCORES_CHOICES = ("cmp", "indexer")
INDEXER_DIMS = (16, 32, 64, 128)
# NSAConfig.recompute -> the branches run under activation checkpointing (NSAAttention.branch)
RECOMPUTED = {"none": (), "win": ("win",), "cmp_win": ("cmp", "win"), "all": ("cmp", "sel", "win")}
RECOMPUTE_CHOICES = tuple(RECOMPUTED)
# the selection-training knobs (not in the paper) and their off values: each needs a selection
# builder that reads scores (the nsa preset's topn)
SCORE_KNOBS_OFF = {"sel_distill": 0.0, "sel_scores": "cmp", "sel_dense_steps": 0}


def inert_score_knobs(cfg) -> dict:
    """The selection-training knobs of `cfg` (an NSAConfig or model args: masks, sel_mask and the
    knobs as attributes) set away from off where its selection -- preset `masks`, or `sel_mask` --
    reads no scores (full_causal, sliding_only, random_selection, ...): {name: value}. {} where it
    reads scores, or where masks / sel_mask name no known preset / builder (validate reports those)."""
    try:
        scores = builder_info(cfg.sel_mask or PRESETS[cfg.masks][1]).scores
    except KeyError:
        return {}
    return {} if scores else {k: getattr(cfg, k) for k, off in SCORE_KNOBS_OFF.items()
                              if getattr(cfg, k) != off}


class NSAConfigError(UserError, ValueError):
    """Raised for an invalid NSAConfig; lists every violated rule, each naming its field.
    ``errors``: the rules, one string each, starting with the field name."""

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = list(errors or [])


_warned_flex_cpu = False


def resolve_backend(backend: str, device, training: bool = False) -> str:
    """The attention backend that runs on ``device`` (one place for the CPU rule).

    "auto" -> "flex" on CUDA, "reference" elsewhere: compiled FlexAttention has no backward on
    the CPU. An explicit "flex" is kept (its CPU forward works), except for ``training`` (the
    trainer always runs a backward): switched to "reference" with one warning per process."""
    global _warned_flex_cpu
    dev = torch.device(device).type
    if backend == "auto":
        return "flex" if dev == "cuda" else "reference"
    if backend == "flex" and training and dev != "cuda":
        if not _warned_flex_cpu:
            logging.getLogger().warning(
                "nsa backend 'flex' has no backward on the CPU (compiled CPU flex): no CUDA device "
                "here, switching to backend 'reference' (backend 'auto' does this silently)")
            _warned_flex_cpu = True
        return "reference"
    return backend


# NSAConfig fields a decoder sets from its own dims (the titan flavor's), not from the [nsa] section
MODEL_DIMS = ("dim", "n_heads", "n_kv_heads")


@dataclass
class NSAConfig(LayerShape):
    """The layer's shape and the paper's hyperparameters (`nsa_flex.rules.LayerShape`: dim, heads,
    head dims, l, d, l_sel, n_sel, n_init, n_local, window; the fields mask builders read, so
    masks' causality check runs on a small one), then the implementation's knobs."""

    # implementation and masks
    phi: str = knob("avg", "compression function: avg (mean pooling) | mlp (learned, with "
                           "intra-block positions)")
    backend: str = knob("auto", "attention backend: auto (flex on CUDA, else reference) | flex "
                                "(compiled FlexAttention; without CUDA, training switches it to "
                                "reference: no CPU backward) | reference (dense, autograd anywhere)")
    masks: str = knob("nsa", "mask preset (masks.PRESETS): nsa | full_causal | sliding_only | "
                             "random_selection | local_selection | no_compressed")
    cmp_mask: str | None = knob(None, "override of the compressed-branch mask builder "
                                      '(masks.list_mask_builders(); "none" switches the branch off)')
    sel_mask: str | None = knob(None, "override of the selection-branch mask builder")
    win_mask: str | None = knob(None, "override of the sliding-window-branch mask builder")
    builder_modules: tuple[str, ...] = knob((), "Python modules imported before the mask names are "
                                                "checked, to register your own builders with "
                                                "masks.register_mask_builder (found on sys.path or "
                                                "in the working directory)")
    rope_theta: float = knob(10000.0, "RoPE base; retrieval across L tokens needs >= 0.0424 L^1.628 "
                             "(nsa_flex.rope.min_rope_base: ~1e4 at 2k, ~3.1e5 at 16k, ~9.5e5 at 32k)")
    score_chunk: int = knob(1024, "queries per chunk in the selection scorer (memory bound: "
                                  "B*H*chunk*num_cmp floats)")
    scorer: str = knob("auto", "selection scorer: auto (the fused Triton kernel on CUDA tensors when "
                               "triton imports and the compressed branch gives its lse, else torch) | "
                               "torch (the naive reference) | triton (the fused kernel, an error where "
                               "it cannot run)")
    sel_kernel: str = knob("auto", "executor of per-position block selections (the topn, random and "
                                   "local selection builders) on the flex backend: auto (our Triton "
                                   "selected-attention op where it runs: CUDA, bf16/fp16/fp32, l_sel "
                                   "16-128; else flex) | flex (FlexAttention's template) | triton "
                                   "(the op; an error where it cannot run)")
    cmp_kernel: str = knob("auto", "executor of the compressed branch's causal mask (without "
                                   "documents; with them flex runs it) on the flex backend: auto "
                                   "(cuDNN's fused attention where it runs: CUDA, bf16/fp16, head "
                                   "dims multiples of 8 up to 256, an sm_80+ GPU; else flex) | flex "
                                   "(FlexAttention's template: slower, keeps less for the backward) "
                                   "| cudnn (an error where it cannot run) | cudnn_lean (cuDNN "
                                   "through our op, nsa_flex.ops.compressed_sdpa: keeps no packed "
                                   "copy of q and of the output for the backward -- 128 MiB a layer "
                                   "at the 125M shape, 32k, ~1.3 GiB at the paper shape -- for "
                                   "~1 ms of host time a step and a few copies)")
    recompute: str = knob("none", "branches whose keys, values and output the backward rebuilds "
                                  "from x and q instead of keeping them (activation memory for "
                                  "compute): none | win (the sliding window) | cmp_win (the "
                                  "compressed and window branches: the layer then keeps about what "
                                  "full attention keeps, the selected branch's K/V and output aside) "
                                  "| all (the three branches; the selection's block lists are kept)")
    sel_distill: float = knob(0.0, "weight of the selection-distillation loss (not in the paper; "
                                   "nsa_flex/distill.py): KL from the selected branch's dense "
                                   "attention mass per selection block to the scorer's p_slc, "
                                   "training only the compressed keys; 0 = off. Costs a dense "
                                   "causal attention forward a layer: for short-context training")
    sel_scores: str = knob("cmp", "where the top-n selection's block scores come from: cmp (the "
                                  "paper's Eq. 8-10, from the compressed attention) | indexer (not "
                                  "in the paper: a small attention of its own over the tokens, "
                                  "DeepSeek-V3.2's lightning indexer per selection block, "
                                  "nsa_flex/indexer.py; a block's score is the mass the indexer "
                                  "puts on its tokens; it learns only from sel_distill)")
    indexer_heads: int = knob(2, "query heads per KV group of the indexer (sel_scores = indexer)")
    indexer_dim: int = knob(64, "head dim of the indexer's queries and keys (sel_scores = indexer): "
                                "16 | 32 | 64 | 128")
    sel_dense_steps: int = knob(0, "dense warm-up of the selection (not in the paper): for the "
                                   "first N training steps every selection holds every earlier "
                                   "block, so the selected branch learns from every key (as full "
                                   "attention does) before the top-n rule narrows it; with "
                                   "sel_distill > 0 the scorer learns meanwhile where it looks. "
                                   "Set by the trainer (nsa-train); 0 = off")
    seed: int = knob(0, "seed of the random_selection ablation (a fresh draw per step, reproducible "
                        "per seed)")

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self, seq_len: int | None = None) -> None:
        """Every violated rule in one :class:`NSAConfigError`. With ``seq_len`` (a training run's
        sequence length) also: n_sel <= the number of selection blocks ceil(seq_len / l_sel)."""
        errs: list[str] = []
        bad: set[str] = set()  # fields already reported: rules that use them are skipped
        positive = ("dim", "n_heads", "n_kv_heads", "d_qk", "d_v", "l", "d", "l_sel", "n_sel",
                    "window", "score_chunk")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errs.append(f"{name}={v!r}: must be a positive integer (>= 1)")
                bad.add(name)
        for name in ("n_init", "n_local"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                errs.append(f"{name}={v!r}: must be a non-negative integer (>= 0)")
                bad.add(name)
        if "n_init" not in bad and self.n_init > 1:
            errs.append(f"n_init={self.n_init}: allowed values are 0 or 1 (the first block)")
            bad.add("n_init")

        def ok(*names):  # a relation is checked whenever all of its fields are valid on their own
            return not bad.intersection(names)

        if ok("n_heads", "n_kv_heads") and self.n_heads % self.n_kv_heads:
            errs.append(f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}: n_heads must be "
                        "a multiple of n_kv_heads (GQA groups)")
        if ok("l", "d") and self.l % self.d:
            errs.append(f"l={self.l}, d={self.d}: the stride d must divide the compression block l")
        if ok("l_sel", "d") and self.l_sel % self.d:
            errs.append(f"l_sel={self.l_sel}, d={self.d}: the stride d must divide the selection "
                        "block l_sel")
        if ok("n_sel", "n_init", "n_local") and self.n_sel < self.n_init + self.n_local:
            errs.append(f"n_sel={self.n_sel}: must be >= n_init + n_local = "
                        f"{self.n_init + self.n_local} (the forced blocks)")
        if seq_len is not None and ok("n_sel", "l_sel") and self.n_sel > -(-seq_len // self.l_sel):
            errs.append(f"n_sel={self.n_sel}: must be <= ceil(seq_len / l_sel) = {-(-seq_len // self.l_sel)}, "
                        f"the number of selection blocks of a {seq_len}-token sequence")
        if ok("d_qk") and self.d_qk % 2:
            errs.append(f"d_qk={self.d_qk}: must be even (RoPE rotates pairs)")
        if self.phi not in PHI_CHOICES:
            errs.append(f"phi={self.phi!r}: allowed values are {PHI_CHOICES}")
        if self.backend not in BACKEND_CHOICES:
            errs.append(f"backend={self.backend!r}: allowed values are {BACKEND_CHOICES}")
        if self.scorer not in SCORER_CHOICES:
            errs.append(f"scorer={self.scorer!r}: allowed values are {SCORER_CHOICES}")
        if self.sel_kernel not in SEL_KERNEL_CHOICES:
            errs.append(f"sel_kernel={self.sel_kernel!r}: allowed values are {SEL_KERNEL_CHOICES}")
        if self.cmp_kernel not in CMP_KERNEL_CHOICES:
            errs.append(f"cmp_kernel={self.cmp_kernel!r}: allowed values are {CMP_KERNEL_CHOICES}")
        if self.recompute not in RECOMPUTE_CHOICES:
            errs.append(f"recompute={self.recompute!r}: allowed values are {RECOMPUTE_CHOICES}")
        if (not isinstance(self.sel_distill, (int, float)) or isinstance(self.sel_distill, bool)
                or not math.isfinite(self.sel_distill) or self.sel_distill < 0):
            errs.append(f"sel_distill={self.sel_distill!r}: must be a finite number >= 0 (0 = off)")
        if self.sel_scores not in SEL_SCORES_CHOICES:
            errs.append(f"sel_scores={self.sel_scores!r}: allowed values are {SEL_SCORES_CHOICES}")
        if not isinstance(self.indexer_heads, int) or isinstance(self.indexer_heads, bool) or self.indexer_heads < 1:
            errs.append(f"indexer_heads={self.indexer_heads!r}: must be an integer >= 1")
        if self.indexer_dim not in INDEXER_DIMS:
            errs.append(f"indexer_dim={self.indexer_dim!r}: allowed values are {INDEXER_DIMS}")
        if (not isinstance(self.sel_dense_steps, int) or isinstance(self.sel_dense_steps, bool)
                or self.sel_dense_steps < 0):
            errs.append(f"sel_dense_steps={self.sel_dense_steps!r}: must be an integer >= 0 (0 = off)")
        if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            errs.append(f"rope_theta={self.rope_theta!r}: must be a positive number")
        # mask names are checked against the registry, after the user's builder modules have
        # registered theirs
        if isinstance(self.builder_modules, str):
            self.builder_modules = (self.builder_modules,)
        self.builder_modules = tuple(self.builder_modules or ())
        try:
            import_builder_modules(self.builder_modules)
        except ImportError as e:
            errs.append(f"builder_modules={list(self.builder_modules)!r}: {e}")
        if self.masks not in PRESETS:
            errs.append(f"masks={self.masks!r}: allowed presets are {sorted(PRESETS)}")
        kinds = {"cmp_mask": "compressed", "sel_mask": "selection", "win_mask": "token"}
        for name, kind in kinds.items():
            v = getattr(self, name)
            if v is not None and v not in list_mask_builders(kind):
                errs.append(f"{name}={v!r}: allowed values are {list_mask_builders(kind)}")
        if not errs and set(self.branch_masks().values()) == {"none"}:
            errs.append(f"cmp_mask={self.cmp_mask!r}, sel_mask={self.sel_mask!r}, win_mask={self.win_mask!r} "
                        f"with masks={self.masks!r}: every branch is 'none'; keep at least one branch")
        if not errs:  # the selection-training knobs need a selection that reads scores
            why = (f"a selection that reads scores (the nsa preset's topn), got sel_mask "
                   f"{self.branch_masks()['sel']!r} (masks={self.masks!r})")
            for name, v in inert_score_knobs(self).items():
                errs.append(f"{name}={v!r}: needs {why}; set {name} = {SCORE_KNOBS_OFF[name]!r}")
            if self.sel_scores == "indexer" and not self.sel_distill > 0:
                errs.append(f"sel_scores='indexer' with sel_distill={self.sel_distill}: the indexer "
                            "learns only from the distillation; set sel_distill > 0 (e.g. 1.0)")
        if errs:
            raise NSAConfigError("invalid NSAConfig:\n  - " + "\n  - ".join(errs), errs)

    # ------------------------------------------------------------------ helpers
    def branch_masks(self) -> dict[str, str]:
        """The mask builder name of each branch: preset, then per-branch overrides."""
        cmp, sel, win = PRESETS[self.masks]
        return {"cmp": self.cmp_mask or cmp, "sel": self.sel_mask or sel, "win": self.win_mask or win}

    def decode_reads(self, seq_len: int) -> int:
        """Key tokens read by one decode step at context length S (paper §5: num_cmp + n*l' + w).

        Selection reads whole selected blocks, except the query's own (forced, partly written)
        block: S when every block is selected, else n*l' minus the unwritten tail of the
        current block."""
        S = seq_len
        n_blocks = -(-S // self.l_sel)
        if n_blocks <= self.n_sel:
            sel = S
        else:
            sel = self.n_sel * self.l_sel - ((-S) % self.l_sel if self.n_local >= 1 else 0)
        return self.num_cmp(S) + sel + min(self.window, S)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NSAConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise NSAConfigError(f"unknown NSAConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)
