import sys, types, inspect, textwrap, time; sys.path.insert(0, __import__('os').path.dirname(__file__)); from lev import *
import kernel, numba
src = textwrap.dedent(inspect.getsource(kernel._cpu_decode_job))
def variant(edits):
    s = src
    for old, new in edits:
        assert old in s, old[:70]; s = s.replace(old, new)
    g = {}; exec(compile(s, "<v>", "exec"), dict(vars(kernel)), g)
    return build(g["_cpu_decode_job"])
KDOT = "                    y += qs[r, ch] * tile[t, ch]\n"
PV = """                    o[r, ch] += (x0 * tile[t, ch] + x1 * tile[t + 1, ch]) + (x2 * tile[t + 2, ch]
                                                                          + x3 * tile[t + 3, ch])
"""
V = {"full": [],
 "no_Kdot": [(KDOT, "                    y += qs[r, ch]\n")],
 "no_Kunpack": [("        _cpu_unpack(kc, page, h, slot, mt, tile)\n", "")],
 "no_pass1": [("    while i < nt:                                                     # pass 1", "    a[:, :nt] = 0.0\n    while i < 0:  #")],
 "no_pass2": [("    while i < nt:                                                     # pass 2", "    while i < 0:  #")],
 "no_pv4": [(PV, "                    pass\n")],
 "no_Vunpack": [("        _cpu_unpack(vc, page, h, slot, mt, tile)\n", "")],
 "no_xs": [("                    psz[r, g] += xs[r, t * NG + g] * vz[page, h, slot + t, g]\n", "")],
}
vs = {k: variant(e) for k, e in V.items()}
numba.set_num_threads(1)
cases = {n: inputs(n) for n in (0, 3776)}
ts = {(k, n): [] for k in vs for n in cases}
rng = np.random.default_rng(1); order = list(ts)
for rep in range(30):
    for j in rng.permutation(len(order)):
        k, n = order[j]
        t0 = time.perf_counter(); vs[k](*cases[n], 1); ts[k, n].append(time.perf_counter() - t0)
for k in vs:
    a0 = sorted(ts[k, 0])[15]; a1 = sorted(ts[k, 3776])
    print(f"{k:>10} t0 {a0*1e6:6.1f} us  ns/pair {(a1[15]-a0)*1e9/(3*3776):6.1f} [{(a1[7]-a0)*1e9/(3*3776):.1f}-{(a1[22]-a0)*1e9/(3*3776):.1f}] (1 thread)")
