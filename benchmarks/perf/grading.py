"""Grading throughput, measured side by side in one run (candidates alternate, fresh caches): our
process pool (`Grader`, our grader) against sequential grading in one process by our grader, by
plain math-verify (parse and verify the whole response) and by the official STARE three-way grader
(math-verify twice and mathruler); then a pathological set that must finish within its time limits.

    python benchmarks/perf/grading.py            # runs as is on a fresh clone
    python benchmarks/perf/grading.py --help     # options

Responses: ~3k characters of reasoning ending in \\boxed{answer}, where the answer is a gold answer
of the benchmark files (../shared/data/benchmarks when present, else the test fixtures) in another
surface form (so math-verify, not string equality, decides), right or off by one.
Goal: the pool >= 2x each sequential grader on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.grading.graders import GRADERS, Grader, grade

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "benchmarks"
FIXTURES = REPO / "tests" / "fixtures" / "benchmarks"

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
    ap = argparse.ArgumentParser(description="Grading throughput: our process pool vs sequential graders (see the "
                                 "module docstring).")
    ap.add_argument("--n", type=int, default=1000, help="responses graded by each candidate (default 1000)")
    ap.add_argument("--workers", type=int, default=2, help="processes of the pool (default 2)")
    ap.add_argument("--data", type=Path, default=SHARED if SHARED.exists() else FIXTURES,
                    help="folder of <benchmark>.jsonl files whose gold answers are used (default: ../shared's, "
                    "else the test fixtures)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each is reported")
    args = ap.parse_args()
    resp, golds = realistic(args.n, args.data)
    sequential = {
        "sequential (ours)": lambda r, g: grade(r, g),
        "sequential (plain math-verify)": GRADERS["math-verify-plain"].judge,
        "sequential (official three-way)": GRADERS["stare-official-3way"].judge,
    }
    times: dict[str, list[float]] = {"pool (ours)": [], **{k: [] for k in sequential}}
    correct: dict[str, int] = {}
    for _ in range(args.rounds):  # alternate so machine drift hits all alike
        with Grader(workers=args.workers) as gr:  # a fresh cache each round: no free hits
            t0 = time.perf_counter()
            pool = gr.grade_many(resp, golds)
            times["pool (ours)"].append(time.perf_counter() - t0)
        correct["pool (ours)"] = sum(v.correct for v in pool)
        for name, fn in sequential.items():
            t0 = time.perf_counter()
            vs = [fn(r, g) for r, g in zip(resp, golds)]
            times[name].append(time.perf_counter() - t0)
            correct[name] = sum(v.correct for v in vs)
    best = {k: min(v) for k, v in times.items()}
    print(f"{args.n} responses (~{sum(map(len, resp)) // len(resp)} chars, golds from {args.data}), "
          f"{args.workers} workers, {args.rounds} rounds")
    for k, v in best.items():
        print(f"  {k:34s} {args.n / v:8.1f} responses/s  (best of {args.rounds}: {v:.2f} s)  correct {correct[k]}")
    for k in sequential:
        print(f"ratio pool / {k.removeprefix('sequential ')} = {best[k] / best['pool (ours)']:.2f}x (goal >= 2)")
    t0 = time.perf_counter()
    with Grader(workers=args.workers, timeout=5, hard_timeout=30) as gr:
        vs = gr.grade_many(PATHOLOGICAL, ["2"] * len(PATHOLOGICAL))
    dt = time.perf_counter() - t0
    print(f"pathological set: {len(vs)} graded in {dt:.1f} s; reasons: {[v.reason for v in vs]}")


if __name__ == "__main__":
    main()
