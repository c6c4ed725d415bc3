"""scratch: variants of the numba decode job, interleaved, SmolLM2 shape."""
import sys, time, types; sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', '..'))
import numba, numpy as np, torch, kernel
from tools import bench
F = kernel._FASTMATH
def build(job_fn, extra=()):
    scope = dict(vars(kernel), prange=numba.prange)
    def jit(fn, **o):
        c = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
        scope[fn.__name__] = numba.njit(**o)(c); return scope[fn.__name__]
    jit(kernel._cpu_unpack, inline="always")
    jit(kernel._cpu_exp_rows, inline="always", fastmath=F)
    for fn in extra: jit(fn, inline="always", fastmath=F)
    c = types.FunctionType(job_fn.__code__, scope, "_cpu_decode_job", job_fn.__defaults__)
    scope["_cpu_decode_job"] = numba.njit(fastmath=F)(c)
    return jit(kernel._cpu_decode, parallel=True)

def inputs(n, G=64, seed=0):
    torch.manual_seed(seed)
    a = bench.random_inputs(1, n, 9, 3, 64, G, 64, 320, torch.float32, "cpu")
    return [a[k].numpy() for k in ("q","k_codes","k_scale","k_zero","v_codes","v_scale","v_zero","block_table","n_quant","win_k","win_v","win_len")] + [np.arange(1), G, np.float32(64**-0.5)]

def compare(variants, lengths=(0, 3776, 7700), reps=21, splits=None, G=64):
    cases = {n: inputs(n, G) for n in lengths}
    ref = {n: kernel._nb().decode(*cases[n], kernel._cpu_splits(1, 3, n+320)) for n in lengths}
    for name, fn in variants.items():
        for n in lengths:
            out = fn(*cases[n], kernel._cpu_splits(1, 3, n+320))
            err = np.abs(out - ref[n]).max()
            assert err < 2e-5, (name, n, err)
    times = {(v, n): [] for v in variants for n in lengths}
    rng = np.random.default_rng(0); order = list(times)
    for rep in range(reps + 1):
        for i in rng.permutation(len(order)):
            v, n = order[i]; args = cases[n] + [splits or kernel._cpu_splits(1, 3, n+320)]
            t0 = time.perf_counter(); variants[v](*args); dt = time.perf_counter() - t0
            if rep: times[v, n].append(dt * 1e6)
    med = lambda x: sorted(x)[len(x)//2]
    for v in variants:
        t0 = med(times[v, lengths[0]])
        print(f"{v:>12}: t(0) {t0:7.1f} us", *[f"| {n}: {med(times[v,n]):7.1f} us {(med(times[v,n])-t0)*1e3/(3*n):5.1f} ns/pair [{(sorted(times[v,n])[len(times[v,n])//4]-t0)*1e3/(3*n):.1f}-{(sorted(times[v,n])[3*len(times[v,n])//4]-t0)*1e3/(3*n):.1f}]" for n in lengths[1:]])
