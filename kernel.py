"""INT2 paged decode attention: the Triton kernel (CUDA), the same algorithm compiled by numba (CPU).

Keys and values stay in the ordinary paged KV-cache format, as 2-bit codes with one fp32 scale and
zero per group of G dims; the kernels read it directly (no dequantized copy).  Per layer (H_kv KV
heads, head dim d, page size P):
    k_codes, v_codes    uint8 (num_pages, H_kv, P, d // 4): byte j of a row holds dims j,
                        j + d/4, j + d/2, j + 3d/4 in bits 0-1, 2-3, 4-5, 6-7
    k/v_scale, k/v_zero fp32 (num_pages, H_kv, P, d // G): x_i = (code_i - zero[i // G]) * scale[i // G]
    block_table         int32 (B, max_blocks): INT2 token n of sequence b is in page
                        block_table[b, n // P], slot n % P
    n_quant             int32 (B,): INT2 tokens per sequence (ragged, may be 0)
    win_k, win_v        fp32/bf16 (B, H_kv, NW, d): the exact sink + recent tokens, slots [0, win_len[b])
    q                   fp32/bf16 (B, H_q, d), already rotated; query head j reads KV head j // (H_q // H_kv)
    output              fp32 (B, H_q, d), still in the rotated value basis

Two Triton kernels, read in this order (`int2_paged_decode(..., kernel=)`: one launcher, one set of checks).
Version 1, "plain": a program per (sequence, KV head) walks the sequence's pages, unpacks each code with a
shift and a mask, dequantizes in fp32 and keeps Eq. 1-2's online softmax (~70 lines and a 15-line helper; read
it beside optr.paged_decode_reference).  Version 2, "fast" (the default), is version 1 refined in four steps,
each one a section below, each with what it buys in `python -m tools.sass`' issue/HBM figure (sm_90a, bench
case d = G = 128, page 64: the INT2 loop's issue cycles per 64-token tile over the H200's HBM cycles for its
5,120 bytes; 1.0 would be memory-bound; triton 3.7.1).  Version 1: 12.8 (shared memory binds: 15.5).
  1. Split-K: grid (B, H_kv, num_splits), each program a contiguous range of tiles, writing a partial
     output and its base-2 lse; stage 2 (grid (B, H_q)) merges them.  The same work per tile, but at
     batch 1 the bench case's 8 programs become hundreds, for 132 SMs.
  2. The factored dot: the query split into four quarter-rows, one per bit field (codes never
     reordered); tokens on the fp16 MMA's rows, the query heads' fp16 hi / lo halves on its columns;
     scale and zero outside the MMA (s * (q.c - z * sum(q)); P.V likewise).  FACTORED needs G a multiple
     of d/4 and d >= 64; other G dequantize in fp32 (16-token tiles: 34.7 at d = G = 128, 362 spills).
  3. Sub-tiles: 128-token tiles of 16-token sub-tiles, each with its own softmax state, merged once after
     the loop: 1.96 (one 128-token sub-tile: 4.61; 64-token tiles of 4: 2.24).
  4. Codes to fp16 with no conversion instruction (_codes_fp16, the hardest, last): fp16 0x6400 | c is
     1024 + c, so a mask, an OR and one HADD2 per pair unpack them (version 1: 32 I2F per warp per page).
Each program writes -inf as the lse of a split with no tokens; stage 2 weighs it 0.

Order: the Triton kernels (without triton: defined, refusing to launch), input checks, the launcher
int2_paged_decode, the numba CPU kernels (compiled by _nb(), by name), int2_paged_decode_cpu,
cpu_decode_step, paged_decode, q2_store; `python -m tools.bench` times them.  The Triton kernels ran
in Triton's CPU interpreter (TRITON_INTERPRET=1 before triton is imported: exact fp16 dots) and ptxas
(`tools.sass`), never on a GPU (none was lent); numba's on x86_64 Linux CPUs (AVX2, AVX-512).
Shape letters: S sub-tiles per tile, T tokens per sub-tile, W = d/4 dims per quarter-row.
"""
import functools
import math
import types

import numpy as np
import torch

_NO_TRITON = "needs triton, which is not installed (its wheels are for Linux); on a CPU, int2_paged_decode_cpu " \
             "(numba) needs none"
try:                  # only the Triton kernel needs it; triton ships wheels for Linux alone
    import triton
    import triton.language as tl
    triton_jit = triton.jit
except ImportError:   # macOS, Windows: the checks, the numba CPU decode and q2_store still work
    triton, tl = None, types.SimpleNamespace(constexpr=None)     # tl: the kernels' annotations

    class triton_jit:   # @triton.jit without triton: the kernel is defined and refuses to launch
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise ImportError(f"{self.fn.__name__} {_NO_TRITON}", name="triton")

_INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)  # what @triton.jit uses
_LOG2E, _MAX_SPLITS = 1.4426950408889634, 1024


# ==== Version 1: the plain Triton kernel (read it beside optr.paged_decode_reference) ====
@triton_jit
def _q2_rows(codes_ptr, scale_ptr, zero_ptr,  # one page's K or V: uint8 codes, fp32 scales, zeros
             code_rows, param_rows,   # (BLOCK_P,) int64 offset of each slot's code row, scale row
             valid,                   # (BLOCK_P,) slots that hold a token
             HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """(BLOCK_P, d) fp32 rows: dim i is bits 2f..2f+1 of byte i % (d/4), f = i // (d/4) (the packing
    in the module docstring), dequantized as Q2 stores it: x_i = (code_i - zero[i // G]) * scale[i // G]."""
    dims = tl.arange(0, HEAD_DIM)
    byte = tl.load(codes_ptr + code_rows[:, None] + (dims % (HEAD_DIM // 4))[None, :],
                   mask=valid[:, None], other=0)
    code = (byte.to(tl.int32) >> (2 * (dims // (HEAD_DIM // 4)))[None, :]) & 3
    params = param_rows[:, None] + (dims // GROUP_SIZE)[None, :]
    scale = tl.load(scale_ptr + params, mask=valid[:, None], other=0.0)
    zero = tl.load(zero_ptr + params, mask=valid[:, None], other=0.0)
    return (code.to(tl.float32) - zero) * scale

@triton_jit
def _int2_decode_plain_kernel(
        q_ptr,                 # (B, H_q, d) fp32/bf16 rotated queries
        k_codes_ptr,           # (num_pages, H_kv, P, d/4) uint8 packed key codes
        k_scale_ptr, k_zero_ptr,  # (num_pages, H_kv, P, d/G) fp32 key scales, zeros
        v_codes_ptr, v_scale_ptr, v_zero_ptr,  # same layouts for the values
        block_table_ptr,       # (B, max_blocks) int32 logical block -> page
        n_quant_ptr,           # (B,) int32 INT2 tokens per sequence
        win_k_ptr, win_v_ptr,  # (B, H_kv, NW, d) fp32/bf16 window keys, values
        win_len_ptr,           # (B,) int32 valid window slots per sequence
        out_ptr,               # (B, H_q, d) fp32 out: the attention output
        qk_scale,              # sm_scale * log2(e): logits in base 2, softmax by exp2
        stride_qb, stride_qh,                  # q strides (batch, head); dim stride is 1
        stride_cp, stride_ch, stride_cn,       # code strides (page, head, slot)
        stride_sp, stride_sh, stride_sn,       # scale / zero strides (page, head, slot)
        stride_btb,                            # block-table row stride
        stride_wb, stride_wh, stride_wn,       # window strides (batch, head, slot)
        stride_yb, stride_yh,                  # output strides (batch, head)
        HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,  # H_q // H_kv
        BLOCK_H: tl.constexpr,  # power of two >= QUERIES_PER_KV
        BLOCK_P: tl.constexpr,  # power of two >= PAGE_SIZE, >= 16 (tl.dot's K)
        BLOCK_W: tl.constexpr,  # window tokens per step, power of two >= 16
        DOT_PRECISION: tl.constexpr):
    """Program (b, h): every query head of KV head h of sequence b, over its INT2 pages, then its
    window; one online softmax (running max m, sum l, output acc rescaled as the max grows)."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = h * QUERIES_PER_KV + tl.arange(0, BLOCK_H)             # GQA: query heads of KV head h
    head_ok = tl.arange(0, BLOCK_H) < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)   # fp32 right after the load
    m, l = tl.full([BLOCK_H], float("-inf"), tl.float32), tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    slots = tl.arange(0, BLOCK_P)
    n_quant = tl.load(n_quant_ptr + b)
    for blk in range(0, tl.cdiv(n_quant, PAGE_SIZE)):              # the sequence's INT2 pages
        page = tl.load(block_table_ptr + b * stride_btb + blk).to(tl.int64)
        valid = (slots < PAGE_SIZE) & (blk * PAGE_SIZE + slots < n_quant)
        code_rows = page * stride_cp + h * stride_ch + slots * stride_cn
        param_rows = page * stride_sp + h * stride_sh + slots * stride_sn
        k = _q2_rows(k_codes_ptr, k_scale_ptr, k_zero_ptr, code_rows, param_rows, valid, HEAD_DIM, GROUP_SIZE)
        v = _q2_rows(v_codes_ptr, v_scale_ptr, v_zero_ptr, code_rows, param_rows, valid, HEAD_DIM, GROUP_SIZE)
        a = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale          # Eq. 1
        a = tl.where(valid[None, :], a, float("-inf"))
        m_new = tl.maximum(m, tl.max(a, axis=1))                   # finite: a page holds a token
        p = tl.exp2(a - m_new[:, None])                            # Eq. 1's softmax, unnormalised
        alpha = tl.exp2(m - m_new)                                 # 0 on the first page
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)       # Eq. 2
        m = m_new
    win_len = tl.load(win_len_ptr + b)
    for first in range(0, win_len, BLOCK_W):                       # the exact sink + recent tokens
        slot = first + tl.arange(0, BLOCK_W)
        valid = slot < win_len
        rows = b * stride_wb + h * stride_wh + slot[:, None] * stride_wn + dims[None, :]
        k = tl.load(win_k_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(win_v_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        a = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale          # Eq. 1
        a = tl.where(valid[None, :], a, float("-inf"))
        m_new = tl.maximum(m, tl.max(a, axis=1))
        p = tl.exp2(a - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)       # Eq. 2
        m = m_new
    tl.store(out_ptr + b * stride_yb + heads[:, None] * stride_yh + dims[None, :], acc / l[:, None],
             mask=head_ok[:, None])


# ==== Version 2, the fast kernel: version 1 refined in four steps (the module docstring) ====
# ---- Step 1: split-K, and the merge of the splits ----
@triton_jit
def _int2_decode_split_kernel(
        q_ptr, k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
        block_table_ptr, n_quant_ptr, win_k_ptr, win_v_ptr, win_len_ptr,   # as the plain kernel's
        part_out_ptr,          # (B, H_q, NUM_SPLITS, d) fp32 out: normalized partial outputs
        part_lse_ptr,          # (B, H_q, NUM_SPLITS) fp32 out: partial log2-sum-exp2 of logits
        qk_scale, num_splits,  # as the plain kernel's; NUM_SPLITS programs per (sequence, KV head)
        stride_qb, stride_qh, stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_sn,
        stride_btb, stride_wb, stride_wh, stride_wn,   # as the plain kernel's
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # partial out (batch, head, split), lse
        HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,   # NUM_GROUPS = d // G
        PAGE_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr,  # as the plain's
        BLOCK_N: tl.constexpr,        # INT2 tokens per tile (any page size), power of two >= 16
        SUB_TILES: tl.constexpr,      # token sub-tiles per tile, each with its own softmax state
        BLOCK_W: tl.constexpr,        # as the plain kernel's
        FACTORED: tl.constexpr,       # scale / zero outside fp16 dots (G % (d/4) == 0, d >= 64)
        DOT_PRECISION: tl.constexpr):
    pid_b, pid_kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch = pid_b.to(tl.int64)
    W: tl.constexpr = HEAD_DIM // 4         # dims per quarter-row
    S: tl.constexpr = SUB_TILES             # sub-tiles per tile (the helpers' S)
    T: tl.constexpr = BLOCK_N // SUB_TILES  # tokens per sub-tile (>= 16 for the P.V dot)

    # Query heads of this KV head as quarter-rows in the codes' dim order (offs_w), as all else.
    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < QUERIES_PER_KV
    q_heads = pid_kv * QUERIES_PER_KV + offs_h
    offs_w = _quarter_dims(W)
    q_rows = q_ptr + batch * stride_qb + q_heads[:, None] * stride_qh
    q, q_cols, q_sum, row_scale = _load_query(q_rows + offs_w[None, :], head_mask, qk_scale,
                                              S, W, BLOCK_H, FACTORED)

    # Per sub-tile (a warp's share) softmax state and outputs: merged once, after the loop.
    m_i, l_i = tl.full([S, BLOCK_H], float("-inf"), dtype=tl.float32), tl.zeros([S, BLOCK_H], dtype=tl.float32)
    acc = [tl.zeros([S, W, BLOCK_H], dtype=tl.float32) for _ in (0, 1, 2, 3)]  # transposed

    # ---- INT2 tokens: this split's range of BLOCK_N-token tiles -------------
    n_quant = tl.load(n_quant_ptr + pid_b)
    n_tiles = tl.cdiv(n_quant, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    first_tile = tl.minimum(split * tiles_per_split, n_tiles)
    last_tile = tl.minimum(first_tile + tiles_per_split, n_tiles)
    offs_n = tl.arange(0, S)[:, None] * T + tl.arange(0, T)[None, :]   # (S, T) token in tile
    bt_row = block_table_ptr + batch * stride_btb
    k_words_ptr = k_codes_ptr.to(tl.pointer_type(tl.uint32))   # a code row is d/4 bytes,
    v_words_ptr = v_codes_ptr.to(tl.pointer_type(tl.uint32))   # loaded as 32-bit words
    n_blocks = tl.cdiv(n_quant, PAGE_SIZE)                   # block-table entries in use
    # Block-table entries of the first tile, loaded ahead; each iteration loads the next.
    blk = _tile_blocks(first_tile, offs_n, BLOCK_N, PAGE_SIZE)[0]
    page_next = tl.load(bt_row + blk, mask=(first_tile < last_tile) & (blk < n_blocks), other=0)
    for tile in range(first_tile, last_tile):
        page = page_next.to(tl.int64)
        blk_next = _tile_blocks(tile + 1, offs_n, BLOCK_N, PAGE_SIZE)[0]
        page_next = tl.load(bt_row + blk_next, mask=(tile + 1 < last_tile) & (blk_next < n_blocks), other=0)
        slot = _tile_blocks(tile, offs_n, BLOCK_N, PAGE_SIZE)[1]
        acc, m_i, l_i = _int2_tile(
            acc, m_i, l_i, q, q_cols, q_sum, row_scale, k_words_ptr, v_words_ptr,
            k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr,
            page * (stride_cp // 4) + pid_kv * (stride_ch // 4) + slot * (stride_cn // 4),
            page * stride_sp + pid_kv * stride_sh + slot * stride_sn,
            tile * BLOCK_N + offs_n < n_quant, offs_w,
            S, T, W, BLOCK_H, GROUP_SIZE, NUM_GROUPS, FACTORED, W >= 16, DOT_PRECISION)

    # ---- One state from the sub-tiles' states: (BLOCK_H,) and (BLOCK_H, W) from here ----
    m_i, l_i, acc = _merge_sub_tiles(m_i, l_i, acc)

    # ---- Full-precision window tokens: window tile t goes to split t % num_splits ----
    win_len = tl.load(win_len_ptr + pid_b)
    q_full = tl.load(q_rows + tl.arange(0, HEAD_DIM)[None, :], mask=head_mask[:, None], other=0.0).to(tl.float32)
    for w_tile in range(split, tl.cdiv(win_len, BLOCK_W), num_splits):
        slot = w_tile * BLOCK_W + tl.arange(0, BLOCK_W)
        rows = batch * stride_wb + pid_kv * stride_wh + slot[:, None] * stride_wn
        acc, m_i, l_i = _window_tile(acc, m_i, l_i, q_full, win_k_ptr, win_v_ptr, rows,
                                     slot < win_len, offs_w, qk_scale, HEAD_DIM, DOT_PRECISION)

    # ---- Partial result; an empty split gives out = 0 and lse = -inf -------
    has_tokens = l_i > 0
    l_safe = tl.where(has_tokens, l_i, 1.0)
    out_rows = part_out_ptr + batch * stride_ob + q_heads[:, None] * stride_oh + split * stride_os + offs_w[None, :]
    for c in tl.static_range(4):
        tl.store(out_rows + c * W, acc[c] / l_safe[:, None], mask=head_mask[:, None])
    tl.store(part_lse_ptr + batch * stride_lb + q_heads * stride_lh + split,
             tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf")), mask=head_mask)

@triton_jit
def _merge_splits_kernel(
        part_out_ptr, part_lse_ptr,        # stage 1's (lse -inf: an empty split)
        out_ptr,                           # (B, H_q, d) fp32 out: final attention output
        num_splits,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_yb, stride_yh,  # as stage 1's, out's
        HEAD_DIM: tl.constexpr,
        BLOCK_SPLITS: tl.constexpr):       # partials merged per step (a (BLOCK_SPLITS, d) block)
    """out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M), M = max lse, BLOCK_SPLITS splits
    at a time (running-max rescaling); empty splits (lse = -inf) weigh 0."""
    batch, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_split, offs_d = tl.arange(0, BLOCK_SPLITS), tl.arange(0, HEAD_DIM)
    lse_row = part_lse_ptr + batch * stride_lb + head * stride_lh
    out_row = part_out_ptr + batch * stride_ob + head * stride_oh
    m, denom = tl.full([1], float("-inf"), tl.float32), tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for first in range(0, num_splits, BLOCK_SPLITS):
        split = first + offs_split
        lse = tl.load(lse_row + split, mask=split < num_splits, other=float("-inf"))
        o = tl.load(out_row + split[:, None] * stride_os + offs_d[None, :],
                    mask=(split < num_splits)[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref)                                     # empty splits: 0
        denom = denom * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + batch * stride_yb + head * stride_yh + offs_d, out)

@triton_jit
def _tile_blocks(tile, offs_n,      # tile index (BLOCK_N tokens each); (S, T) token of the tile
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(block-table column, slot in the page) of every token of a tile; a scalar block within a page."""
    if PAGE_SIZE % BLOCK_N == 0:
        return (tile * BLOCK_N) // PAGE_SIZE, (tile * BLOCK_N) % PAGE_SIZE + offs_n
    elif BLOCK_N % PAGE_SIZE == 0:
        return tile * (BLOCK_N // PAGE_SIZE) + offs_n // PAGE_SIZE, offs_n % PAGE_SIZE
    else:
        tok = tile * BLOCK_N + offs_n
        return tok // PAGE_SIZE, tok % PAGE_SIZE

@triton_jit
def _window_tile(acc, m_i, l_i,     # 4 (BLOCK_H, W) fp32 running outputs; (BLOCK_H,) softmax state
                 q_full,            # (BLOCK_H, d) fp32 query, dims in natural order
                 win_k_ptr, win_v_ptr, rows, valid,   # rows: (BLOCK_W, 1) offsets; valid: slots with a token
                 offs_w, qk_scale,  # offs_w: (W,) dims of a quarter, in the order of the codes
                 HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of window tokens, fp32 dots, output per quarter.  Returns (acc, m_i, l_i)."""
    W: tl.constexpr = HEAD_DIM // 4
    k = tl.load(win_k_ptr + rows + tl.arange(0, HEAD_DIM)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    logits = tl.dot(q_full, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_i, alpha, p, l_i = _softmax_update(logits, m_i, l_i, False)
    v = [tl.load(win_v_ptr + rows + (c * W + offs_w[None, :]), mask=valid[:, None],
                 other=0.0).to(tl.float32) for c in (0, 1, 2, 3)]
    acc = [acc[c] * alpha[:, None] + tl.dot(p, v[c], input_precision=DOT_PRECISION) for c in (0, 1, 2, 3)]
    return acc, m_i, l_i

@triton_jit
def _softmax_update(logits,         # base-2, -inf if masked: (S, N, BLOCK_H) / (BLOCK_H, N)
                    m_i, l_i,       # running max, sum of 2^(logit - m_i): (S, BLOCK_H) / (BLOCK_H,)
                    SUB_TILED: tl.constexpr):
    """Online softmax over the tokens (axis 1): (m_new, alpha, p, l_new); alpha rescales the old state."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))      # -inf until a real token: shift by 0 then
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)                 # 0 on the first real tile (m_i = -inf)
    if SUB_TILED:
        p = tl.exp2(logits - m_ref[:, None, :])  # 0 for masked tokens
    else:
        p = tl.exp2(logits - m_ref[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)

# ---- Step 2: the factored dot (quarter-rows on the fp16 MMA, scale and zero outside it) ----
@triton_jit
def _load_query(q_rows, head_mask, qk_scale,   # (BLOCK_H, W) pointers to each head's quarter 0
                S: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr, FACTORED: tl.constexpr):
    """(q, q_cols, q_sum, row_scale), tuples over the quarters.  Factored: each head scaled
    into [-2^14, 2^14] (row_scale undoes it); q_cols as _query_columns; q_sum for the zeros."""
    q = [tl.load(q_rows + c * W, mask=head_mask[:, None], other=0.0).to(tl.float32) for c in (0, 1, 2, 3)]
    if FACTORED:
        row_max = [tl.max(tl.abs(x), axis=1) for x in q]               # (BLOCK_H,) each
        q_max = tl.maximum(tl.maximum(row_max[0], row_max[1]), tl.maximum(row_max[2], row_max[3]))
        q_mul = 16384.0 / tl.where(q_max > 0, q_max, 1.0)
        q = [x * q_mul[:, None] for x in q]
        row_scale = qk_scale / q_mul
    else:
        row_scale = tl.full([BLOCK_H], 1.0, tl.float32) * qk_scale
    q_cols = [_query_columns(q[c], 2 * c, S, W, BLOCK_H) for c in (0, 1, 2, 3)]
    q_sum = [tl.sum(x, axis=1)[None, None, :] for x in q]
    return q, q_cols, q_sum, row_scale

@triton_jit
def _query_columns(q,               # (BLOCK_H, W) fp32 scaled query quarter
                   SHIFT: tl.constexpr,  # 2 * quarter: the quarter meets codes times 2^SHIFT
                   S: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr):
    """(S, W, 2 * BLOCK_H) fp16: q * 2^-SHIFT (exact) transposed, as hi / lo columns."""
    unit: tl.constexpr = 1.0 / (1 << SHIFT)
    q_t = tl.broadcast_to(tl.trans(q * unit)[None, :, :], (S, W, BLOCK_H))
    return _hi_lo_columns(q_t, S, W, BLOCK_H)

@triton_jit
def _hi_lo_columns(x,               # (S, R, BLOCK_H) fp32, |x| <= 2^14
                   S: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr):
    """x = hi + lo + r (hi, lo fp16, |r| <= 2^-22 |x| + 2^-25) as one (S, R, 2 * BLOCK_H) dot
    operand, column 2h hi of head h, 2h + 1 its lo: the heads fill the MMA's 8-wide side."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return tl.reshape(tl.join(hi, lo), (S, R, 2 * BLOCK_H))

@triton_jit
def _add_hi_lo(t,                   # (S, R, 2 * BLOCK_H) fp32 dot against _hi_lo_columns
               S: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr):
    """(S, R, BLOCK_H): the hi and lo columns of each head added (in fp32)."""
    hi, lo = tl.split(tl.reshape(t, (S, R, BLOCK_H, 2)))
    return hi + lo

@triton_jit
def _int2_tile(acc, m_i, l_i,       # 4 (S, W, BLOCK_H) fp32 running outputs; (S, BLOCK_H) states
               q, q_cols, q_sum, row_scale,   # as _load_query returns them
               k_words_ptr, v_words_ptr,      # uint32 views of k_codes, v_codes
               k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr,
               code_rows,           # (S, T) int64 offset of each token's code row, in words
               param_rows, valid, offs_w,     # (S, T): offset of its scale / zero row, tokens that exist
               S: tl.constexpr, T: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr,
               GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, FACTORED: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """S x T INT2 tokens (K, V rows loaded once, as 32-bit words): logits, each sub-tile's online softmax,
    P.V into each quarter.  Returns (acc, m_i, l_i)."""
    words = code_rows[:, :, None] + tl.arange(0, W // 4)[None, None, :]
    k_packed = tl.load(k_words_ptr + words, mask=valid[:, :, None], other=0)
    v_packed = tl.load(v_words_ptr + words, mask=valid[:, :, None], other=0)
    k_params = _tile_params(k_scale_ptr, k_zero_ptr, param_rows, valid, offs_w, W, GROUP_SIZE, NUM_GROUPS, FACTORED)
    v_params = _tile_params(v_scale_ptr, v_zero_ptr, param_rows, valid, offs_w, W, GROUP_SIZE, NUM_GROUPS, FACTORED)
    logits = _tile_logits(q, q_cols, q_sum, k_packed, k_params, S, T, W, BLOCK_H,
                          NUM_GROUPS, FACTORED, USE_DOT, DOT_PRECISION)
    logits = tl.where(valid[:, :, None], logits * row_scale[None, None, :], float("-inf"))
    m_i, alpha, p, l_i = _softmax_update(logits, m_i, l_i, True)
    acc = [_quarter_pv(acc[c], alpha, p, v_packed, v_params[c][0], v_params[c][1], 2 * c,
                       S, T, W, BLOCK_H, FACTORED, DOT_PRECISION) for c in (0, 1, 2, 3)]
    return acc, m_i, l_i

@triton_jit
def _tile_params(scale_ptr, zero_ptr, rows, valid, offs_w,   # as _quarter_params
                 W: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, FACTORED: tl.constexpr):
    """The four quarters' (scale, zero) (one load when a row is one group)."""
    if FACTORED and NUM_GROUPS == 1:
        params = _quarter_params(scale_ptr, zero_ptr, rows, valid, offs_w, 0, W, GROUP_SIZE, FACTORED)
        return params, params, params, params
    else:
        return [_quarter_params(scale_ptr, zero_ptr, rows, valid, offs_w, c, W, GROUP_SIZE, FACTORED)
                for c in (0, 1, 2, 3)]

@triton_jit
def _quarter_params(scale_ptr, zero_ptr, rows, valid, offs_w,   # as _int2_tile's (param_rows)
                    C: tl.constexpr,  # the quarter, 0 .. 3
                    W: tl.constexpr, GROUP_SIZE: tl.constexpr, FACTORED: tl.constexpr):
    """(scale, zero) of quarter C: (S, T) each if FACTORED, else (S, T, W); 0 if missing."""
    if FACTORED:
        group: tl.constexpr = C * W // GROUP_SIZE
        return (tl.load(scale_ptr + rows + group, mask=valid, other=0.0),
                tl.load(zero_ptr + rows + group, mask=valid, other=0.0))
    else:
        cols = rows[:, :, None] + ((C * W + offs_w) // GROUP_SIZE)[None, None, :]
        return (tl.load(scale_ptr + cols, mask=valid[:, :, None], other=0.0),
                tl.load(zero_ptr + cols, mask=valid[:, :, None], other=0.0))

@triton_jit
def _tile_logits(q, q_cols, q_sum,   # 4 each: (BLOCK_H, W) fp32, (S, W, 2 * BLOCK_H) fp16, (1, 1, BLOCK_H)
                 packed, params,    # (S, T, W // 4) uint32 key code words of the tile; as _tile_params
                 S: tl.constexpr, T: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr, NUM_GROUPS: tl.constexpr,
                 FACTORED: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(S, T, BLOCK_H) logits before row_scale, summed over the quarters.  Factored:
    s * (q.c - z * sum(q)), tokens on the MMA's 16 rows, heads' hi / lo on its 8 columns."""
    if FACTORED:
        no_acc = tl.zeros([S, T, 2 * BLOCK_H], dtype=tl.float32)
        if NUM_GROUPS == 1:
            t = _quarter_dot(packed, q_cols[0], no_acc, 0, S, T, W)
            for c in tl.static_range(1, 4):
                t = _quarter_dot(packed, q_cols[c], t, 2 * c, S, T, W)
            scale, zero = params[0]
            q_total = q_sum[0] + q_sum[1] + q_sum[2] + q_sum[3]
            return scale[:, :, None] * (_add_hi_lo(t, S, T, BLOCK_H) - zero[:, :, None] * q_total)
        else:
            logits = tl.zeros([S, T, BLOCK_H], dtype=tl.float32)
            for c in tl.static_range(4):
                scale, zero = params[c]
                t = _add_hi_lo(_quarter_dot(packed, q_cols[c], no_acc, 2 * c, S, T, W), S, T, BLOCK_H)
                logits += scale[:, :, None] * (t - zero[:, :, None] * q_sum[c])
            return logits
    else:
        logits = tl.zeros([S, T, BLOCK_H], dtype=tl.float32)
        for c in tl.static_range(4):
            scale, zero = params[c]
            logits += _quarter_logits(q[c], packed, scale, zero, 2 * c, S, T, W, BLOCK_H, USE_DOT, DOT_PRECISION)
        return logits

@triton_jit
def _quarter_dot(packed, q_cols, acc,   # code words; one quarter's q_cols; (S, T, 2 * BLOCK_H) fp32
                 SHIFT: tl.constexpr,  # 2 * quarter: the bit field of this quarter
                 S: tl.constexpr, T: tl.constexpr, W: tl.constexpr):
    """acc + codes @ q_cols in every sub-tile (one quarter's exact fp16 codes, fp32 sums)."""
    return tl.dot(_codes_fp16(packed, SHIFT, S, T, W), q_cols, acc, out_dtype=tl.float32)

@triton_jit
def _quarter_logits(q, packed,      # (BLOCK_H, W) fp32 query quarter; code words
                    scale, zero,    # (S, T, W) fp32 per-dim group scale and zero
                    SHIFT: tl.constexpr, S: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                    BLOCK_H: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """General path: one quarter-row's share of q.k, (S, T, BLOCK_H), dequantized in fp32."""
    unit: tl.constexpr = 1.0 / (1 << SHIFT)          # _codes_fp16 gives c * 2^SHIFT
    k = (_codes_fp16(packed, SHIFT, S, T, W).to(tl.float32) * unit - zero) * scale
    if USE_DOT:
        q_t = tl.broadcast_to(tl.trans(q)[None, :, :], (S, W, BLOCK_H))
        return tl.dot(k, q_t, input_precision=DOT_PRECISION)
    else:
        return tl.sum(k[:, :, None, :] * q[None, None, :, :], axis=3)

@triton_jit
def _quarter_pv(acc, alpha, p,      # quarter's (S, W, BLOCK_H) output, (S, BLOCK_H) rescale, (S, T, BLOCK_H) p
                packed,             # (S, T, W // 4) uint32 code words of the tile
                scale, zero,        # factored: (S, T) group params; general: (S, T, W)
                SHIFT: tl.constexpr, S: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                BLOCK_H: tl.constexpr, FACTORED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc * alpha + (p^T v_quarter)^T in every sub-tile.  Factored: p^T ((c - z) s) = c^T (p s) -
    sum(p s z), p s scaled into [0, 2^14] (by the sub-tile's largest scale), hi / lo columns, one dot."""
    codes = _codes_fp16(packed, SHIFT, S, T, W)          # c * 2^SHIFT
    unit: tl.constexpr = 1.0 / (1 << SHIFT)
    if FACTORED:
        s_max = tl.max(scale, axis=1)
        s_max = tl.where(s_max > 0, s_max, 1.0)                         # (S,)
        ps = p * (scale * (16384.0 / s_max[:, None]))[:, :, None]        # in [0, 2^14]
        pc = tl.dot(tl.permute(codes, (0, 2, 1)), _hi_lo_columns(ps, S, T, BLOCK_H), out_dtype=tl.float32)
        pc = _add_hi_lo(pc, S, W, BLOCK_H)                               # (S, W, BLOCK_H)
        psz = tl.sum(p * (scale * zero)[:, :, None], axis=1)             # sum of p s z
        pv = pc * (s_max * (unit / 16384.0))[:, None, None] - psz[:, None, :]
        return acc * alpha[:, None, :] + pv                              # two FFMA each
    else:
        v = (codes.to(tl.float32) * unit - zero) * scale
        return acc * alpha[:, None, :] + tl.dot(tl.permute(v, (0, 2, 1)), p, input_precision=DOT_PRECISION)

# ---- Step 3: sub-tiles (16-token sub-tiles, each its own softmax state, merged after the loop) ----
@triton_jit
def _merge_sub_tiles(m_i, l_i, acc):   # (S, BLOCK_H) states of the sub-tiles; 4 (S, W, BLOCK_H) outputs
    """Sub-tile states rescaled to the largest max and summed: m, l (BLOCK_H,), acc 4 (BLOCK_H, W)."""
    m = tl.max(m_i, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_i - m_ref[None, :])            # 0 for sub-tiles that saw no token
    l = tl.sum(l_i * w, axis=0)
    return m, l, [tl.trans(tl.sum(a * w[:, None, :], axis=0)) for a in acc]

# ---- Step 4, the hardest: INT2 codes to fp16 without a conversion instruction ----
@triton_jit
def _quarter_dims(W: tl.constexpr):
    """(W,) int32: the dim (within its quarter) at each position of _codes_fp16's output:
    positions 4i .. 4i+3 hold dims 4i, 4i+2, 4i+1, 4i+3 (bits 0 and 1 swapped)."""
    pos = tl.arange(0, W)
    return (pos & ~3) | ((pos & 1) << 1) | ((pos >> 1) & 1)

@triton_jit
def _codes_fp16(words,              # (S, T, W // 4) uint32: bytes 4i .. 4i+3 of each code row
                SHIFT: tl.constexpr,  # 2 * quarter: the bit field to extract
                S: tl.constexpr, T: tl.constexpr, W: tl.constexpr):
    """(S, T, W) fp16 in the order of _quarter_dims: the 2-bit code at SHIFT of every byte times 2^SHIFT
    (exact), with no int-to-float instruction.  fp16 0x6400 | m is 1024 + m (m < 1024): masking a word with
    0x00030003 << SHIFT leaves m = c * 2^SHIFT of bytes 0 and 2 in its halves (shifted right by 8: bytes 1 and
    3), OR 0x64006400 makes both fp16 1024 + m, minus 1024 (two per HADD2) leaves c * 2^SHIFT; the caller
    folds 2^SHIFT into the other operand."""
    mask: tl.constexpr = 0x00030003 << SHIFT
    even = (words & mask) | 0x64006400                 # bytes 0 and 2
    odd = ((words >> 8) & mask) | 0x64006400           # bytes 1 and 3
    b0 = (even & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    b1 = (odd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    b2 = (even >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    b3 = (odd >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    # (b0, b2, b1, b3): each half-word pair stays in its register, as the MMA operand wants.
    bits = tl.reshape(tl.join(tl.join(b0, b1), tl.join(b2, b3)), (S, T, W))
    return bits - 1024.0


_KERNEL_NAMES = ("_int2_decode_plain_kernel", "_int2_decode_split_kernel", "_merge_splits_kernel")


# ==== Input checks: the project's one set (optr's files, flags and cache use them too) ====
def need(ok: bool, what: str):
    """A ValueError saying `what` unless ok (kept under python -O, unlike assert)."""
    if not ok:
        raise ValueError(what)


def fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_tensor(name, x, shape=None, dtype=None, finite=False, device=None, contiguous=False):
    """ValueError naming `name` unless x is a tensor of this dtype ("float" or a tuple), shape
    (None / an entry None: any), device and, if asked, contiguous and finite."""
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", type(x).__name__)
    if dtype == "float" and not x.dtype.is_floating_point:
        fail(name, "a floating dtype", x.dtype)
    if isinstance(dtype, tuple) and x.dtype not in dtype:
        fail(name, "dtype " + " or ".join(str(d) for d in dtype), x.dtype)
    if shape is not None and (x.dim() != len(shape) or any(s not in (None, n) for s, n in zip(shape, x.shape))):
        fail(name, "shape (" + ", ".join("*" if s is None else str(s) for s in shape) + ")", tuple(x.shape))
    if device is not None and x.device != device:
        fail(name, f"device {device} (the device of q)", x.device)
    if contiguous and not x.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {x.stride()}")
    if finite and not bool(torch.isfinite(x).all()):
        fail(name, "finite values", "NaN or inf")


def _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                  n_quant, win_k, win_v, win_len, group_size, num_splits, sm_scale):
    """Validate everything (ValueError naming the argument); return the sizes as a dict."""
    floats = (torch.float32, torch.bfloat16)
    check_tensor("q", q, (None, None, None), floats, device=None, contiguous=True)
    dev, (B, H_q, d) = q.device, q.shape
    if B < 1 or H_q < 1:
        fail("q", "at least one sequence and one head", tuple(q.shape))
    if d < 16 or d > 256 or d & (d - 1):
        fail("q", "head_dim (last dim) a power of two in [16, 256]", d)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or d % group_size:
        fail("group_size", f"a positive int dividing head_dim {d}", group_size)
    check_tensor("k_codes", k_codes, (None, None, None, d // 4), (torch.uint8,), device=dev, contiguous=True)
    num_pages, H_kv, P, _ = k_codes.shape
    if H_kv < 1 or H_q % H_kv:
        fail("q", f"a number of query heads divisible by H_kv = {H_kv} (from k_codes)", H_q)
    if P < 1:
        fail("k_codes", "page size (dim 2) >= 1", P)
    check_tensor("v_codes", v_codes, tuple(k_codes.shape), (torch.uint8,), device=dev, contiguous=True)
    params = (num_pages, H_kv, P, d // group_size)
    for name, t in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        check_tensor(name, t, params, (torch.float32,), device=dev, contiguous=True)
    check_tensor("block_table", block_table, (B, None), (torch.int32,), device=dev, contiguous=True)
    check_tensor("n_quant", n_quant, (B,), (torch.int32,), device=dev, contiguous=True)
    check_tensor("win_k", win_k, (B, H_kv, None, d), floats, device=dev, contiguous=True)
    NW = win_k.shape[2]
    check_tensor("win_v", win_v, (B, H_kv, NW, d), floats, device=dev, contiguous=True)
    check_tensor("win_len", win_len, (B,), (torch.int32,), device=dev, contiguous=True)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= _MAX_SPLITS):
        fail("num_splits", f"None or an int in [1, {_MAX_SPLITS}]", num_splits)
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        fail("sm_scale", "None or a finite float", sm_scale)
    return dict(B=B, H_q=H_q, H_kv=H_kv, d=d, P=P, NW=NW, max_tokens=block_table.shape[1] * P, num_pages=num_pages)


def _check_values(k_codes, block_table, n_quant, win_len, sizes):
    """Check lengths and used block-table entries (read on the host); return the longest n_quant."""
    P, NW, num_pages = sizes["P"], sizes["NW"], sizes["num_pages"]
    nq, wl, max_blocks = n_quant.cpu().long(), win_len.cpu().long(), block_table.shape[1]
    if (nq < 0).any() or (nq > max_blocks * P).any():
        fail("n_quant", f"values in [0, max_blocks * page_size] = [0, {max_blocks * P}]", nq.tolist())
    if (wl < 0).any() or (wl > NW).any():
        fail("win_len", f"values in [0, NW] = [0, {NW}] (NW from win_k)", wl.tolist())
    empty = ((nq + wl) < 1).nonzero().flatten().tolist()
    if empty:
        fail("n_quant + win_len", "at least one token per sequence", f"none for sequences {empty}")
    used_blocks = (n_quant.long() + P - 1) // P
    used = torch.arange(max_blocks, device=block_table.device)[None, :] < used_blocks[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        fail("block_table", f"used entries in [0, num_pages) = [0, {num_pages})",
              f"block_table[{b}, {j}] = {int(block_table[b, j])}")
    return dict(max_tokens=int(nq.max()))


# ==== Launcher: block sizes and launch ====
@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _default_num_splits(B, H_kv, max_tiles, device):
    """Enough programs for ~4 waves of the GPU, at least one tile per split."""
    return max(1, min(triton.cdiv(4 * _sm_count(device), max(1, B * H_kv)), max_tiles, 64))


@functools.lru_cache(maxsize=None)
def _dot_precision(device):
    """fp32 tl.dot (window tokens, general path): 3xTF32 keeps ~fp32 accuracy on tensor cores (sm80+)."""
    if device.type == "cuda" and not _INTERPRETED and torch.version.hip is None \
            and torch.cuda.get_device_capability(device)[0] >= 8:
        return "tf32x3"
    return "ieee"


def _block_sizes(d, G, ratio, P):
    """Stage 1's tiles, warps and stages (no autotuning), chosen with `python -m tools.sass`'s static
    model; all tested configurations compile spill-free for sm_80 and sm_90a (`pytest -m sass_all`; triton
    3.7.1, 3.6.0).  d = G = 128: 128-token tiles, no pipelining (model: 2.0x the HBM time; 64 tokens, 1-3
    stages: 2.2-2.4x), 64 if a page is shorter.  Several groups per row: 64 within a page, 32 across pages
    and for d = 256.  General path: 16 tokens, one sub-tile.  maxnreg 255: unset, ptxas spills at 168."""
    quarter = d // 4
    factored = G % quarter == 0 and quarter >= 16
    block_n = (16 if not factored else 32 if d > 128 else (64 if P % 64 == 0 else 32) if d // G > 1
               else 128 if P % 64 == 0 else 64)
    block_w = 32 if d <= 128 else 16          # window tokens per tile (fp32 after upcast)
    sub_tiles = block_n // 16 if factored else 1    # 16 tokens: the MMA's row count
    return dict(BLOCK_H=triton.next_power_of_2(ratio), BLOCK_N=block_n, SUB_TILES=sub_tiles,
                BLOCK_W=block_w, FACTORED=factored, num_warps=4,
                num_stages=1 if block_n == 128 or not factored else 2, maxnreg=255)


def _launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant,
            win_k, win_v, win_len, group_size, num_splits, sm_scale, sizes, kernel="fast"):
    """Launch the plain kernel, or both stages of the fast one, on validated inputs; no host synchronisation."""
    B, H_q, H_kv, d, P, NW = (sizes[k] for k in ("B", "H_q", "H_kv", "d", "P", "NW"))
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if NW == 0:  # give the kernel a readable (never read) pointer
        win_k = win_v = q.new_zeros(B, H_kv, 1, d)
    if k_codes.shape[0] == 0:  # empty pool (all n_quant == 0): same reason
        k_codes = v_codes = k_codes.new_zeros(1, *k_codes.shape[1:])
        k_scale = k_zero = v_scale = v_zero = k_scale.new_zeros(1, *k_scale.shape[1:])
    if block_table.shape[1] == 0:
        block_table = block_table.new_zeros(B, 1)
    if kernel == "plain":
        out = torch.empty(B, H_q, d, dtype=torch.float32, device=q.device)
        _int2_decode_plain_kernel[(B, H_kv)](
            q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant, win_k, win_v,
            win_len, out, sm_scale * _LOG2E, *q.stride()[:2], *k_codes.stride()[:3], *k_scale.stride()[:3],
            block_table.stride(0), *win_k.stride()[:3], *out.stride()[:2], HEAD_DIM=d, GROUP_SIZE=group_size,
            PAGE_SIZE=P, QUERIES_PER_KV=H_q // H_kv, BLOCK_H=triton.next_power_of_2(H_q // H_kv),
            BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_W=16, DOT_PRECISION=_dot_precision(q.device),
            num_warps=8 if P * d >= 8192 else 4)   # 4 spill at d = 128, P = 64 (sm_90a)
        return out
    cfg = _block_sizes(d, group_size, H_q // H_kv, P)
    max_tiles = triton.cdiv(sizes["max_tokens"], cfg["BLOCK_N"])
    num_splits = num_splits or _default_num_splits(B, H_kv, max_tiles, q.device)
    part_out = torch.empty(B, H_q, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H_q, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H_q, d, dtype=torch.float32, device=q.device)
    _int2_decode_split_kernel[(B, H_kv, num_splits)](      # strides as the kernel's arguments name them
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant, win_k, win_v, win_len,
        part_out, part_lse, sm_scale * _LOG2E, num_splits, *q.stride()[:2], *k_codes.stride()[:3],
        *k_scale.stride()[:3], block_table.stride(0), *win_k.stride()[:3], *part_out.stride()[:3],
        *part_lse.stride()[:2], HEAD_DIM=d, GROUP_SIZE=group_size, NUM_GROUPS=d // group_size, PAGE_SIZE=P,
        QUERIES_PER_KV=H_q // H_kv, DOT_PRECISION=_dot_precision(q.device), **cfg)
    _merge_splits_kernel[(B, H_q)](
        part_out, part_lse, out, num_splits, *part_out.stride()[:3], *part_lse.stride()[:2],
        *out.stride()[:2], HEAD_DIM=d, BLOCK_SPLITS=min(triton.next_power_of_2(num_splits), 4096 // d),
        num_warps=4)
    return out


def int2_paged_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant, win_k,
                      win_v, win_len, group_size, num_splits=None, sm_scale=None, checked=True, kernel="fast"):
    """Decode attention of q over an INT2 paged cache plus full-precision windows: (B, H_q, d) fp32.
    kernel: "fast" (split-K) or "plain" (one program per sequence and KV head, num_splits unused);
    num_splits: programs per (sequence, KV head) (None: from the GPU size); sm_scale: logit scale (None:
    1/sqrt(d)).  A ValueError names any malformed argument.  checked=True also checks n_quant, win_len
    and the used block-table entries on the host (a sync); checked=False never syncs (CUDA-graph
    capturable; a whole optr.decode_step is not): bad values are then undefined behaviour, and
    num_splits=None sizes from the block table's capacity."""
    if triton is None:
        raise ImportError(f"int2_paged_decode {_NO_TRITON}", name="triton")
    if kernel not in ("fast", "plain"):
        fail("kernel", '"fast" or "plain"', repr(kernel))
    sizes = _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                          n_quant, win_k, win_v, win_len, group_size, num_splits, sm_scale)
    if checked:
        sizes.update(_check_values(k_codes, block_table, n_quant, win_len, sizes))
    if not _INTERPRETED and q.device.type != "cuda":
        fail("q", "a CUDA tensor (on a CPU: int2_paged_decode_cpu, or Triton's interpreter with "
                  "TRITON_INTERPRET=1 set before triton is imported)", q.device)
    if type(tl.zeros) is not type(_codes_fp16):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported: set it before")
    return _launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant,
                   win_k, win_v, win_len, group_size, num_splits, sm_scale, sizes, kernel)


# ==== CPU kernels (numba): the same algorithm without a GPU, and the INT2 write ====
# numba (imported at the first CPU call) beat torch.compile by ~2x on 2 cores (SmolLM2 shapes); it compiles
# once (~40 s), then loads from __pycache__ in 0.6 s; its first use leaves 94 MiB resident (kernels and
# threads, tools.bench_hf at a8970f6).  A job owns one (sequence, KV head, split) and all its query heads;
# partials merge by log-sum-exp.  Sums are reassociated (vectorised; round-off only); the write is not: bit
# for bit optr's.
prange = range   # numba.prange where compiled (_nb)

_CPU_TILE = 16                      # INT2 tokens unpacked at once (within one page)
_EXP2_TAYLOR = tuple(math.log(2) ** i / math.factorial(i) for i in range(8))   # 2^f = e^(f ln 2)


def _cpu_exp_rows(a, m, n):
    """a[r, :n] = exp(a[r, :n] - m[r]) (a loop LLVM vectorises; libm's expf does not): 2^t as 2^k,
    added to the exponent bits, times 2^f, f = t - k in [-1/2, 1/2], by its degree-7 Taylor
    polynomial (relative error < 6e-9 before fp32 rounding); t >= -115, so 2^k stays normal."""
    f32 = np.float32
    c0, c1, c2, c3, c4, c5, c6, c7 = _EXP2_TAYLOR
    bits = a.view(np.int32)
    for r in range(a.shape[0]):
        for i in range(n):
            t = max(a[r, i] - m[r], f32(-80.0)) * f32(1.4426950408889634)
            k = np.floor(t + f32(0.5))
            f = t - k
            a[r, i] = ((((((f32(c7) * f + f32(c6)) * f + f32(c5)) * f + f32(c4)) * f + f32(c3)) * f
                        + f32(c2)) * f + f32(c1)) * f + f32(c0)
            bits[r, i] += np.int32(k) << 23


_k_dots = _v_dots = _w_dots = _w_axpy = _fetch = _row_max = None   # LLVM vector code: _simd()


def _simd(numba) -> dict:
    """The CPU decode's inner loops over a tile (up to 16 tokens of one page), written as LLVM vector code
    (numba intrinsics; LLVM lowers <16 x float> to the machine's SIMD: AVX-512, AVX2, NEON).  numba's own
    loops over the same work ran 2-4x slower (NOTES.md).  Flat arrays; `tile` the tile's first row
    (page, KV head, slot) counted in rows; m its tokens; logits / p at a[r, i + t] (a's rows `stride` long).

    _k_dots(qx, codes, scale, zero, qsum, tile, m, D4, G, R, acc, a, i, stride, E): the logits
      a[r, i + t] = sum_g s (q_g.c - z sum_g q), lanes over the tokens.  The codes are read E bytes a
      lane: E = 4, a 32-bit word's 16 two-bit fields f = 4k + c (byte k, plane c: dim c D4 + 4e + k of
      word e), each masked in place and converted (f = 15 shifted down); qx[r d + 4E e + f] is the query's
      dim times 4^-f (1 for f = 15), so nothing is shifted back.  E = 1 (G or D4 not a multiple of 4): a
      byte's 4 fields.  The tile's W = D4 / 4 words a token (W = 1, 2, 4, 8, 16) are loaded and transposed
      (log2 W rounds of unzips: word w of every token a vector), else gathered a word at a time; scales
      and zeros loaded where adjacent (G = d).  With gathers the job took 1.2-1.45x at 4k-8k (Zen 4, NOTES).
      acc: (R, d / G, 16) scratch, q_g.c per group.
    _v_dots(codes, scale, zero, tile, m, D4, G, R, a, i, stride, xs, pz, gc, o, L): o[r] += sum_t p s c
      and pz[r, g, t] += p s z (xs: (R, d / G, 16) scratch, p s), lanes over L channels of a plane
      (chunk j of plane c in group gc[c NC + j]), four tokens a sweep of o; the fields masked in place,
      so plane c of o gathers 4^c o (the caller divides once).
    _w_dots(x, rows, base, n, d, R, a, i, stride, L) and _w_axpy(same): the exact window tokens, rows base ..
      base + n - 1 of `rows` (d floats each), 4 tokens a sweep, lanes over L channels (L = 16, or 4 where d is
      not a multiple of 16): _w_dots a[r, i + t] = x[r].row_t (the 4 tokens' lanes summed at once, `sums`),
      _w_axpy x[r] += sum_t a[r, i + t] row_t.  numba's loops over the same: 31 ns per slot, these 21.
    _fetch(x, start, n): prefetch x[start : start + n], a cache line at a time."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic
    i8, i32, i64, f32, V, T = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType(), \
        ir.VectorType, _CPU_TILE
    fm, ptr = ("contract", "reassoc", "nsz"), ir.PointerType()

    class Emit:                                     # IRBuilder and the few vector idioms the loops use
        def __init__(self, context, builder, sig, args):   # ints as i64, arrays as pointers to element 0
            self.b, self.args = builder, [
                context.make_array(t)(context, builder, a).data if isinstance(t, numba.types.Array) else None
                if isinstance(t, numba.types.Literal) else context.cast(builder, a, t, numba.types.int64)
                for t, a in zip(sig.args, args)]
            self.tok = ir.Constant(V(i64, T), list(range(T)))      # the tile's lanes

        def i(self, *xs):                           # the product of ints and i64 values
            return functools.reduce(self.b.mul, [x if isinstance(x, ir.Value) else ir.Constant(i64, x) for x in xs])

        def at(self, p, *terms, ty=None):           # &p[sum(terms)], as a pointer to ty
            q = self.b.gep(p, [functools.reduce(self.b.add, [self.i(t) for t in terms])])
            return q if ty is None else self.b.bitcast(q, ty.as_pointer())

        def splat(self, x, n):                      # n copies of the scalar x
            v = self.b.insert_element(ir.Constant(V(x.type, n), ir.Undefined), x, ir.Constant(i32, 0))
            return self.b.shuffle_vector(v, v, ir.Constant(V(i32, n), [0] * n))

        def llvm(self, name, ret, *args):           # call LLVM's intrinsic `name`
            fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
            return self.b.call(fn, args)

        def lanes(self, p, stride, live, ty):       # p[t stride] for the live lanes t, 0 elsewhere
            b, vt, name = self.b, V(ty, T), f"v{T}{'f32' if ty == f32 else f'i{ty.width}'}"
            with b.if_else(b.icmp_unsigned("==", self.i(stride), self.i(4 if ty == f32 else ty.width // 8))) as (
                    row, apart):
                with row:                           # adjacent: a masked load (a gather costs more)
                    one, at_one = self.llvm(f"llvm.masked.load.{name}.p0", vt, b.bitcast(p, ty.as_pointer()),
                                            ir.Constant(i32, 1), live, ir.Constant(vt, None)), b.basic_block
                with apart:
                    ptrs = b.inttoptr(b.add(b.mul(self.tok, self.splat(self.i(stride), T)),
                                            self.splat(b.ptrtoint(p, i64), T)), V(ptr, T))
                    many, at_many = self.llvm(f"llvm.masked.gather.{name}.v{T}p0", vt, ptrs, ir.Constant(i32, 1),
                                              live, ir.Constant(vt, None)), b.basic_block
            x = b.phi(vt)
            x.add_incoming(one, at_one), x.add_incoming(many, at_many)
            return x

        def transpose(self, p, W, m):               # m rows of W words at p (T rows read) -> W vectors, lane t row t
            vs = [self.llvm(f"llvm.masked.load.v{T}i32.p0", V(i32, T), self.at(p, k * T, ty=i32), ir.Constant(i32, 4),
                            self.b.icmp_unsigned("<", self.b.add(self.tok, self.splat(self.i(k * T), T)),
                                                 self.splat(self.i(m, W), T)), ir.Constant(V(i32, T), None))
                  for k in range(W)]                # word w of row t at flat index t W + w
            for k in range(W.bit_length() - 1):     # the pairs apart in bit k unzipped: a lane's low bit to bit k
                for v, u in ((v, v | 1 << k) for v in range(W) if not v >> k & 1):
                    vs[v], vs[u] = (self.b.shuffle_vector(vs[v], vs[u], ir.Constant(V(i32, T), [*range(o, 2 * T, 2)]))
                                    for o in (0, 1))
            return vs

        def fields(self, w, n):                     # fields 0..n-1 of each lane, masked in place, as fp32
            c = lambda x: ir.Constant(w.type, [ir.Constant(i32, x)] * w.type.count)
            return [self.b.sitofp(self.b.lshr(w, c(30)) if f == 15 else self.b.and_(w, c(3 << 2 * f)),
                                  V(f32, w.type.count)) for f in range(n)]

        def add(self, x, y):
            return self.b.fadd(x, y, flags=fm)

        def axpy(self, acc, x, v):                  # acc + x v (x a scalar), fused where the machine has FMA
            return self.add(acc, self.b.fmul(self.splat(x, v.type.count), v, flags=fm))

        def update(self, p, f):                     # *p = f(*p)
            self.b.store(f(self.b.load(p, align=4)), p, align=4)

        def sums(self, vs):                         # lane t: the sum of vs[t]'s lanes (len(vs) a power of 2)
            L, tok, w = vs[0].type.count, [[t] for t in range(len(vs))], vs[0].type.count   # segments' tokens
            half = lambda v, u, lanes: self.b.shuffle_vector(v, u, ir.Constant(V(i32, len(lanes)), lanes))
            while len(vs) > 1:                      # pairs merged: each segment halved, a's and b's interleaved
                h, ns = w // 2, L // w
                lo = [o + s * w + k for s in range(ns) for o in (0, L) for k in range(h)]
                vs = [self.add(half(p, q, lo), half(p, q, [x + h for x in lo])) for p, q in zip(vs[::2], vs[1::2])]
                tok, w = [[x for s in range(ns) for x in (ta[s], tb[s])] for ta, tb in zip(tok[::2], tok[1::2])], h
            v, tok = vs[0], tok[0]
            while w > 1:                            # then each segment summed in halves
                w //= 2
                lo = [s * 2 * w + k for s in range(len(tok)) for k in range(w)]
                v = self.add(half(v, v, lo), half(v, v, [x + w for x in lo]))
            return half(v, v, [tok.index(t) for t in range(len(tok))])

    def typed(args, body):                          # an intrinsic's type and code; its last argument a constant
        if isinstance(args[-1], numba.types.IntegerLiteral):        # else numba retries with the value
            return numba.types.void(*args), lambda *a: body(Emit(*a), args[-1].literal_value) or a[0].get_dummy_value()

    @intrinsic
    def k_dots(typingctx, qx, codes, scale, zero, qsum, tile, m, D4, G, R, acc, a, i, stride, E):
        return typed((qx, codes, scale, zero, qsum, tile, m, D4, G, R, acc, a, i, stride, E), k_body)

    def k_body(e, E):
        qx, codes, scale, zero, qsum, tile, m, D4, G, R, acc, a, i, stride, _ = e.args
        b, d = e.b, e.i(D4, 4)
        NG, live = b.udiv(d, G), b.icmp_unsigned("<", e.tok, e.splat(m, T))
        def word(w, x):                                               # q.c over word w of every token
            g = [b.udiv(b.add(e.i(c, D4), e.i(E, w)), G) for c in range(4)]              # each plane's group
            with cgutils.for_range(b, R) as r:
                qr = e.at(qx, e.i(r.index, d), e.i(w, 4 * E))
                y = [functools.reduce(lambda u, k: e.axpy(u, b.load(e.at(qr, 4 * k + c)), x[4 * k + c]), range(E),
                                      ir.Constant(V(f32, T), [0.0] * T)) for c in range(4)]
                part = lambda c: e.at(acc, e.i(b.add(e.i(r.index, NG), g[c]), T), ty=V(f32, T))
                with b.if_else(b.icmp_unsigned("==", NG, e.i(1))) as (one, apart):
                    with one:                                       # G = d: one read and write
                        e.update(part(0), lambda v: functools.reduce(e.add, y, v))
                    with apart:
                        for c in range(4):
                            e.update(part(c), lambda v: e.add(v, y[c]))
        done, gather = b.append_basic_block("words.done"), b.append_basic_block("words.gather")
        case = b.switch(D4, gather)
        for W in (1, 2, 4, 8, 16) if E == 4 else ():                  # W words a token: the tile loaded, transposed
            case.add_case(e.i(4 * W), block := b.append_basic_block(f"words.{W}"))
            b.position_at_end(block)
            for w, x in enumerate(e.transpose(e.at(codes, e.i(tile, D4), ty=i32), W, m)):
                word(e.i(w), e.fields(x, 16))
            b.branch(done)
        b.position_at_end(gather)
        with cgutils.for_range(b, b.udiv(D4, e.i(E))) as w:           # else a gather per word
            word(w.index, e.fields(b.zext(e.lanes(e.at(codes, e.i(tile, D4), e.i(w.index, E)), D4, live,
                                                  ir.IntType(8 * E)), V(i32, T)), 4 * E))
        b.branch(done)
        b.position_at_end(done)
        y = cgutils.alloca_once(b, V(f32, T))
        with cgutils.for_range(b, R) as r:                            # the logits: sum_g s (q.c - z sum_g q)
            b.store(ir.Constant(V(f32, T), [0.0] * T), y)
            with cgutils.for_range(b, NG) as g:
                rg, p = b.add(e.i(r.index, NG), g.index), e.i(tile, NG)
                dot = b.load(e.at(acc, e.i(rg, T), ty=V(f32, T)), align=4)
                zq = b.fmul(e.lanes(e.at(zero, p, g.index), e.i(NG, 4), live, f32),
                            e.splat(b.load(e.at(qsum, rg)), T), flags=fm)
                s = e.lanes(e.at(scale, p, g.index), e.i(NG, 4), live, f32)
                e.update(y, lambda v: e.add(v, b.fmul(s, b.fsub(dot, zq, flags=fm), flags=fm)))
            e.llvm(f"llvm.masked.store.v{T}f32.p0", ir.VoidType(), b.load(y), e.at(a, i, e.i(r.index, stride)),
                   ir.Constant(i32, 4), live)

    @intrinsic
    def v_dots(typingctx, codes, scale, zero, tile, m, D4, G, R, a, i, stride, xs, pz, gc, o, L):
        return typed((codes, scale, zero, tile, m, D4, G, R, a, i, stride, xs, pz, gc, o, L), v_body)

    def v_body(e, L):
        codes, scale, zero, tile, m, D4, G, R, a, i, stride, xs, pz, gc, o, _ = e.args
        b, d, fv = e.b, e.i(D4, 4), V(f32, T)
        NG, NC, live = b.udiv(d, G), b.udiv(D4, e.i(L)), b.icmp_unsigned("<", e.tok, e.splat(m, T))
        with cgutils.for_range(b, R) as r:                            # xs = p s (0 past m), pz += p s z
            p = e.llvm(f"llvm.masked.load.v{T}f32.p0", fv, e.at(a, i, e.i(r.index, stride)), ir.Constant(i32, 4),
                       live, ir.Constant(fv, None))
            with cgutils.for_range(b, NG) as g:
                rg, at_g = e.i(b.add(e.i(r.index, NG), g.index), T), e.at(scale, e.i(tile, NG), g.index)
                ps = b.fmul(p, e.lanes(at_g, e.i(NG, 4), live, f32), flags=fm)
                b.store(ps, e.at(xs, rg, ty=fv), align=4)
                z = e.lanes(e.at(zero, e.i(tile, NG), g.index), e.i(NG, 4), live, f32)
                e.update(e.at(pz, rg, ty=fv), lambda v: e.add(v, b.fmul(ps, z, flags=fm)))
        for u in range(0, T, 4):                                      # p V, 4 tokens a sweep of o
            with b.if_then(b.icmp_unsigned("<", e.i(u), m)), cgutils.for_range(b, NC) as j:
                x = []                                                # token t's L bytes (t >= m: row 0's; xs 0)
                for t in range(u, u + 4):
                    row = b.select(b.icmp_unsigned("<", e.i(t), m), b.add(e.i(tile, D4), e.i(t, D4)), e.i(tile, D4))
                    w = b.zext(b.load(e.at(codes, row, e.i(j.index, L), ty=V(i8, L)), align=1), V(i32, L))
                    x.append(e.fields(w, 4))                  # field c times 4^c: o's plane c is 4^c o
                g = [b.load(e.at(gc, e.i(c, NC), j.index)) for c in range(4)]
                with cgutils.for_range(b, R) as r:
                    for c in range(4):
                        xr = e.at(xs, e.i(b.add(e.i(r.index, NG), g[c]), T), u)
                        e.update(e.at(o, e.i(r.index, d), e.i(c, D4), e.i(j.index, L), ty=V(f32, L)),
                                 lambda v: functools.reduce(lambda y, t: e.axpy(y, b.load(e.at(xr, t)), x[t][c]),
                                                            range(4), v))
    @intrinsic
    def w_dots(typingctx, x, rows, base, n, d, R, a, i, stride, L):
        return typed((x, rows, base, n, d, R, a, i, stride, L), lambda e, L: w_body(e, L, False))

    @intrinsic
    def w_axpy(typingctx, x, rows, base, n, d, R, a, i, stride, L):
        return typed((x, rows, base, n, d, R, a, i, stride, L), lambda e, L: w_body(e, L, True))

    def w_body(e, L, axpy):                         # 4 tokens a sweep; t >= n: row 0 read, weighs 0, not stored
        x, rows, base, n, d, R, a, i, stride, _ = e.args
        b, fv, f4, four = e.b, V(f32, L), V(f32, 4), ir.Constant(i32, 4)
        y = [cgutils.alloca_once(b, fv) for _ in range(4)]
        with cgutils.for_range(b, b.udiv(b.add(n, e.i(3)), e.i(4))) as u:
            u4 = e.i(u.index, 4)
            live = b.icmp_unsigned("<", ir.Constant(V(i64, 4), list(range(4))), e.splat(b.sub(n, u4), 4))
            row = [e.at(rows, e.i(b.add(base, b.select(b.extract_element(live, ir.Constant(i32, t)),
                                                       b.add(u4, e.i(t)), e.i(0))), d)) for t in range(4)]
            with cgutils.for_range(b, R) as r:
                pr = e.at(a, i, u4, e.i(r.index, stride))
                p = e.llvm("llvm.masked.load.v4f32.p0", f4, pr, four, live, ir.Constant(f4, [0.0] * 4))
                for t in range(4 * (not axpy)):
                    b.store(ir.Constant(fv, [0.0] * L), y[t])
                with cgutils.for_range(b, b.udiv(d, e.i(L))) as j:    # L channels a chunk
                    xr = e.at(x, e.i(r.index, d), e.i(j.index, L), ty=fv)
                    w = [b.load(e.at(rt, e.i(j.index, L), ty=fv), align=4) for rt in row]
                    if axpy:                                          # x[r] += sum_t a[r, i + 4u + t] w_t
                        pw = lambda v, t: e.axpy(v, b.extract_element(p, ir.Constant(i32, t)), w[t])
                        e.update(xr, lambda v: functools.reduce(pw, range(4), v))
                    else:                                             # y_t += x[r] w_t
                        xv = b.load(xr, align=4)
                        for t in range(4):
                            e.update(y[t], lambda v: e.add(v, b.fmul(xv, w[t], flags=fm)))
                if not axpy:                                          # a[r, i + 4u + t] = y_t's lanes summed
                    e.llvm("llvm.masked.store.v4f32.p0", ir.VoidType(), e.sums([b.load(v) for v in y]), pr, four,
                           live)

    @intrinsic
    def row_max(typingctx, x, start, n):           # max of x[start : start + n] (flat, n >= 1), 16 lanes a load
        def body(context, builder, sig, args):
            e, fv = Emit(context, builder, sig, args), V(f32, T)
            (x, start, n), b, low = e.args, e.b, ir.Constant(fv, [float("-inf")] * T)
            acc = cgutils.alloca_once_value(b, low)
            with cgutils.for_range_slice(b, e.i(0), n, e.i(T)) as (j, _):
                live = b.icmp_unsigned("<", b.add(e.tok, e.splat(j, T)), e.splat(n, T))
                x = e.llvm(f"llvm.masked.load.v{T}f32.p0", fv, e.at(x, start, j), ir.Constant(i32, 4), live, low)
                b.store(e.llvm(f"llvm.maxnum.v{T}f32", fv, b.load(acc), x), acc)
            return e.llvm(f"llvm.vector.reduce.fmax.v{T}f32", f32, b.load(acc))
        return numba.types.float32(x, start, n), body

    @intrinsic
    def fetch(typingctx, x, start, n):             # x[start : start + n] (flat) into the caches, a line a time
        def body(context, builder, sig, args):
            e = Emit(context, builder, sig, args)
            (x, start, n), b = e.args, e.b
            lo, hi = (b.ptrtoint(e.at(x, t), i64) for t in (start, b.add(start, n)))
            with cgutils.for_range_slice(b, b.and_(lo, e.i(-64)), hi, e.i(64)) as (line, _):
                e.llvm("llvm.prefetch.p0", ir.VoidType(), b.inttoptr(line, ptr),   # read, keep, data
                       *(ir.Constant(i32, c) for c in (0, 3, 1)))
            return context.get_dummy_value()
        return numba.types.void(x, start, n), body
    return {"_k_dots": k_dots, "_v_dots": v_dots, "_w_dots": w_dots, "_w_axpy": w_axpy, "_fetch": fetch,
            "_row_max": row_max}


def _cpu_fetch(kc, ks, kz, vc, vs, vz, bt, s, h, t, H, P, D4, NG, T):
    """Prefetch T INT2 tokens of sequence row s, KV head h, from token t on: K's and V's codes, scales, zeros
    (the V pass then reads them from the caches).  At 4k, after the model's weights went through the caches
    (a step in a forward): 468 -> 333 us a layer (SmolLM2, one process, interleaved)."""
    tok = (bt[s, t // P] * H + h) * P + t % P
    for x in (kc, vc):
        _fetch(x, tok * D4, T * D4)
    for x in (ks, kz, vs, vz):
        _fetch(x, tok * NG, T * NG)


def _cpu_decode_job(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, job):
    """One (sequence b, KV head h, split sp) in two passes (logits and max, then p V: no rescaling),
    factored as the Triton kernel (s (q.c - z sum_g q); p s c, then - p s z), over tiles of up to
    _CPU_TILE tokens of one page, the codes read by _k_dots and _v_dots, the window's rows by _w_dots
    and _w_axpy; b reads block-table and window row rows[b]."""
    f32 = np.float32
    (B, Hq, d), H, P = q.shape, kc.shape[1], kc.shape[2]
    R, NG, T, D4 = Hq // H, d // G, _CPU_TILE, d // 4
    E = 4 if D4 % 4 == 0 and G % 4 == 0 else 1                        # _k_dots' bytes a lane
    L = 16 if D4 % 16 == 0 and G % 16 == 0 else E                     # _v_dots' channels a lane
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w, s = nq[b], wl[b], rows[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split          # INT2 tokens [t0, t1)
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split          # window slots [w0, w1)
    nt, nw = t1 - t0, w1 - w0
    if nt + nw == 0:                                                  # nothing here: weighs 0
        for r in range(R):
            lse_part[b, h * R + r, sp] = -np.inf
        return
    qs = np.empty((R, d), dtype=f32)                                  # the KV head's queries, scaled,
    qsum, qx = np.zeros((R, NG), dtype=f32), np.empty(R * d, dtype=f32)   # their sum per Q2 group,
    for r in range(R):                                                # and in _k_dots' field order
        for ch in range(d):
            qs[r, ch] = q[b, h * R + r, ch] * scale
            qsum[r, ch // G] += qs[r, ch]
        for e in range(D4 // E):
            for f in range(4 * E):
                qx[r * d + 4 * E * e + f] = qs[r, (f % 4) * D4 + E * e + f // 4] / f32(1 << 2 * f if f < 15 else 1)
    kcf, vcf, ksf, kzf, qsf = kc.reshape(-1), vc.reshape(-1), ks.reshape(-1), kz.reshape(-1), qsum.reshape(-1)
    vsf, vzf = vs.reshape(-1), vz.reshape(-1)
    a, acc = np.empty((R, nt + nw), dtype=f32), np.empty(R * NG * T, dtype=f32)   # logits then p; q.c
    af = a.reshape(-1)
    for i in range(t0, min(t1, t0 + 2 * T), T):                      # the first two tiles' K and V, fetched
        _cpu_fetch(kcf, ksf, kzf, vcf, vsf, vzf, bt, s, h, i, H, P, D4, NG, T)
    i = 0
    while i < nt:                                                     # pass 1: INT2 logits, a tile
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P               # of mt tokens in one page
        mt, acc[:] = min(T, nt - i, P - slot), 0.0
        tok = (page * H + h) * P + slot
        if t0 + i + 2 * T < t1:                                       # and two tiles ahead: DRAM's latency
            _cpu_fetch(kcf, ksf, kzf, vcf, vsf, vzf, bt, s, h, t0 + i + 2 * T, H, P, D4, NG, T)
        if E == 4:
            _k_dots(qx, kcf, ksf, kzf, qsf, tok, mt, D4, G, R, acc, af, i, nt + nw, 4)
        else:
            _k_dots(qx, kcf, ksf, kzf, qsf, tok, mt, D4, G, R, acc, af, i, nt + nw, 1)
        i += mt
    wrow = (s * H + h) * wk.shape[2] + w0                               # the window tokens, exact
    if d % 16 == 0:
        _w_dots(qs.reshape(-1), wk.reshape(-1), wrow, nw, d, R, af, nt, nt + nw, 16)
    else:
        _w_dots(qs.reshape(-1), wk.reshape(-1), wrow, nw, d, R, af, nt, nt + nw, 4)
    m, l = np.empty(R, dtype=f32), np.zeros(R, dtype=f32)
    for r in range(R):
        m[r] = _row_max(af, r * (nt + nw), nt + nw)
    _cpu_exp_rows(a, m, nt + nw)
    for r in range(R):
        for i in range(nt + nw):
            l[r] += a[r, i]
    o, pz, xs = np.zeros((R, d), dtype=f32), np.zeros(R * NG * T, dtype=f32), np.empty(R * NG * T, dtype=f32)
    of, NC = o.reshape(-1), D4 // L                                   # xs: a tile's p s; pz: its p s z
    gc = np.empty(4 * NC, dtype=np.int64)                             # chunk (c, j)'s group
    for c in range(4):
        for j in range(NC):
            gc[c * NC + j] = (c * D4 + L * j) // G
    i = 0
    while i < nt:                                                     # pass 2: p V~, a tile a call
        page, slot = bt[s, (t0 + i) // P], (t0 + i) % P
        mt, tok = min(T, nt - i, P - slot), (page * H + h) * P + slot
        if L == 16:
            _v_dots(vcf, vsf, vzf, tok, mt, D4, G, R, af, i, nt + nw, xs, pz, gc, of, 16)
        elif L == 4:
            _v_dots(vcf, vsf, vzf, tok, mt, D4, G, R, af, i, nt + nw, xs, pz, gc, of, 4)
        else:
            _v_dots(vcf, vsf, vzf, tok, mt, D4, G, R, af, i, nt + nw, xs, pz, gc, of, 1)
        i += mt
    psz = pz.reshape(R, NG, T).sum(axis=2)
    for r in range(R):                                                # plane c of o: 4^c o (exact)
        for ch in range(d):
            o[r, ch] /= f32(1 << 2 * (ch // D4))
    if d % 16 == 0:
        _w_axpy(of, wv.reshape(-1), wrow, nw, d, R, af, nt, nt + nw, 16)
    else:
        _w_axpy(of, wv.reshape(-1), wrow, nw, d, R, af, nt, nt + nw, 4)
    for r in range(R):
        for ch in range(d):
            o_part[b, h * R + r, sp, ch] = (o[r, ch] - psz[r, ch // G]) / l[r]
        lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])


def _cpu_decode(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split):
    """Stage 1 over (sequence, KV head, split) in parallel, then the log-sum-exp merge.  Scalar loops, no
    array expressions: parallel=True made each a parallel region of its own (a call with one token: 29 us, now 11).
    Divisions as numpy's (error_model): a sequence with no token (refused by the checks) gives NaN, not a raise."""
    (B, Hq, d), H = q.shape, kc.shape[1]
    o_part = np.empty((B, Hq, n_split, d), dtype=np.float32)
    lse_part = np.empty((B, Hq, n_split), dtype=np.float32)          # each job writes its heads' (or -inf)
    for job in prange(B * H * n_split):
        _cpu_decode_job(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, rows, G, scale, n_split, o_part, lse_part, job)
    out = np.empty((B, Hq, d), dtype=np.float32)
    for bj in range(B * Hq):              # out = sum_i e^(lse_i - M) o_i / sum_i e^(lse_i - M)
        b, j, M, tot = bj // Hq, bj % Hq, np.float32(-np.inf), np.float32(0.0)
        for sp in range(n_split):
            M = max(M, lse_part[b, j, sp])
        for ch in range(d):
            out[b, j, ch] = 0.0
        for sp in range(n_split):
            if lse_part[b, j, sp] > -np.inf:
                wgt = np.exp(lse_part[b, j, sp] - M)
                tot += wgt
                for ch in range(d):
                    out[b, j, ch] += wgt * o_part[b, j, sp, ch]
        for ch in range(d):
            out[b, j, ch] /= tot
    return out


def _cpu_select(a, n, k):
    """The k-th smallest of a[:n] (from 0): the largest a[i] with at most k entries below it (no branch on the
    data: a sort or a quickselect mispredicts; n^2 compares, vectorised)."""
    out = np.float32(-np.inf)                                       # a: fp32
    for i in range(n):
        below = 0
        for j in range(n):
            below += a[j] < a[i]
        if below <= k:
            out = max(out, a[i])
    return out


def _cpu_q2_row(x, rank, G, eps, codes, scale, zero, page, h, slot, work):
    """Q2 of one row x (d,) fp32 into codes, scale, zero[page, h, slot], bit for bit as q2_quantize.
    work: (d + G,) fp32 scratch (the codes, then a group's |x|)."""
    f32, d, D4 = np.float32, x.shape[0], x.shape[0] // 4
    code, a = work[:d], work[d:]
    for g in range(d // G):
        xg = x[g * G:(g + 1) * G]
        for k in range(G):
            a[k] = abs(xg[k])
        tau = _cpu_select(a, G, rank)                              # |x| at rank floor(c G)
        mn, mx = f32(np.inf), f32(-np.inf)
        for k in range(G):
            y = max(min(xg[k], tau), -tau)
            mn, mx = min(mn, y), max(mx, y)
        s = max(mx - mn, eps) / f32(3.0)                            # range floored, then divided
        z = -mn / s
        for k in range(G):
            y = max(min(xg[k], tau), -tau)
            code[g * G + k] = min(max(np.floor(y / s + z + f32(0.5)), f32(0.0)), f32(3.0))
        scale[page, h, slot, g], zero[page, h, slot, g] = s, z
    for j in range(D4):
        c0, c1 = np.uint8(code[j]), np.uint8(code[D4 + j])
        c2, c3 = np.uint8(code[2 * D4 + j]), np.uint8(code[3 * D4 + j])
        codes[page, h, slot, j] = c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)


def _cpu_q2_store(rows, rank, G, eps, codes, scale, zero, page, slot):
    """_cpu_q2_row of rows (N, H, d) fp32 at [page[i], :, slot[i]], in parallel (a scratch per chunk of rows)."""
    N, H, d = rows.shape
    n = min(N * H, 64)
    for c in prange(n):
        work = np.empty(d + G, dtype=np.float32)
        for ih in range(c, N * H, n):
            i, h = ih // H, ih % H
            _cpu_q2_row(rows[i, h], rank, G, eps, codes, scale, zero, page[i], h, slot[i], work)


def _cpu_rotate(x, R, rep, out):
    """out[b, j] = x[b, j] R[j // rep] (R (H, d, d) fp32 or float64), each entry summed in float64 in channel
    order and rounded once to fp32: optr.rotate_rows' product (a loop over the output's lanes vectorises)."""
    B, n, d = x.shape
    acc = np.empty(d, dtype=np.float64)
    for bj in range(B * n):
        b, j, acc[:] = bj // n, bj % n, 0.0
        for ch in range(d):
            for e in range(d):
                acc[e] += np.float64(x[b, j, ch]) * R[j // rep, ch, e]
        for e in range(d):
            out[b, j, e] = np.float32(acc[e])


def _cpu_step(q, k, v, mu, rk, rv, rvt, kc, ks, kz, vc, vs, vz, bt, wk, wv, seqs, plan, rank_k, rank_v, G, eps,
              scale, threads, out):
    """A layer's decode step as optr.Step.plan says, a token per sequence b (cache row seqs[b]): stores
    (k - mu) R_K, v R_V (float64, rounded once); if plan[1, b] >= 0, Q2 of the token leaving the window
    (slot plan[0, b]; -1: the new one) into page plan[1, b], slot plan[2, b]; the new token into window slot
    plan[0, b]. out = (q R_K over plan[3, b] INT2 tokens, plan[4, b] window slots) R_V^T (rvt), the context
    split for `threads` (_cpu_splits)."""
    B, H, d = k.shape
    kr, vr, qr = np.empty_like(k), np.empty_like(v), np.empty_like(q)
    _cpu_rotate(k - mu, rk, 1, kr)                                   # keys centred (step 1), then R_K
    _cpu_rotate(v, rv, 1, vr)
    _cpu_rotate(q, rk, q.shape[1] // H, qr)
    work = np.empty(d + G, dtype=np.float32)
    for b in range(B):
        s, slot, page, ps = seqs[b], plan[0, b], plan[1, b], plan[2, b]
        for h in range(H):
            if page >= 0:                                         # a token goes INT2: the ring's oldest
                k_old, v_old = (wk[s, h, slot], wv[s, h, slot]) if slot >= 0 else (kr[b, h], vr[b, h])
                _cpu_q2_row(k_old, rank_k, G, eps, kc, ks, kz, page, h, ps, work)
                _cpu_q2_row(v_old, rank_v, G, eps, vc, vs, vz, page, h, ps, work)
            if slot >= 0:
                wk[s, h, slot], wv[s, h, slot] = kr[b, h], vr[b, h]
    nq, wl = plan[3].astype(np.int32), plan[4].astype(np.int32)
    n_split = _cpu_splits(B, H, (plan[3] + plan[4]).max(), threads)
    o = _cpu_decode(qr, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, seqs, G, scale, n_split)
    _cpu_rotate(o, rvt, q.shape[1] // H, out)                        # back to the model's basis


_FASTMATH = {"reassoc", "contract", "nsz"}   # reorder sums (vectorise); keep inf and NaN semantics


@functools.lru_cache(maxsize=None)
def _nb() -> types.SimpleNamespace:
    """The compiled CPU kernels by name (decode, store, step; exp_rows for its test), jitted at the first
    call, then cached on disk.  Each is compiled from a copy of its function whose globals are a copy of
    the module's with the names it calls (_cpu_exp_rows, prange, ...) compiled, and _simd's vector code."""
    import numba
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]   # omp: 90 ms/token at 4k,
    scope = dict(globals(), prange=numba.prange, **_simd(numba))         # workqueue 242 (SmolLM2)

    def jit(fn, **options):
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
        copy.__qualname__ = fn.__qualname__
        scope[fn.__name__] = numba.njit(cache=True, **options)(copy)
        return scope[fn.__name__]
    jit(_cpu_decode_job, fastmath=_FASTMATH), jit(_cpu_q2_row), jit(_cpu_rotate), jit(_cpu_splits)   # called
    jit(_cpu_exp_rows, inline="always", fastmath=_FASTMATH), jit(_cpu_fetch, inline="always"), jit(_cpu_select)
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    return types.SimpleNamespace(decode=jit(_cpu_decode, parallel=True, error_model="numpy"), step=jit(_cpu_step),
                                 store=jit(_cpu_q2_store, parallel=True), exp_rows=scope["_cpu_exp_rows"])


def _cpu_splits(B, H_kv, longest, threads):
    """Splits per (sequence, KV head): about two jobs per thread, at least 256 tokens each."""
    return max(1, min(-(-2 * threads // (B * H_kv)), longest // 256))


def int2_paged_decode_cpu(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant, win_k,
                          win_v, win_len, group_size, num_splits=None, sm_scale=None, checked=True) -> torch.Tensor:
    """int2_paged_decode on the CPU (numba): same arguments and result.  checked=False checks
    nothing (malformed inputs are undefined behaviour)."""
    if checked:
        sizes = _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                              n_quant, win_k, win_v, win_len, group_size, num_splits, sm_scale)
        if q.device.type != "cpu":
            fail("q", "a CPU tensor (int2_paged_decode runs on CUDA)", q.device)
        _check_values(k_codes, block_table, n_quant, win_len, sizes)
    B, H_kv, d = q.shape[0], k_codes.shape[1], q.shape[2]
    nq, wl = n_quant.numpy(), win_len.numpy()
    num_splits = num_splits or _cpu_splits(B, H_kv, int(nq.max()) + int(wl.max()), torch.get_num_threads())
    fp32 = lambda x: x.detach().float().numpy()   # bf16 q and windows: numba has no bf16
    return torch.from_numpy(_nb().decode(
        fp32(q), *(x.numpy() for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table)), nq,
        fp32(win_k), fp32(win_v), wl, np.arange(B), group_size,
        np.float32(1.0 / math.sqrt(d) if sm_scale is None else sm_scale), num_splits))


def cpu_decode_step(q, k, v, rotations: tuple, pages: tuple, seqs, plan, sizes: tuple, sm_scale, out):
    """_cpu_step, unchecked (optr's cache vouches), on numpy arrays: q (B, H_q, d), k, v (B, H_kv, d), out
    fp32 contiguous, the model's basis; `rotations` mu (H_kv, d) fp32, R_K, R_V, R_V^T (H_kv, d, d) fp32 or
    float64 (identities where none); `pages` a layer's k_codes .. v_zero, block_table, win_k, win_v; `sizes`
    rank_k, rank_v, group_size, eps (np.float32); sm_scale np.float32."""
    _nb().step(q, k, v, *rotations, *pages, seqs, plan, *sizes, sm_scale, torch.get_num_threads(), out)


def paged_decode(q, **view) -> torch.Tensor:
    """int2_paged_decode on CUDA, int2_paged_decode_cpu otherwise (the serving code's call)."""
    return (int2_paged_decode if q.is_cuda else int2_paged_decode_cpu)(q, **view)


def q2_store(rows, rank, group_size, eps, codes, scale, zero, page, slot):
    """Write Q2's storage form of rows (N, H, d) fp32 (CPU) into codes[page[i], :, slot[i]] and
    its scale and zero, as optr.q2_quantize computes them, bit for bit (compiled by numba); rank:
    the clip's, optr.clip_rank(clip, group_size)."""
    need(rows.dim() == 3 and page.shape == slot.shape == rows.shape[:1], "q2_store: a page and slot per row")
    need(rows.dtype == torch.float32 and rows.is_contiguous() and codes.is_contiguous(), "q2_store: fp32 rows")
    need(isinstance(rank, int) and 0 <= rank < group_size, f"q2_store: rank in [0, {group_size}), got {rank}")
    _nb().store(rows.detach().numpy(), rank, group_size, np.float32(eps), codes.numpy(), scale.numpy(),
                zero.numpy(), page.numpy(), slot.numpy())
