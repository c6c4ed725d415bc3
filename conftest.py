"""Hypothesis settings for the spec in test_optr.py: no deadlines (CPU timing varies),
no example database, failing examples printed as reproducible blobs; derandomized (a
fixed sequence of examples) under CI, randomized locally. HYPOTHESIS_PROFILE overrides.
It also caps torch's intra-op threads at 2 for the whole session (the last line:
torch.set_num_threads(min(2, torch.get_num_threads()))), so the tests run, and round off,
with at most two threads, not with torch's default count."""
import os

import torch
from hypothesis import HealthCheck, settings

common = dict(deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=30, **common)
settings.register_profile("dev", max_examples=30, **common)
settings.register_profile("thorough", max_examples=300, **common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))
