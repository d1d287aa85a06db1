"""Shared test settings.

Hypothesis runs with no deadline (these machines are shared and noisy) and a modest number of
examples so the whole suite stays fast; tests that need a different count say so themselves.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "rope-export",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# HYPOTHESIS_PROFILE=thorough: many more examples, for a manual search before a release.
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "rope-export"))

# The tests use small tensors only: on a shared 2-core machine a second intra-op thread costs
# milliseconds of synchronisation per op and gains nothing.
torch.set_num_threads(1)

# rich sizes its tables and wraps its log lines to the terminal; with no terminal (CI, pytest-xdist
# workers) that width varies. One fixed width keeps what the tests read the same everywhere.
os.environ["COLUMNS"] = "200"
