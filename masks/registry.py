"""Branch mask builders by name, and presets of one builder per NSA branch.

Contract of a branch mask builder (register your own with `register_mask_builder`):

    builder(ctx: MaskContext) -> MaskSpec | None      # None switches the branch off

`ctx` holds the layer's config and this step's inputs (sequence length, document ids and, for
selection builders, `ctx.topn()`, the scorer's top-n block indices [B, n_kv_heads, T, n_sel]).
With context parallelism the queries are a shard (`ctx.q_offset`, `ctx.q_len`) of the whole
sequence (`ctx.seq_len`, `ctx.doc_ids`): masks take positions, `ctx.topn()` has the shard's rows;
the layer sets the returned mask's query offset (`masks.core.at_offset`); a selection builder
passes `ctx.q_offset` to `selection` and `ctx.rows(...)` keeps the shard's rows of a whole-sequence
tensor.
A builder is called every step, so it may depend on the data. It must be strictly causal and,
for the selection branch, give every head of a GQA group the same mask (heads = n_kv_heads).
`kind` says which branch accepts it: "compressed" (kv index = compressed block), "selection"
(per-group token mask), or "token" (token mask; accepted by the selection and window branches).
The registry answers what a builder needs and what its mask is (`builder_info`): the layer and
the decode step ask it instead of knowing builder names.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from nsa_flex.rules import LayerShape, forced_and_valid, local_topn, pick_blocks, random_topn

from .builders import (causal, compressed_causal, doc_start, document, drop_forced, forced_parts,
                       selection, sliding_window)
from .core import MaskSpec, and_masks, offset_mask_mod


@dataclass
class MaskContext:
    cfg: LayerShape  # the layer's NSAConfig (a LayerShape), or the causality check's small one
    batch: int
    seq_len: int
    device: torch.device
    doc_ids: Tensor | None = None
    topn: Callable[[], Tensor] | None = None  # scorer -> [B, n_kv_heads, T, n_sel]
    # varies the random_selection draw: an int, or a tensor broadcastable to [B, H, T, Ns]
    step: Tensor | int = 0
    # doc_start(doc_ids) [B, T] where the caller has it already (computed once for a model's
    # layers: nsa_flex.layer.StepMasks); None: computed here from doc_ids
    starts: Tensor | None = None
    # the queries are positions q_offset .. q_offset + q_len - 1 of the seq_len (context
    # parallelism: one shard); q_len None: all of them
    q_offset: int = 0
    q_len: int | None = None

    def rows(self, x: Tensor, dim: int = 2) -> Tensor:
        """The query shard's rows of a whole-sequence tensor (positions along `dim`)."""
        if self.q_len is None or self.q_len == self.seq_len:
            return x
        return x.narrow(dim, self.q_offset, self.q_len)

    def with_docs(self, spec: MaskSpec, kv_stride: int = 1, kv_span: int = 1) -> MaskSpec:
        if self.doc_ids is None:
            return spec
        return and_masks(spec, document(self.doc_ids, kv_stride, kv_span))

    def doc_start(self) -> Tensor:
        if self.doc_ids is None:
            return torch.zeros(1, self.seq_len, dtype=torch.long, device=self.device)
        return doc_start(self.doc_ids.long()) if self.starts is None else self.starts


@dataclass(frozen=True)
class BuilderInfo:
    """A registered builder and what it needs. kind: the branches that accept it (above);
    scores: its mask reads the scorer's top-n (`ctx.topn()`), which needs the compressed branch's
    keys and lse: the layer computes them even where that branch is off; step: it reads
    `ctx.step` (a draw that varies per step); native: what its mask is in a step without
    documents, where an executor runs that mask natively ("causal": plain causal attention,
    "compressed_causal": the compressed-causal mask of the config's l, d), None for any other
    mask; decode: the branches `nsa_flex.inference` decodes it on."""
    kind: str
    fn: Callable[[MaskContext], MaskSpec | None]
    scores: bool = False
    step: bool = False
    native: str | None = None
    decode: tuple[str, ...] = ()


_REGISTRY: dict[str, BuilderInfo] = {}


class MaskBuilderError(ValueError):
    """A mask builder that cannot be registered: a name taken by another function, or a mask that
    lets a query see a future key."""


def register_mask_builder(name: str, kind: str, fn: Callable[[MaskContext], MaskSpec | None],
                          replace: bool = False, *, scores: bool = False, step: bool = False):
    """Register ``fn`` as mask builder ``name`` for ``kind`` ("compressed", "selection", "token").
    ``scores``: it calls ``ctx.topn()`` and wants the top-n scored with the compressed branch's
    lse (the layer then runs that branch even where it is off); ``step``: it reads ``ctx.step``
    (the layer then draws one per step). See `BuilderInfo`.

    Registering the same function again under its name is a no-op (a notebook cell run twice); a
    different function needs ``replace=True``. The builder is checked once, here, on a small
    random case (:func:`check_causal`): a mask that lets a query see a future key, with either
    backend's form of the mask, raises MaskBuilderError naming the builder and the first leaking
    (query, key) pair."""
    if kind not in ("compressed", "selection", "token"):
        raise ValueError(f"kind={kind!r}: allowed values are 'compressed', 'selection', 'token'")
    info = BuilderInfo(kind, fn, scores=scores, step=step)
    if name in _REGISTRY:
        if _REGISTRY[name] == info:
            return fn
        if not replace:
            raise MaskBuilderError(f"mask builder {name!r} is already registered with another function or "
                                   "kind; pass replace=True to replace it")
    check_causal(name, kind, fn)
    _REGISTRY[name] = info
    return fn


def _register_builtin(name: str, kind: str, fn, **info) -> None:
    # built-ins: covered by tests/masks/test_causality.py (hypothesis), not checked at import
    _REGISTRY[name] = BuilderInfo(kind, fn, **info)


def _random_topn(cfg, B: int, T: int, starts: Tensor, gen: torch.Generator) -> Tensor:
    valid, forced = forced_and_valid(cfg, T, starts, "cpu")
    scores = torch.rand(B, cfg.n_kv_heads, T, valid.shape[-1], generator=gen)
    return pick_blocks(scores, valid.unsqueeze(1), forced.unsqueeze(1), cfg.n_sel)


def _first_leak(allowed: Tensor, q_tok: Tensor, key_end: Tensor) -> tuple[int, int] | None:
    """First (query token, key index) with allowed[..., row, key] where the key ends after the
    query; allowed [B, H, rows, S], q_tok [rows] (token of each row), key_end [S]."""
    leak = allowed.bool() & (key_end.view(1, 1, 1, -1) > q_tok.view(1, 1, -1, 1))
    if not leak.any():
        return None
    _, _, r, k = leak.nonzero().unbind(-1)
    i = torch.argmin(q_tok[r] * (key_end.numel() + 1) + k)
    return int(q_tok[r[i]]), int(k[i])


def check_config() -> LayerShape:
    """The small layer `check_causal` runs a builder on: `nsa_flex.rules.LayerShape`, the fields of
    `NSAConfig` a builder reads from `ctx.cfg` (its base class; masks never imports the config)."""
    return LayerShape(dim=8, n_heads=4, n_kv_heads=2, d_qk=8, d_v=8, l=4, d=2, l_sel=4, n_sel=3,
                      n_init=1, n_local=1, window=5)


def check_causal(name: str, kind: str, fn, T: int = 19, seed: int = 0) -> None:
    """Run builder ``fn`` on a small random case (B=2, T tokens, with and without documents, random
    top-n blocks) and check both backends' forms of its mask: the dense mask of the reference
    backend, and the BlockMask of flex (block lists, mask_mod inside partial blocks, the packed
    layout of per-group masks). Key index = token for token masks, compressed block j (its last
    token j*d + l - 1) for compressed masks. Raises MaskBuilderError naming the builder and the
    first leaking (query, key) pair."""
    cfg = check_config()
    gen = torch.Generator().manual_seed(seed)
    B = 2
    docs = torch.sort(torch.randint(0, 3, (B, T), generator=gen), dim=-1).values
    for doc_ids in (None, docs):
        starts = doc_start(doc_ids) if doc_ids is not None else torch.zeros(1, T, dtype=torch.long)
        idx = _random_topn(cfg, B, T, starts, gen)
        ctx = MaskContext(cfg, B, T, torch.device("cpu"), doc_ids=doc_ids, topn=lambda: idx)
        try:
            spec = fn(ctx)
        except Exception as e:
            raise MaskBuilderError(f"mask builder {name!r} failed on the causality check's small random case "
                                   f"(B={B}, T={T}): {type(e).__name__}: {e}") from e
        if spec is None:
            continue
        S = cfg.num_cmp(T) if kind == "compressed" else T
        key_end = torch.arange(S) * (cfg.d if kind == "compressed" else 1) + (cfg.l - 1 if kind == "compressed" else 0)
        where = "" if doc_ids is None else " (with documents)"
        leak = _first_leak(spec.dense(B, T, S), torch.arange(T), key_end)
        if leak is None:  # the flex form: block lists + mask_mod, packed rows for per-group masks
            # (on GPU flex attends each part of a split mask on its own: every part is checked)
            for form in (spec, *(spec.parts or ())):
                leak = _first_leak_flex(form, cfg, B, T, S, key_end)
                if leak is not None:
                    break
            where = " in flex's BlockMask" + where
        else:
            where = " in the reference backend's dense mask" + where
        if leak is not None:
            q, k = leak
            what = f"compressed key {k} (tokens up to {int(key_end[k])})" if kind == "compressed" else f"key {k}"
            raise MaskBuilderError(
                f"mask builder {name!r} (kind {kind!r}) is not causal: query {q} sees {what}{where}, "
                f"on a random case of B={B}, T={T}. A builder must never let a query see a later token")


def _first_leak_flex(spec, cfg, B, T, S, key_end):
    """First (query, key) that flex's BlockMask of `spec` lets through after its key's time."""
    G = cfg.group_size if spec.per_group else 1
    q_tok = torch.arange(T * G) // G + spec.q_offset
    return _first_leak(flex_allowed(spec, cfg, B, T, S), q_tok, key_end)


def flex_allowed(spec, cfg, B, T, S, compact: bool = False) -> Tensor:
    """What flex's BlockMask of `spec` lets each of T query rows (packed: T * G rows for a
    per-group mask) see of S keys, bool [B|1, H|1, rows, S]: listed blocks & mask_mod, full
    blocks whole. compact: the BlockMask of the spec's compact builder (what a GPU runs), built
    here on the CPU."""
    G = cfg.group_size if spec.per_group else 1
    # the packed layout: q blocks of whole positions (lcm(G, 16) rows), kv blocks of the mask's
    # block length (flex's tiles are checked by the layer, the lists and mask_mod here)
    bs = (math.lcm(G, 16), spec.kv_block or 16) if spec.per_group else (16, 16)
    if compact:
        bm = spec.compact(T, S, bs, G, "cpu", None, None,
                          offset_mask_mod(spec.mask_mod, spec.q_offset))
    else:
        bm = spec.block_mask(B, T, S, device="cpu", block_size=bs, q_pack=G)
    QB, KB = bm.BLOCK_SIZE
    rows = T * G

    def expand(blocks):
        return blocks.repeat_interleave(QB, -2).repeat_interleave(KB, -1)[..., :rows, :S].bool()

    def listed(num, idx):  # row-wise lists [.., NQB, W] -> block flags [.., NQB, NKB]
        nkb = -(-S // KB)  # (the compact lists' width W is not NKB: no BlockMask.to_dense)
        slot = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
        flags = torch.zeros(*idx.shape[:-1], nkb + 1, dtype=torch.bool)
        return flags.scatter_(-1, torch.where(slot, idx.long(), nkb), True)[..., :nkb]

    n_b, n_h = bm.kv_num_blocks.shape[:2]
    b = torch.arange(n_b).view(-1, 1, 1, 1)
    h = torch.arange(n_h).view(1, -1, 1, 1)
    r = torch.arange(rows).view(1, 1, -1, 1)
    kv = torch.arange(S).view(1, 1, 1, -1)
    allowed = expand(listed(bm.kv_num_blocks, bm.kv_indices)) & bm.mask_mod(b, h, r, kv)
    if bm.full_kv_num_blocks is not None:  # full blocks: mask_mod is not evaluated there
        allowed = allowed | expand(listed(bm.full_kv_num_blocks, bm.full_kv_indices))
    return allowed


def import_builder_modules(names) -> None:
    """Import the modules ``names`` (each registering its builders on import), looking in the
    working directory too (``nsa-train`` is a console script: its ``sys.path`` lacks it). Raises
    ImportError naming the module and the reason."""
    import importlib
    import os
    import sys

    for name in names:
        if name in sys.modules:
            continue
        cwd = os.getcwd()
        added = cwd not in sys.path
        if added:
            sys.path.append(cwd)
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name.split(".")[0] and e.name != name:
                raise ImportError(f"builder module {name!r} fails to import: {e}") from e
            raise ImportError(f"no module {name!r} in the working directory {cwd} or on sys.path") from e
        except Exception as e:  # the user's module raised: where, and what
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            raise ImportError(f"builder module {name!r} fails to import: {type(e).__name__}: {e} "
                              f"({where.filename}:{where.lineno})") from e
        finally:
            if added and cwd in sys.path:
                sys.path.remove(cwd)


def builder_info(name: str) -> BuilderInfo:
    """What the registry knows of builder `name` (`BuilderInfo`); KeyError for an unknown name."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown mask builder {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def get_mask_builder(name: str) -> Callable[[MaskContext], MaskSpec | None]:
    return builder_info(name).fn


def list_mask_builders(branch: str | None = None, decode: str | None = None) -> list[str]:
    """Builder names a branch accepts: "compressed", "selection" (selection + token builders),
    "token" (window branch), or all; decode: only those the decode step supports on that branch
    ("cmp", "sel", "win")."""
    ok = {None: ("compressed", "selection", "token"), "compressed": ("compressed",),
          "selection": ("selection", "token"), "token": ("token",)}[branch]
    return sorted(n for n, i in _REGISTRY.items() if (i.kind in ok or n == "none")
                  and (decode is None or decode in i.decode))


# ---------------------------------------------------------------------- built-in builders
def _none(ctx):
    return None


def _causal(ctx):
    return ctx.with_docs(causal())


def _sliding(ctx):
    return ctx.with_docs(sliding_window(ctx.cfg.window))


def _compressed(ctx):
    c = ctx.cfg
    return ctx.with_docs(compressed_causal(c.l, c.d), kv_stride=c.d, kv_span=c.l)


def _topn(ctx):
    return selection_parts(ctx, ctx.topn())


def selection_parts(ctx, idx: Tensor) -> MaskSpec:
    """The selection mask of the picked blocks idx [B, H, T, n] (every forced block among them,
    as `nsa_flex.rules.pick_blocks` guarantees), with the same mask as disjoint parts: the forced
    blocks (static bands with ordinary q blocks and GQA, `forced_parts`) and the rest. Why split:
    packed with the rest, block 0 makes one dK/dV program walk every query (two thirds of the
    branch's backward at 64k)."""
    c, o = ctx.cfg, ctx.q_offset
    whole = ctx.with_docs(selection(idx, c.l_sel, o))
    starts = None if ctx.doc_ids is None else ctx.doc_start()
    forced = forced_parts(c.l_sel, c.n_init, c.n_local, starts)
    if not forced:
        return whole
    rows = None if starts is None else ctx.rows(starts, dim=1)
    rest = selection(drop_forced(idx, c.l_sel, c.n_init, c.n_local, rows, o), c.l_sel, o)
    return dataclasses.replace(whole, parts=tuple(ctx.with_docs(p) for p in (*forced, rest)))


def _random(ctx):
    idx = random_topn(ctx.cfg, ctx.batch, ctx.seq_len, ctx.doc_start(), ctx.step, ctx.device)
    return selection_parts(ctx, ctx.rows(idx))


def _local(ctx):
    idx = local_topn(ctx.cfg, ctx.batch, ctx.seq_len, ctx.doc_start(), ctx.device)
    return selection_parts(ctx, ctx.rows(idx))


_register_builtin("none", "token", _none, decode=("cmp", "sel", "win"))
_register_builtin("causal", "token", _causal, native="causal", decode=("sel",))
_register_builtin("sliding_window", "token", _sliding, decode=("win",))
_register_builtin("compressed_causal", "compressed", _compressed, native="compressed_causal",
                  decode=("cmp",))
_register_builtin("topn", "selection", _topn, scores=True, decode=("sel",))
_register_builtin("random_selection", "selection", _random, step=True)
_register_builtin("local_selection", "selection", _local, decode=("sel",))

# preset name -> (compressed branch, selection branch, window branch) builder names
PRESETS: dict[str, tuple[str, str, str]] = {
    "nsa": ("compressed_causal", "topn", "sliding_window"),
    "full_causal": ("none", "causal", "none"),
    "sliding_only": ("none", "none", "sliding_window"),
    "random_selection": ("compressed_causal", "random_selection", "sliding_window"),
    "local_selection": ("compressed_causal", "local_selection", "sliding_window"),
    "no_compressed": ("none", "topn", "sliding_window"),
}
