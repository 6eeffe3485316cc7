"""Grading throughput: the process pool (`Grader`) against plain sequential math-verify calls, on
a realistic set of long responses, measured side by side in one run; then a pathological set that
must finish within its time limits.

    python benchmarks/perf/grading.py [--n 2000 --workers 2 --data ../shared/data/benchmarks]

Responses: ~3k characters of reasoning ending in \\boxed{answer}, where the answer is the gold in
another surface form (so math-verify, not string equality, decides), right or off by one.
Goal (issue: evaluation): pool >= 1.8x sequential on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.grading import Grader, grade

FILLER = ("Let us consider the problem carefully. We expand the expression, collect like terms and "
          "verify each step; then we check the boundary cases and simplify. ")


def variant(gold: str, rng: random.Random) -> str:
    g = gold.strip().strip("$")
    if g.lstrip("-").isdigit():
        v = int(g) + (0 if rng.random() < 0.6 else 1)
        return f"{v}.0"
    return " ".join(g) if rng.random() < 0.5 else g.replace("\\frac", "\\dfrac") + " "


def realistic(n: int, data: Path, seed: int = 0) -> tuple[list[str], list[str]]:
    golds = []
    for f in sorted(data.glob("*.jsonl")):
        golds += [json.loads(x)["answer"] for x in f.read_text().splitlines()]
    rng = random.Random(seed)
    resp, gs = [], []
    for i in range(n):
        g = golds[i % len(golds)]
        body = FILLER * rng.randint(18, 26)
        resp.append(f"{body}\nTherefore the answer is \\boxed{{{variant(g, rng)}}}.")
        gs.append(g)
    return resp, gs


PATHOLOGICAL = [
    "\\boxed{9^{9^{9^{9}}}}", "\\boxed{10000!}", "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "z" * 100_000 + "\\boxed{2}", "\\boxed{{{{", "", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2].parent / "shared/data/benchmarks")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    resp, golds = realistic(args.n, args.data)
    times = {"sequential": [], "pool": []}
    correct = {}
    for _ in range(args.rounds):  # alternate so machine drift hits both alike
        t0 = time.perf_counter()
        seq = [grade(r, g) for r, g in zip(resp, golds)]
        times["sequential"].append(time.perf_counter() - t0)
        with Grader(workers=args.workers) as gr:  # a fresh cache each round: no free hits
            t0 = time.perf_counter()
            pool = gr.grade_many(resp, golds)
            times["pool"].append(time.perf_counter() - t0)
        correct = {"sequential": sum(v.correct for v in seq), "pool": sum(v.correct for v in pool)}
    best = {k: min(v) for k, v in times.items()}
    print(f"{args.n} responses (~{sum(map(len, resp)) // len(resp)} chars), {args.workers} workers, {args.rounds} rounds")
    for k, v in best.items():
        print(f"  {k:10s} {args.n / v:8.1f} responses/s  (best of {args.rounds}: {v:.2f} s)  correct {correct[k]}")
    print(f"ratio pool / sequential = {best['sequential'] / best['pool']:.2f}x (goal >= 1.8)")
    t0 = time.perf_counter()
    with Grader(workers=args.workers, timeout=5, hard_timeout=30) as gr:
        vs = gr.grade_many(PATHOLOGICAL, ["2"] * len(PATHOLOGICAL))
    dt = time.perf_counter() - t0
    print(f"pathological set: {len(vs)} graded in {dt:.1f} s; reasons: {[v.reason for v in vs]}")


if __name__ == "__main__":
    main()
