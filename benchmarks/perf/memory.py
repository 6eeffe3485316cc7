"""Peak memory and step time of the real-model recipe's training steps under each memory setting of issue
69's table (`VARIANTS`: the default; the default before lean activations; micro-batches of 16 and 8 rows;
token budgets; activation checkpointing; both; the mapped heap beside glibc's), side by side in one run,
each beside its memory plan (`stare train --dry-run`, stare_cli/backends/memory_plan.py) at the lengths the
run had.

Each variant is `--steps` `stare train` steps of recipes/small/smollm2-135m-words.yaml (rollout, old
log-probs, update; no evaluation) in a child process of its own, so that its peak resident set is its own
(`os.wait4`'s ru_maxrss). Two steps by default: the optimizer's state exists from the first update on, so
the second step is the steady state the plan describes. Variants alternate (A B C A B C ...) so that a
slow spell of a shared machine hits all alike. Printed per variant: peak RSS, the plan's peak and their
ratio, `time/train` (old log-probs + update, mean over the steps), medians over the repetitions, and the
ratios to the first variant.

    python benchmarks/perf/memory.py [--reps 1] [--steps 2] [--recipe small/smollm2-135m-words] [--only VARIANT]

Needs the real model (`stare model get smollm2-135m`). One torch thread. Run it alone: about 5 minutes per
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

# name -> overrides on top of the recipe (issue 69's table). The first is the shipped default; the ratios
# are to the second, the default before lean activations (autograd's own saved tensors). The heap is glibc's
# unless a variant maps it (backend.embedded.heap: 'auto' is glibc's).
VARIANTS = {
    "default": [],
    "before: autograd's saved tensors": ["backend.embedded.lean_activations=false"],
    "default, mapped heap": ["backend.embedded.heap=mapped"],
    "micro_batch_size=16": ["optim.micro_batch_size=16"],
    "micro_batch_size=8": ["optim.micro_batch_size=8"],
    "micro_batch_size=16, mapped heap": ["optim.micro_batch_size=16", "backend.embedded.heap=mapped"],
    "micro_batch_size=8, mapped heap": ["optim.micro_batch_size=8", "backend.embedded.heap=mapped"],
    "micro_batch_tokens=1600": ["optim.micro_batch_tokens=1600"],
    "micro_batch_tokens=800": ["optim.micro_batch_tokens=800"],
    "activation checkpointing": ["backend.embedded.activation_checkpointing=true"],
    "checkpointing + tokens=1600": ["backend.embedded.activation_checkpointing=true", "optim.micro_batch_tokens=1600"],
}
BASE = "before: autograd's saved tensors"


def one_step(recipe: str, overrides: list[str], out: Path, steps: int) -> dict:
    """`steps` training steps in a child process: its peak RSS (GiB), its steps' timings, the lengths."""
    cmd = [sys.executable, "-m", "stare_cli", "train", "--recipe", recipe, "--out", str(out),
           "-o", f"optim.total_steps={steps}", "-o", "eval.benchmarks=[]"]
    for o in overrides:
        cmd += ["-o", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    output = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{output[-2000:]}")
    run_dir = Path(output.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"rss_gib": usage.ru_maxrss * 1024 / 2**30, "train_s": statistics.fmean(r["time/train"] for r in rows),
            "step_s": statistics.fmean(r["time/step"] for r in rows), "entropy": rows[-1]["entropy"],
            "grad_norm": rows[-1]["grad_norm"], "micro_batches": rows[-1]["micro_batches"],
            "response_len": max(r["len/mean"] for r in rows)}


def mean_prompt_tokens(recipe: str, k: int = 64) -> float:
    """Mean tokens of the recipe's first k training prompts as the trainer builds them (template, chat)."""
    from benchmarks.data.models import resolve_model_path
    from stare_cli.backends.memory_plan import mean_prompt_tokens as mean_of
    from stare_cli.core.resolve import load_recipe

    cfg = load_recipe(recipe, None, [])
    return mean_of(cfg, resolve_model_path(cfg.model.path), k)[0]


def planned(recipe: str, overrides: list[str], prompt_len: float, response_len: float) -> float:
    """The memory plan's peak (GiB) for the variant at the lengths its run had, in a fresh process."""
    code = ("import json, sys\n"
            "from benchmarks.data.models import resolve_model_path\n"
            "from stare_cli.backends.memory_plan import plan\n"
            "from stare_cli.core.resolve import load_recipe\n"
            "cfg = load_recipe(sys.argv[1], None, json.loads(sys.argv[2]))\n"
            "p = plan(cfg, resolve_model_path(cfg.model.path), prompt_tokens=int(sys.argv[3]),"
            " response_tokens=int(sys.argv[4]))\n"
            "print(p.peak / 2**30)\n")
    r = subprocess.run([sys.executable, "-c", code, recipe, json.dumps(overrides), str(round(prompt_len)),
                        str(round(response_len))], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--recipe", default="small/smollm2-135m-words")
    ap.add_argument("--prompt-len", type=float, default=None,
                    help="prompt tokens for the plan (default: the mean of the recipe's first 64 prompts)")
    ap.add_argument("--only", action="append", default=[], metavar="VARIANT",
                    help="run only these variants (repeatable; the first, 'default', and the ratios' base always run)")
    args = ap.parse_args()
    unknown = [v for v in args.only if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; variants: {', '.join(VARIANTS)}")
    chosen = {k: v for k, v in VARIANTS.items() if not args.only or k in ("default", BASE, *args.only)}
    plen = args.prompt_len or mean_prompt_tokens(args.recipe)
    results: dict[str, list[dict]] = {k: [] for k in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for i, (name, ov) in enumerate(chosen.items()):
                r = one_step(args.recipe, ov, Path(tmp) / f"{rep}-{i}", args.steps)
                r["plan_gib"] = planned(args.recipe, ov, plen, r["response_len"])
                results[name].append(r)
                print(f"rep {rep + 1}: {name}: peak RSS {r['rss_gib']:.2f} GiB (plan {r['plan_gib']:.2f}, "
                      f"prompt {plen:.1f} / response {r['response_len']:.1f} tokens), train {r['train_s']:.1f} s/step, "
                      f"step {r['step_s']:.1f} s, {r['micro_batches']} micro-batches, entropy {r['entropy']:.6f}, "
                      f"grad_norm {r['grad_norm']:.6f}", flush=True)
    base = BASE
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("rss_gib", "plan_gib", "train_s", "step_s")}
           for k, v in results.items()}
    print(f"\nmedians over {args.reps} repetition(s) of {args.steps} steps; ratios to '{base}'")
    print(f"{'variant':48s} {'peak RSS':>9s} {'plan':>7s} {'plan/RSS':>8s} {'ratio':>6s} {'train s':>8s} {'ratio':>6s} "
          f"{'step s':>7s} {'ratio':>6s}")
    b = med[base]
    for k, m in med.items():
        print(f"{k:48s} {m['rss_gib']:7.2f}G {m['plan_gib']:6.2f}G {m['plan_gib'] / m['rss_gib']:8.2f} "
              f"{m['rss_gib'] / b['rss_gib']:6.2f} {m['train_s']:8.1f} {m['train_s'] / b['train_s']:6.2f} "
              f"{m['step_s']:7.1f} {m['step_s'] / b['step_s']:6.2f}")
    d = med["default"]
    print(f"target, default: peak <= 6 GiB {'met' if d['rss_gib'] <= 6 else 'missed'} ({d['rss_gib']:.2f}) at <= 1.1x "
          f"the time before {'met' if d['train_s'] <= 1.1 * b['train_s'] else 'missed'} ({d['train_s'] / b['train_s']:.2f}x)")
    for k, m in med.items():
        if k in (base, "default"):
            continue
        print(f"target, {k}: peak <= 4 GiB {'met' if m['rss_gib'] <= 4 else 'missed'} ({m['rss_gib']:.2f}) at <= 1.4x "
              f"{'met' if m['train_s'] <= 1.4 * b['train_s'] else 'missed'} ({m['train_s'] / b['train_s']:.2f}x)")
    for k, m in med.items():
        err = m["plan_gib"] / m["rss_gib"] - 1
        print(f"plan error, {k}: {err:+.0%} ({'within' if abs(err) <= 0.15 else 'outside'} 15%)")


if __name__ == "__main__":
    main()
