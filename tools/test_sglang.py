"""
The spec of tools/sglang.py: the authors' SGLang engine reads export_sglang's files as the specs they
came from, and serves with them what optr simulates. The oracles below restate, in plain torch and
without calling optr, what the authors' engine does with the files (engine/sglang-research of
daniel-eai/Output-Aware-INT2-KV-Cache-Quantization: mem_cache/memory_pool.py load_oscar_rotations,
mem_cache/unified_kv_pool.py _load_oscar_k_means and its K write, QuantKernel/
oscar_rotation_clip_int2_kv.py, mem_cache/kv_quant_kernels.py's dequantize, scripts/
validate_rotation_artifact.py, run.sh). Their GPU kernels run in bf16 on the HP tier; the oracles
run the same steps in fp32 (their SGLANG_MIXED_KV_HP_DTYPE=float32).
"""
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ladder
import optr
from tools import sglang
from tools.sglang import export_sglang

ROOT = Path(__file__).parent.parent
IDX = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(7))
GEMMA_SLIDING = 12                                     # tokens a sliding layer reads


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).float() * scale


def random_orthogonal(d, seed=0):
    q, r = torch.linalg.qr(rand(d, d, seed=seed).double())
    return (q * torch.sign(torch.diagonal(r))).float()


def orthogonal_specs(cfg, seed=0):
    """One KVQuant per layer: a key mean and a random orthogonal R_K, R_V per KV head."""
    H, d = cfg.n_kv_heads, cfg.head_dim
    heads = lambda s: torch.stack([random_orthogonal(d, s + h) for h in range(H)])
    return [optr.KVQuant(k_mean=rand(H, d, seed=seed + l), r_k=heads(seed + 10 * l + 1),
                         r_v=heads(seed + 10 * l + 5)) for l in range(cfg.n_layers)]


def served_model(kind="qwen2", seed=3, **kw):
    """A random TinyLM the engine can serve as calibrated (G = d = 16, windows of 8; Llama, or
    Qwen2's q/k/v bias) with every weight drawn, and its specs."""
    cfg = optr.Config(vocab_size=300, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16,
                      ffn_dim=80, group_size=16, rope_theta=5e4, rms_eps=1e-5, attention_bias=kind == "qwen2",
                      seed=seed, sink=8, window=8, page_size=8, **kw)
    model = optr.TinyLM(cfg)
    with torch.no_grad():
        for i, (n, p) in enumerate(model.named_parameters()):
            p.copy_(rand(*p.shape, seed=seed + i, scale=0.3 if p.dim() == 2 else 0.1)
                    + (1.0 if n.endswith("norm.weight") else 0.0))
    return model.eval(), orthogonal_specs(cfg, seed=seed)


def q2_dequantize(packed, scale, zero, G):
    """The test's reading of Q2's storage form: (packed (..., d/4), scale, zero (..., d/G)) -> (..., d)."""
    code = optr.unpack_int2(packed).float()
    return ((code.unflatten(-1, (-1, G)) - zero[..., None]) * scale[..., None]).flatten(-2)


def tiny_gemma3():
    """A random transformers Gemma 3 (4 layers, sliding and full alternating, a 12-token slide, MQA)."""
    import transformers
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, head_dim=16, num_attention_heads=4,
        num_key_value_heads=1, num_hidden_layers=4, sliding_window=GEMMA_SLIDING, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False)
    return transformers.Gemma3ForCausalLM(config).eval()


# The oracles below restate, in plain torch and without calling optr, what the authors'
# engine does with the files (engine/sglang-research of daniel-eai/Output-Aware-INT2-KV-
# Cache-Quantization: mem_cache/memory_pool.py load_oscar_rotations, mem_cache/
# unified_kv_pool.py _load_oscar_k_means and its K write, QuantKernel/
# oscar_rotation_clip_int2_kv.py, mem_cache/kv_quant_kernels.py's dequantize, scripts/
# validate_rotation_artifact.py, run.sh). Their GPU kernels run in bf16 on the HP tier; the
# oracles run the same steps in fp32 (their SGLANG_MIXED_KV_HP_DTYPE=float32).

def sglang_rotations(path, n_layers, d, n_heads):
    """Their loader and validator: a 'layers' mapping keyed by int or str layer id; each
    rotation (d, d) for every head or (n_heads, d, d) per head, not mixed; finite, square,
    max |R^T R - I| <= 5e-3 in fp32. Returns (n_layers, n_heads, d, d) fp32."""
    layers = torch.load(path, map_location="cpu", weights_only=True)["layers"]
    mats, kinds = [], set()
    for l in range(n_layers):
        R = layers[l if l in layers else str(l)]["rotation"].float()
        assert torch.isfinite(R).all() and R.ndim in (2, 3) and R.shape[-1] == R.shape[-2] == d
        assert (R.transpose(-1, -2) @ R - torch.eye(d)).abs().max() <= 5e-3
        kinds.add(R.ndim)
        mats.append(R.expand(n_heads, d, d) if R.ndim == 2 else R)
    assert len(kinds) == 1, "layerwise and headwise layers mixed"
    return torch.stack(mats)


def sglang_k_means(path, n_layers, d):
    """Their key-mean loader: a 'layers' mapping, each 'mu' 2-D with d columns."""
    layers = torch.load(path, map_location="cpu", weights_only=True)["layers"]
    mus = [layers[l if l in layers else str(l)]["mu"].float() for l in range(n_layers)]
    assert all(m.dim() == 2 and m.shape[1] == d for m in mus)
    return torch.stack(mus)


def sglang_specs(k_path, v_path, cfg, mu_path=None) -> list:
    """The engine's files through their loaders -> a KVQuant per layer (mu None without a file)."""
    L, H, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    r_k, r_v = (sglang_rotations(p, L, d, H) for p in (k_path, v_path))
    mu = sglang_k_means(mu_path, L, d) if mu_path else [None] * L
    return [optr.KVQuant(k_mean=m, r_k=a, r_v=b) for m, a, b in zip(mu, r_k, r_v)]


def sglang_env(path):
    """serve.env as their engine reads it, with their launch-time rules: both rotation paths
    set, clip ratios in [0, 1], windows multiples of N_Q = 4 * bytes(bf16) = 8, the key mean
    active only with K_MEAN_IN_POOL and a path. Returns (env, server flags)."""
    env, args = {}, {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("export "):
            k, v = line[len("export "):].split("=", 1)
            env[k] = v
        elif line.startswith("SGLANG_SERVER_ARGS="):
            words = line.split("=", 1)[1].strip('"').split()
            args = dict(zip(words[::2], words[1::2]))
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] and env["SGLANG_OSCAR_V_ROTATION_PATH"]
    assert all(0 <= float(env[f"SGLANG_OSCAR_{s}_CLIP_RATIO"]) <= 1 for s in "KV")
    assert all(int(env[f"SGLANG_MIXED_KV_{w}_TOKENS"]) % 8 == 0 for w in ("PREFIX", "RECENT"))
    env["k_mean_active"] = env["SGLANG_OSCAR_K_MEAN_IN_POOL"] == "1" and bool(env["SGLANG_OSCAR_K_MEAN_PATH"])
    return env, args


def sglang_quantize(rows, clip, G):
    """Their clip + pack kernel on rotated rows (..., d): per-ROW clip at the sorted |x| of
    index min(max(int(c d), 0), d - 1), then per group of G: scale = max(max - min, 1e-8)/3,
    zero = -min/scale, code = uint8(x/scale + zero + 0.5) (truncation, no clamp); byte j holds
    the codes of dims j, j + d/4, j + d/2, j + 3d/4; scales and zeros interleaved per group."""
    d = rows.shape[-1]
    idx = min(max(int(clip * d), 0), d - 1)
    thr = rows.abs().sort(dim=-1).values[..., idx:idx + 1]
    x = torch.minimum(torch.maximum(rows, -thr), thr).reshape(*rows.shape[:-1], d // G, G)
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = torch.clamp(mx - mn, min=1e-8) / 3.0
    zero = -mn / scale
    q = (x / scale + zero + 0.5).to(torch.uint8).reshape(rows.shape)
    Q = d // 4
    packed = q[..., :Q] | (q[..., Q:2 * Q] << 2) | (q[..., 2 * Q:3 * Q] << 4) | (q[..., 3 * Q:] << 6)
    return packed, torch.stack([scale[..., 0], zero[..., 0]], -1).flatten(-2)


def sglang_dequantize(packed, sz, G):
    """Their dequantize: the four 2-bit fields of byte j are dims j, j + d/4, ...; value =
    (code - zero) * scale of the code's group."""
    q = torch.cat([((packed >> s) & 3).float() for s in (0, 2, 4, 6)], -1)
    scale, zero = sz[..., 0::2, None], sz[..., 1::2, None]
    return ((q.reshape(*q.shape[:-1], -1, G) - zero) * scale).reshape(q.shape)


def sglang_write(k, v, R_k, R_v, mu, clip_k, clip_v, G, absorbed):
    """Their K/V write for k, v (B, H, T, d): keys k R_K - mu R_K, values v R_V (or v as the
    absorbed projection made it), then sglang_quantize."""
    k_rows = k @ R_k[None] - (mu[:, None, :] @ R_k)[None]
    v_rows = v if absorbed else v @ R_v[None]
    return sglang_quantize(k_rows, clip_k, G), sglang_quantize(v_rows, clip_v, G)


def engine_attention(files, cfg):
    """The model's attention as their engine serves it with no exact windows (every token
    through INT2, itself included): keys and values written and dequantized by the oracles
    above, queries rotated by R_K, o R_V^T after attention (V absorbed into v_proj only)."""
    R_k, R_v, mu = files

    def attention(layer, q, k, v):
        (kp, ksz), (vp, vsz) = sglang_write(k, v, R_k[layer], R_v[layer], mu[layer],
                                            cfg.clip_k, cfg.clip_v, cfg.group_size, absorbed=False)
        K, V = sglang_dequantize(kp, ksz, cfg.group_size), sglang_dequantize(vp, vsz, cfg.group_size)
        qr = q @ R_k[layer].repeat_interleave(cfg.n_rep, 0)[None]
        o = F.scaled_dot_product_attention(qr, K, V, is_causal=True, enable_gqa=True)
        return o @ R_v[layer].repeat_interleave(cfg.n_rep, 0).transpose(-1, -2)[None]
    return attention


def exported(tmp_path, kv, cfg, folded=False, name="sglang"):
    out = export_sglang(kv, cfg, str(tmp_path / name), folded=folded)
    return [os.path.join(out, f) for f in ("k_rotation.pt", "v_rotation.pt", "k_mean.pt")]


def test_sglang_files_load_in_their_loaders_with_the_flags_they_need(tmp_path):
    """export_sglang writes plain-tensor files their loaders and validator accept, holding
    R_K, R_V and mu per layer and KV head, and a serve.env that passes their launch rules with
    group size d, page size 8, our windows and clips, V absorption and the key mean on."""
    model, kv = served_model()
    c = model.cfg
    k_path, v_path, mu_path = exported(tmp_path, kv, c)
    for p in (k_path, v_path, mu_path):
        torch.load(p, weights_only=True)
    assert torch.equal(sglang_rotations(k_path, c.n_layers, 16, 2), torch.stack([s.r_k for s in kv]))
    assert torch.equal(sglang_rotations(v_path, c.n_layers, 16, 2), torch.stack([s.r_v for s in kv]))
    assert torch.equal(sglang_k_means(mu_path, c.n_layers, 16), torch.stack([s.k_mean for s in kv]))
    env, args = sglang_env(tmp_path / "sglang" / "serve.env")
    assert args == {"--kv-cache-dtype": "int2", "--kv-cache-quant-group-size": "16", "--page-size": "8"}
    assert (env["SGLANG_MIXED_KV_PREFIX_TOKENS"], env["SGLANG_MIXED_KV_RECENT_TOKENS"]) == ("8", "8")
    assert (float(env["SGLANG_OSCAR_K_CLIP_RATIO"]), float(env["SGLANG_OSCAR_V_CLIP_RATIO"])) == (c.clip_k, c.clip_v)
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "1" and env["k_mean_active"]
    assert Path(env["SGLANG_OSCAR_K_MEAN_PATH"]).samefile(mu_path)
    kv_plain = [optr.KVQuant(r_k=s.r_k) for s in kv]               # no centering, no R_V
    exported(tmp_path, kv_plain, c, name="plain")
    env, _ = sglang_env(tmp_path / "plain" / "serve.env")
    assert not env["k_mean_active"] and not (tmp_path / "plain" / "k_mean.pt").exists()
    assert torch.equal(sglang_rotations(env["SGLANG_OSCAR_V_ROTATION_PATH"], c.n_layers, 16, 2),
                       torch.eye(16).expand(c.n_layers, 2, 16, 16))


def test_their_write_path_stores_our_codes_bit_for_bit_at_G_equal_d():
    """On the same rotated rows their clip, affine and packing give our codes, scales and
    zeros bit for bit when G = d (their per-row clip is our per-group clip), and their
    dequantization our values; through their whole write path (k R_K - mu R_K, ours
    (k - mu) R_K) the dequantized keys agree to round-off. With G < d they clip per row and
    we per group, and the codes differ."""
    H, d = 2, 16
    spec = orthogonal_specs(optr.Config(n_kv_heads=H, head_dim=d, group_size=d), seed=4)[0]
    k, v = rand(3, H, 20, d, seed=5), rand(3, H, 20, d, seed=6)
    k[..., 2] = k[..., 2] * 5 + 3                                           # an offset outlier channel
    rows = optr.rotate_rows(optr.center_keys(k, spec.k_mean), spec.r_k)
    for G in (d, d // 2):
        ours = optr.q2_quantize(rows, 0.9, G)
        packed, sz = sglang_quantize(rows, 0.9, G)
        same = torch.equal(packed, ours[0]) and torch.equal(sz[..., 0::2], ours[1]) \
            and torch.equal(sz[..., 1::2], ours[2])
        assert same == (G == d), G
        if G == d:
            assert torch.equal(sglang_dequantize(packed, sz, G), q2_dequantize(*ours, G))
    (kp, ksz), (vp, vsz) = sglang_write(k, v, spec.r_k, spec.r_v, spec.k_mean, 0.9, 0.9, d, absorbed=False)
    ours_k = q2_dequantize(*optr.q2_quantize(rows, 0.9, d), d)
    assert torch.allclose(sglang_dequantize(kp, ksz, d), ours_k, atol=1e-5)
    ours_v = optr.q2_quantize(optr.rotate_rows(v, spec.r_v), 0.9, d)
    assert torch.equal(vp, ours_v[0])


def test_their_loaders_read_back_export_sglangs_specs_exactly(tmp_path):
    """Their loaders read export_sglang's files back as every layer's mu, R_K and R_V bit for
    bit; with folded=True R_V comes back as the identity; a file of one (d, d) rotation per
    layer (their V1 format) is expanded per head."""
    model, kv = served_model()
    c = model.cfg
    k_path, v_path, mu_path = exported(tmp_path, kv, c)
    back = sglang_specs(k_path, v_path, c, mu_path)
    for a, b in zip(kv, back):
        assert torch.equal(a.k_mean, b.k_mean) and torch.equal(a.r_k, b.r_k) and torch.equal(a.r_v, b.r_v)
    k_path, v_path, _ = exported(tmp_path, kv, c, folded=True, name="folded")
    assert all(torch.equal(s.r_v, torch.eye(16).expand(2, 16, 16)) and s.k_mean is None
               for s in sglang_specs(k_path, v_path, c))
    R = random_orthogonal(16, seed=9)
    torch.save({"layers": {str(l): {"rotation": R} for l in range(c.n_layers)}}, tmp_path / "v1.pt")
    assert all(torch.equal(s.r_k, R.expand(2, 16, 16)) for s in sglang_specs(tmp_path / "v1.pt", v_path, c))


def test_the_v_file_matches_the_weights_it_is_served_with(tmp_path):
    """Served by their engine (the oracle: INT2 everywhere), the original weights with R_V in
    the V file and our folded weights (export_hf) with the identity there both give optr's
    simulated INT2 outputs; our folded weights with R_V in the file rotate V twice."""
    model, kv = served_model("llama")
    c = model.cfg
    files = lambda folded, name: (sglang_rotations(exported(tmp_path, kv, c, folded, name)[0], 2, 16, 2),
                                  sglang_rotations(str(tmp_path / name / "v_rotation.pt"), 2, 16, 2),
                                  sglang_k_means(str(tmp_path / name / "k_mean.pt"), 2, 16))
    ours = model(IDX, optr.SimulatedINT2(kv, replace(c, sink=0, window=0)))
    folded = optr.fold_value_rotation(model, kv)
    original = model(IDX, engine_attention(files(False, "orig"), c))
    served_folded = folded(IDX, engine_attention(files(True, "fold"), c))
    twice = folded(IDX, engine_attention(files(False, "orig"), c))
    assert torch.allclose(original, ours, atol=1e-3) and torch.allclose(served_folded, ours, atol=1e-3)
    assert (twice - ours).abs().max() > 0.1


def _kv_with(kv, l, **change):
    return [replace(s, **change) if i == l else s for i, s in enumerate(kv)]


@pytest.mark.parametrize("change,kv_change,match", [
    (dict(group_size=8), {}, "group_size 8 != head_dim 16"),
    (dict(sink=4), {}, "sink 4 and window 8: expected multiples of 8"),
    (dict(window=12), {}, "window 12: expected multiples of 8"),
    (dict(head_dim=24, group_size=24, d_model=24), {}, "head_dim 24: expected a power of two"),
    (dict(scale_eps=1e-6), {}, "scale_eps"),
    ({}, dict(quant_v=False), r"kv\[1\]: keys or values kept exact, but the engine stores every layer in INT2"),
])
def test_export_sglang_refuses_what_their_engine_cannot_serve_as_calibrated(tmp_path, change, kv_change, match):
    """G != d (per-row clip), windows that are not multiples of 8, d not a power of two, an
    epsilon other than theirs, or a layer left in full precision: a ValueError naming it."""
    model, kv = served_model()
    cfg = replace(model.cfg, **change)
    kv = orthogonal_specs(cfg) if "head_dim" in change else kv
    with pytest.raises(ValueError, match=match):
        export_sglang(_kv_with(kv, 1, **kv_change) if kv_change else kv, cfg, str(tmp_path))


@pytest.mark.parametrize("side", ["clip_k", "clip_v"])
def test_export_sglang_refuses_a_layer_clip_of_its_own_on_either_side(side):
    """The engine clips every layer at serve.env's one c_K and c_V: a layer with a clip of its
    own on either side is a ValueError naming the layer."""
    model, kv = served_model("qwen2")
    with pytest.raises(ValueError, match=r"kv\[1\]: clips of its own"):
        export_sglang(_kv_with(kv, 1, **{side: 0.8}), model.cfg, "/nonexistent/never-written")


def test_export_sglang_refuses_gemma3s_exact_sliding_layers_and_names_the_fix(tmp_path):
    """calibrate_hf leaves Gemma 3's sliding layers exact, and the authors' engine stores every
    layer in INT2: export_sglang refuses, naming the first such layer and calibrate_hf(...,
    sliding=True); that calibration (sequences within the 12-token slide) exports, and
    their loaders read back its R_K, R_V and mu."""
    model = tiny_gemma3()
    cfg = optr.hf_config(model.config, sink=0, window=8, steps=6, eval_every=2, n_loss_queries=16)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(11))
    cal, held = ids[:, :GEMMA_SLIDING], ids[:, GEMMA_SLIDING:]
    kv, _ = ladder.calibrate_hf(model, cal, held, cfg, learn=False)
    with pytest.raises(ValueError, match=r"kv\[0\]: keys or values kept exact.*calibrate_hf\(\.\.\., sliding=True\)"):
        export_sglang(kv, cfg, str(tmp_path / "default"))
    kv, _ = ladder.calibrate_hf(model, cal, held, cfg, learn=False, sliding=True)
    k_path, v_path, mu_path = exported(tmp_path, kv, cfg)
    for a, b in zip(kv, sglang_specs(k_path, v_path, cfg, mu_path)):
        assert torch.equal(a.r_k, b.r_k) and torch.equal(a.r_v, b.r_v) and torch.equal(a.k_mean, b.k_mean)


def test_the_command_line_exports_a_rotation_files_variant_as_its_specs(tmp_path, transformers_twin):
    """python -m tools.sglang FILE OUT writes the file's quarot+optr (the paper's; --variant NAME another),
    which their loaders read back as its specs; from export_hf's directory (R_V folded into the
    weights) the V file is the identity."""
    model, kv = served_model("llama")
    other = orthogonal_specs(model.cfg, seed=50)
    optr.save_kv_rotations(str(tmp_path / "r.safetensors"), {"oscar+optr": other, "quarot+optr": kv},
                           model.cfg)
    d = sglang.main([str(tmp_path / "r.safetensors"), str(tmp_path / "a")])
    back = sglang_specs(*(os.path.join(d, f) for f in ("k_rotation.pt", "v_rotation.pt")), model.cfg,
                        os.path.join(d, "k_mean.pt"))
    for a, b in zip(kv, back):
        assert torch.equal(a.r_k, b.r_k) and torch.equal(a.r_v, b.r_v) and torch.equal(a.k_mean, b.k_mean)
    optr.export_hf(transformers_twin(model), kv, str(tmp_path / "hf"), cfg=model.cfg)
    d = sglang.main([str(tmp_path / "hf"), str(tmp_path / "b"), "--variant", "optr"])
    v_file = sglang_rotations(os.path.join(d, "v_rotation.pt"), 2, 16, 2)
    assert torch.equal(v_file, torch.eye(16).expand(2, 2, 16, 16))


def test_the_command_line_refuses_the_recommended_recipe_naming_its_clips(tmp_path):
    """The README's recipe, quarot+center+clip, has clips of its own per layer (the engine has one c_K,
    c_V): the command line refuses it with a ValueError naming the clips; a variant the file lacks
    is refused naming the ones it has."""
    with pytest.raises(ValueError, match=r"kv\[0\]: clips of its own"):
        sglang.main([str(ROOT / "rotations" / "smollm2"), str(tmp_path), "--variant", "quarot+center+clip"])
    with pytest.raises(ValueError, match="expected one of"):
        sglang.main([str(ROOT / "rotations" / "smollm2"), str(tmp_path), "--variant", "oscar"])


@pytest.mark.slow
def test_the_readmes_serving_elsewhere_snippet_runs_and_generates_our_tokens(tmp_path):
    """The README's "Serving elsewhere" code runs as written, its paths made absolute and its export
    in a temporary folder (SmolLM2 from its wheel through
    transformers alone, its published rotations, the recommended quarot+center+clip): greedy generate()
    through hf_cache, the prompt past the sink and recent window, gives the tokens of greedy decoding
    through simulate_hf (the whole sequence each token, the prompt one forward), and its
    default decode on a CPU (the compiled one) the tokens of the torch reference's; the exported checkpoint reads back with R_V
    folded, and the SGLang files of the paper's quarot+optr as its specs.
    Optr against optr: hf_cache against simulate_hf."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Serving elsewhere.*?```python\n(.*?)```", text, re.S).group(1)
    assert code.count('"runs/served') == 2 and code.count('"README.md"') == 1
    env = {}
    exec(code.replace('"rotations/', f'"{ROOT}/rotations/').replace('"README.md"', f'"{ROOT}/README.md"')
         .replace('"runs/served', f'"{tmp_path / "x"}'), env)
    hf, prompt, spec, cfg = env["hf"], env["prompt"], env["spec"], env["cfg"]
    assert prompt.shape[1] > cfg.sink + cfg.window, prompt.shape                # the prompt reaches INT2
    x = prompt
    for _ in range(8):
        with torch.no_grad(), ladder.simulate_hf(hf, spec, cfg, chunks=(prompt.shape[1],)):
            x = torch.cat([x, hf(x, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert env["ids"].tolist() == x.tolist()
    with torch.no_grad():                                  # the compiled decode's tokens are the reference's
        with optr.hf_cache(hf, spec, cfg, attend=optr.paged_decode_reference) as cache:
            ref = hf.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert env["ids"].tolist() == ref.tolist()
    d = tmp_path / "x" / "sglang"                          # the paper's variant, for the original weights
    back = sglang_specs(d / "k_rotation.pt", d / "v_rotation.pt", cfg, d / "k_mean.pt")
    for a, b in zip(back, env["kv"]["quarot+optr"]):
        assert torch.equal(a.r_k, b.r_k) and torch.equal(a.k_mean, b.k_mean) and torch.equal(a.r_v, b.r_v)
    assert optr.load_kv_rotations(tmp_path / "x")[1]["r_v_folded"]["optr"]
