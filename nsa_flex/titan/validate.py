"""Validator on nsa_flex's datasets (torchtitan's Validator reads only its own dataset table)."""

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
        # same state as torchtitan's Validator.__init__, with our dataloader
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
