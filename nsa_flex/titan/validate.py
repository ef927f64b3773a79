"""Validator on nsa_flex's datasets, with nsa_flex's context parallelism.

torchtitan 0.2.2's ``Validator.__init__`` builds its loader with ``build_text_validation_dataloader``
(torchtitan's own dataset table only), a builder the TrainSpec does not expose (pytorch/torchtitan
PR 1362, "leaves this dataloader function unexposed to the train_spec"). So ``NSAValidator.__init__``
sets the same state itself with nsa_flex's loader. Its ``validate`` is torchtitan's loop without
two things nsa_flex cannot use under context parallelism: torchtitan's sharding (zig-zag shards
and its ring-attention context; here each rank takes its contiguous shard, `shard_batch`, and the
layers all-gather keys and values) and its token count taken after the split (here the whole
batch's, so the ranks' loss shares sum to the one-process loss). Pipeline parallelism is refused
(`args.parallelism_problems`). tests/titan/test_trainer.py fails when upstream's state, its loader
call or its loop changes.

Each validation also scores ``[validation] retrieval_docs`` held-out retrieval documents
(:mod:`nsa_flex.titan.retrieval`); their metrics join the validation record (metrics.jsonl).
Every rank scores the same documents, so FSDP's collectives stay in step; under context
parallelism each rank runs its shard of them and the logits of the answer positions reach every
rank (`range_of_seq_nograd`: one all-reduce per batch).
"""

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from nsa_flex.context_parallel import NO_SHARD, range_of_seq_nograd

from . import retrieval
from .data import build_validation_dataloader
from .parallelize import owns_context_parallel, shard_batch


class NSAValidator(Validator):
    def __init__(
        self,
        job_config,
        dp_world_size,
        dp_rank,
        tokenizer,
        parallel_dims,
        loss_fn,
        validation_context,
        maybe_enable_amp,
        metrics_processor,
        pp_schedule=None,
        pp_has_first_stage=None,
        pp_has_last_stage=None,
    ):
        # Validator.__init__'s state (torchtitan 0.2.2), with nsa_flex's dataloader
        self.job_config = job_config
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_dataloader = build_validation_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=job_config.validation.steps != -1,
        )
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage = pp_has_first_stage
        self.pp_has_last_stage = pp_has_last_stage
        n = retrieval.check_docs(getattr(job_config.validation, "retrieval_docs", 0))
        corpus = retrieval.probe_corpus(job_config, tokenizer) if n else None
        self.retrieval_docs = retrieval.probe_documents(corpus, n) if corpus is not None else []
        if self.retrieval_docs:
            logger.info(f"Validation scores retrieval on {n} held-out documents of {job_config.validation.seq_len} "
                        "tokens (answer loss, exact answers: retrieval/* in the validation records)")
        self.recall_docs = retrieval.check_docs(getattr(job_config.validation, "retrieval_recall_docs", 0),
                                                "retrieval_recall_docs") if self.retrieval_docs else 0
        if self.recall_docs and parallel_dims.world_size > 1:
            # the ranks would have to agree on a failure that turns it off (FSDP's collectives)
            logger.warning("validation.retrieval_recall_docs: selection recall runs in one process only; "
                           f"off with {parallel_dims.world_size} ranks")
            self.recall_docs = 0

    def post_dataloading_process(self, input_dict, labels, model_parts):
        """torchtitan's; with context parallelism on the NSA model this rank's contiguous shard
        (`shard_batch`; the llama3 baseline validates without context parallelism)."""
        if not (self.parallel_dims.cp_enabled and owns_context_parallel(model_parts[0])):
            return super().post_dataloading_process(input_dict, labels, model_parts)
        return shard_batch(model_parts[0], input_dict, labels)

    @torch.no_grad()
    def validate(self, model_parts, step: int) -> None:
        """The retrieval metrics, then the validation loss: per batch each rank's loss sum over the
        whole batch's token count (counted before the context split, summed over the data-parallel
        ranks), averaged over the batches and summed over the loss mesh (data x context ranks)."""
        (model,) = model_parts  # one part: pipeline parallelism is refused (args.parallelism_problems)
        pd, device = self.parallel_dims, utils.device_type
        model.eval()
        try:
            if self.retrieval_docs:
                self.metrics_processor.validation_extra = self.score_retrieval(model_parts)
            losses = []
            for input_dict, labels in self.validation_dataloader:
                if self.job_config.validation.steps != -1 and len(losses) >= self.job_config.validation.steps:
                    break
                self.metrics_processor.ntokens_since_last_log += labels.numel()
                input_dict = {k: v.to(device) for k, v in input_dict.items()}
                labels = labels.to(device)
                tokens = (labels != IGNORE_INDEX).sum()
                total = dist_utils.dist_sum(tokens, pd.get_mesh("batch")) if pd.dp_enabled else tokens.float()
                inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
                    input_dict, labels, model_parts)
                with self.validation_context(), self.maybe_enable_amp:
                    loss_sum = self.loss_fn(model(inputs, **extra_inputs, **extra_kwargs), labels)
                losses.append(loss_sum.detach() / total)
            loss = torch.stack(losses).sum() / len(losses)
            avg = dist_utils.dist_sum(loss, pd.get_optional_mesh("loss")) if pd.dp_cp_enabled else loss.item()
            self.metrics_processor.log_validation(loss=avg, step=step)
        finally:
            model.train()

    def run_tokens(self, model_parts, tokens):
        """The model's output for a batch of tokens [B, T] (this rank's shard of them under context
        parallelism), as validation runs it."""
        inputs, _, extra_inputs, extra_kwargs = self.post_dataloading_process({"input": tokens}, tokens, model_parts)
        with self.validation_context(), self.maybe_enable_amp:
            return model_parts[0](inputs, **extra_inputs, **extra_kwargs)

    def score_retrieval(self, model_parts) -> dict[str, float]:
        """The retrieval metrics of the held-out documents (the model in eval mode)."""
        model = model_parts[0]

        def logits_of(tokens, start):
            logits = self.run_tokens(model_parts, tokens)
            return range_of_seq_nograd(logits, getattr(model, "seq_shard", NO_SHARD), start, tokens.shape[1], 1)

        # near / far from the model's sliding window (its masks: full attention's too)
        window = getattr(getattr(model, "model_args", None), "window", None)
        out = retrieval.score(logits_of, self.retrieval_docs, self.job_config.validation.local_batch_size,
                              utils.device_type, far_from=window)
        if self.recall_docs and window is not None:
            out.update(self.selection_recall(model_parts, window))
        return out

    def selection_recall(self, model_parts, window: int) -> dict[str, float]:
        """`retrieval.selection_recall` (which runs the model eagerly). A diagnostic: a failure
        (out of memory, say) logs a warning and turns it off for the rest of the run, never
        stopping training."""
        try:
            return retrieval.selection_recall(model_parts[0], lambda t: self.run_tokens(model_parts, t),
                                              self.retrieval_docs, window, self.recall_docs, utils.device_type)
        except Exception as e:  # noqa: BLE001 -- a metric must not end the run
            logger.warning(f"validation.retrieval_recall_docs: selection recall failed ({type(e).__name__}: "
                           f"{e}); off for the rest of this run")
            self.recall_docs = 0
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return {}


def build_validator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                    maybe_enable_amp, metrics_processor=None, pp_schedule=None, pp_has_first_stage=None,
                    pp_has_last_stage=None):
    """TrainSpec.build_validator_fn."""
    assert metrics_processor is not None
    return NSAValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                        validation_context, maybe_enable_amp, metrics_processor, pp_schedule,
                        pp_has_first_stage, pp_has_last_stage)
