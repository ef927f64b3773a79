"""torchtitan integration of nsa-flex: model, TrainSpec "nsa_flex", JobConfig [nsa] section, data, tokenizers.

Importing this package has no side effects; ``nsa_flex.titan.train_spec`` registers the TrainSpec
when imported, normally by torchtitan through ``[experimental] custom_import``. Runs start with
``nsa-train`` or ``torchrun -m nsa_flex.titan.train`` (:class:`nsa_flex.titan.trainer.NSATrainer`).
"""
