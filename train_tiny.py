"""
The paper's ladder in miniature: train a tiny model, calibrate, evaluate, one command.

    python train_tiny.py                   # about 5 minutes on 2 CPU cores
    python train_tiny.py --quick           # about a minute: smaller everything
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
     centering) and, beyond the paper (ours), each OptR variant refined end to end on the
     model's next-token KL (+e2e, optr appendix D). For each: answer accuracy at several
     context lengths, KL(full || variant) at answer positions, the post-W_O output error at
     answer positions split into its key- and value-induced parts (Eq. 8), the
     reconstruction error E_rec (Eq. 9), and the bits per element of the cache as stored
     in the paged cache.
  4. A real decode check: the paged INT2 cache, token by token, with the Triton kernel
     (its CPU interpreter when there is no GPU), against the simulated path.
Training, calibration, held-out and evaluation data come from separate random streams of
the seed; the same seed gives the same numbers. Results go to OUT/results.json, the model
to OUT/model.safetensors and every variant's rotations and key means to
OUT/kv_rotations.safetensors (optr.save_kv_rotations; read back with
optr.load_kv_rotations).

Part 1 of this file is the ladder harness that eval_llm.py shares (the same ladder on a
real LLM); part 2 is the tiny model's own run: its task, training and metrics.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import math
import os
import re
import textwrap
import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import optr


# ========================================================================================
# Part 1. The ladder harness, shared with eval_llm.py
# ========================================================================================
"""
What both ladders do the same way, whatever the model and the data: the run config and
its command line, the variants, calibration of every variant, key statistics, the Eq. 8
split and E_rec, bits per element measured from the paged cache, the decode check through
the paged cache, the gap closed, the table, the rotation file and results.json. Each
script keeps only its data, its model and its metrics.
kernel.py is not imported here: without a GPU it switches Triton to its CPU interpreter
on import. A run that decodes with the kernel imports it at its start (decode_attention).
"""

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


def parse_run_config(argv, cls, quick: dict, description: str):
    """The run config `cls` from the command line; --quick applies the `quick` preset
    first, so flags given explicitly still win."""
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


class Timer:
    """Wall-clock seconds per stage, for the timing lines and results.json's timing_s."""

    def __init__(self):
        self.t0, self.stages = time.perf_counter(), {}

    def lap(self, name: str, since: float) -> float:
        """Add the seconds since `since` to stage `name`; returns them."""
        dt = time.perf_counter() - since
        self.stages[name] = self.stages.get(name, 0.0) + dt
        return dt

    def timing(self) -> dict:
        return dict(self.stages, total=time.perf_counter() - self.t0)


# ----------------------------------------------------------------------------------------
# H2. The variants, and calibration of every one through optr.calibrate (and, for the
# e2e variants, ours, optr.refine_end_to_end)
# ----------------------------------------------------------------------------------------

class Variant(NamedTuple):
    base: str                      # base rotation: identity, quarot or oscar (optr.base_rotations)
    center: bool                   # key centering (Section 4)
    learn: bool                    # OptR's per-layer correction (Section 6)
    e2e: bool = False              # then every layer refined on the end-to-end KL (optr appendix D)


VARIANTS = {                       # name: how its cache is stored, or None: not quantized
    "full": None,
    "int2": Variant("identity", False, False),
    "quarot": Variant("quarot", False, False),
    "quarot+optr": Variant("quarot", True, True),
    "oscar": Variant("oscar", False, False),
    "oscar+optr": Variant("oscar", True, True),
    "quarot+center": Variant("quarot", True, False),          # ablation: centering alone
    "quarot+optr-nocenter": Variant("quarot", False, True),   # ablation: OptR without centering
    # beyond the paper (ours): NAME+e2e starts from NAME's rotations (optr.refine_end_to_end)
    "quarot+optr+e2e": Variant("quarot", True, True, e2e=True),
    "oscar+optr+e2e": Variant("oscar", True, True, e2e=True),
}


def per_layer_variant(name: str) -> str:
    """The variant an e2e variant refines: its name without "+e2e" (the same cache)."""
    src = name.removesuffix("+e2e")
    assert VARIANTS[name].e2e and VARIANTS[src] == VARIANTS[name]._replace(e2e=False), name
    return src


def calibrate_variants(model, cal, held, names, query_positions=None, per_head=False,
                       progress_every=0, timer=None, log=print, workers=1, propagate=False,
                       e2e_positions=None, block=None) -> tuple[dict, dict]:
    """Every variant in `names` through optr.calibrate on the frozen model, from the
    calibration tokens cal (N, T) and held-out tokens held (M, T'). Returns {name: [KVQuant
    per layer]} (None for full) and {name: OptR's per-head report rows}. One line per
    variant: the held-out loss of the base -> OptR, summed over heads, and the heads that
    kept their OptR rotation; per_head: then one line per layer and part with each head's
    losses ("(base)": the base rotation kept); progress_every=n: a line every n layers;
    workers, propagate: as in optr.calibrate.
    An e2e variant (ours) refines its per-layer variant's specs (calibrated once in this
    call, listed or not) by optr.refine_end_to_end on the same tokens at e2e_positions (None:
    every position past the windows), `block` its simulated cache's query block; its report
    is refine_end_to_end's, its time the Timer's stage 'e2e'. One line per step, then the
    held-out KL at the start -> the kept step's."""
    timer = timer or Timer()
    L, steps = model.cfg.n_layers, model.cfg.steps
    specs, reports, per_layer, captured = {}, {}, {}, []

    def calibrated(name):            # a per-layer variant, calibrated once per call
        if name not in per_layer:
            per_layer[name] = calibrate_one(name)
        return per_layer[name]

    def calibrate_one(name):
        base, center, learn, _ = VARIANTS[name]
        t0, done = time.perf_counter(), set()

        def progress(line):          # optr.calibrate logs each held-out score; the last V one
            m = re.match(rf"\s*L(\d+) V step\s+{steps}\b", line)       # ends a layer
            if m and (int(m[1]) + 1) % progress_every == 0 and m[1] not in done:
                done.add(m[1])
                log(f"  calibrating {name:<21} | layer {int(m[1]) + 1:3d}/{L} | "
                    f"{time.perf_counter() - t0:6.1f} s")

        if not captured:             # one full-precision forward, shared by every variant
            captured.extend(optr.full_precision_captures(model, cal, held))
        kv, report = optr.calibrate(
            model, cal, held, base=base, center=center, learn=learn,
            query_positions=query_positions, cfg=model.cfg, workers=workers, propagate=propagate,
            log=progress if learn and progress_every else None, captured=captured)
        line = f"calibrated {name:<21} | {timer.lap('calibrate', t0):6.1f} s"
        for part in ("k", "v") if learn else ():
            r = [x for x in report if x["part"] == part]
            line += (f" | {part.upper()} held-out loss {sum(x['base_loss'] for x in r):.4g} -> "
                     f"{sum(x['best_loss'] for x in r):.4g}, "
                     f"{sum(x['kept'] for x in r)}/{len(r)} heads learned")
        log(line)
        for l in range(L) if learn and per_head else ():
            for part in ("k", "v"):
                rows = [r for r in report if r["layer"] == l and r["part"] == part]
                log(f"    layer {l} {part.upper()}: " + "  ".join(
                    f"{r['base_loss']:.5f} -> {r['best_loss']:.5f}"
                    f"{'' if r['kept'] else ' (base)'}" for r in rows))
        return kv, report

    for name in names:
        if VARIANTS[name] is None:
            specs[name] = None
        elif not VARIANTS[name].e2e:
            specs[name], reports[name] = calibrated(name)
        else:                        # beyond the paper (ours): end-to-end refinement
            kv, _ = calibrated(per_layer_variant(name))
            t0 = time.perf_counter()
            specs[name], reports[name] = optr.refine_end_to_end(
                model, kv, cal, held, cfg=model.cfg, positions=e2e_positions, block=block, log=log)
            rows, k = reports[name]["steps"], reports[name]["kept_step"]
            log(f"refined {name:<24} | {timer.lap('e2e', t0):6.1f} s | held-out KL "
                f"{rows[0]['held_kl']:.5f} -> {rows[k]['held_kl']:.5f} | step {k}/{len(rows) - 1} kept")
    return specs, reports


def save_ladder(path: str, specs: dict, cfg, meta: dict | None = None) -> str:
    """Every quantized variant of the ladder into one rotation file (optr.save_kv_rotations;
    full precision has nothing to store). `meta`: the script's JSON dict stored beside."""
    return optr.save_kv_rotations(path, {n: kv for n, kv in specs.items() if kv is not None},
                                  cfg, meta=meta)


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


KEY_STATS = (("pre_rope", "pre-RoPE"), ("post_rope", "post-RoPE"), ("post_rope_centered", "centered"))


@torch.no_grad()
def key_stats(cfg, captured: list, k_means: list) -> dict:
    """Per layer, from each layer's (q, k, v) in `captured` (k post-RoPE, from positions
    0 .. T-1): the pre-RoPE keys (rotated back by RoPE^-1), the post-RoPE keys (what the
    cache stores) and the post-RoPE keys minus the calibration mean mu (what a centered
    cache stores)."""
    T = captured[0][1].shape[2]
    cos, sin = optr.rope_cos_sin(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta)
    return {f"layer{l}": dict(pre_rope=channel_stats(optr.apply_rope(k, cos, -sin)),
                              post_rope=channel_stats(k),
                              post_rope_centered=channel_stats(optr.center_keys(k, mu)))
            for l, ((_, k, _), mu) in enumerate(zip(captured, k_means))}


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
        mask, fp = optr.causal_mask(positions, T), optr.fp_window_mask(positions, T, c.sink, c.window)
        k_t, v_t = optr.effective_kv(k, v, kv[l], c)                                  # Eq. 4
        r = optr.error_decomposition(q[:, :, positions], k, v, k_t, v_t, model.o_proj_heads(l),
                                     mask, fp)
        n_int2 = int(optr.int2_mask(mask, fp).any(0).sum())                  # INT2 tokens
        sums["e_out_key"] += r["dy_k"].pow(2).sum(-1).mean().item()                  # Eq. 8
        sums["e_out_value"] += r["dy_v"].pow(2).sum(-1).mean().item()                # Eq. 8
        sums["e_out"] += r["e_out"].mean().item()                                    # Eq. 10
        sums["e_rec"] += r["e_rec"].item() / max(1, B * H * n_int2)                  # Eq. 9
    return {name: s / len(captured) for name, s in sums.items()}


# ----------------------------------------------------------------------------------------
# H5. Serving: bits as stored, and the decode check through the paged INT2 cache
# ----------------------------------------------------------------------------------------

DECODE_ATTENDS = ("kernel", "reference")


def decode_attention(name: str):
    """The paged attention decode_step calls: 'kernel' (kernel.int2_paged_decode, Triton;
    its CPU interpreter without a GPU) or 'reference' (optr.paged_decode_reference, pure
    torch). Resolve it at the start of a run: kernel.py must be imported before anything
    imports triton (torch's optimizers do), or it cannot switch to the interpreter."""
    if name not in DECODE_ATTENDS:
        raise ValueError(f"decode_attend: expected one of {DECODE_ATTENDS}, got {name!r}")
    if name == "reference":
        return optr.paged_decode_reference
    import kernel                     # here, not at the top: see this part's docstring
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
        full = copy.deepcopy(model).reconfigure(sink=0, window=T)
        return full, [optr.KVQuant()] * model.cfg.n_layers
    return optr.fold_value_rotation(model, kv), kv


@torch.no_grad()
def measured_bits(model, kv, idx: torch.Tensor) -> tuple[float, float | None]:
    """Bits per cached K/V element of idx (1, T) as stored in optr.PagedKVCache with bf16
    windows (as served), and of its INT2 part alone (None for full precision)."""
    T = idx.shape[1]
    served, specs = serving_setup(model, kv, T)
    cache = optr.PagedKVCache(served.cfg, num_pages=math.ceil(T / served.cfg.page_size),
                              max_seqs=1, kv=specs, window_dtype=torch.bfloat16)
    seq = cache.add_sequence()
    optr.prefill(served, cache, [seq], idx)
    return cache.bits_per_element(seq), None if kv is None else cache.bits_per_element(seq, True)


def ladder_bits(model, specs: dict, variants: dict, idx: torch.Tensor, timer, log=print) -> float:
    """bits_per_element and bits_int2_part of every variant, measured on idx (1, T). Every
    INT2 variant stores the same tensors, so one of them is measured. Returns the INT2
    part's bits."""
    t0 = time.perf_counter()
    bits_full, _ = measured_bits(model, None, idx)
    first_q = next(n for n, kv in specs.items() if kv is not None)
    bits_q, bits_int2 = measured_bits(model, specs[first_q], idx)
    for name, v in variants.items():
        v["bits_per_element"] = bits_full if specs[name] is None else bits_q
        v["bits_int2_part"] = None if specs[name] is None else bits_int2
    log(f"bits per element at {idx.shape[1]} tokens, measured from optr.PagedKVCache's "
        f"tensors: full {bits_full:.2f}, INT2 variants {bits_q:.2f} (INT2 part "
        f"{bits_int2:.2f}) | {timer.lap('bits', t0):5.1f} s")
    return bits_int2


@torch.no_grad()
def decode_check(model, specs: dict, names, idx: torch.Tensor, first: int,
                 positions: torch.Tensor, attend, simulated: dict | None = None,
                 block: int | None = None, timer=None, log=print) -> dict:
    """Prefill idx[:, :first] (n, first) into optr.PagedKVCache (optr.prefill), then decode
    the tokens first .. max(positions) one at a time (optr.decode_step with `attend`,
    R_V folded into the weights), teacher-forced. Compare the logits at `positions` (each
    predicting the next token of idx) with the simulated cache every other number comes
    from: simulated {name: (n, len(positions), vocab)}, or model(idx, SimulatedINT2)."""
    timer = timer or Timer()
    n, T = idx.shape
    assert first >= 1 and int(positions.min()) >= first and int(positions.max()) < T - 1
    target = idx[:, positions + 1]
    out = {}
    for name in names:
        t0, kv = time.perf_counter(), specs[name]
        served, cache_kv = serving_setup(model, kv, T)
        c = served.cfg
        cache = optr.PagedKVCache(c, num_pages=n * math.ceil(T / c.page_size), max_seqs=n,
                                  kv=cache_kv)
        seqs = [cache.add_sequence() for _ in range(n)]
        optr.prefill(served, cache, seqs, idx[:, :first], block=block)
        steps = [optr.decode_step(served, cache, seqs, idx[:, t], attend=attend)
                 for t in range(first, int(positions.max()) + 1)]
        dec = torch.stack(steps, 1)[:, positions - first]                  # (n, n_pos, vocab)
        if simulated is not None:
            sim = simulated[name][:n]
        else:
            sim = model(idx, None if kv is None else optr.SimulatedINT2(kv, model.cfg, block))[:, positions]
        ok_dec, ok_sim = dec.argmax(-1) == target, sim.argmax(-1) == target
        res = dict(seqs=n, context=T, answer_tokens=target.numel(), attend=attend.__name__,
                   same_argmax=int((dec.argmax(-1) == sim.argmax(-1)).sum()),
                   correct_decoded=int(ok_dec.sum()), correct_simulated=int(ok_sim.sum()),
                   seqs_correct_decoded=int(ok_dec.all(-1).sum()),
                   seqs_correct_simulated=int(ok_sim.all(-1).sum()),
                   max_abs_logit_diff=(dec - sim).abs().max().item())
        out[name] = res
        log(f"decode check {name:<13} | {res['same_argmax']}/{res['answer_tokens']} answer tokens "
            f"match the simulated argmax | correct {res['correct_decoded']} decoded, "
            f"{res['correct_simulated']} simulated (all of a sequence's: "
            f"{res['seqs_correct_decoded']}/{n}, {res['seqs_correct_simulated']}/{n}) | "
            f"max |logit diff| {res['max_abs_logit_diff']:.2e} | {res['attend']} | "
            f"{timer.lap('decode', t0):5.1f} s")
    return out


# ----------------------------------------------------------------------------------------
# H6. Gap closed, the table, results.json
# ----------------------------------------------------------------------------------------

def gap_closed(variants: dict, metrics: dict) -> dict:
    """For each base (quarot, oscar) present with its +optr variant: the fraction of the
    gap to full precision that OptR closes, (optr - base) / (full - base), for each metric
    {name: (value of a variant's results, +1 if higher is better, -1 if lower is)}; None
    where full is not better than the base (no gap). For KL (full 0) that is
    (KL_base - KL_optr) / KL_base. With the base's +optr+e2e variant (ours) present, the
    same fraction for it under the key METRIC_e2e (e.g. kl_e2e)."""
    out = {}
    for base in ("quarot", "oscar"):
        if base not in variants or base + "+optr" not in variants:
            continue
        f, b = variants["full"], variants[base]
        out[base] = {}
        for suffix, name in (("", base + "+optr"), ("_e2e", base + "+optr+e2e")):
            for m, (get, sign) in metrics.items() if name in variants else ():
                gap = get(f) - get(b)
                out[base][m + suffix] = (get(variants[name]) - get(b)) / gap if gap * sign > 0 else None
    return out


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
                   best_step, kept); an e2e variant: optr.refine_end_to_end's report
                   {steps: [{step, cal_kl, held_kl}], kept_step}}
    then the script's own keys (`extra`). Returns the dict written."""
    results = dict(config=config_dict(cfg), timing_s=timing, key_stats=key_stats,
                   variants=variants, gap_closed=gap, decode_check=decode, report=report, **extra)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


# ========================================================================================
# Part 2. The tiny model: the task, training, evaluation, the run
# ========================================================================================

# ----------------------------------------------------------------------------------------
# 1. Run config: optr.Config plus training and evaluation fields; one CLI flag per field
# ----------------------------------------------------------------------------------------

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
    decode_seqs: int = _f(4, "sequences decoded through the paged cache")
    decode_attend: str = _f("kernel", "paged attention of the decode check: 'kernel' (the Triton "
                            "kernel, its CPU interpreter without a GPU) or 'reference' (pure torch)")
    # the run
    quick: bool = _f(False, "small preset, about a minute: T=64, sink 2, window 8, fewer steps "
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
        if self.decode_attend not in DECODE_ATTENDS:
            raise ValueError(f"RunConfig.decode_attend: expected one of {DECODE_ATTENDS}, "
                             f"got {self.decode_attend!r}")


# --quick: fields it changes (explicit flags win)
QUICK = dict(stage_len=(13, 64), stage_pairs=(4, 8), stage_steps=(800, 150),
             stage_batch=(32, 32), sink=2, window=8, eval_len=(32, 48, 64), eval_seqs=128,
             err_seqs=32, calib_seqs=64, heldout_seqs=64, steps=40, eval_every=10)


def parse_config(argv=None) -> RunConfig:
    return parse_run_config(argv, RunConfig, QUICK, __doc__.strip().split("\n")[0])


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
# 4. Checkpoints: safetensors only
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


# ----------------------------------------------------------------------------------------
# 5. Data for calibration and evaluation; accuracy and KL at the answer positions
# ----------------------------------------------------------------------------------------

def calibration_data(cfg: RunConfig):
    """Calibration and held-out sequences at the last stage's length, and OptR's loss
    query positions (the answer positions, or None: optr's last qwin)."""
    T, n_pairs = cfg.stage_len[-1], cfg.stage_pairs[-1]
    cal, _ = recall_batch(cfg.calib_seqs, T, n_pairs, cfg.query_frac, cfg.vocab_size,
                          generator(cfg, "calib"))
    held, _ = recall_batch(cfg.heldout_seqs, T, n_pairs, cfg.query_frac, cfg.vocab_size,
                           generator(cfg, "heldout"))
    qpos = (answer_positions(T, n_queries(n_pairs, cfg.query_frac))
            if cfg.calib_queries == "answers" else None)
    return cal, held, qpos


def eval_data(cfg: RunConfig) -> dict:
    """{T: (idx (n, T), answers (n, n_q))} from the evaluation stream."""
    gen = generator(cfg, "eval")
    return {T: recall_batch(cfg.eval_seqs, T, pairs_at(cfg, T), cfg.query_frac, cfg.vocab_size, gen)
            for T in cfg.eval_len}


@torch.no_grad()
def answer_logits(model, idx, n_q, kv=None, chunk=64) -> torch.Tensor:
    """Logits at the answer positions (n, n_q, vocab), with the simulated INT2 cache of
    per-layer specs `kv` (None: full precision)."""
    pos = answer_positions(idx.shape[1], n_q)
    attention = None if kv is None else optr.SimulatedINT2(kv, model.cfg)
    return torch.cat([model(idx[i:i + chunk], attention)[:, pos] for i in range(0, len(idx), chunk)])


def evaluate(model, specs: dict, cfg: RunConfig, data: dict, captured: list, log=print) -> dict:
    """Per variant: answer accuracy at every evaluation length, KL(full || variant) at the
    answer positions of the longest, and the Eq. 8 split and E_rec there (on `captured`,
    the full-precision q, k, v of its first err_seqs sequences)."""
    T_max = max(cfg.eval_len)
    n_q = {T: ans.shape[1] for T, (_, ans) in data.items()}
    full_logits = answer_logits(model, data[T_max][0], n_q[T_max])
    pos = answer_positions(T_max, n_q[T_max])
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
        results[name] = dict(accuracy=acc, kl=kl, **output_errors(model, captured, kv, pos))
        log(f"evaluated {name:<21} in {time.perf_counter() - t0:5.1f} s | accuracy "
            + " ".join(f"{a:.4f}@{T}" for T, a in acc.items()))
    return results


def tiny_gap_closed(variants: dict, T: str) -> dict:
    """gap_closed of the answer accuracy at length T and of the KL."""
    return gap_closed(variants, dict(accuracy=(lambda v: v["accuracy"][T], +1),
                                     kl=(lambda v: v["kl"], -1)))


# ----------------------------------------------------------------------------------------
# 6. One run, the summary table, several seeds
# ----------------------------------------------------------------------------------------

def run_once(cfg: RunConfig, attend, log=print) -> dict:
    timer = Timer()
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
    timer.lap("train", t0)
    model.eval().requires_grad_(False)

    data = eval_data(cfg)
    T_max = max(cfg.eval_len)
    cal, held, qpos = calibration_data(cfg)
    captured, cal_captured = [], []
    with torch.no_grad():
        model(data[T_max][0][:cfg.err_seqs], capture=captured)
        model(cal, capture=cal_captured)
    stats = key_stats(cfg, captured, [optr.key_mean(k) for _, k, _ in cal_captured])
    print_key_stats(stats, log)

    # e2e variants (ours): the KL at OptR's loss queries, the answer positions the ladder
    # scores (calib_queries "answers"), or with "last" every position past the windows
    specs, reports = calibrate_variants(model, cal, held, list(VARIANTS), qpos, per_head=True,
                                        timer=timer, log=log, e2e_positions=qpos)
    save_ladder(os.path.join(cfg.out, "kv_rotations.safetensors"), specs, cfg,
                meta=dict(config=config_dict(cfg)))

    t0 = time.perf_counter()
    variants = evaluate(model, specs, cfg, data, captured, log)
    timer.lap("evaluate", t0)
    ladder_bits(model, specs, variants, data[T_max][0][:1], timer, log)
    T = str(T_max)
    best = max(("quarot+optr", "oscar+optr"), key=lambda n: variants[n]["accuracy"][T])
    idx, ans = data[min(cfg.eval_len)]
    pos = answer_positions(idx.shape[1], ans.shape[1])
    decode = decode_check(model, specs, ["full", best], idx[:cfg.decode_seqs], int(pos[0]), pos,
                          attend, timer=timer, log=log)
    return write_results(cfg.out, cfg, timer.timing(), stats, variants,
                         tiny_gap_closed(variants, T), decode, reports)


COLUMNS = [("kl", "KL nats", "{:.4f}"), ("e_out_key", "E_out,K", "{:.4f}"),
           ("e_out_value", "E_out,V", "{:.4f}"), ("e_rec", "E_rec", "{:.3f}"),
           ("bits_per_element", "bits", "{:.2f}")]


def print_summary(results: dict, std: dict | None = None, log=print):
    """The ladder: one row per variant, accuracy per context length, then the errors."""
    variants = results["variants"]
    lens = list(variants["full"]["accuracy"])

    def cell(get, f):                  # the value, and +- its std over seeds when given
        return lambda name, v: f.format(get(v)) + ("" if std is None else "±" + f.format(get(std[name])))

    w = 8 if std is None else 15
    columns = [(f"acc@{T}", w, cell(lambda v, T=T: v["accuracy"][T], "{:.4f}")) for T in lens]
    columns += [(h, w, cell(lambda v, k=k: v[k], f)) for k, h, f in COLUMNS]
    log("")
    print_table(variants, columns, log)
    int2_bits = variants["int2"]["bits_int2_part"]
    log(f"KL(full || variant) in nats and the post-W_O errors |dy_K|^2, |dy_V|^2 (Eq. 8) at the "
        f"answer positions at T={lens[-1]},")
    log("per query head, mean over layers; E_rec (Eq. 9) per token and KV head over the INT2 "
        "part; bits per K/V element")
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
        if "kl_e2e" in g:
            log(f"gap closed by OptR+e2e over {base:<6}: accuracy@{lens[-1]} "
                f"{fmt(g['accuracy_e2e'])} | KL {fmt(g['kl_e2e'])}  (e2e: ours, not the paper's)")
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
    attend = decode_attention(cfg.decode_attend)       # before training imports triton
    if not cfg.seeds:
        results = run_once(cfg, attend)
        print_summary(results)
    else:
        per_seed = []
        for s in cfg.seeds:
            print(f"\n=== seed {s} ===")
            per_seed.append(run_once(dataclasses.replace(cfg, seed=s, seeds=(),
                                                         out=os.path.join(cfg.out, f"seed{s}")),
                                     attend))
        mean, std = mean_std(per_seed)
        seed = lambda key: {f"seed{s}": r[key] for s, r in zip(cfg.seeds, per_seed)}
        results = write_results(
            cfg.out, cfg, {k: sum(r["timing_s"][k] for r in per_seed) for k in per_seed[0]["timing_s"]},
            seed("key_stats"), mean, tiny_gap_closed(mean, str(max(cfg.eval_len))),
            seed("decode_check"), seed("report"), variants_std=std,
            gap_closed_per_seed=[r["gap_closed"] for r in per_seed], seeds=list(cfg.seeds))
        print_summary(results, std)
    print(f"wrote {os.path.join(cfg.out, 'results.json')} | "
          f"total {time.perf_counter() - t_start:.1f} s")
    return results


if __name__ == "__main__":
    main()
