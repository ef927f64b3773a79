"""parallelize_fn for the NSA decoder: activation checkpointing -> per-block torch.compile -> FSDP2 / DDP.

Reuses torchtitan's llama3 helpers: ``apply_ac`` (modes full / selective layer / selective op /
memory_budget, with llama3's op save list, which already saves flex_attention), ``apply_fsdp``
(``fully_shard`` on the embedding, every block, norm+output, and the root; mixed precision from
``[training] mixed_precision_param/reduce``) and ``apply_ddp``. Each block is compiled as llama3's
``apply_compile`` does (fullgraph=True), with ``[compile] combo_kernels`` passed to inductor
(:func:`compile_blocks`). Context parallelism (``[parallelism] context_parallel_degree``) is ours,
not torchtitan's ring attention: every layer gets this rank's contiguous sequence shard
(`nsa_flex.context_parallel`, `set_seq_shard`), the trainer and the validator shard inputs and
labels (:func:`shard_batch`), FSDP shards over data and context ranks (torchtitan's "fsdp" mesh).
Tensor and pipeline parallelism are not supported.

Masks: what every layer shares (``nsa_flex.layer.StepMasks``: RoPE, documents, the compressed and
window masks) is built once a step outside the blocks and is an input of each compiled block; the
selection is computed inside each block from its activations. A block's graph has no host sync and
no data-dependent shape (fullgraph=True fails on either), so a CUDA graph replay of it recomputes
everything from its inputs. CUDA graphs come from one place, ``[compile] cudagraphs`` (inductor's,
per block; "auto": on for one CUDA process); the compile backend "cudagraphs" and inductor's global
``triton.cudagraphs`` (``TORCHINDUCTOR_CUDAGRAPHS=1``; llama3's ``apply_compile`` passes no
``mode``) are a :class:`CompileConfigError` naming it.
"""

import torch
from torch import nn

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_ddp, apply_fsdp
from torchtitan.tools.logging import logger

from nsa_flex.context_parallel import shard_of, split_seq
from nsa_flex.errors import UserError

from .model import NSATransformer, set_seq_shard


class CompileConfigError(UserError, ValueError):
    """A compile setting nsa_flex does not run: CUDA graphs other than ``[compile] cudagraphs``."""


def check_no_cudagraphs(backend: str) -> None:
    """CUDA graphs are neither the compile backend nor on in inductor globally (they come from
    ``[compile] cudagraphs`` alone); else :class:`CompileConfigError`."""
    if "cudagraph" in backend:
        raise CompileConfigError(f"compile.backend={backend!r}: CUDA graphs for the blocks come from inductor "
                                 "with [compile] cudagraphs (\"auto\" or \"on\"); use inductor")
    import torch._inductor.config as inductor_config

    if inductor_config.triton.cudagraphs:
        raise CompileConfigError("inductor's triton.cudagraphs is on (TORCHINDUCTOR_CUDAGRAPHS=1?): it would put "
                                 "every compiled function in CUDA graphs; unset it: [compile] cudagraphs (\"auto\": "
                                 "on for one CUDA process) puts the blocks in graphs")


CUDAGRAPHS_CHOICES = ("auto", "on", "off")


def cudagraphs_choice(compile_cfg, world_size: int, cuda: bool) -> tuple[bool, str]:
    """Whether the blocks run in inductor's CUDA graphs ([compile] cudagraphs), and why, for the
    log. They can run with backend inductor in one process (FSDP gathers the parameters into new
    memory every step, which a graph replay cannot follow) on CUDA: "auto" takes them there, "on"
    is a :class:`CompileConfigError` elsewhere (on a CPU inductor runs the blocks without graphs)."""
    value = compile_cfg.cudagraphs
    if isinstance(value, bool):  # a TOML true / false
        value = "on" if value else "off"
    if value not in CUDAGRAPHS_CHOICES:
        raise CompileConfigError(f"compile.cudagraphs={value!r}: allowed {', '.join(map(repr, CUDAGRAPHS_CHOICES))}")
    if value == "off":
        return False, "cudagraphs off"
    blockers = [f"backend {compile_cfg.backend!r}"] if compile_cfg.backend != "inductor" else []
    blockers += [f"{world_size} processes"] if world_size > 1 else []
    if value == "on":
        if blockers:
            raise CompileConfigError(f"compile.cudagraphs='on' needs backend inductor and one process (got "
                                     f"{' and '.join(blockers)}); use 'auto' or 'off'")
        return True, "cudagraphs on"
    blockers += [] if cuda else ["no CUDA"]
    return not blockers, f"cudagraphs auto: {'off, ' + ', '.join(blockers) if blockers else 'on'}"


def compile_options(compile_cfg, graphs: bool) -> dict | None:
    """Inductor's options for the blocks from [compile]: combo_kernels, and triton.cudagraphs where
    ``graphs`` (`cudagraphs_choice`); None for another backend."""
    if compile_cfg.backend != "inductor":
        return None
    options = {"combo_kernels": compile_cfg.combo_kernels}
    if graphs:
        options["triton.cudagraphs"] = True
    return options


def compile_blocks(model: nn.Module, compile_cfg, world_size: int = 1, cuda: bool | None = None) -> None:
    """torch.compile each transformer block with fullgraph=True (llama3's ``apply_compile``), and
    for the inductor backend with the options of [compile] (`compile_options`): combo kernels (the
    NSA layer's many small kernels in fewer, larger launches) and CUDA graphs, both for where the
    host's launch rate bounds a step (short sequences). ``cuda``: whether the blocks run on CUDA
    (default: whether it is available)."""
    graphs, why = cudagraphs_choice(compile_cfg, world_size, torch.cuda.is_available() if cuda is None else cuda)
    options = compile_options(compile_cfg, graphs)
    model.graph_blocks = graphs
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, backend=compile_cfg.backend,
                                                             fullgraph=True, options=options))
    logger.info("Compiling each TransformerBlock with torch.compile (%s; %s)",
                ", ".join(f"{k}={v}" for k, v in options.items()) if options else compile_cfg.backend, why)


def cpu_data_parallel_problem(parallelism, world_size: int, cuda: bool) -> str | None:
    """Several processes without CUDA communicate through gloo, which lacks the PREMUL_SUM
    reduction FSDP uses: they need DDP. The message says what to set; None when fine."""
    if cuda or world_size <= 1 or parallelism.data_parallel_shard_degree == 1:
        return None
    return (f"{world_size} processes without CUDA (gloo) cannot use FSDP (parallelism.data_parallel_shard_degree="
            f"{parallelism.data_parallel_shard_degree}; gloo lacks its PREMUL_SUM reduction): use DDP with "
            f"--parallelism.data_parallel_replicate_degree {world_size} --parallelism.data_parallel_shard_degree 1 "
            f"(or [parallelism] data_parallel_replicate_degree = {world_size}, data_parallel_shard_degree = 1)")


def sum_reductions_on_gloo(model: nn.Module) -> None:
    """FSDP on gloo (CPU; FSDP over the context-parallel ranks): gloo lacks PREMUL_SUM, which FSDP
    uses for torchtitan's gradient divide factor 1.0; plain SUM reductions give the same sums."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def owns_context_parallel(model: nn.Module) -> bool:
    """Whose context parallelism shards ``model``'s inputs (the trainer's and the validator's rule):
    nsa_flex's (:func:`shard_batch`) for the NSA model, whose layers all-gather keys and values;
    torchtitan's (zig-zag shards and position ids for its ring attention) for any other model,
    e.g. the llama3 baseline (`nsa_flex.titan.llama3_baseline`)."""
    return isinstance(model, NSATransformer)


def shard_batch(model: nn.Module, input_dict: dict, labels: torch.Tensor):
    """Context parallelism's ``post_dataloading_process`` (the trainer's and the validator's): this
    rank's contiguous shard (`model.seq_shard`) of the inputs and labels, as torchtitan's
    (inputs, labels, extra_inputs, extra_kwargs); no position ids, no masks (the layers build
    theirs) and none of torchtitan's zig-zag sharding. The layers all-gather the keys and values
    they read."""
    shard = model.seq_shard
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    return split_seq(input_dict["input"], shard), split_seq(labels, shard), extra_inputs, {}


def parallelize_nsa(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    if parallel_dims.tp_enabled or parallel_dims.pp_enabled:
        raise NotImplementedError("nsa_flex supports data and context parallelism only (no TP / PP)")
    problem = cpu_data_parallel_problem(job_config.parallelism, parallel_dims.world_size, torch.cuda.is_available())
    if problem:
        raise UserError(problem)
    if parallel_dims.cp_enabled:  # before AC and compile wrap the blocks
        set_seq_shard(model, shard_of(parallel_dims.get_mesh("cp").get_group()))
        logger.info("Context parallelism: %d contiguous sequence shards (nsa_flex.context_parallel)",
                    parallel_dims.cp)

    compile_cfg = job_config.compile
    model_compile_enabled = compile_cfg.enable and "model" in compile_cfg.components

    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=model_compile_enabled,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )

    if model_compile_enabled:
        check_no_cudagraphs(compile_cfg.backend)
        compile_blocks(model, compile_cfg, parallel_dims.world_size)  # per block, fullgraph=True

    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        if not torch.cuda.is_available():
            sum_reductions_on_gloo(model)
        logger.info("Applied %s to the model", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP")
    elif parallel_dims.dp_replicate_enabled:
        mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != mesh.size():
            raise RuntimeError("DDP has not supported > 1D parallelism")
        apply_ddp(model, mesh, enable_compile=model_compile_enabled)
    return model
