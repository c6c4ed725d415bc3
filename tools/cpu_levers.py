"""Issue 58's levers on the numba decode job, each against the job before (f88f914's, frozen here as
job_f88f914), interleaved in one process at SmolLM2's shape (9 query / 3 KV heads, d = G = 64, fp32
windows 320, batch 1, 2 threads): `python -m tools.cpu_levers levers` (ablate, ablate_v: where the time
goes; splits: the context split).  A scratch harness: its winners move into kernel.py, its losers into
NOTES.md, and it leaves the tree in the next commit."""
import sys, time, types
import numba, numpy as np, torch
import kernel
from tools import bench

F = kernel._FASTMATH
f32 = np.float32


def build(job_fn, extra=()):
    scope = dict(vars(kernel), prange=numba.prange)
    def jit(fn, **o):
        c = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
        scope[fn.__name__] = numba.njit(**o)(c); return scope[fn.__name__]
    c = types.FunctionType(unpack_f88f914.__code__, scope, "_cpu_unpack")   # the job before's row unpack
    scope["_cpu_unpack"] = numba.njit(inline="always")(c)
    jit(kernel._cpu_exp_rows, inline="always", fastmath=F)
    for fn in extra:
        jit(fn, inline="always", fastmath=F)
    c = types.FunctionType(job_fn.__code__, scope, "_cpu_decode_job", job_fn.__defaults__)
    scope["_cpu_decode_job"] = numba.njit(fastmath=F)(c)
    return jit(kernel._cpu_decode, parallel=True), scope["_cpu_decode_job"]


def unpack_f88f914(codes, page, h, slot, m, tile):
    """tile[t] = the d codes of row (page, h, slot + t) as fp32, t < m (int32 shifts: AVX2 converts int32)."""
    D4 = codes.shape[3]
    for t in range(m):
        for c in range(4):
            for j in range(D4):
                tile[t, c * D4 + j] = np.float32((np.int32(codes[page, h, slot + t, j]) >> np.int32(2 * c))
                                                 & np.int32(3))


def job_f88f914(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part,
                    lse_part, job):
    """One (sequence b, KV head h, split sp) in two passes (logits and max, then p V: no rescaling),
    factored as the Triton kernel, over tiles of up to _CPU_TILE tokens of one page (codes unpacked once
    a tile; at G = d p V four tokens a sweep); b reads block-table and window row rows[b]."""
    f32 = np.float32
    (B, Hq, d), H, P = q.shape, kc.shape[1], kc.shape[2]
    R, NG, T = Hq // H, d // G, _CPU_TILE
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w, s = nq[b], wl[b], rows[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split          # INT2 tokens [t0, t1)
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split          # window slots [w0, w1)
    nt, nw = t1 - t0, w1 - w0
    if nt + nw == 0:                                                  # nothing here: lse stays -inf
        return
    qs = np.empty((R, d), dtype=f32)                                  # the KV head's queries, scaled,
    qsum = np.zeros((R, NG), dtype=f32)                               # and their sum per Q2 group
    for r in range(R):
        for ch in range(d):
            qs[r, ch] = q[b, h * R + r, ch] * scale
            qsum[r, ch // G] += qs[r, ch]
    a, tile = np.empty((R, nt + nw), dtype=f32), np.empty((T, d), dtype=f32)   # logits then p; codes
    qs3, tile3 = qs.reshape(R, NG, G), tile.reshape(T, NG, G)         # views by Q2 group
    i = 0
    while i < nt:                                                     # pass 1: INT2 logits, a tile
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P               # of mt tokens in one page
        mt = min(T, nt - i, P - slot)
        _cpu_unpack(kc, page, h, slot, mt, tile)
        for t in range(mt if NG == 1 else 0):                         # G = d
            for r in range(R):
                y = f32(0.0)
                for ch in range(d):
                    y += qs[r, ch] * tile[t, ch]
                a[r, i + t] = ks[page, h, slot + t, 0] * (y - kz[page, h, slot + t, 0] * qsum[r, 0])
        for t in range(0 if NG == 1 else mt):                         # G < d
            for r in range(R):
                y = f32(0.0)
                for g in range(NG):
                    x = f32(0.0)
                    for k in range(G):        # indices from ranges (known >= 0): the loop vectorises
                        x += qs3[r, g, k] * tile3[t, g, k]
                    y += ks[page, h, slot + t, g] * (x - kz[page, h, slot + t, g] * qsum[r, g])
                a[r, i + t] = y
        i += mt
    for i in range(nw):                                               # the window tokens, exact
        for r in range(R):
            y = f32(0.0)
            for ch in range(d):
                y += qs[r, ch] * wk[s, h, w0 + i, ch]
            a[r, nt + i] = y
    m, l = np.empty(R, dtype=f32), np.zeros(R, dtype=f32)
    for r in range(R):
        m[r] = a[r].max()
    _cpu_exp_rows(a, m, nt + nw)
    for r in range(R):
        for i in range(nt + nw):
            l[r] += a[r, i]
    o, psz = np.zeros((R, d), dtype=f32), np.zeros((R, NG), dtype=f32)
    o3, xs = o.reshape(R, NG, G), np.empty((R, T * NG), dtype=f32)  # xs[r, t NG + g]: p s of (t, g)
    i = 0
    while i < nt:                                                     # pass 2: p V~, tile by tile
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        _cpu_unpack(vc, page, h, slot, mt, tile)
        for r in range(R):
            for t in range(mt):
                for g in range(NG):
                    xs[r, t * NG + g] = a[r, i + t] * vs[page, h, slot + t, g]
                    psz[r, g] += xs[r, t * NG + g] * vz[page, h, slot + t, g]
            t = 0
            while NG == 1 and t + 4 <= mt:                            # G = d: four tokens a sweep of o
                x0, x1, x2, x3 = xs[r, t], xs[r, t + 1], xs[r, t + 2], xs[r, t + 3]
                for ch in range(d):
                    o[r, ch] += (x0 * tile[t, ch] + x1 * tile[t + 1, ch]) + (x2 * tile[t + 2, ch]
                                                                          + x3 * tile[t + 3, ch])
                t += 4
            for t in range(t, mt):                                    # the rest; G < d: every token
                for g in range(NG):
                    for k in range(G):
                        o3[r, g, k] += xs[r, t * NG + g] * tile3[t, g, k]
        i += mt
    for i in range(nw):
        for r in range(R):
            for ch in range(d):
                o[r, ch] += a[r, nt + i] * wv[s, h, w0 + i, ch]
    for r in range(R):
        for ch in range(d):
            o_part[b, h * R + r, sp, ch] = (o[r, ch] - psz[r, ch // G]) / l[r]
        lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])


def job_tl(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, job):
    """Pass 1 with lanes over 16 tokens (codes read as uint32 words), else kernel's job."""
    f32 = np.float32
    (B, Hq, d), H, P = q.shape, kc.shape[1], kc.shape[2]
    R, NG, T, D4 = Hq // H, d // G, 16, d // 4
    W = D4 // 4
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w, s = nq[b], wl[b], rows[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split
    nt, nw = t1 - t0, w1 - w0
    if nt + nw == 0:
        return
    qs = np.empty((R, d), dtype=f32)
    qsum = np.zeros((R, NG), dtype=f32)
    for r in range(R):
        for ch in range(d):
            qs[r, ch] = q[b, h * R + r, ch] * scale
            qsum[r, ch // G] += qs[r, ch]
    a, tile = np.empty((R, nt + nw), dtype=f32), np.empty((T, d), dtype=f32)
    o3 = None
    kw = kc.view(np.uint32)
    wt, x, acc = np.empty(T, dtype=np.uint32), np.empty(T, dtype=f32), np.empty((R, NG, T), dtype=f32)
    i = 0
    while i < nt:
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        acc[:] = 0
        for wd in range(W):
            for t in range(T):
                wt[t] = kw[page, h, slot + min(t, mt - 1), wd]
            for e in range(4):
                for c in range(4):
                    ch = c * D4 + 4 * wd + e
                    g, sh = ch // G, np.uint32(8 * e + 2 * c)
                    for t in range(T):
                        x[t] = f32((wt[t] >> sh) & np.uint32(3))
                    for r in range(R):
                        qv = qs[r, ch]
                        for t in range(T):
                            acc[r, g, t] += qv * x[t]
        for t in range(mt):
            for r in range(R):
                y = f32(0.0)
                for g in range(NG):
                    y += ks[page, h, slot + t, g] * (acc[r, g, t] - kz[page, h, slot + t, g] * qsum[r, g])
                a[r, i + t] = y
        i += mt
    for i in range(nw):
        for r in range(R):
            y = f32(0.0)
            for ch in range(d):
                y += qs[r, ch] * wk[s, h, w0 + i, ch]
            a[r, nt + i] = y
    m, l = np.empty(R, dtype=f32), np.zeros(R, dtype=f32)
    for r in range(R):
        m[r] = a[r].max()
    _cpu_exp_rows(a, m, nt + nw)
    for r in range(R):
        for i in range(nt + nw):
            l[r] += a[r, i]
    o, psz = np.zeros((R, d), dtype=f32), np.zeros((R, NG), dtype=f32)
    o3, tile3, xs = o.reshape(R, NG, G), tile.reshape(T, NG, G), np.empty((R, T * NG), dtype=f32)
    i = 0
    while i < nt:
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        _cpu_unpack(vc, page, h, slot, mt, tile)
        for r in range(R):
            for t in range(mt):
                for g in range(NG):
                    xs[r, t * NG + g] = a[r, i + t] * vs[page, h, slot + t, g]
                    psz[r, g] += xs[r, t * NG + g] * vz[page, h, slot + t, g]
            t = 0
            while NG == 1 and t + 4 <= mt:
                x0, x1, x2, x3 = xs[r, t], xs[r, t + 1], xs[r, t + 2], xs[r, t + 3]
                for ch in range(d):
                    o[r, ch] += (x0 * tile[t, ch] + x1 * tile[t + 1, ch]) + (x2 * tile[t + 2, ch]
                                                                          + x3 * tile[t + 3, ch])
                t += 4
            for t in range(t, mt):
                for g in range(NG):
                    for k in range(G):
                        o3[r, g, k] += xs[r, t * NG + g] * tile3[t, g, k]
        i += mt
    for i in range(nw):
        for r in range(R):
            for ch in range(d):
                o[r, ch] += a[r, nt + i] * wv[s, h, w0 + i, ch]
    for r in range(R):
        for ch in range(d):
            o_part[b, h * R + r, sp, ch] = (o[r, ch] - psz[r, ch // G]) / l[r]
        lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])


def args_for(n, H_q=9, H_kv=3, d=64, G=64, P=64, NW=320, seed=0):
    torch.manual_seed(seed)
    a = bench.random_inputs(1, n, H_q, H_kv, d, G, P, NW, torch.float32, "cpu")
    return [a[k].numpy() for k in ("q", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero",
                                   "block_table", "n_quant", "win_k", "win_v", "win_len")] + \
        [np.arange(1), G, np.float32(d ** -0.5), kernel._cpu_splits(1, H_kv, n + NW)]


def compare(variants, lengths=(0, 3776, 7700), reps=21, H_kv=3):
    cases = {n: args_for(n) for n in lengths}
    for name, f in variants.items():                       # compile, and check against the first
        for n in lengths:
            f(*cases[n])
    ref = {n: list(variants.values())[0](*cases[n]) for n in lengths}
    for name, f in variants.items():
        print(name, "max |diff| vs first:", max(float(np.abs(f(*cases[n]) - ref[n]).max()) for n in lengths))
    times = {(v, n): [] for v in variants for n in lengths}
    order, rng = list(times), np.random.default_rng(0)
    for rep in range(reps + 1):
        for i in rng.permutation(len(order)):
            v, n = order[i]
            t0 = time.perf_counter(); variants[v](*cases[n]); dt = (time.perf_counter() - t0) * 1e6
            if rep:
                times[v, n].append(dt)
    med = lambda x: sorted(x)[len(x) // 2]
    for v in variants:
        t_0 = med(times[v, lengths[0]])
        row = [f"{v:>10}"]
        for n in lengths:
            t = times[v, n]
            ns = (med(t) - t_0) * 1e3 / (H_kv * n) if n else float("nan")
            row.append(f"{n}: {med(t):7.1f} us [{min(t):.1f}-{max(t):.1f}] {ns:5.1f} ns")
        print(" | ".join(row))


import inspect, textwrap
SRC = inspect.getsource(job_f88f914).replace("def job_f88f914(", "def _cpu_decode_job(")


def variant(*subs):
    src = SRC
    for old, new in subs:
        assert old in src, old
        src = src.replace(old, new)
    ns = dict(vars(kernel), _cpu_unpack=unpack_f88f914)
    exec(src, ns)
    return ns["_cpu_decode_job"]


def ablate():
    no_k = variant(("        _cpu_unpack(kc, page, h, slot, mt, tile)\n        for t in range(mt if NG == 1 else 0):",
                    "        for t in range(0):"), ("    while i < nt:                                                     # pass 1",
                    "    a[:] = 0\n    while i < nt:  #"))
    no_v = variant(("        _cpu_unpack(vc, page, h, slot, mt, tile)\n        for r in range(R):", "        for r in range(0):"))
    no_kdot = variant(("        for t in range(mt if NG == 1 else 0):", "        a[:, i:i+mt] = tile[0, 0]\n        for t in range(0):"))
    compare({"base": build(job_f88f914)[0], "no_k": build(no_k)[0], "no_v": build(no_v)[0],
             "no_kdot": build(no_kdot)[0]}, lengths=(0, 7700), reps=11)



def _cpu_unpack16(codes, page, h, slot, m, tile):
    """_cpu_unpack over a page's (P, D4) view, 16 bytes a chunk where D4 allows (a zmm, no remainder)."""
    D4 = codes.shape[3]
    src = codes[page, h]
    if D4 % 16 == 0:
        for t in range(m):
            for c in range(4):
                for j0 in range(0, D4, 16):
                    for k in range(16):
                        tile[t, c * D4 + j0 + k] = np.float32((np.int32(src[slot + t, j0 + k]) >> np.int32(2 * c))
                                                              & np.int32(3))
    else:
        for t in range(m):
            for c in range(4):
                for j in range(D4):
                    tile[t, c * D4 + j] = np.float32((np.int32(src[slot + t, j]) >> np.int32(2 * c)) & np.int32(3))


INT8 = (("    a, tile = np.empty((R, nt + nw), dtype=f32), np.empty((T, d), dtype=f32)",
         "    q8, qsc = np.empty((R, d), dtype=np.int8), np.empty(R, dtype=f32)\n"
         "    for r in range(R):\n"
         "        qsc[r] = max(np.abs(qs[r]).max(), f32(1e-30)) / f32(127.0)\n"
         "        for ch in range(d):\n"
         "            q8[r, ch] = np.int8(np.round(qs[r, ch] / qsc[r]))\n"
         "    tile8 = np.empty((T, d), dtype=np.uint8)\n"
         "    a, tile = np.empty((R, nt + nw), dtype=f32), np.empty((T, d), dtype=f32)"),
        ("        _cpu_unpack(kc, page, h, slot, mt, tile)\n",
         "        for t in range(mt):\n"
         "            for c in range(4):\n"
         "                for j in range(d // 4):\n"
         "                    tile8[t, c * (d // 4) + j] = (kc[page, h, slot + t, j] >> np.uint8(2 * c)) & np.uint8(3)\n"),
        ("                y = f32(0.0)\n                for ch in range(d):\n                    y += qs[r, ch] * tile[t, ch]\n"
         "                a[r, i + t] = ks[page, h, slot + t, 0] * (y - kz[page, h, slot + t, 0] * qsum[r, 0])",
         "                yi = np.int32(0)\n                for ch in range(d):\n"
         "                    yi += np.int32(q8[r, ch]) * np.int32(tile8[t, ch])\n"
         "                a[r, i + t] = ks[page, h, slot + t, 0] * (qsc[r] * f32(yi) - kz[page, h, slot + t, 0] * qsum[r, 0])"))


def exp1_asm():
    import re, collections
    u16 = variant(("_cpu_unpack(kc", "_cpu_unpack16(kc"), ("_cpu_unpack(vc", "_cpu_unpack16(vc"))
    i8 = variant(*INT8)
    dec_i8, job_i8 = build(i8)
    vs = {"base": build(job_f88f914)[0], "u16": build(u16, extra=(_cpu_unpack16,))[0], "int8": dec_i8}
    compare(vs, lengths=(0, 3776, 7700), reps=15)
    asm = "\n".join(job_i8.inspect_asm().values())
    c = collections.Counter(re.findall(r'^\s+(vp[a-z0-9]+)\s', asm, re.M))
    print("int8 job asm:", {k: v for k, v in c.items() if "madd" in k or "dp" in k or "mul" in k})



def ablate_v():
    no_vunpack = variant(("        _cpu_unpack(vc, page, h, slot, mt, tile)\n", ""))
    no_sweep = variant(("            while NG == 1 and t + 4 <= mt:", "            while NG == 1 and t + 4 <= 0:"),
                       ("            for t in range(t, mt):                                    # the rest",
                        "            for t in range(t, 0):                                    # the rest"))
    no_xs = variant(("                    psz[r, g] += xs[r, t * NG + g] * vz[page, h, slot + t, g]\n", ""))
    compare({"base": build(job_f88f914)[0], "no_vunpack": build(no_vunpack)[0],
             "no_sweep": build(no_sweep)[0], "no_psz": build(no_xs)[0]}, lengths=(0, 7700), reps=15)



def _cpu_unpack_planes(codes, page, h, slot, m, tile):
    """tile[c, t D4 + j] = code c of byte j of row (page, h, slot + t) (channel c D4 + j), t < m, as fp32:
    one loop over the m D4 bytes, contiguous within the page."""
    D4 = codes.shape[3]
    src = codes[page, h].reshape(-1)                          # the page's (P D4,) bytes
    o = slot * D4
    for i in range(m * D4):
        v = np.int32(src[o + i])
        tile[0, i] = np.float32(v & np.int32(3))
        tile[1, i] = np.float32((v >> np.int32(2)) & np.int32(3))
        tile[2, i] = np.float32((v >> np.int32(4)) & np.int32(3))
        tile[3, i] = np.float32(v >> np.int32(6))


def job_planes(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, job):
    f32 = np.float32
    (B, Hq, d), H, P = q.shape, kc.shape[1], kc.shape[2]
    R, NG, T, D4 = Hq // H, d // G, 16, d // 4
    L = min(G, D4)                                                    # a group's run within a plane
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w, s = nq[b], wl[b], rows[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split
    nt, nw = t1 - t0, w1 - w0
    if nt + nw == 0:
        return
    qs = np.empty((R, d), dtype=f32)
    qsum = np.zeros((R, NG), dtype=f32)
    for r in range(R):
        for ch in range(d):
            qs[r, ch] = q[b, h * R + r, ch] * scale
            qsum[r, ch // G] += qs[r, ch]
    a, tile = np.empty((R, nt + nw), dtype=f32), np.empty((4, T * D4), dtype=f32)
    xg = np.empty(NG, dtype=f32)
    i = 0
    while i < nt:
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        _cpu_unpack_planes(kc, page, h, slot, mt, tile)
        for t in range(mt if NG == 1 else 0):                         # G = d: one sum of 4 planes
            o = t * D4
            for r in range(R):
                y = f32(0.0)
                for j in range(D4):
                    y += ((qs[r, j] * tile[0, o + j] + qs[r, D4 + j] * tile[1, o + j])
                          + (qs[r, 2 * D4 + j] * tile[2, o + j] + qs[r, 3 * D4 + j] * tile[3, o + j]))
                a[r, i + t] = ks[page, h, slot + t, 0] * (y - kz[page, h, slot + t, 0] * qsum[r, 0])
        for t in range(0 if NG == 1 else mt):                         # G < d: runs of L in a plane
            for r in range(R):
                xg[:] = 0
                for c in range(4):
                    for u in range(0, D4, L):
                        x = f32(0.0)
                        for k in range(L):
                            x += qs[r, c * D4 + u + k] * tile[c, t * D4 + u + k]
                        xg[(c * D4 + u) // G] += x
                y = f32(0.0)
                for g in range(NG):
                    y += ks[page, h, slot + t, g] * (xg[g] - kz[page, h, slot + t, g] * qsum[r, g])
                a[r, i + t] = y
        i += mt
    for i in range(nw):
        for r in range(R):
            y = f32(0.0)
            for ch in range(d):
                y += qs[r, ch] * wk[s, h, w0 + i, ch]
            a[r, nt + i] = y
    m, l = np.empty(R, dtype=f32), np.zeros(R, dtype=f32)
    for r in range(R):
        m[r] = a[r].max()
    _cpu_exp_rows(a, m, nt + nw)
    for r in range(R):
        for i in range(nt + nw):
            l[r] += a[r, i]
    o, psz = np.zeros((R, d), dtype=f32), np.zeros((R, NG), dtype=f32)
    xs = np.empty((R, T, NG), dtype=f32)
    i = 0
    while i < nt:
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        _cpu_unpack_planes(vc, page, h, slot, mt, tile)
        for r in range(R):
            for t in range(mt):
                for g in range(NG):
                    xs[r, t, g] = a[r, i + t] * vs[page, h, slot + t, g]
                    psz[r, g] += xs[r, t, g] * vz[page, h, slot + t, g]
            t = 0
            while NG == 1 and t + 4 <= mt:                            # G = d: four tokens a sweep
                x0, x1, x2, x3 = xs[r, t, 0], xs[r, t + 1, 0], xs[r, t + 2, 0], xs[r, t + 3, 0]
                o0, o1, o2, o3 = t * D4, (t + 1) * D4, (t + 2) * D4, (t + 3) * D4
                for c in range(4):
                    for j in range(D4):
                        o[r, c * D4 + j] += ((x0 * tile[c, o0 + j] + x1 * tile[c, o1 + j])
                                             + (x2 * tile[c, o2 + j] + x3 * tile[c, o3 + j]))
                t += 4
            for t in range(t, mt):
                for c in range(4):
                    for u in range(0, D4, L):
                        x = xs[r, t, (c * D4 + u) // G]
                        for k in range(L):
                            o[r, c * D4 + u + k] += x * tile[c, t * D4 + u + k]
        i += mt
    for i in range(nw):
        for r in range(R):
            for ch in range(d):
                o[r, ch] += a[r, nt + i] * wv[s, h, w0 + i, ch]
    for r in range(R):
        for ch in range(d):
            o_part[b, h * R + r, sp, ch] = (o[r, ch] - psz[r, ch // G]) / l[r]
        lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])


def check_g():
    base = build(job_f88f914)[0]
    pl = build(job_planes, extra=(_cpu_unpack_planes,))[0]
    for d, G, Hq, Hkv in [(64, 64, 9, 3), (64, 16, 8, 2), (64, 32, 4, 4), (16, 16, 6, 1), (16, 4, 2, 1), (128, 128, 8, 1), (32, 8, 3, 3)]:
        for n in (0, 5, 77, 300):
            a = args_for(n, Hq, Hkv, d, G, 16, 20)
            print(d, G, n, float(np.abs(pl(*a) - base(*a)).max()), end="; ")
    print()


def planes():
    compare({"base": build(job_f88f914)[0],
             "planes": build(job_planes, extra=(_cpu_unpack_planes,))[0]}, lengths=(0, 3776, 7700), reps=21)



def splits():
    """Lever (d): the context split, at f88f914's job: 1 split a KV head (3 jobs on 2 threads) against 2
    (what _cpu_splits picks here: 6 jobs) and 4."""
    dec = build(job_f88f914)[0]
    def with_splits(k):
        return lambda *a: dec(*a[:-1], k)
    compare({"split1": with_splits(1), "split2": with_splits(2), "split4": with_splits(4)},
            lengths=(0, 3776, 7700), reps=21)



def levers():
    """(b)-(c) and the layouts tried, against the job before: token lanes (tl), the int8 query (int8), 16-byte
    unpack chunks (u16), codes in bit planes (planes)."""
    import re, collections
    dec_i8, job_i8 = build(variant(*INT8))
    u16 = variant(("_cpu_unpack(kc", "_cpu_unpack16(kc"), ("_cpu_unpack(vc", "_cpu_unpack16(vc"))
    compare({"base": build(job_f88f914)[0], "tl": build(job_tl)[0], "int8": dec_i8,
             "u16": build(u16, extra=(_cpu_unpack16,))[0],
             "planes": build(job_planes, extra=(_cpu_unpack_planes,))[0]}, lengths=(0, 3776, 7700), reps=15)
    asm = "\n".join(job_i8.inspect_asm().values())
    c = collections.Counter(re.findall(r"^\s+(vp[a-z0-9]+)\s", asm, re.M))
    print("int8 job's integer products:", {k: v for k, v in c.items() if "madd" in k or "dp" in k or "mul" in k})


if __name__ == "__main__":
    globals()[sys.argv[1]]()
