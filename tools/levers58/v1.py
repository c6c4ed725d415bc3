import numpy as np, math
f32 = np.float32
_CPU_TILE = 16

def unpack_bytes(codes, page, h, slot, m, tile):
    """tile[t, 4 j + c] = code c (bits 2c, 2c+1) of byte j of row (page, h, slot + t), as fp32"""
    D4 = codes.shape[3]
    src = codes[page, h].reshape(-1)
    dst = tile.reshape(-1)
    base = slot * D4
    for x in range(m * D4):
        b = np.int32(src[base + x])
        dst[4 * x] = np.float32(b & np.int32(3))
        dst[4 * x + 1] = np.float32((b >> np.int32(2)) & np.int32(3))
        dst[4 * x + 2] = np.float32((b >> np.int32(4)) & np.int32(3))
        dst[4 * x + 3] = np.float32((b >> np.int32(6)) & np.int32(3))

def unpack_gather(codes, page, h, slot, m, tile):
    D4 = codes.shape[3]
    src = codes[page, h].reshape(-1)
    dst = tile.reshape(-1)
    base = slot * D4
    for x in range(m * D4 * 4):
        dst[x] = np.float32((np.int32(src[base + (x >> 2)]) >> np.int32(2 * (x & 3))) & np.int32(3))

def job_v1(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, job):
    f32 = np.float32
    (B, Hq, d), H, P = q.shape, kc.shape[1], kc.shape[2]
    R, NG, T, D4 = Hq // H, d // G, _CPU_TILE, d // 4
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w, s = nq[b], wl[b], rows[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split
    nt, nw = t1 - t0, w1 - w0
    if nt + nw == 0:
        return
    qs = np.empty((R, d), dtype=f32)        # byte order: qs[r, 4 j + c] = q[c D4 + j]
    qsum = np.zeros(R, dtype=f32)
    for r in range(R):
        for c in range(4):
            for j in range(D4):
                qs[r, 4 * j + c] = q[b, h * R + r, c * D4 + j] * scale
        for ch in range(d):
            qsum[r] += qs[r, ch]
    a, tile = np.empty((R, nt + nw), dtype=f32), np.empty((T, d), dtype=f32)
    i = 0
    while i < nt:
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        UNPACK(kc, page, h, slot, mt, tile)
        for t in range(mt):
            for r in range(R):
                y = f32(0.0)
                for ch in range(d):
                    y += qs[r, ch] * tile[t, ch]
                a[r, i + t] = ks[page, h, slot + t, 0] * (y - kz[page, h, slot + t, 0] * qsum[r])
        i += mt
    for i in range(nw):
        for r in range(R):
            y = f32(0.0)
            for c in range(4):
                for j in range(D4):
                    y += qs[r, 4 * j + c] * wk[s, h, w0 + i, c * D4 + j]
            a[r, nt + i] = y
    m, l = np.empty(R, dtype=f32), np.zeros(R, dtype=f32)
    for r in range(R):
        m[r] = a[r].max()
    _cpu_exp_rows(a, m, nt + nw)
    for r in range(R):
        for i in range(nt + nw):
            l[r] += a[r, i]
    o, psz = np.zeros((R, d), dtype=f32), np.zeros(R, dtype=f32)
    xs = np.empty((R, T), dtype=f32)
    i = 0
    while i < nt:
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt = min(T, nt - i, P - slot)
        UNPACK(vc, page, h, slot, mt, tile)
        for r in range(R):
            for t in range(mt):
                xs[r, t] = a[r, i + t] * vs[page, h, slot + t, 0]
                psz[r] += xs[r, t] * vz[page, h, slot + t, 0]
            t = 0
            while t + 4 <= mt:
                x0, x1, x2, x3 = xs[r, t], xs[r, t + 1], xs[r, t + 2], xs[r, t + 3]
                for ch in range(d):
                    o[r, ch] += (x0 * tile[t, ch] + x1 * tile[t + 1, ch]) + (x2 * tile[t + 2, ch] + x3 * tile[t + 3, ch])
                t += 4
            for t in range(t, mt):
                for ch in range(d):
                    o[r, ch] += xs[r, t] * tile[t, ch]
        i += mt
    for r in range(R):
        for c in range(4):
            for j in range(D4):
                ow = (o[r, 4 * j + c] - psz[r]) 
                for i2 in range(0):
                    pass
                o_part[b, h * R + r, sp, c * D4 + j] = ow
    for i in range(nw):
        for r in range(R):
            for ch in range(d):
                o_part[b, h * R + r, sp, ch] += a[r, nt + i] * wv[s, h, w0 + i, ch]
    for r in range(R):
        for ch in range(d):
            o_part[b, h * R + r, sp, ch] /= l[r]
        lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])
