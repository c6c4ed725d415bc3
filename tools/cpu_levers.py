"""Levers on the numba decode job at G = d, each against kernel's job, interleaved in one process:
`python -m tools.cpu_levers` (SmolLM2's shape, INT2 3,776 and 7,700, fp32 windows 320, batch 1).
A scratch harness: its winners move into kernel.py, its losers into NOTES.md."""
import time

import numba
import numpy as np
import torch

import kernel
from tools import bench

f32 = np.float32
LOG2E = f32(1.4426950408889634)
LN2 = 0.6931471805599453
C = [f32(LN2 ** i / np.prod(np.arange(1, i + 1, dtype=np.float64))) for i in range(8)]   # 2^f's Taylor


def _unpack_row(codes, page, h, slot, out):
    """kernel's unpack before the tiles: out[:] = the d codes of row (page, h, slot) as fp32."""
    D4 = codes.shape[3]
    for c in range(4):
        for j in range(D4):
            out[c * D4 + j] = np.float32((np.int32(codes[page, h, slot, j]) >> np.int32(2 * c)) & np.int32(3))


def make(fast_exp, tile_pv, tile_qk, T=16):
    """A decode (the parallel driver of kernel._cpu_decode at G = d) whose job takes the levers."""
    c0, c1, c2, c3, c4, c5, c6, c7 = C
    unpack = numba.njit(inline="always")(_unpack_row)

    @numba.njit(inline="always", fastmath=kernel._FASTMATH)
    def exp_rows(a, m, n):
        """a[r, :n] = exp(a[r, :n] - m[r]), vectorised: 2^k (exponent bits) times 2^f (Taylor, |f| <= 1/2)."""
        R = a.shape[0]
        ai = a.view(np.int32)
        for r in range(R):
            for i in range(n):
                t = max(a[r, i] - m[r], f32(-80.0)) * LOG2E
                k = np.floor(t + f32(0.5))
                f = t - k
                p = c7 * f + c6
                p = p * f + c5
                p = p * f + c4
                p = p * f + c3
                p = p * f + c2
                p = p * f + c1
                a[r, i] = p * f + c0
                ai[r, i] += np.int32(k) << 23

    @numba.njit(fastmath=kernel._FASTMATH)
    def job(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, jb):
        B, Hq, d = q.shape
        H, P = kc.shape[1], kc.shape[2]
        D4 = d // 4
        R = Hq // H
        b, h, sp = jb // (H * n_split), (jb // n_split) % H, jb % n_split
        n, w, s = nq[b], wl[b], rows[b]
        t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split
        w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split
        nt, nw = t1 - t0, w1 - w0
        if nt + nw == 0:
            return
        qs = np.empty((R, d), dtype=f32)
        qsum = np.zeros(R, dtype=f32)
        for r in range(R):
            for ch in range(d):
                qs[r, ch] = q[b, h * R + r, ch] * scale
                qsum[r] += qs[r, ch]
        a = np.empty((R, nt + nw), dtype=f32)
        code = np.empty(d, dtype=f32)
        tile = np.empty((T, d), dtype=f32)
        if tile_qk:
            i = 0
            while i < nt:                                  # tokens [i, i + m) in one page
                page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
                m = min(T, nt - i, P - slot)
                for t in range(m):
                    for c in range(4):
                        for j in range(D4):
                            tile[t, c * D4 + j] = f32((np.int32(kc[page, h, slot + t, j]) >> np.int32(2 * c))
                                                      & np.int32(3))
                for t in range(m):
                    for r in range(R):
                        y = f32(0.0)
                        for ch in range(d):
                            y += qs[r, ch] * tile[t, ch]
                        a[r, i + t] = ks[page, h, slot + t, 0] * (y - kz[page, h, slot + t, 0] * qsum[r])
                i += m
        else:
            for i in range(nt):
                page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
                unpack(kc, page, h, slot, code)
                for r in range(R):
                    y = f32(0.0)
                    for ch in range(d):
                        y += qs[r, ch] * code[ch]
                    a[r, i] = ks[page, h, slot, 0] * (y - kz[page, h, slot, 0] * qsum[r])
        for i in range(nw):
            for r in range(R):
                y = f32(0.0)
                for ch in range(d):
                    y += qs[r, ch] * wk[s, h, w0 + i, ch]
                a[r, nt + i] = y
        mx, l = np.empty(R, dtype=f32), np.zeros(R, dtype=f32)
        for r in range(R):
            mx[r] = a[r].max()
        if fast_exp:
            exp_rows(a, mx, nt + nw)
        else:
            for r in range(R):
                for i in range(nt + nw):
                    a[r, i] = np.exp(a[r, i] - mx[r])
        for r in range(R):
            for i in range(nt + nw):
                l[r] += a[r, i]
        o, psz = np.zeros((R, d), dtype=f32), np.zeros(R, dtype=f32)
        if tile_pv:
            x = np.empty((R, T), dtype=f32)
            i = 0
            while i < nt:
                page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
                m = min(T, nt - i, P - slot)
                for t in range(m):
                    for c in range(4):
                        for j in range(D4):
                            tile[t, c * D4 + j] = f32((np.int32(vc[page, h, slot + t, j]) >> np.int32(2 * c))
                                                      & np.int32(3))
                for r in range(R):
                    for t in range(m):
                        x[r, t] = a[r, i + t] * vs[page, h, slot + t, 0]
                        psz[r] += x[r, t] * vz[page, h, slot + t, 0]
                for r in range(R):
                    t = 0
                    while t + 4 <= m:
                        x0, x1, x2, x3 = x[r, t], x[r, t + 1], x[r, t + 2], x[r, t + 3]
                        for ch in range(d):
                            o[r, ch] += (x0 * tile[t, ch] + x1 * tile[t + 1, ch]) + (x2 * tile[t + 2, ch]
                                                                                  + x3 * tile[t + 3, ch])
                        t += 4
                    while t < m:
                        x0 = x[r, t]
                        for ch in range(d):
                            o[r, ch] += x0 * tile[t, ch]
                        t += 1
                i += m
        else:
            for i in range(nt):
                page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
                unpack(vc, page, h, slot, code)
                for r in range(R):
                    x0 = a[r, i] * vs[page, h, slot, 0]
                    psz[r] += x0 * vz[page, h, slot, 0]
                    for ch in range(d):
                        o[r, ch] += x0 * code[ch]
        for i in range(nw):
            for r in range(R):
                for ch in range(d):
                    o[r, ch] += a[r, nt + i] * wv[s, h, w0 + i, ch]
        for r in range(R):
            for ch in range(d):
                o_part[b, h * R + r, sp, ch] = (o[r, ch] - psz[r]) / l[r]
            lse_part[b, h * R + r, sp] = mx[r] + np.log(l[r])

    @numba.njit(parallel=True)
    def decode(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split):
        B, Hq, d = q.shape
        H = kc.shape[1]
        o_part = np.zeros((B, Hq, n_split, d), dtype=f32)
        lse_part = np.full((B, Hq, n_split), -np.inf, dtype=f32)
        for jb in numba.prange(B * H * n_split):
            job(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, jb)
        out = np.zeros((B, Hq, d), dtype=f32)
        for bj in range(B * Hq):
            b, j = bj // Hq, bj % Hq
            M = lse_part[b, j].max()
            tot = f32(0.0)
            for sp in range(n_split):
                if lse_part[b, j, sp] > -np.inf:
                    wgt = np.exp(lse_part[b, j, sp] - M)
                    tot += wgt
                    out[b, j] += wgt * o_part[b, j, sp]
            out[b, j] /= tot
        return out
    return decode


def main(lengths=(700, 3776, 7700), reps=15, only=None):
    sh = bench.SMOLLM2_SHAPE
    variants = {"kernel": kernel._nb().decode, "before": make(False, False, False), "fast exp": make(True, False, False),
                "tiled p.V": make(False, True, False), "tiled q.k": make(False, False, True),
                "both tiles": make(False, True, True), "all three": make(True, True, True)}
    variants = {k: v for k, v in variants.items() if only is None or k in only}
    torch.manual_seed(0)
    times = {(v, n): [] for v in variants for n in lengths}
    for n in lengths:
        a = bench.random_inputs(1, n, sh["H_q"], sh["H_kv"], sh["d"], sh["G"], sh["P"], sh["NW"], torch.float32, "cpu")
        args = [a[k].numpy() for k in ("q", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero",
                                       "block_table", "n_quant", "win_k", "win_v", "win_len")]
        args += [np.arange(1), sh["G"], f32(sh["d"] ** -0.5), kernel._cpu_splits(1, sh["H_kv"], n + sh["NW"])]
        ref = variants["kernel"](*args)
        for v, fn in variants.items():
            err = float(np.abs(fn(*args) - ref).max())
            print(f"{v:>10} {n:>5}: max |out - kernel's| {err:.2e}")
        for rep in range(reps):
            for v in np.random.default_rng(rep).permutation(list(variants)):
                t = time.perf_counter()
                variants[v](*args)
                times[v, n].append((time.perf_counter() - t) * 1e6)
    med = {k: float(np.median(t)) for k, t in times.items()}
    for v in variants:
        print(f"{v:>10}", "  ".join(f"{n}: {med[v, n]:7.1f} us [{min(times[v, n]):.0f}-{max(times[v, n]):.0f}]"
                                    + (f" {(med[v, n] - med[v, lengths[0]]) * 1e3 / (sh['H_kv'] * n):.1f} ns/tok-head"
                                       if lengths[0] == 0 and n >= 256 else "") for n in lengths))

if __name__ == "__main__":
    main()
