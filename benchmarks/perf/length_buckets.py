"""Training forward+backward of one toy rollout batch: one padded forward vs length-sorted buckets
(`length_buckets`) at several per-bucket overheads, alternating in one run. Prints each setting's
median time and its ratio to the single forward; `BUCKET_OVERHEAD_TOKENS` in
stare_cli/backends/forward.py is chosen from this.

    python benchmarks/perf/length_buckets.py [--reps 7]

The batch is a real rollout of the warmed-up toy (16 prompts x 8 samples, at most 56 new tokens,
temperature 1), so the length spread is the one the trainer sees. One torch thread.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--overheads", default="0,64,128,256,1024")
    args = ap.parse_args()
    from benchmarks.perf._toy import toy_engine

    import stare_cli.backends.forward as E
    from benchmarks.generation.engines import SamplingParams
    from benchmarks.generation.templates import build_prompt
    from benchmarks.data.toy import problems

    model, tok, eng = toy_engine()
    prompts = [build_prompt(r["problem"], "raw", tok, False) for r in problems(16, seed=1000)]
    samples = [s for g in eng.generate(prompts, SamplingParams(n=8, max_new_tokens=56, seed=0)) for s in g]
    batch = E.pack(samples, tok.pad_token_id, "cpu")
    lens = batch["seq_len"].tolist()
    print(f"{len(samples)} rows, lengths {min(lens)}-{max(lens)} (mean {sum(lens) / len(lens):.1f})")
    model.train()

    def run(buckets: bool) -> float:
        t = time.perf_counter()
        lp, en = E.token_logprobs_entropy(model, batch, range(len(samples)), 1.0, buckets=buckets)
        ((lp + 0.01 * en) * batch["response_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    settings = [("one forward", None)] + [(f"buckets, overhead {o}", int(o)) for o in args.overheads.split(",")]
    times: dict[str, list[float]] = {name: [] for name, _ in settings}
    for rep in range(args.reps + 1):
        for name, o in settings:  # alternate settings, so drift on a shared machine hits all alike
            if o is not None:
                E.BUCKET_OVERHEAD_TOKENS = o
            dt = run(o is not None)
            if rep:  # the first round warms up
                times[name].append(dt)
    base = sorted(times["one forward"])[len(times["one forward"]) // 2]
    for name, o in settings:
        n_b = len(E.length_buckets(lens, o)) if o is not None else 1
        med = sorted(times[name])[len(times[name]) // 2]
        print(f"{name:24s} {n_b:3d} forwards  median {med * 1e3:6.1f} ms  speed-up {base / med:.2f}x")


if __name__ == "__main__":
    main()
