"""
The paper's ladder in miniature: train a tiny model, calibrate, evaluate, one command.

    python train_tiny.py                   # about 3 minutes on 2 CPU cores
    python train_tiny.py --quick           # under a minute: smaller everything
    python train_tiny.py --seeds 0,1,2     # the whole run per seed, mean +- std
    python train_tiny.py --attention-bias  # Qwen2-style q/k/v biases: keys may carry offsets
    python train_tiny.py --resume --clip-k 0.96  # reuse OUT's model, recalibrate, re-evaluate
    python train_tiny.py --help            # one flag per config field

What it shows, on a model small enough to train on a laptop CPU:
  1. A tiny Llama/Qwen3-style decoder (optr.TinyLM) learns multi-query associative
     recall: a context of key->value pairs, filler, then queries of some of the keys.
     The pairs a query needs lie far behind the recent full-precision window, so every
     answer is read from the INT2 part of the KV cache.
  2. Post-RoPE key statistics (per-channel offsets, outlier channels, attention sink):
     what rotations and centering are meant to fix, measured rather than assumed.
  3. The ladder: full precision, naive INT2, QuaRot and OSCAR base rotations, each with
     OptR's output-oriented correction, plus two ablations (centering alone; OptR without
     centering). For each: answer accuracy at several context lengths, KL(full || variant)
     at answer positions, the post-W_O output error at answer positions split into its
     key- and value-induced parts (Eq. 8), the reconstruction error E_rec (Eq. 9), and the
     bits per element of the cache as stored in the paged cache.
  4. A real decode check: the paged INT2 cache, token by token, with the Triton kernel
     (its CPU interpreter when there is no GPU), against the simulated path.
Training, calibration, held-out and evaluation data come from separate random streams of
the seed; the same seed gives the same numbers. Results go to OUT/results.json, the model
and every variant's rotations and key means to OUT/model.safetensors and
OUT/kv_rotations.safetensors (safetensors only).
"""

from __future__ import annotations

import kernel  # first: it switches Triton to its CPU interpreter when there is no GPU

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import textwrap
import time
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import optr


# ----------------------------------------------------------------------------------------
# 1. Run config: optr.Config plus training and evaluation fields; one CLI flag per field
# ----------------------------------------------------------------------------------------

def _f(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig(optr.Config):
    # this testbed's INT2 clip. optr.Config keeps the paper's 0.96 / 0.92, set for G = 128;
    # at G = 32, c = 0.96 clips only the largest value of a group. Here c = 0.9 makes OptR
    # more accurate and the bases slightly less: compare with
    # `--resume --clip-k 0.96 --clip-v 0.92`.
    clip_k: float = _f(0.9, "c_K: keys clipped at the |x| of rank floor(c*G) in a group")
    clip_v: float = _f(0.9, "c_V: same for values")
    # the retrieval task and its short-to-long curriculum (one entry per stage)
    stage_len: tuple[int, ...] = _f((13, 256), "sequence length of each curriculum stage (tokens); "
                                    "13 = 4 pairs and 2 queries with no filler")
    stage_pairs: tuple[int, ...] = _f((4, 32), "key->value pairs in the context, per stage")
    stage_steps: tuple[int, ...] = _f((800, 300), "optimizer steps per stage (the last one "
                                      "anneals the learning rate linearly to 0)")
    stage_batch: tuple[int, ...] = _f((32, 16), "training sequences per step, per stage")
    stage_copy: tuple[float, ...] = _f((0.3, 0.1), "fraction of previous-token-copy batches, "
                                       "per stage")
    query_frac: float = _f(0.5, "fraction of the context's keys that are queried")
    # training the model
    train_lr: float = _f(1e-3, "AdamW learning rate of the model (lr is OptR's)")
    grad_clip: float = _f(1.0, "clip the model's gradient norm at this value")
    log_every: int = _f(100, "training steps between progress lines")
    # calibration and evaluation data (disjoint seeds)
    calib_seqs: int = _f(64, "calibration sequences, at the last stage's length")
    heldout_seqs: int = _f(32, "held-out sequences OptR scores its heads on")
    calib_queries: str = _f("answers", "OptR loss queries: 'answers' (answer positions) or "
                            "'last' (the last qwin positions)")
    eval_len: tuple[int, ...] = _f((64, 128, 256), "evaluation context lengths; pairs scale with "
                                   "length as in the last stage")
    eval_seqs: int = _f(256, "evaluation sequences per context length")
    err_seqs: int = _f(64, "sequences for the error decomposition, at the longest length")
    decode_seqs: int = _f(4, "sequences decoded through the paged cache and Triton kernel")
    # the run
    quick: bool = _f(False, "small preset, under a minute: T=64, sink 2, window 8, fewer steps "
                     "and sequences; flags given explicitly still win")
    out: str = _f("runs/tiny", "output directory: results.json and safetensors files")
    resume: bool = _f(False, "load OUT/model.safetensors instead of training")
    seeds: tuple[int, ...] = _f((), "repeat the whole run for each seed (OUT/seedN), report "
                                "mean +- std")

    def __post_init__(self):
        super().__post_init__()
        n = len(self.stage_len)
        for name in ("stage_pairs", "stage_steps", "stage_batch", "stage_copy"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RunConfig.{name}: expected {n} entries (one per stage), "
                                 f"got {getattr(self, name)}")
        if n == 0 or not self.eval_len:
            raise ValueError("RunConfig: need at least one stage and one eval length")
        if self.calib_queries not in ("answers", "last"):
            raise ValueError(f"RunConfig.calib_queries: expected 'answers' or 'last', "
                             f"got {self.calib_queries!r}")


# --quick: fields it changes (explicit flags win)
QUICK = dict(stage_len=(13, 64), stage_pairs=(4, 8), stage_steps=(800, 150),
             stage_batch=(32, 32), sink=2, window=8, eval_len=(32, 48, 64), eval_seqs=128,
             err_seqs=32, calib_seqs=64, heldout_seqs=64, steps=40, eval_every=10)


def _inherited_help() -> dict:
    """Help of optr.Config's fields: the trailing comment on each field's line."""
    return dict(re.findall(r"^\s+(\w+): [^=\n]+=[^#\n]+#\s*(.+)$",
                           inspect.getsource(optr.Config), re.M))


def build_parser(cls=None, description=None) -> argparse.ArgumentParser:
    """One flag per field of the run config `cls` (RunConfig here; eval_llm.py passes its own)."""
    cls = cls or RunConfig
    p = argparse.ArgumentParser(description=description or __doc__.strip().split("\n")[0])
    inherited = _inherited_help()
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata.get("help") or inherited.get(f.name, f.name)
        kw = dict(dest=f.name, default=argparse.SUPPRESS)
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction,
                           help=f"{help} (default {f.default})", **kw)
        elif f.type.startswith("tuple"):
            elem = {"int": int, "float": float, "str": str}[re.search(r"\[(\w+)", f.type)[1]]
            p.add_argument(flag, metavar="A,B,...",
                           type=lambda s, e=elem: tuple(e(x.strip()) for x in s.split(",") if x.strip()),
                           help=f"{help} (default {','.join(map(str, f.default)) or 'none'})", **kw)
        else:
            p.add_argument(flag, type={"int": int, "float": float, "str": str}[f.type],
                           help=f"{help} (default {f.default})", **kw)
    return p


def parse_config(argv=None, cls=None, quick=None, description=None):
    """The run config from the command line; --quick applies the `quick` preset first, so
    flags given explicitly still win."""
    cls, quick = cls or RunConfig, QUICK if quick is None else quick
    parser = build_parser(cls, description)
    given = vars(parser.parse_args(argv))
    try:
        return cls(**{**(quick if given.get("quick") else {}), **given})
    except ValueError as e:
        parser.error(str(e))                 # exits with the usage line and the message


def print_config(cfg, log=print, tag="config"):
    items = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in config_dict(cfg).items()]
    for line in textwrap.wrap("  ".join(items), width=96, break_on_hyphens=False):
        log(f"{tag} | " + line)


def config_dict(cfg) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v)
            for f in fields(cfg)}


def generator(cfg: RunConfig, stream: str) -> torch.Generator:
    """Independent random stream per purpose, so train, calibration, held-out and
    evaluation data never overlap and each is reproducible under the seed."""
    k = ("model", "train", "calib", "heldout", "eval").index(stream)
    return torch.Generator().manual_seed(1_000_003 * k + cfg.seed)


# ----------------------------------------------------------------------------------------
# 2. The task: multi-query associative recall
# ----------------------------------------------------------------------------------------
"""
    BOS  k1 v1  k2 v2 ... kN vN  _ _ ... _  kq1 vq1  kq2 vq2 ...
         <------ N pairs ----->  filler     <-- queries: a subset of the keys -->
Keys are distinct, values drawn with replacement. At each queried key the model must emit
that key's value: these answer positions are the only ones scored. The queries close the
sequence, so the pairs they need are far behind the recent full-precision window: every
answer is read from the INT2 part of the cache. Querying only a subset of the keys denies
the model the shortcut "emit a context value not yet used".
"""

BOS, FILL = 0, 1


def vocab_split(vocab_size: int):
    """Token ranges: keys [2, 2 + n_keys), values [2 + n_keys, vocab_size)."""
    n_keys = (vocab_size - 2) // 2
    return 2, n_keys, 2 + n_keys, vocab_size - 2 - n_keys


def n_queries(n_pairs: int, frac: float) -> int:
    return max(1, round(n_pairs * frac))


def answer_positions(T: int, n_q: int) -> torch.Tensor:
    """Positions of the queried keys: the logits there must predict the value."""
    return T - 2 * n_q + 2 * torch.arange(n_q)


def pairs_at(cfg: RunConfig, T: int) -> int:
    """Pairs for an evaluation length: the last training stage's density."""
    return max(1, round(T * cfg.stage_pairs[-1] / cfg.stage_len[-1]))


def recall_batch(B: int, T: int, n_pairs: int, query_frac: float, vocab_size: int,
                 gen: torch.Generator):
    """idx (B, T) and answers (B, n_q): the token after each answer position."""
    k0, n_keys, v0, n_vals = vocab_split(vocab_size)
    n_q = n_queries(n_pairs, query_frac)
    if n_pairs > n_keys or 1 + 2 * n_pairs + 2 * n_q > T:
        raise ValueError(f"recall task: {n_pairs} pairs and {n_q} queries do not fit in "
                         f"T={T} tokens with {n_keys} distinct keys")
    keys = torch.rand(B, n_keys, generator=gen).argsort(-1)[:, :n_pairs] + k0   # distinct
    vals = torch.randint(v0, v0 + n_vals, (B, n_pairs), generator=gen)
    pick = torch.rand(B, n_pairs, generator=gen).argsort(-1)[:, :n_q]          # queried subset
    qk, qv = keys.gather(1, pick), vals.gather(1, pick)
    idx = torch.full((B, T), FILL, dtype=torch.long)
    idx[:, 0] = BOS
    idx[:, 1:1 + 2 * n_pairs] = torch.stack([keys, vals], -1).view(B, -1)
    idx[:, T - 2 * n_q:] = torch.stack([qk, qv], -1).view(B, -1)
    return idx, qv


def copy_batch(B: int, T: int, vocab_size: int, gen: torch.Generator):
    """Random tokens; the target at position t >= 1 is the token at t - 1."""
    idx = torch.randint(2, vocab_size, (B, T), generator=gen)
    return idx, idx[:, :-1]


# ----------------------------------------------------------------------------------------
# 3. Training: short-to-long curriculum with a few previous-token-copy batches
# ----------------------------------------------------------------------------------------
"""
Recall needs an induction circuit: a previous-token head in the first layer (so a value's
position knows its key) and a matching head in the second. Trained directly at the target
length the model sits on a plateau for minutes. What works on 2 cores:
  - a dense first stage (4 pairs, 2 queries, no filler at all): with even a few constant
    filler tokens the second layer's heads learn to park their attention on the filler
    (an attention sink) and the matching head never forms;
  - some batches of "predict the previous token" on random tokens, which teach the
    previous-token head;
  - Adam at 1e-3 with the gradient norm clipped (at 2e-3 and 3e-3 some seeds stall: the
    previous-token head can form in the second layer, where it is no use);
  - then the target length with its filler, where the circuit only has to generalise;
    that last stage anneals the learning rate linearly to zero.
Loss (and the accuracy in the progress lines) on the answer positions only.
"""

def train(model: optr.TinyLM, cfg: RunConfig, log=print) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train_lr, weight_decay=0.0)
    gen = generator(cfg, "train")
    step = 0
    stages = zip(cfg.stage_len, cfg.stage_pairs, cfg.stage_steps, cfg.stage_batch, cfg.stage_copy)
    for stage, (T, n_pairs, n_steps, B, p_copy) in enumerate(stages):
        log(f"stage: T={T} tokens, {n_pairs} pairs, {n_steps} steps of {B} sequences, "
            f"{p_copy:.0%} copy batches")
        pos = answer_positions(T, n_queries(n_pairs, cfg.query_frac))
        last = stage == len(cfg.stage_len) - 1
        loss_sum, hits, n_ans, t0, n_log = 0.0, 0, 0, time.perf_counter(), 0
        for i in range(n_steps):
            step, n_log = step + 1, n_log + 1
            if last:                                  # the last stage anneals linearly to 0
                for group in opt.param_groups:
                    group["lr"] = cfg.train_lr * (1 - i / n_steps)
            if torch.rand(1, generator=gen).item() < p_copy:
                idx, tgt = copy_batch(B, T, cfg.vocab_size, gen)
                loss = F.cross_entropy(model(idx)[:, 1:].flatten(0, 1), tgt.flatten())
            else:
                idx, ans = recall_batch(B, T, n_pairs, cfg.query_frac, cfg.vocab_size, gen)
                logits = model(idx)[:, pos]                                 # (B, n_q, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1), ans.flatten())
                loss_sum += loss.item() * ans.numel()
                hits += (logits.argmax(-1) == ans).sum().item()
                n_ans += ans.numel()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            if step % cfg.log_every == 0 or step == sum(cfg.stage_steps):
                ms = (time.perf_counter() - t0) * 1000 / n_log
                n = max(n_ans, 1)
                log(f"step {step:5d} | loss {loss_sum / n:.4f} | acc {hits / n:.3f} | "
                    f"{ms:5.1f} ms/step")
                loss_sum, hits, n_ans, t0, n_log = 0.0, 0, 0, time.perf_counter(), 0


# ----------------------------------------------------------------------------------------
# 4. Key statistics: is there anything for centering and rotations to fix?
# ----------------------------------------------------------------------------------------

def channel_stats(k: torch.Tensor) -> dict:
    """k (B, H_kv, T, d) keys of one layer, statistics over all B*T tokens, per KV head:
    per-channel |mean|/std (mean and max over channels), channels with |mean| > std,
    largest / median per-channel max-abs, BOS (position 0) key norm / median key norm."""
    x = k.double()
    mean, std = x.mean(dim=(0, 2)), x.std(dim=(0, 2))                 # (H_kv, d)
    ratio = mean.abs() / std
    maxabs = x.abs().amax(dim=(0, 2))                                 # (H_kv, d)
    norm = x.norm(dim=-1)                                             # (B, H_kv, T)
    return dict(
        mean_over_std_mean=ratio.mean(-1).tolist(),
        mean_over_std_max=ratio.amax(-1).tolist(),
        channels_mean_gt_std=(mean.abs() > std).sum(-1).tolist(),
        maxabs_max_over_median=(maxabs.amax(-1) / maxabs.median(-1).values).tolist(),
        bos_norm_over_median=(norm[:, :, 0].mean(0) / norm[:, :, 1:].transpose(0, 1)
                              .flatten(1).median(-1).values).tolist(),
    )


@torch.no_grad()
def key_stats(model: optr.TinyLM, idx: torch.Tensor) -> dict:
    """Per layer: statistics of the post-RoPE keys (what the cache stores) and of the
    pre-RoPE keys (the post-RoPE ones rotated back by the inverse RoPE rotation)."""
    cfg = model.cfg
    _, captured = model(idx, capture=True)
    cos, sin = optr.rope_cos_sin(torch.arange(idx.shape[1])[None], cfg.head_dim, cfg.rope_theta)
    out = {}
    for l, (_, k, _) in enumerate(captured):
        pre = optr.apply_rope(k, cos, -sin)                           # RoPE^-1: rotate back
        out[f"layer{l}"] = dict(post_rope=channel_stats(k), pre_rope=channel_stats(pre))
    return out


def print_key_stats(stats: dict, log=print):
    log("key statistics per layer and KV head (h0/h1/...):")
    log(f"  {'layer':<8}{'keys':<10}{'|mean|/std mean':>17}{'max':>12}{'#|mean|>std':>13}"
        f"{'maxabs max/med':>16}{'BOS norm/med':>14}")
    fmt = lambda xs, f: "/".join(f.format(x) for x in xs)
    for layer, s in stats.items():
        for where in ("post_rope", "pre_rope"):
            c = s[where]
            log(f"  {layer:<8}{where.replace('_', '-'):<10}"
                f"{fmt(c['mean_over_std_mean'], '{:.2f}'):>17}"
                f"{fmt(c['mean_over_std_max'], '{:.2f}'):>12}"
                f"{fmt(c['channels_mean_gt_std'], '{:d}'):>13}"
                f"{fmt(c['maxabs_max_over_median'], '{:.2f}'):>16}"
                f"{fmt(c['bos_norm_over_median'], '{:.2f}'):>14}")


# ----------------------------------------------------------------------------------------
# 5. Variants: how each stores the cache (base rotation, key centering, OptR correction)
# ----------------------------------------------------------------------------------------

VARIANTS = {                       # name: (base rotation, key centering, OptR correction)
    "full": None,                  # no quantization
    "int2": ("identity", False, False),
    "quarot": ("quarot", False, False),
    "quarot+optr": ("quarot", True, True),
    "oscar": ("oscar", False, False),
    "oscar+optr": ("oscar", True, True),
    "quarot+center": ("quarot", True, False),           # ablation: centering alone
    "quarot+optr-nocenter": ("quarot", False, True),    # ablation: OptR without centering
}


def calibrate_all(model, cfg: RunConfig, log=print) -> tuple[dict, dict]:
    """KVQuant specs per variant (None for full) and OptR's per-head report rows."""
    T, n_pairs = cfg.stage_len[-1], cfg.stage_pairs[-1]
    cal, _ = recall_batch(cfg.calib_seqs, T, n_pairs, cfg.query_frac, cfg.vocab_size,
                          generator(cfg, "calib"))
    held, _ = recall_batch(cfg.heldout_seqs, T, n_pairs, cfg.query_frac, cfg.vocab_size,
                           generator(cfg, "heldout"))
    qpos = (answer_positions(T, n_queries(n_pairs, cfg.query_frac))
            if cfg.calib_queries == "answers" else None)             # None: the last qwin
    specs, reports = {}, {}
    for name, how in VARIANTS.items():
        if how is None:
            specs[name] = None
            continue
        base, center, learn = how
        t0 = time.perf_counter()
        specs[name], reports[name] = optr.calibrate(model, cal, held, base=base, center=center,
                                                    learn=learn, query_positions=qpos, cfg=cfg)
        if learn:
            log(f"calibrated {name:<21} in {time.perf_counter() - t0:5.1f} s | held-out loss, "
                f"base -> OptR (heads kept):")
            for l in range(cfg.n_layers):
                for part in ("k", "v"):
                    rows = [r for r in reports[name] if r["layer"] == l and r["part"] == part]
                    log(f"    layer {l} {part.upper()}: " + "  ".join(
                        f"{r['base_loss']:.5f} -> {r['best_loss']:.5f}"
                        f"{'' if r['kept'] else ' (base)'}" for r in rows))
    return specs, reports


# ----------------------------------------------------------------------------------------
# 6. Evaluation: accuracy, KL, where the output error comes from, E_rec, bits
# ----------------------------------------------------------------------------------------

def eval_data(cfg: RunConfig) -> dict:
    """{T: (idx (n, T), answers (n, n_q))} from the evaluation stream."""
    gen = generator(cfg, "eval")
    return {T: recall_batch(cfg.eval_seqs, T, pairs_at(cfg, T), cfg.query_frac, cfg.vocab_size, gen)
            for T in cfg.eval_len}


@torch.no_grad()
def answer_logits(model, idx, n_q, kv=None, chunk=64) -> torch.Tensor:
    """Logits at the answer positions (n, n_q, vocab), with a simulated cache `kv`."""
    pos = answer_positions(idx.shape[1], n_q)
    return torch.cat([model(idx[i:i + chunk], kv=kv)[:, pos] for i in range(0, len(idx), chunk)])


@torch.no_grad()
def output_errors(model, captured, kv, cfg: RunConfig, n_q: int) -> dict:
    """Eq. 8-10 per layer from the full-precision q, k, v of every layer, with the
    variant's effective keys and values (sink and recent window exact, per query).
    e_out_key, e_out_value: mean |dy_K|^2, |dy_V|^2 per query head and answer position;
    e_out: mean |dy_K + dy_V|^2; e_rec: mean |k - k~|^2 + |v - v~|^2 per KV head and
    token over the INT2 part of the cache at the last position. Means over layers."""
    sums = dict(e_out_key=0.0, e_out_value=0.0, e_out=0.0, e_rec=0.0)
    if kv is None:
        return sums
    for l, (q, k, v) in enumerate(captured):
        T = k.shape[2]
        pos = answer_positions(T, n_q)
        k_t, v_t = optr.effective_kv(k, v, kv[l], cfg)
        mask = optr.causal_mask(pos, T)
        fp = optr.fp_window_mask(pos, T, cfg.sink, cfg.window)
        r = optr.error_decomposition(q[:, :, pos], k, v, k_t, v_t, model.o_proj_heads(l), mask, fp)
        sums["e_out_key"] += r["dy_k"].pow(2).sum(-1).mean().item()
        sums["e_out_value"] += r["dy_v"].pow(2).sum(-1).mean().item()
        sums["e_out"] += r["e_out"].mean().item()
        int2 = ~optr.fp_window_mask(torch.tensor([T - 1]), T, cfg.sink, cfg.window)[0]
        sums["e_rec"] += ((k - k_t)[:, :, int2].pow(2).sum(-1).mean()
                          + (v - v_t)[:, :, int2].pow(2).sum(-1).mean()).item()
    return {name: s / len(captured) for name, s in sums.items()}


def full_cache_setup(cfg: RunConfig, T: int):
    """Full precision in the paged cache: a recent window that covers the whole context."""
    return dataclasses.replace(cfg, sink=0, window=T), [optr.KVQuant()] * cfg.n_layers


def serving_model(model, cfg: RunConfig, specs: list) -> optr.TinyLM:
    """The model as served from a paged cache with these windows: same weights, R_V folded
    into v_proj and o_proj."""
    served = optr.TinyLM(cfg)
    served.load_state_dict(model.state_dict())
    return optr.fold_value_rotation(served, specs)


@torch.no_grad()
def measured_bits(model, kv, cfg: RunConfig, idx: torch.Tensor) -> tuple[float, float | None]:
    """Bits per cached K/V element of one sequence of idx's length as stored in the paged
    cache (windows in bf16, as served), and of its INT2 part alone (None for full)."""
    T = idx.shape[1]
    c, specs = full_cache_setup(cfg, T) if kv is None else (cfg, kv)
    cache = optr.PagedKVCache(c, num_pages=math.ceil(T / c.page_size), max_seqs=1, kv=specs,
                              window_dtype=torch.bfloat16)
    seq = cache.add_sequence()
    optr.prefill(serving_model(model, c, specs), cache, [seq], idx[:1])
    return cache.bits_per_element(seq), None if kv is None else cache.bits_per_element(seq, True)


def evaluate(model, specs: dict, cfg: RunConfig, log=print) -> dict:
    data = eval_data(cfg)
    T_max = max(cfg.eval_len)
    n_q = {T: ans.shape[1] for T, (_, ans) in data.items()}
    full_logits = answer_logits(model, data[T_max][0], n_q[T_max])
    with torch.no_grad():
        _, captured = model(data[T_max][0][:cfg.err_seqs], capture=True)
    results = {}
    for name, kv in specs.items():
        t0 = time.perf_counter()
        acc = {}
        for T, (idx, ans) in data.items():
            reuse = kv is None and T == T_max
            logits = full_logits if reuse else answer_logits(model, idx, n_q[T], kv)
            acc[str(T)] = (logits.argmax(-1) == ans).float().mean().item()
            if T == T_max:
                logp_full, logp = full_logits.log_softmax(-1), logits.log_softmax(-1)
                kl = (logp_full.exp() * (logp_full - logp)).sum(-1).mean().item()
        bits, bits_int2 = measured_bits(model, kv, cfg, data[T_max][0])
        results[name] = dict(accuracy=acc, kl=kl,
                             **output_errors(model, captured, kv, cfg, n_q[T_max]),
                             bits_per_element=bits, bits_int2_part=bits_int2)
        log(f"evaluated {name:<21} in {time.perf_counter() - t0:5.1f} s | accuracy "
            + " ".join(f"{a:.4f}@{T}" for T, a in acc.items()))
    return results


# ----------------------------------------------------------------------------------------
# 7. Real decode: the paged INT2 cache, token by token, with the Triton kernel
# ----------------------------------------------------------------------------------------

@torch.no_grad()
def decode_check(model, specs: dict, names: list, cfg: RunConfig, log=print) -> dict:
    """Prefill each context into the paged cache (appending its tokens), then decode the
    query section one token at a time with attend = kernel.int2_paged_decode. Compare the
    answers with the simulated cache (the one every number above comes from)."""
    T = min(cfg.eval_len)
    idx, ans = (x[:cfg.decode_seqs] for x in eval_data(cfg)[T])
    n, n_q = ans.shape
    pos = answer_positions(T, n_q)
    first = int(pos[0])                                  # the query section starts here
    out = {}
    for name in names:
        kv = specs[name]
        c, kv_cache = full_cache_setup(cfg, T) if kv is None else (cfg, kv)
        folded = serving_model(model, c, kv_cache)
        cache = optr.PagedKVCache(c, num_pages=n * math.ceil(T / c.page_size), max_seqs=n,
                                  kv=kv_cache)
        seqs = [cache.add_sequence() for _ in range(n)]
        optr.prefill(folded, cache, seqs, idx[:, :first])
        steps = [optr.decode_step(folded, cache, seqs, idx[:, t], attend=kernel.int2_paged_decode)
                 for t in range(first, T)]
        dec = torch.stack(steps, 1)[:, pos - first]                       # (n, n_q, vocab)
        sim = answer_logits(model, idx, n_q, kv)
        res = dict(seqs=n, context=T, answers=ans.numel(),
                   same_argmax=int((dec.argmax(-1) == sim.argmax(-1)).sum()),
                   correct_decode=int((dec.argmax(-1) == ans).sum()),
                   correct_simulated=int((sim.argmax(-1) == ans).sum()),
                   max_abs_logit_diff=(dec - sim).abs().max().item())
        out[name] = res
        log(f"decode check {name:<12}: {res['same_argmax']}/{res['answers']} answers match the "
            f"simulated argmax | correct {res['correct_decode']} decoded, "
            f"{res['correct_simulated']} simulated | "
            f"max |logit diff| {res['max_abs_logit_diff']:.2e}")
    return out


# ----------------------------------------------------------------------------------------
# 8. Checkpoints: safetensors only
# ----------------------------------------------------------------------------------------

def save_model(model, cfg: RunConfig, path: str):
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, path, metadata={"config": json.dumps(config_dict(cfg))})


def load_model(model, path: str):
    """Load a safetensors checkpoint into model; refuse any missing, extra or
    differently shaped tensor, saying which."""
    state, want = load_file(path), model.state_dict()
    problems = [f"missing {k} {tuple(v.shape)}" for k, v in want.items() if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in want]
    problems += [f"{k}: file has {tuple(state[k].shape)}, model has {tuple(v.shape)}"
                 for k, v in want.items() if k in state and state[k].shape != v.shape]
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint {path} does not match this config: "
                         + "; ".join(problems[:3]) + more)
    model.load_state_dict(state)


def save_rotations(specs: dict, path: str):
    """Every variant's per-layer key mean and key/value rotations: "<variant>/<layer>/r_k"."""
    tensors = {}
    for name, kv in specs.items():
        for l, s in enumerate(kv or []):
            for part in ("k_mean", "r_k", "r_v"):
                if getattr(s, part) is not None:
                    tensors[f"{name}/{l}/{part}"] = getattr(s, part).detach().contiguous()
    save_file(tensors, path)


# ----------------------------------------------------------------------------------------
# 9. One run, the summary table, several seeds
# ----------------------------------------------------------------------------------------

def gap_closed(variants: dict, T: str) -> dict:
    """(optr - base) / (full - base) for each base: accuracy at length T, and KL."""
    out = {}
    for base in ("quarot", "oscar"):
        full, b, o = variants["full"], variants[base], variants[base + "+optr"]
        gap = full["accuracy"][T] - b["accuracy"][T]
        out[base] = dict(
            accuracy=(o["accuracy"][T] - b["accuracy"][T]) / gap if gap > 0 else None,
            kl=(b["kl"] - o["kl"]) / b["kl"] if b["kl"] > 0 else None)
    return out


def run_once(cfg: RunConfig, log=print) -> dict:
    t_start = time.perf_counter()
    os.makedirs(cfg.out, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = optr.TinyLM(cfg)
    ckpt = os.path.join(cfg.out, "model.safetensors")
    t0 = time.perf_counter()
    if cfg.resume:
        if not os.path.exists(ckpt):
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}; run once without it")
        load_model(model, ckpt)
        log(f"resumed from {ckpt}")
    else:
        train(model, cfg, log)
        save_model(model, cfg, ckpt)
    t_train = time.perf_counter() - t0
    model.eval().requires_grad_(False)

    idx, _ = eval_data(cfg)[max(cfg.eval_len)]
    stats = key_stats(model, idx[:cfg.err_seqs])
    print_key_stats(stats, log)

    t0 = time.perf_counter()
    specs, reports = calibrate_all(model, cfg, log)
    t_cal = time.perf_counter() - t0
    save_rotations(specs, os.path.join(cfg.out, "kv_rotations.safetensors"))

    t0 = time.perf_counter()
    variants = evaluate(model, specs, cfg, log)
    T = str(max(cfg.eval_len))
    best = max(("quarot+optr", "oscar+optr"), key=lambda n: variants[n]["accuracy"][T])
    decode = decode_check(model, specs, ["full", best], cfg, log)
    t_eval = time.perf_counter() - t0

    results = dict(config=config_dict(cfg),
                   timing_s=dict(train=t_train, calibrate=t_cal, evaluate=t_eval,
                                 total=time.perf_counter() - t_start),
                   key_stats=stats, variants=variants, gap_closed=gap_closed(variants, T),
                   decode_check=decode, report=reports)
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


COLUMNS = [("kl", "KL nats", "{:.4f}"), ("e_out_key", "E_out,K", "{:.4f}"),
           ("e_out_value", "E_out,V", "{:.4f}"), ("e_rec", "E_rec", "{:.3f}"),
           ("bits_per_element", "bits", "{:.2f}")]


def print_summary(results: dict, std: dict | None = None, log=print):
    """The ladder: one row per variant, accuracy per context length, then the errors."""
    variants = results["variants"]
    lens = list(variants["full"]["accuracy"])
    pm = lambda v, s, f: f.format(v) + ("" if s is None else "±" + f.format(s))
    w = 8 if std is None else 15
    log("")
    log(f"{'variant':<22}" + "".join(f"{'acc@' + T:>{w}}" for T in lens)
        + "".join(f"{h:>{w}}" for _, h, _ in COLUMNS))
    for name, v in variants.items():
        s = None if std is None else std[name]
        row = "".join(f"{pm(v['accuracy'][T], s and s['accuracy'][T], '{:.4f}'):>{w}}"
                      for T in lens)
        row += "".join(f"{pm(v[k], s and s[k], f):>{w}}" for k, _, f in COLUMNS)
        log(f"{name:<22}{row}")
    int2_bits = variants["int2"]["bits_int2_part"]
    log(f"KL(full || variant) in nats and the post-W_O errors |dy_K|^2, |dy_V|^2 (Eq. 8) at the "
        f"answer positions at T={lens[-1]},")
    log(f"per query head, mean over layers; E_rec (Eq. 9) per token and KV head over the INT2 "
        f"part; bits per K/V element")
    log(f"of the whole cache as stored (sink and window in bf16; the INT2 part alone "
        f"{int2_bits:.2f} bits).")
    fmt = lambda x: "n/a (no gap)" if x is None else f"{x:6.1%}"
    for base, g in results["gap_closed"].items():
        line = (f"gap closed by OptR over {base:<6}: accuracy@{lens[-1]} {fmt(g['accuracy'])} | "
                f"KL {fmt(g['kl'])}")
        if "gap_closed_per_seed" in results:
            line += "  (of the means; per seed: " + ", ".join(
                fmt(r[base]["accuracy"]).strip() for r in results["gap_closed_per_seed"]) + ")"
        log(line)
    log("  gap closed = (optr - base) / (full - base); for KL, (KL_base - KL_optr) / KL_base")
    if results["config"]["quick"]:
        log("  (--quick is a smoke run: at T=64 INT2 costs about a point, within this run's noise)")


def mean_std(per_seed: list[dict]) -> tuple[dict, dict]:
    """Mean and std (over seeds) of every number in the variants tables."""
    def walk(xs):
        if isinstance(xs[0], dict):
            pairs = {k: walk([x[k] for x in xs]) for k in xs[0]}
            return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
        if xs[0] is None:
            return None, None
        t = torch.tensor(xs, dtype=torch.float64)
        return t.mean().item(), (t.std().item() if len(xs) > 1 else 0.0)
    return walk([r["variants"] for r in per_seed])


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    cfg = parse_config(argv)
    print_config(cfg)
    if not cfg.seeds:
        results = run_once(cfg)
        print_summary(results)
    else:
        per_seed = []
        for s in cfg.seeds:
            print(f"\n=== seed {s} ===")
            per_seed.append(run_once(dataclasses.replace(cfg, seed=s, seeds=(),
                                                         out=os.path.join(cfg.out, f"seed{s}"))))
        mean, std = mean_std(per_seed)
        T = str(max(cfg.eval_len))
        results = dict(config=config_dict(cfg),
                       timing_s={k: sum(r["timing_s"][k] for r in per_seed)
                                 for k in per_seed[0]["timing_s"]},
                       key_stats={f"seed{s}": r["key_stats"] for s, r in zip(cfg.seeds, per_seed)},
                       variants=mean, variants_std=std, gap_closed=gap_closed(mean, T),
                       gap_closed_per_seed=[r["gap_closed"] for r in per_seed],
                       decode_check_per_seed=[r["decode_check"] for r in per_seed],
                       seeds=list(cfg.seeds))
        with open(os.path.join(cfg.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        print_summary(results, std)
    print(f"wrote {os.path.join(cfg.out, 'results.json')} | "
          f"total {time.perf_counter() - t_start:.1f} s")
    return results


if __name__ == "__main__":
    main()
