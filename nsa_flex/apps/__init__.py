"""Applications on top of the trainer glue (`nsa_flex.titan`) and the library: text generation
from a checkpoint (`generate`), evaluation of checkpoints (`eval`), figures of runs' metrics
(`plot`). Nothing below this package imports it; `python -m nsa_flex.generate`, `nsa_flex.eval`
and `nsa_flex.plot` are aliases that run these modules."""
