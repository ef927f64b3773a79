"""[compile] cudagraphs on one GPU: the default "auto" puts the compiled blocks in inductor's CUDA
graphs, and training and validation (a forward without grad, where every block call starts a new
graph generation: `NSATransformer.graph_blocks`) give the numbers of the same run without graphs."""

import pytest
import torch

from tests.titan.helpers import metrics_by_step, run_debug_trainer, seed_checkpoint

STEPS = 4
LOSS, VAL = "loss_metrics/global_avg_loss", "validation_metrics/loss"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_default_cudagraphs_train_and_validate_as_without(tmp_path):
    seed = seed_checkpoint(tmp_path / "seed")
    common = ["--compile.enable", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
              "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
              "--checkpoint.initial_load_model_only", "--checkpoint.interval", "1000",
              "--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
              "--validation.local_batch_size", "2", "--validation.seq_len", "256",
              "--validation.retrieval_docs", "3"]
    runs = {}
    for name, extra in (("auto", []), ("off", ["--compile.cudagraphs", "off"])):
        run_debug_trainer(["--job.dump_folder", str(tmp_path / name), *common, *extra], tmp_path / f"{name}.log")
        runs[name] = tmp_path / name / "metrics.jsonl"
    log = (tmp_path / "auto.log").read_text()
    assert "cudagraphs auto: on" in log and "Unable to hit fast path" not in log  # console.setup's filter
    assert "cudagraphs off" in (tmp_path / "off.log").read_text()
    graphs, plain = metrics_by_step(runs["auto"], LOSS), metrics_by_step(runs["off"], LOSS)
    assert sorted(graphs) == sorted(plain) == list(range(1, STEPS + 1))
    for step in plain:
        want = (plain[step][LOSS], plain[step]["grad_norm"])
        assert (graphs[step][LOSS], graphs[step]["grad_norm"]) == pytest.approx(want, rel=1e-5), step
    graphs, plain = metrics_by_step(runs["auto"], VAL), metrics_by_step(runs["off"], VAL)
    assert sorted(graphs) == sorted(plain) == [1, 2, 4]
    for step in plain:
        names = [k for k in plain[step] if k == VAL or k.startswith("retrieval/")]
        assert "retrieval/passkey_exact" in names
        for k in names:
            assert graphs[step][k] == pytest.approx(plain[step][k], rel=1e-5, abs=1e-6), (step, k)
