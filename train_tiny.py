"""
The paper's ladder in miniature: train a tiny model, calibrate, evaluate, one command.

    python train_tiny.py                   # seeds 0, 1, 2 side by side: mean +- std (README: times)
    python train_tiny.py --seeds 0         # one seed (--seed 0 too)
    python train_tiny.py --quick           # under a minute: smaller everything, one seed
    python train_tiny.py --per-seed        # also print each seed's own table
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
     OptR's output-oriented correction, plus ablations (centering alone; OptR without
     centering) and, beyond the paper (ours, optr appendix D), a clip searched per layer on
     QuaRot with and without centering and under OptR (quarot+clip, quarot+center+clip,
     optr+ = quarot+optr+). For each: answer accuracy at several
     context lengths, KL(full || variant) at answer positions, the post-W_O output error at
     answer positions split into its key- and value-induced parts (Eq. 8), the
     reconstruction error E_rec (Eq. 9), and the bits per element of the cache as stored
     in the paged cache.
  4. A real decode check (of several seeds, on the first): the paged INT2 cache, token by
     token, with serving's compiled decode (kernel.paged_decode: numba on a CPU; or the Triton
     kernel, --decode-attend triton), against the simulated path.
Training, calibration, held-out and evaluation data come from separate random streams of
the seed. Round-off moves single runs by several points (it trains another model), and the
instruction set picks torch's and MKL's round-off: so run as a script this file pins both
before torch loads (ATEN_CPU_CAPABILITY=default: torch's plain kernels; MKL_CBWR=COMPATIBLE:
MKL's portable path; set either yourself to override). On 2 AMD EPYC cores that costs about
twice the time (the default run: 443 s, against 231 s unpinned, with AVX-512) and prints the
same digits with AVX2 and AVX-512 (--quick --seeds 0: QuaRot's KL 0.0476, OptR closing 61.0%
on both; unpinned 0.0336 / -21.6% on AVX2, 0.0605 / 48.4% on AVX-512, and the default run's
OptR 67.0% +- 6.3% / 73.7% +- 6.9% of QuaRot's KL gap). And the default run repeats everything
for seeds 0, 1, 2 (each its own model, data and calibration, each a process of its own with
one torch thread) and prints mean +- std over them. Where things go: one seed (--seed N,
--quick) writes OUT/results.json, the model to OUT/model.safetensors and every variant's
rotations and key means to
OUT/kv_rotations.safetensors (optr.save_kv_rotations; read back with optr.load_kv_rotations);
several seeds write those per seed in OUT/seedN/ (with its log, log.txt) and the mean +- std
with the per-seed tables to OUT/results.json.

This file is the tiny model's own run: its task, training and metrics. The ladder itself
(variants, calibration, key statistics, Eq. 8 split, bits, decode check, table) is
ladder.py, shared with eval_llm.py.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

if __name__ == "__main__":     # the same arithmetic on any x86-64 CPU: read once, when torch loads (the
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")   # seeds' processes inherit it); see above
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

if __name__ == "__main__" and not torch.cuda.is_available():   # a run without a GPU: the Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")   # kernel in its CPU interpreter (read at triton's import, below)

import optr
from ladder import (  # the ladder harness both scripts share
    DECODE_ATTENDS, VARIANTS, Timer, _f, calibrate_variants, config_dict, decode_attention,
    decode_check, gap_closed, gap_closed_mean_std, key_stats, ladder_bits, mean_std, output_errors,
    parse_run_config, plot_gap_closed, print_config, print_gap_closed, print_key_stats, print_table, run_cli,
    save_ladder, token_kl, write_results)


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
                            "'last' (the last n_loss_queries positions)")
    eval_len: tuple[int, ...] = _f((64, 128, 256), "evaluation context lengths; pairs scale with "
                                   "length as in the last stage")
    eval_seqs: int = _f(128, "evaluation sequences per context length")
    err_seqs: int = _f(64, "sequences for the error decomposition, at the longest length")
    decode_seqs: int = _f(2, "sequences decoded through the paged cache (the Triton interpreter, "
                          "--decode-attend triton, takes about 5 s per sequence and variant)")
    decode_attend: str = _f("compiled", "paged attention of the decode check: 'compiled' "
                            "(kernel.paged_decode, serving's: numba on a CPU), 'triton' (the Triton "
                            "kernel, its CPU interpreter without a GPU) or 'reference' (pure torch)")
    # the run
    quick: bool = _f(False, "small preset, about a minute: T=64, sink 2, window 8, fewer steps "
                     "and sequences; flags given explicitly still win")
    out: str = _f("runs/tiny", "output directory: results.json and safetensors files")
    resume: bool = _f(False, "load OUT/model.safetensors instead of training")
    seeds: tuple[int, ...] = _f((0, 1, 2), "repeat the whole run for each seed (its own model, "
                                "data and calibration, in OUT/seedN), report mean +- std; empty or "
                                "--seed N: one run of that seed in OUT")
    per_seed: bool = _f(False, "with several seeds, also print each seed's own table")
    jobs: int = _f(0, "seeds run at once, each in its own process (0: all of them; 1: one "
                   "after another); the numbers do not depend on it")
    threads: int = _f(1, "torch threads per seed (0: torch's default); another count rounds "
                      "differently, so a seed's numbers are those of its thread count")

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
        if self.jobs < 0 or self.threads < 0:
            raise ValueError(f"RunConfig.jobs, threads: expected >= 0, got {self.jobs}, {self.threads}")
        if self.decode_attend not in DECODE_ATTENDS:
            raise ValueError(f"RunConfig.decode_attend: expected one of {DECODE_ATTENDS}, "
                             f"got {self.decode_attend!r}")


# --quick: fields it changes (explicit flags win)
QUICK = dict(stage_len=(13, 64), stage_pairs=(4, 8), stage_steps=(800, 150),
             stage_batch=(32, 32), sink=2, window=8, eval_len=(32, 48, 64),
             err_seqs=32, calib_seqs=64, heldout_seqs=64, steps=40, eval_every=10, seeds=())


def parse_config(argv=None) -> RunConfig:
    """The run config; an explicit --seed N without --seeds is one run of seed N."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_run_config(argv, RunConfig, dict(quick=QUICK), __doc__.strip().split("\n")[0])
    given = {a.split("=")[0] for a in argv}
    if "--seed" in given and "--seeds" not in given:
        cfg = dataclasses.replace(cfg, seeds=())
    return cfg


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
    query positions (the answer positions, or None: optr's last n_loss_queries)."""
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
                kl = token_kl(logp_full, logp).mean().item()
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

def run_once(cfg: RunConfig, attend, log=print, timer=None) -> dict:
    """One seed end to end in cfg.out; attend None: no decode check."""
    timer = timer or Timer()
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

    specs, reports = calibrate_variants(model, cal, held, list(VARIANTS), qpos, per_head=True,
                                        timer=timer, log=log)
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
    decode = {} if attend is None else decode_check(
        model, specs, ["full", best], idx[:cfg.decode_seqs], int(pos[0]), pos, attend, timer=timer, log=log)
    return write_results(cfg.out, cfg, timer.timing(), stats, variants,
                         tiny_gap_closed(variants, T), decode, reports, seeds=[cfg.seed])


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
    print_gap_closed(results, {"accuracy": f"accuracy@{lens[-1]}", "kl": "KL"},
                     results.get("gap_closed_std") is not None, log)
    log("  gap closed = (row - base) / (full - base); for KL, (KL_base - KL_row) / KL_base")
    if std is not None:
        seeds = results["seeds"]
        log(f"  mean ± std over seeds {', '.join(map(str, seeds))} (each its own model, data and "
            f"calibration; std with n - 1 in the divisor);")
        log("  gap closed: the mean of each seed's own (a seed without a gap is left out of it); "
            "per-seed tables")
        log("  in results.json (per_seed), on screen with --per-seed")
    if results["config"]["quick"]:
        log("  (--quick is a smoke run: at T=64 INT2 costs about a point, within this run's noise)")


def run_seed(cfg: RunConfig, seed: int, decode: bool) -> dict:
    """One seed of a several-seed run, in a process of its own (run_seeds): its model, data,
    calibration and results.json in OUT/seedN, its whole log in OUT/seedN/log.txt, a line
    on screen as each stage ends; the decode check only where `decode`."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg = dataclasses.replace(cfg, seed=seed, seeds=(), out=os.path.join(cfg.out, f"seed{seed}"))
    attend = decode_attention(cfg.decode_attend) if decode else None
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "log.txt"), "w", buffering=1) as f:
        progress = lambda stage, dt, t: print(f"seed {seed} | {stage:<9} +{dt:6.1f} s | "
                                              f"{t:6.1f} s so far", flush=True)
        return run_once(cfg, attend, log=lambda line: f.write(line + "\n"), timer=Timer(progress))


def run_seeds(cfg: RunConfig) -> list[dict]:
    """Every seed as its own process, cfg.jobs at once (0: all); fresh processes with the same
    thread count compute the same numbers whether they run side by side or one by one. The
    decode check (of the paged cache and kernel, not a table row) runs on the first seed."""
    jobs = min(cfg.jobs or len(cfg.seeds), len(cfg.seeds))
    print(f"seeds {', '.join(map(str, cfg.seeds))}: {jobs} at once, {cfg.threads or 'default'} "
          f"torch thread(s) each; logs in {os.path.join(cfg.out, 'seedN', 'log.txt')}")
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        decode = [i == 0 for i in range(len(cfg.seeds))]
        return list(pool.map(run_seed, [cfg] * len(cfg.seeds), cfg.seeds, decode))


def aggregate_seeds(cfg: RunConfig, per_seed: list[dict], wall: float) -> dict:
    """OUT/results.json of several seeds: mean and std of every number, each seed's gap
    closed, per-seed tables; timing_s the per-stage sums over seeds and the wall time."""
    mean, std = mean_std([r["variants"] for r in per_seed])
    gap_mean, gap_std = gap_closed_mean_std([r["gap_closed"] for r in per_seed])
    seed = lambda key: {f"seed{s}": r[key] for s, r in zip(cfg.seeds, per_seed) if r[key]}
    stages = dict.fromkeys(k for r in per_seed for k in r["timing_s"])
    timing = {k: sum(r["timing_s"].get(k, 0.0) for r in per_seed) for k in stages} | dict(wall=wall)
    return write_results(
        cfg.out, cfg, timing, seed("key_stats"), mean, gap_mean, seed("decode_check"), seed("report"),
        seeds=list(cfg.seeds), variants_std=std, gap_closed_std=gap_std,
        gap_closed_of_means=tiny_gap_closed(mean, str(max(cfg.eval_len))),
        per_seed={f"seed{s}": dict(variants=r["variants"], gap_closed=r["gap_closed"],
                                   timing_s=r["timing_s"])
                  for s, r in zip(cfg.seeds, per_seed)})


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    cfg = parse_config(argv)
    print_config(cfg)
    print(f"arithmetic: torch's {torch.backends.cpu.get_cpu_capability()} kernels, MKL_CBWR="
          f"{os.environ.get('MKL_CBWR', 'unset')} (pinned to default, COMPATIBLE when run as a script)")
    if not cfg.seeds:
        attend = decode_attention(cfg.decode_attend)
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.threads or threads)
        try:
            results = run_once(cfg, attend)
        finally:
            torch.set_num_threads(threads)
        print_summary(results)
    else:
        per_seed = run_seeds(cfg)
        results = aggregate_seeds(cfg, per_seed, time.perf_counter() - t_start)
        for s, r in zip(cfg.seeds, per_seed) if cfg.per_seed else ():
            print(f"\nseed {s}:")
            print_summary(r)
        print_summary(results, results["variants_std"])
        for s, checks in results["decode_check"].items():   # the first seed's, from its log
            for name, c in checks.items():
                print(f"decode check ({s}, {c['attend']}) {name:<12} | {c['same_argmax']}/"
                      f"{c['answer_tokens']} answer tokens as simulated | max |logit diff| "
                      f"{c['max_abs_logit_diff']:.2e}")
    runs = [r["gap_closed"] for r in per_seed] if cfg.seeds else [results["gap_closed"]]
    plot = plot_gap_closed(runs, list(VARIANTS), "kl", [f"seed {s}" for s in cfg.seeds or (cfg.seed,)],
                           os.path.join(cfg.out, "gap_closed.png"), "the tiny model: KL gap closed, per seed")
    print(f"wrote {os.path.join(cfg.out, 'results.json')}, {plot} | total {time.perf_counter() - t_start:.1f} s")
    return results


if __name__ == "__main__":
    run_cli(main)
