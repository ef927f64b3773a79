"""Validator on nsa_flex's datasets.

torchtitan 0.2.2's ``Validator.__init__`` builds its loader with ``build_text_validation_dataloader``
(torchtitan's own dataset table only), a builder the TrainSpec does not expose (pytorch/torchtitan
PR 1362, "leaves this dataloader function unexposed to the train_spec"). So ``NSAValidator.__init__``
sets the same state itself with nsa_flex's loader and inherits every other method;
tests/titan/test_trainer.py fails when upstream's state or its loader call changes.

Each validation also scores ``[validation] retrieval_docs`` held-out retrieval documents
(:mod:`nsa_flex.titan.retrieval`); their metrics join the validation record (metrics.jsonl).
Every rank scores the same documents, so FSDP's collectives stay in step.
"""

from torchtitan.components.validate import Validator
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from . import retrieval
from .data import build_validation_dataloader


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

    def validate(self, model_parts, step: int) -> None:
        if self.retrieval_docs:
            self.metrics_processor.validation_extra = self.score_retrieval(model_parts)
        super().validate(model_parts, step)

    def score_retrieval(self, model_parts) -> dict[str, float]:
        def logits_of(tokens):
            inputs, _, extra_inputs, extra_kwargs = self.post_dataloading_process(
                {"input": tokens}, tokens, model_parts)
            with self.validation_context(), self.maybe_enable_amp:
                return model_parts[0](inputs, **extra_inputs, **extra_kwargs)

        for m in model_parts:
            m.eval()
        try:
            # near / far from the model's sliding window (its masks: full attention's too)
            window = getattr(getattr(model_parts[0], "model_args", None), "window", None)
            return retrieval.score(logits_of, self.retrieval_docs, self.job_config.validation.local_batch_size,
                                   utils.device_type, far_from=window)
        finally:
            for m in model_parts:
                m.train()


def build_validator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                    maybe_enable_amp, metrics_processor=None, pp_schedule=None, pp_has_first_stage=None,
                    pp_has_last_stage=None):
    """TrainSpec.build_validator_fn."""
    assert metrics_processor is not None
    return NSAValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                        validation_context, maybe_enable_amp, metrics_processor, pp_schedule,
                        pp_has_first_stage, pp_has_last_stage)
