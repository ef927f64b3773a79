"""The NSA torchtitan model: flavors, [nsa] section -> model args, FLOPs, parallelize_fn (AC, compile)."""

import copy

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

from nsa_flex.config import NSAConfigError
from nsa_flex.flops import full_attention_flops, nsa_attention_flops
from nsa_flex.titan.args import NSAModelArgs, nsa_flex_args
from nsa_flex.data.documents import doc_ids_from_tokens
from nsa_flex.titan.model import NSATransformer
from nsa_flex.titan.parallelize import compile_blocks, parallelize_nsa

CFG = "nsa_flex.titan.job_config"


def job(*args):
    return ConfigManager().parse_args(["--job.custom_config_module", CFG, *args])


def args_for(*cli, flavor="debugmodel"):
    a = nsa_flex_args[flavor]
    a.update_from_config(job("--model.flavor", flavor, *cli))
    return a


def build(a: NSAModelArgs, seed=0) -> NSATransformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = NSATransformer(a)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights()
    return m


def test_job_config_nsa_section_and_defaults():
    cfg = job("--nsa.l", "16", "--nsa.masks", "full_causal")
    assert cfg.nsa.l == 16 and cfg.nsa.masks == "full_causal" and cfg.nsa.d is None
    assert (cfg.model.name, cfg.model.flavor, cfg.model.tokenizer) == ("nsa_flex", "debugmodel", "byte")
    assert cfg.training.dataset == "passkey" and cfg.experimental.custom_import == "nsa_flex.titan.train_spec"
    with pytest.raises(SystemExit):  # unknown keys are rejected
        job("--nsa.block_size", "3")


def test_toml_nsa_section(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[job]\ncustom_config_module = "nsa_flex.titan.job_config"\n'
                 '[model]\nflavor = "debugmodel"\n[nsa]\nwindow = 64\nphi = "mlp"\nsel_mask = "local_selection"\n')
    cfg = ConfigManager().parse_args(["--job.config_file", str(f), "--nsa.n_sel", "5"])
    a = nsa_flex_args["debugmodel"]
    a.update_from_config(cfg)
    c = a.nsa_config()
    assert (c.window, c.phi, c.sel_mask, c.n_sel, c.l) == (64, "mlp", "local_selection", 5, 8)


def test_flavors_fresh_copies_and_unknown_flavor():
    a = nsa_flex_args["debugmodel"]
    a.window = 999
    assert nsa_flex_args["debugmodel"].window == 32
    with pytest.raises(KeyError, match=r"\[model\] flavor='7B': unknown nsa_flex flavor; allowed values "
                                       r"are .*'125M'.*'1B'.*'350M'.*'debugmodel'") as e:
        nsa_flex_args["7B"]
    assert str(e.value).startswith("[model] flavor='7B'")  # the message, not a KeyError repr


def test_update_from_config():
    a = args_for("--training.seq_len", "128")
    assert a.vocab_size == 320 and a.eos_id == 257 and a.max_seq_len == 128  # byte vocab 258 -> x64
    assert (a.l, a.d, a.l_sel, a.n_sel, a.window) == (8, 4, 16, 4, 32)  # flavor values kept
    if not torch.cuda.is_available():
        assert a.backend == "reference"  # auto -> reference on a CPU-only machine
    b = args_for("--nsa.window", "64", "--nsa.masks", "sliding_only", "--nsa.doc_masking", "True")
    assert (b.window, b.masks, b.doc_masking) == (64, "sliding_only", True)


def test_invalid_nsa_settings_name_the_fields():
    with pytest.raises(NSAConfigError, match=r"\[nsa\] l=8, d=3"):
        args_for("--nsa.d", "3")
    with pytest.raises(NSAConfigError, match=r"\[nsa\] window=-3: must be a positive integer"):
        args_for("--nsa.window", "-3")
    with pytest.raises(NSAConfigError, match=r"masks='bogus'"):
        args_for("--nsa.masks", "bogus")
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree"):
        args_for("--parallelism.tensor_parallel_degree", "2")


def test_one_toml_for_every_variant_turns_the_selection_training_off(caplog, monkeypatch):
    """[nsa] selection-training knobs (an NSA recipe) with --nsa.masks full_causal / sliding_only:
    off for that run, named in one warning; under nsa they apply; an invalid combination that does
    not depend on the variant (the indexer without the distillation) still fails."""
    import nsa_flex.titan.args as args_module

    monkeypatch.setattr(args_module, "_said", set())  # what earlier tests made it say
    recipe = ("--nsa.sel_scores", "indexer", "--nsa.sel_distill", "1.0", "--nsa.sel_dense_steps", "50")
    a = args_for(*recipe)
    assert (a.sel_scores, a.sel_distill, a.sel_dense_steps) == ("indexer", 1.0, 50)
    for masks in ("full_causal", "sliding_only"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            a = args_for(*recipe, "--nsa.masks", masks)
        assert (a.sel_scores, a.sel_distill, a.sel_dense_steps) == ("cmp", 0.0, 0)
        said = [r.getMessage() for r in caplog.records if "not apply" in r.getMessage()]
        assert len(said) == 1 and f"masks='{masks}'" in said[0], said
        assert "sel_distill=1.0, sel_scores='indexer', sel_dense_steps=50 do not apply" in said[0], said
        caplog.clear()
        with caplog.at_level("WARNING"):
            args_for(*recipe, "--nsa.masks", masks)  # the same run's config again: said once
        assert not [r for r in caplog.records if "not apply" in r.getMessage()]
    with pytest.raises(NSAConfigError, match="sel_scores='indexer' with sel_distill=0"):
        args_for("--nsa.sel_scores", "indexer")


@pytest.mark.parametrize("flavor,lo,hi", [("125M", 150e6, 170e6), ("350M", 370e6, 390e6), ("1B", 1.0e9, 1.3e9)])
def test_flavor_sizes(flavor, lo, hi):
    a = nsa_flex_args[flavor]
    a.vocab_size = 50304  # gpt2 padded
    with torch.device("meta"):
        m = NSATransformer(a)
    n = sum(p.numel() for p in m.parameters())
    assert lo < n < hi, n


def test_flops_count_nsa_not_full_attention():
    a = nsa_flex_args["125M"]
    a.backend = "reference"
    with torch.device("meta"):
        m = NSATransformer(a)
    seq = 8192
    n, flops = a.get_nparams_and_flops(m, seq)
    emb = m.tok_embeddings.weight.numel()
    nsa = nsa_attention_flops(a.nsa_config(), seq)
    assert n == sum(p.numel() for p in m.parameters())
    assert flops == int(6 * (n - emb) + 3 * a.n_layers * nsa / seq)
    full = full_attention_flops(a.nsa_config(), seq)
    assert nsa < full / 2  # sparse at 8k: far below causal full attention
    b = copy.deepcopy(a)
    b.masks = "full_causal"
    _, flops_full = b.get_nparams_and_flops(m, seq)
    assert flops_full > flops


def test_doc_ids_from_tokens():
    t = torch.tensor([[5, 9, 7, 9, 9, 1], [9, 2, 3, 4, 9, 6]])
    assert doc_ids_from_tokens(t, 9).tolist() == [[0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 2]]


def test_doc_masking_isolates_documents():
    a = args_for("--nsa.doc_masking", "True", "--training.seq_len", "64")
    m = build(a)
    eos = a.eos_id
    x = torch.randint(0, 256, (1, 64))
    x[0, 30] = eos
    y = x.clone()
    y[0, :30] = torch.randint(0, 256, (30,))  # change the first document only
    with torch.no_grad():
        ox, oy = m(x), m(y)
    assert torch.allclose(ox[0, 31:], oy[0, 31:], atol=1e-5)  # the second document does not see it
    assert not torch.allclose(ox[0, :30], oy[0, :30])


def _parallel_dims():
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def _loss_and_grads(model, x):
    model.zero_grad()
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), x.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode,option", [("full", "2"), ("selective", "2"), ("selective", "op")])
def test_activation_checkpointing_matches(mode, option):
    a = args_for("--training.seq_len", "128")
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _loss_and_grads(build(a), x)
    m = build(a)
    cfg = job("--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option)
    m = parallelize_nsa(m, _parallel_dims(), cfg)
    wrapped = sum("checkpoint" in type(b).__name__.lower() for b in m.layers.values())
    assert wrapped >= 1, [type(b).__name__ for b in m.layers.values()]
    loss, grads = _loss_and_grads(m, x)
    assert torch.equal(loss, ref_loss)
    strip = lambda k: k.replace("_checkpoint_wrapped_module.", "")
    grads = {strip(k): v for k, v in grads.items()}
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)


def test_compile_per_block_fullgraph():
    """parallelize_fn compiles every block with fullgraph=True (a graph break would raise). CPU CI
    uses the aot_eager backend on the reference path; inductor + flex is the GPU path."""
    torch._dynamo.reset()
    a = args_for("--training.seq_len", "64")
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(build(a), x)
    m = build(a)
    # with torchtitan's default AC (selective, every 2nd block) under the compiled blocks
    cfg = job("--compile.enable", "--compile.backend", "aot_eager")
    assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option) == ("selective", "2")
    m = parallelize_nsa(m, _parallel_dims(), cfg)
    assert all(type(b).__name__ == "OptimizedModule" for b in m.layers.values())
    loss, grads = _loss_and_grads(m, x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    grads = {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): v for k, v in grads.items()}
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)
    with pytest.raises(ValueError, match="CUDA graphs"):
        parallelize_nsa(build(a), _parallel_dims(), job("--compile.enable", "--compile.backend", "cudagraphs"))


@pytest.mark.parametrize("cli,options", [((), {"combo_kernels": True}),
                                         (("--compile.no_combo_kernels",), {"combo_kernels": False}),
                                         (("--compile.cudagraphs", "on"),
                                          {"combo_kernels": True, "triton.cudagraphs": True}),
                                         (("--compile.backend", "aot_eager"), None)])
def test_compile_options_from_config(monkeypatch, cli, options):
    """Every block is compiled with fullgraph=True and, on inductor, [compile] combo_kernels (on by
    default: fewer launches where the host bounds a step); other backends get no inductor options.
    On this CPU the default cudagraphs "auto" leaves the graphs off."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda block, **kw: seen.append(kw) or block)
    a = args_for("--training.seq_len", "64")
    parallelize_nsa(build(a), _parallel_dims(), job("--compile.enable", *cli))
    backend = "aot_eager" if "aot_eager" in cli else "inductor"
    assert seen == [dict(backend=backend, fullgraph=True, options=options)] * a.n_layers


@pytest.mark.parametrize("cli", [(), ("--nsa.doc_masking", "True"), ("--nsa.masks", "full_causal")])
def test_shared_step_masks_equal_per_layer_masks(cli):
    """The model builds the masks every layer shares once a forward (StepMasks); loss and every
    gradient equal, bit for bit, those of the same blocks each building its own masks."""
    a = args_for("--training.seq_len", "64", *cli)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    x[:, 20] = a.eos_id
    m = build(a)
    loss, grads = _loss_and_grads(m, x)

    def own_masks(tokens):  # the model's forward, each layer building its own masks
        doc_ids = doc_ids_from_tokens(tokens, a.eos_id) if a.doc_masking else None
        h = m.tok_embeddings(tokens)
        for blk in m.layers.values():
            h = blk(h, attend=lambda y, blk=blk: blk.attention(y, doc_ids))
        return m.output(m.norm(h))

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, tokens):
            return own_masks(tokens)

    ref_loss, ref_grads = _loss_and_grads(Own(), x)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == {k.removeprefix("m."): None for k in ref_grads}.keys()
    for k, g in grads.items():
        assert torch.equal(g, ref_grads["m." + k]), k


@pytest.mark.parametrize("cli,world_size,cuda,graphs,why", [
    ((), 1, True, True, "cudagraphs auto: on"),
    ((), 2, True, False, "cudagraphs auto: off, 2 processes"),
    ((), 1, False, False, "cudagraphs auto: off, no CUDA"),
    (("--compile.backend", "aot_eager"), 1, True, False, "cudagraphs auto: off, backend 'aot_eager'"),
    (("--compile.cudagraphs", "on"), 1, True, True, "cudagraphs on"),
    (("--compile.cudagraphs", "on"), 1, False, True, "cudagraphs on"),
    (("--compile.cudagraphs", "off"), 1, True, False, "cudagraphs off")])
def test_cudagraphs_auto_where_they_can_run(cli, world_size, cuda, graphs, why):
    """[compile] cudagraphs "auto" (the default) puts the blocks in inductor's CUDA graphs where they
    can run: backend inductor, one process (FSDP's gathered parameters move every step), CUDA."""
    from nsa_flex.titan.parallelize import compile_options, cudagraphs_choice

    cfg = job("--compile.enable", *cli).compile
    assert cudagraphs_choice(cfg, world_size, cuda) == (graphs, why)
    options = compile_options(cfg, graphs)
    assert (options or {}).get("triton.cudagraphs", False) is graphs


@pytest.mark.parametrize("cli,match", [
    (("--compile.cudagraphs", "on", "--compile.backend", "aot_eager"),
     "compile.cudagraphs='on' needs backend inductor and one process \\(got backend 'aot_eager'\\)"),
    (("--compile.cudagraphs", "yes"), "compile.cudagraphs='yes': allowed 'auto', 'on', 'off'")])
def test_cudagraphs_on_where_they_cannot_run_or_unknown_is_one_error(cli, match):
    from nsa_flex.titan.parallelize import CompileConfigError, cudagraphs_choice

    with pytest.raises(CompileConfigError, match=match):
        cudagraphs_choice(job("--compile.enable", *cli).compile, 1, True)
    with pytest.raises(CompileConfigError, match="needs backend inductor and one process \\(got 2 processes\\)"):
        cudagraphs_choice(job("--compile.enable", "--compile.cudagraphs", "on").compile, 2, True)


@pytest.mark.parametrize("value,graphs", [("true", True), ("false", False)])
def test_cudagraphs_toml_bool_reads_as_on_or_off(tmp_path, value, graphs):
    from nsa_flex.titan.parallelize import cudagraphs_choice

    toml = tmp_path / "job.toml"
    toml.write_text(f'[job]\ncustom_config_module = "{CFG}"\n[compile]\ncudagraphs = {value}\n')
    cfg = ConfigManager().parse_args(["--job.config_file", str(toml)]).compile
    assert cudagraphs_choice(cfg, 1, True)[0] is graphs
    assert cudagraphs_choice(cfg, 1, False)[0] is graphs  # "on" on a CPU: inductor runs without graphs


def test_step_masks_without_documents_built_once_per_shape():
    """Without documents the step's masks are a function of the shape: the model builds them for
    the first step and reuses them (the same object) while (B, T) stays; with documents every step."""
    m = build(args_for("--training.seq_len", "64"))
    x = torch.randint(0, 256, (2, 64))
    first = m.step_masks(x)
    assert m.step_masks(x.flip(1)) is first
    assert m.step_masks(x[:, :32]) is not first and m.step_masks(x[:1]) is not first
    d = build(args_for("--training.seq_len", "64", "--nsa.doc_masking", "True"))
    assert d.step_masks(x) is not d.step_masks(x)


def test_blocks_in_cuda_graphs_copy_their_output_out_of_the_pool_without_grad():
    """[compile] cudagraphs: without grad, every block call may start a new graph generation that
    overwrites the previous block's output (inductor's pool) before the next block reads it. A
    stand-in pool: each block writes into one shared buffer after clearing it (a new generation).
    With graph_blocks the model's logits equal the eager model's; without, the stand-in breaks it."""
    m = build(args_for())
    tokens = torch.randint(0, 64, (1, 64))
    with torch.no_grad():
        want = m(tokens)
    pool = {}

    def pooled(block):
        def call(h, masks=None):
            buf = pool.setdefault("out", torch.empty_like(h))
            buf.zero_()  # a new generation reuses the pool: h, if the last block's output, is gone
            return buf.copy_(block(h, masks))
        return call

    class Pooled(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block, self.call = block, pooled(block)

        def forward(self, h, masks=None):
            return self.call(h, masks)

    for name, block in list(m.layers.named_children()):
        m.layers.register_module(name, Pooled(block))
    with torch.no_grad():
        assert not torch.equal(m(tokens), want)  # the stand-in does overwrite
        m.graph_blocks = True
        torch.testing.assert_close(m(tokens), want)
    m2 = build(args_for())
    compile_blocks(m2, job("--compile.cudagraphs", "on").compile)  # compiles lazily: nothing runs here
    assert m2.graph_blocks
