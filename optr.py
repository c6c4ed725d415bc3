"""
OptR: output-oriented rotation for INT2 KV-cache quantization, in one readable file.

Paper: Yun, Lim, Cheong, Lee, Annavaram, Karimireddy, Yoo, "Output-Oriented Rotation for
INT2 KV Cache Quantization" (arXiv 2608.02691); equation numbers follow its Section 3.
Where it is silent (the quantizer's details, the loss normalisation, OSCAR's composition,
the schedule) this file follows the authors' code; README.md lists where it does not.

Reading map. Sections 0-6 are the paper's method alone, in its order; 7-8 run it in a model
and serve it from a paged cache; the appendices are infrastructure a learner may skip.
  0. Config                one dataclass: model, quantizer, windows, pages, calibration
  1. Attention (Eq. 1-3)   logits, softmax, readout, the post-W_O head contribution
  2. INT2 quantizer        Q2: clip, asymmetric affine, straight-through rounding
  3. Rotations (Eq. 4)     D_R,c(z) = Q2(zR) R^T; bases: identity, QuaRot, OSCAR
  4. Key centering         k - mu after RoPE: softmax unchanged, INT2 range shrinks
  5. Windows, error split  exact sink/recent windows; Eq. 5-10: dy_K + dy_V, exactly
  6. OptR calibration      R = R_base exp(A - A^T): keys (KL + lambda dy_K^2), then values
  7. The model             Llama/Qwen3-style decoder, one forward, pluggable attention; R_V folded
  8. Serving               INT2 packing, the plain paged INT2 cache: decode and the multi-token forward
  A. Fast paths            key loss on the INT2 columns, block-wise simulation, compiled decode step
  B. Files                 checks of outside data; rotation files; Hugging Face export
  D. Beyond the paper      ours, and only here: a clip searched per layer (optr+)
  E. Serving elsewhere     transformers: a Cache, any model's attention (SGLang: tools/sglang.py)

Shapes: B batch, T keys (source tokens), Tq queries, H_q query heads, H_kv KV heads,
n_rep = H_q // H_kv query heads per KV head (GQA), d head_dim, G group size. A tilde is spelled
out (k_tilde: through the INT2 cache); `exact`: the (Tq, T) mask of the keys read in full precision.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernel
from kernel import check_tensor, need   # the project's one set of input checks (kernel.py imports nothing of ours)


# ----------------------------------------------------------------------------------------
# 0. Config
# ----------------------------------------------------------------------------------------

@dataclass
class Config:
    # model geometry (tiny Llama/Qwen3-style decoder)
    vocab_size: int = 128        # tokens
    d_model: int = 64            # residual width
    n_layers: int = 2            # decoder layers
    n_heads: int = 4             # query heads H_q
    n_kv_heads: int = 2          # KV heads H_kv (GQA)
    head_dim: int = 32           # d
    ffn_dim: int = 192           # SwiGLU hidden width
    rope_theta: float = 10000.0  # RoPE base
    rms_eps: float = 1e-6        # RMSNorm epsilon
    qk_norm: bool = False        # Qwen3-style RMSNorm on q and k per head (before RoPE)
    attention_bias: bool = False  # Qwen2-style bias on q_proj/k_proj/v_proj
    tie_embeddings: bool = False  # lm_head shares model.embed_tokens' weight
    # INT2 quantizer Q2 and precision windows
    group_size: int = 32         # G: consecutive channels along d sharing scale and zero
    clip_k: float = 0.96         # c_K: keys clipped at the |x| of rank floor(c*G) in a group
    clip_v: float = 0.92         # c_V: same for values
    scale_eps: float = 1e-8      # floor on a group's range (max - min): no 0/0 on a constant group
    sink: int = 4                # first tokens kept in full precision
    window: int = 16             # most recent tokens (current one included) in full precision
    page_size: int = 16          # INT2 tokens per page of the paged cache
    # OptR calibration
    lr: float = 0.02             # Adam learning rate on A
    steps: int = 80              # full-batch steps, keys and values each
    n_loss_queries: int = 64     # the last positions of each sequence that are the loss's queries
    lam: float = 1.0             # lambda: weight of the output term beside KL in the key loss
    out_reduce: str = "mean"     # output terms: "mean" over d_model (the authors') or "sum"
    eval_every: int = 20         # score heads on held-out data after updates 1, 1 + this, ..., last
    seed: int = 0                # seed of everything random

    def __post_init__(self):      # what a user sets: ValueErrors naming the field, under -O too
        need(min(self.vocab_size, self.d_model, self.n_layers, self.n_kv_heads, self.ffn_dim, self.page_size, self.steps,
                 self.n_loss_queries, self.eval_every) >= 1, "sizes, steps, n_loss_queries and eval_every must be >= 1")
        need(self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads")
        need(self.head_dim % 4 == 0 and self.head_dim % self.group_size == 0,
             "head_dim must be a multiple of 4 (4 codes per byte) and of group_size")
        need(0 < self.clip_k <= 1 and 0 < self.clip_v <= 1, "clip_k and clip_v must be in (0, 1]")
        need(min(self.sink, self.window) >= 0, "sink, window must be >= 0")
        need(all(0 < x < math.inf for x in (self.scale_eps, self.lr, self.rope_theta, self.rms_eps)) and 0 <=
             self.lam < math.inf, "scale_eps, lr, rope_theta, rms_eps must be finite and > 0, lam finite and >= 0")
        need(self.out_reduce in ("mean", "sum"), "out_reduce must be 'mean' or 'sum'")

    @property
    def n_rep(self) -> int:      # query heads per KV head
        return self.n_heads // self.n_kv_heads


# ----------------------------------------------------------------------------------------
# 1. Attention (Eq. 1-3)
# ----------------------------------------------------------------------------------------
"""
Eq. 1  a_t,s = <q_t,j, k_s,h> / sqrt(d),   p_t = softmax_{s<=t}(a_t,s)
Eq. 2  o_t,j = sum_s p_t,s v_s,h
Eq. 3  y_t,j = o_t,j W_O,j^T          (head j's contribution to the residual stream)
Query head j reads KV head h = j // n_rep. W_O,j is the (d_model, d) slice of o_proj.weight.
"""

def causal_mask(q_pos: torch.Tensor, T: int) -> torch.Tensor:
    """(Tq, T) bool, True where key s may be attended by the query at position q_pos[i]."""
    return torch.arange(T, device=q_pos.device)[None, :] <= q_pos[:, None]


def gqa_logits(q, k):
    """Eq. 1 logits. q (B, H_q, Tq, d), k (B, H_kv, T, d) -> (B, H_q, Tq, T)."""
    B, Hq, Tq, d = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv * Tq, d)                 # (B, H_kv, n_rep * Tq, d)
    a = (qg / math.sqrt(d)) @ k.transpose(-1, -2)             # Eq. 1
    return a.view(B, Hq, Tq, k.shape[2])


def gqa_readout(p, v):
    """Eq. 2 readout. p (B, H_q, Tq, T), v (B, H_kv, T, d) -> o (B, H_q, Tq, d)."""
    B, Hq, Tq, T = p.shape
    Hkv = v.shape[1]
    o = p.reshape(B, Hkv, Hq // Hkv * Tq, T) @ v              # Eq. 2, (B, H_kv, n_rep * Tq, d)
    return o.view(B, Hq, Tq, v.shape[-1])


def head_output(o, w_o):
    """Eq. 3 per-head contribution. o (B, H_q, Tq, d), w_o (H_q, d_model, d) -> (B, H_q, Tq, d_model)."""
    return torch.einsum("bhtd,hmd->bhtm", o, w_o)             # Eq. 3: o_j W_O,j^T


def split_o_proj(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """o_proj.weight (d_model, H_q * d) -> W_O (H_q, d_model, d): the slice that reads head j."""
    d_model = weight.shape[0]
    return weight.view(d_model, n_heads, -1).permute(1, 0, 2)


# ----------------------------------------------------------------------------------------
# 2. The INT2 quantizer Q2(x; c, G)
# ----------------------------------------------------------------------------------------
"""
Per token, groups of G consecutive channels along d. In each group, in fp32 whatever the
input dtype (the authors' quantizer, formula for formula):
  clip    tau = |x| at rank floor(c*G) of the sorted |x| (clamped to the last index);
          x <- clamp(x, -tau, tau)                 (no gradient through tau)
  affine  scale = max(max - min, eps) / 3,  zero = -min / scale   (the range is floored,
          then divided; zero is a float, not rounded)
  code    = clamp(floor(x / scale + zero + 0.5), 0, 3)       (straight-through in training)
  dequant = (code - zero) * scale
Gradients flow through the rounding (STE) and through scale, zero, min and max.
"""

def clip_rank(clip: float, G: int) -> int:
    """The rank of tau in a group's sorted |x|: floor(c G), clamped (at c = 1 still the largest |x|)."""
    return min(max(int(math.floor(clip * G)), 0), G - 1)


def _q2_params(x, clip, G, eps):
    """Shared by the fake-quant and storage (Section 8) forms, so both compute the same numbers.
    x (..., d) fp32 -> xg (..., d/G, G) clipped, scale and zero (..., d/G, 1) fp32."""
    assert x.shape[-1] % G == 0 and 0 < clip <= 1 and eps > 0, "G must divide d; clip in (0, 1]"
    xg, r = x.reshape(*x.shape[:-1], x.shape[-1] // G, G), clip_rank(clip, G)
    a = xg.detach().abs()                      # tau: sorted |x|[rank], no grad (on the CPU numpy's select: 4x topk's)
    tau = torch.from_numpy(np.partition(a.numpy(), r)[..., r:r + 1]) if a.is_cpu else a.topk(G - r).values[..., -1:]
    xg = torch.maximum(torch.minimum(xg, tau), -tau)
    mn, mx = xg.amin(dim=-1, keepdim=True), xg.amax(dim=-1, keepdim=True)
    scale = (mx - mn).clamp_min(eps) / 3                     # range floored, then divided
    zero = -mn / scale
    return xg, scale, zero


def q2(x: torch.Tensor, clip: float, G: int, eps: float = 1e-8) -> torch.Tensor:
    """Fake-quant Q2(x; c, G): quantize and dequantize in fp32, differentiable by straight-
    through rounding. x (..., d) -> same shape and dtype as x."""
    xg, scale, zero = _q2_params(x.float(), clip, G, eps)
    u = xg / scale + zero
    code = u + (torch.clamp(torch.floor(u + 0.5), 0, 3) - u).detach()  # STE: forward = code
    return ((code - zero) * scale).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------
# 3. Rotations and rotated INT2 quantization (Eq. 4)
# ----------------------------------------------------------------------------------------
"""
Eq. 4  D_R,c(z) = Q2(z R; c, G) R^T,   R orthogonal.
With Q2 the identity, D_R,c(z) = z R R^T = z: a rotation only changes the basis in which
the INT2 error is made. Bases R_base (per layer, (H_kv, d, d)):
  identity   naive INT2
  QuaRot     H_d / sqrt(d), the normalised Sylvester Hadamard (keys after RoPE, and values)
  OSCAR      U H P: U the eigenvectors of an attention-aware covariance, H the Hadamard,
             P a bit-reversal permutation spreading large-eigenvalue directions over the
             groups. Keys: Sigma_Q = E[q^T q] over the layer's query heads. Values: Sigma_V
             = mean_h mean_t w_t v_t^T v_t, w_t = k_t Sigma_Q,h k_t^T (Sigma_Q,h: KV head
             h's own query group; w mean 1 per head). One rotation per layer.
"""

def rotate_dequant(z: torch.Tensor, R: torch.Tensor | None, clip: float, G: int, eps: float = 1e-8) -> torch.Tensor:
    """Eq. 4: D_R,c(z) = Q2(z R; c, G) R^T. z (B, H, T, d), R (H, d, d) or None (identity).
    Computed in fp32 whatever z's dtype (bf16 z, fp32 R is fine); returns z's dtype."""
    if R is None:
        return q2(z, clip, G, eps)
    zf, Rf = z.float(), R.float().unsqueeze(0)
    return (q2(zf @ Rf, clip, G, eps) @ Rf.transpose(-1, -2)).to(z.dtype)  # Eq. 4


def hadamard(d: int, dtype=torch.float32) -> torch.Tensor:
    """Normalised Sylvester Hadamard H_d / sqrt(d), built by Kronecker doubling (d a power of 2)."""
    assert d >= 1 and d & (d - 1) == 0, "a Hadamard matrix needs d a power of two"
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype)


def identity_rotation(n_kv_heads: int, d: int, device=None) -> torch.Tensor:
    return torch.eye(d, device=device).expand(n_kv_heads, d, d).clone()    # naive INT2


def quarot_rotation(n_kv_heads: int, d: int, device=None) -> torch.Tensor:
    return hadamard(d).to(device).expand(n_kv_heads, d, d).clone()         # QuaRot, every head


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """perm[i] = i with its log2(d) bits reversed (d a power of 2)."""
    bits = int(math.log2(d))
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(d)])


def oscar_covariances(q, k, v):
    """Sigma_Q and Sigma_V (d, d) of one layer in float64, as in the section's docstring.
    q (N, H_q, T, d), k and v (N, H_kv, T, d) post-RoPE."""
    N, Hq, T, d = q.shape
    Hkv = k.shape[1]
    qg = q.double().reshape(N, Hkv, Hq // Hkv, T, d)                    # (N, H_kv, n_rep, T, d)
    sigma_qh = torch.einsum("nhrtd,nhrte->hde", qg, qg) / (N * (Hq // Hkv) * T)  # (H_kv, d, d)
    sigma_q = sigma_qh.mean(0)                               # = E[q^T q] over all query heads
    kf, vf = k.double(), v.double()
    w = torch.einsum("nhtd,hde,nhte->nht", kf, sigma_qh, kf)            # (N, H_kv, T)
    w = w / w.sum(dim=(0, 2), keepdim=True).clamp_min(1e-12) * (N * T)  # mean 1 per head
    sigma_v = torch.einsum("nht,nhtd,nhte->de", w, vf, vf) / (N * Hkv * T)
    return sigma_q, sigma_v


def oscar_rotation(cov: torch.Tensor) -> torch.Tensor:
    """(d, d) OSCAR base R = U H P of a covariance, as the authors compose it: U exactly as
    eigh returns it for the float64-symmetrised Sigma (its order, its signs: the asymmetric
    quantizer notices both); P = I[:, pi], pi[bitrev(i)] = the i-th largest eigenvalue."""
    d = cov.shape[-1]
    sym = (cov.double() + cov.double().transpose(-1, -2)) / 2
    evals, U = torch.linalg.eigh(sym)
    pi = torch.empty(d, dtype=torch.long, device=cov.device)
    pi[bit_reversal_permutation(d).to(cov.device)] = torch.argsort(evals, descending=True)
    return (U @ hadamard(d, torch.float64).to(cov.device))[:, pi].float()   # U H P


def oscar_bases(q, k, v, n_kv_heads: int):
    """OSCAR key and value bases of one layer, shared by its heads: (H_kv, d, d) each."""
    d = q.shape[-1]
    sigma_q, sigma_v = oscar_covariances(q, k, v)
    rk, rv = oscar_rotation(sigma_q), oscar_rotation(sigma_v)
    return rk.expand(n_kv_heads, d, d).clone(), rv.expand(n_kv_heads, d, d).clone()


def base_rotations(base: str, q, k, v, cfg: Config):
    """R_base for keys and values of one layer, on k's device: "identity", "quarot" or
    "oscar" (q, k, v the layer's full-precision calibration tensors, used by OSCAR)."""
    H, d, dev = cfg.n_kv_heads, cfg.head_dim, k.device
    assert base in ("identity", "quarot", "oscar"), f"unknown base {base!r}"
    if base == "identity":
        return identity_rotation(H, d, dev), identity_rotation(H, d, dev)
    if base == "quarot":
        return quarot_rotation(H, d, dev), quarot_rotation(H, d, dev)
    return oscar_bases(q, k, v, H)


# ----------------------------------------------------------------------------------------
# 4. Key centering (attention-equivalent reparameterisation)
# ----------------------------------------------------------------------------------------
"""
mu_h = mean of the post-RoPE keys of KV head h over calibration tokens. Every cached key
is stored as k - mu (sink and recent windows too). For a fixed query every logit moves by
the same -<q, mu>/sqrt(d), so softmax is unchanged exactly; centering before RoPE would
not be, since RoPE rotates mu differently at each position. It removes per-channel
offsets that would otherwise use up INT2's four levels. (A model with learned attention-
sink logits would have to shift those by the same amount; this model has none.)
"""

def key_mean(k: torch.Tensor) -> torch.Tensor:
    """k (N, H_kv, T, d) post-RoPE calibration keys -> mu (H_kv, d) fp32 (summed in float64)."""
    return k.double().mean(dim=(0, 2)).float()


def center_keys(k: torch.Tensor, k_mean: torch.Tensor | None) -> torch.Tensor:
    """k (B, H_kv, T, d) - mu (H_kv, d), in k's dtype."""
    return k if k_mean is None else k - k_mean[None, :, None, :].to(k.dtype)


# ----------------------------------------------------------------------------------------
# 5. Exact windows, and where the error goes (Eq. 5-10)
# ----------------------------------------------------------------------------------------
"""
The first `sink` tokens and the `window` most recent stay exact, the rest go through
Eq. 4: query t reads key s exactly if s < sink or s > t - window (`exact`; None: INT2 for
all), so the effective key depends on the query. A layer's storage is a KVQuant. With the
effective k~, v~ (k_tilde, v_tilde):
Eq. 5  a~ = <q, k~>/sqrt(d),  p~ = softmax(a~)
Eq. 6  da = a~ - a = <q, dk>/sqrt(d),  dk = k~ - k,  dv = v~ - v,  dp = p~ - p
Eq. 7  y~ = (sum_s p~_s v~_s) W_O^T
Eq. 8  y~ - y = (sum_s dp_s v_s) W_O^T + (sum_s p~_s dv_s) W_O^T = dy_K + dy_V   (exact)
Eq. 9  E_rec = |K - K~|^2 + |V - V~|^2          (the proxy)
Eq. 10 E_out = |dy_K + dy_V|^2                  (what the model sees)
"""

def exact_window_mask(q_pos: torch.Tensor, T: int, sink: int, window: int, frontier=None) -> torch.Tensor:
    """(Tq, T) bool: key s is exact for the query at q_pos[i] if s < sink or s >= frontier[i], by default
    q_pos[i] + 1 - window (s > q_pos[i] - window); serving's frontiers: int2_frontier."""
    s = torch.arange(T, device=q_pos.device)[None, :]
    return (s < sink) | (s >= (q_pos + 1 - window if frontier is None else frontier)[:, None])


def int2_mask(mask, exact=None):
    """(Tq, T) True where the query reads the INT2 copy: allowed and outside the windows."""
    return mask if exact is None else mask & ~exact


def int2_tokens(mask, exact=None) -> torch.Tensor:
    """(T,) the tokens some query reads in INT2: the cache's INT2 part (the others never are)."""
    return int2_mask(mask, exact).any(dim=0)


@dataclass
class KVQuant:
    """How one layer's KV cache is stored (Section 8 pages it with both in INT2, R_V folded)."""
    k_mean: torch.Tensor | None = None   # (H_kv, d) key centering mu, or None
    r_k: torch.Tensor | None = None      # (H_kv, d, d) key rotation, or None (identity)
    r_v: torch.Tensor | None = None      # (H_kv, d, d) value rotation, or None (identity)
    quant_k: bool = True                 # keys outside the windows in INT2
    quant_v: bool = True                 # values outside the windows in INT2
    clip_k: float | None = None          # this layer's c_K, or None: Config's
    clip_v: float | None = None          # this layer's c_V, or None: Config's

    def to(self, device) -> KVQuant:     # the same spec with its tensors on `device`
        return replace(self, **{f: getattr(self, f).to(device) for f in ("k_mean", "r_k", "r_v")
                                if getattr(self, f) is not None})

    def layer_cfg(self, cfg: Config) -> Config:   # cfg with this layer's clips
        return replace(cfg, clip_k=self.clip_k or cfg.clip_k, clip_v=self.clip_v or cfg.clip_v)


def dequant_keys(k, k_mean, r_k, cfg: Config):
    """k~ = mu + D_{R_K,c_K}(k - mu), k (B, H_kv, T, d): Eq. 4 on the centered keys (+ mu: same softmax)."""
    k_tilde = rotate_dequant(center_keys(k, k_mean), r_k, cfg.clip_k, cfg.group_size, cfg.scale_eps)
    return k_tilde if k_mean is None else k_tilde + k_mean[None, :, None, :].to(k_tilde.dtype)


def effective_kv(k, v, spec: KVQuant, cfg: Config):
    """Dequantized keys and values in the model's own basis (no windows applied), with the
    layer's clips: k~ = mu + D_{R_K,c_K}(k - mu),  v~ = D_{R_V,c_V}(v)   (Eq. 4)."""
    c = spec.layer_cfg(cfg)
    k_tilde = dequant_keys(k, spec.k_mean, spec.r_k, c) if spec.quant_k else k
    v_tilde = rotate_dequant(v, spec.r_v, c.clip_v, c.group_size, c.scale_eps) if spec.quant_v else v  # Eq. 4
    return k_tilde, v_tilde


def exact_attention_probs(q, k, mask):                 # Eq. 1 under the (Tq, T) mask: p (B, H_q, Tq, T)
    return torch.softmax(gqa_logits(q, k).masked_fill(~mask, float("-inf")), dim=-1)


def effective_logits(q, k, k_tilde, mask, exact=None):
    """Eq. 5 logits a~ (B, H_q, Tq, T): INT2 keys outside the windows, -inf where masked."""
    a_int2 = gqa_logits(q, k_tilde)                             # Eq. 5 (INT2 keys)
    a = a_int2 if exact is None else torch.where(exact, gqa_logits(q, k), a_int2)
    return a.masked_fill(~mask, float("-inf"))


def window_readout(p_tilde, v, v_tilde, quant):
    """Readout with exact values inside the windows and INT2 values outside: (B, H_q, Tq, d)."""
    return gqa_readout(p_tilde * ~quant, v) + gqa_readout(p_tilde * quant, v_tilde)


def effective_attention(q, k, v, k_tilde, v_tilde, mask, exact=None):
    """Eq. 5 and the readout: q (B, H_q, Tq, d); k, v, k_tilde, v_tilde (B, H_kv, T, d);
    mask, exact (Tq, T) bool -> p~ (B, H_q, Tq, T), o~ (B, H_q, Tq, d)."""
    p_tilde = torch.softmax(effective_logits(q, k, k_tilde, mask, exact), dim=-1)  # Eq. 5
    return p_tilde, window_readout(p_tilde, v, v_tilde, int2_mask(mask, exact))


def key_error(p, p_tilde, v, w_o):
    """Eq. 8, key-induced term: dy_K = (sum_s dp_s v_s) W_O^T, (B, H_q, Tq, d_model)."""
    return head_output(gqa_readout(p_tilde - p, v), w_o)


def value_error(p_tilde, dv, quant, w_o):
    """Eq. 8, value-induced term: dy_V = (sum_s p~_s dv_s) W_O^T, (B, H_q, Tq, d_model).
    quant (Tq, T): where the query reads the INT2 value (dv = 0 inside the windows)."""
    return head_output(gqa_readout(p_tilde * quant, dv), w_o)


def error_decomposition(q, k, v, k_tilde, v_tilde, w_o, mask, exact=None):
    """Eq. 5-10 for every query head (shapes as in effective_attention; w_o (H_q, d_model, d)):
    y, y_tilde, dy_k, dy_v (B, H_q, Tq, d_model); p, p_tilde, da (B, H_q, Tq, T); e_rec
    (Eq. 9, over the cache's INT2 part); e_out (B, H_q, Tq, Eq. 10)."""
    a = gqa_logits(q, k).masked_fill(~mask, float("-inf"))                 # Eq. 1
    p = torch.softmax(a, dim=-1)                                            # Eq. 1
    y = head_output(gqa_readout(p, v), w_o)                                 # Eq. 2-3
    a_tilde = effective_logits(q, k, k_tilde, mask, exact)                  # Eq. 5
    da = torch.where(mask, a_tilde - a, torch.zeros_like(a))                # Eq. 6
    p_tilde = torch.softmax(a_tilde, dim=-1)                                # Eq. 5
    quant = int2_mask(mask, exact)                                          # dv = 0 in windows
    y_tilde = head_output(window_readout(p_tilde, v, v_tilde, quant), w_o)  # Eq. 7
    dy_k = key_error(p, p_tilde, v, w_o)                                    # Eq. 8, key term
    dy_v = value_error(p_tilde, v_tilde - v, quant, w_o)                    # Eq. 8, value term
    stored = int2_tokens(mask, exact)                                       # INT2 tokens (T,)
    e_rec = ((k - k_tilde)[:, :, stored] ** 2).sum() + ((v - v_tilde)[:, :, stored] ** 2).sum()  # Eq. 9
    e_out = ((dy_k + dy_v) ** 2).sum(-1)                                    # Eq. 10
    return dict(y=y, y_tilde=y_tilde, dy_k=dy_k, dy_v=dy_v, p=p, p_tilde=p_tilde, da=da, e_rec=e_rec, e_out=e_out)


# ----------------------------------------------------------------------------------------
# 6. OptR: output-oriented rotation correction
# ----------------------------------------------------------------------------------------
"""
Per layer and KV head, R = R_base exp(A - A^T), A = 0 at the start (training starts exactly
at the base); only A is trained, the model is frozen, gradients pass Q2 as in Section 2.
The two losses are the two terms of Eq. 8:
  keys first:  L_K = KL(p || p~) + lambda * mean (dy_K)^2     (values in full precision)
  then values: L_V = mean (dy_V)^2, with the learned key rotation fixed (p~ is final).
"mean" as in the authors' code: the squared output error averaged over the queries AND the
d_model hidden units (out_reduce="sum": summed over d_model); KL summed over keys with
their 1e-12 clamp, averaged over queries; both averaged over the group's query heads and
the sequences. Queries: the last n_loss_queries positions (from max(1, T - n)), causal;
windows static as in their calibration (the sequence's first `sink` and last `window`
tokens exact for every query). Adam on the mean of the per-head losses, full batch; each
head is scored on held-out sequences after updates 1, 1 + eval_every, ... and the last,
keeps its best A, and falls back to R_base if that is not below the base's held-out loss.
Layers are calibrated independently.
"""

def optr_rotation(r_base: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """R = R_base exp(A - A^T): orthogonal for any A, equal to R_base at A = 0.
    r_base, A (H, d, d) -> (H, d, d). Computed in float64: in fp32 the exponential of a
    large skew matrix drifts from orthogonal by more than 1e-5."""
    S = (A - A.transpose(-1, -2)).double()
    return (r_base.double() @ torch.linalg.matrix_exp(S)).to(r_base.dtype)


def per_head(x, n_kv_heads):
    """(B, H_q, Tq) -> mean over batch, the group's query heads and queries: (H_kv,)."""
    B, Hq, Tq = x.shape
    return x.view(B, n_kv_heads, Hq // n_kv_heads, Tq).mean(dim=(0, 2, 3))


def output_error(dy, cfg: Config):
    """Squared output error per query, (B, H_q, Tq, d_model) -> (B, H_q, Tq): the mean over
    the hidden units (the authors' normalisation) or, with out_reduce="sum", the sum."""
    sq = dy.pow(2)
    return sq.mean(-1) if cfg.out_reduce == "mean" else sq.sum(-1)


def kl_divergence(p, p_tilde):
    """KL(p || p~) per query, summed over keys: sum p (log max(p, 1e-12) - log max(p~, 1e-12)),
    the authors' clamp (a masked key has p = p~ = 0 and adds nothing). (..., T) -> (...)."""
    return (p * (p.clamp_min(1e-12).log() - p_tilde.clamp_min(1e-12).log())).sum(-1)


def optr_key_loss(q, k, v, w_o, r_k, k_mean, mask, exact, cfg: Config):
    """Per-head L_K = KL(p || p~) + lambda * mean (dy_K)^2, (H_kv,); values exact.
    q (B, H_q, Tq, d); k, v (B, H_kv, T, d); w_o (H_q, d_model, d); r_k (H_kv, d, d);
    k_mean (H_kv, d) or None; mask, exact (Tq, T)."""
    p = exact_attention_probs(q, k, mask)                                          # Eq. 1
    k_tilde = dequant_keys(k, k_mean, r_k, cfg)                                    # Eq. 4
    p_tilde = torch.softmax(effective_logits(q, k, k_tilde, mask, exact), dim=-1)  # Eq. 5
    dy_k = key_error(p, p_tilde, v, w_o)                                           # Eq. 8
    return per_head(kl_divergence(p, p_tilde) + cfg.lam * output_error(dy_k, cfg), k.shape[1])


def optr_value_loss(p_tilde, v, w_o, r_v, mask, exact, cfg: Config):
    """Per-head L_V = mean (dy_V)^2, (H_kv,), given the final INT2-key attention p~
    (B, H_q, Tq, T); v (B, H_kv, T, d); r_v (H_kv, d, d)."""
    dv = rotate_dequant(v, r_v, cfg.clip_v, cfg.group_size, cfg.scale_eps) - v      # Eq. 4
    dy_v = value_error(p_tilde, dv, int2_mask(mask, exact), w_o)                    # Eq. 8
    return per_head(output_error(dy_v, cfg), v.shape[1])


def fit_rotation(loss_fn, r_base, cfg: Config, tag: str = "", log=None):
    """Learn R = R_base exp(A - A^T) per head. loss_fn(R, split) -> per-head losses (H_kv,) on
    split "cal" (differentiable) or "held". Returns R (H_kv, d, d) and report rows."""
    H, d, _ = r_base.shape
    r_base = r_base.float()
    A = torch.zeros(H, d, d, device=r_base.device, requires_grad=True)
    opt = torch.optim.Adam([A], lr=cfg.lr)
    with torch.no_grad():
        base = loss_fn(r_base, "held")
    best, best_A = base.clone(), torch.zeros_like(A)
    best_step = torch.zeros(H, dtype=torch.long, device=r_base.device)
    for step in range(1, cfg.steps + 1):
        loss = loss_fn(optr_rotation(r_base, A), "cal").mean()      # mean of the per-head losses
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step - 1) % cfg.eval_every == 0 or step == cfg.steps:   # after updates 1, 21, ..., last
            with torch.no_grad():
                held = loss_fn(optr_rotation(r_base, A), "held")
                better = held < best
                best = torch.where(better, held, best)
                best_A[better] = A.detach()[better]
                best_step[better] = step
            if log:
                log(f"  {tag} step {step:4d} | cal loss {loss.item():.5f} | "
                    f"held {' '.join(f'{x:.5f}' for x in held.tolist())}")
    kept = best < base                                   # fallback: no gain -> the base itself
    with torch.no_grad():
        R = torch.where(kept[:, None, None], optr_rotation(r_base, best_A), r_base)
    rows = [dict(head=h, base_loss=base[h].item(), best_loss=best[h].item(),
                 best_step=int(best_step[h]), kept=bool(kept[h])) for h in range(H)]
    return R.detach(), rows


def loss_queries(T: int, cfg: Config, query_positions=None, device=None):
    """The loss's query positions (given, or the authors' max(1, T - n_loss_queries) .. T - 1),
    their causal mask and the authors' static exact-window mask (Tq, T): the sequence's own sink and
    last window, for every query."""
    q_pos = torch.arange(max(1, T - cfg.n_loss_queries), T, device=device) \
        if query_positions is None else query_positions.to(device)
    mask = causal_mask(q_pos, T)
    exact = exact_window_mask(torch.full_like(q_pos, T - 1), T, cfg.sink, cfg.window).expand(len(q_pos), T)
    assert bool(int2_mask(mask, exact).any()), f"T = {T}: no loss query reads an INT2 token"
    return q_pos, mask, exact


def loss_data(splits: dict, cfg: Config, query_positions=None) -> dict:
    """{split: (q, k, v)} -> {split: (q at the loss queries, k, v, mask, exact)}, fp32 on k's device."""
    data = {}
    for split, (q, k, v) in splits.items():
        q_pos, mask, exact = loss_queries(k.shape[2], cfg, query_positions, k.device)
        data[split] = (q[:, :, q_pos].detach().float(), k.detach().float(), v.detach().float(), mask, exact)
    return data


@torch.no_grad()
def value_loss(data: dict, w_o, k_mean, r_k, cfg: Config):
    """L_V as a function (R_V, split) -> (H_kv,), with the final INT2-key attention p~ (keys
    at r_k) computed once and fixed."""
    fixed = {}
    for split, (q, k, v, mask, exact) in data.items():
        k_tilde = dequant_keys(k, k_mean, r_k, cfg)                                       # Eq. 4
        p_tilde = torch.softmax(effective_logits(q, k, k_tilde, mask, exact), dim=-1)     # Eq. 5
        s = int2_tokens(mask, exact)                     # no query reads the others' dv
        fixed[split] = (p_tilde[..., s], v[:, :, s], mask[:, s], exact[:, s])
    return lambda R, split: optr_value_loss(*fixed[split][:2], w_o, R, *fixed[split][2:], cfg)


def calibrate_layer(cal, held, w_o, r_k0, r_v0, k_mean, cfg: Config, query_positions=None,
                    learn_k=True, learn_v=True, tag="", log=None, fast=True):
    """OptR for one layer. cal, held: full-precision (q (N, H_q, T, d), k, v (N, H_kv, T, d))
    post-RoPE, any float dtype (the math runs in fp32 on k's device); w_o (H_q, d_model, d);
    r_k0, r_v0 (H_kv, d, d) bases; k_mean (H_kv, d) or None. Keys first, then values at the
    learned R_K. fast: L_K by fast_key_loss (Appendix A: the same value and gradient, the
    exactly read keys in closed form). Returns a KVQuant and report rows."""
    data = loss_data({"cal": cal, "held": held}, cfg, query_positions)
    dev = data["cal"][1].device
    w_o, k_mean, r_k0, r_v0 = (x if x is None else x.float().to(dev) for x in (w_o, k_mean, r_k0, r_v0))
    key_loss = fast_key_loss(data, w_o, k_mean, cfg) if fast else \
        lambda R, split: optr_key_loss(*data[split][:3], w_o, R, k_mean, *data[split][3:], cfg)   # L_K
    r_k, rows_k = fit_rotation(key_loss, r_k0, cfg, f"{tag}K", log) if learn_k else (r_k0, [])
    r_v, rows_v = fit_rotation(value_loss(data, w_o, k_mean, r_k, cfg), r_v0, cfg, f"{tag}V", log) \
        if learn_v else (r_v0, [])
    return (KVQuant(k_mean=k_mean, r_k=r_k, r_v=r_v),
            [dict(r, part="k") for r in rows_k] + [dict(r, part="v") for r in rows_v])


def calibrate_one_layer(w_o, l, cal, held, cfg: Config, base="quarot", center=True, learn=True,
                        query_positions=None, log=None):
    """Layer l from its captured (q, k, v) and W_O (H_q, d_model, d): mu, the base, then OptR
    -> KVQuant, report rows."""
    q, k, v = cal
    mu = key_mean(k) if center else None                                   # Section 4
    r_k0, r_v0 = base_rotations(base, q, k, v, cfg)                        # Section 3
    if not learn:
        return KVQuant(k_mean=mu, r_k=r_k0, r_v=r_v0), []
    spec, rows = calibrate_layer(cal, held, w_o, r_k0, r_v0, mu, cfg, query_positions, tag=f"L{l} ", log=log)
    return spec, [dict(r, layer=l) for r in rows]


def calibrate(model, calib_idx, heldout_idx, base="quarot", center=True, learn=True,
              query_positions=None, cfg: Config | None = None, log=None, captured=None,
              layer_map=map, one_layer=calibrate_one_layer):
    """Every layer of a frozen model from its full-precision q, k, v: calib_idx (N, T) and
    heldout_idx (M, T') disjoint tokens, or their `captured` (cal, held). layer_map (a thread
    pool's, say) may run the independent layers at once. Returns per-layer KVQuant and rows
    (layer, head, part, base_loss, best_loss, best_step, kept)."""
    cal, held = captured or full_precision_captures(model, calib_idx, heldout_idx)
    one = lambda l: one_layer(model.o_proj_heads(l), l, cal[l], held[l], cfg or model.cfg,
                              base, center, learn, query_positions, log)
    done = list(layer_map(one, range(len(cal))))
    return [spec for spec, _ in done], [r for _, rows in done for r in rows]


# ----------------------------------------------------------------------------------------
# 7. The model: a Llama/Qwen3-style decoder with Hugging Face parameter names
# ----------------------------------------------------------------------------------------
"""
RMSNorm, RoPE (rotate-half), GQA attention, SwiGLU MLP; optional Qwen3 q/k-norm and Qwen2 q/k/v bias;
names as model.layers.N.self_attn.q_proj.weight. One forward; what attention reads is pluggable,
`attention(layer, q, k, v) -> o`, post-RoPE q, o (B, H_q, T, d), k, v (B, H_kv, T, d): None, exact causal
attention; SimulatedINT2(kv, cfg), Section 5's INT2 cache on every position at once; paged_forward's,
Section 8's paged cache. fold_value_rotation (what Section 8 serves): a copy, each layer's R_V in v_proj, o_proj.
"""

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()                                 # normalised in fp32, scaled in x's dtype
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(pos: torch.Tensor, d: int, theta: float):
    """pos (..., T) integer positions -> cos, sin (..., T, d) in the rotate-half layout."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d)
    ang = (pos.float()[..., None] * inv).repeat(*[1] * pos.dim(), 2)   # (..., T, d): halves equal
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x (B, H, T, d); cos, sin (B or 1, T, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


def exact_attention(layer: int, q, k, v):
    """Full-precision causal attention over the T tokens given (Eq. 1-2)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def int2_frontier(T: int, window: int, chunks=(), device=None) -> torch.Tensor:
    """(T,) per query t the first key after the sink it reads exactly, served by forwards of `chunks`
    tokens, then of one each: one token appends first, t + 1 - window (the ladders' rule, chunks ());
    a forward [c0, c1) of several reads the windows held at its start and itself: c0 - window."""
    f, c0 = torch.arange(T, device=device) + 1 - window, 0
    for n in chunks:
        f[c0:c0 + n] = c0 - window if n > 1 else f[c0:c0 + n]
        c0 += n
    return f


class SimulatedINT2:
    """The INT2 cache of the per-layer specs `kv` on every position at once (Section 5): dense
    (T, T) logits, or block=n the same numbers block by block (Appendix A); chunks: the windows
    as served by forwards of these lengths (int2_frontier; None: every query its own)."""

    def __init__(self, kv: list, cfg: Config, block: int | None = None, chunks=None):
        assert len(kv) == cfg.n_layers and (block is None or block >= 1), "a KVQuant per layer"
        assert block is None or chunks is None, "block by block: every query its own windows"
        self.kv, self.cfg, self.block, self.chunks = kv, cfg, block, chunks

    def __call__(self, layer: int, q, k, v):
        c, T = self.cfg, q.shape[2]
        k_tilde, v_tilde = effective_kv(k, v, self.kv[layer], c)            # Eq. 4
        if self.block is not None:
            return block_simulated_attention(q, k, v, k_tilde, v_tilde, c.sink, c.window, self.block)
        pos = torch.arange(T, device=q.device)
        frontier = None if self.chunks is None else int2_frontier(T, c.window, self.chunks, q.device)
        mask, exact = causal_mask(pos, T), exact_window_mask(pos, T, c.sink, c.window, frontier)
        return effective_attention(q, k, v, k_tilde, v_tilde, mask, exact)[1]   # Eq. 5, Eq. 2


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, hd, b = cfg, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=b)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=b)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=b)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_eps), RMSNorm(hd, cfg.rms_eps)

    def forward(self, x, pos, layer: int, attention):
        """x (B, T, d_model), pos (B or 1, T) positions -> (B, T, d_model), and the post-RoPE (q, k, v) read."""
        c, (B, T, _) = self.cfg, x.shape
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)    # (B, H_q, T, d); k, v (B, H_kv, T, d)
        k, v = (p(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention(layer, q, k, v)                                           # (B, H_q, T, d)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1).to(x.dtype)), (q, k, v)


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, pos, layer, attention):
        a, qkv = self.self_attn(self.input_layernorm(x), pos, layer, attention)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), qkv


class TinyLM(nn.Module):
    """model.embed_tokens -> model.layers[i] -> model.norm -> lm_head."""

    def __init__(self, cfg: Config, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(embed_tokens=nn.Embedding(cfg.vocab_size, cfg.d_model),
                                        layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers)),
                                        norm=RMSNorm(cfg.d_model, cfg.rms_eps)))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not init:                  # weights come from a checkpoint (load_state_dict)
            return
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                elif name.endswith(".bias"):
                    p.zero_()

    def hidden_states(self, idx, attention=None, pos=None, capture: list | None = None):
        """idx (B, T) at positions pos (B or 1, T; default 0 .. T-1) -> final normed hidden states
        (B, T, d_model); attention as above; capture: a list receiving each layer's (q, k, v)."""
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)[None]
        x = self.model.embed_tokens(idx)
        for l, layer in enumerate(self.model.layers):
            x, qkv = layer(x, pos, l, exact_attention if attention is None else attention)
            if capture is not None:
                capture.append(qkv)
        return self.model.norm(x)

    def forward(self, idx, attention=None, pos=None, capture: list | None = None):  # logits (B, T, vocab)
        return self.lm_head(self.hidden_states(idx, attention, pos, capture))

    def o_proj_heads(self, layer: int) -> torch.Tensor:        # W_O of a layer: (H_q, d_model, d)
        return split_o_proj(self.model.layers[layer].self_attn.o_proj.weight, self.cfg.n_heads)


def fold_value_rotation(model, kv: list, cfg: Config | None = None):
    """A copy of TinyLM (or of a transformers model, cfg: hf_config's) with each layer's R_V folded
    in: v_proj rows of head h R_h^T W_h (bias b_h R_h), o_proj columns of query head j W_O,j R_h."""
    c, model = cfg or model.cfg, copy.deepcopy(model)
    for layer, spec in zip(model.model.layers, kv):
        if spec.r_v is None:
            continue
        R, attn = spec.r_v.to(torch.float64), layer.self_attn              # R (H_kv, d, d)
        with torch.no_grad():
            wv = attn.v_proj.weight.double().view(c.n_kv_heads, c.head_dim, c.d_model)
            attn.v_proj.weight.copy_((R.transpose(-1, -2) @ wv).reshape_as(attn.v_proj.weight))
            if attn.v_proj.bias is not None:
                bv = attn.v_proj.bias.double().view(c.n_kv_heads, 1, c.head_dim)
                attn.v_proj.bias.copy_((bv @ R).reshape(-1))
            wo = attn.o_proj.weight.double().view(c.d_model, c.n_heads, c.head_dim)
            Rq = R.repeat_interleave(c.n_rep, dim=0)                       # (H_q, d, d)
            attn.o_proj.weight.copy_(torch.einsum("mjd,jde->mje", wo, Rq).reshape(c.d_model, -1))
    return model


@torch.no_grad()
def full_precision_captures(model, calib_idx, heldout_idx):
    """Per layer, the full-precision (q, k, v) that calibration learns from: two lists."""
    cal, held = [], []
    model(calib_idx, capture=cal)
    model(heldout_idx, capture=held)
    return cal, held


# ----------------------------------------------------------------------------------------
# 8. Serving: the paged INT2 KV cache, decode and the multi-token forward
# ----------------------------------------------------------------------------------------
"""
The cache stores (k - mu) R_K and v R_V (R_V folded into the weights: fold_value_rotation): the sink and
recent windows in full precision (window_dtype), everything between them in INT2 pages. Queries are rotated
by R_K: <q R_K, (k - mu) R_K> = <q, k - mu>, the same softmax. Layout (per layer; kernel.py reads exactly this):
  k_codes, v_codes  uint8 (num_pages, H_kv, page_size, d/4)   4 codes per byte (pack_int2)
  k_scale, k_zero, v_scale, v_zero  fp32 (num_pages, H_kv, page_size, d/G)
  block_table  int32 (max_seqs, num_pages): INT2 token n of a sequence lives in page
               block_table[seq, n // page_size], slot n % page_size; -1 = no page
  win_k, win_v  (max_seqs, H_kv, sink + window, d): position p in window slot ring_slot(p)
  length  (max_seqs,) on the host: tokens held, the same in every layer; past sink + window, INT2
Plan once, then per layer: write, read. reserve takes a forward's pages and makes its Step (every
index a layer needs, uploaded at once); each layer then, as the authors' SGLang engine (README, "Serving"):
  decode  one token enters the window, the oldest leaves to INT2; its query reads all held (paged_decode_reference).
  extend  a multi-token forward (a prompt, a chat turn): its queries read the chunk's own keys
          exactly and what was held before it as held (chunk_attention); then the chunk is stored.
"""

def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """(..., d) integer codes in [0, 3] -> (..., d/4) uint8, byte j = dims j, j+d/4, j+d/2, j+3d/4."""
    d = codes.shape[-1]
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], 4, d // 4)
    return c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """(..., d/4) uint8 -> (..., d) uint8 codes; inverse of pack_int2."""
    return torch.cat([(packed >> (2 * i)) & 3 for i in range(4)], dim=-1)


def q2_quantize(x: torch.Tensor, clip: float, G: int, eps: float = 1e-8):
    """Storage form of Q2: x (..., d) float, 4 | d -> (packed (..., d/4) uint8, scale, zero (..., d/G) fp32)."""
    assert x.shape[-1] % 4 == 0, "4 codes per byte: d must be a multiple of 4"
    xg, scale, zero = _q2_params(x.float(), clip, G, eps)
    code = torch.clamp(torch.floor(xg / scale + zero + 0.5), 0, 3)
    return pack_int2(code.reshape(x.shape)), scale.squeeze(-1), zero.squeeze(-1)


def q2_dequantize(packed, scale, zero, G: int) -> torch.Tensor:
    """Q2's dequant of the storage form: (code - zero) * scale per group -> (..., d) fp32."""
    codes = unpack_int2(packed).float().unflatten(-1, (-1, G))                  # (..., d/G, G)
    return ((codes - zero[..., None]) * scale[..., None]).flatten(-2)


def rotate_rows(x: torch.Tensor, R: torch.Tensor | None) -> torch.Tensor:
    """x (n, H, T, d) @ R (H, d, d), summed in float64 and rounded once to x's dtype (exact products:
    T tokens at once and one at a time store the same numbers)."""
    return x if R is None else (x.double() @ R.double()).to(x.dtype)


def stored_keys(spec: KVQuant, k: torch.Tensor) -> torch.Tensor:
    """(k - mu) R_K, the keys as cached; k (n, H_kv, T, d)."""
    return rotate_rows(center_keys(k, spec.k_mean), spec.r_k)


PACKED = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")   # a layer's INT2 tensors


def ring_slot(p, sink: int, window: int):
    """The window slot of position p (int or array): p in the sink, else sink + (p - sink) % window (-1: none)."""
    return np.where(p < sink, p, sink + (p - sink) % window if window else -1)


class Step:
    """A forward's plan, made once (PagedKVCache.reserve), read by every layer: sequence b (id seqs[b]) held
    start[b] tokens, its chunk rows pad[b]..T-1 come next. Host: seqs, pad, `held` (counts before); for one
    token `plan` (5, n), kernel.cpu_decode_step's (window slot; page, slot of the INT2 token made: the ring's
    oldest, or with window 0 itself; -1: none; INT2 and window counts after). Device, one upload, `on`: seq,
    start, n_quant, win_len after, block_table rows; the tokens going INT2, the ring's (old_seq, old_slot) then
    chunk rows (new_b, new_t), into (page, slot); chunk rows (win_b, win_t) into the windows (win_seq, win_slot)."""

    def __init__(self, cache, seqs: list, start: np.ndarray, T: int, pad: np.ndarray):
        (S, W, P), end = (cache.cfg.sink, cache.cfg.window, cache.cfg.page_size), start + T - pad
        self.seqs, self.pad = np.asarray(seqs, dtype=np.int64), pad
        q0, q1 = (np.maximum(n - S - W, 0) for n in (start, end))                     # INT2 counts before, after
        self.at, self.held = (cache, start, end, q1, S, W, P), dict(n_quant=q0, win_len=start - q0)
        if T == 1:
            n = start - S - W                                                       # the INT2 index made
            made = [cache.pages[s][i // P] if i >= 0 else -1 for s, i in zip(seqs, n)]
            self.plan = np.stack([ring_slot(start, S, W), made, np.where(n >= 0, n % P, -1), q1, end - q1])
        if T > 1 or not compiled(cache):         # `on` made here; for one token where the CPU step is compiled
            self.on = self.upload()              # (it reads `plan`), at a first read if any

    def upload(self) -> dict:
        (cache, start, end, q1, S, W, P), seqs, pad, cat = self.at, self.seqs, self.pad, np.concatenate
        each = lambda f: [f(n0, n1) for n0, n1 in zip(start, end)]                   # positions, per sequence:
        old = each(lambda n0, n1: np.arange(max(S, n0 - W), min(n1 - W, n0)))       # leaving the ring for INT2
        new = each(lambda n0, n1: np.arange(max(S, n0), n1 - W))                     # the chunk's for INT2
        win = each(lambda n0, n1: np.r_[n0:min(S, n1), max(S, n1 - W, n0) if W else n1:n1])   # ... for the windows
        b_of = lambda ps: np.repeat(np.arange(len(seqs)), [len(p) for p in ps])      # their sequence
        row = lambda ps: cat(ps) - (start - pad)[b_of(ps)]                             # their chunk row
        page = lambda ps: cat([np.asarray(cache.pages[s], dtype=np.int64)[(p - S) // P] for s, p in zip(seqs, ps)])
        on = dict(seq=seqs, start=start, n_quant=q1, win_len=end - q1, old_seq=seqs[b_of(old)],
                  old_slot=ring_slot(cat(old), S, W), new_b=b_of(new), new_t=row(new),
                  page=cat([page(old), page(new)]), slot=(cat(old + new) - S) % P, win_b=b_of(win), win_t=row(win),
                  win_seq=seqs[b_of(win)], win_slot=ring_slot(cat(win), S, W))
        dev, host = cache.block_table.device, torch.from_numpy(cat(list(on.values())).astype(np.int32))
        host = host.pin_memory() if dev.type == "cuda" else host                      # then copied asynchronously
        on = dict(zip(on, host.to(dev, non_blocking=True).split([len(x) for x in on.values()])))  # the upload
        return {**on, "block_table": cache.block_table[on["seq"]]}
    on = functools.cached_property(upload)


class PagedKVCache:
    """Page pool + block table + full-precision windows, for every layer of a model."""

    def __init__(self, cfg: Config, num_pages: int, max_seqs: int, kv: list,
                 window_dtype=torch.float32, device="cpu", grow: bool = False):
        """num_pages: the page budget, allocated at once, or (grow: Appendix A) as sequences reach them."""
        need(min(num_pages, max_seqs) >= 1, f"PagedKVCache: num_pages {num_pages}, max_seqs {max_seqs}: >= 1")
        check_kv("PagedKVCache", kv, cfg)
        need(all(s.quant_k and s.quant_v for s in kv), "full precision: make sink + window cover the context")
        self.cfg, self.kv = cfg, [replace(s, r_v=None).to(device) for s in kv]   # R_V: in the weights
        self.quant = [s.layer_cfg(cfg) for s in self.kv]                   # per layer: its clips, their ranks
        self.ranks = [(clip_rank(q.clip_k, q.group_size), clip_rank(q.clip_v, q.group_size)) for q in self.quant]
        L, H, d, P, G = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.page_size, cfg.group_size
        n, self.budget = (0 if grow else num_pages), num_pages            # pages allocated, allowed
        for t in PACKED:          # codes (L, pages, H_kv, P, d/4) uint8; scale, zero (..., d/G) fp32
            codes = t.endswith("codes")
            setattr(self, t, torch.zeros(L, n, H, P, d // 4 if codes else d // G, device=device,
                                         dtype=torch.uint8 if codes else torch.float32))
        self.win_k, self.win_v = (torch.zeros(L, max_seqs, H, cfg.sink + cfg.window, d, dtype=window_dtype,
                                              device=device) for _ in range(2))
        self.block_table = torch.full((max_seqs, num_pages), -1, dtype=torch.int32, device=device)
        self.pages = [[] for _ in range(max_seqs)]                    # the block table on the host
        self.length = torch.zeros(max_seqs, dtype=torch.long)          # tokens held, by every layer
        self.free_pages, self.active = list(range(num_pages)), [False] * max_seqs   # pages from the front

    def add_sequence(self) -> int:
        if all(self.active):
            raise RuntimeError(f"PagedKVCache: all {len(self.active)} sequence slots are in use")
        self.active[s := self.active.index(False)] = True
        return s

    def free(self, seq: int):
        """Return the sequence's pages to the pool and clear its slot."""
        self.check_seqs([seq])
        self.free_pages += self.pages[seq]
        self.block_table[seq].fill_(-1)
        self.pages[seq], self.length[seq], self.active[seq] = [], 0, False
        self.win_k[:, seq], self.win_v[:, seq] = 0, 0

    def check_seqs(self, seqs: list):
        """ValueError unless seqs are distinct ids of active sequences."""
        for s in seqs:
            need(s in range(len(self.active)) and self.active[s], f"seq: expected an active sequence id, got {s}")
        need(len(set(seqs)) == len(seqs), f"seqs: expected distinct sequence ids, got {list(seqs)}")

    def reserve(self, seqs: list, T: int, pad=None) -> Step:
        """A forward of T tokens per sequence (pad (n,): left padding, neither attended nor stored): take the pages
        its INT2 tokens fill, or raise before taking any; advance the lengths; return its Step (T = 0: what is held)."""
        self.check_seqs(seqs)
        c, num_pages, length = self.cfg, self.block_table.shape[1], self.length.numpy()
        pad = np.zeros(len(seqs), np.int64) if pad is None else torch.as_tensor(pad).cpu().numpy()
        start, P, held = length[seqs], c.page_size, c.sink + c.window          # held: before INT2 index 0
        want = [(s, blk) for s, n in zip(seqs, start + T - pad)
                for blk in range(len(self.pages[s]), -(-max(0, n - held) // P))]
        if len(want) > len(self.free_pages) or any(blk >= num_pages for _, blk in want):
            raise RuntimeError(f"PagedKVCache: page pool exhausted ({num_pages} pages, {len(self.free_pages)} free) "
                               f"while sequences {list(seqs)} needed {len(want)} more for {T} more tokens each")
        for s, blk in want:
            self.pages[s].append(self.free_pages.pop(0))
            self.block_table[s, blk] = self.pages[s][-1]
        if want:
            grow_pages(self, 1 + max(self.pages[s][-1] for s, _ in want))     # Appendix A
        length[seqs] = start + T - pad
        return Step(self, seqs, start, T, pad)

    def append(self, seqs: list, k: torch.Tensor, v: torch.Tensor):
        """Append T tokens per sequence to every layer: k (L, n, H_kv, T, d) post-RoPE keys, v (L, n, H_kv,
        T, d) in R_V's basis; pages reserved first (a full pool writes nothing)."""
        c = self.cfg
        check_tensor("k", k, (c.n_layers, len(seqs), c.n_kv_heads, None, c.head_dim), "float", finite=True)
        check_tensor("v", v, tuple(k.shape), "float", finite=True)
        step = self.reserve(seqs, k.shape[3])
        for layer in range(c.n_layers):
            self.store(layer, step, stored_keys(self.kv[layer], k[layer]), v[layer])

    def store(self, layer: int, step: Step, kr, v):
        """kr (n, H_kv, T, d) the stored keys, v as stored, where `step` puts them: position p in window slot
        ring_slot(p) in the sink or among the `window` newest, else INT2 index p - sink. Those leaving the ring,
        then the chunk's past it, through the window dtype, go INT2 in one Q2 call (storage form; on the CPU
        compiled, bit for bit: q2_quantize's torch calls cost more there); then the chunk enters the windows."""
        i, c, page, slot = step.on, self.quant[layer], step.on["page"], step.on["slot"]
        for x, w, names, clip, rank in ((kr, self.win_k[layer], PACKED[:3], c.clip_k, self.ranks[layer][0]),
                                        (v, self.win_v[layer], PACKED[3:], c.clip_v, self.ranks[layer][1])):
            if len(page):
                new = x[i["new_b"], :, i["new_t"]]
                rows = (torch.cat([w[i["old_seq"], :, i["old_slot"]], new.to(w.dtype)]) if c.window else new).float()
                codes, scale, zero = (getattr(self, t)[layer] for t in names)
                if page.device.type == "cpu":
                    kernel.q2_store(rows.contiguous(), rank, c.group_size, c.scale_eps, codes, scale, zero, page, slot)
                else:
                    codes[page, :, slot], scale[page, :, slot], zero[page, :, slot] = q2_quantize(
                        rows, clip, c.group_size, c.scale_eps)
            if len(i["win_slot"]):
                w[i["win_seq"], :, i["win_slot"]] = x[i["win_b"], :, i["win_t"]].to(w.dtype)

    def n_int2(self) -> np.ndarray:     # per sequence, its tokens in INT2 (numpy: no torch call)
        return np.maximum(self.length.numpy() - self.cfg.sink - self.cfg.window, 0)

    def layer_view(self, layer: int, step: Step) -> dict:
        """What a decode reads of the step's sequences after it (paged_decode_reference's keyword arguments)."""
        i = step.on
        return dict(k_codes=self.k_codes[layer], k_scale=self.k_scale[layer], k_zero=self.k_zero[layer],
                    v_codes=self.v_codes[layer], v_scale=self.v_scale[layer], v_zero=self.v_zero[layer],
                    block_table=i["block_table"], n_quant=i["n_quant"], win_k=self.win_k[layer, i["seq"]],
                    win_v=self.win_v[layer, i["seq"]], win_len=i["win_len"])


def held_kv(view: dict, b: int, G: int) -> list:
    """Sequence b of a layer_view: its keys, values (H_kv, n, d) fp32 as stored, the n_quant INT2 tokens
    dequantized (Q2's dequant, page block_table[b, i // P], slot i % P), then the win_len window slots."""
    n, w, P = int(view["n_quant"][b]), int(view["win_len"][b]), view["k_codes"].shape[2]
    rows = lambda x: x[view["block_table"][b, :-(-n // P)].long()].transpose(0, 1).flatten(1, 2)[:, :n]
    return [torch.cat([q2_dequantize(*(rows(view[t]) for t in names), G), view[win][b, :, :w].float()], 1)
            for names, win in ((PACKED[:3], "win_k"), (PACKED[3:], "win_v"))]


def paged_decode_reference(q, group_size: int, sm_scale=None, **view):
    """The decode every kernel must match: q (B, H_q, d) rotated by R_K, a token per sequence, over a
    layer_view -> (B, H_q, d) fp32 in the rotated value basis: Eq. 1-2 over each sequence's held_kv."""
    (B, Hq, d), H = q.shape, view["k_codes"].shape[1]
    out = torch.empty(B, Hq, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        K, V = held_kv(view, b, group_size)
        assert K.shape[1] >= 1, "every sequence holds at least one token"
        a = q[b].float().view(H, Hq // H, d) @ K.mT * (d ** -0.5 if sm_scale is None else sm_scale)  # Eq. 1
        out[b] = (torch.softmax(a, dim=-1) @ V).reshape(Hq, d)                                       # Eq. 2
    return out


def chunk_attention(cache: PagedKVCache, layer: int, step: Step, b: int, qr, kr, v, sm_scale: float):
    """The authors' multi-token forward for the step's sequence b: qr (1, H_q, T, d) by R_K, kr, v (1, H_kv, T, d) as
    stored (nothing held: any basis keeping q k^T) -> (1, H_q, T, d) fp32: the chunk exact and causal, held as held."""
    n0, T, K, V = int(step.held["n_quant"][b] + step.held["win_len"][b]), qr.shape[2], kr[0].float(), v[0].float()
    if n0:                                                                       # counts: host
        held = held_kv({**cache.layer_view(layer, step), **step.held}, b, cache.cfg.group_size)
        K, V = (torch.cat([x, y], 1) for x, y in zip(held, (K, V)))
    mask = None if n0 == 0 else torch.ones(T, n0 + T, dtype=torch.bool, device=qr.device).tril(n0)
    return F.scaled_dot_product_attention(qr.float(), K[None], V[None], attn_mask=mask, is_causal=n0 == 0,
                                          scale=sm_scale, enable_gqa=True)            # Eq. 1-2


def paged_step(cache: PagedKVCache, layer: int, step: Step, q, k, v, attend=None, sm_scale=None, r_v=None, **options):
    """One layer's attention through the cache, as `step` (reserve's) plans: q (n, H_q, T, d), k, v (n, H_kv, T, d)
    post-RoPE (v in R_V's basis; with r_v in the model's, rotated here and o back) -> o (n, H_q, T, d) fp32. One
    token: store, then decode (attend None: kernel.paged_decode, or on CPU pages with fp32 windows Appendix A's
    compiled step). Several: chunk_attention, then store (rows before step.pad: neither attended nor stored);
    a prompt (nothing held) attends in q, k, v's basis: no rotation to make or undo."""
    n, Hq, T, d = q.shape
    spec, scale = cache.kv[layer], d ** -0.5 if sm_scale is None else sm_scale
    if T == 1 and attend is None and compiled(cache, q, k, v):
        return compiled_step(cache, layer, step, q, k, v, scale, r_v=r_v)             # Appendix A
    r_k, prompt = spec.r_k, T > 1 and not (step.held["n_quant"] + step.held["win_len"]).any()
    qr = q.float() if r_k is None or prompt else (q.float().unflatten(1, (len(r_k), -1)) @ r_k[:, None]).flatten(1, 2)
    kr, vr = stored_keys(spec, k), v if r_v is None else rotate_rows(v, r_v)   # as stored; v R_V
    if T == 1:                                                                        # decode
        cache.store(layer, step, kr, vr)
        if attend is None:
            attend, options = kernel.paged_decode, {"checked": False, **options}
        o = attend(qr[:, :, 0].contiguous(), **cache.layer_view(layer, step), group_size=cache.cfg.group_size,
                   sm_scale=scale, **options)[:, :, None]
    else:                                                                             # extend
        o, x = torch.zeros(n, Hq, T, d, device=q.device), (qr, k, v) if prompt else (qr, kr, vr)
        for b, t in enumerate(step.pad):
            o[b:b + 1, :, t:] = chunk_attention(cache, layer, step, b, *(y[b:b + 1, :, t:] for y in x), scale)
        cache.store(layer, step, kr, vr)
    return o if r_v is None or prompt else (o.view(n, len(r_v), -1, d) @ r_v.mT.float()).view(n, Hq, T, d)


@torch.no_grad()
def paged_forward(model: TinyLM, cache: PagedKVCache, seqs: list, idx: torch.Tensor, attend=None,
                  **options) -> torch.Tensor:
    """Logits (n, T, vocab) of idx (n, T) after what each sequence holds; `model` folded
    (fold_value_rotation); attend, options: paged_step's. The plan once, then per layer: write, read."""
    step = cache.reserve(seqs, idx.shape[1])           # the forward's pages and plan, for every layer
    pos = step.on["start"][:, None] + torch.arange(idx.shape[1], device=idx.device)
    return model(idx, lambda l, q, k, v: paged_step(cache, l, step, q, k, v, attend, **options), pos)


def prefill(model: TinyLM, cache: PagedKVCache, seqs: list, idx: torch.Tensor) -> torch.Tensor:
    """A prompt idx (n, T) into empty sequences, one paged_forward -> logits (n, T, vocab)."""
    need(idx.dim() == 2 and len(idx) == len(seqs), f"idx: expected a prompt per sequence ({len(seqs)}, T)")
    cache.check_seqs(seqs)
    held = {s: int(cache.length[s]) for s in seqs if cache.length[s]}
    need(not held, f"seqs: prefill writes positions 0..T-1, expected empty sequences, got {held} (held)")
    return paged_forward(model, cache, seqs, idx)


def decode_step(model: TinyLM, cache: PagedKVCache, seqs: list, tokens: torch.Tensor,
                attend=None, **options) -> torch.Tensor:
    """Logits (n, vocab) of one new token per sequence (tokens (n,)): paged_forward of one token."""
    need(tokens.shape == (len(seqs),), f"tokens: expected shape ({len(seqs)},), got {tuple(tokens.shape)}")
    cache.check_seqs(seqs)
    return paged_forward(model, cache, seqs, tokens[:, None], attend, **options)[:, 0]


# ========================================================================================
# Appendices: infrastructure (the reading map at the top). The method is complete above.
# ========================================================================================

# ----------------------------------------------------------------------------------------
# A. Fast paths: the key loss on the INT2 columns, the simulated cache block by block, the decode step
# ----------------------------------------------------------------------------------------
"""
The numbers of Sections 5-8, faster. fast_key_loss (calibrate_layer's): keys split into S, read in INT2 by
some loss query, and C, read exactly by all. On C, p~ = c p, c = exp(lse - lse~) per query: KL adds
(sum_C p) log(1/c), dy_K adds (c - 1) o_C W_O^T (o_C = sum_C p v); only S moves with R_K. Block-wise
simulation: queries [t0, t1) read the exact sink, the INT2 copies of [sink, t1 - window), the exact keys of
[t0 - window + 1, t1): no dense (T, T) logits. The compiled decode step: store and decode in one numba call.
"""

def fast_key_loss(data: dict, w_o, k_mean, cfg: Config):
    """L_K of optr_key_loss as a function (R_K, split) -> (H_kv,), for the splits of
    data {split: (q, k, v, mask, exact)} (loss_data's) and the key mean mu (or None)."""
    fixed = {}
    for split, (q, k, v, mask, exact) in data.items():
        stored = int2_tokens(mask, exact)                                          # S
        a = gqa_logits(q, k).masked_fill(~mask, float("-inf"))                     # Eq. 1
        a_s, a_rest = a[..., stored], a[..., ~stored]
        lse_rest = a_rest.logsumexp(-1)                                            # over C
        lse = torch.logaddexp(lse_rest, a_s.logsumexp(-1))   # formed as lse~ is: equal at k~ = k
        o_rest = gqa_readout((a_rest - lse[..., None]).exp(), v[:, :, ~stored])    # Eq. 2 over C
        fixed[split] = (q, k[:, :, stored], v[:, :, stored], int2_mask(mask, exact)[:, stored],
                        a_s, (a_s - lse[..., None]).exp(), lse, lse_rest, o_rest)

    def loss(r_k, split):
        q, k_s, v_s, int2, a_s, p_s, lse, lse_rest, o_rest = fixed[split]
        k_tilde = dequant_keys(k_s, k_mean, r_k, cfg)                              # Eq. 4 on S
        a_tilde = torch.where(int2, gqa_logits(q, k_tilde), a_s)                   # Eq. 5 on S
        lse_tilde = torch.logaddexp(lse_rest, a_tilde.logsumexp(-1))
        p_tilde = (a_tilde - lse_tilde[..., None]).exp()
        c = (lse - lse_tilde).exp()                                                # p~ = c p on C
        kl = kl_divergence(p_s, p_tilde) + (lse_rest - lse).exp() * (lse_tilde - lse)
        dy_k = head_output(gqa_readout(p_tilde - p_s, v_s) + (c - 1)[..., None] * o_rest, w_o)  # Eq. 8
        return per_head(kl + cfg.lam * output_error(dy_k, cfg), k_s.shape[1])
    return loss


def block_simulated_attention(q, k, v, k_tilde, v_tilde, sink: int, window: int, block: int, q0: int = 0):
    """effective_attention's o (B, H_q, Tq, d) block by block (above), up to round-off: queries at
    positions q0 .. q0 + Tq - 1 over keys 0 .. q0 + Tq - 1 (k~, v~ read on [sink, q0 + Tq - window))."""
    out, Tq, dev = torch.empty_like(q), q.shape[2], q.device
    for a in range(0, Tq, block):
        t0, t1 = q0 + a, q0 + min(Tq, a + block)            # the block's query positions
        ns, hi, lo = min(sink, t1), max(sink, t1 - window), max(sink, t0 - window + 1)   # sink, INT2, exact
        s = torch.cat([torch.arange(ns), torch.arange(sink, hi), torch.arange(lo, max(lo, t1))]).to(dev)
        t, i = torch.arange(t0, t1, device=dev)[:, None], torch.arange(len(s), device=dev)
        int2 = (i >= ns) & (i < ns + hi - sink)
        mask = torch.where(int2, s <= t - window, (s <= t) & ((s > t - window) | (s < sink)))
        K, V = (torch.cat([x[:, :, :ns], x_tilde[:, :, sink:hi], x[:, :, lo:t1]], 2)
                for x, x_tilde in ((k, k_tilde), (v, v_tilde)))
        out[:, :, a:t1 - q0] = F.scaled_dot_product_attention(q[:, :, a:t1 - q0], K, V, attn_mask=mask,
                                                              enable_gqa=True)             # Eq. 2
    return out


def grow_pages(cache: PagedKVCache, n: int):
    """At least n pages allocated (1/8 more than before, within the budget), contents kept."""
    have = cache.k_codes.shape[1]
    if n > have:
        n = min(cache.budget, max(n, have + have // 8))
        for t in PACKED:
            old = getattr(cache, t)
            setattr(cache, t, torch.cat([old, old.new_zeros(old.shape[0], n - have, *old.shape[2:])], 1))


def compiled(cache: PagedKVCache, *qkv) -> bool:
    """paged_step's fast path applies: CPU pages, fp32 windows, q, k, v (numba has no bf16, no GPU)."""
    return cache.win_k.device.type == "cpu" and {cache.win_k.dtype, *(x.dtype for x in qkv)} == {torch.float32}


def compiled_step(cache: PagedKVCache, layer: int, step: Step, q, k, v, sm_scale: float, r_v=None):
    """paged_step's one token per sequence (q, k, v (n, H, 1, d), r_v) in one kernel.cpu_decode_step call, rotations
    in (rotate_rows' float64 products) -> (n, H_q, 1, d) fp32, as store (bit for bit) then paged_decode_reference."""
    spec, held = cache.kv[layer], vars(cache).setdefault("compiled_args", {}).get(layer)
    if held is None or held[0] is not cache.k_codes or held[1] != (id(spec.k_mean), id(spec.r_k), id(r_v)):
        held = cache.compiled_args[layer] = compiled_args(cache, layer, r_v)     # once, again after the pages grow
    out, rows = np.empty(q.shape, np.float32), lambda x: np.ascontiguousarray(x.detach().numpy()[:, :, 0])   # fp32
    kernel.cpu_decode_step(rows(q), rows(k), rows(v), held[2], held[3], step.seqs, step.plan, held[4],
                           np.float32(sm_scale), out[:, :, 0])
    return torch.from_numpy(out)


def compiled_args(cache: PagedKVCache, layer: int, r_v) -> tuple:
    """compiled_step's arguments that change only with the pages' size or the rotations (numpy views; fp32 rotations
    held as they are: half a float64 copy's bytes), with what they were made from and its ids (held: not reused)."""
    c, spec, one = cache.quant[layer], cache.kv[layer], np.eye(cache.cfg.head_dim, dtype=np.float32)
    made_of, host = (spec.k_mean, spec.r_k, r_v), lambda R: (R if R.dtype in (torch.float32, torch.float64) else
                                                             R.double()).detach().cpu().numpy()
    mu = np.zeros((c.n_kv_heads, c.head_dim), np.float32) if spec.k_mean is None else host(spec.k_mean.float())
    rk, rv = (np.tile(one, (c.n_kv_heads, 1, 1)) if R is None else host(R) for R in made_of[1:])
    pages = [getattr(cache, t)[layer] for t in PACKED] + [cache.block_table, cache.win_k[layer], cache.win_v[layer]]
    return (cache.k_codes, tuple(map(id, made_of)), tuple(map(np.ascontiguousarray, (mu, rk, rv, rv.swapaxes(-1, -2)))),
            tuple(x.numpy() for x in pages), (*cache.ranks[layer], c.group_size, np.float32(c.scale_eps)), made_of)


# ----------------------------------------------------------------------------------------
# B. Files: checks of what comes from outside, rotation files, export as a Hugging Face checkpoint
# ----------------------------------------------------------------------------------------
"""
What enters from outside raises a ValueError naming it (need, check_tensor); inside, asserts. One format for
all rotations (the scripts' variants in one file, export_hf's served one): safetensors, per variant NAME, layer N,
  NAME/layers.N.r_k     float32 (H_kv, d, d)  key rotation R_K
  NAME/layers.N.r_v     float32 (H_kv, d, d)  value rotation R_V (absent when folded)
  NAME/layers.N.k_mean  float32 (H_kv, d)     key mean mu after RoPE
and as metadata the format, geometry, model type and name, quantizer settings, and per variant
its parts, quant_k / quant_v flags, per-layer clips (appendix D; null: the settings') and whether
R_V is folded. Loading checks each tensor (name, shape, dtype, finite, max |R^T R - I| <= ORTHO_TOL).
"""

ORTHO_TOL = 5e-3   # max |R^T R - I| a rotation read from a file may have (the authors' artifact check)


def check_rotation(name: str, R, n_heads: int, d: int):
    """ValueError naming `name` unless R is a finite (n_heads, d, d) float tensor, max |R^T R - I| <= ORTHO_TOL."""
    check_tensor(name, R, shape=(n_heads, d, d), dtype="float", finite=True)
    Rd = R.detach().double()
    err = (Rd.transpose(-1, -2) @ Rd - torch.eye(d, dtype=torch.float64, device=R.device)).abs().max()
    need(err <= ORTHO_TOL, f"{name}: expected orthogonal matrices (max |R^T R - I| <= {ORTHO_TOL}), "
                            f"got {err.item():.3g}")


ROTATION_FORMAT = "optr-kv-rotations-1"
KV_SETTINGS = ("group_size", "clip_k", "clip_v", "scale_eps", "sink", "window", "page_size")
KV_PARTS = ("r_k", "r_v", "k_mean")


def check_kv(where: str, kv: list, cfg: Config):   # a ValueError naming both: another model's rotations
    got = sorted({(t.shape[0], t.shape[-1]) for s in kv for t in (s.r_k, s.r_v, s.k_mean) if t is not None})
    need(len(kv) == cfg.n_layers and set(got) <= {(cfg.n_kv_heads, cfg.head_dim)}, f"{where}: kv is "
         f"{len(kv)} layers of (n_kv_heads, head_dim) {got}, the model {cfg.n_layers} layers of "
         f"{(cfg.n_kv_heads, cfg.head_dim)}: rotations calibrated for another model?")


def save_kv_rotations(path: str, variants: dict, cfg: Config, folded=(), meta: dict | None = None,
                      model_type: str | None = None, model_name: str | None = None):
    """variants {name: [KVQuant per layer]} into one safetensors file; `folded`: the names whose R_V is in
    the weights; `meta`: a JSON dict stored beside (load's info["meta"]); the model's type and name."""
    from safetensors.torch import save_file
    tensors, parts, flags = {}, {}, {}
    for name, kv in variants.items():
        have = [p for p in KV_PARTS if any(getattr(s, p) is not None for s in kv)]
        int2 = [s for s in kv if s.quant_k or s.quant_v]     # an exact layer (Gemma 3's sliding) has none
        need(bool(name) and "/" not in name, f"save_kv_rotations: variant names without '/', got {name!r}")
        check_kv(f"save_kv_rotations: variant {name!r}", kv, cfg)
        need(all(getattr(s, p) is not None for p in have for s in int2), f"{name}: a part in some layers only")
        need(not (name in folded and "r_v" in have), f"{name}: R_V folded into the weights but r_v given")
        for l, s in enumerate(kv):
            for p in have if s.quant_k or s.quant_v else ():
                tensors[f"{name}/layers.{l}.{p}"] = getattr(s, p).detach().float().contiguous().clone()
        parts[name], flags[name] = have, dict(quant_k=[bool(s.quant_k) for s in kv],
                                              quant_v=[bool(s.quant_v) for s in kv], r_v_folded=name in folded,
                                              clip_k=[s.clip_k for s in kv], clip_v=[s.clip_v for s in kv])
    info = dict(format=ROTATION_FORMAT, n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim, model_type=model_type, model_name=model_name,
                settings={n: getattr(cfg, n) for n in KV_SETTINGS},
                variants=list(variants), parts=parts, flags=flags, meta=meta or {})
    save_file(tensors, path, metadata={k: json.dumps(v) for k, v in info.items()})
    return path


def load_kv_rotations(path: str, cfg=None):
    """A rotation file (or a directory holding kv_rotations.safetensors) -> (variants {name: [KVQuant per
    layer]}, info {settings, r_v_folded: {name: bool}, meta, geometry}). cfg: the model's Config or
    transformers config; another model's file is a ValueError naming both, before a tensor is read."""
    from safetensors import SafetensorError, safe_open
    path = os.fspath(path)
    path = os.path.join(path, "kv_rotations.safetensors") if os.path.isdir(path) else path
    kind = cfg.get_text_config().model_type if hasattr(cfg, "get_text_config") else None   # transformers'
    cfg = cfg if kind is None else hf_config(cfg)
    try:                                     # a truncated or garbage file: a ValueError naming it
        with safe_open(path, framework="pt") as f:
            try:
                info = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: metadata: expected JSON values ({e})") from None
            need(info.get("format") == ROTATION_FORMAT,
                 f"{path}: metadata format: expected {ROTATION_FORMAT!r}, got {info.get('format')!r}")
            missing = [k for k in "n_layers n_kv_heads head_dim settings variants parts flags".split() if k not in info]
            need(not missing, f"{path}: metadata is missing {missing}")
            L, H, d = (int(info[k]) for k in ("n_layers", "n_kv_heads", "head_dim"))
            mine, want = info.get("model_type"), cfg and (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)  # older: None
            about = lambda what, L, H, d: f"{what} ({L} layers, {H} KV heads, head_dim {d})"
            need(cfg is None or want == (L, H, d) and (kind == mine or None in (kind, mine)), f"{path}: calibrated for "
                 f"{about(' '.join(filter(None, (mine, info.get('model_name')))) or 'a model', L, H, d)}, not for "
                 f"{about(kind or 'this model', *(want or (0, 0, 0)))}")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    flags = {name: info["flags"][name] for name in info["variants"]}
    for name, fl in flags.items():
        fl.setdefault("clip_k", [None] * L), fl.setdefault("clip_v", [None] * L)      # older files
        need(all(len(fl[f]) == L for f in ("quant_k", "quant_v", "clip_k", "clip_v")),
             f"{path}: flags of {name!r}: expected {L} layers")
        need(all(c is None or (isinstance(c, float) and 0 < c <= 1) for c in fl["clip_k"] + fl["clip_v"]),
             f"{path}: flags of {name!r}: clips must be null or in (0, 1]")
    expected = {f"{name}/layers.{l}.{p}" for name, fl in flags.items() for p in info["parts"][name]
                for l in range(L) if fl["quant_k"][l] or fl["quant_v"][l]}     # exact layers: none
    need(not any(k.endswith(".v_mean") for k in tensors), f"{path}: holds value offsets nu (v_mean, "
         "OptR+ at commit 5235131), which this version does not apply; use a variant without them")
    need(set(tensors) <= expected, f"{path}: unexpected tensors {sorted(set(tensors) - expected)[:8]}")
    need(expected <= set(tensors), f"{path}: missing tensors {sorted(expected - set(tensors))[:8]}")
    shapes = dict(r_k=(H, d, d), r_v=(H, d, d), k_mean=(H, d))
    for key, t in tensors.items():
        p = key.rsplit(".", 1)[1]
        check_tensor(f"{path}: tensor {key}", t, shape=shapes[p], dtype=(torch.float32,), finite=True)
        if p.startswith("r_"):
            check_rotation(f"{path}: tensor {key}", t, H, d)
    variants = {name: [KVQuant(**{p: tensors.get(f"{name}/layers.{l}.{p}") for p in KV_PARTS},
                               **{f: fl[f][l] for f in ("quant_k", "quant_v", "clip_k", "clip_v")})
                       for l in range(L)] for name, fl in flags.items()}
    info["r_v_folded"] = {name: bool(fl["r_v_folded"]) for name, fl in flags.items()}
    return variants, info


KV_LAYOUT = """kv_rotations.safetensors: this checkpoint's KV cache (OptR). R_V is folded into
the weights; per layer N of variant NAME the file holds NAME/layers.N.r_k (H_kv, d, d),
NAME/layers.N.k_mean (H_kv, d). Cache a post-RoPE key as (k - mu) R_K, a value as v_proj gives
it; rotate queries by R_K; all but the first `sink` and `window` latest tokens are INT2 (settings,
per-layer clips: metadata). Load: from_pretrained(dir), optr.load_kv_rotations(dir).
"""


def export_hf(model, kv: list, out_dir: str, tokenizer=None, name: str = "optr", cfg: Config | None = None) -> str:
    """A transformers model (cfg: its hf_config) with R_V folded in, by its save_pretrained, beside
    kv_rotations.safetensors (`name`: R_K, mu) and .txt; the tokenizer if given."""
    need(cfg is not None and not isinstance(model, TinyLM), "export_hf: a transformers model and its cfg "
         "(optr.hf_config); TinyLM's weights load by name into the Llama, Qwen2 or Qwen3 it is")
    folded = fold_value_rotation(model, kv, cfg)
    quant = getattr(folded, "hf_quantizer", None)       # a GGUF is dequantized on load: saved as the floats held
    if quant is not None and getattr(quant.quantization_config.quant_method, "value", None) == "gguf":
        folded.hf_quantizer = None
        del folded.config.quantization_config
    folded.save_pretrained(out_dir)
    served = [replace(s, r_v=None) for s in kv]                  # R_V: in the weights
    save_kv_rotations(os.path.join(out_dir, "kv_rotations.safetensors"), {name: served}, cfg, folded=(name,),
                      model_type=model.config.get_text_config().model_type)
    with open(os.path.join(out_dir, "kv_rotations.txt"), "w") as f:
        f.write(KV_LAYOUT)
    if tokenizer is not None:
        save = getattr(tokenizer, "save_pretrained", None)                # transformers' or tokenizers'
        save(out_dir) if save else tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


# ----------------------------------------------------------------------------------------
# D. Beyond the paper (ours): a clip searched per layer (OptR+)
# ----------------------------------------------------------------------------------------
"""
Clip search (calibrate(one_layer=clipped(grid)): the +clip rows, optr+): per layer, c_K of {c_K} + grid with
the least held-out L_K at the base, then c_V of {c_V} + grid by L_V at that c_K; the base, or OptR learned
there, is served at these clips (KVQuant.clip_k, clip_v). End-to-end refinement of all layers lost: NOTES.md.
"""

@torch.no_grad()
def search_clips(spec: KVQuant, w_o, held, cfg: Config, grid, query_positions=None) -> KVQuant:
    """spec (the base: mu, R_K,0, R_V,0) with its layer's clip_k, clip_v: of {cfg's} + grid, the
    ones with the least held-out loss (summed over heads) at spec's rotations."""
    data = loss_data({"held": held}, cfg, query_positions)
    dev = data["held"][1].device
    w_o, mu, r_k, r_v = (x if x is None else x.float().to(dev) for x in (w_o, spec.k_mean, spec.r_k, spec.r_v))
    key = lambda c: fast_key_loss(data, w_o, mu, replace(cfg, clip_k=c))(r_k, "held").sum().item()   # L_K
    c_k = min((cfg.clip_k, *grid), key=key)
    value = lambda c: value_loss(data, w_o, mu, r_k, replace(cfg, clip_k=c_k, clip_v=c))(r_v, "held").sum().item()
    return replace(spec, clip_k=c_k, clip_v=min((cfg.clip_v, *grid), key=value))                      # L_V


def clipped(grid):
    """calibrate's one_layer: calibrate_one_layer at the layer's clips, searched first at its base."""
    def one_layer(w_o, l, cal, held, cfg, base, center, learn, query_positions, log):
        spec = KVQuant(key_mean(cal[1]) if center else None, *base_rotations(base, *cal, cfg))
        spec = search_clips(spec, w_o, held, cfg, grid, query_positions)
        got, rows = calibrate_one_layer(w_o, l, cal, held, spec.layer_cfg(cfg), base, center, learn,
                                        query_positions, log)
        return replace(got, clip_k=spec.clip_k, clip_v=spec.clip_v), rows
    return one_layer


# ----------------------------------------------------------------------------------------
# E. Serving elsewhere: transformers' generate() and models (SGLang's files: tools/sglang.py)
# ----------------------------------------------------------------------------------------
"""
Any transformers causal LM whose layers call its attention interface (Llama, Qwen2, Qwen3, Gemma 3): hf_config
reads its geometry; hf_cache serves INT2 layers from Section 8's pages: the numbers of ladder.simulate_hf with
chunks (Section 5 in the model's attention). PagedLayer.update keeps k, v and returns itself as keys and
values, which transformers hands untouched to "optr-paged" (paged_attention), then to its attend: paged_step.
"""

@dataclass
class _Pool:
    """What hf_cache's INT2 layers share: their specs, and the PagedKVCache of the first update."""
    model: object                          # the transformers model it serves
    specs: list                            # KVQuant of each INT2 layer, in order
    cfg: Config
    max_tokens: int                        # tokens a sequence may hold, prompt and new ones
    attend: object = None                  # the decode (None: kernel.paged_decode)
    cache: PagedKVCache | None = None
    seqs: list | None = None
    step: Step | None = None               # the forward's plan (PagedLayer.attend, at the first INT2 layer)

    def begin(self, k, held: int):
        """The first INT2 layer's update of a forward, k (B, H_kv, T, d), after `held` tokens: max_tokens
        checked; the first opens the cache, a sequence a row (attend reserves: the padding is known there)."""
        B, _, T, _ = k.shape
        need(self.model.config._attn_implementation == "optr-paged",
             "hf_cache: the model attends through it inside `with optr.hf_cache(model, kv, cfg) as cache:`")
        need(held or T <= self.max_tokens, f"hf_cache: a prompt of {T} tokens passes max_tokens={self.max_tokens}")
        need(held + T <= self.max_tokens, f"hf_cache: a sequence passes max_tokens={self.max_tokens}")
        if self.cache is None:
            self.open(B, k.dtype, k.device)

    def open(self, B: int, dtype, device):
        """A PagedKVCache of B sequences, pages for max_tokens each (allocated as they fill)."""
        c, n = self.cfg, max(1, self.max_tokens - self.cfg.sink - self.cfg.window)      # INT2 tokens per sequence
        self.cache = PagedKVCache(replace(c, n_layers=len(self.specs)), B * -(-n // c.page_size), B, self.specs,
                                  window_dtype=dtype, device=device, grow=True)
        self.seqs = [self.cache.add_sequence() for _ in range(B)]

    def regroup(self, rows: list):
        """Row b takes what row rows[b] held (beam search, batch_select_indices, batch_repeat_interleave):
        a new cache, each row its source's windows and lengths, and its INT2 tokens copied into its own pages."""
        old, src = self.cache, [self.seqs[i] for i in rows]
        self.open(len(src), old.win_k.dtype, old.win_k.device)
        new, ix = self.cache, lambda x: torch.tensor(x, dtype=torch.long, device=old.block_table.device)
        new.length[self.seqs] = old.length[src]
        new.reserve(self.seqs, 0)                       # pages for what each row holds (all layers hold as many)
        for w in ("win_k", "win_v"):
            getattr(new, w)[:, ix(self.seqs)] = getattr(old, w)[:, ix(src)]
        for to, of in zip(self.seqs, src):
            used = ix(old.pages[of][:len(new.pages[to])])
            for t in PACKED:
                getattr(new, t)[:, ix(new.pages[to])] = getattr(old, t)[:, used]


class PagedLayer:
    """An INT2 layer of hf_cache, its tokens in the pool's PagedKVCache (as layer `index`): a virtual subclass of
    CacheLayerMixin (hf_cache registers it: `import optr` needs no transformers); methods served or refused by name."""
    is_sliding = is_compileable = is_croppable = supports_early_init = False

    def __init__(self, pool: _Pool, index: int, spec: KVQuant, folded: bool):
        self.pool, self.index, self.n, self.new = pool, index, 0, None
        self.spec = replace(spec, r_v=None) if folded else spec

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:     # keys update returns, offset
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return self.pool.max_tokens

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states (B, H_kv, T, d) post-RoPE: kept for paged_attention."""
        if self.index == 0:                                   # the forward's first INT2 layer
            self.pool.begin(key_states, self.n)
        if self.n == 0:
            self.spec = self.spec.to(key_states.device)                    # specs loaded on the CPU
        self.n, self.new = self.n + key_states.shape[-2], (key_states, value_states)
        return self, self

    def reset(self):
        """Hold nothing, as a fresh hf_cache: the pool's pages dropped (a new prompt opens new ones)."""
        self.n, self.new, self.pool.cache, self.pool.seqs = 0, None, None, None

    def _rows(self, rows):      # rows(B): the source of each new row; every INT2 layer at once, by the first
        if self.index == 0 and self.pool.cache is not None:
            self.pool.regroup(rows(len(self.pool.seqs)))

    def reorder_cache(self, beam_idx: torch.Tensor):     # beam search: row b takes what row beam_idx[b] holds
        self._rows(lambda B: beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor):
        self._rows(lambda B: torch.arange(B)[indices.cpu()].tolist())

    def batch_repeat_interleave(self, repeats: int):
        self._rows(lambda B: [b for b in range(B) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int):
        need(tokens_to_remove == 0, "hf_cache: crop: the tokens that left the exact recent window for INT2 "
             "cannot be un-quantized, so a shorter cache is not what a fresh one holds; refused (crop(0): served)")

    def offload(self, *args, **kwargs):
        need(False, "hf_cache: offload, prefetch, lazy_initialization: refused (the pages stay on their device "
             "and open at the first INT2 layer's update)")
    prefetch = lazy_initialization = offload

    def nbytes(self) -> int:      # this layer's part of the pages and windows (allocated)
        return sum(getattr(self.pool.cache, t)[self.index].nbytes for t in PACKED + ("win_k", "win_v"))

    def attend(self, query, scaling, mask):
        """query (B, H_q, Tq, d) of the tokens update brought, mask transformers' (B, 1, Tq, keys) or None -> (B, Tq,
        H_q, d), via paged_step; the left padding among them (every chunk's): keys the last query does not read."""
        pool, (k, v) = self.pool, self.new
        self.new, Tq = None, query.shape[2]                   # the pages hold them from here
        seen = None if mask is None or Tq == 1 else mask[:, 0, -1, -Tq:]
        pad = None if seen is None else Tq - (seen if seen.dtype == torch.bool else seen == 0).sum(-1)
        if self.index == 0:                                   # the forward's pages and plan, for every layer
            pool.step = pool.cache.reserve(pool.seqs, Tq, pad)
        o = paged_step(pool.cache, self.index, pool.step, query, k, v, pool.attend, scaling, self.spec.r_v)
        return o.transpose(1, 2).to(query.dtype)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface "optr-paged": hf_cache's INT2 layers attend through the
    pages (PagedLayer.attend), every other layer is transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if not isinstance(key, PagedLayer):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    need(kwargs.get("softcap") is None, "hf_cache: attention logit soft-capping is not Eq. 1")
    return key.attend(query, scaling, attention_mask), None


class _Modes(list):       # generate()'s modes inside hf_cache, checked before the prompt runs
    def __str__(self):
        return ("every generation mode but assisted generation (assistant_model=, prompt_lookup_num_tokens="
                "): hf_cache cannot roll back its INT2 pages")


@functools.lru_cache(maxsize=None)
def _int2_cache_type():                   # hf_cache's Cache: the model attends through it inside `with`
    from transformers.cache_utils import Cache
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.masking_utils import sdpa_mask

    def enter(self):
        m, self.modes = self.model, self.model.__dict__.get("_supported_generation_modes", self)
        self.attention = attention_interface(m, paged_attention, sdpa_mask, "optr-paged")
        self.attention.__enter__()
        m._supported_generation_modes = _Modes(g for g in GenerationMode if g != "assisted_generation")
        return self

    def exit(self, *exc):
        del self.model._supported_generation_modes
        if self.modes is not self:
            self.model._supported_generation_modes = self.modes
        return self.attention.__exit__(*exc)
    return type("INT2Cache", (Cache,), dict(__enter__=enter, __exit__=exit))


def hf_cache(model, kv: list, cfg: Config, folded: bool = False, max_tokens: int | None = None, attend=None):
    """A transformers Cache for generate(past_key_values=...): inside `with optr.hf_cache(model, kv, cfg) as cache:`
    the model attends through "optr-paged" (INT2 layers from one PagedKVCache, the others sdpa); constructing it
    changes nothing. max_tokens: what a sequence may hold (None: max_position_embeddings or 8192; a longer prompt
    refused before any layer attends). folded: with export_hf's weights, else v R_V here. attend: the decode."""
    from transformers.cache_utils import CacheLayerMixin, DynamicCache
    check_kv("hf_cache", kv, cfg)
    mixed = [l for l, s in enumerate(kv) if s.quant_k != s.quant_v]
    need(not mixed, f"hf_cache: kv{mixed}: keys and values both in INT2 or both exact")
    theirs = DynamicCache(config=model.config).layers
    slides = [l for l, (s, t) in enumerate(zip(kv, theirs)) if s.quant_k and t.is_sliding]
    need(not slides, f"hf_cache: kv{slides}: sliding-window layers (sliding_window "
         f"{getattr(model.config.get_text_config(), 'sliding_window', None)}) in INT2: the pages attend over all "
         "they hold, not the window; keep them exact (calibrate_hf's default, eval_llm without --int2-sliding)")
    if max_tokens is None:
        max_tokens = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 8192
    need(isinstance(max_tokens, int) and max_tokens >= 1, f"hf_cache: max_tokens must be an int >= 1, got {max_tokens}")
    int2 = [l for l, s in enumerate(kv) if s.quant_k]
    pool = _Pool(model, [kv[l] for l in int2], cfg, max_tokens, attend)
    CacheLayerMixin.register(PagedLayer)
    cache = _int2_cache_type()(layers=[PagedLayer(pool, int2.index(l), s, folded) if s.quant_k else t
                                       for l, (s, t) in enumerate(zip(kv, theirs))])
    cache.model = model
    return cache


def hf_config(hf_config, **settings) -> Config:
    """Config of a transformers model: geometry from model.config, the rest from `settings` (group_size:
    head_dim unless given, the authors' G = d); ffn_dim, qk_norm, attention_bias: for TinyLM's twin."""
    c = hf_config.get_text_config()
    H, rope, get = c.num_attention_heads, getattr(c, "rope_parameters", None) or {}, c.to_dict().get
    d = get("head_dim") or c.hidden_size // H
    try:
        return Config(**{"group_size": d, **settings}, vocab_size=c.vocab_size, d_model=c.hidden_size,
                      n_layers=c.num_hidden_layers, n_heads=H, n_kv_heads=get("num_key_value_heads") or H,
                      head_dim=d, ffn_dim=get("intermediate_size") or 4 * c.hidden_size,
                      rope_theta=rope.get("full_attention", rope).get("rope_theta", 1e4),
                      rms_eps=get("rms_norm_eps", 1e-6), qk_norm=c.model_type in ("qwen3", "gemma3_text"),
                      attention_bias=get("attention_bias", c.model_type == "qwen2"),
                      tie_embeddings=bool(get("tie_word_embeddings")))
    except (ValueError, TypeError) as e:                    # a bad setting, or one the model fixes
        raise ValueError(f"hf_config: {e} (the model: {c.model_type}, head_dim {d}; settings {settings}: "
                         "another model's? load_kv_rotations(path, model.config) checks)") from None


@contextlib.contextmanager
def attention_interface(model, attention, mask=None, name: str = "optr"):
    """`with attention_interface(model, fn):` every layer calls fn(module, query, key, value,
    attention_mask, scaling=None, dropout=0.0, **kwargs), registered as `name` (and `mask` as its mask
    builder, if given) in transformers' interfaces; the model's own is back on exit."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, attention)
    if mask is not None:
        AttentionMaskInterface.register(name, mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
