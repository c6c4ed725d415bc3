"""Fused decode attention over an INT2 paged KV cache: Triton on CUDA, numba on a CPU.

OptR keeps the ordinary paged KV-cache format: keys and values are stored as
2-bit codes in fixed-size pages that a block table maps to sequences, with one
fp32 scale and zero per group of `G` dims.  This file holds the decode kernel
that reads that format directly, so no dequantized copy of the cache is made.

Layout (per layer; H_kv KV heads, head dim d, page size P)
    k_codes, v_codes    uint8 (num_pages, H_kv, P, d // 4)
                        byte j of a row holds dims j, j + d/4, j + d/2, j + 3d/4
                        in bits 0-1, 2-3, 4-5, 6-7
    k/v_scale, k/v_zero fp32  (num_pages, H_kv, P, d // G)
                        x_i = (code_i - zero[i // G]) * scale[i // G]
    block_table         int32 (B, max_blocks): INT2 token n of sequence b lives
                        in page block_table[b, n // P], slot n % P
    n_quant             int32 (B,): INT2 tokens per sequence (ragged, may be 0)
    win_k, win_v        fp32/bf16 (B, H_kv, NW, d): full-precision sink + recent
                        tokens, valid slots [0, win_len[b])
    q                   fp32/bf16 (B, H_q, d), already rotated; query head j
                        reads KV head j // (H_q // H_kv)
    output              fp32 (B, H_q, d), still in the rotated value basis

Design: flash-decoding ("split-K"), laid out for memory bandwidth
    Stage 1, grid (B, H_kv, num_splits).  A program owns one KV head and all its
    query heads (GQA), so every page is read once per KV head.  The INT2 tokens
    are cut into BLOCK_N-token tiles, independent of the page size; a split owns
    a contiguous range of tiles and fetches the next tile's block-table entries
    one iteration ahead.  Per tile it loads the packed rows of K and of V once,
    as 32-bit words, and never reorders them: bit field c of byte j is dim
    c*d/4 + j, so the query is split into four quarter-rows instead and each
    quarter meets its bit field directly (q.k = sum over quarters).
    Codes become fp16 by a bit trick, two per mask-and-OR and no
    int-to-float instruction: a word masked with 0x00030003 << 2c, OR 0x64006400,
    holds two fp16 1024 + c * 4^c; minus 1024 leaves c * 4^c exactly, and 4^-c
    goes into the other operand.  A tile is cut into sub-tiles of 16 tokens (one
    per warp at the default sizes), each with its own softmax state, merged
    once after the loop, so no reduction in the loop crosses warps.
    Scale and zero stay out of the tile when a quarter lies in one group
    (G a multiple of d/4, d >= 64; the production case d = G = 128):
        q.k = s * (q.c - z * sum(q))              (per group, per token)
        p.v = (p s).c - sum(p s z)
    The dots take exact fp16 codes; the other operand (the query, or p s) is
    scaled into [-2^14, 2^14] and split into two fp16 parts hi + lo, which
    carry ~22 bits, with fp32 accumulation: near fp32 accuracy.  The tokens
    fill the MMA's 16 rows and the hi and lo parts of every head sit side by
    side on its 8 columns, so one dot computes both; with one group per row
    the four quarter dots chain into one accumulator.
    Other group sizes (and d < 64) take a general path in the
    same loop: the quarter is dequantized in fp32 with per-dim scale and zero.
    The full-precision window tokens are spread over the splits (window tile t
    goes to split t % num_splits) and use fp32 dots (3xTF32 on sm80+).
    Each program writes its normalized partial output and the log-sum-exp of
    its logits (base 2); a program with no tokens writes lse = -inf.

    Stage 2, grid (B, H_q), merges the NUM_SPLITS partials of a query head, a
    (BLOCK_SPLITS, d) block at a time; over the splits i,
        out = sum_i 2^(lse_i - M) * o_i / sum_i 2^(lse_i - M),  M = max_i lse_i
    Splits with lse = -inf get weight 0 (their partial output is 0, not NaN).

Entry points
    paged_decode(q, **view): the device's kernel, what optr's serving calls (Triton's
    int2_paged_decode for CUDA tensors, int2_paged_decode_cpu otherwise); q2_store: the
    cache's INT2 write on a CPU.  The CPU kernels (numba, compiled at the first call and
    cached on disk) follow the Triton launcher; numba is imported only then.

Reading order
    The kernels first: _int2_decode_split_kernel (set-up, the loop over INT2 tiles,
    the window tokens, the partial result) after the helpers it calls, the per-tile
    body _int2_tile among them; then _merge_splits_kernel.  Then the launcher
    (int2_paged_decode), --bench and --gpu-check, and two appendices: the static SASS
    analysis (--sass) and the interpreter set-up.  Shape letters in the kernels: S
    sub-tiles per tile (SUB_TILES), T tokens per sub-tile, W = d/4 dims per quarter-row;
    the splits are NUM_SPLITS (num_splits) programs per (sequence, KV head).

Launch paths
    int2_paged_decode(..., checked=True) also checks lengths and block-table
    entries on the host (a device sync); checked=False checks only shapes,
    dtypes and devices and never syncs, so the launch can be captured in a CUDA
    graph (a whole optr.decode_step cannot: its cache append checks values and
    takes pages on the host).
    Block sizes, warps and stages are chosen in _block_sizes; no autotuning.
    The interpreter computes fp16 dots correctly (unlike bf16 ones), so the CPU
    tests run the same algorithm as the GPU.
"""
import os

import torch

if not torch.cuda.is_available():
    # No GPU: run the kernels with Triton's CPU interpreter.  Triton reads this
    # when a function is decorated with @triton.jit, so it must be set before
    # triton is first imported (its own tl.* helpers are decorated then too).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import functools
import math
import sys

import numpy as np
import triton
import triton.language as tl

from optr import paged_decode_reference  # the pure-torch decode this kernel must match

_INTERPRETED = bool(triton.knobs.runtime.interpret)  # what @triton.jit below will use
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 1024


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _codes_fp16(words,              # (S, T, W // 4) uint32: bytes 4i .. 4i+3 of each code row
                SHIFT: tl.constexpr,  # 2 * quarter: the bit field to extract
                S: tl.constexpr, T: tl.constexpr, W: tl.constexpr):
    """(S, T, W) fp16 in the order of _quarter_dims: the 2-bit code at SHIFT of every
    byte times 4^quarter = 2^SHIFT (exact: 0, 1, 2, 3 times 1, 4, 16 or 64).  No
    int-to-float instruction; one mask and one OR (two LOP3) make two codes.

    0x6400 is 1024.0 in fp16 and its 10 mantissa bits count units, so the bit pattern
    0x6400 | m is 1024 + m for m < 1024.  Masking a word with 0x00030003 << SHIFT leaves
    the fields of bytes 0 and 2 in place, as m = c * 2^SHIFT in the two 16-bit halves
    (the word shifted right by 8 does the same for bytes 1 and 3); OR-ing 0x64006400 makes
    both halves fp16 1024 + m at once.  The halves, taken as fp16, minus 1024 (exact, two
    per HADD2) leave c * 2^SHIFT; the caller folds the power of two into the other
    operand."""
    mask: tl.constexpr = 0x00030003 << SHIFT
    even = (words & mask) | 0x64006400                 # bytes 0 and 2
    odd = ((words >> 8) & mask) | 0x64006400           # bytes 1 and 3
    b0 = (even & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    b1 = (odd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    b2 = (even >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    b3 = (odd >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    # Joined as (b0, b2, b1, b3): each half-word pair stays in its register, as the MMA
    # operand wants it; the kernel keeps every quarter's dims in this order (_quarter_dims).
    bits = tl.reshape(tl.join(tl.join(b0, b1), tl.join(b2, b3)), (S, T, W))
    return bits - 1024.0


@triton.jit
def _quarter_dims(W: tl.constexpr):
    """(W,) int32: the dim (within its quarter) at each position of _codes_fp16's output:
    positions 4i .. 4i+3 hold dims 4i, 4i+2, 4i+1, 4i+3 (bits 0 and 1 swapped)."""
    pos = tl.arange(0, W)
    return (pos & ~3) | ((pos & 1) << 1) | ((pos >> 1) & 1)


@triton.jit
def _split_fp16(x):
    """x (fp32, |x| <= 2^14) = hi + lo + r with hi, lo fp16 and |r| <= 2^-22 |x| (+2^-25)."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def _hi_lo_columns(x,               # (S, R, BLOCK_H) fp32, |x| <= 2^14
                   S: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr):
    """The fp16 split of x as one (S, R, 2 * BLOCK_H) dot operand: column 2h holds hi of
    head h, column 2h + 1 its lo.  One dot against it computes both parts of every head,
    and the heads fill the 8-wide side of the MMA instead of padding its 16-row side."""
    hi, lo = _split_fp16(x)
    return tl.reshape(tl.join(hi, lo), (S, R, 2 * BLOCK_H))


@triton.jit
def _query_columns(q,               # (BLOCK_H, W) fp32 scaled query quarter
                   SHIFT: tl.constexpr,  # 2 * quarter: the quarter meets codes times 2^SHIFT
                   S: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr):
    """(S, W, 2 * BLOCK_H) fp16: q * 2^-SHIFT (exact) transposed, as hi / lo columns, for
    every sub-tile."""
    unit: tl.constexpr = 1.0 / (1 << SHIFT)
    q_t = tl.broadcast_to(tl.trans(q * unit)[None, :, :], (S, W, BLOCK_H))
    return _hi_lo_columns(q_t, S, W, BLOCK_H)


@triton.jit
def _add_hi_lo(t,                   # (S, R, 2 * BLOCK_H) fp32 dot against _hi_lo_columns
               S: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr):
    """(S, R, BLOCK_H): the hi and lo columns of each head added (in fp32)."""
    hi, lo = tl.split(tl.reshape(t, (S, R, BLOCK_H, 2)))
    return hi + lo


@triton.jit
def _quarter_dot(packed,            # (S, T, W // 4) uint32 code words of the tile
                 q_cols,            # (S, W, 2 * BLOCK_H) fp16 query quarter, hi / lo columns
                 acc,               # (S, T, 2 * BLOCK_H) fp32 accumulator
                 SHIFT: tl.constexpr,  # 2 * quarter: the bit field of this quarter
                 S: tl.constexpr, T: tl.constexpr, W: tl.constexpr):
    """acc + codes @ q_cols in every sub-tile: the exact fp16 codes of one quarter against
    both fp16 parts of the query quarter of every head (fp32 accumulation)."""
    return tl.dot(_codes_fp16(packed, SHIFT, S, T, W), q_cols, acc, out_dtype=tl.float32)


@triton.jit
def _quarter_logits(q,              # (BLOCK_H, W) fp32 query quarter
                    packed,         # (S, T, W // 4) uint32 code words of the tile
                    scale, zero,    # (S, T, W) fp32 per-dim group scale and zero
                    SHIFT: tl.constexpr, S: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                    BLOCK_H: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """General path: the contribution of one quarter-row (dims c*d/4 .. c*d/4 + W - 1) to
    q.k, (S, T, BLOCK_H), with the quarter dequantized in fp32."""
    unit: tl.constexpr = 1.0 / (1 << SHIFT)          # _codes_fp16 gives c * 2^SHIFT
    k = (_codes_fp16(packed, SHIFT, S, T, W).to(tl.float32) * unit - zero) * scale
    if USE_DOT:
        q_t = tl.broadcast_to(tl.trans(q)[None, :, :], (S, W, BLOCK_H))
        return tl.dot(k, q_t, input_precision=DOT_PRECISION)
    else:
        return tl.sum(k[:, :, None, :] * q[None, None, :, :], axis=3)


@triton.jit
def _quarter_pv(acc,                # (S, W, BLOCK_H) fp32 running output of this quarter
                alpha,              # (S, BLOCK_H) rescale of the running output
                p,                  # (S, T, BLOCK_H) fp32 softmax numerators
                packed,             # (S, T, W // 4) uint32 code words of the tile
                scale, zero,        # factored: (S, T) group params; general: (S, T, W)
                SHIFT: tl.constexpr, S: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                BLOCK_H: tl.constexpr, FACTORED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc * alpha + (p^T v_quarter)^T in every sub-tile.  Factored: p^T ((c - z) s) =
    c^T (p s) - sum(p s z), with p s scaled into [0, 2^14] (by the sub-tile's largest
    scale) and split into hi / lo columns, one dot for both."""
    codes = _codes_fp16(packed, SHIFT, S, T, W)          # c * 2^SHIFT
    unit: tl.constexpr = 1.0 / (1 << SHIFT)
    if FACTORED:
        s_max = tl.max(scale, axis=1)
        s_max = tl.where(s_max > 0, s_max, 1.0)                         # (S,)
        ps = p * (scale * (16384.0 / s_max[:, None]))[:, :, None]        # in [0, 2^14]
        pc = tl.dot(tl.permute(codes, (0, 2, 1)), _hi_lo_columns(ps, S, T, BLOCK_H),
                    out_dtype=tl.float32)
        pc = _add_hi_lo(pc, S, W, BLOCK_H)                               # (S, W, BLOCK_H)
        psz = tl.sum(p * (scale * zero)[:, :, None], axis=1)             # sum of p s z
        pv = pc * (s_max * (unit / 16384.0))[:, None, None] - psz[:, None, :]
        return acc * alpha[:, None, :] + pv                              # two FFMA each
    else:
        v = (codes.to(tl.float32) * unit - zero) * scale
        return acc * alpha[:, None, :] + tl.dot(tl.permute(v, (0, 2, 1)), p,
                                                input_precision=DOT_PRECISION)


@triton.jit
def _softmax_update(logits,         # fp32 logits in base-2 units, -inf if masked: (S, N,
                                    # BLOCK_H) if SUB_TILED, else (BLOCK_H, N)
                    m_i, l_i,       # running max and sum of 2^(logit - m_i): (S, BLOCK_H)
                                    # if SUB_TILED, else (BLOCK_H,)
                    SUB_TILED: tl.constexpr):
    """Online softmax over the tokens (axis 1): returns (m_new, alpha, p, l_new); alpha
    rescales the old state.  SUB_TILED: one state per sub-tile (the INT2 loop)."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    # -inf only while no real token has been seen; shift by 0 then (not -inf - -inf).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)                 # 0 on the first real tile (m_i = -inf)
    if SUB_TILED:
        p = tl.exp2(logits - m_ref[:, None, :])  # 0 for masked tokens
    else:
        p = tl.exp2(logits - m_ref[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _load_query(q_rows,             # (BLOCK_H, W) pointers to quarter 0 of each head's query
                head_mask,          # (BLOCK_H,) query heads that exist
                qk_scale,           # sm_scale * log2(e)
                S: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr,
                FACTORED: tl.constexpr):
    """The query as the INT2 loop takes it: (q, q_cols, q_sum, row_scale), tuples over the
    quarters.  Factored: each head scaled into [-2^14, 2^14] (row_scale undoes it), and the
    dot operands, hi and lo of every head side by side (_query_columns), quarter c times
    4^-c, as it meets codes times 4^c (_codes_fp16); the sums serve the zeros."""
    q = [tl.load(q_rows + c * W, mask=head_mask[:, None], other=0.0).to(tl.float32)
         for c in (0, 1, 2, 3)]
    if FACTORED:
        row_max = [tl.max(tl.abs(x), axis=1) for x in q]               # (BLOCK_H,) each
        q_max = tl.maximum(tl.maximum(row_max[0], row_max[1]),
                           tl.maximum(row_max[2], row_max[3]))
        q_mul = 16384.0 / tl.where(q_max > 0, q_max, 1.0)
        q = [x * q_mul[:, None] for x in q]
        row_scale = qk_scale / q_mul
    else:
        row_scale = tl.full([BLOCK_H], 1.0, tl.float32) * qk_scale
    q_cols = [_query_columns(q[c], 2 * c, S, W, BLOCK_H) for c in (0, 1, 2, 3)]
    q_sum = [tl.sum(x, axis=1)[None, None, :] for x in q]
    return q, q_cols, q_sum, row_scale


@triton.jit
def _tile_blocks(tile,              # int32 tile index (BLOCK_N tokens each)
                 offs_n,            # (S, T) int32 token of the tile, 0 .. BLOCK_N - 1
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(block, slot) of every token of a tile: its logical block (block-table column) and
    its slot in that page.  A scalar block when a tile lies in one page; when a tile
    holds whole pages the slots are the same for every tile (and leave the loop)."""
    if PAGE_SIZE % BLOCK_N == 0:
        return (tile * BLOCK_N) // PAGE_SIZE, (tile * BLOCK_N) % PAGE_SIZE + offs_n
    elif BLOCK_N % PAGE_SIZE == 0:
        return tile * (BLOCK_N // PAGE_SIZE) + offs_n // PAGE_SIZE, offs_n % PAGE_SIZE
    else:
        tok = tile * BLOCK_N + offs_n
        return tok // PAGE_SIZE, tok % PAGE_SIZE


@triton.jit
def _quarter_params(scale_ptr, zero_ptr,  # fp32 (num_pages, H_kv, P, d // G) scales, zeros
                    rows,           # (S, T) int64 element offset of each token's row
                    valid,          # (S, T) tokens that exist
                    offs_w,         # (W,) dims of a quarter, in the order of the codes
                    C: tl.constexpr,  # the quarter, 0 .. 3
                    W: tl.constexpr, GROUP_SIZE: tl.constexpr, FACTORED: tl.constexpr):
    """(scale, zero) of quarter C of every token: (S, T) each when the quarter lies in one
    group (FACTORED), else (S, T, W), the group of every dim.  0 for missing tokens."""
    if FACTORED:
        group: tl.constexpr = C * W // GROUP_SIZE
        return (tl.load(scale_ptr + rows + group, mask=valid, other=0.0),
                tl.load(zero_ptr + rows + group, mask=valid, other=0.0))
    else:
        cols = rows[:, :, None] + ((C * W + offs_w) // GROUP_SIZE)[None, None, :]
        return (tl.load(scale_ptr + cols, mask=valid[:, :, None], other=0.0),
                tl.load(zero_ptr + cols, mask=valid[:, :, None], other=0.0))


@triton.jit
def _tile_params(scale_ptr, zero_ptr, rows, valid, offs_w,   # as _quarter_params
                 W: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                 FACTORED: tl.constexpr):
    """The four quarters' (scale, zero), a tuple indexed by quarter (one load per group
    when a row is one group: every quarter shares it)."""
    if FACTORED and NUM_GROUPS == 1:
        params = _quarter_params(scale_ptr, zero_ptr, rows, valid, offs_w, 0, W, GROUP_SIZE,
                                 FACTORED)
        return params, params, params, params
    else:
        return [_quarter_params(scale_ptr, zero_ptr, rows, valid, offs_w, c, W, GROUP_SIZE,
                                FACTORED) for c in (0, 1, 2, 3)]


@triton.jit
def _tile_logits(q,                 # tuple of 4 (BLOCK_H, W) fp32 scaled query quarters
                 q_cols,            # tuple of 4 (S, W, 2 * BLOCK_H) fp16 hi / lo columns
                 q_sum,             # tuple of 4 (1, 1, BLOCK_H) fp32 sums of the quarters
                 packed,            # (S, T, W // 4) uint32 key code words of the tile
                 params,            # tuple of 4 (scale, zero), as _tile_params
                 S: tl.constexpr, T: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr,
                 NUM_GROUPS: tl.constexpr, FACTORED: tl.constexpr, USE_DOT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """(S, T, BLOCK_H) logits of the tile, before row_scale: the sum over the quarters of
    q.k.  Factored: s * (q.c - z * sum(q)) with the codes' tokens on the MMA's 16-row side
    and the heads' hi / lo columns on its 8-column side."""
    if FACTORED:
        no_acc = tl.zeros([S, T, 2 * BLOCK_H], dtype=tl.float32)
        if NUM_GROUPS == 1:
            # One group: the four quarter dots chain into one accumulator.
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
                t = _add_hi_lo(_quarter_dot(packed, q_cols[c], no_acc, 2 * c, S, T, W),
                               S, T, BLOCK_H)
                logits += scale[:, :, None] * (t - zero[:, :, None] * q_sum[c])
            return logits
    else:
        logits = tl.zeros([S, T, BLOCK_H], dtype=tl.float32)
        for c in tl.static_range(4):
            scale, zero = params[c]
            logits += _quarter_logits(q[c], packed, scale, zero, 2 * c, S, T, W, BLOCK_H,
                                      USE_DOT, DOT_PRECISION)
        return logits


@triton.jit
def _int2_tile(acc,                 # tuple of 4 (S, W, BLOCK_H) fp32 running outputs
               m_i, l_i,            # (S, BLOCK_H) softmax state of each sub-tile
               q, q_cols, q_sum,    # the query, as _tile_logits takes it
               row_scale,           # (BLOCK_H,) fp32 factor from q.k to base-2 logits
               k_words_ptr, v_words_ptr,   # uint32 views of k_codes, v_codes
               k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr,   # fp32 group params
               code_rows,           # (S, T) int64 offset of each token's code row, in words
               param_rows,          # (S, T) int64 element offset of its scale / zero row
               valid,               # (S, T) tokens that exist (the rest read nothing)
               offs_w,              # (W,) dims of a quarter, in the order of the codes
               S: tl.constexpr, T: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr,
               GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, FACTORED: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of S x T INT2 tokens: load its codes (one load of the packed rows of K
    and of V, as 32-bit words; the quarters are the bit fields of their bytes) and its
    scales and zeros, compute the logits, update the online softmax of every sub-tile
    and add P.V to each quarter's output.  Returns (acc, m_i, l_i)."""
    words = code_rows[:, :, None] + tl.arange(0, W // 4)[None, None, :]
    k_packed = tl.load(k_words_ptr + words, mask=valid[:, :, None], other=0)
    v_packed = tl.load(v_words_ptr + words, mask=valid[:, :, None], other=0)
    k_params = _tile_params(k_scale_ptr, k_zero_ptr, param_rows, valid, offs_w, W,
                            GROUP_SIZE, NUM_GROUPS, FACTORED)
    v_params = _tile_params(v_scale_ptr, v_zero_ptr, param_rows, valid, offs_w, W,
                            GROUP_SIZE, NUM_GROUPS, FACTORED)
    logits = _tile_logits(q, q_cols, q_sum, k_packed, k_params, S, T, W, BLOCK_H,
                          NUM_GROUPS, FACTORED, USE_DOT, DOT_PRECISION)
    logits = tl.where(valid[:, :, None], logits * row_scale[None, None, :], float("-inf"))
    m_i, alpha, p, l_i = _softmax_update(logits, m_i, l_i, True)
    acc = [_quarter_pv(acc[c], alpha, p, v_packed, v_params[c][0], v_params[c][1], 2 * c,
                       S, T, W, BLOCK_H, FACTORED, DOT_PRECISION) for c in (0, 1, 2, 3)]
    return acc, m_i, l_i


@triton.jit
def _merge_sub_tiles(m_i, l_i,      # (S, BLOCK_H) softmax state of each sub-tile
                     acc):          # tuple of 4 (S, W, BLOCK_H) running outputs
    """One softmax state from S: every sub-tile's state rescaled to the largest max and
    summed; returns m, l (BLOCK_H,) and acc as 4 (BLOCK_H, W)."""
    m = tl.max(m_i, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_i - m_ref[None, :])            # 0 for sub-tiles that saw no token
    l = tl.sum(l_i * w, axis=0)
    return m, l, [tl.trans(tl.sum(a * w[:, None, :], axis=0)) for a in acc]


@triton.jit
def _window_tile(acc,               # tuple of 4 (BLOCK_H, W) fp32 running outputs
                 m_i, l_i,          # (BLOCK_H,) softmax state
                 q_full,            # (BLOCK_H, d) fp32 query, dims in natural order
                 win_k_ptr, win_v_ptr,  # fp32/bf16 (B, H_kv, NW, d) window keys, values
                 rows,              # (BLOCK_W, 1) element offset of each window token's row
                 valid,             # (BLOCK_W,) window slots that hold a token
                 offs_w,            # (W,) dims of a quarter, in the order of the codes
                 qk_scale,          # sm_scale * log2(e)
                 HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of full-precision window tokens, fp32 dots (3xTF32 on sm80+); the output
    is kept per quarter in the order of the INT2 tokens'.  Returns (acc, m_i, l_i)."""
    W: tl.constexpr = HEAD_DIM // 4
    k = tl.load(win_k_ptr + rows + tl.arange(0, HEAD_DIM)[None, :], mask=valid[:, None],
                other=0.0).to(tl.float32)
    logits = tl.dot(q_full, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_i, alpha, p, l_i = _softmax_update(logits, m_i, l_i, False)
    v = [tl.load(win_v_ptr + rows + (c * W + offs_w[None, :]), mask=valid[:, None],
                 other=0.0).to(tl.float32) for c in (0, 1, 2, 3)]
    acc = [acc[c] * alpha[:, None] + tl.dot(p, v[c], input_precision=DOT_PRECISION)
           for c in (0, 1, 2, 3)]
    return acc, m_i, l_i


@triton.jit
def _int2_decode_split_kernel(
        q_ptr,                 # (B, H_q, d) fp32/bf16 rotated queries
        k_codes_ptr,           # (num_pages, H_kv, P, d/4) uint8 packed key codes
        k_scale_ptr,           # (num_pages, H_kv, P, d/G) fp32 key scales
        k_zero_ptr,            # (num_pages, H_kv, P, d/G) fp32 key zeros
        v_codes_ptr,           # same layouts for the values
        v_scale_ptr,
        v_zero_ptr,
        block_table_ptr,       # (B, max_blocks) int32 logical block -> page
        n_quant_ptr,           # (B,) int32 INT2 tokens per sequence
        win_k_ptr,             # (B, H_kv, NW, d) fp32/bf16 window keys
        win_v_ptr,             # (B, H_kv, NW, d) fp32/bf16 window values
        win_len_ptr,           # (B,) int32 valid window slots per sequence
        part_out_ptr,          # (B, H_q, NUM_SPLITS, d) fp32 out: normalized partial outputs
        part_lse_ptr,          # (B, H_q, NUM_SPLITS) fp32 out: partial log2-sum-exp2 of logits
        qk_scale,              # sm_scale * log2(e): logits are kept in base-2 units
        num_splits,            # NUM_SPLITS, programs per (sequence, KV head)
        stride_qb, stride_qh,                  # q strides (batch, head); dim stride is 1
        stride_cp, stride_ch, stride_cn,       # code strides (page, head, slot)
        stride_sp, stride_sh, stride_sn,       # scale / zero strides (page, head, slot)
        stride_btb,                            # block-table row stride
        stride_wb, stride_wh, stride_wn,       # window strides (batch, head, slot)
        stride_ob, stride_oh, stride_os,       # partial-output strides (batch, head, split)
        stride_lb, stride_lh,                  # partial-lse strides (batch, head)
        HEAD_DIM: tl.constexpr,       # d, a power of two
        GROUP_SIZE: tl.constexpr,     # G, dims per scale / zero
        NUM_GROUPS: tl.constexpr,     # d // G
        PAGE_SIZE: tl.constexpr,      # P, tokens per page
        QUERIES_PER_KV: tl.constexpr,  # H_q // H_kv
        BLOCK_H: tl.constexpr,        # query-head tile, power of two >= QUERIES_PER_KV
        BLOCK_N: tl.constexpr,        # INT2 tokens per tile (any page size), power of two >= 16
        SUB_TILES: tl.constexpr,      # token sub-tiles per tile, each with its own softmax state
        BLOCK_W: tl.constexpr,        # window tokens per tile, power of two >= 16
        FACTORED: tl.constexpr,       # scale / zero outside fp16 dots (G % (d/4) == 0, d >= 64)
        DOT_PRECISION: tl.constexpr,  # tl.dot input precision for fp32 operands
):
    pid_b, pid_kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch = pid_b.to(tl.int64)
    W: tl.constexpr = HEAD_DIM // 4         # dims per quarter-row
    S: tl.constexpr = SUB_TILES             # sub-tiles per tile (the helpers' S)
    T: tl.constexpr = BLOCK_N // SUB_TILES  # tokens per sub-tile (>= 16 for the P.V dot)

    # All query heads that share this KV head, as four quarter-rows: quarter c holds dims
    # c*W .. c*W + W-1, the dims stored in bit field c of the code bytes, in the order
    # _codes_fp16 unpacks them (offs_w).  The query, the scales and zeros, the window
    # values and the output all use that order, so the codes are never reordered.
    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < QUERIES_PER_KV
    q_heads = pid_kv * QUERIES_PER_KV + offs_h
    offs_w = _quarter_dims(W)
    q_rows = q_ptr + batch * stride_qb + q_heads[:, None] * stride_qh
    q, q_cols, q_sum, row_scale = _load_query(q_rows + offs_w[None, :], head_mask, qk_scale,
                                              S, W, BLOCK_H, FACTORED)

    # Softmax state and outputs of each sub-tile of T tokens (a warp's share of a tile at
    # the default sizes): no reduction crosses sub-tiles inside the loop; one merge after.
    m_i = tl.full([S, BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([S, BLOCK_H], dtype=tl.float32)
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
        page_next = tl.load(bt_row + blk_next, mask=(tile + 1 < last_tile) & (blk_next < n_blocks),
                            other=0)
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
    q_full = tl.load(q_rows + tl.arange(0, HEAD_DIM)[None, :], mask=head_mask[:, None],
                     other=0.0).to(tl.float32)
    for w_tile in range(split, tl.cdiv(win_len, BLOCK_W), num_splits):
        slot = w_tile * BLOCK_W + tl.arange(0, BLOCK_W)
        rows = batch * stride_wb + pid_kv * stride_wh + slot[:, None] * stride_wn
        acc, m_i, l_i = _window_tile(acc, m_i, l_i, q_full, win_k_ptr, win_v_ptr, rows,
                                     slot < win_len, offs_w, qk_scale, HEAD_DIM, DOT_PRECISION)

    # ---- Partial result; an empty split gives out = 0 and lse = -inf -------
    has_tokens = l_i > 0
    l_safe = tl.where(has_tokens, l_i, 1.0)
    out_rows = part_out_ptr + batch * stride_ob + q_heads[:, None] * stride_oh \
        + split * stride_os + offs_w[None, :]
    for c in tl.static_range(4):
        tl.store(out_rows + c * W, acc[c] / l_safe[:, None], mask=head_mask[:, None])
    tl.store(part_lse_ptr + batch * stride_lb + q_heads * stride_lh + split,
             tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf")), mask=head_mask)


@triton.jit
def _merge_splits_kernel(
        part_out_ptr,          # (B, H_q, NUM_SPLITS, d) fp32 normalized partial outputs
        part_lse_ptr,          # (B, H_q, NUM_SPLITS) fp32 partial log2-sum-exp2 (-inf: empty)
        out_ptr,               # (B, H_q, d) fp32 out: final attention output
        num_splits,            # NUM_SPLITS, partials per (sequence, head)
        stride_ob, stride_oh, stride_os,   # partial-output strides (batch, head, split)
        stride_lb, stride_lh,              # partial-lse strides (batch, head)
        stride_yb, stride_yh,              # output strides (batch, head)
        HEAD_DIM: tl.constexpr,  # d
        BLOCK_SPLITS: tl.constexpr,  # partials merged per step (a (BLOCK_SPLITS, d) block)
):
    """out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M) over the splits i, BLOCK_SPLITS
    partials at a time with the same running-max rescaling as the softmax; empty splits
    (lse = -inf) weigh 0."""
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_split = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_row = part_lse_ptr + batch * stride_lb + head * stride_lh
    out_row = part_out_ptr + batch * stride_ob + head * stride_oh
    m = tl.full([1], float("-inf"), tl.float32)
    denom = tl.zeros([1], tl.float32)
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


_KERNEL_NAMES = ("_int2_decode_split_kernel", "_merge_splits_kernel")


# ----------------------------------------------------------------------------
# Launcher: input checks
# ----------------------------------------------------------------------------
def _fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _check_tensor(name, t, shape, dtypes, device):
    """shape: tuple of ints or None (= any size); dtypes: allowed torch dtypes."""
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        _fail(name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)
    if len(shape) != t.dim() or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        _fail(name, f"shape {want}", tuple(t.shape))
    if device is not None and t.device != device:
        _fail(name, f"device {device} (the device of q)", t.device)
    if not t.is_contiguous():
        _fail(name, "a contiguous tensor", f"strides {t.stride()}")


def _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                  n_quant, win_k, win_v, win_len, group_size, num_splits, sm_scale):
    """Validate everything (ValueError naming the argument); return the sizes as a dict."""
    floats = (torch.float32, torch.bfloat16)
    _check_tensor("q", q, (None, None, None), floats, None)
    dev = q.device
    B, H_q, d = q.shape
    if B < 1 or H_q < 1:
        _fail("q", "at least one sequence and one head", tuple(q.shape))
    if d < 16 or d > 256 or d & (d - 1):
        _fail("q", "head_dim (last dim) a power of two in [16, 256]", d)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
            or d % group_size:
        _fail("group_size", f"a positive int dividing head_dim {d}", group_size)
    _check_tensor("k_codes", k_codes, (None, None, None, d // 4), (torch.uint8,), dev)
    num_pages, H_kv, P, _ = k_codes.shape
    if H_kv < 1 or H_q % H_kv:
        _fail("q", f"a number of query heads divisible by H_kv = {H_kv} (from k_codes)", H_q)
    if P < 1:
        _fail("k_codes", "page size (dim 2) >= 1", P)
    _check_tensor("v_codes", v_codes, tuple(k_codes.shape), (torch.uint8,), dev)
    params = (num_pages, H_kv, P, d // group_size)
    for name, t in (("k_scale", k_scale), ("k_zero", k_zero),
                    ("v_scale", v_scale), ("v_zero", v_zero)):
        _check_tensor(name, t, params, (torch.float32,), dev)
    _check_tensor("block_table", block_table, (B, None), (torch.int32,), dev)
    _check_tensor("n_quant", n_quant, (B,), (torch.int32,), dev)
    _check_tensor("win_k", win_k, (B, H_kv, None, d), floats, dev)
    NW = win_k.shape[2]
    _check_tensor("win_v", win_v, (B, H_kv, NW, d), floats, dev)
    _check_tensor("win_len", win_len, (B,), (torch.int32,), dev)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= _MAX_SPLITS):
        _fail("num_splits", f"None or an int in [1, {_MAX_SPLITS}]", num_splits)
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        _fail("sm_scale", "None or a finite float", sm_scale)

    return dict(B=B, H_q=H_q, H_kv=H_kv, d=d, P=P, NW=NW,
                max_tokens=block_table.shape[1] * P, num_pages=num_pages)


def _check_values(k_codes, block_table, n_quant, win_len, sizes):
    """Value checks of the lengths and used block-table entries; these read the small int
    tensors on the host.  Returns the longest INT2 length (sizes the default splits)."""
    P, NW, num_pages = sizes["P"], sizes["NW"], sizes["num_pages"]
    nq = n_quant.cpu().long()
    wl = win_len.cpu().long()
    max_blocks = block_table.shape[1]
    if (nq < 0).any() or (nq > max_blocks * P).any():
        _fail("n_quant", f"values in [0, max_blocks * page_size] = [0, {max_blocks * P}]",
              nq.tolist())
    if (wl < 0).any() or (wl > NW).any():
        _fail("win_len", f"values in [0, NW] = [0, {NW}] (NW from win_k)", wl.tolist())
    empty = ((nq + wl) < 1).nonzero().flatten().tolist()
    if empty:
        _fail("n_quant + win_len", "at least one token per sequence", f"none for sequences {empty}")
    used_blocks = (n_quant.long() + P - 1) // P
    used = torch.arange(max_blocks, device=block_table.device)[None, :] < used_blocks[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        _fail("block_table", f"used entries in [0, num_pages) = [0, {num_pages})",
              f"block_table[{b}, {j}] = {int(block_table[b, j])}")
    return dict(max_tokens=int(nq.max()))


# ----------------------------------------------------------------------------
# Launcher: block sizes and launch
# ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _sm_count(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _default_num_splits(B, H_kv, max_tiles, device):
    """Enough programs for ~4 waves of the GPU, at least one tile per split."""
    want = triton.cdiv(4 * _sm_count(device), max(1, B * H_kv))
    return max(1, min(want, max_tiles, 64))


@functools.lru_cache(maxsize=None)
def _dot_precision(device):
    """fp32 tl.dot (window tokens, general path): 3xTF32 keeps ~fp32 accuracy on tensor
    cores (NVIDIA sm80+)."""
    if device.type == "cuda" and not _INTERPRETED and torch.version.hip is None \
            and torch.cuda.get_device_capability(device)[0] >= 8:
        return "tf32x3"
    return "ieee"


def _block_sizes(d, G, ratio, P):
    """Tile sizes, warps and stages for stage 1 (explicit; no autotuning), chosen with
    the static model of python kernel.py --sass and checked spill-free on sm_80 and
    sm_90a for every tested configuration (python kernel.py --sass --all), with
    triton 3.7.1 (the pin) and 3.6.0.

    Factored path, one group per row (the production case d = G = 128): 128-token tiles
    of 8 sub-tiles, 4 warps, no software pipelining (at the bench case the model gives
    about 2.0x the HBM time against 2.2-2.4x for 64 tokens with 1-3 stages); 64 tokens
    when a page is shorter than 64.  Several groups per row: 64 tokens within a page, 32
    when a tile gathers its tokens from several pages (a page index and d/G scale and
    zero addresses per token), 32 for d = 256.  General path: 16 tokens, one sub-tile,
    no pipelining (its per-dim scale and zero tiles and, for d < 64, its (tokens, heads,
    d/4) product are large).  Every path may take up to 255 registers: left to itself,
    ptxas settles at 168 on sm_90a and spills a few (in the factored path too, with the
    ptxas of triton 3.7.1), and the extra instructions of a tighter limit cost more than
    the occupancy they buy in the static model."""
    quarter = d // 4
    factored = G % quarter == 0 and quarter >= 16
    if not factored:
        block_n = 16
    elif d > 128:
        block_n = 32
    elif d // G > 1:
        block_n = 64 if P % 64 == 0 else 32
    else:
        block_n = 128 if P % 64 == 0 else 64
    block_w = 32 if d <= 128 else 16          # window tokens per tile (fp32 after upcast)
    # Token sub-tiles of 16 (the MMA's row count) in the factored path.
    sub_tiles = block_n // 16 if factored else 1
    return dict(BLOCK_H=triton.next_power_of_2(ratio), BLOCK_N=block_n, SUB_TILES=sub_tiles,
                BLOCK_W=block_w, FACTORED=factored, num_warps=4,
                num_stages=1 if block_n == 128 or not factored else 2, maxnreg=255)


def _launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant,
            win_k, win_v, win_len, group_size, num_splits, sm_scale, sizes):
    """Launch both stages on already validated inputs; no host synchronisation."""
    B, H_q, H_kv, d, P, NW = (sizes[k] for k in ("B", "H_q", "H_kv", "d", "P", "NW"))
    cfg = _block_sizes(d, group_size, H_q // H_kv, P)
    if num_splits is None:
        max_tiles = triton.cdiv(sizes["max_tokens"], cfg["BLOCK_N"])
        num_splits = _default_num_splits(B, H_kv, max_tiles, q.device)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if NW == 0:  # give the kernel a readable (never read) pointer
        win_k = win_v = q.new_zeros(B, H_kv, 1, d)
    if k_codes.shape[0] == 0:  # empty pool (all n_quant == 0): same reason
        k_codes = v_codes = k_codes.new_zeros(1, *k_codes.shape[1:])
        k_scale = k_zero = v_scale = v_zero = k_scale.new_zeros(1, *k_scale.shape[1:])
    if block_table.shape[1] == 0:
        block_table = block_table.new_zeros(B, 1)

    part_out = torch.empty(B, H_q, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H_q, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H_q, d, dtype=torch.float32, device=q.device)

    _int2_decode_split_kernel[(B, H_kv, num_splits)](
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant,
        win_k, win_v, win_len, part_out, part_lse,
        sm_scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        block_table.stride(0),
        win_k.stride(0), win_k.stride(1), win_k.stride(2),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=d, GROUP_SIZE=group_size, NUM_GROUPS=d // group_size, PAGE_SIZE=P,
        QUERIES_PER_KV=H_q // H_kv, DOT_PRECISION=_dot_precision(q.device), **cfg,
    )
    _merge_splits_kernel[(B, H_q)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_SPLITS=max(1, min(triton.next_power_of_2(num_splits), 4096 // d)),
        num_warps=4,
    )
    return out


def int2_paged_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                      n_quant, win_k, win_v, win_len, group_size, num_splits=None,
                      sm_scale=None, checked=True) -> torch.Tensor:
    """Decode attention of q over an INT2 paged cache plus full-precision windows.

    Returns (B, H_q, d) fp32.  num_splits: programs per (sequence, KV head) (None: chosen
    from the GPU size); sm_scale: logit scale (None: 1/sqrt(d)).  Raises ValueError,
    naming the argument, on any malformed input.

    checked=True (default) also checks the values of n_quant, win_len and the used
    block-table entries, which reads them on the host (a device synchronisation).
    checked=False checks shapes, dtypes and devices only and never synchronises, so this
    launch can be captured in a CUDA graph (a whole optr.decode_step cannot: its cache
    append checks values and takes pages on the host); out-of-range lengths or
    block-table entries are then undefined behaviour.  num_splits=None there sizes the
    splits from the block table's capacity instead of the longest sequence.
    """
    sizes = _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                          n_quant, win_k, win_v, win_len, group_size, num_splits, sm_scale)
    if checked:
        sizes.update(_check_values(k_codes, block_table, n_quant, win_len, sizes))
    if not _INTERPRETED and q.device.type != "cuda":
        _fail("q", "a CUDA tensor (Triton runs on the GPU; TRITON_INTERPRET=1 for CPU)",
              q.device)
    if type(tl.zeros) is not type(_codes_fp16):
        raise RuntimeError("triton was imported before kernel.py without TRITON_INTERPRET=1 "
                           "on a machine without CUDA; import kernel first or set "
                           "TRITON_INTERPRET=1 in the environment")
    return _launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, n_quant,
                   win_k, win_v, win_len, group_size, num_splits, sm_scale, sizes)


# ----------------------------------------------------------------------------
# CPU kernels (numba): the same algorithm without a GPU, and the INT2 write
# ----------------------------------------------------------------------------
# Why numba: measured on 2 CPU cores for 30 SmolLM2-shaped layers (the issue's prototype
# and this file), a numba loop over the packed codes beat torch.compile's elementwise form
# by about 2x, compiles once (about 40 s on 2 cores: the decode 37 s, the write 2 s) and
# then loads from its disk cache (__pycache__) in 0.6 s; a C++ extension was faster still
# but took 40-70 s to compile and needs a compiler at run time.  numba is imported at the first CPU call, never at import.
# Algorithm: as the Triton kernel.  A job owns one (sequence, KV head, split): its share
# of the INT2 tokens and of the window slots, all query heads of the KV head together
# (each code row is unpacked once for them), an online softmax over 32-token tiles, and
# q.k~ and p.V~ in Q2's affine form straight from the codes; the jobs run in parallel and
# their partials merge by log-sum-exp.  G = d (one group per row) has its own job, two
# passes with no group loop.  Reassociated sums let LLVM vectorise; the result is the
# reference's up to round-off.

def _cpu_decode_job(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, G, scale, n_split, tile,
                    o_part, lse_part, job):
    """One (sequence b, KV head h, split sp): its share of the INT2 tokens and window slots."""
    f32 = np.float32
    B, Hq, d = q.shape
    H, P, D4 = kc.shape[1], kc.shape[2], kc.shape[3]
    R, NG = Hq // H, d // G
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w = nq[b], wl[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split          # INT2 tokens [t0, t1)
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split          # window slots [w0, w1)
    qs = np.empty((R, d), dtype=f32)                                  # the group's queries, scaled
    qsum = np.zeros((R, NG), dtype=f32)                               # their sum per Q2 group
    for r in range(R):
        for ch in range(d):
            qs[r, ch] = q[b, h * R + r, ch] * scale
        for g in range(NG):
            qsum[r, g] = qs[r, g * G:(g + 1) * G].sum()
    m = np.full(R, -np.inf, dtype=f32)                                # online softmax: max,
    l = np.zeros(R, dtype=f32)                                        # sum of e^(a - m),
    acc = np.zeros((R, d), dtype=f32)                                 # sum p s c + sum p v,
    accz = np.zeros((R, NG), dtype=f32)                               # sum p s z (INT2 values)
    code, prod, ps = np.empty(d, dtype=f32), np.empty(d, dtype=f32), np.empty(d, dtype=f32)
    p = np.empty((R, tile), dtype=f32)
    end = t1 + (w1 - w0)                  # items t0 .. t1 - 1 are INT2 tokens, then window slots
    for u0 in range(t0, end, tile):
        nt = min(tile, end - u0)
        for i in range(nt):               # logits: q.k~ = sum_g s_g (q_g . c_g - z_g sum q_g)
            u = u0 + i
            if u < t1:
                page, slot = bt[b, u // P], u % P
                row = kc[page, h, slot]
                for c in range(4):        # byte j holds dims j, j + d/4, j + d/2, j + 3d/4
                    for j in range(D4):
                        code[c * D4 + j] = f32((np.int32(row[j]) >> np.int32(2 * c)) & np.int32(3))
                for r in range(R):
                    for ch in range(d):
                        prod[ch] = qs[r, ch] * code[ch]
                    a = f32(0.0)
                    for g in range(NG):
                        a += ks[page, h, slot, g] * (prod[g * G:(g + 1) * G].sum() - kz[page, h, slot, g] * qsum[r, g])
                    p[r, i] = a
            else:                         # a window token, exact
                krow = wk[b, h, w0 + u - t1]
                for r in range(R):
                    for ch in range(d):
                        prod[ch] = qs[r, ch] * krow[ch]
                    p[r, i] = prod.sum()
        for r in range(R):                # rescale the running state to the new max
            mt = m[r]
            for i in range(nt):
                mt = max(mt, p[r, i])
            alpha = np.exp(m[r] - mt)
            l[r] *= alpha
            acc[r] *= alpha
            accz[r] *= alpha
            m[r] = mt
            for i in range(nt):
                p[r, i] = np.exp(p[r, i] - mt)
                l[r] += p[r, i]
        for i in range(nt):               # p V~ = (p s) . c - sum p s z;  p v in the windows
            u = u0 + i
            if u < t1:
                page, slot = bt[b, u // P], u % P
                row = vc[page, h, slot]
                for c in range(4):
                    for j in range(D4):
                        code[c * D4 + j] = f32((np.int32(row[j]) >> np.int32(2 * c)) & np.int32(3))
                for r in range(R):
                    for g in range(NG):
                        x = p[r, i] * vs[page, h, slot, g]
                        accz[r, g] += x * vz[page, h, slot, g]
                        ps[g * G:(g + 1) * G] = x
                    for ch in range(d):
                        acc[r, ch] += ps[ch] * code[ch]
            else:
                vrow = wv[b, h, w0 + u - t1]
                for r in range(R):
                    for ch in range(d):
                        acc[r, ch] += p[r, i] * vrow[ch]
    for r in range(R):
        if l[r] > 0:
            for ch in range(d):
                o_part[b, h * R + r, sp, ch] = (acc[r, ch] - accz[r, ch // G]) / l[r]
            lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])


def _cpu_decode_job_row(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, scale, n_split, o_part,
                        lse_part, job):
    """_cpu_decode_job for one group per row (G = d: the authors' choice and the real models'):
    one scale and zero per token, so q.k~ = s (q.c - z sum q) and p.V~ = sum (p s) c - sum p s z
    with no per-group loop; two passes (all logits, their max, then p and the values), so the
    running sums are never rescaled."""
    f32 = np.float32
    B, Hq, d = q.shape
    H, P, D4 = kc.shape[1], kc.shape[2], kc.shape[3]
    R = Hq // H
    b, h, sp = job // (H * n_split), (job // n_split) % H, job % n_split
    n, w = nq[b], wl[b]
    t0, t1 = (n * sp) // n_split, (n * (sp + 1)) // n_split
    w0, w1 = (w * sp) // n_split, (w * (sp + 1)) // n_split
    qs = np.empty((R, d), dtype=f32)
    qsum = np.zeros(R, dtype=f32)
    for r in range(R):
        for ch in range(d):
            qs[r, ch] = q[b, h * R + r, ch] * scale
            qsum[r] += qs[r, ch]
    nt = t1 - t0
    if nt + w1 - w0 == 0:                                           # nothing here: lse stays -inf
        return
    a = np.empty((R, nt + w1 - w0), dtype=f32)
    code = np.empty(d, dtype=f32)
    m = np.full(R, -np.inf, dtype=f32)
    for i in range(nt):                                             # pass 1: logits
        u = t0 + i
        page, slot = bt[b, u // P], u % P
        for c in range(4):                # int32 shifts: AVX2 converts int32, not int64, to float
            for j in range(D4):
                code[c * D4 + j] = f32((np.int32(kc[page, h, slot, j]) >> np.int32(2 * c)) & np.int32(3))
        s, z = ks[page, h, slot, 0], kz[page, h, slot, 0]
        for r in range(R):
            y = f32(0.0)
            for ch in range(d):
                y += qs[r, ch] * code[ch]
            a[r, i] = s * (y - z * qsum[r])
    for i in range(w1 - w0):                                        # the window tokens, exact
        for r in range(R):
            y = f32(0.0)
            for ch in range(d):
                y += qs[r, ch] * wk[b, h, w0 + i, ch]
            a[r, nt + i] = y
    for r in range(R):
        m[r] = a[r].max()
    l = np.zeros(R, dtype=f32)
    o = np.zeros((R, d), dtype=f32)
    psz = np.zeros(R, dtype=f32)
    for r in range(R):
        for i in range(nt + w1 - w0):
            p = np.exp(a[r, i] - m[r])
            l[r] += p
            a[r, i] = p
    for i in range(nt):                                             # pass 2: p V~
        u = t0 + i
        page, slot = bt[b, u // P], u % P
        for c in range(4):
            for j in range(D4):
                code[c * D4 + j] = f32((np.int32(vc[page, h, slot, j]) >> np.int32(2 * c)) & np.int32(3))
        s, z = vs[page, h, slot, 0], vz[page, h, slot, 0]
        for r in range(R):
            x = a[r, i] * s
            psz[r] += x * z
            for ch in range(d):
                o[r, ch] += x * code[ch]
    for i in range(w1 - w0):
        for r in range(R):
            x = a[r, nt + i]
            for ch in range(d):
                o[r, ch] += x * wv[b, h, w0 + i, ch]
    for r in range(R):
        if l[r] > 0:
            for ch in range(d):
                o_part[b, h * R + r, sp, ch] = (o[r, ch] - psz[r]) / l[r]
            lse_part[b, h * R + r, sp] = m[r] + np.log(l[r])


def _cpu_decode(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, G, scale, n_split, tile):
    """Stage 1 over (sequence, KV head, split) in parallel, then the log-sum-exp merge."""
    B, Hq, d = q.shape
    H = kc.shape[1]
    o_part = np.zeros((B, Hq, n_split, d), dtype=np.float32)
    lse_part = np.full((B, Hq, n_split), -np.inf, dtype=np.float32)
    for job in numba_prange(B * H * n_split):
        if G == d:
            cpu_decode_job_row(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, scale, n_split, o_part,
                               lse_part, job)
        else:
            cpu_decode_job(q, kc, ks, kz, vc, vs, vz, bt, nq, wk, wv, wl, G, scale, n_split, tile,
                           o_part, lse_part, job)
    out = np.zeros((B, Hq, d), dtype=np.float32)
    for bj in range(B * Hq):              # out = sum_i e^(lse_i - M) o_i / sum_i e^(lse_i - M)
        b, j = bj // Hq, bj % Hq
        M = lse_part[b, j].max()
        tot = np.float32(0.0)
        for sp in range(n_split):
            if lse_part[b, j, sp] > -np.inf:
                wgt = np.exp(lse_part[b, j, sp] - M)
                tot += wgt
                out[b, j] += wgt * o_part[b, j, sp]
        out[b, j] /= tot
    return out


def _cpu_q2_store(rows, clip_rank, G, eps, codes, scale, zero, page, slot):
    """Q2's storage form of rows (N, H, d) fp32 into codes (pages, H, P, d/4), scale and zero
    (pages, H, P, d/G) at [page[i], :, slot[i]]: q2_quantize's numbers, bit for bit."""
    f32 = np.float32
    N, H, d = rows.shape
    D4 = d // 4
    code = np.empty(d, dtype=np.uint8)
    for i in range(N):
        for h in range(H):
            x = rows[i, h]
            for g in range(d // G):
                xg = x[g * G:(g + 1) * G]
                tau = np.sort(np.abs(xg))[clip_rank]               # |x| at rank floor(c G)
                mn, mx = f32(np.inf), f32(-np.inf)
                for k in range(G):
                    y = max(min(xg[k], tau), -tau)
                    mn, mx = min(mn, y), max(mx, y)
                s = max(mx - mn, eps) / f32(3.0)                    # range floored, then divided
                z = -mn / s
                for k in range(G):
                    y = max(min(xg[k], tau), -tau)
                    code[g * G + k] = np.uint8(min(max(np.floor(y / s + z + f32(0.5)), f32(0.0)), f32(3.0)))
                scale[page[i], h, slot[i], g], zero[page[i], h, slot[i], g] = s, z
            for j in range(D4):
                codes[page[i], h, slot[i], j] = (code[j] | (code[D4 + j] << 2) | (code[2 * D4 + j] << 4)
                                                 | (code[3 * D4 + j] << 6))

_FASTMATH = {"reassoc", "contract", "nsz"}   # reorder sums (vectorise); keep inf and NaN semantics


@functools.lru_cache(maxsize=None)
def _numba():
    """The compiled CPU kernels, jitted at the first call (compiled once, then cached on disk)."""
    import numba
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]   # omp: 90 ms/token at 4k,
    g = globals()                                                        # workqueue 242 (SmolLM2)
    g["numba_prange"] = numba.prange
    g["cpu_decode_job"] = numba.njit(cache=True, fastmath=_FASTMATH)(_cpu_decode_job)
    g["cpu_decode_job_row"] = numba.njit(cache=True, fastmath=_FASTMATH)(_cpu_decode_job_row)
    decode = numba.njit(parallel=True, cache=True)(_cpu_decode)
    store = numba.njit(cache=True)(_cpu_q2_store)
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    return decode, store


def int2_paged_decode_cpu(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                          n_quant, win_k, win_v, win_len, group_size, num_splits=None,
                          sm_scale=None, checked=True) -> torch.Tensor:
    """int2_paged_decode on the CPU, compiled by numba: the same arguments and result (B, H_q, d)
    fp32, a ValueError naming a malformed argument.  checked=False checks nothing (the caller
    vouches for the view, as optr's cache does for the one it builds): no per-call cost, and
    malformed inputs are undefined behaviour."""
    if checked:
        sizes = _check_inputs(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                              n_quant, win_k, win_v, win_len, group_size, num_splits, sm_scale)
        if q.device.type != "cpu":
            _fail("q", "a CPU tensor (int2_paged_decode runs on CUDA)", q.device)
        _check_values(k_codes, block_table, n_quant, win_len, sizes)
    B, H_kv, d = q.shape[0], k_codes.shape[1], q.shape[2]
    longest = int(n_quant.max()) + int(win_len.max())
    decode, _ = _numba()
    if num_splits is None:      # about two jobs per thread, at least 256 tokens each
        threads = torch.get_num_threads()
        num_splits = max(1, min(-(-2 * threads // (B * H_kv)), longest // 256))
    fp32 = lambda x: x.detach().float().numpy()   # bf16 windows: numba has no bf16
    out = decode(q.detach().float().numpy(), k_codes.numpy(), k_scale.numpy(), k_zero.numpy(), v_codes.numpy(),
                 v_scale.numpy(), v_zero.numpy(), block_table.numpy(), n_quant.numpy(), fp32(win_k),
                 fp32(win_v), win_len.numpy(), group_size,
                 np.float32(1.0 / math.sqrt(d) if sm_scale is None else sm_scale), num_splits, 32)
    return torch.from_numpy(out)


def paged_decode(q, **view) -> torch.Tensor:
    """The decode the serving code calls: the device's kernel for q's device (Triton on CUDA,
    numba on the CPU), with the arguments of int2_paged_decode."""
    return (int2_paged_decode if q.is_cuda else int2_paged_decode_cpu)(q, **view)


def q2_store(rows, clip, group_size, eps, codes, scale, zero, page, slot):
    assert rows.dim() == 3 and page.shape == slot.shape == rows.shape[:1], "a page and slot per row"
    """Write Q2's storage form of rows (N, H, d) fp32 (CPU) into codes[page[i], :, slot[i]] and
    its scale and zero, as optr.q2_quantize computes them, bit for bit (compiled by numba)."""
    assert rows.dtype == torch.float32 and rows.is_contiguous() and codes.is_contiguous(), "fp32 rows"
    rank = min(max(int(math.floor(clip * group_size)), 0), group_size - 1)
    _numba()[1](rows.detach().numpy(), rank, group_size, np.float32(eps), codes.numpy(), scale.numpy(),
                zero.numpy(), page.numpy(), slot.numpy())


# ----------------------------------------------------------------------------
# Benchmark (python kernel.py --bench) and the device check (--gpu-check)
# ----------------------------------------------------------------------------
# Peak HBM bandwidth in GB/s, matched in order against torch.cuda.get_device_name().
_PEAK_GBS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
             ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 1935.0), ("A100", 1555.0)]
# The decode shape that --bench and --gpu-check time (Qwen3-8B-like attention) and the
# small one a CPU dry run of --gpu-check uses instead.
_BENCH_SHAPE = dict(H_q=32, H_kv=8, d=128, G=128, P=64, sink=64, recent=256)
_DRY_SHAPE = dict(H_q=4, H_kv=2, d=64, G=64, P=16, sink=2, recent=6)


def _random_inputs(B, n_quant, H_q, H_kv, d, G, P, NW, win_dtype, device):
    """Random cache with a shuffled block table; every sequence has n_quant INT2 tokens."""
    blocks = triton.cdiv(n_quant, P)
    num_pages = max(1, B * blocks)
    gen = dict(device=device)
    k_codes = torch.randint(0, 256, (num_pages, H_kv, P, d // 4), dtype=torch.uint8, **gen)
    v_codes = torch.randint(0, 256, (num_pages, H_kv, P, d // 4), dtype=torch.uint8, **gen)
    params = (num_pages, H_kv, P, d // G)
    k_scale, v_scale = (0.05 + 0.1 * torch.rand(params, **gen) for _ in range(2))
    k_zero, v_zero = (3.0 * torch.rand(params, **gen) for _ in range(2))
    block_table = torch.randperm(num_pages, **gen)[:B * blocks].to(torch.int32).view(B, blocks)
    return dict(
        q=torch.randn(B, H_q, d, dtype=win_dtype, **gen),
        k_codes=k_codes, k_scale=k_scale, k_zero=k_zero,
        v_codes=v_codes, v_scale=v_scale, v_zero=v_zero, block_table=block_table,
        n_quant=torch.full((B,), n_quant, dtype=torch.int32, **gen),
        win_k=torch.randn(B, H_kv, NW, d, dtype=win_dtype, **gen),
        win_v=torch.randn(B, H_kv, NW, d, dtype=win_dtype, **gen),
        win_len=torch.full((B,), NW, dtype=torch.int32, **gen),
        group_size=G)


# The launch shape of _tiny_check (as _record_launch takes it; --sass --all compiles it).
_TINY_LAUNCH = dict(B=3, H_q=8, H_kv=2, d=64, G=16, P=16, NW=5, n_quant=40, num_splits=2,
                    q_dtype="bf16", win_dtype="bf16")


def _tiny_check(device):
    """Kernel vs torch reference on a small ragged case; returns the max abs error."""
    torch.manual_seed(0)
    c = _TINY_LAUNCH
    args = _random_inputs(c["B"], c["n_quant"], c["H_q"], c["H_kv"], c["d"], c["G"], c["P"],
                          c["NW"], torch.bfloat16, device)
    args["n_quant"] = torch.tensor([40, 0, 17], dtype=torch.int32, device=device)
    args["win_len"] = torch.tensor([5, 2, 0], dtype=torch.int32, device=device)
    out = int2_paged_decode(**args, num_splits=c["num_splits"])
    ref = paged_decode_reference(**args)
    return (out - ref).abs().max().item()


def _paged_bf16_baseline(q, k_pages, v_pages, block_table, n_tokens):
    """Decode over a paged bf16 cache in plain torch: gather the pages through the block
    table, then scaled_dot_product_attention.  k_pages (num_pages, H_kv, P, d)."""
    import torch.nn.functional as F
    B, H_q, d = q.shape
    H_kv = k_pages.shape[1]
    k = k_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, H_kv, -1, d)[:, :, :n_tokens]
    v = v_pages[block_table].permute(0, 2, 1, 3, 4).reshape(B, H_kv, -1, d)[:, :, :n_tokens]
    return F.scaled_dot_product_attention(q.view(B, H_kv, H_q // H_kv, d), k, v)


def _timer(device):
    """fn -> microseconds per call: CUDA graphs on a GPU (triton.testing's
    do_bench_cudagraph), the median of 3 wall-clock calls elsewhere (the dry run)."""
    if device.type == "cuda":
        from triton.testing import do_bench_cudagraph
        return lambda fn: do_bench_cudagraph(fn) * 1e3
    import time

    def wall(fn):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e6
    return wall


def _sdpa(q, k, v):
    """(name, fn): bf16 attention of q over k, v with the first SDPA backend that runs
    this shape (flash, cuDNN, memory-efficient, math), so the table can name it."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    names = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    for backend in (getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        try:
            fn()
        except RuntimeError:
            continue
        return backend.name.lower(), fn
    raise RuntimeError("no SDPA backend runs this shape")


def _bench_rows(batches, contexts, device, shape, paged=True, deadline=None):
    """Time one decode step per (batch, context): the INT2 kernel through the unchecked
    launcher, a contiguous bf16 cache with SDPA (backend named) and, if paged, a paged
    bf16 cache (torch gather + SDPA).  Yields a dict per row.  Bytes moved count the
    INT2 codes, scales and zeros, the windows, the query, the stage-1 partials (written
    and read back) and the output; the bf16 cache reads its K and V."""
    import time
    H_q, H_kv, d, G, P = (shape[k] for k in ("H_q", "H_kv", "d", "G", "P"))
    NW = shape["sink"] + shape["recent"]
    bench = _timer(device)
    for B in batches:
        for ctx in contexts:
            row = dict(batch=B, ctx=ctx)
            n = ctx - NW
            int2_bytes = 2 * B * H_kv * n * (d // 4 + 2 * 4 * d // G)   # codes + scales + zeros
            win_bytes = 2 * B * H_kv * NW * d * 2
            bf16_bytes = 2 * B * H_kv * ctx * d * 2
            if deadline is not None and time.monotonic() > deadline:
                yield dict(row, skipped="out of time")
                continue
            need = 2.5 * (int2_bytes + win_bytes + bf16_bytes)
            if device.type == "cuda" and need > torch.cuda.mem_get_info(device)[0]:
                yield dict(row, skipped="does not fit in memory")
                continue
            args = _random_inputs(B, n, H_q, H_kv, d, G, P, NW, torch.bfloat16, device)
            sizes = _check_inputs(*args.values(), None, None)
            sizes.update(_check_values(args["k_codes"], args["block_table"], args["n_quant"],
                                       args["win_len"], sizes))
            splits = _default_num_splits(B, H_kv, triton.cdiv(n, _block_sizes(d, G, H_q // H_kv, P)
                                                             ["BLOCK_N"]), device)
            part_bytes = B * H_q * splits * (d + 1) * 4 * 2              # written, then read
            io_bytes = B * H_q * d * (2 + 4)                              # bf16 q, fp32 out
            row["splits"] = splits
            row["int2_us"] = bench(lambda a=args, n=splits, s=sizes: _launch(*a.values(), n, None, s))
            moved = int2_bytes + win_bytes + part_bytes + io_bytes
            row["gbs"] = moved / (row["int2_us"] * 1e-6) / 1e9
            del args
            # Contiguous bf16 cache: the query heads of a KV head act as its query rows.
            k = torch.randn(B, H_kv, ctx, d, dtype=torch.bfloat16, device=device)
            v = torch.randn_like(k)
            qb = torch.randn(B, H_kv, H_q // H_kv, d, dtype=torch.bfloat16, device=device)
            row["backend"], attend = _sdpa(qb, k, v)
            row["bf16_us"] = bench(attend)
            row["bf16_gbs"] = bf16_bytes / (row["bf16_us"] * 1e-6) / 1e9
            del k, v, attend
            if paged:
                # Paged bf16 cache, same shuffled-page layout as the INT2 one.
                blocks = triton.cdiv(ctx, P)
                k_pages = torch.randn(B * blocks, H_kv, P, d, dtype=torch.bfloat16, device=device)
                v_pages = torch.randn_like(k_pages)
                table = torch.randperm(B * blocks, device=device).view(B, blocks)
                qp = qb.reshape(B, H_q, d)
                row["paged_us"] = bench(
                    lambda: _paged_bf16_baseline(qp, k_pages, v_pages, table, ctx))
                del k_pages, v_pages
            if device.type == "cuda":
                torch.cuda.empty_cache()
            yield row


def _print_bench(rows, peak_gbs):
    """One table, a line per row as it comes (GB/s of the INT2 kernel, % of peak, speed-up
    over the bf16 SDPA decode, whose backend is named, and over the paged bf16 one)."""
    print(f"{'batch':>5} {'ctx':>7} {'splits':>6} {'int2 us':>9} {'GB/s':>7} {'%peak':>6}"
          f" {'bf16 us':>9} {'x bf16':>7} {'SDPA backend':>17} {'paged us':>9} {'x paged':>7}",
          flush=True)
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>5} {r['ctx']:>7}  skipped ({r['skipped']})", flush=True)
            continue
        pct = f"{100 * r['gbs'] / peak_gbs:6.1f}" if peak_gbs else f"{'-':>6}"
        paged = (f" {r['paged_us']:>9.1f} {r['paged_us'] / r['int2_us']:>6.2f}x"
                 if "paged_us" in r else f" {'-':>9} {'-':>7}")
        print(f"{r['batch']:>5} {r['ctx']:>7} {r['splits']:>6} {r['int2_us']:>9.1f} "
              f"{r['gbs']:>7.0f} {pct} {r['bf16_us']:>9.1f} {r['bf16_us'] / r['int2_us']:>6.2f}x "
              f"{r['backend']:>17}{paged}", flush=True)


def _peak_gbs(device, peak_gbs=None):
    """(device name, peak HBM GB/s or None) for the %peak column."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    if peak_gbs is None:
        peak_gbs = next((gbs for key, gbs in _PEAK_GBS if key in name), None)
    return name, peak_gbs


def _bench(peak_gbs, batches=(1, 8, 32, 64), contexts=(1024, 4096, 16384, 32768, 131072),
           device="cuda"):
    """python kernel.py --bench: the tiny correctness check, then the table."""
    device = torch.device(device)
    name, peak_gbs = _peak_gbs(device, peak_gbs)
    s = _BENCH_SHAPE
    print(f"device: {name}; peak HBM: {peak_gbs or 'unknown'} GB/s; triton {triton.__version__}, "
          f"torch {torch.__version__}")
    print(f"tiny correctness check, max abs error vs torch: {_tiny_check(device):.2e}")
    print(f"H_q={s['H_q']} H_kv={s['H_kv']} d={s['d']} G={s['G']} page={s['P']} "
          f"window=bf16 sink {s['sink']} + recent {s['recent']}")
    _print_bench(_bench_rows(batches, contexts, device, s), peak_gbs)


# ---- python kernel.py --bench-hf: a real model's decoding, DynamicCache against optr.hf_cache ----
def _cache_bytes(cache) -> int:
    """Bytes a transformers Cache holds: optr's pages and windows (allocated), others' keys, values."""
    import optr
    return sum(layer.nbytes() if isinstance(layer, optr.PagedLayer) else
               sum(t.nbytes for t in (layer.keys, layer.values) if t is not None) for layer in cache.layers)


def _peak_mib(device, reset=False) -> float:
    """Peak memory since the last reset: allocated memory on CUDA; on the CPU the process's
    resident set (Linux's VmHWM, reset through /proc/self/clear_refs)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats() if reset else None
        return torch.cuda.max_memory_allocated() / 2**20
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**10


BENCH_HF_ROWS = ("DynamicCache", "optr compiled", "optr reference")   # the cache and its decode


@torch.no_grad()
def _bench_hf_row(job) -> dict:
    """One row of --bench-hf, in a process of its own (its peak memory is its own): the model and
    its published quarot+optr rotations, a prompt of T random tokens in one forward, then `new`
    greedy steps (what generate() runs) through DynamicCache, or optr.hf_cache decoding with the
    device's compiled kernel (kernel.paged_decode) or the torch reference."""
    import time
    import eval_llm
    import optr
    from transformers import DynamicCache
    model, kind, T, new, device = job
    os.environ["TQDM_DISABLE"] = "1"                                     # GGUF's progress bar
    hf, _ = eval_llm.load_model(eval_llm.model_path(model)[0])
    hf = hf.to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    kv, info = optr.load_kv_rotations(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rotations", model))
    cfg = optr.hf_config(hf.config, **info["settings"])
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(device)
    attend = optr.paged_decode_reference if kind == "optr reference" else None
    if kind == "DynamicCache":
        hf.set_attn_implementation("sdpa")
    cache = DynamicCache() if kind == "DynamicCache" else optr.hf_cache(kv["quarot+optr"], cfg, hf, attend=attend,
                                                                       max_tokens=T + new)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step = lambda x: hf(x, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    warm = cfg.sink + cfg.window + cfg.page_size + 1                     # compile or load the kernels:
    step(step(ids[:, :warm])) if kind != "DynamicCache" else None        # a prompt past the windows, a step
    cache = DynamicCache() if kind == "DynamicCache" else optr.hf_cache(kv["quarot+optr"], cfg, hf, attend=attend,
                                                                       max_tokens=T + new)
    before, t0 = _peak_mib(device, reset=True), time.perf_counter()
    tok = step(ids)                                                       # the prompt, as generate()
    sync()
    prefill, steps = time.perf_counter() - t0, []
    for _ in range(new):
        t0 = time.perf_counter()
        tok = step(tok)
        sync()
        steps.append(time.perf_counter() - t0)
    return dict(cache=kind, T=T, prefill_s=prefill, decode_ms=1e3 * sorted(steps)[len(steps) // 2],
                cache_mib=_cache_bytes(cache) / 2**20, peak_mib=_peak_mib(device), loaded_mib=before)


def _bench_hf(model="smollm2", contexts=(1024, 4096, 8000), new=16, rows=BENCH_HF_ROWS):
    """python kernel.py --bench-hf: per context, DynamicCache (sdpa) against optr.hf_cache with the
    compiled decode (Triton on CUDA, numba on the CPU) and with the torch reference, each row a
    fresh process."""
    import multiprocessing
    device = "cuda" if torch.cuda.is_available() and not _INTERPRETED else "cpu"
    print(f"{model} on {device} ({torch.get_num_threads()} threads), prompt in one forward, then "
          f"{new} greedy tokens; decode: median ms/token; peak: {'max allocated' if device == 'cuda' else 'max RSS'} "
          f"while generating (loaded: before)")
    print(f"{'cache':15s} {'tokens':>6s} {'prefill s':>9s} {'decode ms':>9s} {'cache MiB':>9s} "
          f"{'peak MiB':>9s} {'loaded MiB':>10s}")
    out, ctx = [], multiprocessing.get_context("spawn")
    for T in contexts:
        got = {}
        for kind in rows:
            with ctx.Pool(1) as pool:
                r = got[kind] = pool.apply(_bench_hf_row, ((model, kind, T, new, device),))
            out.append(r)
            print(f"{r['cache']:15s} {T:6d} {r['prefill_s']:9.2f} {r['decode_ms']:9.1f} {r['cache_mib']:9.1f} "
                  f"{r['peak_mib']:9.0f} {r['loaded_mib']:10.0f}", flush=True)
        dyn, ours = got.get("DynamicCache"), got.get("optr compiled")
        if dyn and ours:
            print(f"{'':15s} {T:6d} compiled/DynamicCache: decode {ours['decode_ms'] / dyn['decode_ms']:.2f}x, cache "
                  f"{dyn['cache_mib'] / ours['cache_mib']:.1f}x smaller, peak lower by "
                  f"{dyn['peak_mib'] - ours['peak_mib']:.0f} MiB of the caches' {dyn['cache_mib'] - ours['cache_mib']:.0f}")
    return out


# ---- python kernel.py --gpu-check: everything a lent GPU should confirm, in one command ----
_GPU_CHECK_SECONDS = 480          # the whole check, start-up of the tests included
_MARK = {True: "ok", False: "FAIL", None: "skip"}   # a step's result: passed, failed, skipped


def _served_tiny(device, small):
    """A random optr.TinyLM with QuaRot rotations on `device`: (cfg, the model with R_V
    folded, the rotations as optr.KVQuant)."""
    import optr
    d = 64 if small else 128
    cfg = optr.Config(n_heads=8, n_kv_heads=2, head_dim=d, d_model=128, group_size=d,
                      sink=2, window=6, page_size=4 if small else 16)
    model = optr.TinyLM(cfg)
    kv = [optr.KVQuant(r_k=optr.quarot_rotation(cfg.n_kv_heads, d),
                       r_v=optr.quarot_rotation(cfg.n_kv_heads, d)) for _ in range(cfg.n_layers)]
    return cfg, optr.fold_value_rotation(model, kv).to(device), [s.to(device) for s in kv]


def _paged_cache(cfg, kv, B, n_tokens, device):
    """An optr.PagedKVCache on `device` with bf16 windows, room for B sequences of n_tokens
    and two pages more, its pages taken in shuffled order; (cache, seqs)."""
    import optr
    num_pages = B * triton.cdiv(n_tokens, cfg.page_size) + 2
    cache = optr.PagedKVCache(cfg, num_pages, B, kv, window_dtype=torch.bfloat16, device=device)
    cache.free_pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
    return cache, [cache.add_sequence() for _ in range(B)]


def _kernel_and_reference(worst):
    """An `attend` for optr.decode_step: the kernel's output, with the largest
    |kernel - reference| / (1e-5 + 1e-4 |reference|) on the same paged view kept in worst[0]."""
    def both(q, **view):
        out = int2_paged_decode(q, **view)
        ref = paged_decode_reference(q, **view)
        worst[0] = max(worst[0], ((out - ref).abs() / (1e-5 + 1e-4 * ref.abs())).max().item())
        return out
    return both


def _check_decode_step(device, small):
    """optr.decode_step through optr.PagedKVCache on `device` with bf16 windows: every
    layer's kernel output equals optr.paged_decode_reference on the same paged view, token
    after token, as INT2 tokens fill several pages.  Returns (ok, detail)."""
    import optr
    cfg, folded, kv = _served_tiny(device, small)
    steps, B = (16 if small else 120), 3
    cache, seqs = _paged_cache(cfg, kv, B, steps, device)
    worst = [0.0]
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (steps, B), device=device)
    for t in range(steps):
        logits = optr.decode_step(folded, cache, seqs, tokens[t], attend=_kernel_and_reference(worst))
    ok = worst[0] <= 1.0 and bool(torch.isfinite(logits).all())
    return ok, (f"{steps} steps x {cfg.n_layers} layers, B={B}, d={cfg.head_dim}, "
                f"{int(cache.layer_view(0, seqs)['n_quant'][0])} INT2 tokens; max |err| / "
                f"(1e-5 + 1e-4 |ref|) = {worst[0]:.2f} (pass <= 1)")


def _check_prefill(device, small):
    """optr.prefill of a prompt into an optr.PagedKVCache on `device` with bf16 windows:
    the cache is bit for bit what token-by-token appends of the same forward's keys and
    values store on `device`; the page ids are the CPU prefill's and the logits within 2%
    of the CPU logits' largest (a code at a rounding boundary may round the other way on
    another device); the next decode_step's kernel output equals the reference on the
    cache prefill left.  Returns (ok, detail)."""
    import optr
    T, B = (24 if small else 200), 3
    prompt = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(1))

    def prefilled(dev):                     # (cfg, folded model, kv, cache, seqs, logits)
        cfg, folded, kv = _served_tiny(dev, small)
        cache, seqs = _paged_cache(cfg, kv, B, T + 1, dev)
        return cfg, folded, kv, cache, seqs, optr.prefill(folded, cache, seqs, prompt[:, :T].to(dev))
    cfg, folded, kv, cache, seqs, logits = prefilled(device)
    # token by token on the device: appends of the k, v of prefill's simulated forward
    one, _ = _paged_cache(cfg, kv, B, T + 1, device)
    captured = []
    specs = [optr.served_spec(s) for s in kv]                              # R_V is folded
    with torch.no_grad():
        sim = folded(prompt[:, :T].to(device), optr.SimulatedINT2(specs, cfg, block=256), capture=captured)
    for l, (_, k, v) in enumerate(captured):
        for t in range(T):
            one.append(l, seqs, k[:, :, t], v[:, :, t])
    names = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "win_k", "win_v",
             "block_table", "length")
    differ = [n for n in names if not torch.equal(getattr(cache, n), getattr(one, n))]
    differ += [] if torch.equal(logits, sim) else ["logits"]
    *_, cpu_cache, _, cpu_logits = prefilled(torch.device("cpu"))
    pages_as_cpu = torch.equal(cache.block_table.cpu(), cpu_cache.block_table)
    err = ((logits.cpu() - cpu_logits).abs().max() / cpu_logits.abs().max()).item()
    worst = [0.0]
    nxt = optr.decode_step(folded, cache, seqs, prompt[:, T].to(device),
                           attend=_kernel_and_reference(worst))
    ok = not differ and pages_as_cpu and err <= 0.02 and worst[0] <= 1.0 \
        and bool(torch.isfinite(nxt).all())
    return ok, (f"B={B} x {T} tokens, d={cfg.head_dim}, {int(cache.layer_view(0, seqs)['n_quant'][0])}"
                f" INT2 each; differs from appends: {differ or 'nothing'}; page ids as on the CPU: "
                f"{pages_as_cpu}; max |logits - CPU's| / max |CPU's| = {err:.1e} (pass <= 0.02); "
                f"next token's kernel vs reference {worst[0]:.2f} (pass <= 1)")


def _check_cuda_graph(device, small):
    """The unchecked launch captured in a CUDA graph and replayed after the inputs changed
    in place (new queries, shorter sequences) equals the eager reference on the new
    inputs.  Without CUDA (the dry run) the launch is simply called again."""
    torch.manual_seed(1)
    s = _DRY_SHAPE if small else _BENCH_SHAPE
    n, NW = (40 if small else 3000), s["sink"] + s["recent"]
    args = _random_inputs(2, n, s["H_q"], s["H_kv"], s["d"], s["G"], s["P"], NW,
                          torch.bfloat16, device)
    run = lambda: int2_paged_decode(**args, checked=False)
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()                                   # compile and warm up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replay = lambda: (graph.replay(), out)[1]
    else:
        replay = run
    errors = []
    for step in range(3):
        args["q"].copy_(torch.randn_like(args["q"]))
        args["n_quant"].copy_(torch.tensor([n - 7 * step, n // 2 + step], dtype=torch.int32))
        args["win_len"].copy_(torch.tensor([NW, NW - step], dtype=torch.int32))
        got = replay()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ref = paged_decode_reference(**args)
        errors.append((got - ref).abs().max().item())
    ok = max(errors) <= 2e-5
    return ok, f"3 replays with new q and lengths; max abs error vs reference {max(errors):.2e}"


def _appendix_e_run(tests, kind, device, ids, kv=None):
    """The test file's tiny random transformers model `kind` (tests.tiny_hf, seed 0) on
    `device`: calibrate_hf's specs from ids[:2] (held out: ids[2:4]), and simulate_hf's logits
    of ids[4:] in exact mode and in INT2 with kv (None: the specs just learned)."""
    import optr
    model = tests.tiny_hf(kind).to(device)
    cfg = optr.hf_config(model.config, **tests.hf_settings())
    x = ids.to(device)
    learned, _ = optr.calibrate_hf(model, x[:2], x[2:4], cfg)
    with torch.no_grad():
        with optr.simulate_hf(model, None, cfg):
            exact = model(x[4:]).logits
        with optr.simulate_hf(model, learned if kv is None else [s.to(device) for s in kv], cfg):
            int2 = model(x[4:]).logits
    return model, cfg, learned, exact, int2


def _check_transformers(device, tests=None):
    """optr's appendix E on `device` against the CPU, TF32 off, on the tiny random transformers
    models of the test module `tests` (default: the kernel's test file): a Llama (GQA) and a
    Gemma 3 (sliding layers of 12 tokens on 30, exact by calibrate_hf's default).  Judged:
    simulate_hf's logits in exact mode within 1e-4 of the CPU's largest (fp32 sums in another
    order: a 1e-6 relative jitter of every weight moves them by 1.8e-5 on the CPU, TF32's
    rounding by 2.6e-3) and in INT2 with the CPU's specs within 2e-2 (as _check_prefill: a code
    at a rounding boundary may round the other way); calibrate_hf's specs all on the device,
    the same layers in INT2, key means within 1e-4, rotations orthogonal within 1e-4 and,
    scored on the CPU, an end-to-end KL within 20% of the CPU's rotations' (the jitter: 2.4%;
    one of 1e-5: 23%).  The learned rotations are not compared entry by entry: a code that
    rounds the other way changes the STE gradient, and Adam moves each entry by about lr
    whatever its gradient's size, so even a 1e-7 jitter moved them by 0.24.
    Returns (ok, detail), or (None, why) without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, ("skipped: transformers is not importable here (the GPU machine's image "
                      "has none, and no package registry to install it from)")
    import optr
    tests = tests or _test_module(_kernel_test_file(None))
    cpu, failed, details = torch.device("cpu"), [], []
    ids = torch.randint(0, 300, (6, 30), generator=torch.Generator().manual_seed(2))
    rel = lambda a, b: ((a.cpu() - b).abs().max() / b.abs().max()).item()
    kl = lambda p, q: optr.token_kl(p, q).mean().item()                # KL(p || q) of log-probs
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for kind in ("llama-GQA", "gemma3-GQA"):
            model, cfg, ref, exact, int2 = _appendix_e_run(tests, kind, cpu, ids)
            _, _, got, dev_exact, dev_int2 = _appendix_e_run(tests, kind, device, ids, ref)
            pairs = [(a, b) for a, b in zip(got, ref) if a.r_k is not None]
            eye = torch.eye(cfg.head_dim, device=device)
            with torch.no_grad(), optr.simulate_hf(model, [s.to(cpu) for s in got], cfg):
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
            d_rot = max((x.cpu() - y).abs().max().item() for a, b in pairs
                        for x, y in ((a.r_k, b.r_k), (a.r_v, b.r_v)))
            details.append(f"{kind}: " + ", ".join(f"{n} {v:.1e}" for n, (v, _) in measured.items())
                           + f", max |R - CPU's| {d_rot:.1e} (not judged)")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return not failed, "; ".join(details) + (f"; FAILED: {', '.join(failed)}" if failed else "")


def _check_generate(device, tests=None):
    """Greedy generate() of a tiny random Llama (the test file's tiny_hf, GQA, windows 2 and 4)
    through optr.hf_cache on `device` (int2_paged_decode behind transformers' attention on CUDA)
    against the CPU (the torch reference): the same 12 tokens after a 20-token prompt, and the
    step logits within 2e-2 (as _check_prefill: a code at a rounding boundary may flip).
    Returns (ok, detail), or (None, why) without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, "skipped: transformers is not importable here"
    import optr
    tests, out = tests or _test_module(_kernel_test_file(None)), []
    for dev in (torch.device("cpu"), device):
        model = tests.tiny_hf("llama-GQA").to(dev)
        cfg = optr.hf_config(model.config, **tests.hf_settings(sink=2, window=4))
        with torch.no_grad():
            out.append(model.generate(tests.IDX_HF[:, :20].to(dev), past_key_values=optr.hf_cache(
                tests.quarot_specs(cfg, seed=7), cfg, model), max_new_tokens=12, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True))
    a, b = out
    err = max((x.cpu() - y.cpu()).abs().max().item() for x, y in zip(a.logits, b.logits))
    same = torch.equal(a.sequences.cpu(), b.sequences.cpu())
    return same and err <= 2e-2, f"tokens {'equal' if same else 'DIFFER'}, max |logit diff| {err:.1e}"


def _kernel_tests(small, seconds):
    """The kernel tests of the test file (its KERNEL_TESTS), run by pytest in a child
    process on this machine's device.  The dry run only collects them.  (ok, detail)."""
    import subprocess
    path = _kernel_test_file(None)
    names = _test_module(path).KERNEL_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    cmd += ["--collect-only"] if small else []
    cmd += [f"{path}::{name}" for name in names]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds,
                           cwd=os.path.dirname(path))
    except subprocess.TimeoutExpired:
        return False, f"{len(names)} test functions: timed out after {seconds:.0f} s"
    lines = [l for l in r.stdout.strip().splitlines() if l.strip()]
    summary = lines[-1] if lines else r.stderr.strip()[-300:]
    if r.returncode != 0:
        print(r.stdout[-6000:] + r.stderr[-2000:], flush=True)
    return r.returncode == 0, f"{len(names)} test functions: {summary}"


def gpu_check(small=False, peak_gbs=None):
    """python kernel.py --gpu-check, for a lent GPU (at most _GPU_CHECK_SECONDS): a tiny
    kernel-vs-reference check, optr.decode_step and optr.prefill on the device, a CUDA-graph
    capture and replay, tiny transformers models calibrated and simulated on the device
    against the CPU and generate() through optr.hf_cache (skipped without transformers), the kernel tests on the device and the
    bench table (batch 1 and 8, 4k to 128k tokens; rows past the time limit are skipped),
    then a summary.  small=True is the dry run on the CPU interpreter: the same steps at
    small sizes (transformers: the CPU against itself), the tests collected but not run.
    Returns the exit status: 1 if a step failed (a skipped one does not)."""
    import time
    start = time.monotonic()
    device = torch.device("cpu" if small else "cuda")
    name, peak_gbs = _peak_gbs(device, peak_gbs)
    print(f"gpu-check on {name}: triton {triton.__version__}, torch {torch.__version__}, "
          f"peak HBM {peak_gbs or 'unknown'} GB/s", flush=True)
    results = []

    def step(what, fn):
        t0 = time.monotonic()
        try:
            ok, detail = fn()
        except Exception as e:                       # a failure is a result here
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ok = None if ok is None else bool(ok)                   # None: skipped
        results.append((what, ok, detail, time.monotonic() - t0))
        print(f"[{_MARK[ok]}] {what} ({time.monotonic() - t0:.0f} s): {detail}", flush=True)

    step("tiny kernel vs reference",
         lambda: ((e := _tiny_check(device)) < 1e-5, f"max abs err {e:.2e}"))
    step("decode_step via PagedKVCache, bf16 windows", lambda: _check_decode_step(device, small))
    step("prefill into PagedKVCache, bf16 windows", lambda: _check_prefill(device, small))
    step("CUDA graph capture + replay", lambda: _check_cuda_graph(device, small))
    step("transformers models on the device vs CPU", lambda: _check_transformers(device))
    step("transformers generate() through hf_cache vs CPU", lambda: _check_generate(device))

    def bench():
        s = _DRY_SHAPE if small else _BENCH_SHAPE
        print(f"bench: H_q={s['H_q']} H_kv={s['H_kv']} d={s['d']} G={s['G']} page={s['P']} "
              f"window=bf16 sink {s['sink']} + recent {s['recent']}; x bf16 = bf16 SDPA time / "
              f"INT2 time", flush=True)
        contexts = (24, 40) if small else (4096, 16384, 32768, 65536, 131072)
        rows = []
        _print_bench((rows.append(r) or r for r in _bench_rows(
            (1, 2) if small else (1, 8), contexts, device, s, paged=False,
            deadline=start + _GPU_CHECK_SECONDS - 20)), peak_gbs)
        done = [r for r in rows if "skipped" not in r]
        return len(done) == len(rows), f"{len(done)} of {len(rows)} rows timed"
    left = _GPU_CHECK_SECONDS - (time.monotonic() - start)
    step("kernel tests on the device",
         lambda: _kernel_tests(small, max(30.0, min(260.0, left - 120))))
    step("bench", bench)

    print(f"\n{'check':<45} {'result':<6} {'s':>5}  detail")
    for what, ok, detail, seconds in results:
        print(f"{what:<45} {_MARK[ok]:<6} {seconds:>5.0f}  {detail}")
    print(f"total {time.monotonic() - start:.0f} s")
    return 0 if all(ok is not False for _, ok, _, _ in results) else 1


# ============================================================================
# Appendix A. Static analysis (python kernel.py --sass): compile for a GPU without one
# ============================================================================
# H200 figures the estimate rests on (printed with the result): HBM bandwidth, SMs, the
# base and boost clocks (HBM bytes per SM-cycle depend on the clock), schedulers per SM.
_H200 = dict(hbm_gbs=4800.0, sms=132, clocks_ghz=(1.755, 1.98), schedulers=4)
_SASS_CASE = dict(B=1, H_q=32, H_kv=8, d=128, G=128, P=64, n_quant=32768 - 320, NW=320)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _record_launch(case):
    """Run the launcher on meta tensors of a launch shape; return the recorded calls.

    case: B, H_q, H_kv, d, G, P, NW, n_quant (longest INT2 length) and, optional,
    q_dtype / win_dtype ("fp32" or "bf16", default bf16), num_splits (default None),
    num_pages and max_blocks (default: just enough pages for n_quant tokens), and
    max_tokens (what sizes the default splits: n_quant, or the block-table capacity on
    the unchecked path)."""
    c = case
    meta = torch.device("meta")
    blocks = c.get("max_blocks", triton.cdiv(c["n_quant"], c["P"]))
    num_pages = c.get("num_pages", blocks * c["B"])
    pages = (num_pages, c["H_kv"], c["P"])
    q_dtype = _DTYPES[c.get("q_dtype", "bf16")]
    win_dtype = _DTYPES[c.get("win_dtype", "bf16")]
    args = dict(
        q=torch.empty(c["B"], c["H_q"], c["d"], dtype=q_dtype, device=meta),
        k_codes=torch.empty(*pages, c["d"] // 4, dtype=torch.uint8, device=meta),
        k_scale=torch.empty(*pages, c["d"] // c["G"], device=meta),
        k_zero=torch.empty(*pages, c["d"] // c["G"], device=meta),
        v_codes=torch.empty(*pages, c["d"] // 4, dtype=torch.uint8, device=meta),
        v_scale=torch.empty(*pages, c["d"] // c["G"], device=meta),
        v_zero=torch.empty(*pages, c["d"] // c["G"], device=meta),
        block_table=torch.empty(c["B"], blocks, dtype=torch.int32, device=meta),
        n_quant=torch.empty(c["B"], dtype=torch.int32, device=meta),
        win_k=torch.empty(c["B"], c["H_kv"], c["NW"], c["d"], dtype=win_dtype, device=meta),
        win_v=torch.empty(c["B"], c["H_kv"], c["NW"], c["d"], dtype=win_dtype, device=meta),
        win_len=torch.empty(c["B"], dtype=torch.int32, device=meta))
    sizes = dict(B=c["B"], H_q=c["H_q"], H_kv=c["H_kv"], d=c["d"], P=c["P"], NW=c["NW"],
                 max_tokens=c.get("max_tokens", c["n_quant"]), num_pages=num_pages)
    recorders = {name: _Recorder(globals()[name]) for name in _KERNEL_NAMES}
    saved = {name: globals()[name] for name in recorders}
    globals().update(recorders)
    try:
        _launch(*args.values(), c["G"], c.get("num_splits"), None, sizes)
    finally:
        globals().update(saved)
    return {name: rec.calls[0] for name, rec in recorders.items() if rec.calls}


_TL_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


def _specialise(fn, args, kw):
    """(signature, constexprs, attrs, options) of a call, specialised like a real launch:
    pointers and ints divisible by 16 get the divisibility hint, ints equal to 1 are
    constants.  Two calls with equal results compile to the same kernel."""
    import inspect
    params = inspect.signature(fn.fn).parameters     # works compiled and interpreted
    names = list(params)
    signature, constexprs, attrs = {}, {}, {}
    options = {k: kw[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    values = dict(zip(names, args))
    values.update({k: v for k, v in kw.items() if k not in options})
    for i, name in enumerate(names):
        v = values[name]
        if params[name].annotation in (tl.constexpr, "tl.constexpr"):
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TL_TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"cannot specialise argument {name} = {v!r}")
        elif isinstance(v, float):
            signature[name] = "fp32"
        elif v == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def _compile_recorded(fn, args, kw, arch):
    """triton.compile the recorded call for sm_<arch> (cubin in .asm['cubin'])."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs, attrs, options = _specialise(fn, args, kw)
    target = GPUTarget("cuda", arch, 32)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options)


def _nvidia_tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _sass_of(compiled, disassemble=True):
    """(resource usage dict, list of (offset, opcode, text, source line) SASS lines,
    label -> offset).  Spills are the local-memory stores and loads in the SASS."""
    import re
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True, check=True).stdout
        dis = subprocess.run([_nvidia_tool("nvdisasm"), "-c", "-g", path],
                             capture_output=True, text=True, check=True).stdout
    usage = {key: int(m.group(1)) if (m := re.search(rf"{pat}:(\d+)", res)) else 0
             for key, pat in (("regs", "REG"), ("stack", "STACK"), ("smem", "SHARED"))}
    lines, labels = [], {}
    pending, src_line = [], 0
    for raw in dis.splitlines():
        if (m := re.search(r'//## File ".*", line (\d+)', raw)):
            src_line = int(m.group(1))
            continue
        if (m := re.match(r"\s*(\.L_x_\d+):", raw)):
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", raw)
        if not m:
            continue
        offset, text = int(m.group(1), 16), m.group(2).strip()
        for label in pending:
            labels[label] = offset
        pending = []
        body = re.sub(r"^@!?U?P[T\d]+\s+", "", text)
        lines.append((offset, body.split()[0], body, src_line))
    usage["spill_stores"] = sum(1 for _, op, _, _ in lines if op.startswith("STL"))
    usage["spill_loads"] = sum(1 for _, op, _, _ in lines if op.startswith("LDL"))
    return usage, lines, labels


def _loops(lines, labels):
    """Backward branches: list of (start offset, end offset) of each loop body."""
    import re
    loops = []
    for offset, op, text, _ in lines:
        if op.startswith("BRA") and (m := re.search(r"`\((\.L_x_\d+)\)", text)):
            target = labels.get(m.group(1))
            if target is not None and target <= offset:
                loops.append((target, offset))
    return loops


# Instruction classes of the per-iteration table, matched on the opcode's prefix.
_CLASSES = [("LDG", ("LDG",)), ("LDGSTS", ("LDGSTS",)), ("LDS", ("LDS", "LDSM")),
            ("STS", ("STS",)), ("LDL/STL", ("LDL", "STL")), ("I2F", ("I2F",)),
            ("F2F", ("F2F", "F2FP")), ("HMMA", ("HMMA",)), ("HADD2/HFMA2", ("HADD2", "HFMA2", "HMUL2")),
            ("FFMA", ("FFMA",)), ("FADD/FMUL", ("FADD", "FMUL")), ("MUFU", ("MUFU",)),
            ("IMAD", ("IMAD",)), ("LOP3", ("LOP3",)), ("SHF", ("SHF",)), ("PRMT", ("PRMT",)),
            ("shuffles", ("SHFL",)), ("FSEL/SEL", ("FSEL", "SEL")),
            ("IADD3/ISETP", ("IADD3", "ISETP", "FSETP")), ("BAR", ("BAR",))]

_LOAD_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def _is(op, prefixes):
    return any(op == p or op.startswith(p + ".") for p in prefixes)


def _classify(ops):
    counts = {name: 0 for name, _ in _CLASSES}
    counts["other"] = 0
    for op in ops:
        for name, prefixes in _CLASSES:
            if _is(op, prefixes):
                counts[name] += 1
                break
        else:
            counts["other"] += 1
    return counts


def _lane_bytes(op):
    """Bytes per lane of a load or store opcode (32-bit unless the opcode says otherwise)."""
    return next((b for suffix, b in _LOAD_BYTES.items() if f".{suffix}" in op), 4)


def _global_bytes(ops):
    """Bytes per warp that the LDG / LDGSTS instructions request (all 32 lanes active)."""
    return sum(32 * _lane_bytes(op) for op in ops if op.startswith("LDG"))


# The pipe model: cycles each class of SASS instruction occupies its pipe, per warp
# instruction.  Scheduler-side pipes (one of each per SM sub-partition, 4 per SM):
#   integer/logic (ALU; LOP3, SHF, PRMT, IADD3, compares, selects, min/max, moves):
#     16 lanes per cycle, 2 cycles a warp instruction;
#   FMA: fp32 FFMA/FADD/FMUL and packed fp16 HFMA2/HADD2/HMUL2 on two 16-lane halves
#     (1 cycle a warp instruction); IMAD only on one half (2 cycles), so the pipe needs
#     max(2 * IMAD, fp + IMAD) cycles;
#   special functions and conversions (MUFU, F2F, F2FP, I2F, F2I): 4 lanes, 8 cycles;
#   tensor: mma.sync at the sm_80 rate per sub-partition, 512 fp16 (256 tf32) FLOP per
#     cycle, so HMMA.16816 (m16 n8 k16, 4,096 FLOP) takes 8 cycles; Hopper's dense peak
#     is twice that but only through wgmma, which Triton does not use for these shapes.
# Shared memory, one per SM: 128 bytes per cycle for LDS/LDSM/STS/LDGSTS, one cycle per
# shuffle.  Issue: one instruction per scheduler per cycle.
_ALU_OPS = ("LOP3", "SHF", "PRMT", "IADD3", "ISETP", "FSETP", "HSETP2", "SEL", "FSEL", "MOV",
            "FMNMX", "IMNMX", "LEA", "IABS", "PLOP3", "P2R", "R2P", "SGXT", "BMSK", "LOP",
            "ISCADD", "FLO", "POPC", "VIADD", "VIMNMX", "UIADD3", "ULOP3", "USHF", "UMOV")
_FP_OPS = ("FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD")
_XU_OPS = ("MUFU", "F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")
_SHARED_OPS = ("LDS", "LDSM", "STS", "LDGSTS")
_LDSM_BYTES = {"1": 128, "2": 256, "4": 512}
_PIPES = ("issue", "integer/logic", "FMA", "special/convert", "tensor", "shared memory")


def _hmma_cycles(op):
    """Tensor-pipe cycles of one HMMA (shape from the opcode, e.g. HMMA.16816.F32)."""
    import re
    m = re.match(r"HMMA\.(16)(8)(\d+)", op)
    flop = 2 * 16 * 8 * int(m.group(3)) if m else 4096
    rate = 256 if "TF32" in op else 512
    return flop / rate


def _shared_cycles(op):
    """Shared-memory cycles of one warp instruction (128 bytes per SM-cycle)."""
    import re
    if op.startswith("SHFL"):
        return 1.0
    if op.startswith("LDSM"):
        m = re.search(r"\.(\d)$", op)
        return _LDSM_BYTES.get(m.group(1) if m else "4", 512) / 128
    return 32 * _lane_bytes(op) / 128


def _pipe_cycles(ops, warps, per_tile):
    """SM cycles per 64-token tile that each pipe needs for the loop body `ops` (one
    warp's instructions) run by `warps` warps, scaled by per_tile (64 / tokens per
    iteration); the sub-partition pipes serve warps / 4 of the warps each."""
    n = lambda prefixes: sum(1 for op in ops if _is(op, prefixes))
    imad, fp = n(("IMAD", "IMUL")), n(_FP_OPS)
    per_smsp = {
        "issue": len(ops),
        "integer/logic": 2 * n(_ALU_OPS),
        "FMA": max(2 * imad, fp + imad),
        "special/convert": 8 * n(_XU_OPS),
        "tensor": sum(_hmma_cycles(op) for op in ops if op.startswith("HMMA")),
    }
    smsp_share = warps / _H200["schedulers"] * per_tile
    cycles = {k: v * smsp_share for k, v in per_smsp.items()}
    cycles["shared memory"] = warps * per_tile * sum(
        _shared_cycles(op) for op in ops if _is(op, _SHARED_OPS + ("SHFL",)))
    return cycles


def _hbm_cycles(tile_bytes, clock_ghz):
    """SM cycles the HBM needs for tile_bytes at clock_ghz (bandwidth shared by all SMs)."""
    return tile_bytes / (_H200["hbm_gbs"] / _H200["sms"] / clock_ghz)


def _compile_stage1(arch, case, config):
    """Record stage 1's launch at `case`, compile it for sm_<arch>, return (kw, SASS)."""
    calls = _record_launch(case)
    grid, args, kw = calls["_int2_decode_split_kernel"]
    kw = dict(kw)
    if "DOT_PRECISION" in kw:
        kw["DOT_PRECISION"] = "tf32x3"     # what the launcher picks on sm80+
    kw.update(config or {})
    return kw, _sass_of(_compile_recorded(_int2_decode_split_kernel, args, kw, arch))


def sass_report(arch=90, case=None, verbose=True, config=None):
    """Compile stage 1 for sm_<arch> at the bench case and analyse its INT2 loop.

    The INT2 loop is the innermost backward-branch loop holding the most instructions
    of _codes_fp16 (the unpacking of the code bytes, found by the SASS line info).
    config overrides launch meta-parameters (BLOCK_N, num_warps, ...).  Returns a dict
    of the figures, the issue/HBM ratio at the base clock; prints a table if verbose."""
    case = dict(_SASS_CASE, **(case or {}))
    kw, (usage, lines, labels) = _compile_stage1(arch, case, config)
    loops = _loops(lines, labels)
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1]
                                           for o in loops)]
    import inspect
    src, first = inspect.getsourcelines(_codes_fp16.fn)
    unpack = range(first, first + len(src))
    start, end = max(inner, key=lambda lp: sum(1 for off, _, _, ln in lines
                                               if lp[0] <= off <= lp[1] and ln in unpack))
    body = [op for off, op, _, _ in lines if start <= off <= end]
    counts = _classify(body)
    warps = kw.get("num_warps", 4)
    tokens = kw["BLOCK_N"]                  # tokens of one KV head per loop iteration
    per_tile = 64 / tokens
    d, G = case["d"], case["G"]
    tile_bytes = 64 * 2 * (d // 4 + 2 * 4 * (d // G))
    pipes = _pipe_cycles(body, warps, per_tile)
    clocks = _H200["clocks_ghz"]
    hbm = {ghz: _hbm_cycles(tile_bytes, ghz) for ghz in clocks}
    global_bytes = _global_bytes(body) * warps
    r = dict(arch=arch, regs=usage["regs"], spills=usage["spill_stores"] + usage["spill_loads"],
             spill_stores=usage["spill_stores"], spill_loads=usage["spill_loads"],
             stack=usage["stack"], smem=usage["smem"], total=len(lines), loop=len(body),
             counts=counts, warps=warps, tokens=tokens, global_bytes=global_bytes,
             tile_bytes=tile_bytes, pipes=pipes, hbm_cycles=hbm[clocks[0]],
             issue_cycles=pipes["issue"], ratio=pipes["issue"] / hbm[clocks[0]],
             binding=max(pipes, key=pipes.get),
             ratios={ghz: {k: v / hbm[ghz] for k, v in pipes.items()} for ghz in clocks})
    if verbose:
        print(f"sm_{arch}: {r['regs']} registers, {r['stack']} B stack, "
              f"{r['spill_stores']} spill stores + {r['spill_loads']} spill loads, "
              f"{r['smem']} B shared memory, {r['total']} SASS instructions, "
              f"num_warps {warps}")
        print(f"  INT2 loop: {len(body)} instructions per warp per iteration "
              f"({tokens} tokens of one KV head)")
        print("  " + " | ".join(f"{k} {v}" for k, v in counts.items() if v))
        print(f"  global loads per iteration (all warps, all lanes): {global_bytes} B; "
              f"the {tokens}-token K+V tile holds {tile_bytes * tokens // 64} B")
        head = "".join(f" | / HBM at {ghz} GHz" for ghz in clocks)
        print(f"  per 64-token tile ({tile_bytes} B; HBM "
              + ", ".join(f"{hbm[ghz]:.0f} cycles at {ghz} GHz" for ghz in clocks) + ")")
        print(f"  {'pipe':<16} | SM cycles{head}")
        for name in _PIPES:
            print(f"  {name:<16} | {pipes[name]:9.0f}"
                  + "".join(f" | {pipes[name] / hbm[ghz]:16.2f}" for ghz in clocks))
        print(f"  binding pipe: {r['binding']} ({pipes[r['binding']] / hbm[clocks[0]]:.2f}x "
              f"the HBM time at {clocks[0]} GHz, "
              f"{pipes[r['binding']] / hbm[clocks[1]]:.2f}x at {clocks[1]} GHz)")
    return r


def _sass_main():
    """Print the --sass report; runs in a child process with the interpreter off."""
    c = _SASS_CASE
    print(f"case: d = {c['d']}, G = {c['G']}, page {c['P']}, {c['H_q'] // c['H_kv']} query "
          f"heads per KV head, bf16 q and windows, {c['n_quant'] + c['NW']} tokens")
    bpc = ", ".join(f"{_H200['hbm_gbs'] / _H200['sms'] / ghz:.1f} B per SM-cycle at {ghz} GHz"
                    for ghz in _H200["clocks_ghz"])
    print(f"H200 assumptions: {_H200['hbm_gbs']:.0f} GB/s HBM over {_H200['sms']} SMs = "
          f"{bpc}; {_H200['schedulers']} schedulers per SM issuing 1 instruction per cycle "
          f"each; all loads full-width with no cache reuse; pipe rates in kernel._pipe_cycles")
    results = {arch: sass_report(arch) for arch in (80, 90)}
    r = results[90]
    print(f"SASS sm_90a: regs {r['regs']} | spills {r['spills']} | "
          f"issue/HBM cycles per tile {r['ratio']:.2f}")


def _compile_job(job):
    """Compile one recorded call for one architecture; (registers, spills, smem) or the
    error text.  Module-level so that a process pool can run it."""
    name, args, kw, arch = job
    try:
        usage, _, _ = _sass_of(_compile_recorded(globals()[name], args, kw, arch))
        return usage["regs"], usage["spill_stores"] + usage["spill_loads"], usage["smem"]
    except Exception as e:                        # a compile failure is a result here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def config_key(name, args, kw):
    """A string naming the compiled kernel that the call kernel `name`[grid](*args, **kw)
    gets (equal keys, one compilation); the fp32 dot precision is left out (the launcher
    picks it from the device)."""
    kw = dict(kw, DOT_PRECISION="tf32x3") if "DOT_PRECISION" in kw else kw
    sig, const, attrs, opts = _specialise(globals()[name], args, kw)
    return repr((name, sorted(sig.items()), sorted(const.items()),
                 sorted(attrs.items()), sorted(opts.items())))


def sass_coverage(launches, archs=(90, 80), verbose=True, workers=1):
    """Compile every distinct kernel configuration among `launches` (launch shapes as in
    _record_launch) for each architecture; returns a list of rows (kernel, arch, the
    specialisation's constexprs, registers, spills, shared memory, error or None) and
    prints one line per row and the summary line if verbose."""
    jobs, keys = [], set()
    for case in launches:
        for name, (grid, args, kw) in _record_launch(case).items():
            kw = dict(kw)
            if "DOT_PRECISION" in kw:
                kw["DOT_PRECISION"] = "tf32x3"
            key = config_key(name, args, kw)
            for arch in archs:
                if (key, arch) not in keys:
                    keys.add((key, arch))
                    jobs.append((name, args, kw, arch))
    if workers > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            results = list(pool.map(_compile_job, jobs))
    else:
        results = [_compile_job(job) for job in jobs]
    rows = []
    for (name, args, kw, arch), res in zip(jobs, results):
        shown = {k: v for k, v in kw.items() if k.isupper() or k.startswith("num_")}
        err = res if isinstance(res, str) else None
        regs, spills, smem = (0, 0, 0) if err else res
        rows.append(dict(kernel=name, arch=arch, config=shown, regs=regs, spills=spills,
                         smem=smem, error=err))
        if verbose:
            what = err or f"regs {regs:3d} | spills {spills:3d} | smem {smem:6d} B"
            cfg = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"sm_{arch} {name}: {what} | {cfg}", flush=True)
    if verbose:
        print(f"SASS coverage: {len(rows)} configurations | "
              f"failures {sum(1 for r in rows if r['error'])} | "
              f"with spills {sum(1 for r in rows if r['spills'])} | "
              f"max regs {max((r['regs'] for r in rows), default=0)}")
    return rows


def _kernel_test_file(path):
    """The test file of the kernel: `path`, or (None) the test_*.py file beside this one,
    or under tests/, that defines KERNEL_LAUNCHES."""
    import glob
    if path is not None:
        return os.path.abspath(path)
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(glob.glob(os.path.join(here, "test_*.py"))
                   + glob.glob(os.path.join(here, "tests", "test_*.py")))
    path = next((f for f in files if "KERNEL_LAUNCHES" in open(f).read()), None)
    if path is None:
        raise SystemExit("no test file beside kernel.py defines KERNEL_LAUNCHES; "
                         "pass --tests PATH")
    return path


def _test_module(path):
    """The test module at `path`, imported (its KERNEL_LAUNCHES and KERNEL_TESTS)."""
    import importlib.util
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("_kernel_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_check_launches():
    """The launch shapes of --gpu-check at its full sizes: the bench rows, the CUDA-graph
    launch (unchecked: splits sized from the block table) and the decode_step and prefill
    checks (fp32 queries from the model, a block table as wide as the page pool, 1, 2 or 4
    splits)."""
    s = _BENCH_SHAPE
    NW = s["sink"] + s["recent"]
    shape = dict(H_q=s["H_q"], H_kv=s["H_kv"], d=s["d"], G=s["G"], P=s["P"], NW=NW)
    bench = [dict(shape, B=B, n_quant=ctx - NW) for B in (1, 8)
             for ctx in (4096, 16384, 32768, 65536, 131072)]
    blocks = triton.cdiv(3000, s["P"])
    graph = [dict(shape, B=2, n_quant=3000, max_tokens=blocks * s["P"])]
    decode = [dict(B=3, H_q=8, H_kv=2, d=128, G=128, P=16, NW=8, n_quant=n, num_pages=pages,
                   max_blocks=pages, q_dtype="fp32") for n, pages in ((1, 26), (112, 26), (193, 41))]
    return bench + graph + decode


def _tested_launches(path):
    """The launch shapes of the kernel tests (KERNEL_LAUNCHES of the test module at
    `path`, see _kernel_test_file), of the launcher's own small check (_tiny_check) and
    of --gpu-check."""
    module = _test_module(_kernel_test_file(path))
    return list(module.KERNEL_LAUNCHES) + [_TINY_LAUNCH] + _gpu_check_launches()


def _sass_all_main(tests_path):
    """--sass --all: every configuration the kernel tests launch, sm_90a and sm_80."""
    launches = _tested_launches(tests_path)
    print(f"{len(launches)} kernel-test launches; compiling each distinct configuration of "
          f"both kernels for sm_90a and sm_80")
    rows = sass_coverage(launches, workers=max(1, min(4, os.cpu_count() or 1)))
    bad = any(r["error"] or r["spills"] for r in rows)
    raise SystemExit(1 if bad else 0)


def _run_sass(all_configs=False, tests_path=None):
    """--sass must compile the real kernel: re-run this file with the interpreter off."""
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = (f"import kernel; kernel._sass_all_main({tests_path!r})" if all_configs
            else "import kernel; kernel._sass_main()")
    r = subprocess.run([sys.executable, "-c", code], env=env,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(r.returncode)


# ============================================================================
# Appendix B. Interpreter set-up (the switch itself is at the top, before triton is imported)
# ============================================================================
def _memoize_interpreter_scan():
    """Make nested @triton.jit calls cheap in Triton's CPU interpreter.

    On every call of a @triton.jit helper from a kernel (our _codes_fp16, _quarter_pv, ...,
    and tl.sum, tl.max, tl.cdiv, which are @triton.jit functions too) the interpreter
    re-patches triton.language, finding its builtins with inspect.getmembers over each
    module: ~1 ms per call, several times the arithmetic of a whole tile.  The set of
    builtin names of a module never changes, so it is found once per module here; each
    call still re-checks and patches every one of them exactly as before."""
    import inspect
    from triton.runtime import interpreter
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "memoized", False) \
            or not hasattr(interpreter, "_patch_attr"):
        return                                    # another Triton layout: leave it alone
    names = {}

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in names:
            names[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg)
                                    if tl.core.is_builtin(m)])
        for name in names[id(pkg)][1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.memoized = True
    patch_builtin.builtin_names = lambda pkg: list(names[id(pkg)][1]) if id(pkg) in names else None
    interpreter._patch_builtin = patch_builtin


if _INTERPRETED:
    _memoize_interpreter_scan()


def main():
    parser = argparse.ArgumentParser(description="INT2 paged decode attention kernel.")
    parser.add_argument("--bench", action="store_true",
                        help="time the kernel against a bf16 SDPA baseline (needs CUDA; "
                             "on CPU runs a small interpreter correctness check instead)")
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="peak memory bandwidth in GB/s for the %%peak column "
                             "(default: looked up from the GPU name)")
    parser.add_argument("--sass", action="store_true",
                        help="compile stage 1 for sm_90a and sm_80 (no GPU needed) and print "
                             "registers, spills, the INT2 loop's instruction mix and its "
                             "pipe model")
    parser.add_argument("--all", action="store_true",
                        help="with --sass: compile every configuration the kernel tests launch "
                             "(KERNEL_LAUNCHES of the test file) for sm_90a and sm_80 and list "
                             "registers, spills and shared memory of each")
    parser.add_argument("--tests", default=None,
                        help="with --sass --all: the test file that defines KERNEL_LAUNCHES "
                             "(default: the test_*.py beside kernel.py that does)")
    parser.add_argument("--gpu-check", action="store_true",
                        help="on a CUDA GPU (at most 8 minutes): a tiny check, optr.decode_step "
                             "on the GPU, a CUDA-graph replay, tiny transformers models "
                             "calibrated and simulated on the GPU against the CPU (where "
                             "transformers is importable), the bench table (batch 1 and 8, "
                             "4k-128k tokens) and the kernel tests; exits 2 without CUDA")
    parser.add_argument("--bench-hf", action="store_true",
                        help="SmolLM2 (or --model) through transformers, DynamicCache against "
                             "optr.hf_cache: prefill s, decode ms/token, cache and peak MiB at "
                             "--contexts tokens (the kernel on CUDA, the torch reference on CPU)")
    parser.add_argument("--model", default="smollm2", help="with --bench-hf: smollm2 or gemma3-270m")
    parser.add_argument("--contexts", default="1024,4096,8000", help="with --bench-hf: prompt lengths")
    parser.add_argument("--rows", default=",".join(BENCH_HF_ROWS), help="with --bench-hf: caches to time")
    parser.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)  # CPU test
    args = parser.parse_args()
    if args.bench_hf:
        _bench_hf(args.model, tuple(int(t) for t in args.contexts.split(",")), rows=tuple(args.rows.split(",")))
        return
    if args.sass:
        _run_sass(args.all, args.tests)
    if args.gpu_check:
        if args.dry_run:
            raise SystemExit(gpu_check(small=True, peak_gbs=args.peak_gbs))
        if not torch.cuda.is_available() or _INTERPRETED:
            print("--gpu-check needs a CUDA GPU and there is none here (or TRITON_INTERPRET=1 "
                  "is set); nothing was checked", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(gpu_check(peak_gbs=args.peak_gbs))
    if not args.bench:
        parser.print_help()
        return
    if torch.cuda.is_available() and not _INTERPRETED:
        _bench(args.peak_gbs)
    else:
        print("the benchmark needs a CUDA GPU; running a small correctness check with the "
              "Triton interpreter instead")
        print(f"max abs error, kernel vs torch reference: {_tiny_check(torch.device('cpu')):.2e}")


if __name__ == "__main__":
    main()
