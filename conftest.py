"""How the spec in test_optr.py runs.

- Without CUDA, Triton's CPU interpreter: set here, before anything imports triton (the
  scripts do the same at their top; importing kernel.py or optr.py switches nothing), with
  its builtin scan memoized (memoize_interpreter_scan).  Without triton (no wheel for macOS
  or Windows) the tests that need it are skipped and say so; the rest runs.
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

try:
    import triton  # noqa: E402
except ImportError:
    triton = None

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


def memoize_interpreter_scan():
    """Make nested @triton.jit calls cheap in Triton's CPU interpreter.

    On every call of a @triton.jit helper from a kernel (kernel.py's _codes_fp16, _quarter_pv, ...,
    and tl.sum, tl.max, tl.cdiv, which are @triton.jit functions too) the interpreter
    re-patches triton.language, finding its builtins with inspect.getmembers over each
    module: ~1 ms per call, several times the arithmetic of a whole tile.  The set of
    builtin names of a module never changes, so it is found once per module here; each
    call still re-checks and patches every one of them exactly as before."""
    import inspect
    import triton.language as tl
    from triton.runtime import interpreter
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "memoized", False) \
            or not hasattr(interpreter, "_patch_attr"):
        return                                    # another Triton layout: leave it alone
    names = {}

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in names:
            names[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg)
                                    if tl.core.is_builtin(m)])
        for name in names[id(pkg)][1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.memoized = True
    patch_builtin.builtin_names = lambda pkg: list(names[id(pkg)][1]) if id(pkg) in names else None
    interpreter._patch_builtin = patch_builtin


def pytest_configure(config):
    if triton is not None:
        memoize_interpreter_scan()                      # nested @triton.jit calls made cheap


def pytest_collection_modifyitems(config, items):
    """The device checks (marked gpu) skip without CUDA or triton, saying so. Without --full
    or -m, leave out the slow tests (and sass_all, which only -m runs)."""
    why = ("no CUDA device: a device check would compare the CPU with itself"
           if not torch.cuda.is_available() else None if triton else "triton is not installed")
    for item in items if why else ():
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=why))
    if config.getoption("--full") or config.option.markexpr:
        if not config.option.markexpr:
            skip = [i for i in items if "sass_all" in i.keywords]
            items[:] = [i for i in items if "sass_all" not in i.keywords]
            config.hook.pytest_deselected(items=skip)
        return
    kept = [i for i in items if "slow" not in i.keywords and "sass_all" not in i.keywords]
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = kept
