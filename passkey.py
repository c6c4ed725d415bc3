"""
Passkey retrieval for eval_llm.py: the prompts, per-prompt scores, Wilson and Student t 95%
intervals, and the paired comparison of two variants on the same prompts.

    header  filler ... NEEDLE ... filler  question  answer
The needle ("The pass key is 71432. Remember it. 71432 is the pass key.") starts at a
filler-sentence boundary; over the prompts of one length its position is spread evenly
across the INT2 part of the cache as seen from the answer (after the sink, before the
recent window). One needle per prompt: this model retrieves one reliably in full
precision (SmolLM2), several in one prompt poorly. Greedy decoding returns the passkey iff the
argmax at every answer position equals the true token given the true tokens before it, so
one forward over prompt + answer scores a prompt exactly: `correct`, and a continuous
score, the mean log-probability of the true answer tokens.
Every variant reads the same prompts, so OptR and its base are compared in pairs: the
per-prompt difference OptR - base, its mean and a Student t 95% interval, per length and
pooled over the lengths. Proportions get Wilson 95% intervals.
"""

from __future__ import annotations

import math
import re

import torch

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


def passkey_prompts(tok, L: int, n: int, cfg, gen: torch.Generator):
    """n prompts (prompt + answer) of one length L' <= L: the header, whole filler
    sentences (PK_SENTENCES, cycled) with the needle between two of them, the question,
    the answer. As many whole sentences as fit in L tokens, so L' falls short of L by less
    than a sentence and no sentence breaks off before the question. Returns ids (n, L'), the
    number of answer tokens, and the needle's first position in each prompt."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    head, question = tok.encode(PK_HEADER).ids, enc(PK_QUESTION)      # the header after BOS if any
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
