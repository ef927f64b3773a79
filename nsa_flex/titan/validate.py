"""Validator on nsa_flex's datasets.

torchtitan 0.2.2's ``Validator.__init__`` builds its loader with ``build_text_validation_dataloader``
(torchtitan's own dataset table only), a builder the TrainSpec does not expose (pytorch/torchtitan
PR 1362, "leaves this dataloader function unexposed to the train_spec"). So ``NSAValidator.__init__``
sets the same state itself with nsa_flex's loader and inherits every other method;
tests/titan/test_trainer.py fails when upstream's state or its loader call changes.
"""

from torchtitan.components.validate import Validator

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


def build_validator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                    maybe_enable_amp, metrics_processor=None, pp_schedule=None, pp_has_first_stage=None,
                    pp_has_last_stage=None):
    """TrainSpec.build_validator_fn."""
    assert metrics_processor is not None
    return NSAValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                        validation_context, maybe_enable_amp, metrics_processor, pp_schedule,
                        pp_has_first_stage, pp_has_last_stage)
