"""How the spec in test_optr.py runs.

- Without CUDA, Triton's CPU interpreter: set here, before anything imports triton (the
  scripts do the same at their top; importing kernel.py or optr.py switches nothing).
- `pytest -q` is the spec a learner reads, in under a minute on 2 cores; the parts marked `slow`
  (real models, the scripts end to end, SASS compiles, the tests that take many seconds)
  run with `pytest -q --full`, which is what CI runs.  `-m EXPR` picks by marker as usual
  (`pytest -m "kernel or gpu"` on a CUDA machine: the kernel tests and the device checks).
- Hypothesis: no deadlines (CPU timing varies), no example database, failing examples
  printed as reproducible blobs; derandomized (a fixed sequence) under CI=1, randomized
  locally; HYPOTHESIS_PROFILE overrides.
- torch's intra-op threads capped at 2, so the tests run, and round off, with at most two.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # no GPU: the Triton kernel on the CPU

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

common = dict(deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=30, **common)
settings.register_profile("dev", max_examples=30, **common)
settings.register_profile("thorough", max_examples=300, **common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the whole spec: also the tests marked slow (what CI runs)")


def pytest_configure(config):
    import ladder
    ladder.memoize_interpreter_scan()                   # nested @triton.jit calls made cheap


def pytest_collection_modifyitems(config, items):
    """Without --full or -m, leave out the slow tests (and sass_all, which only -m runs)."""
    if config.getoption("--full") or config.option.markexpr:
        if not config.option.markexpr:
            skip = [i for i in items if "sass_all" in i.keywords]
            items[:] = [i for i in items if "sass_all" not in i.keywords]
            config.hook.pytest_deselected(items=skip)
        return
    kept = [i for i in items if "slow" not in i.keywords and "sass_all" not in i.keywords]
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = kept
