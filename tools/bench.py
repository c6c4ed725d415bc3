"""The decode kernels' benchmark: `python -m tools.bench` (kernel.py's device kernel against bf16 SDPA).

One decode step per (batch, context) at a Qwen3-8B-like shape: the INT2 kernel (Triton on CUDA,
numba on a CPU; unchecked, as the cache calls it) against bf16 scaled_dot_product_attention over
a contiguous cache of the same tokens; GB/s counts the bytes each must read, %peak is of the
GPU's HBM bandwidth.  random_inputs builds a random paged cache (the kernel tests use it too).
No project import but kernel.py.
"""
import torch

import kernel

_PEAK_GBS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),     # by device name, in order
             ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 1935.0), ("A100", 1555.0)]
BENCH_SHAPE = dict(H_q=32, H_kv=8, d=128, G=128, P=64, sink=64, recent=256)   # Qwen3-8B-like


def random_inputs(B, n_quant, H_q, H_kv, d, G, P, NW, win_dtype, device):
    """Random cache with a shuffled block table; every sequence has n_quant INT2 tokens."""
    blocks = -(-n_quant // P)
    num_pages, gen = max(1, B * blocks), dict(device=device)
    codes = lambda: torch.randint(0, 256, (num_pages, H_kv, P, d // 4), dtype=torch.uint8, **gen)
    params = lambda: torch.rand(num_pages, H_kv, P, d // G, **gen)
    win = lambda *shape: torch.randn(*shape, dtype=win_dtype, **gen)
    lens = lambda n: torch.full((B,), n, dtype=torch.int32, **gen)
    return dict(q=win(B, H_q, d), k_codes=codes(), k_scale=0.05 + 0.1 * params(), k_zero=3.0 * params(),
                v_codes=codes(), v_scale=0.05 + 0.1 * params(), v_zero=3.0 * params(),
                block_table=torch.randperm(num_pages, **gen)[:B * blocks].to(torch.int32).view(B, blocks),
                n_quant=lens(n_quant), win_k=win(B, H_kv, NW, d), win_v=win(B, H_kv, NW, d), win_len=lens(NW),
                group_size=G)


def _time_us(fn, device, reps=10):
    """Microseconds per call: CUDA graphs on a GPU (do_bench_cudagraph), else the median of reps."""
    if device.type == "cuda":
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn) * 1e3
    import time
    fn()                                                  # compile or load the CPU kernel
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e6


def bench(batches, contexts, device, peak_gbs=None, shape=BENCH_SHAPE):
    """Print a row per (batch, context): one decode step of the INT2 kernel (unchecked: what the
    cache calls) against bf16 scaled_dot_product_attention over a contiguous cache of the same
    tokens (a KV head's query heads as its query rows); GB/s counts the bytes each must read,
    %peak is of the GPU's HBM bandwidth, where known."""
    import torch.nn.functional as F
    H_q, H_kv, d, G, P, sink, recent = (shape[k] for k in ("H_q", "H_kv", "d", "G", "P", "sink", "recent"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    peak = peak_gbs or next((g for key, g in _PEAK_GBS if key in name), None)
    triton = getattr(kernel.triton, "__version__", "not installed")
    print(f"{name}; triton {triton}, torch {torch.__version__}; H_q {H_q}, H_kv {H_kv}, "
          f"d = G = {d}, page {P}, bf16 windows {sink} + {recent}")
    print(f"{'batch':>5} {'ctx':>7} {'int2 us':>9} {'GB/s':>7} {'%peak':>6} {'bf16 us':>9} {'GB/s':>7} {'x bf16':>7}")
    decode = kernel.int2_paged_decode if device.type == "cuda" else kernel.int2_paged_decode_cpu
    for B in batches:
        for ctx in contexts:
            NW = sink + recent
            int2_bytes = 2 * B * H_kv * ((ctx - NW) * (d // 4 + 8 * d // G) + NW * d * 2)  # codes, s, z, windows
            bf16_bytes = 2 * B * H_kv * ctx * d * 2
            if device.type == "cuda" and 3 * (int2_bytes + bf16_bytes) > torch.cuda.mem_get_info(device)[0]:
                print(f"{B:>5} {ctx:>7}  skipped (does not fit in memory)", flush=True)
                continue
            args = random_inputs(B, ctx - NW, H_q, H_kv, d, G, P, NW, torch.bfloat16, device)
            int2_us = _time_us(lambda: decode(**args, checked=False), device)
            del args
            k = torch.randn(B, H_kv, ctx, d, dtype=torch.bfloat16, device=device)
            v, q = torch.randn_like(k), torch.randn(B, H_kv, H_q // H_kv, d, dtype=torch.bfloat16, device=device)
            bf16_us = _time_us(lambda: F.scaled_dot_product_attention(q, k, v), device)
            gbs = int2_bytes / int2_us / 1e3
            pct = f"{100 * gbs / peak:6.1f}" if peak else f"{'-':>6}"
            print(f"{B:>5} {ctx:>7} {int2_us:>9.1f} {gbs:>7.0f} {pct} {bf16_us:>9.1f} "
                  f"{bf16_bytes / bf16_us / 1e3:>7.0f} {bf16_us / int2_us:>6.2f}x", flush=True)


SMOLLM2_SHAPE = dict(H_q=9, H_kv=3, d=64, G=64, P=64, NW=320)   # fp32 windows: sink 64 + window 256
CPU_LENGTHS = (0, 64, 700, 3776, 7700)                            # INT2 tokens: 1k, 4k, 8k less the windows


def _machine():
    """The CPU's model name and the threads torch and numba use."""
    import os
    info = open("/proc/cpuinfo").read().splitlines() if os.path.exists("/proc/cpuinfo") else []
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "CPU")
    return f"{model}, {torch.get_num_threads()} threads"


def cpu_table(lengths=CPU_LENGTHS, reps=21, shape=SMOLLM2_SHAPE, log=print):
    """One decode call per INT2 length at SmolLM2's shape, batch 1: the numba decode as
    int2_paged_decode_cpu (unchecked) and as _nb().decode (what cpu_decode_step calls, numpy in),
    interleaved in one process in a seeded random order each round, with a memory bandwidth read each
    round (torch.sum over 256 MiB fp32); medians [min-max].  ns per INT2 token and KV head (a pair):
    (t(n) - t(0)) / (H_kv n), at t(n)'s median [quartiles]; the GB/s its bytes (K and V codes, scale and
    zero) make at that rate, and the time against theirs at the read bandwidth; t(0) is the window's and
    the fixed cost; ctx counts the window's tokens.  Returns {(path, n): median us}."""
    import time
    import numpy as np
    H_q, H_kv, d, G, P, NW = (shape[k] for k in ("H_q", "H_kv", "d", "G", "P", "NW"))
    torch.manual_seed(0)
    cases = {n: random_inputs(1, n, H_q, H_kv, d, G, P, NW, torch.float32, "cpu") for n in lengths}
    nb = kernel._nb()
    np_args = {n: [a[k].numpy() for k in ("q", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero",
                                          "block_table", "n_quant", "win_k", "win_v", "win_len")]
               + [np.arange(1), G, np.float32(d ** -0.5), kernel._cpu_splits(1, H_kv, n + NW, torch.get_num_threads())]
               for n, a in cases.items()}
    paths = {"int2_paged_decode_cpu": lambda n: kernel.int2_paged_decode_cpu(**cases[n], checked=False),
             "_nb().decode": lambda n: nb.decode(*np_args[n])}
    big = torch.ones(64 << 20)                                               # 256 MiB
    times, gbs = {(p, n): [] for p in paths for n in lengths}, []
    order, rng = [(p, n) for n in lengths for p in paths], np.random.default_rng(0)
    for rep in range(reps + 1):                                              # round 0 warms up
        t0 = time.perf_counter()
        big.sum()
        gbs.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        for i in rng.permutation(len(order)):                                # a fresh order each round
            p, n = order[i]
            t0 = time.perf_counter()
            paths[p](n)
            times[p, n].append((time.perf_counter() - t0) * 1e6)
    med = lambda x: sorted(x[1:])[len(x[1:]) // 2]
    quartiles = lambda x: [sorted(x)[len(x) // 2], sorted(x)[len(x) // 4], sorted(x)[(3 * len(x)) // 4]]
    bw, per_tok = med(gbs), 2 * (d // 4) + 2 * 8 * (d // G)                 # bytes per INT2 token and KV head
    log(f"{_machine()}; torch {torch.__version__}; H_q {H_q}, H_kv {H_kv}, d {d}, G {G}, page {P}, "
        f"fp32 windows {NW}; batch 1; {reps} interleaved rounds, median [min-max]")
    log(f"read bandwidth (torch.sum, 256 MiB): {bw:.1f} GB/s [{min(gbs[1:]):.1f}-{max(gbs[1:]):.1f}]; "
        f"a token-head reads {per_tok} B: {per_tok / bw:.2f} ns")
    log(f"{'path':>22} {'INT2':>5} {'ctx':>5} {'us/call':>22} {'ns/pair [quartiles]':>22} {'GB/s':>5} {'x bytes':>8}")
    for p in paths:
        for n in lengths:
            t, t_0 = times[p, n], med(times[p, lengths[0]])
            row = f"{p:>22} {n:>5} {n + NW:>5} {med(t):>9.1f} [{min(t[1:]):.1f}-{max(t[1:]):.1f}]".ljust(58)
            if n > lengths[0] and n >= 256:
                ns, q1, q3 = ((x - t_0) * 1e3 / (H_kv * (n - lengths[0])) for x in quartiles(t[1:]))
                gb = f"{per_tok / ns:>5.1f}" if ns > 0 else f"{'-':>5}"     # the bytes' GB/s at this rate
                row += f" {ns:>9.1f} [{q1:.1f}-{q3:.1f}]".ljust(23) + f" {gb} {ns / (per_tok / bw):>7.1f}x"
            log(row)
    return {key: med(t) for key, t in times.items()}


def _ints(s):
    """argparse type of --batches, --contexts: positive ints, comma-separated."""
    import argparse
    if not all(x.strip().isdigit() and int(x) > 0 for x in s.split(",")):
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, got {s!r}")
    return tuple(int(x) for x in s.split(","))


def main(argv=None):
    import argparse
    cuda = torch.cuda.is_available() and not kernel._INTERPRETED
    p = argparse.ArgumentParser(description="Time the INT2 paged decode (Triton on CUDA, numba on a CPU) "
                                            "against bf16 SDPA over a full cache: a table.")
    p.add_argument("--batches", type=_ints, default="1,8,32,64" if cuda else "1,8", help="default: %(default)s")
    p.add_argument("--contexts", type=_ints, default="1024,4096,16384,32768,131072" if cuda else "1024,4096,16384",
                   help="default: %(default)s")
    p.add_argument("--cpu-table", action="store_true", help="the numba decode at SmolLM2's shape against "
                   "its bytes' time (ns per INT2 token and KV head; the fixed cost at 0 and 64 tokens)")
    p.add_argument("--peak-gbs", type=float, default=None, help="HBM GB/s for %%peak (default: by GPU name)")
    args = p.parse_args(argv)
    if args.peak_gbs is not None and not args.peak_gbs > 0:
        p.error(f"--peak-gbs: expected a positive number, got {args.peak_gbs}")
    if args.cpu_table:
        return cpu_table()
    bench(args.batches, args.contexts, torch.device("cuda" if cuda else "cpu"), args.peak_gbs)


if __name__ == "__main__":
    main()
