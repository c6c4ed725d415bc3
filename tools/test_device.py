"""The device checks (marked gpu): serving, a CUDA-graph replay, transformers on the device
against the CPU.

On CUDA, `pytest -m "kernel or gpu"` runs them with the spec's kernel tests, the device
against the CPU; without CUDA (or triton) conftest.py skips them and says why: there they
would compare the CPU with itself. The tests of check_transformers itself run on the CPU.
Their launch shapes are in tools/test_sass.py (GPU_LAUNCHES), which `pytest -m sass_all`
compiles. The builders they share with the spec (device, tiny_hf, hf_settings, ...) are
conftest.py's fixtures.
"""
import sys
from dataclasses import replace

import pytest
import torch

import ladder
import optr
from kernel import int2_paged_decode
from tools import bench

GPU_SHAPE = dict(bench.BENCH_SHAPE)
def folded_tinylm_on(device):
    """A random optr.TinyLM with QuaRot rotations on `device`: (cfg, the model with R_V
    folded, the rotations as optr.KVQuant)."""
    d = 128
    cfg = optr.Config(n_heads=8, n_kv_heads=2, head_dim=d, d_model=128, group_size=d,
                      sink=2, window=6, page_size=16)
    torch.manual_seed(0)
    model = optr.TinyLM(cfg)
    kv = [optr.KVQuant(r_k=optr.quarot_rotation(cfg.n_kv_heads, d),
                       r_v=optr.quarot_rotation(cfg.n_kv_heads, d)) for _ in range(cfg.n_layers)]
    return cfg, optr.fold_value_rotation(model, kv).to(device), [s.to(device) for s in kv]


@pytest.fixture(scope="module")
def shuffled_cache(shuffled):
    """shuffled_cache(cfg, kv, B, n_tokens, device): an optr.PagedKVCache on `device` with bf16
    windows, room for B sequences of n_tokens and two pages more, its pages taken in shuffled
    order; (cache, seqs)."""
    def build(cfg, kv, B, n_tokens, device):
        num_pages = B * -(-n_tokens // cfg.page_size) + 2
        cache = optr.PagedKVCache(cfg, num_pages, B, kv, window_dtype=torch.bfloat16, device=device)
        cache = shuffled(cache, 0)
        return cache, [cache.add_sequence() for _ in range(B)]
    return build


def kernel_and_reference(worst):
    """An `attend` for optr.decode_step: the Triton kernel's output, with the largest
    |kernel - reference| / (1e-5 + 1e-4 |reference|) on the same paged view kept in worst[0]."""
    def both(q, **view):
        out = int2_paged_decode(q, **view)
        ref = optr.paged_decode_reference(q, **view)
        worst[0] = max(worst[0], ((out - ref).abs() / (1e-5 + 1e-4 * ref.abs())).max().item())
        return out
    return both


@pytest.mark.gpu
def test_gpu_the_kernel_matches_the_reference_on_a_small_ragged_case(device, tiny_kernel_error):
    """The Triton kernel on the device against optr.paged_decode_reference: 3 ragged
    sequences (one with no INT2 token, one with no window), bf16, within 1e-5.
    Optr against optr: the Triton kernel on the device against paged_decode_reference."""
    assert tiny_kernel_error(device) < 1e-5


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_decode_step_through_the_paged_cache_uses_the_kernel_as_the_reference(device, shuffled_cache):
    """optr.decode_step through optr.PagedKVCache on the device with bf16 windows: every
    layer's kernel output equals optr.paged_decode_reference on the same paged view, token
    after token, as INT2 tokens fill several pages.
    Optr against optr: the Triton kernel on the device against paged_decode_reference, layer by
    layer."""
    cfg, folded, kv = folded_tinylm_on(device)
    steps, B = 120, 3
    cache, seqs = shuffled_cache(cfg, kv, B, steps, device)
    worst = [0.0]
    tokens = torch.randint(0, cfg.vocab_size, (steps, B), generator=torch.Generator().manual_seed(0)).to(device)
    for t in range(steps):
        logits = optr.decode_step(folded, cache, seqs, tokens[t], attend=kernel_and_reference(worst))
    assert int(cache.n_int2()[seqs[0]]) > cfg.page_size
    assert worst[0] <= 1.0 and bool(torch.isfinite(logits).all()), worst


@pytest.mark.gpu
def test_gpu_a_decode_step_makes_no_host_sync(device, shuffled_cache):
    """optr.decode_step through optr.PagedKVCache on CUDA runs under set_sync_debug_mode("error"):
    its pages are taken once per forward on the host, its lengths live on the device too, the INT2
    write gathers its slots from the block table there, the kernel launches unchecked."""
    if device.type != "cuda":
        pytest.skip("CUDA's sync debug mode: needs CUDA")
    cfg, folded, kv = folded_tinylm_on(device)
    cache, seqs = shuffled_cache(cfg, kv, 2, 40, device)
    tokens = torch.randint(0, cfg.vocab_size, (40, 2), generator=torch.Generator().manual_seed(0)).to(device)
    for t in range(30):                                          # past the windows; the kernels compiled
        optr.decode_step(folded, cache, seqs, tokens[t])
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(30, 40):
            optr.decode_step(folded, cache, seqs, tokens[t])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(cache.n_int2()[seqs[0]]) == 40 - cfg.sink - cfg.window


@pytest.mark.gpu
def test_gpu_prefill_stores_what_appends_store_and_its_logits_are_the_cpus(device, shuffled_cache):
    """optr.prefill of a prompt into an optr.PagedKVCache on the device with bf16 windows:
    the cache is bit for bit what token-by-token appends of the same forward's keys and
    values store on the device; the page ids are the CPU prefill's and the logits within 2%
    of the CPU logits' largest (a code at a rounding boundary may round the other way on
    another device); the next decode_step's kernel output equals the reference.
    Optr against optr: prefill on the device against appends on the device and against prefill on
    the CPU."""
    T, B = 200, 3
    prompt = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(1))

    def prefilled(dev):                     # (cfg, folded model, kv, cache, seqs, logits)
        cfg, folded, kv = folded_tinylm_on(dev)
        cache, seqs = shuffled_cache(cfg, kv, B, T + 1, dev)
        return cfg, folded, kv, cache, seqs, optr.prefill(folded, cache, seqs, prompt[:, :T].to(dev))
    cfg, folded, kv, cache, seqs, logits = prefilled(device)
    one, _ = shuffled_cache(cfg, kv, B, T + 1, device)
    captured, specs = [], [replace(s, r_v=None) for s in kv]               # R_V is folded
    with torch.no_grad():
        sim = folded(prompt[:, :T].to(device), optr.SimulatedINT2(specs, cfg, block=256), capture=captured)
    k, v = (torch.stack(x) for x in list(zip(*captured))[1:])                 # (L, n, H_kv, T, d)
    for t in range(T):
        one.append(seqs, k[:, :, :, t:t + 1], v[:, :, :, t:t + 1])
    names = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "win_k", "win_v",
             "block_table", "length")
    assert [n for n in names if not torch.equal(getattr(cache, n), getattr(one, n))] == []
    assert torch.equal(logits, sim)
    *_, cpu_cache, _, cpu_logits = prefilled(torch.device("cpu"))
    assert torch.equal(cache.block_table.cpu(), cpu_cache.block_table)
    assert ((logits.cpu() - cpu_logits).abs().max() / cpu_logits.abs().max()).item() <= 0.02
    worst = [0.0]
    nxt = optr.decode_step(folded, cache, seqs, prompt[:, T].to(device), attend=kernel_and_reference(worst))
    assert worst[0] <= 1.0 and bool(torch.isfinite(nxt).all()), worst


@pytest.mark.gpu
def test_gpu_a_cuda_graph_replay_after_inputs_change_in_place_is_the_reference(device):
    """The unchecked launch captured in a CUDA graph and replayed after the inputs changed
    in place (new queries, shorter sequences) equals the eager reference on the new inputs.
    Optr against optr: the replayed CUDA graph against paged_decode_reference."""
    torch.manual_seed(1)
    s = GPU_SHAPE
    n, NW = 3000, s["sink"] + s["recent"]
    args = bench.random_inputs(2, n, s["H_q"], s["H_kv"], s["d"], s["G"], s["P"], NW, torch.bfloat16, device)
    run = lambda: int2_paged_decode(**args, checked=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()                                       # compile and warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(3):
        args["q"].copy_(torch.randn_like(args["q"]))
        args["n_quant"].copy_(torch.tensor([n - 7 * step, n // 2 + step], dtype=torch.int32))
        args["win_len"].copy_(torch.tensor([NW, NW - step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize(device)
        got = out
        assert (got - optr.paged_decode_reference(**args)).abs().max().item() <= 2e-5, step


def _appendix_e_run(make_model, settings, kind, device, ids, kv=None):
    """The tiny random transformers model `kind` (make_model(kind), seed 0) on `device`, optr's
    `settings` (hf_settings()): calibrate_hf's specs from ids[:2] (held out: ids[2:4]), and
    simulate_hf's logits of ids[4:] in exact mode and in INT2 with kv (None: the specs just learned)."""
    model = make_model(kind).to(device)
    cfg = optr.hf_config(model.config, **settings)
    x = ids.to(device)
    learned, _ = ladder.calibrate_hf(model, x[:2], x[2:4], cfg)
    with torch.no_grad():
        with ladder.simulate_hf(model, None, cfg):
            exact = model(x[4:]).logits
        with ladder.simulate_hf(model, learned if kv is None else [s.to(device) for s in kv], cfg):
            int2 = model(x[4:]).logits
    return model, cfg, learned, exact, int2


def check_transformers(device, make_model, settings):
    """optr's appendix E on `device` against the CPU, TF32 off, on the tiny random transformers
    models (make_model: tiny_hf; optr's `settings`: hf_settings()): a Llama (GQA) and a Gemma 3
    (sliding layers of 12 tokens on 30, exact by calibrate_hf's default).  Judged: simulate_hf's
    logits in exact mode within 1e-4 of the CPU's largest (fp32 sums in another order: a 1e-6
    relative jitter of every weight moves them by 1.8e-5 on the CPU, TF32's rounding by 2.6e-3)
    and in INT2 with the CPU's specs within 2e-2 (a code at a rounding boundary may round the
    other way); calibrate_hf's specs all on the device, the same layers in INT2, key means
    within 1e-4, rotations orthogonal within 1e-4 and, scored on the CPU, an end-to-end KL
    within 20% of the CPU's rotations' (the jitter: 2.4%; one of 1e-5: 23%).  The learned
    rotations are not compared entry by entry: a code that rounds the other way changes the
    STE gradient, and Adam moves each entry by about lr whatever its gradient's size.
    Returns (ok, detail), or (None, why) without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, "skipped: transformers is not importable here"
    cpu, failed, details = torch.device("cpu"), [], []
    ids = torch.randint(0, 300, (6, 30), generator=torch.Generator().manual_seed(2))
    rel = lambda a, b: ((a.cpu() - b).abs().max() / b.abs().max()).item()
    kl = lambda p, q: ladder.token_kl(p, q).mean().item()                # KL(p || q) of log-probs
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for kind in ("llama-GQA", "gemma3-GQA"):
            model, cfg, ref, exact, int2 = _appendix_e_run(make_model, settings, kind, cpu, ids)
            _, _, got, dev_exact, dev_int2 = _appendix_e_run(make_model, settings, kind, device, ids, ref)
            pairs = [(a, b) for a, b in zip(got, ref) if a.r_k is not None]
            eye = torch.eye(cfg.head_dim, device=device)
            with torch.no_grad(), ladder.simulate_hf(model, [s.to(cpu) for s in got], cfg):
                kl_dev = kl(exact.log_softmax(-1), model(ids[4:]).logits.log_softmax(-1))
            measured = {                                   # name: (value, largest that passes)
                "logits exact": (rel(dev_exact, exact), 1e-4),
                "INT2": (rel(dev_int2, int2), 2e-2),
                "k_mean": (max((a.k_mean.cpu() - b.k_mean).abs().max().item() for a, b in pairs), 1e-4),
                "|R^T R - I|": (max((R.mT @ R - eye).abs().max().item()
                                    for a, _ in pairs for R in (a.r_k, a.r_v)), 1e-4),
                "KL / CPU's - 1": (abs(kl_dev / kl(exact.log_softmax(-1), int2.log_softmax(-1)) - 1), 0.2)}
            passed = {**{n: v <= limit for n, (v, limit) in measured.items()},     # NaN fails
                      f"specs on {device.type}": all(t.device.type == device.type for s in got
                                                     for t in (s.k_mean, s.r_k, s.r_v) if t is not None),
                      "same INT2 layers": [s.quant_k for s in got] == [s.quant_k for s in ref]}
            failed += [f"{kind} {n}" for n, ok in passed.items() if not ok]
            details.append(f"{kind}: " + ", ".join(f"{n} {v:.1e}" for n, (v, _) in measured.items()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return not failed, "; ".join(details) + (f"; FAILED: {', '.join(failed)}" if failed else "")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_transformers_models_calibrated_and_simulated_on_the_device_match_the_cpu(device, tiny_hf,
                                                                                      hf_settings):
    """check_transformers(device) passes: the device computes as the CPU does.
    Optr against optr: calibrate_hf and simulate_hf on the device against the same on the CPU."""
    pytest.importorskip("transformers")
    ok, detail = check_transformers(device, tiny_hf, hf_settings())
    assert ok, detail


@pytest.mark.slow
@pytest.mark.parametrize("device_weights", ["as-cpu", "tf32-rounded"])
def test_the_transformers_device_check_passes_only_where_the_device_computes_as_the_cpu(
        device_weights, tiny_hf, hf_settings):
    """check_transformers, run with the CPU as the device, passes when that side computes as
    the CPU does, and fails when its weights are rounded to TF32's 10-bit mantissa (what TF32
    matmuls would do)."""
    pytest.importorskip("transformers")
    built = {}

    def device_side_rounded(kind):                 # the second model of a kind is the device's
        model, built[kind] = tiny_hf(kind), built.get(kind, 0) + 1
        if device_weights == "tf32-rounded" and built[kind] == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(((p.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32))
        return model
    ok, detail = check_transformers(torch.device("cpu"), device_side_rounded, hf_settings())
    assert built == {"llama-GQA": 2, "gemma3-GQA": 2}
    assert ok == (device_weights == "as-cpu"), detail


def test_the_transformers_device_check_is_skipped_without_transformers(monkeypatch, tiny_hf, hf_settings):
    """Where transformers cannot be imported (the GPU machine's image) check_transformers
    says so and returns None instead of failing."""
    monkeypatch.setitem(sys.modules, "transformers", None)           # import raises ImportError
    ok, detail = check_transformers(torch.device("cpu"), tiny_hf, hf_settings())
    assert ok is None and "transformers is not importable" in detail, detail


@pytest.mark.gpu
def test_gpu_generate_through_hf_cache_gives_the_cpus_tokens_and_logits(device, tiny_hf, hf_settings,
                                                                          quarot_specs, idx_hf):
    """Greedy generate() of a tiny random Llama (GQA, windows 2 and 4) through optr.hf_cache
    on the device (the Triton kernel behind transformers' attention on CUDA) against the CPU
    (the compiled CPU kernel): the same 12 tokens after a 20-token prompt, and the step logits
    within 2e-2 (a code at a rounding boundary may round the other way).
    Optr against optr: hf_cache's generate() on the device against the same on the CPU."""
    pytest.importorskip("transformers")
    out = []
    for dev in (torch.device("cpu"), device):
        model = tiny_hf("llama-GQA").to(dev)
        cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
        with torch.no_grad(), optr.hf_cache(model, quarot_specs(cfg, seed=7), cfg) as cache:
            out.append(model.generate(idx_hf[:, :20].to(dev), past_key_values=cache, max_new_tokens=12,
                                      do_sample=False, pad_token_id=0, output_logits=True,
                                      return_dict_in_generate=True))
    a, b = out
    assert torch.equal(a.sequences.cpu(), b.sequences.cpu())
    assert max((x.cpu() - y.cpu()).abs().max().item() for x, y in zip(a.logits, b.logits)) <= 2e-2
