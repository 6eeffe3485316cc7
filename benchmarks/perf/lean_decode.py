"""The toy rollout with the lean decode step (benchmarks/generation/lean_decode.py) vs the model's own forward at
every decode step, alternating in one run on the same prompts and seeds. Prints each side's median
rollout time, their ratio, and whether the two sampled the same tokens with the same log-probs.

    python benchmarks/perf/lean_decode.py [--reps 12]

A rollout is the trainer's: the warmed-up toy, 16 prompts x 8 samples, at most 56 new tokens,
temperature 1, one torch thread. Times are CPU time of this process (steadier than wall time on a
shared machine; the rollout is single-threaded, so they are the same work).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    from benchmarks.perf._toy import toy_engine

    import benchmarks.generation.lean_decode as L
    from benchmarks.generation.engines import SamplingParams
    from benchmarks.data.toy import problems

    model, tok, eng = toy_engine(max_prompt_tokens=32)
    rows = problems(16 * (args.reps + 1), seed=5)
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=56, seed=1)
    lean = L.lean_decode_step
    if lean(model) is None:
        raise SystemExit("the lean step declines this model: nothing to compare")
    sides = {"model forward": lambda m: None, "lean step": lean}
    times: dict[str, list[float]] = {k: [] for k in sides}
    outs: dict[str, list] = {k: [] for k in sides}
    for rep in range(args.reps + 1):
        prompts = [r["problem"] + "\n" for r in rows[16 * rep:16 * rep + 16]]
        for name in (list(sides) if rep % 2 else list(sides)[::-1]):  # alternate: drift hits both alike
            L.lean_decode_step = sides[name]
            t = time.process_time()
            out = eng.generate(prompts, sp)
            dt = time.process_time() - t
            if rep:  # the first round warms up
                times[name].append(dt)
            outs[name].append([(s.response_ids, s.logprobs) for g in out for s in g])
    L.lean_decode_step = lean
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:14s} median rollout {v * 1e3:.0f} ms ({len(times[k])} rollouts)")
    tokens = sum(len(s[0]) for o in outs["lean step"] for s in o)
    print(f"lean step: {med['model forward'] / med['lean step']:.2f}x faster; same tokens and log-probs: "
          f"{outs['model forward'] == outs['lean step']} ({tokens} tokens)")


if __name__ == "__main__":
    main()
