"""How the tests run, and what the spec (test_optr.py) and the tools' tests (tools/test_*.py) share.

- Without CUDA, Triton's CPU interpreter: set here, before anything imports triton (the
  scripts do the same at their top; importing kernel.py or optr.py switches nothing), with
  its builtin scan memoized (memoize_interpreter_scan).  Without triton (no wheel for macOS
  or Windows) the tests marked needs_triton are skipped and say so; the rest runs.
- `pytest -q` is the spec a learner reads, in under a minute on 2 cores; the parts marked `slow`
  (real models, the scripts end to end, SASS compiles, the tests that take many seconds)
  run with `pytest -q --full`, which is what CI runs.  `-m EXPR` picks by marker as usual
  (`pytest -m "kernel or gpu"` on a CUDA machine: the kernel tests and the device checks).
- Hypothesis: no deadlines (CPU timing varies), no example database, failing examples
  printed as reproducible blobs; derandomized (a fixed sequence) under CI=1, randomized
  locally; HYPOTHESIS_PROFILE overrides.
- torch's intra-op threads capped at 2, so the tests run, and round off, with at most two.

Then the builders both share, each with one home here: random tensors and rotations (rand,
random_rotations), optr's tiny random models and rotations (random_model, quarot_specs, IDX),
transformers' (tiny_hf, tinylm_of, hf_settings, IDX_HF, HELD_HF), run_python, shuffled, and the
kernel tests' cases with every launch they make (KERNEL_LAUNCHES, TINY_LAUNCH, tiny_kernel_error).
test_optr.py imports them from here; tools/test_*.py import neither file (nor a script): they
take the same objects as fixtures (`def test_x(tiny_hf, eval_llm)`), the scripts imported
only when a test asks for them.
"""
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # no GPU: the Triton kernel on the CPU

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

try:
    import triton  # noqa: E402
except ImportError:
    triton = None

import kernel  # noqa: E402
import optr  # noqa: E402
from tools import bench  # noqa: E402

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
    parser.addoption("--shuffle", type=int, metavar="SEED", default=None,
                     help="run the selected tests in an order shuffled by random.Random(SEED): "
                          "a test that needs another to run first fails")


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
    """The tests marked needs_triton skip without triton, and the device checks (marked gpu)
    without CUDA or triton, saying so. Without --full or -m, leave out the slow tests (and
    sass_all, which only -m runs). --shuffle SEED: the kept tests in a shuffled order."""
    why = ("no CUDA device: a device check would compare the CPU with itself"
           if not torch.cuda.is_available() else None if triton else "triton is not installed")
    for item in items:
        if "gpu" in item.keywords and why:
            item.add_marker(pytest.mark.skip(reason=why))
        elif "needs_triton" in item.keywords and kernel.triton is None:   # first, before its other skipifs
            item.add_marker(pytest.mark.skipif(True, reason=NO_TRITON), append=False)
    if config.getoption("--full") or config.option.markexpr:
        if not config.option.markexpr:
            skip = [i for i in items if "sass_all" in i.keywords]
            items[:] = [i for i in items if "sass_all" not in i.keywords]
            config.hook.pytest_deselected(items=skip)
    else:
        kept = [i for i in items if "slow" not in i.keywords and "sass_all" not in i.keywords]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    if config.getoption("--shuffle") is not None:
        random.Random(config.getoption("--shuffle")).shuffle(items)


# ----------------------------------------------------------------------------------------
# The builders the spec and the tools' tests share
# ----------------------------------------------------------------------------------------
# Triton ships wheels for Linux only: elsewhere the tests marked needs_triton are skipped, saying so
# (pytest_collection_modifyitems).
NO_TRITON = "triton is not installed (its wheels are for Linux): the Triton kernel's tests cannot run here"
needs_triton = pytest.mark.needs_triton


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def random_orthogonal(d, seed=0, dtype=torch.float32):
    q, r = torch.linalg.qr(rand(d, d, seed=seed, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def random_rotations(H, d, seed=0):
    """(H, d, d) random orthogonal matrices."""
    return torch.stack([random_orthogonal(d, seed + h) for h in range(H)])


def run_python(*args, timeout=600, **env):
    """`python *args` in a new process at the repository's root, TRITON_INTERPRET unset (the
    child decides, as a user's shell would) and `env`'s variables set: its CompletedProcess."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **env}
    return subprocess.run([sys.executable, *args], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def random_model(kind="llama", tie=False, seed=0, **kw):
    """A small random Llama / Qwen2 (q/k/v bias) / Qwen3 (q/k norm) with every weight,
    bias and norm gain drawn, so a mix-up of any two tensors changes the logits."""
    cfg = optr.Config(vocab_size=300, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                      head_dim=16, ffn_dim=80, group_size=16, rope_theta=5e4, rms_eps=1e-5,
                      qk_norm=kind == "qwen3", attention_bias=kind == "qwen2",
                      tie_embeddings=tie, seed=seed, **kw)
    model = optr.TinyLM(cfg)
    with torch.no_grad():
        for i, (n, p) in enumerate(model.named_parameters()):
            p.copy_(rand(*p.shape, seed=seed + i, scale=0.3 if p.dim() == 2 else 0.1)
                    + (1.0 if n.endswith("norm.weight") else 0.0))
    return model.eval()


IDX = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(7))


def quarot_specs(cfg, seed=0, mean=True):
    """One KVQuant per layer: a key mean and random orthogonal R_K, R_V."""
    H, d = cfg.n_kv_heads, cfg.head_dim
    return [optr.KVQuant(k_mean=rand(H, d, seed=seed + l) if mean else None,
                         r_k=random_rotations(H, d, seed + 10 * l + 1),
                         r_v=random_rotations(H, d, seed + 10 * l + 5)) for l in range(cfg.n_layers)]


def shuffled(cache, seed):
    """The cache with its free pages in a random order, so block tables point all over."""
    order = torch.randperm(len(cache.free_pages), generator=torch.Generator().manual_seed(seed))
    cache.free_pages = order.tolist()
    return cache


# Tiny random transformers models built from their configs (no download); test_optr.py's section E.
HF_KINDS = {   # name: (config class, model class, config fields)
    "llama-GQA": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2)),
    "llama-MQA": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
    "qwen2-GQA": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2)),
    "qwen3-GQA": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2)),
    "gemma3-MQA": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=1)),
    "gemma3-GQA": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=2)),
}
GEMMA_SLIDING = 12                                     # tokens a sliding layer reads (< the sequences)
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
IDX_HF = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(11))
HELD_HF = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(12))


def tiny_hf(kind, seed=0):
    """A random transformers model of this kind: hidden 48, head_dim 16, vocabulary 300,
    untied; every projection and bias drawn, every norm gain moved off its init."""
    import transformers
    cfg_cls, model_cls, heads = HF_KINDS[kind]
    extra = dict(layer_types=GEMMA_LAYERS, sliding_window=GEMMA_SLIDING, query_pre_attn_scalar=24,
                 num_hidden_layers=4) if kind.startswith("gemma") else dict(num_hidden_layers=2)
    config = getattr(transformers, cfg_cls)(vocab_size=300, hidden_size=48, intermediate_size=80,
                                            head_dim=16, tie_word_embeddings=False, **heads, **extra)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if p.dim() == 2:
                p.copy_(rand(*p.shape, seed=seed + i, scale=0.2))
            else:
                p.add_(rand(*p.shape, seed=seed + i, scale=0.1))
    return model.eval()


def transformers_twin(model):
    """TinyLM as the transformers Llama, Qwen2 or Qwen3 it is (the same parameter names), for export_hf."""
    import transformers
    c = model.cfg
    assert not (c.qk_norm and c.attention_bias), "q/k norm with q/k/v bias: no Hugging Face model_type"
    hf = transformers.AutoConfig.for_model(
        "qwen3" if c.qk_norm else "qwen2" if c.attention_bias else "llama", vocab_size=c.vocab_size,
        hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.ffn_dim,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=None, eos_token_id=None)                # TinyLM has no special tokens
    twin = transformers.AutoModelForCausalLM.from_config(hf, dtype=model.lm_head.weight.dtype)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def hf_settings(**kw):
    """optr's settings for the tiny models: windows of 4 and 8, a short calibration."""
    return dict(dict(sink=4, window=8, steps=6, eval_every=2, n_loss_queries=16), **kw)


def tinylm_of(model, cfg):
    """optr's TinyLM holding the transformers model's weights (the same parameter names)."""
    tiny = optr.TinyLM(cfg, init=False)
    tiny.load_state_dict(model.state_dict(), strict=True)
    return tiny.eval()


# ----------------------------------------------------------------------------------------
# The kernel tests' cases (test_optr.py's section 9) and every launch they make
# ----------------------------------------------------------------------------------------
# Kernel tests run on CUDA when it is there, in the Triton interpreter otherwise.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not kernel._INTERPRETED
                      else "cpu")


# A case: the ragged batch, the heads and the page layout one kernel test builds (test_optr.build).
@dataclass(frozen=True)
class Case:
    n_quant: tuple          # INT2 tokens per sequence (ragged)
    H_q: int
    H_kv: int
    d: int
    G: int                  # group size
    P: int                  # page size
    NW: int = 0             # window capacity
    win_len: tuple = None   # valid window slots per sequence (None: all 0)
    win_dtype: torch.dtype = torch.float32
    q_dtype: torch.dtype = torch.float32
    num_splits: int = None
    spare_pages: int = 3

    @property
    def id(self):
        win = f"W{self.NW}{'bf16' if self.win_dtype == torch.bfloat16 else 'fp32'}" \
            if self.NW else "W0"
        q = "-qbf16" if self.q_dtype == torch.bfloat16 else ""
        return (f"B{len(self.n_quant)}-T{max(self.n_quant)}-Hq{self.H_q}-Hkv{self.H_kv}"
                f"-d{self.d}-G{self.G}-P{self.P}-{win}{q}-S{self.num_splits}")


RAGGED = (0, 5, 63, 64, 65, 200)   # empty, < 1 page, page - 1, 1 page, page + 1, 4 pages
RAGGED_NO_EMPTY = (1, 5, 63, 64, 65, 200)
RAGGED_WIN = (3, 7, 0, 1, 7, 5)
SPLITS = (1, 2, 3, 16)             # 16 > pages of every sequence


def _matrix():
    cases = []
    heads = [(2, 2), (4, 2), (4, 1)]                                       # GQA 1 / 2 / 4
    windows = [(0, torch.float32), (7, torch.bfloat16), (7, torch.float32)]
    i = 0
    for H_q, H_kv in heads:
        for d in (32, 64):
            for NW, win_dtype in windows:
                cases.append(Case(
                    n_quant=RAGGED if NW else RAGGED_NO_EMPTY, H_q=H_q, H_kv=H_kv, d=d,
                    G=d if i % 2 else d // 4, P=64, NW=NW, win_len=RAGGED_WIN if NW else None,
                    win_dtype=win_dtype, num_splits=SPLITS[i % len(SPLITS)]))
                i += 1
    return cases


EXTRA = [
    # windows only: every sequence has n_quant = 0 and the page pool is empty
    Case((0, 0), 4, 2, 32, 8, 16, NW=6, win_len=(6, 1), win_dtype=torch.bfloat16,
         q_dtype=torch.bfloat16, num_splits=2, spare_pages=0),
    # bf16 queries, no window
    Case((16, 100), 4, 2, 32, 32, 16, q_dtype=torch.bfloat16, num_splits=2),
    # page size that is not a power of two
    Case((50, 24, 23), 4, 2, 32, 4, 24, NW=4, win_len=(2, 4, 0), num_splits=3),
    # d = 256: a page is processed as two tiles; tiny groups
    Case((70, 3), 4, 2, 256, 64, 64, NW=3, win_len=(3, 1), win_dtype=torch.bfloat16,
         num_splits=2),
    # d = 16, G = 2, page smaller than the 16-row tile, GQA 8
    Case((9, 30), 8, 1, 16, 2, 8, num_splits=4),
    # d = 128 (the production head dim), num_splits chosen by the launcher
    Case((130, 64), 4, 2, 128, 128, 16, NW=2, win_len=(2, 2), num_splits=None),
]
CASES = _matrix() + EXTRA
# The cases of single tests: how the context is split; bad inputs; the unchecked (CUDA graph) launch.
SPLIT_CASE = Case((40, 17), 4, 2, 32, 8, 16, NW=3, win_len=(1, 3))
SPLIT_CASE_SPLITS = (1, 4)
VALID_CASE = Case((20, 40), 4, 2, 32, 8, 16, NW=3, win_len=(3, 0), num_splits=2)
UNCHECKED_CASE = Case((70, 9), 4, 2, 64, 16, 16, NW=5, win_len=(5, 2), win_dtype=torch.bfloat16)
UNCHECKED_SPLITS = (None, 3)


def launch_shape(case, num_splits, checked=True):
    """The shape of one kernel call on build(case), in the form tools.sass._record_launch
    takes: everything that decides which kernel configuration the launcher compiles."""
    blocks = [math.ceil(n / case.P) for n in case.n_quant]
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    return dict(B=len(case.n_quant), H_q=case.H_q, H_kv=case.H_kv, d=case.d, G=case.G,
                P=case.P, NW=case.NW, n_quant=max(case.n_quant),
                num_pages=sum(blocks) + case.spare_pages, max_blocks=max(blocks) + 1,
                max_tokens=max(case.n_quant) if checked else (max(blocks) + 1) * case.P,
                num_splits=num_splits, q_dtype=name[case.q_dtype],
                win_dtype=name[case.win_dtype])


# Every kernel launch of the spec's kernel tests (each checks its own against this list:
# test_optr.record_kernel_launches): `pytest -m sass_all` compiles each distinct configuration
# among them for sm_90a and sm_80 (tools/test_sass.py).
KERNEL_LAUNCHES = ([launch_shape(c, c.num_splits) for c in CASES]
                   + [launch_shape(SPLIT_CASE, s) for s in SPLIT_CASE_SPLITS]
                   + [launch_shape(VALID_CASE, VALID_CASE.num_splits)]
                   + [launch_shape(UNCHECKED_CASE, s, checked=False) for s in UNCHECKED_SPLITS]
                   + [dict(launch_shape(c, c.num_splits), kernel="plain") for c in CASES + [SPLIT_CASE]])


# A small ragged launch (3 sequences: 40, 0 and 17 INT2 tokens; windows 5, 2, 0), bf16.
TINY_LAUNCH = dict(B=3, H_q=8, H_kv=2, d=64, G=16, P=16, NW=5, n_quant=40, num_splits=2,
                   q_dtype="bf16", win_dtype="bf16")


def tiny_kernel_error(device):
    """Max |Triton kernel - optr.paged_decode_reference| on TINY_LAUNCH's case on `device`."""
    torch.manual_seed(0)
    c = TINY_LAUNCH
    args = bench.random_inputs(c["B"], c["n_quant"], c["H_q"], c["H_kv"], c["d"], c["G"], c["P"],
                               c["NW"], torch.bfloat16, device)
    args["n_quant"] = torch.tensor([40, 0, 17], dtype=torch.int32, device=device)
    args["win_len"] = torch.tensor([5, 2, 0], dtype=torch.int32, device=device)
    out = kernel.int2_paged_decode(**args, num_splits=c["num_splits"])
    return (out - optr.paged_decode_reference(**args)).abs().max().item()


# ----------------------------------------------------------------------------------------
# The same, as fixtures: what tools/test_*.py take (they import neither this file nor a script)
# ----------------------------------------------------------------------------------------
# Session-scoped: a hypothesis @given test may take them (a function-scoped fixture fails its
# health check). The scripts are imported when a test first asks for them, not at collection.

@pytest.fixture(scope="session", name="eval_llm")
def eval_llm_script():
    """The eval_llm.py script as a module (imported here, on first use: it needs transformers)."""
    import eval_llm
    return eval_llm


@pytest.fixture(scope="session", name="train_tiny")
def train_tiny_script():
    """The train_tiny.py script as a module (imported here, on first use)."""
    import train_tiny
    return train_tiny


def _shared(name, value):
    """A session fixture `name` whose value is this module's `value` (a builder or a constant)."""
    return pytest.fixture(scope="session", name=name)(lambda: value)


device_fixture = _shared("device", DEVICE)
idx_fixture = _shared("idx", IDX)
idx_hf_fixture = _shared("idx_hf", IDX_HF)
held_hf_fixture = _shared("held_hf", HELD_HF)
kernel_launches_fixture = _shared("kernel_launches", KERNEL_LAUNCHES)
tiny_launch_fixture = _shared("tiny_launch", TINY_LAUNCH)
hf_settings_fixture = _shared("hf_settings", hf_settings)
quarot_specs_fixture = _shared("quarot_specs", quarot_specs)
random_model_fixture = _shared("random_model", random_model)
run_python_fixture = _shared("run_python", run_python)
shuffled_fixture = _shared("shuffled", shuffled)
tiny_hf_fixture = _shared("tiny_hf", tiny_hf)
tinylm_of_fixture = _shared("tinylm_of", tinylm_of)
transformers_twin_fixture = _shared("transformers_twin", transformers_twin)
tiny_kernel_error_fixture = _shared("tiny_kernel_error", tiny_kernel_error)
