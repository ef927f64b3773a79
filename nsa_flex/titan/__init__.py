"""torchtitan integration of nsa-flex: model, TrainSpec "nsa_flex", JobConfig [nsa] section, data, tokenizers.

Importing this package has no side effects; ``nsa_flex.titan.train_spec`` registers the TrainSpec
(and applies the CPU shim on machines without CUDA) when imported, normally by torchtitan through
``[experimental] custom_import``.
"""
