"""Shared pytest setup for the NSA core tests.

Hypothesis profiles (pick one with `--hypothesis-profile NAME` or `HYPOTHESIS_PROFILE=NAME`):
  ci        (default) 200 examples per property test, no deadline: the CI budget
  thorough  3000 examples per property test, for a long local / nightly run
  dev       25 examples, for quick iteration
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=200, **_common)
settings.register_profile("thorough", max_examples=3000, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device: skipped without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def single_thread():
    """Tiny tensors: one intra-op thread is 10-20x faster than OpenMP on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
