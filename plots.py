"""
eval_llm.py's plots (PNG, matplotlib's Agg backend): the paper's Figure 2 in small, per-channel
key mean and spread before and after centering, KL and passkey retrieval against context.
`model` is anything with TinyLM's cfg and o_proj_heads (eval_llm.HFModel, optr.TinyLM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import optr


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def pick_layer_head(stats: dict, cfg) -> tuple[int, int]:
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
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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
