"""Metrics over n graded samples per problem: avg@n, unbiased pass@k, maj@k.

pass@k = 1 - C(n - c, k) / C(n, k) per problem (Chen et al. 2021), averaged over problems.
maj@k: the expected accuracy of a majority vote over k of the n samples drawn without replacement,
as pass@k is an expectation over k of n (so maj@1 = avg@n, and maj@n is the vote of all n). In a
vote, answers the grader judges equal count as one (`same`; `\\frac{1}{2}`, `0.5` and `1/2` vote
together; ties: the answer seen first), and the vote is correct when that answer's samples were
graded correct. Exact over every k-subset up to 2,000 of them, else a seeded estimate over 1,000;
averaged over problems.
ci95/avg@n: a bootstrap 95% interval of avg@n over problems (1,000 resamples, seeded).
"""

from __future__ import annotations

import re
from itertools import combinations
from math import comb
import random
from typing import Callable, Optional, Sequence


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


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool],
                     same: Optional[Callable[[str, str], bool]] = None) -> bool:
    """Whether the most voted answer (answers `same` calls equal vote together; default: equal
    strings) was graded correct. Ties: the answer seen first."""
    groups: list[list[int]] = []  # sample indices per answer class, in order of first appearance
    for i, a in enumerate(answers):
        if a is None:
            continue
        for g in groups:
            rep = answers[g[0]]
            if a == rep or (same is not None and same(a, rep)):
                g.append(i)
                break
        else:
            groups.append([i])
    if not groups:
        return False
    best = max(groups, key=len)  # max keeps the first of equal sizes
    return any(correct[i] for i in best)


def answer_classes(answers: Sequence[Optional[str]], same: Optional[Callable[[str, str], bool]] = None
                   ) -> list[Optional[int]]:
    """A class id per sample (answers `same` calls equal share one; None: no answer), numbered in
    order of first appearance."""
    reps: list[str] = []
    out: list[Optional[int]] = []
    for a in answers:
        if a is None:
            out.append(None)
            continue
        for c, rep in enumerate(reps):
            if a == rep or (same is not None and same(a, rep)):
                out.append(c)
                break
        else:
            reps.append(a)
            out.append(len(reps) - 1)
    return out


MAJ_EXACT_SUBSETS = 2000
MAJ_SAMPLED_SUBSETS = 1000


def majority_at_k(classes: Sequence[Optional[int]], correct: Sequence[bool], k: int, seed: int = 0) -> float:
    """The expected correctness of a majority vote over k of the samples (see the module docstring)."""
    n = len(classes)
    if k > n:
        raise ValueError(f"maj@{k} needs at least {k} samples, got {n}")

    def vote(idx: Sequence[int]) -> bool:
        counts: dict[int, int] = {}
        first: dict[int, int] = {}
        for pos, i in enumerate(idx):
            c = classes[i]
            if c is not None:
                counts[c] = counts.get(c, 0) + 1
                first.setdefault(c, pos)
        if not counts:
            return False
        best = max(counts, key=lambda c: (counts[c], -first[c]))
        return any(correct[i] for i in idx if classes[i] == best)

    if comb(n, k) <= MAJ_EXACT_SUBSETS:
        subsets = list(combinations(range(n), k))
    else:
        rng = random.Random(seed * 1_000_003 + n * 1009 + k)
        subsets = [sorted(rng.sample(range(n), k)) for _ in range(MAJ_SAMPLED_SUBSETS)]
    return sum(vote(s) for s in subsets) / len(subsets)


def bootstrap_ci(values: Sequence[float], n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    k = len(values)
    means = sorted(sum(values[rng.randrange(k)] for _ in range(k)) / k for _ in range(n_boot))
    lo = means[int((1 - level) / 2 * n_boot)]
    hi = means[min(n_boot - 1, int((1 + level) / 2 * n_boot))]
    return (lo, hi)


def benchmark_metrics(per_problem: list[dict], same: Optional[Callable[[str, str], bool]] = None) -> dict:
    """per_problem: [{'correct': [bool]*n, 'answers': [str|None]*n, 'lengths': [int]*n,
    'finished': [bool]*n, 'reflection': float}] -> metrics in percent (lengths in tokens).
    `same`: answer equivalence for maj@k (default: equal strings)."""
    if not per_problem:
        return {}
    n = min(len(p["correct"]) for p in per_problem)
    out: dict = {"n": n, "problems": len(per_problem)}
    acc = [sum(p["correct"][:n]) / n for p in per_problem]
    out[f"avg@{n}"] = 100 * sum(acc) / len(acc)
    out[f"ci95/avg@{n}"] = [100 * x for x in bootstrap_ci(acc)]
    classes = [answer_classes(p["answers"][:n], same) for p in per_problem]
    for k in ks_for(n):
        out[f"pass@{k}"] = 100 * sum(pass_at_k(n, sum(p["correct"][:n]), k) for p in per_problem) / len(per_problem)
        out[f"maj@{k}"] = 100 * sum(majority_at_k(c, p["correct"][:n], k, seed=i)
                                    for i, (c, p) in enumerate(zip(classes, per_problem))) / len(per_problem)
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


# Student's t quantile t_{0.975, df} for df = 1 .. 30 (standard tables); beyond 30 the normal's 1.96 is within
# 2% of it (t_{0.975, 30} = 2.042).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


PERCENT = (0.0, 100.0)  # what a mean of percentages (pass@k, avg@k, maj@k) can take: `seed_interval`'s `within`
PERCENT_DIFFERENCE = (-100.0, 100.0)  # and a difference of two


def seed_interval(values: Sequence[float], within: Optional[tuple[float, float]] = None) -> tuple[float, float, str]:
    """An interval for the mean over seeds that is honest at small counts: (low, high, kind).

    Three or more seeds: the 95% Student-t interval mean +- t_{0.975, k-1} s / sqrt(k) ("t95"). Two seeds:
    their range (min, max) ("range"): a t-interval on one degree of freedom is 12.7 standard errors wide
    and a bootstrap of two values is just their range, so the range is shown as what it is. One: none.
    `within`: the range the mean can take (a percentage: (0, 100); a difference of two: (-100, 100)); the
    t-interval is cut to it, which drops only values the mean cannot have, so it covers the mean as often
    (pass@32 over seeds at 75, 100, 100 and 100 gives [73.9, 100] rather than [73.9, 113.6]).
    """
    k = len(values)
    if k < 2:
        raise ValueError("an interval over seeds needs at least two values")
    if k == 2:
        return (min(values), max(values), "range")
    m = sum(values) / k
    sd = (sum((v - m) ** 2 for v in values) / (k - 1)) ** 0.5
    t = _T975[k - 2] if k - 1 <= len(_T975) else 1.96
    half = t * sd / k**0.5
    lo, hi = m - half, m + half
    if within is not None:
        lo, hi = max(lo, within[0]), min(hi, within[1])
    return (lo, hi, "t95")
