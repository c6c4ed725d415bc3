import sys, types, inspect, textwrap, time; sys.path.insert(0, __import__('os').path.dirname(__file__)); from lev import *
import kernel, numba
f32 = np.float32
src = textwrap.dedent(inspect.getsource(kernel._cpu_decode_job))
OLD_K = """        _cpu_unpack(kc, page, h, slot, mt, tile)
        for t in range(mt if NG == 1 else 0):                         # G = d
            for r in range(R):
                y = f32(0.0)
                for ch in range(d):
                    y += qs[r, ch] * tile[t, ch]
                a[r, i + t] = ks[page, h, slot + t, 0] * (y - kz[page, h, slot + t, 0] * qsum[r, 0])
"""
NEW_K = """        if NG == 1:
            LOGITS(qs, qsum, kc[page, h], ks[page, h], kz[page, h], slot, mt, tile, a, i)
        else:
            _cpu_unpack(kc, page, h, slot, mt, tile)
"""
def logits(qs, qsum, codes, sc, zr, slot, mt, tile, a, i):
    """G = d: a[r, i + t] = logits of tokens slot..slot+mt of one page (codes (P, D4))."""
    R, d = qs.shape
    D4 = codes.shape[1]
    for t in range(mt):
        for c in range(4):
            for j in range(D4):
                tile[t, c * D4 + j] = np.float32((np.int32(codes[slot + t, j]) >> np.int32(2 * c)) & np.int32(3))
    for t in range(mt):
        for r in range(R):
            y = np.float32(0.0)
            for ch in range(d):
                y += qs[r, ch] * tile[t, ch]
            a[r, i + t] = sc[slot + t, 0] * (y - zr[slot + t, 0] * qsum[r, 0])
def variant(edits, extra):
    s = src
    for old, new in edits:
        assert old in s, old[:60]; s = s.replace(old, new)
    g = {}; exec(compile(s, "<v>", "exec"), dict(vars(kernel)), g)
    scope = dict(vars(kernel), prange=numba.prange)
    for name, (fn, opts) in extra.items():
        scope[name] = numba.njit(**opts)(types.FunctionType(fn.__code__, scope, name))
    scope['_cpu_unpack'] = numba.njit(inline="always")(types.FunctionType(kernel._cpu_unpack.__code__, scope, '_cpu_unpack'))
    scope['_cpu_exp_rows'] = numba.njit(inline="always", fastmath=F)(types.FunctionType(kernel._cpu_exp_rows.__code__, scope, '_cpu_exp_rows'))
    scope['_cpu_decode_job'] = numba.njit(fastmath=F)(types.FunctionType(g["_cpu_decode_job"].__code__, scope, '_cpu_decode_job'))
    return numba.njit(parallel=True)(types.FunctionType(kernel._cpu_decode.__code__, scope, '_cpu_decode'))
vs = {"full": build(kernel._cpu_decode_job),
      "K_fn": variant([(OLD_K, NEW_K)], {"LOGITS": (logits, dict(fastmath=F, inline="never"))}),
      "K_fn_inl": variant([(OLD_K, NEW_K)], {"LOGITS": (logits, dict(fastmath=F, inline="always"))})}
numba.set_num_threads(1)
cases = {n: inputs(n) for n in (0, 3776)}
ref = vs["full"](*cases[3776], 1)
for k, f in vs.items(): print(k, np.abs(f(*cases[3776], 1) - ref).max())
ts = {(k, n): [] for k in vs for n in cases}
for rep in range(40):
    for (k, n) in ts:
        t0 = time.perf_counter(); vs[k](*cases[n], 1); ts[k, n].append(time.perf_counter() - t0)
for k in vs:
    a0 = sorted(ts[k, 0])[20]; a1 = sorted(ts[k, 3776]); 
    print(f"{k:>10} t0 {a0*1e6:6.1f} us  ns/pair {(a1[20]-a0)*1e9/(3*3776):6.1f} [{(a1[10]-a0)*1e9/(3*3776):.1f}-{(a1[30]-a0)*1e9/(3*3776):.1f}] (1 thread)")
