"""
The executable spec of OptR. Read it top to bottom to learn the method: each test's
docstring states one claim of the paper (or of this implementation's contract) in words,
and the test checks it. Equation numbers follow optr.py / docs/METHOD.md.

Sections: the INT2 quantizer, rotations (Eq. 4), key centering, the exact error
decomposition (Eq. 5-10), OptR calibration, the tiny model, the paged cache, bad input,
the Triton decode kernel, and the end-to-end script.
"""
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

import kernel  # first: without CUDA it switches Triton to its interpreter before import
import optr
from kernel import int2_paged_decode

F64 = torch.float64


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)


def random_orthogonal(d, seed=0, dtype=torch.float32):
    q, r = torch.linalg.qr(rand(d, d, seed=seed, dtype=F64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


# ----------------------------------------------------------------------------------------
# Hypothesis strategies: small bounded shapes, finite floats, adversarial values on purpose
# ----------------------------------------------------------------------------------------

@st.composite
def gqa_shapes(draw, max_t=65):
    """(B, H_q, H_kv, T, d) with GQA ratio 1, 2 or 4, head_dim 8..64, lengths incl. 1 and
    page-boundary values."""
    h_kv = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16, 32, 64]))
    T = draw(st.sampled_from([t for t in (1, 2, 7, 15, 16, 17, 63, 64, 65) if t <= max_t]))
    B = draw(st.integers(1, 2))
    return B, h_kv * ratio, h_kv, T, d


@st.composite
def quant_rows(draw):
    """(x (rows, d), G) with values in one of several regimes: plain Gaussian, one channel
    scaled x1e4, constant groups, or tiny values."""
    d = draw(st.sampled_from([8, 16, 32, 64]))
    G = draw(st.sampled_from([g for g in (4, 8, 16, 32, 64) if d % g == 0]))
    rows = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    x = rand(rows, d, seed=seed)
    regime = draw(st.sampled_from(["gauss", "outlier", "constant", "tiny", "offset"]))
    if regime == "outlier":
        x[:, draw(st.integers(0, d - 1))] *= 1e4
    elif regime == "constant":
        x = torch.full((rows, d), draw(st.floats(-100, 100, allow_nan=False, allow_subnormal=False, width=32)))
    elif regime == "tiny":
        x = x * 1e-6
    elif regime == "offset":
        x = x + draw(st.floats(-50, 50, allow_nan=False, allow_subnormal=False, width=32))
    return x, G


# ----------------------------------------------------------------------------------------
# 2. The INT2 quantizer
# ----------------------------------------------------------------------------------------

@given(quant_rows(), st.sampled_from([1.0, 0.96, 0.92, 0.5]))
def test_q2_codes_levels_and_rounding_error(data, clip):
    """Q2 stores codes in [0, 3]; each group dequantizes to at most 4 distinct levels; an
    element inside the clip range is off by at most half a step (scale / 2)."""
    x, G = data
    packed, scale, zero = optr.q2_quantize(x, clip, G)
    codes = optr.unpack_int2(packed)
    assert codes.max() <= 3
    deq = optr.q2_dequantize(packed, scale, zero, G)
    xg, dg = x.view(x.shape[0], -1, G), deq.view(x.shape[0], -1, G)
    for r in range(xg.shape[0]):
        for g in range(xg.shape[1]):
            assert dg[r, g].unique().numel() <= 4
    rank = min(int(math.floor(clip * G)), G - 1)
    tau = xg.abs().sort(-1).values[..., rank:rank + 1]
    inside = xg.abs() <= tau
    err = (xg - dg).abs()
    bound = scale.view(x.shape[0], -1, 1) / 2 * (1 + 1e-5) + 1e-6 * xg.abs()
    assert torch.all(err[inside] <= bound.expand_as(err)[inside])
    assert torch.isfinite(deq).all()


@given(quant_rows(), st.sampled_from([1.0, 0.96, 0.92]))
def test_storage_form_equals_fake_quant_bit_for_bit(data, clip):
    """Quantize-pack-unpack-dequantize reproduces the differentiable fake-quant forward
    exactly, so what calibration optimizes is what the cache serves."""
    x, G = data
    fake = optr.q2(x, clip, G)
    stored = optr.q2_dequantize(*optr.q2_quantize(x, clip, G), G)
    assert torch.equal(fake, stored)


@given(st.sampled_from([4, 8, 32, 128]), st.integers(1, 5), st.integers(0, 1000))
def test_pack_unpack_round_trip(d, rows, seed):
    """pack_int2 puts 4 codes in a byte and unpack_int2 returns them unchanged."""
    codes = torch.randint(0, 4, (rows, d), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = optr.pack_int2(codes)
    assert packed.shape == (rows, d // 4) and packed.dtype == torch.uint8
    assert torch.equal(optr.unpack_int2(packed), codes)


def test_pack_layout_is_strided_quarters():
    """Byte j of a d-channel row holds channels j, j + d/4, j + d/2, j + 3d/4 in bits
    0-1, 2-3, 4-5, 6-7 (the layout the kernel unpacks)."""
    d = 16
    codes = torch.zeros(d, dtype=torch.uint8)
    codes[1], codes[1 + 4], codes[1 + 8], codes[1 + 12] = 1, 2, 3, 1
    packed = optr.pack_int2(codes)
    assert packed[1].item() == 1 | (2 << 2) | (3 << 4) | (1 << 6)
    assert packed[0].item() == 0 and packed[2].item() == 0


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 1e6])
def test_constant_group_quantizes_exactly(value):
    """A constant group has zero range; the scale floor makes it exact instead of 0/0."""
    x = torch.full((3, 32), value)
    assert torch.equal(optr.q2(x, 0.96, 16), x)
    assert torch.equal(optr.q2_dequantize(*optr.q2_quantize(x, 0.96, 16), 16), x)


def test_clip_rank_follows_the_authors_rule():
    """tau is the |x| at rank floor(c*G) of the group's sorted magnitudes, so with G = 8 and
    c = 0.8 the largest magnitude (rank 7) is clipped to the one at rank 6."""
    x = torch.tensor([[0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -9.0]])
    xg, scale, zero = optr._q2_params(x, 0.8, 8, 1e-8)
    assert xg.abs().max().item() == pytest.approx(0.7)
    assert xg[0, 0, -1].item() == pytest.approx(-0.7)


def test_straight_through_gradients_reach_A():
    """Gradients of an output loss pass the rounding (straight-through) and reach the
    skew parameter A of R = R_base exp(A - A^T); they also flow through scale and zero."""
    z = rand(2, 2, 9, 16, seed=1)
    A = torch.zeros(2, 16, 16, requires_grad=True)
    R = optr.optr_rotation(optr.quarot_rotation(2, 16), A)
    loss = (optr.rotate_dequant(z, R, 0.96, 16) - z).pow(2).sum()
    loss.backward()
    assert torch.isfinite(A.grad).all() and A.grad.abs().sum() > 0
    x = rand(4, 16, seed=2).requires_grad_()
    optr.q2(x, 1.0, 16).sum().backward()
    assert not torch.allclose(x.grad, torch.ones_like(x))   # scale/zero terms, not identity


# ----------------------------------------------------------------------------------------
# 3. Rotations (Eq. 4)
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 8, 32, 128, 256])
def test_hadamard_is_generated_orthogonal_and_flat(d):
    """H_d / sqrt(d) is orthogonal with every entry +-1/sqrt(d): it spreads each channel
    evenly over all channels."""
    H = optr.hadamard(d, F64)
    assert torch.allclose(H @ H.T, torch.eye(d, dtype=F64), atol=1e-12)
    assert torch.allclose(H.abs(), torch.full_like(H, 1 / math.sqrt(d)))


@given(st.sampled_from([4, 8, 32, 64]), st.floats(0.0, 10.0, allow_nan=False, width=32),
       st.integers(0, 10_000), st.sampled_from(["identity", "quarot", "random"]))
def test_optr_rotation_is_orthogonal_for_any_A(d, amp, seed, base):
    """R = R_base exp(A - A^T) is orthogonal whatever A is, and equals R_base at A = 0."""
    H = 2
    r_base = {"identity": optr.identity_rotation(H, d), "quarot": optr.quarot_rotation(H, d),
              "random": torch.stack([random_orthogonal(d, seed + i) for i in range(H)])}[base]
    A = rand(H, d, d, seed=seed, scale=amp)
    R = optr.optr_rotation(r_base, A)
    err = (R.transpose(-1, -2) @ R - torch.eye(d)).abs().max()
    assert err <= 1e-5
    assert torch.equal(optr.optr_rotation(r_base, torch.zeros(H, d, d)), r_base)


@given(gqa_shapes(), st.integers(0, 10_000))
def test_rotation_only_changes_the_basis(shape, seed):
    """Eq. 4: with Q2 replaced by the identity, D_R(z) = z R R^T = z for any orthogonal R."""
    B, _, H, T, d = shape
    z = rand(B, H, T, d, seed=seed)
    R = torch.stack([random_orthogonal(d, seed + h) for h in range(H)])
    out = optr.rotate_dequant(z, R, 1.0, d)
    saved = optr.q2
    try:
        optr.q2 = lambda x, *args, **kw: x
        ident = optr.rotate_dequant(z, R, 1.0, d)
    finally:
        optr.q2 = saved
    assert torch.allclose(ident, z, atol=1e-5)
    assert not torch.allclose(out, z, atol=1e-5) or T * d < 8  # with real Q2 there is error


def test_oscar_base_is_eigenbasis_then_hadamard_then_bit_reversal():
    """OSCAR's R = U H P: U the covariance eigenvectors by descending eigenvalue, H the
    Hadamard, P the bit-reversal permutation; R is orthogonal."""
    d = 16
    X = rand(500, d, seed=3) * torch.linspace(5, 0.1, d)
    cov = X.T @ X / 500
    R = optr.oscar_rotation(cov)
    assert (R.T @ R - torch.eye(d)).abs().max() < 1e-5
    perm = optr.bit_reversal_permutation(d)
    assert sorted(perm.tolist()) == list(range(d)) and perm[1].item() == d // 2
    inv = torch.argsort(perm)
    U = (R[:, inv].double() @ optr.hadamard(d, F64).T)
    evals = torch.diagonal(U.T @ cov.double() @ U)
    assert torch.all(evals[:-1] >= evals[1:] - 1e-6)                 # descending
    off = U.T @ cov.double() @ U - torch.diag(evals)
    assert off.abs().max() < 1e-4                                      # diagonalizes cov


# ----------------------------------------------------------------------------------------
# 4. Key centering
# ----------------------------------------------------------------------------------------

@given(gqa_shapes(), st.integers(0, 10_000), st.floats(0.0, 10.0, allow_nan=False, width=32))
def test_key_centering_leaves_softmax_unchanged(shape, seed, mu_scale):
    """Subtracting the same mu from every (post-RoPE) key shifts all logits of a query
    by the same -<q, mu>/sqrt(d), so every attention distribution is unchanged."""
    B, Hq, Hkv, T, d = shape
    q = rand(B, Hq, 3, d, seed=seed, dtype=F64)
    k = rand(B, Hkv, T, d, seed=seed + 1, dtype=F64)
    mu = rand(Hkv, d, seed=seed + 2, dtype=F64, scale=mu_scale)
    p = torch.softmax(optr.gqa_logits(q, k), -1)
    pc = torch.softmax(optr.gqa_logits(q, optr.center_keys(k, mu)), -1)
    assert (p - pc).abs().max() <= 1e-12


def test_centering_must_come_after_rope():
    """The same mean subtracted *before* RoPE is not a constant shift after it (RoPE turns
    mu differently at each position), so it would change the attention."""
    d, T = 16, 12
    cos, sin = optr.rope_cos_sin(torch.arange(T)[None], d, 10000.0)
    k_pre = rand(1, 1, T, d, seed=4) + 3.0
    q = optr.apply_rope(rand(1, 1, 1, d, seed=5), *optr.rope_cos_sin(torch.tensor([[T - 1]]), d, 1e4))
    mu = k_pre.mean(dim=2, keepdim=True)
    p = torch.softmax(optr.gqa_logits(q, optr.apply_rope(k_pre, cos, sin)), -1)
    p_pre = torch.softmax(optr.gqa_logits(q, optr.apply_rope(k_pre - mu, cos, sin)), -1)
    mu_post = optr.key_mean(optr.apply_rope(k_pre, cos, sin))
    p_post = torch.softmax(optr.gqa_logits(q, optr.center_keys(optr.apply_rope(k_pre, cos, sin), mu_post)), -1)
    assert (p - p_pre).abs().max() > 1e-3
    assert (p - p_post).abs().max() < 1e-6


def test_centering_shrinks_the_int2_error_of_offset_keys():
    """Keys with large per-channel offsets waste INT2's four levels on the offset; stored
    as k - mu they quantize with a much smaller error."""
    k = rand(4, 2, 64, 32, seed=6) + 8 * rand(1, 2, 1, 32, seed=7)
    mu = optr.key_mean(k)
    err = (optr.q2(k, 1.0, 32) - k).pow(2).sum()
    err_c = (optr.q2(optr.center_keys(k, mu), 1.0, 32) + mu[None, :, None] - k).pow(2).sum()
    assert err_c < 0.5 * err


# ----------------------------------------------------------------------------------------
# 5. Where the error goes (Eq. 5-10)
# ----------------------------------------------------------------------------------------

@st.composite
def perturbed_attention(draw):
    B, Hq, Hkv, T, d = draw(gqa_shapes())
    Tq = draw(st.integers(1, min(T, 5)))
    seed = draw(st.integers(0, 10_000))
    d_model = draw(st.sampled_from([8, 24]))
    dk_scale = draw(st.sampled_from([0.0, 1e-3, 0.1, 1.0, 5.0]))
    dv_scale = draw(st.sampled_from([0.0, 1e-3, 0.1, 1.0]))
    sink, window = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    q = rand(B, Hq, Tq, d, seed=seed, dtype=F64)
    k = rand(B, Hkv, T, d, seed=seed + 1, dtype=F64)
    v = rand(B, Hkv, T, d, seed=seed + 2, dtype=F64)
    k_t = k + rand(B, Hkv, T, d, seed=seed + 3, dtype=F64, scale=dk_scale)
    v_t = v + rand(B, Hkv, T, d, seed=seed + 4, dtype=F64, scale=dv_scale)
    w_o = rand(Hq, d_model, d, seed=seed + 5, dtype=F64)
    q_pos = torch.arange(T - Tq, T)
    use_windows = draw(st.booleans())
    fp = optr.fp_window_mask(q_pos, T, sink, window) if use_windows else None
    return q, k, v, k_t, v_t, w_o, optr.causal_mask(q_pos, T), fp


@given(perturbed_attention())
def test_error_decomposition_is_exact(case):
    """Eq. 8: for ANY perturbation of K and V (not only quantization), the key-induced
    term (sum_s dp_s v_s) W_O^T plus the value-induced term (sum_s p~_s dv_s) W_O^T equals
    y~ - y exactly (float64), with sink/recent windows or without."""
    q, k, v, k_t, v_t, w_o, mask, fp = case
    r = optr.error_decomposition(q, k, v, k_t, v_t, w_o, mask, fp)
    dy = r["y_tilde"] - r["y"]
    gap = (r["dy_k"] + r["dy_v"] - dy).abs().max()
    assert gap <= 1e-10 * dy.abs().max() + 1e-13 * r["y"].abs().max()
    assert torch.allclose(r["e_out"], dy.pow(2).sum(-1), rtol=1e-9, atol=1e-13)     # Eq. 10
    assert torch.allclose(r["e_rec"], (k - k_t).pow(2).sum() + (v - v_t).pow(2).sum())  # Eq. 9


@given(perturbed_attention())
def test_logit_error_is_linear_in_the_key_error(case):
    """Eq. 6: the logit error is <q, dk>/sqrt(d) (zero inside the windows): INT2 key error
    matters only through the queries that read it."""
    q, k, v, k_t, v_t, w_o, mask, fp = case
    da = optr.error_decomposition(q, k, v, k_t, v_t, w_o, mask, fp)["da"]
    expect = optr.gqa_logits(q, k_t - k)
    quant = mask if fp is None else mask & ~fp
    assert torch.allclose(da, torch.where(quant, expect, torch.zeros_like(expect)), atol=1e-9)


def test_each_error_term_vanishes_with_its_cause():
    """Exact keys give no key-induced error; exact values give no value-induced error."""
    q, k, v = rand(1, 4, 3, 16, seed=8, dtype=F64), rand(1, 2, 9, 16, seed=9, dtype=F64), rand(1, 2, 9, 16, seed=10, dtype=F64)
    w_o, mask = rand(4, 8, 16, seed=11, dtype=F64), optr.causal_mask(torch.arange(6, 9), 9)
    r = optr.error_decomposition(q, k, v, k, v + 0.1, w_o, mask)
    assert r["dy_k"].abs().max() == 0 and r["dy_v"].abs().max() > 0
    r = optr.error_decomposition(q, k, v, k + 0.1, v, w_o, mask)
    assert r["dy_v"].abs().max() == 0 and r["dy_k"].abs().max() > 0


def test_reconstruction_error_is_only_a_proxy():
    """Eq. 9 vs Eq. 10: a key error along a direction no query reads has a large E_rec but
    zero output error; a smaller error along the queries' direction hurts the output."""
    d = 8
    q = torch.zeros(1, 1, 4, d, dtype=F64)
    q[..., 0] = torch.tensor([3.0, -2.0, 1.0, 4.0]).view(1, 1, 4)     # queries live on channel 0
    k, v = rand(1, 1, 6, d, seed=12, dtype=F64), rand(1, 1, 6, d, seed=13, dtype=F64)
    w_o, mask = rand(1, 5, d, seed=14, dtype=F64), torch.ones(4, 6, dtype=torch.bool)
    unseen, seen = k.clone(), k.clone()
    unseen[..., 1:] += 1.0                                               # big, orthogonal to q
    seen[..., 0] += 0.3 * torch.tensor([1, -1, 1, -1, 1, -1], dtype=F64)  # small, along q
    r_u = optr.error_decomposition(q, k, v, unseen, v, w_o, mask)
    r_s = optr.error_decomposition(q, k, v, seen, v, w_o, mask)
    assert r_u["e_rec"] > r_s["e_rec"] and r_u["e_out"].sum() < 1e-20 < r_s["e_out"].sum()


# ----------------------------------------------------------------------------------------
# 6. OptR calibration
# ----------------------------------------------------------------------------------------

def layer_fixture(seed=0, N=6, T=48, Hq=4, Hkv=2, d=16, d_model=24, outlier=True):
    """Synthetic full-precision q, k, v of one layer, with keys that are hard for INT2:
    a few channels carry large offsets and outliers, queries read them."""
    def make(s):
        q = rand(N, Hq, T, d, seed=s)
        k = rand(N, Hkv, T, d, seed=s + 1)
        v = rand(N, Hkv, T, d, seed=s + 2)
        if outlier:
            k[..., 0] = k[..., 0] * 6 + 4
            k[..., 3] *= 3
            q[..., 0] *= 2
        return q, k, v
    return make(seed), make(seed + 100), rand(Hq, d_model, d, seed=seed + 7) / math.sqrt(d)


def small_cfg(**kw):
    base = dict(n_heads=4, n_kv_heads=2, head_dim=16, d_model=24, group_size=16, clip_k=1.0,
                clip_v=1.0, sink=2, window=4, steps=30, eval_every=10, qwin=16, lr=0.02)
    base.update(kw)
    return optr.Config(**base)


def held_losses(cal, held, w_o, r_k, r_v, mu, cfg):
    """Held-out L_K and L_V of given rotations, recomputed independently of the fit."""
    q, k, v = held
    T = k.shape[2]
    q_pos = torch.arange(T - cfg.qwin, T)
    mask, fp = optr.causal_mask(q_pos, T), optr.fp_window_mask(q_pos, T, cfg.sink, cfg.window)
    qq = q[:, :, q_pos]
    lk = optr.optr_key_loss(qq, k, v, w_o, r_k, mu, mask, fp, cfg)
    kc = optr.center_keys(k, mu)
    k_t = optr.rotate_dequant(kc, r_k, cfg.clip_k, cfg.group_size)
    p_t = torch.softmax(optr.effective_logits(qq, kc, k_t, mask, fp), -1)
    return lk, p_t, mask, fp


def test_optr_strictly_improves_a_poor_base():
    """On keys with outlier channels, where the identity base (naive INT2) is poor, the
    learned correction lowers the held-out key and value losses of every head."""
    cfg = small_cfg()
    cal, held, w_o = layer_fixture()
    r0 = optr.identity_rotation(2, 16)
    r_k, r_v, rows = optr.calibrate_layer(cal, held, w_o, r0, r0, None, cfg)
    assert all(r["kept"] and r["best_loss"] < r["base_loss"] for r in rows)
    lk_base, p_t0, mask, fp = held_losses(cal, held, w_o, r0, r0, None, cfg)
    lk, p_t, _, _ = held_losses(cal, held, w_o, r_k, r_v, None, cfg)
    assert torch.all(lk < lk_base)
    lv = optr.optr_value_loss(p_t, held[2], w_o, r_v, mask, fp, cfg)
    lv_base = optr.optr_value_loss(p_t, held[2], w_o, r0, mask, fp, cfg)
    assert torch.all(lv < lv_base)


def test_optr_is_never_worse_than_its_base_on_held_out_data():
    """With a learning rate far too large the fit wanders; each head keeps its best
    held-out A, and a head that never beats its base falls back to R_base exactly."""
    cfg = small_cfg(lr=3.0, steps=20, eval_every=5)
    cal, held, w_o = layer_fixture(seed=1, outlier=False)
    rk0 = optr.quarot_rotation(2, 16)
    mu = optr.key_mean(cal[1])
    r_k, r_v, rows = optr.calibrate_layer(cal, held, w_o, rk0, rk0, mu, cfg)
    for r in rows:
        assert r["best_loss"] <= r["base_loss"]
        R = (r_k if r["part"] == "k" else r_v)[r["head"]]
        if not r["kept"]:
            assert torch.equal(R, rk0[r["head"]])
    lk_base, *_ = held_losses(cal, held, w_o, rk0, rk0, mu, cfg)
    lk, *_ = held_losses(cal, held, w_o, r_k, r_v, mu, cfg)
    assert torch.all(lk <= lk_base)


def test_calibrated_rotations_are_orthogonal(calibrated_tiny):
    """Rotations returned by calibration are orthogonal in fp32 (|R^T R - I|_inf <= 1e-5)."""
    _, _, specs, _ = calibrated_tiny
    for s in specs:
        for R in (s.r_k, s.r_v):
            assert (R.transpose(-1, -2) @ R - torch.eye(R.shape[-1])).abs().max() <= 1e-5


def test_calibration_freezes_the_model_and_is_deterministic(calibrated_tiny):
    """Only A is trained: model weights are untouched; the same seed gives the same rotations."""
    model, data, specs, _ = calibrated_tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    specs2, _ = optr.calibrate(model, data[0], data[1], base="quarot")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a.r_k, b.r_k) and torch.equal(a.r_v, b.r_v) for a, b in zip(specs, specs2))


# ----------------------------------------------------------------------------------------
# 7. The tiny model
# ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibrated_tiny():
    """A small random model (sharpened weights so attention is peaked) and a quick OptR
    calibration on the QuaRot base."""
    cfg = optr.Config(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_dim=64, group_size=16, sink=2, window=4, page_size=8,
                      steps=6, eval_every=3, qwin=8, attention_bias=True)
    model = optr.TinyLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(10.0)
            elif n.endswith("bias"):
                p.copy_(rand(*p.shape, seed=len(n)))
    g = torch.Generator().manual_seed(1)
    data = (torch.randint(0, 64, (4, 24), generator=g), torch.randint(0, 64, (4, 24), generator=g))
    specs, report = optr.calibrate(model, data[0], data[1], base="quarot")
    return model, data, specs, report


def test_hugging_face_parameter_names():
    """Parameter names follow Hugging Face Llama/Qwen checkpoints, so a real state dict
    maps one to one."""
    cfg = optr.Config(n_layers=1, qk_norm=True, attention_bias=True)
    names = set(optr.TinyLM(cfg).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    p = "model.layers.0."
    expected |= {p + n for n in ["input_layernorm.weight", "post_attention_layernorm.weight",
                                 "self_attn.q_proj.weight", "self_attn.q_proj.bias",
                                 "self_attn.k_proj.weight", "self_attn.k_proj.bias",
                                 "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                                 "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                 "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                                 "mlp.up_proj.weight", "mlp.down_proj.weight"]}
    assert names == expected


def test_windows_covering_the_context_mean_full_precision():
    """If the sink and recent windows cover every position, the simulated INT2 cache
    is exact: logits equal the full-precision model's."""
    cfg = optr.Config(sink=0, window=64)
    model = optr.TinyLM(cfg)
    idx = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    kv = [optr.KVQuant(k_mean=rand(2, 32, seed=1), r_k=optr.quarot_rotation(2, 32),
                       r_v=optr.quarot_rotation(2, 32))] * cfg.n_layers
    assert torch.allclose(model(idx, kv=kv), model(idx), atol=1e-5)


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_folding_the_value_rotation_leaves_outputs_unchanged(ratio):
    """Folding R_V into v_proj (and its bias) and R_V^T into o_proj, per head, leaves the
    full-precision model's outputs unchanged, for GQA ratios 1, 2 and 4."""
    cfg = optr.Config(n_heads=2 * ratio, n_kv_heads=2, head_dim=16, group_size=16, attention_bias=True)
    model = optr.TinyLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.copy_(rand(*p.shape, seed=3))
    kv = [optr.KVQuant(r_v=torch.stack([random_orthogonal(16, 10 * l + h) for h in range(2)]))
          for l in range(cfg.n_layers)]
    folded = optr.fold_value_rotation(model, kv)
    idx = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(folded(idx), model(idx), atol=1e-5)
    assert not torch.allclose(folded.model.layers[0].self_attn.v_proj.weight,
                              model.model.layers[0].self_attn.v_proj.weight)


# ----------------------------------------------------------------------------------------
# 8. The paged INT2 cache
# ----------------------------------------------------------------------------------------

def dense_reference(q, k, v, spec, cfg):
    """Attention of the last position's query over all T tokens, in the model's own basis:
    keys k~ = mu + D_R(k - mu) and values D_R(v) outside the sink/recent windows."""
    T = k.shape[2]
    k_t, v_t = optr.effective_kv(k, v, spec, cfg)
    q_pos = torch.tensor([T - 1])
    _, o = optr.effective_attention(q, k, v, k_t, v_t, optr.causal_mask(q_pos, T),
                                    optr.fp_window_mask(q_pos, T, cfg.sink, cfg.window))
    return o[:, :, 0]                                                   # (B, H_q, d)


@pytest.mark.parametrize("T", [1, 5, 6, 7, 21, 22, 23, 68, 69, 70])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_paged_cache_matches_contiguous_reference(T, ratio):
    """Tokens appended one by one to a paged cache whose pages come in shuffled order,
    then decoded, give the attention of the contiguous simulated INT2 cache (same keys
    k~ = mu + D(k - mu), same values D(v), same windows). Lengths put 0, 1, 15, 16, 17,
    63, 64, 65 tokens in INT2 with 16-token pages."""
    cfg = optr.Config(n_heads=2 * ratio, n_kv_heads=2, head_dim=32, group_size=16,
                      sink=2, window=3, page_size=16)
    B, H, d = 2, 2, 32
    k, v = rand(B, H, T, d, seed=T) * 2 + 1, rand(B, H, T, d, seed=T + 1)
    q = rand(B, cfg.n_heads, 1, d, seed=T + 2)
    spec = optr.KVQuant(k_mean=optr.key_mean(k), r_k=torch.stack([random_orthogonal(d, i) for i in range(H)]),
                        r_v=torch.stack([random_orthogonal(d, 5 + i) for i in range(H)]))
    order = torch.randperm(20, generator=torch.Generator().manual_seed(T)).tolist()
    cache = optr.PagedKVCache(cfg, 20, B, [spec] * cfg.n_layers, page_order=order)
    seqs = [cache.add_sequence() for _ in range(B)]
    vr = v @ spec.r_v.unsqueeze(0)                                    # the folded v_proj's output
    for t in range(T):
        cache.append(0, seqs, k[:, :, t], vr[:, :, t])
    view = cache.layer_view(0, seqs)
    assert view["n_quant"].tolist() == [max(0, T - 5)] * B
    qr = (q[:, :, 0].view(B, H, ratio, d) @ spec.r_k.unsqueeze(0)).reshape(B, -1, d)
    o_rot = optr.paged_decode_reference(qr, **view, group_size=cfg.group_size)
    o = (o_rot.view(B, H, ratio, d) @ spec.r_v.transpose(-1, -2).unsqueeze(0)).reshape(B, -1, d)
    assert torch.allclose(o, dense_reference(q, k, v, spec, cfg), atol=2e-5)


def test_decode_path_matches_simulated_model(calibrated_tiny):
    """The real serving path - folded model, prefill, then token-by-token decode from the
    paged cache with rotated queries - gives the logits of the simulated INT2 model."""
    model, data, specs, _ = calibrated_tiny
    idx = data[1]
    sim = model(idx, kv=specs)
    folded = optr.fold_value_rotation(model, specs)
    cache = optr.PagedKVCache(model.cfg, 16, idx.shape[0], specs,
                              page_order=torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist())
    seqs = [cache.add_sequence() for _ in range(idx.shape[0])]
    pre = optr.prefill(folded, cache, seqs, idx[:, :10])
    dec = torch.stack([optr.decode_step(folded, cache, seqs, idx[:, t]) for t in range(10, idx.shape[1])], 1)
    assert torch.allclose(pre, sim[:, :10], atol=1e-3, rtol=1e-4)
    assert torch.allclose(dec, sim[:, 10:], atol=1e-3, rtol=1e-4)
    assert (dec.argmax(-1) == sim[:, 10:].argmax(-1)).all()


def test_page_pool_exhaustion_raises_and_free_returns_pages():
    """When no page is left the cache raises instead of overwriting; freeing a sequence
    returns its pages for reuse."""
    cfg = optr.Config(sink=0, window=0, page_size=4, n_layers=1)
    cache = optr.PagedKVCache(cfg, 2, 2, [optr.KVQuant()])
    s = cache.add_sequence()
    tok = rand(1, 2, 32)
    for _ in range(8):                                                # 2 pages x 4 slots
        cache.append(0, [s], tok, tok)
    with pytest.raises(RuntimeError, match="page pool exhausted"):
        cache.append(0, [s], tok, tok)
    cache.free(s)
    assert sorted(cache.free_pages) == [0, 1]
    s2 = cache.add_sequence()
    cache.append(0, [s2], tok, tok)
    assert cache.layer_view(0, [s2])["n_quant"].tolist() == [1]


def test_bits_per_element_measured_from_the_tensors():
    """INT2 with fp32 scale and zero costs 2 + 64/G bits per element; windows cost their dtype."""
    for G in (8, 16, 32):
        cfg = optr.Config(group_size=G, sink=1, window=2, n_layers=1)
        cache = optr.PagedKVCache(cfg, 4, 1, [optr.KVQuant()], window_dtype=torch.bfloat16)
        s = cache.add_sequence()
        for _ in range(13):
            cache.append(0, [s], rand(1, 2, 32), rand(1, 2, 32))
        assert cache.bits_per_element(s, int2_only=True) == 2 + 64 / G
        assert cache.bits_per_element(s) == pytest.approx((10 * (2 + 64 / G) + 3 * 16) / 13)


def test_prefill_refuses_a_model_with_other_windows(calibrated_tiny):
    """Prefill simulates the cache with the model's config; if its windows or quantizer
    differ from the cache's, what it stores would not be what decoding stores: refused."""
    model, data, specs, _ = calibrated_tiny
    import dataclasses
    cache = optr.PagedKVCache(dataclasses.replace(model.cfg, window=7), 16, 1, specs)
    with pytest.raises(ValueError, match="model: expected the cache's sink, window"):
        optr.prefill(model, cache, [cache.add_sequence()], data[0][:1])


def cache_state(cache):
    """Every tensor and table of a cache, for bit-for-bit comparisons."""
    names = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "win_k", "win_v",
             "block_table", "length")
    return {n: getattr(cache, n).clone() for n in names} | dict(free=list(cache.free_pages))


def assert_same_state(a, b):
    for n in a:
        if n == "free":
            assert a[n] == b[n], "free page lists differ"
        else:
            assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), f"{n} differs"


@given(sink=st.integers(0, 5), window=st.integers(0, 7), page_size=st.sampled_from([1, 3, 4, 8]),
       chunks=st.lists(st.integers(1, 30), min_size=1, max_size=3), n_seqs=st.integers(1, 3),
       bf16=st.booleans(), seed=st.integers(0, 10_000))
def test_bulk_extend_equals_token_by_token_append(sink, window, page_size, chunks, n_seqs, bf16, seed):
    """Appending T tokens at once (`extend`: one quantizer call per layer, scattered into
    pages) leaves the cache bit for bit as appending them one at a time: codes, scales,
    zeros, sink and ring windows, block table (pages taken in the same order), lengths,
    free list; for lengths below the sink, inside the windows, and past a ring wrap."""
    cfg = optr.Config(n_heads=4, n_kv_heads=2, head_dim=16, group_size=8, sink=sink,
                      window=window, page_size=page_size, n_layers=2)
    H, d = 2, 16
    spec = [optr.KVQuant(k_mean=rand(H, d, seed=seed), r_k=torch.stack([random_orthogonal(d, seed + h) for h in range(H)])),
            optr.KVQuant()]
    wdt = torch.bfloat16 if bf16 else torch.float32
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist()
    one, bulk = (optr.PagedKVCache(cfg, 64, 3, spec, window_dtype=wdt, page_order=order) for _ in range(2))
    seqs = [one.add_sequence() for _ in range(n_seqs)]
    assert [bulk.add_sequence() for _ in range(n_seqs)] == seqs
    for c, T in enumerate(chunks):
        k = rand(n_seqs, H, T, d, seed=seed + 100 * c) * 3 + 1
        v = rand(n_seqs, H, T, d, seed=seed + 100 * c + 1)
        for l in range(2):
            for t in range(T):
                one.append(l, seqs, k[:, :, t], v[:, :, t])
            bulk.extend(l, seqs, k, v)
    assert_same_state(cache_state(one), cache_state(bulk))
    assert int(bulk.length[0, seqs[0]]) == sum(chunks)


def test_bulk_extend_on_an_exhausted_pool_raises_and_writes_nothing():
    """An extend that needs more pages than are free raises before touching the cache."""
    cfg = optr.Config(sink=1, window=2, page_size=4, n_layers=1)
    cache = optr.PagedKVCache(cfg, 2, 1, [optr.KVQuant()])
    s = cache.add_sequence()
    cache.extend(0, [s], rand(1, 2, 5, 32), rand(1, 2, 5, 32))          # 2 INT2 tokens: 1 page
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="page pool exhausted"):
        cache.extend(0, [s], rand(1, 2, 7, 32), rand(1, 2, 7, 32))     # 9 INT2 tokens: 3 pages
    assert_same_state(before, cache_state(cache))
    cache.extend(0, [s], rand(1, 2, 6, 32), rand(1, 2, 6, 32))          # 8 INT2 tokens: fits


def test_bulk_prefill_then_decode_equals_token_by_token(calibrated_tiny):
    """prefill (one forward, bulk cache writes) then decode_step gives the same logits and
    the same cache, bit for bit, as appending the prompt's keys and values token by token."""
    model, data, specs, _ = calibrated_tiny
    idx = data[1]
    folded = optr.fold_value_rotation(model, specs)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
    bulk, one = (optr.PagedKVCache(model.cfg, 16, idx.shape[0], specs, page_order=order) for _ in range(2))
    seqs = [bulk.add_sequence() for _ in range(idx.shape[0])]
    assert [one.add_sequence() for _ in range(idx.shape[0])] == seqs
    logits = optr.prefill(folded, bulk, seqs, idx[:, :13])
    sim = [optr.KVQuant(k_mean=s.k_mean, r_k=s.r_k) for s in specs]
    ref, captured = folded(idx[:, :13], kv=sim, capture=True)
    for l, (_, k, v) in enumerate(captured):
        for t in range(13):
            one.append(l, seqs, k[:, :, t], v[:, :, t])
    assert torch.equal(logits, ref)
    assert_same_state(cache_state(one), cache_state(bulk))
    for t in range(13, idx.shape[1]):
        a = optr.decode_step(folded, bulk, seqs, idx[:, t])
        b = optr.decode_step(folded, one, seqs, idx[:, t])
        assert torch.equal(a, b)
    assert_same_state(cache_state(one), cache_state(bulk))
    with pytest.raises(ValueError, match="expected empty sequences"):
        optr.prefill(folded, bulk, seqs, idx[:, :2])


# ----------------------------------------------------------------------------------------
# Bad input: a clear ValueError naming the argument
# ----------------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    """Wrong shapes, dtypes and non-finite values are refused with a message that names
    the argument, what was expected and what came."""
    with pytest.raises(ValueError, match="x: expected finite"):
        optr.q2_quantize(torch.tensor([[1.0, float("nan"), 0.0, 2.0]]), 1.0, 4)
    with pytest.raises(ValueError, match="x: expected a floating dtype, got torch.int32"):
        optr.q2_quantize(torch.ones(2, 8, dtype=torch.int32), 1.0, 4)
    with pytest.raises(ValueError, match="x: last dim"):
        optr.q2_quantize(torch.ones(2, 6), 1.0, 4)
    with pytest.raises(ValueError, match="group_size"):
        optr.Config(group_size=24)
    with pytest.raises(ValueError, match="n_heads"):
        optr.Config(n_heads=3)
    with pytest.raises(ValueError, match="clip_k"):
        optr.Config(clip_k=1.5)
    with pytest.raises(ValueError, match="d: expected a power of two"):
        optr.hadamard(12)
    model = optr.TinyLM(optr.Config(n_layers=1))
    with pytest.raises(ValueError, match="idx: expected dtype"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"idx: expected token ids in \[0, 128\)"):
        model(torch.tensor([[1, 200]]))
    cache = optr.PagedKVCache(model.cfg, 2, 1, [optr.KVQuant()])
    s = cache.add_sequence()
    with pytest.raises(ValueError, match=r"k: expected shape \(1, 2, 32\), got \(1, 2, 16\)"):
        cache.append(0, [s], torch.zeros(1, 2, 16), torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match="v: expected finite"):
        cache.append(0, [s], torch.zeros(1, 2, 32), torch.full((1, 2, 32), float("inf")))
    with pytest.raises(ValueError, match="seq: expected an active sequence"):
        cache.append(0, [5], torch.zeros(1, 2, 32), torch.zeros(1, 2, 32))
    cal, held, w_o = layer_fixture(N=1, T=8)
    r0 = optr.identity_rotation(2, 16)
    with pytest.raises(ValueError, match="query_positions"):
        optr.calibrate_layer(cal, held, w_o, r0, r0, None, small_cfg(), query_positions=torch.tensor([8]))


# ----------------------------------------------------------------------------------------
# 9. The Triton INT2 paged decode kernel (interpreter on CPU, small shapes)
# ----------------------------------------------------------------------------------------
# Every case is checked three ways: Triton kernel == optr.paged_decode_reference (reads
# the paged cache through the block table) == float64 dense attention over the logical,
# never-paged K/V. Pages sit in a shuffled pool with spare pages; everything a correct
# kernel must not read (spare pages, unused slots, window slots past win_len) holds NaN
# scales or values, and unused block-table entries hold garbage, so a masking mistake
# shows up as NaN or a wrong result.

# (atol, rtol) keyed by the lowest-precision input dtype (q or windows).  The
# kernel and both references upcast bf16 inputs exactly and compute in fp32 /
# fp64, so all comparisons here are at fp32 level; the looser bf16 entry is
# for references that keep some arithmetic in bf16.
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-3, 2e-3)}


def assert_close_report(actual, expected, atol, rtol, name):
    """Element-wise |actual - expected| <= atol + rtol * |expected|, no NaN/inf,
    and normalized RMS error <= rtol; the message locates the worst element."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(expected).all(), f"{name}: expected has NaN/inf"
    bad = ~torch.isfinite(actual)
    assert not bad.any(), f"{name}: {int(bad.sum())} NaN/inf, first at {bad.nonzero()[0].tolist()}"
    err = (actual - expected).abs()
    excess = err - (atol + rtol * expected.abs())
    worst = int(excess.flatten().argmax())
    idx = [int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape)]
    nrms = err.pow(2).mean().sqrt() / (expected.pow(2).mean().sqrt() + atol)
    report = (f"{name}: max abs err {err.max():.3e}; worst at {idx}: actual "
              f"{actual.flatten()[worst]:.6g} vs expected {expected.flatten()[worst]:.6g} "
              f"(atol {atol}, rtol {rtol}); {int((excess > 0).sum())} of {err.numel()} "
              f"elements out of tolerance; normalized RMS err {nrms:.3e}")
    assert excess.max() <= 0, report
    assert nrms <= rtol, report


# ----------------------------------------------------------------------------
# Random cases
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    n_quant: tuple          # INT2 tokens per sequence (ragged)
    H_q: int
    H_kv: int
    d: int
    G: int                  # group size
    P: int                  # page size
    NW: int = 0             # window capacity
    win_len: tuple = None   # valid window slots per sequence (None: all 0)
    win_dtype: torch.dtype = torch.float32
    q_dtype: torch.dtype = torch.float32
    num_splits: int = None
    spare_pages: int = 3

    @property
    def id(self):
        win = f"W{self.NW}{'bf16' if self.win_dtype == torch.bfloat16 else 'fp32'}" \
            if self.NW else "W0"
        q = "-qbf16" if self.q_dtype == torch.bfloat16 else ""
        return (f"B{len(self.n_quant)}-T{max(self.n_quant)}-Hq{self.H_q}-Hkv{self.H_kv}"
                f"-d{self.d}-G{self.G}-P{self.P}-{win}{q}-S{self.num_splits}")


def build(case, seed=0):
    """Return (kernel kwargs, dense_k, dense_v).  dense_k / dense_v are lists over
    the batch of float64 (H_kv, T_b, d) tensors built from the logical tokens
    (INT2 tokens, then window tokens), without pages or packing."""
    g = torch.Generator().manual_seed(seed)
    B, d, G, P, H_kv = len(case.n_quant), case.d, case.G, case.P, case.H_kv
    win_len = case.win_len or (0,) * B
    blocks = [math.ceil(n / P) for n in case.n_quant]
    num_pages = sum(blocks) + case.spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    block_table = torch.randint(-5, 10**6, (B, max(blocks) + 1), generator=g, dtype=torch.int32)

    # Pool: garbage codes and NaN scales / zeros everywhere a kernel must not read.
    shape = (num_pages, H_kv, P)
    args = {name: torch.randint(0, 256, (*shape, d // 4), generator=g, dtype=torch.uint8)
            for name in ("k_codes", "v_codes")}
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        args[name] = torch.full((*shape, d // G), float("nan"))

    win_k = torch.randn(B, H_kv, case.NW, d, generator=g).to(case.win_dtype)
    win_v = torch.randn(B, H_kv, case.NW, d, generator=g).to(case.win_dtype)
    dense = {"k": [], "v": []}
    next_page = 0
    for b, n in enumerate(case.n_quant):
        pages = perm[next_page:next_page + blocks[b]]
        next_page += blocks[b]
        block_table[b, :blocks[b]] = torch.tensor(pages, dtype=torch.int32)
        for kv, window in (("k", win_k), ("v", win_v)):
            codes = torch.randint(0, 4, (H_kv, n, d), generator=g)
            scale = 0.05 + 0.5 * torch.rand(H_kv, n, d // G, generator=g)
            zero = 3.0 * torch.rand(H_kv, n, d // G, generator=g)
            for blk, page in enumerate(pages):
                tok = slice(blk * P, min(n, (blk + 1) * P))
                cnt = tok.stop - tok.start
                args[f"{kv}_codes"][page, :, :cnt] = optr.pack_int2(codes[:, tok])
                args[f"{kv}_scale"][page, :, :cnt] = scale[:, tok]
                args[f"{kv}_zero"][page, :, :cnt] = zero[:, tok]
            x = (codes.double() - zero.double().repeat_interleave(G, -1)) \
                * scale.double().repeat_interleave(G, -1)
            dense[kv].append(torch.cat([x, window[b, :, :win_len[b]].double()], dim=1))
        win_k[b, :, win_len[b]:] = float("nan")   # slots past win_len must not be read
        win_v[b, :, win_len[b]:] = float("nan")

    q = torch.randn(B, case.H_q, d, generator=g).to(case.q_dtype)
    args.update(q=q, block_table=block_table,
                n_quant=torch.tensor(case.n_quant, dtype=torch.int32),
                win_k=win_k, win_v=win_v, win_len=torch.tensor(win_len, dtype=torch.int32),
                group_size=G)
    return args, dense["k"], dense["v"]


def dense_attention(q, dense_k, dense_v):
    """float64 softmax(q k^T / sqrt(d)) v per sequence; GQA by repeating KV heads."""
    B, H_q, d = q.shape
    out = torch.empty(B, H_q, d, dtype=torch.float64)
    for b in range(B):
        ratio = H_q // dense_k[b].shape[0]
        k = dense_k[b].repeat_interleave(ratio, 0)
        v = dense_v[b].repeat_interleave(ratio, 0)
        logits = torch.einsum("hd,htd->ht", q[b].double(), k) / math.sqrt(d)
        out[b] = torch.einsum("ht,htd->hd", logits.softmax(-1), v)
    return out


def tolerance(case):
    """(atol, rtol) for the lowest-precision input that reaches the result."""
    uses_bf16 = case.q_dtype == torch.bfloat16 or (case.NW and case.win_dtype == torch.bfloat16)
    return TOLERANCES[torch.bfloat16 if uses_bf16 else torch.float32]


RAGGED = (0, 5, 63, 64, 65, 200)   # empty, < 1 page, page - 1, 1 page, page + 1, 4 pages
RAGGED_NO_EMPTY = (1, 5, 63, 64, 65, 200)
RAGGED_WIN = (3, 7, 0, 1, 7, 5)
SPLITS = (1, 2, 3, 16)             # 16 > pages of every sequence


def _matrix():
    cases = []
    heads = [(2, 2), (4, 2), (4, 1)]                                       # GQA 1 / 2 / 4
    windows = [(0, torch.float32), (7, torch.bfloat16), (7, torch.float32)]
    i = 0
    for H_q, H_kv in heads:
        for d in (32, 64):
            for NW, win_dtype in windows:
                cases.append(Case(
                    n_quant=RAGGED if NW else RAGGED_NO_EMPTY, H_q=H_q, H_kv=H_kv, d=d,
                    G=d if i % 2 else d // 4, P=64, NW=NW, win_len=RAGGED_WIN if NW else None,
                    win_dtype=win_dtype, num_splits=SPLITS[i % len(SPLITS)]))
                i += 1
    return cases


EXTRA = [
    # windows only: every sequence has n_quant = 0 and the page pool is empty
    Case((0, 0), 4, 2, 32, 8, 16, NW=6, win_len=(6, 1), win_dtype=torch.bfloat16,
         q_dtype=torch.bfloat16, num_splits=2, spare_pages=0),
    # bf16 queries, no window
    Case((16, 100), 4, 2, 32, 32, 16, q_dtype=torch.bfloat16, num_splits=2),
    # page size that is not a power of two
    Case((50, 24, 23), 4, 2, 32, 4, 24, NW=4, win_len=(2, 4, 0), num_splits=3),
    # d = 256: a page is processed as two tiles; tiny groups
    Case((70, 3), 4, 2, 256, 64, 64, NW=3, win_len=(3, 1), win_dtype=torch.bfloat16,
         num_splits=2),
    # d = 16, G = 2, page smaller than the 16-row tile, GQA 8
    Case((9, 30), 8, 1, 16, 2, 8, num_splits=4),
    # d = 128 (the production head dim), num_splits chosen by the launcher
    Case((130, 64), 4, 2, 128, 128, 16, NW=2, win_len=(2, 2), num_splits=None),
]
CASES = _matrix() + EXTRA


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_matches_reference_and_dense(case):
    """The Triton kernel, reading packed INT2 pages through a shuffled block table plus
    the full-precision windows, equals optr's torch paged reference and a float64 dense
    attention over the logical (never paged) tokens: ragged lengths (0, < 1 page, 63, 64,
    65, several pages), GQA 1/2/4/8, head_dim 16-256, windows none/bf16/fp32, 1-16 splits."""
    args, dense_k, dense_v = build(case)
    atol, rtol = tolerance(case)
    out = int2_paged_decode(**args, num_splits=case.num_splits)
    ref = optr.paged_decode_reference(**args)
    dense = dense_attention(args["q"], dense_k, dense_v)
    assert out.dtype == torch.float32 and out.shape == args["q"].shape
    assert_close_report(ref, dense, atol, rtol, f"torch reference vs dense [{case.id}]")
    assert_close_report(out, dense, atol, rtol, f"kernel vs dense [{case.id}]")
    assert_close_report(out, ref, atol, rtol, f"kernel vs torch reference [{case.id}]")


def test_sm_scale_and_split_invariance():
    """The result does not depend on how the context is split; a custom sm_scale is used."""
    case = Case((40, 17), 4, 2, 32, 8, 16, NW=3, win_len=(1, 3))
    args, _, _ = build(case, seed=1)
    ref = optr.paged_decode_reference(**args, sm_scale=0.3)
    for splits in (1, 4):
        out = int2_paged_decode(**args, num_splits=splits, sm_scale=0.3)
        assert_close_report(out, ref, *TOLERANCES[torch.float32], f"sm_scale=0.3, S{splits}")


# ----------------------------------------------------------------------------
# The assertion helper itself
# ----------------------------------------------------------------------------
def test_assert_close_report_accepts_close_values():
    """The comparison helper passes values within tolerance..."""
    expected = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    assert_close_report(expected * (1 + 1e-6), expected, 1e-5, 1e-4, "close")


@pytest.mark.parametrize("bad_value", [0.01, float("nan"), float("inf")],
                         ids=["off-by-0.01", "nan", "inf"])
def test_assert_close_report_fails_on_one_wrong_element(bad_value):
    """...and fails when a single element is off, NaN or inf, naming where."""
    expected = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    actual = expected.clone()
    actual[1, 2, 5] = expected[1, 2, 5] + bad_value
    with pytest.raises(AssertionError, match=r"\[1, 2, 5\]|NaN/inf"):
        assert_close_report(actual, expected, 1e-5, 1e-4, "one wrong element")


# ----------------------------------------------------------------------------
# Input validation: ValueError naming the argument, raised before any launch
# ----------------------------------------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    """Replace the kernels so that a launch fails the test loudly."""
    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched despite invalid inputs")
    monkeypatch.setattr(kernel, "_int2_decode_split_kernel", _NoLaunch())
    monkeypatch.setattr(kernel, "_merge_splits_kernel", _NoLaunch())


def _valid_args():
    case = Case((20, 40), 4, 2, 32, 8, 16, NW=3, win_len=(3, 0))
    return build(case, seed=2)[0]


def _used_entry_out_of_range(a, value):
    a["block_table"][1, 2] = value   # sequence 1 uses 3 blocks (40 tokens, page 16)


BAD_INPUTS = [
    ("block_table", "block_table", lambda a: _used_entry_out_of_range(a, a["k_codes"].shape[0])),
    ("block_table-negative", "block_table", lambda a: _used_entry_out_of_range(a, -1)),
    ("block_table-dtype", "block_table", lambda a: a.update(block_table=a["block_table"].long())),
    ("k_codes-int8", "k_codes", lambda a: a.update(k_codes=a["k_codes"].to(torch.int8))),
    ("q-float64", "q", lambda a: a.update(q=a["q"].double())),
    ("q-noncontiguous", "q",
     lambda a: a.update(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1))),
    ("v_scale-shape", "v_scale", lambda a: a.update(v_scale=a["v_scale"][..., :2].contiguous())),
    ("v_codes-shape", "v_codes", lambda a: a.update(v_codes=a["v_codes"][:, :1].contiguous())),
    ("k_zero-dtype", "k_zero", lambda a: a.update(k_zero=a["k_zero"].half())),
    ("win_k-device", "win_k", lambda a: a.update(win_k=a["win_k"].to("meta"))),
    ("n_quant-device", "n_quant", lambda a: a.update(n_quant=a["n_quant"].to("meta"))),
    ("win_v-shape", "win_v", lambda a: a.update(win_v=a["win_v"][:, :, :2].contiguous())),
    ("head_dim", "q", lambda a: a.update(q=a["q"][..., :24].contiguous())),
    ("gqa", "q", lambda a: a.update(q=a["q"][:, :3].contiguous())),
    ("group_size", "group_size", lambda a: a.update(group_size=12)),
    ("n_quant-capacity", "n_quant", lambda a: a["n_quant"].fill_(10**4)),
    ("n_quant-negative", "n_quant", lambda a: a["n_quant"].__setitem__(0, -1)),
    ("win_len-range", "win_len", lambda a: a["win_len"].__setitem__(0, 4)),
    ("empty-sequence", "n_quant \\+ win_len",
     lambda a: (a["n_quant"].__setitem__(1, 0), a["win_len"].__setitem__(1, 0))),
]


@pytest.mark.parametrize("what,name,corrupt", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_invalid_inputs_raise_before_launch(no_launch, what, name, corrupt):
    """Malformed shapes, dtypes, devices, contiguity, block-table entries and lengths are
    refused with a ValueError naming the argument, before any kernel is launched."""
    args = _valid_args()
    corrupt(args)
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        int2_paged_decode(**args)


@pytest.mark.parametrize("num_splits", [0, -1, 2.0, 10**6])
def test_invalid_num_splits(no_launch, num_splits):
    """num_splits must be None or an int in [1, 1024]."""
    with pytest.raises(ValueError, match="^num_splits: expected"):
        int2_paged_decode(**_valid_args(), num_splits=num_splits)


def test_unused_block_table_entries_are_ignored():
    """Block-table entries past a sequence's last used page are never read."""
    args = _valid_args()
    ref = optr.paged_decode_reference(**args)
    args["block_table"][0, 2:] = -7          # sequence 0 uses blocks 0 and 1 only
    out = int2_paged_decode(**args, num_splits=2)
    assert_close_report(out, ref, *TOLERANCES[torch.float32], "unused entries = -7")


# ----------------------------------------------------------------------------
# Interpreter set-up on machines without CUDA
# ----------------------------------------------------------------------------
def _run_python(code):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter set-up only")
def test_import_enables_interpreter_without_env_variable():
    """Without CUDA, importing kernel switches Triton to its CPU interpreter by itself."""
    r = _run_python("import kernel, torch; print(kernel._tiny_check(torch.device('cpu')))")
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[-1]) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter set-up only")
def test_triton_imported_first_gives_clear_error():
    """If triton was imported first (so not in interpreter mode), the launcher says so."""
    r = _run_python("import triton, kernel, torch; kernel._tiny_check(torch.device('cpu'))")
    assert r.returncode != 0 and "import kernel first" in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------
# 10. The end-to-end script
# ----------------------------------------------------------------------------------------

def test_train_tiny_quick_smoke(tmp_path):
    """`python train_tiny.py --quick` trains, calibrates, evaluates and decodes in about a
    minute; results.json has the documented schema, every variant is present, full
    precision answers >= 95% correctly, and the paged Triton decode agrees with the
    simulated cache."""
    import json
    import train_tiny
    results = train_tiny.main(["--quick", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    for key in ("config", "timing_s", "key_stats", "variants"):
        assert key in on_disk
    assert set(on_disk["timing_s"]) >= {"train", "calibrate", "evaluate", "total"}
    names = {"full", "int2", "quarot", "quarot+optr", "oscar", "oscar+optr",
             "quarot+center", "quarot+optr-nocenter"}
    assert set(on_disk["variants"]) == names
    for v in on_disk["variants"].values():
        assert set(v) >= {"accuracy", "kl", "e_out_key", "e_out_value", "e_rec", "bits_per_element"}
        assert len(v["accuracy"]) >= 3
    longest = max(on_disk["variants"]["full"]["accuracy"], key=int)
    assert on_disk["variants"]["full"]["accuracy"][longest] >= 0.95
    assert on_disk["variants"]["int2"]["bits_per_element"] < 16
    for check in results["decode_check"].values():
        assert check["same_argmax"] == check["answers"]
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "kv_rotations.safetensors").exists()


def test_checkpoint_with_wrong_shapes_refuses_to_load(tmp_path):
    """A safetensors checkpoint saved for one geometry does not load into another: the
    error names the tensors whose shapes differ (loading never runs code)."""
    import train_tiny
    cfg = train_tiny.RunConfig(n_layers=1)
    path = str(tmp_path / "model.safetensors")
    train_tiny.save_model(optr.TinyLM(cfg), cfg, path)
    train_tiny.load_model(optr.TinyLM(cfg), path)                       # same shapes: fine
    with pytest.raises(ValueError, match=r"does not match this config: .*file has"):
        train_tiny.load_model(optr.TinyLM(train_tiny.RunConfig(n_layers=1, d_model=32)), path)


# ----------------------------------------------------------------------------------------
# eval_llm.py: the real-model script, end to end on a tiny random checkpoint
# ----------------------------------------------------------------------------------------

def _byte_tokenizer():
    """Byte-level BPE without merges: 256 byte tokens and one control token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


def test_eval_llm_smoke(tmp_path):
    """eval_llm.py runs every stage on a tiny random Llama checkpoint (Hugging Face layout),
    writes results.json in train_tiny's schema, its block-wise simulated cache equals optr's
    dense one, the paged decode reproduces the simulated passkey answers, and it writes
    orthogonal rotations and the plots."""
    import json
    from safetensors.torch import load_file, save_file
    import eval_llm
    tok = _byte_tokenizer()
    cfg = optr.Config(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16, ffn_dim=64, group_size=16, seed=3)
    model = optr.TinyLM(cfg)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=cfg.vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)))
    tok.save(str(ckpt / "tokenizer.json"))
    calib, evalf = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    evalf.write_text("Pack my box with five dozen liquor jugs, said 42 sphinxes. " * 12)
    out = tmp_path / "out"
    results = eval_llm.main([
        "--model", str(ckpt), "--calib-text", str(calib), "--eval-text", str(evalf),
        "--out", str(out), "--sink", "4", "--window", "16", "--contexts", "320,384",
        "--gap-ctx", "384", "--calib-len", "64", "--calib-seqs", "2", "--heldout-seqs", "1",
        "--qwin", "16", "--steps", "2", "--eval-every", "1", "--err-queries", "8",
        "--variants", "full,int2,quarot,quarot+optr", "--passkey-prompts", "2",
        "--decode-prompts", "1"])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["variants"].keys() == {"full", "int2", "quarot", "quarot+optr"}
    for name, v in on_disk["variants"].items():
        for key in ("passkey", "kl", "top1", "nll", "e_out_key", "e_out_value", "e_rec",
                    "bits_per_element"):
            assert key in v, (name, key)
        assert set(v["passkey"]) == {"320", "384"}
    full, int2 = on_disk["variants"]["full"], on_disk["variants"]["int2"]
    assert full["kl"] == 0 and full["top1"] == 1 and full["bits_per_element"] == 16
    assert int2["kl"] > 0 and int2["e_rec"] > 0 and 2 < int2["bits_per_element"] < 16
    assert on_disk["simulation_check"]["attention_max_rel_diff"] < 1e-4
    dec = on_disk["decode_check"]["quarot+optr"]
    assert dec["same_argmax"] == dec["answer_tokens"] and dec["max_abs_logit_diff"] < 1e-3
    assert "quarot" in on_disk["gap_closed"]
    rot = load_file(str(out / "kv_rotations.safetensors"))
    r = rot["quarot+optr/1/r_k"].double()                                  # (H_kv, d, d)
    assert torch.allclose(r @ r.transpose(-1, -2), torch.eye(16, dtype=torch.float64), atol=1e-5)
    for name in results["plots"].values():
        if isinstance(name, str):
            assert (out / name).stat().st_size > 10_000
