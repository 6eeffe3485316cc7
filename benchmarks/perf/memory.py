"""Peak memory and step time of the real-model recipe's training step: the parent commit's path (the model's
full logits, the recipe's old micro-batching) vs the shipped one, side by side in one run (issue 45).

Each variant is one `stare train` step of recipes/small/smollm2-135m-words.yaml (its rollout, old log-probs,
update; no evaluation) in a child process of its own, so that its peak resident set is its own
(`os.wait4`'s ru_maxrss). Variants alternate (A B A B ...) so that a slow spell of a shared machine hits
both alike. Printed per variant: peak RSS, `time/train` (old log-probs + update) and `time/step`
(with the rollout), medians over the repetitions, and the ratios to the first variant.

    python benchmarks/perf/memory.py [--reps 2] [--recipe small/smollm2-135m-words]

Needs the real model (`stare model get smollm2-135m`). One torch thread. Run it alone: about 3 minutes per
child on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> overrides on top of the recipe. "today": the parent commit's training path (the model's own
# logits over the whole vocabulary, one micro-batch of 64 responses, no activation checkpointing).
VARIANTS = {
    "today (full logits, 1 micro-batch)": ["backend.embedded.lm_head=full", "optim.micro_batch_size=64",
                                           "optim.micro_batch_tokens=null",
                                           "backend.embedded.activation_checkpointing=false"],
    "chunked head, 1 micro-batch": ["backend.embedded.lm_head=chunked", "optim.micro_batch_size=64",
                                    "optim.micro_batch_tokens=null",
                                    "backend.embedded.activation_checkpointing=false"],
    "shipped recipe": [],
}


def one_step(recipe: str, overrides: list[str], out: Path) -> dict:
    """One training step in a child process: its peak RSS (GiB) and its step's timings."""
    cmd = [sys.executable, "-m", "stare_cli", "train", "--recipe", recipe, "--out", str(out),
           "-o", "optim.total_steps=1", "-o", "eval.benchmarks=[]"]
    for o in overrides:
        cmd += ["-o", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    output = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{output[-2000:]}")
    run_dir = Path(output.strip().splitlines()[-1])
    row = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
    return {"rss_gib": usage.ru_maxrss * 1024 / 2**30, "train_s": row["time/train"], "step_s": row["time/step"],
            "entropy": row["entropy"], "grad_norm": row["grad_norm"], "micro_batches": row["micro_batches"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--recipe", default="small/smollm2-135m-words")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, ov in VARIANTS.items():
                r = one_step(args.recipe, ov, Path(tmp) / f"{rep}-{len(results[name])}-{abs(hash(name))}")
                results[name].append(r)
                print(f"rep {rep + 1}: {name}: peak RSS {r['rss_gib']:.2f} GiB, train {r['train_s']:.1f} s, "
                      f"step {r['step_s']:.1f} s, {r['micro_batches']} micro-batches, entropy {r['entropy']:.6f}, "
                      f"grad_norm {r['grad_norm']:.6f}", flush=True)
    base = next(iter(VARIANTS))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("rss_gib", "train_s", "step_s")}
           for k, v in results.items()}
    print(f"\nmedians over {args.reps} repetitions; ratios to '{base}'")
    print(f"{'variant':40s} {'peak RSS':>10s} {'ratio':>6s} {'train s':>8s} {'ratio':>6s} {'step s':>7s} {'ratio':>6s}")
    for k, m in med.items():
        b = med[base]
        print(f"{k:40s} {m['rss_gib']:8.2f}G {m['rss_gib'] / b['rss_gib']:6.2f} {m['train_s']:8.1f} "
              f"{m['train_s'] / b['train_s']:6.2f} {m['step_s']:7.1f} {m['step_s'] / b['step_s']:6.2f}")
    shipped = med["shipped recipe"]
    print(f"\ntargets: peak RSS <= 3.5 GiB: {'met' if shipped['rss_gib'] <= 3.5 else 'missed'} "
          f"({shipped['rss_gib']:.2f}); train time <= 1.05x today's: "
          f"{'met' if shipped['train_s'] <= 1.05 * med[base]['train_s'] else 'missed'} "
          f"({shipped['train_s'] / med[base]['train_s']:.2f}x)")


if __name__ == "__main__":
    main()
