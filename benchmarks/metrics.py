"""Metrics over n graded samples per problem: avg@n, unbiased pass@k, maj@k.

pass@k = 1 - C(n - c, k) / C(n, k) per problem (Chen et al. 2021), averaged over problems.
maj@k: majority vote over the extracted answers of the first k samples (ties: the answer seen
first), correct when that answer's samples were graded correct; averaged over problems.
"""

from __future__ import annotations

import re
from collections import Counter
from math import comb
from typing import Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with c correct of n samples."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """Powers of two up to n (and n itself)."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> bool:
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == best)
    return any(c for a, c in zip(answers, correct) if a == winner)


def benchmark_metrics(per_problem: list[dict]) -> dict[str, float]:
    """per_problem: [{'correct': [bool]*n, 'answers': [str|None]*n, 'lengths': [int]*n,
    'finished': [bool]*n, 'reflection': float}] -> metrics in percent (lengths in tokens)."""
    if not per_problem:
        return {}
    n = min(len(p["correct"]) for p in per_problem)
    out: dict[str, float] = {"n": n, "problems": len(per_problem)}
    out[f"avg@{n}"] = 100 * sum(sum(p["correct"][:n]) / n for p in per_problem) / len(per_problem)
    for k in ks_for(n):
        out[f"pass@{k}"] = 100 * sum(pass_at_k(n, sum(p["correct"][:n]), k) for p in per_problem) / len(per_problem)
        out[f"maj@{k}"] = 100 * sum(majority_correct(p["answers"][:k], p["correct"][:k]) for p in per_problem) / len(per_problem)
    lens = [x for p in per_problem for x in p["lengths"][:n]]
    fins = [x for p in per_problem for x in p["finished"][:n]]
    out["len/mean"] = sum(lens) / len(lens)
    out["truncated"] = 100 * (1 - sum(fins) / len(fins))
    out["reflection_rate"] = sum(p.get("reflection", 0.0) for p in per_problem) / len(per_problem)
    calls = [x for p in per_problem for x in p.get("tool_calls", [])[:n]]
    if calls:
        out["tool_calls"] = sum(calls) / len(calls)  # tool calls per response
    return out


REFLECTION_WORDS = ("wait", "verify", "check", "recheck", "however", "alternatively")


def reflection_rate(texts: Sequence[str], words: Sequence[str] = REFLECTION_WORDS) -> float:
    """Reflection words (whole words, any case) per 1,000 words of response text."""
    if not words:
        return 0.0
    pat = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    n_words = sum(len(t.split()) for t in texts)
    hits = sum(len(pat.findall(t)) for t in texts)
    return 1000.0 * hits / max(n_words, 1)
