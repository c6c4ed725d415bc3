"""
The authors' SGLang engine (engine/sglang-research of daniel-eai/Output-Aware-INT2-KV-Cache-Quantization)
serves a variant of a rotation file: its k_rotation.pt, v_rotation.pt, k_mean.pt and serve.env.

    python -m tools.sglang rotations/smollm2 OUT                  # quarot+optr, the paper's
    python -m tools.sglang runs/llm/kv_rotations.safetensors OUT --variant oscar+optr

or from Python: `from tools.sglang import export_sglang`. Imports optr (ladder for the command line's errors).
"""
from __future__ import annotations

import argparse
import os

import torch

import optr


def export_sglang(kv: list, cfg: optr.Config, out_dir: str, folded: bool = False) -> str:
    """The authors' SGLang fork (engine/sglang-research) files in out_dir: k_rotation.pt, v_rotation.pt (R_V
    for the original weights; the identity with folded=True, beside export_hf's), k_mean.pt if it centers,
    serve.env (flags, environment). Their torch.save dicts hold optr's orientation and packing; the engine
    folds R_V into v_proj only, clips per row, moves tokens 8 at a time, needs d = 2^n."""
    L, H, d, G = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.group_size
    for ok, msg in [(G == d, f"group_size {G} != head_dim {d} (the engine clips per row)"),
                    (cfg.sink % 8 == cfg.window % 8 == 0,
                     f"sink {cfg.sink} and window {cfg.window}: expected multiples of 8"),
                    (d & (d - 1) == 0, f"head_dim {d}: expected a power of two"),
                    (cfg.scale_eps == 1e-8, f"scale_eps {cfg.scale_eps}: the engine's is 1e-8"),
                    (len(kv) == L, f"kv: expected {L} layers, got {len(kv)}")] + [
            (s.quant_k and s.quant_v, f"kv[{l}]: keys or values kept exact, but the engine stores every layer "
             "in INT2: give every layer INT2 specs (sliding layers: ladder.calibrate_hf(..., sliding=True))")
            for l, s in enumerate(kv)] + [
            (s.clip_k in (None, cfg.clip_k) and s.clip_v in (None, cfg.clip_v), f"kv[{l}]: clips of its own "
             f"(c_K {s.clip_k}, c_V {s.clip_v}; appendix D), but the engine clips every layer at cfg's: use a "
             "variant without them") for l, s in enumerate(kv)]:
        optr.need(ok, f"export_sglang: {msg}")
    os.makedirs(out_dir, exist_ok=True)
    eye = torch.eye(d).expand(H, d, d)
    f32 = lambda t, default: (default if t is None else t).detach().float().cpu().contiguous().clone()
    for side, Rs in (("k", [s.r_k for s in kv]), ("v", [None if folded else s.r_v for s in kv])):
        torch.save({"format_version": 2, "objective": f"optr_output_aware_{side}",
                    "source_grouping": "kv_head", "layers": {l: {"layer_id": l, "rotation":
                    f32(R, eye)} for l, R in enumerate(Rs)}}, os.path.join(out_dir, f"{side}_rotation.pt"))
    center = any(s.k_mean is not None for s in kv)
    if center:                                      # a layer without mu gets mu = 0
        torch.save({"format_version": 1, "layers": {l: {"layer_id": l, "mu": f32(s.k_mean,
                    torch.zeros(H, d))} for l, s in enumerate(kv)}}, os.path.join(out_dir, "k_mean.pt"))
    p = os.path.abspath(out_dir)
    env = dict(SGLANG_ENABLE_MIXED_KV_WINDOWS=1, SGLANG_OSCAR_ABSORB_V_ROTATION=1,
               SGLANG_MIXED_KV_PREFIX_TOKENS=cfg.sink, SGLANG_MIXED_KV_RECENT_TOKENS=cfg.window,
               SGLANG_MIXED_KV_HP_DTYPE="bfloat16", SGLANG_MIXED_KV_SCALE_DTYPE="float32",
               SGLANG_OSCAR_K_ROTATION_PATH=f"{p}/k_rotation.pt", SGLANG_OSCAR_V_ROTATION_PATH=f"{p}/v_rotation.pt",
               SGLANG_OSCAR_K_CLIP_RATIO=cfg.clip_k, SGLANG_OSCAR_V_CLIP_RATIO=cfg.clip_v,
               SGLANG_OSCAR_K_MEAN_IN_POOL=int(center), SGLANG_OSCAR_K_MEAN_PATH=f"{p}/k_mean.pt" if center else "")
    with open(os.path.join(out_dir, "serve.env"), "w") as f:
        f.write(f"# source this, then python -m sglang.launch_server --model-path MODEL $SGLANG_SERVER_ARGS"
                f"\n# MODEL: {'optr.export_hf' if folded else 'the original'} checkpoint\nSGLANG_SERVER_ARGS="
                f'"--kv-cache-dtype int2 --kv-cache-quant-group-size {G} --page-size 8"\n'
                + "".join(f"export {k}={v}\n" for k, v in env.items()))
    return out_dir


def main(argv=None) -> str:
    """The command line: a rotation file (or its directory), an output directory, a variant."""
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("rotations", help="kv_rotations.safetensors, or a directory holding one (rotations/MODEL)")
    p.add_argument("out", help="directory for k_rotation.pt, v_rotation.pt, k_mean.pt, serve.env")
    p.add_argument("--variant", default="quarot+optr", help="a variant of the file without clips of its own "
                   "(default quarot+optr)")
    args = p.parse_args(argv)
    kv, info = optr.load_kv_rotations(args.rotations)
    optr.need(args.variant in kv, f"variant: expected one of {list(kv)}, got {args.variant!r}")
    H, d = info["n_kv_heads"], info["head_dim"]
    cfg = optr.Config(n_layers=info["n_layers"], n_heads=H, n_kv_heads=H, head_dim=d, **info["settings"])
    out = export_sglang(kv[args.variant], cfg, args.out)          # a variant folded into weights: no r_v
    print(f"{args.variant} of {args.rotations} -> {out} (source serve.env, then launch SGLang)")
    return out


if __name__ == "__main__":
    import ladder
    ladder.run_cli(main)
