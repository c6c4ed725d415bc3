"""
The spec of tools/bench_hf.py: what it measures is what it says. Against small stand-ins (a tiny
transformers Llama built from its config, DynamicCache subclasses that log, add noise or hold
memory): its KLs are KL(DynamicCache || row) computed here in float64 numpy, each row's peak is
measured from the resident set just before that row and counts the runtime its warm-up left, and
the caches' timed steps and generate() runs interleave; the bytes a step's attention reads are
counted from the quantizer's widths and dtypes by hand, its time is its attention calls', and the
break-even is checked against the ratios interpolated on a grid of every token. The slow test runs
the command line, small, on SmolLM2.
"""
import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import DynamicCache

import optr

from tools import bench_hf

IDS = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(3))
MIB = 2**20


def tiny_llama():
    """A random transformers Llama (hidden 48, 2 layers, 6 query / 2 KV heads of 16; weights of std 0.2:
    logits that feel a change of keys), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


class Logged(DynamicCache):
    """A DynamicCache that appends its name to `log` at each forward (its first layer's update)."""
    def __init__(self, name, log, config):
        super().__init__(config=config)
        self.name, self.log = name, log

    def update(self, k, v, layer_idx, *args, **kw):
        if layer_idx == 0:
            self.log.append(self.name)
        return super().update(k, v, layer_idx, *args, **kw)


class Noisy(DynamicCache):
    """A DynamicCache that stores its keys with seeded noise: logits that differ from DynamicCache's."""
    def update(self, k, v, layer_idx, *args, **kw):
        g = torch.Generator().manual_seed(1000 * layer_idx + k.shape[2])
        return super().update(k + 0.5 * torch.randn(k.shape, generator=g), v, layer_idx, *args, **kw)


class Ballast(DynamicCache):
    """A DynamicCache that takes `mib` MiB of resident memory at its first update and holds it."""
    mib = 256

    def update(self, k, v, layer_idx, *args, **kw):
        if not hasattr(self, "ballast"):
            self.ballast = torch.ones(self.mib * MIB // 4)              # written: resident
        return super().update(k, v, layer_idx, *args, **kw)


def numpy_kl(ref_logits, logits) -> np.ndarray:
    """KL(p_ref || p) per position in float64 numpy, from logits (P, vocab)."""
    def log_softmax(x):
        x = np.asarray(x, dtype=np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    p, q = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(p) * (p - q)).sum(-1)


def makers(hf, **rows):
    """{"DynamicCache": ..., name: a maker of cls(config=hf.config) for each row}."""
    return dict(DynamicCache=lambda: DynamicCache(config=hf.config),
                **{n: (lambda c=c: c(config=hf.config)) for n, c in rows.items()})


def test_the_prompts_kl_is_kl_from_dynamic_cache_to_the_row_at_every_position():
    """prompt_kl's (mean, max) over the prompt's positions is KL(p_DynamicCache || p_row), computed
    here in float64 numpy from each cache's own forward, lm_head chunk by chunk or not; the reverse
    KL differs, so the direction is what the numbers say."""
    hf = tiny_llama()
    got = bench_hf.prompt_kl(hf, makers(hf, noisy=Noisy), IDS, chunk=16)
    with torch.no_grad():
        ref, row = (hf(IDS, past_key_values=c(config=hf.config)).logits[0] for c in (DynamicCache, Noisy))
    kl, reverse = numpy_kl(ref, row), numpy_kl(row, ref)
    assert got["DynamicCache"] == (0.0, 0.0)
    assert got["noisy"] == pytest.approx((kl.mean(), kl.max()), rel=1e-6)
    assert abs(reverse.mean() - kl.mean()) > 1e-3 * kl.mean()             # a thousand times the tolerance


def test_the_decode_kl_is_the_mean_kl_from_dynamic_cache_to_the_row_over_its_positions():
    """side_by_side_rows' decode KL is the mean over the prompt's last position and every step of
    KL(p_DynamicCache || p_row), float64 numpy on the log-probs each cache gave; DynamicCache's is 0."""
    hf = tiny_llama()
    with bench_hf.fresh_caches(makers(hf, noisy=Noisy)) as caches:
        runs = bench_hf.run_side_by_side(hf, caches, IDS[:, :34], 3)
        rows = bench_hf.side_by_side_rows(runs, 30)
    ref, got = (torch.stack(runs[n].logp) for n in ("DynamicCache", "noisy"))
    assert len(ref) == 5 and rows[0]["kl"] == 0                          # the prompt's last, 1 + 3 steps
    assert rows[1]["kl"] == pytest.approx(numpy_kl(ref, got).mean(), rel=1e-6)
    assert abs(numpy_kl(got, ref).mean() - rows[1]["kl"]) > 1e-3 * rows[1]["kl"]


def test_each_rows_peak_is_measured_from_the_resident_set_just_before_it():
    """A row that holds 256 MiB after its run does not count in the next row's peak: each row's
    baseline is the resident set before its own prefill (one baseline for all rows would give
    DynamicCache, run second, the ballast's 256 MiB)."""
    hf = tiny_llama()
    with bench_hf.fresh_caches(dict(ballast=lambda: Ballast(config=hf.config),
                                    DynamicCache=lambda: DynamicCache(config=hf.config))) as caches:
        runs = bench_hf.run_side_by_side(hf, caches, IDS, 1)
    assert runs["ballast"].peak_mib >= 0.9 * Ballast.mib
    assert runs["DynamicCache"].peak_mib < 0.25 * Ballast.mib, runs["DynamicCache"].peak_mib


def test_a_rows_peak_counts_the_runtime_its_warm_up_left_resident():
    """warm_up measures the resident set a cache's first use leaves behind (a stand-in for numba's
    compiled kernels: 128 MiB loaded once, at the first cache made), none for DynamicCache; the row's
    peak counts it, although its own run allocates nothing new for it."""
    hf, loaded = tiny_llama(), []

    def with_runtime():
        loaded.append(torch.ones(0 if loaded else 128 * MIB // 4))      # once per process, like numba
        return DynamicCache(config=hf.config)
    make = dict(DynamicCache=lambda: DynamicCache(config=hf.config), runtime=with_runtime)
    runtime = bench_hf.warm_up(hf, make, IDS, 20)
    assert runtime["runtime"] >= 0.9 * 128 and runtime["DynamicCache"] < 16, runtime
    with bench_hf.fresh_caches(make) as caches:
        runs = bench_hf.run_side_by_side(hf, caches, IDS, 1, runtime)
    assert runs["runtime"].peak_mib >= 0.9 * 128 > runs["DynamicCache"].peak_mib + 64


def test_each_rows_runtime_is_measured_from_the_resident_set_just_before_its_first_use():
    """warm_up's baseline is taken anew before each row's first use, after the model's own first
    generate(): a model that loads 128 MiB at its first forward (as weights mapped lazily do) gives
    the first row no runtime, and a row after one that left 128 MiB resident gets none of them (one
    baseline for every row would hand both to the rows' peaks)."""
    hf, loaded = tiny_llama(), []

    def load_once(module, args):
        if not loaded:
            loaded.append(torch.ones(128 * MIB // 4))                   # resident from the first forward
    hf.register_forward_pre_hook(load_once)

    def with_runtime():
        loaded.append(torch.ones(128 * MIB // 4))
        return DynamicCache(config=hf.config)
    make = dict(DynamicCache=lambda: DynamicCache(config=hf.config), runtime=with_runtime,
                after=lambda: DynamicCache(config=hf.config))
    runtime = bench_hf.warm_up(hf, make, IDS, 20)
    assert len(loaded) == 2 and runtime["runtime"] >= 0.9 * 128, runtime
    assert runtime["DynamicCache"] < 16 and runtime["after"] < 16, runtime


def test_the_chat_turns_kl_is_kl_from_dynamic_cache_to_the_row_after_the_follow_up():
    """bench_chat's KL is KL(p_DynamicCache || p_row) at the follow-up's last position, float64
    numpy on the logits of each cache's own two forwards here (the prompt, then the follow-up);
    the reverse KL differs, so the direction is what the number says. DynamicCache's is 0."""
    hf = tiny_llama()
    rows = bench_hf.bench_chat(hf, makers(hf, noisy=Noisy), IDS, bench_hf.BenchConfig(chat_turn=(30, 10)))
    logits = {}
    with torch.no_grad():
        for name, cls in (("DynamicCache", DynamicCache), ("noisy", Noisy)):
            cache = cls(config=hf.config)
            hf(IDS[:, :30], past_key_values=cache)
            logits[name] = hf(IDS[:, 30:40], past_key_values=cache).logits[0, -1:]
    kl, reverse = numpy_kl(logits["DynamicCache"], logits["noisy"]), numpy_kl(logits["noisy"], logits["DynamicCache"])
    assert [(r["cache"], r["P"], r["F"]) for r in rows] == [("DynamicCache", 30, 10), ("noisy", 30, 10)]
    assert rows[0]["kl"] == 0 and rows[1]["kl"] == pytest.approx(kl[0], rel=1e-6)
    assert abs(reverse[0] - kl[0]) > 1e-3 * kl[0]                          # a thousand times the tolerance


def test_the_chat_turn_is_the_median_of_its_runs_the_caches_in_turn(monkeypatch):
    """bench_chat: chat_runs turns, fresh caches each, the caches in turn; a row's follow-up seconds per run,
    their median and the medians' ratio to DynamicCache's (not one run's)."""
    hf, made, secs = tiny_llama(), [], iter([(2.0, 3.5), (3.0, 2.0), (1.0, 4.0)])   # per run: Dynamic's, other's

    def turn(hf_, caches, ids, P):
        logp = [torch.zeros(5).log_softmax(-1)]
        return {n: bench_hf.CacheRun(c, s, logp=logp) for (n, c), s in zip(caches.items(), next(secs))}
    monkeypatch.setattr(bench_hf, "chat_turn", turn)
    make = {n: (lambda n=n: made.append(n) or DynamicCache(config=hf.config)) for n in ("DynamicCache", "other")}
    rows = bench_hf.bench_chat(hf, make, IDS, bench_hf.BenchConfig(chat_turn=(30, 10), chat_runs=3))
    assert made == ["DynamicCache", "other"] * 3
    assert [(r["followup_runs"], r["followup_s"], r["x"]) for r in rows] == [([2.0, 3.0, 1.0], 2.0, 1.0),
                                                                             ([3.5, 2.0, 4.0], 3.5, 1.75)]


def test_the_timed_steps_interleave_the_caches():
    """After each cache's prefill and first step (one cache after the other: the prefill is timed
    alone), every round of timed steps takes one step of each cache, their order rotating."""
    hf, log = tiny_llama(), []
    make = {n: (lambda n=n: Logged(n, log, hf.config)) for n in ("DynamicCache", "other")}
    with bench_hf.fresh_caches(make) as caches:
        bench_hf.run_side_by_side(hf, caches, IDS, 4)
    assert log[:4] == ["DynamicCache", "DynamicCache", "other", "other"]
    rounds = [log[i:i + 2] for i in range(4, len(log), 2)]
    assert len(rounds) == 4 and all(sorted(r) == ["DynamicCache", "other"] for r in rounds), log
    assert rounds[0] != rounds[1]                                       # the order rotates


def test_generate_runs_alternate_the_caches_and_report_every_run():
    """generate() end to end: a fresh cache per run, the caches in turn (DynamicCache, other,
    DynamicCache, other), each run's seconds and its first forward's (the prompt) reported, and the greedy
    tokens a row shares with DynamicCache's (all of them for a cache that stores the same)."""
    hf, made = tiny_llama(), []

    def maker(name):
        def make():
            made.append(name)
            return DynamicCache(config=hf.config)
        return make
    got = bench_hf.generate_runs(hf, {n: maker(n) for n in ("DynamicCache", "other")}, IDS[:, :12], 5, 2)
    assert made == ["DynamicCache", "other", "DynamicCache", "other"]
    assert all(len(r["s"]) == 2 and min(r["s"]) > 0 and r["same"] == 5 for r in got.values()), got
    assert all(len(r["prefill_s"]) == 2 and 0 < p < t for r in got.values() for p, t in zip(r["prefill_s"], r["s"]))


def test_the_summary_says_how_many_times_smaller_than_dynamic_cache(capsys):
    """A row's "N.Nx smaller" is DynamicCache's (the first row's) MiB over the row's, its decode,
    prefill and generate ratios the row's time over DynamicCache's (decode: the median step, prefill: the median
    of its timed prefill and generate()'s first forwards, generate: run by run)."""
    def filled(T):                                   # 2 KV heads x 64 channels x T tokens, fp32
        cache = DynamicCache()
        cache.update(torch.zeros(1, 2, T, 64), torch.zeros(1, 2, T, 64), 0)
        return cache
    logp = list(torch.randn(3, 10).log_softmax(-1))
    runs = {"DynamicCache": bench_hf.CacheRun(filled(400), 2.0, 50.0, [10.0, 30.0, 20.0], logp),
            "small": bench_hf.CacheRun(filled(100), 3.0, 20.0, [5.0, 6.0, 40.0], [x.flip(-1) for x in logp])}
    rows = bench_hf.end_to_end_columns(bench_hf.side_by_side_rows(runs, 400),
                                       dict(DynamicCache=(0.0, 0.0), small=(0.1, 0.5)),
                                       dict(DynamicCache=dict(s=[4.0, 5.0], prefill_s=[1.0, 1.5], same=8),
                                            small=dict(s=[2.0, 10.0], prefill_s=[9.0, 2.25], same=3)))
    (s,) = bench_hf.print_side_by_side(rows)
    assert [(r["decode_ms"], r["prefill_s"]) for r in rows] == [(20.0, 1.5), (6.0, 3.0)]
    got = (s["smaller"], s["decode_x"], s["prefill_x"], *s["generate_x"])
    assert got == pytest.approx((4.0, 0.3, 2.0, 0.5, 2.0))
    assert ("generate 0.50x, 2.00x (3 tokens the same), decode 0.30x, prefill 2.00x, cache 4.0x smaller "
            "(0.4 / 0.1 MiB)") in capsys.readouterr().out


def test_the_config_refuses_an_unknown_row_and_a_bad_chat_turn():
    """BenchConfig: a cache name it does not know, a chat turn of one number, zero new tokens: a
    ValueError naming the field (under python -O too)."""
    for bad, field in ((dict(rows=("DynamicCache", "StaticCache")), "rows"),
                       (dict(chat_turn=(5,)), "chat_turn"), (dict(new_tokens=0), "new_tokens")):
        with pytest.raises(ValueError, match=field):
            bench_hf.BenchConfig(**bad)


@settings(max_examples=15)                                  # a forward of a model each
@given(N=st.integers(1, 40), G=st.sampled_from([4, 8, 16]), B=st.integers(1, 2),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_an_int2_step_reads_the_codes_scale_zero_of_its_int2_tokens_and_its_window_tokens_at_their_dtype(
        N, G, B, dtype):
    """attention_read of hf_cache holding N tokens per sequence (B of them; sink 4 + window 8, 2 layers,
    2 KV heads of d = 16): per layer, sequence and KV head, max(N - 12, 0) INT2 tokens of K and V codes
    (d/4 bytes each) and a scale and a zero per group (fp32), the rest in the windows at the model's
    dtype; as many pairs as tokens held. Counted here by hand from the sizes."""
    hf = tiny_llama().to(dtype)
    cfg = optr.hf_config(hf.config, sink=4, window=8, group_size=G, page_size=4)
    with optr.hf_cache(hf, [optr.KVQuant()] * 2, cfg) as cache, torch.no_grad():
        assert bench_hf.attention_read(cache) == (0, 0)                    # nothing held yet
        hf(IDS[:, :N].expand(B, N), past_key_values=cache)
        got = bench_hf.attention_read(cache)
    L, H, d, n2, width = 2, 2, 16, max(N - 12, 0), torch.finfo(dtype).bits // 8
    int2, window = 2 * (d // 4 + 2 * 4 * (d // G)), 2 * d * width      # K and V of one (token, KV head)
    assert got == (L * B * H * (n2 * int2 + (N - n2) * window), L * B * H * N)


@given(shapes=st.lists(st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 9), st.integers(1, 8)),
                       min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_a_full_precision_step_reads_every_key_and_value_it_holds(shapes, dtype):
    """attention_read of a DynamicCache whose layer l holds keys and values (B, H, T, d) = shapes[l]:
    B H T d elements of K and of V at the dtype's width, B H T pairs, summed over the layers."""
    cache = DynamicCache()
    for layer, (B, H, T, d) in enumerate(shapes):
        cache.update(torch.zeros(B, H, T, d, dtype=dtype), torch.zeros(B, H, T, d, dtype=dtype), layer)
    width = torch.finfo(dtype).bits // 8
    assert bench_hf.attention_read(cache) == (sum(2 * B * H * T * d * width for B, H, T, d in shapes),
                                              sum(B * H * T for B, H, T, _ in shapes))


def test_the_attention_rates_are_medians_of_each_steps_time_over_its_pairs_and_its_bytes_over_its_time():
    """attention_rates: ms the median step; ns per pair and GB/s the medians of each step's own ratio
    (2,000 / 4,000 / 2,500 ns; 4 / 2 / 3.6 GB/s), a step whose read is unknown left out."""
    run = bench_hf.CacheRun(None, attention_ms=[2.0, 4.0, 3.0, 1.0], read=[(8e6, 1000), (8e6, 1000), (9e6, 1200), None])
    got = bench_hf.attention_rates(run)
    assert got == pytest.approx(dict(attention_ms=3.0, ns_pair=2500.0, gbs=3.0, read_pairs=1000, read_bytes=8e6))
    assert set(bench_hf.attention_rates(bench_hf.CacheRun(None, attention_ms=[1.0], read=[None])).values()) == {None}


def test_the_added_rates_are_the_rise_of_the_attention_time_over_the_rise_of_pairs_and_of_bytes():
    """added_rates between consecutive lengths of one row (in any order, other rows ignored): 10 -> 40 ms
    over 100,000 -> 400,000 pairs of 48 B is 100 ns per pair and 0.48 GB/s; a time that fell gives None."""
    row = lambda T, ms, pairs, cache="hf_cache": dict(cache=cache, T=T, attention_ms=ms, read_pairs=pairs,
                                                      read_bytes=48 * pairs)
    rows = [row(4096, 40.0, 400_000), row(1024, 10.0, 100_000), row(1024, 1.0, 1, "other"), row(8000, 39.0, 780_000)]
    got = bench_hf.added_rates(rows, "hf_cache")
    assert [a["T"] for a in got] == [(1024, 4096), (4096, 8000)]
    assert (got[0]["ns_pair"], got[0]["gbs"]) == pytest.approx((100.0, 0.48))
    assert got[1]["ns_pair"] is None and got[1]["gbs"] is None


def test_a_steps_attention_time_is_its_attention_calls_and_the_function_is_put_back():
    """run_side_by_side times each step's calls of the model's attention function: one that sleeps 5 ms a
    call (one per layer, 2 layers) gives every step at least 10 ms of attention, and less than the step;
    after it the function the model had (here a local entry of transformers' interface) is back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    hf, sdpa = tiny_llama(), functions["sdpa"]

    def sleepy(*args, **kw):
        time.sleep(0.005)
        return sdpa(*args, **kw)
    functions["sdpa"] = sleepy
    try:
        with bench_hf.fresh_caches(makers(hf)) as caches:
            runs = bench_hf.run_side_by_side(hf, caches, IDS[:, :34], 3)
        assert functions["sdpa"] is sleepy
    finally:
        del functions["sdpa"]
    assert functions["sdpa"] is sdpa
    run = runs["DynamicCache"]
    assert len(run.attention_ms) == 3 and all(10 <= a < s for a, s in zip(run.attention_ms, run.steps_ms)), run


def grid_break_even(points):
    """The smallest whole prompt length from which the ratios, interpolated linearly between the points
    (numpy), stay below 1 up to the longest; None if none."""
    T, x = zip(*sorted(points))
    grid = np.arange(T[0], T[-1] + 1)
    above = np.flatnonzero(np.interp(grid, T, x) >= 1 - 1e-12)
    return None if len(above) and above[-1] == len(grid) - 1 else int(grid[above[-1] + 1] if len(above) else grid[0])


@given(points=st.lists(st.tuples(st.integers(1, 20000), st.one_of(st.floats(0.5, 1.5), st.just(1.0))),
                       min_size=1, max_size=5, unique_by=lambda p: p[0]))
def test_the_break_even_is_where_the_interpolated_ratio_goes_below_1_for_good(points):
    """break_even: the length from which the ratio, linear between the lengths measured, stays below 1 up
    to the longest: within a token of the smallest such whole length on numpy's interpolation over every
    token (none where the longest is not below 1; the shortest where every one is)."""
    got, ref = bench_hf.break_even(points), grid_break_even(points)
    if ref is None:
        assert got["how"] == "none" and got["tokens"] is None, (got, points)
    elif ref == min(points)[0]:
        assert got["how"] in ("every", "interpolated") and ref - 1 <= got["tokens"] <= ref, (got, points)
    else:
        assert got["how"] == "interpolated" and ref - 1 <= got["tokens"] <= ref, (got, points)


def test_the_break_even_line_reads_the_median_of_generate_runs_and_says_none_when_never_faster():
    """break_even_line: generate()'s ratio at a length is the median of its runs (1.2 at 1,024; 1.05 at
    4,096; 0.96 at 8,000: linear, ~6,265 tokens); a decode never below 1 reads "none within the lengths
    measured" and its ratio at the longest."""
    summary = [dict(cache="hf_cache", T=T, generate_x=g, decode_x=d) for T, g, d in
               ((1024, [1.1, 1.3], 1.2), (4096, [0.9, 1.2], 1.1), (8000, [1.0, 0.92], 1.0))]
    line, got = bench_hf.break_even_line("hf_cache", summary)
    assert got["generate"]["tokens"] == pytest.approx(4096 + 0.05 / 0.09 * 3904)
    assert "generate() (median of runs) from ~6,265 tokens (linear between 4,096 at 1.05x and 8,000 at 0.96x)" in line
    assert line.endswith("decode none within the lengths measured (1.00x at 8,000, the longest)")
    assert got["decode"]["how"] == "none"


@pytest.mark.slow
def test_the_command_line_runs_dynamic_cache_and_hf_cache_side_by_side_on_smollm2(capsys, tmp_path):
    """python -m tools.bench_hf --quick (SmolLM2, its published quarot+center+clip at the default
    max_tokens, 400 tokens of real text, 2 teacher-forced steps, generate() of 4 tokens twice per
    cache, a 340 + 8 chat turn, --profile): a row per cache with finite numbers; KLs against DynamicCache
    (its own 0; hf_cache's prompt's within round-off, its decode's small but not 0); the summary's "N.Nx
    smaller" is DynamicCache's MiB over hf_cache's; hf_cache's runtime (numba) measured; each row's attention timed
    and its rates finite; a break-even for hf_cache (one length: no added rates); table and figure written."""
    out = bench_hf.main(["--quick", "--rows", "DynamicCache,hf_cache", "--profile", "--out", str(tmp_path)])
    rows, (s,) = out["rows"], out["summary"]
    assert [(r["cache"], r["T"]) for r in rows] == [("DynamicCache", 400), ("hf_cache", 400)]
    for r in rows + out["chat"] + list(out["profile"][400].values()):
        assert all(math.isfinite(x) and x >= 0 for x in r.values() if isinstance(x, float)), r
    assert all(r["prefill_s"] > 0 and r["decode_ms"] > 0 and r["cache_mib"] > 0 for r in rows), rows
    assert all(len(r["generate_s"]) == 2 and min(r["generate_s"]) > 0 for r in rows), rows
    assert all(r["attention_ms"] > 0 and r["ns_pair"] > 0 and r["gbs"] > 0 for r in rows), rows
    assert set(out["break_even"]) == {"hf_cache"} and out["added"] == dict(DynamicCache=[], hf_cache=[])
    assert rows[0]["kl"] == rows[0]["prompt_kl"] == 0 and 0 < rows[1]["kl"] < 0.5, rows
    assert 0 <= rows[1]["prompt_kl"] <= rows[1]["prompt_kl_max"] < 1e-5, rows          # a prompt attends exactly
    assert [(c["cache"], c["P"], c["F"]) for c in out["chat"]] == [("DynamicCache", 340, 8), ("hf_cache", 340, 8)]
    assert s["cache"] == "hf_cache"
    assert s["smaller"] == pytest.approx(rows[0]["cache_mib"] / rows[1]["cache_mib"])
    assert set(out["runtime_mib"]) == {"DynamicCache", "hf_cache"}
    printed = capsys.readouterr().out.splitlines()
    header = printed.index(bench_hf.HEADER)
    shown = [line.split()[:2] for line in printed[header + 1:header + 3]]
    assert shown == [["DynamicCache", "400"], ["hf_cache", "400"]]
    assert not [line for line in printed if "USDT" in line or "Warning" in line], printed
    assert (tmp_path / "bench_hf_smollm2.png").is_file() and (tmp_path / "bench_hf_smollm2.json").is_file()
