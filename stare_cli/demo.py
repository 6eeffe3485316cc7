"""`stare demo`: GRPO-ds and STARE-O1 on the CPU toy under one recipe and seed, side by side.

The two runs are separate `stare train` processes, one torch thread each, run at the same time
(the machine has two cores). Then a comparison table (stdout) and the training-dynamics plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from stare_cli.errors import StareError
from stare_cli.runs import read_jsonl

DEMO_RECIPE = "tiny/arith"
DEMO_METHODS = ("grpo-ds", "stare-o1")


def summarize(rows: list[dict], h_tgt: float) -> dict:
    """Numbers that say whether a run shows the Fig. 3 shape (entropy band over the second half)."""
    train = [r for r in rows if "entropy" in r]
    if not train:
        return {}
    ent = [r["entropy"] for r in train]
    half = ent[len(ent) // 2 :]
    tail = ent[-max(5, len(ent) // 5) :]
    xs = list(range(len(half)))
    mx, my = sum(xs) / len(xs), sum(half) / len(half)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, half)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    evals = [r for r in rows if any(k.startswith("eval/") and k.endswith("/acc") for k in r)]
    last_eval = evals[-1] if evals else {}
    acc = next((v for k, v in last_eval.items() if k.startswith("eval/") and k.endswith("/acc")), None)
    return {
        "steps": train[-1]["step"],
        "entropy_start": ent[0],
        "entropy_end": sum(tail) / len(tail),
        "entropy_2nd_half_min": min(half),
        "entropy_2nd_half_max": max(half),
        "entropy_2nd_half_mean": sum(half) / len(half),
        "slope_2nd_half_per_100": 100 * slope,  # least-squares trend of the entropy over the second half
        "still_falling": 100 * slope < -0.01,
        "gate_on_share": sum(r.get("stare/gate", 0.0) for r in train) / len(train),
        "eval_acc": acc,
        "train_reward_last": sum(r["reward"] for r in train[-10:]) / len(train[-10:]),
        "h_tgt": h_tgt,
    }


def run_demo(out: Path, steps: Optional[int] = None, seed: int = 1, methods=DEMO_METHODS,
             overrides: Optional[list[str]] = None) -> dict:
    from rich.console import Console
    from rich.table import Table

    from stare_cli.plots import plot_dynamics
    from stare_cli.method_layer import load_recipe
    from stare_cli.toy import ensure_toy_model

    err = Console(stderr=True)
    base = [f"optim.seed={seed}", *(overrides or [])]
    if steps:
        base.append(f"optim.total_steps={steps}")
    cfg = load_recipe(DEMO_RECIPE, methods[0], base)
    t_start = time.time()
    ensure_toy_model("arith")  # once, before the parallel runs share it
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    procs = {}
    t0 = time.time()
    for m in methods:
        cmd = [sys.executable, "-m", "stare_cli", "train", "--recipe", DEMO_RECIPE, "--method", m, "--out", str(out)]
        for o in base:
            cmd += ["-o", o]
        log = open(out / f"{m}.log", "w")
        procs[m] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env), log)
    err.print(f"[bold]demo[/]: training {', '.join(methods)} on the toy ({cfg.optim.total_steps} steps, seed {seed}); "
              f"logs in {out}/<method>.log")
    run_dirs = {}
    try:
        for m, (p, log) in procs.items():
            stdout, _ = p.communicate()
            log.close()
            if p.returncode != 0:
                tail = (out / f"{m}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise StareError(f"demo: training {m} failed (exit {p.returncode}): {tail[0]}",
                                 hint=f"see {out / (m + '.log')}")
            run_dirs[m] = Path(stdout.strip().splitlines()[-1])
    except KeyboardInterrupt:
        for p, _ in procs.values():
            p.terminate()
        raise
    elapsed = time.time() - t0
    rows = {m: read_jsonl(d / "metrics.jsonl") for m, d in run_dirs.items()}
    h_tgt = cfg.method.stare.h_tgt
    summ = {m: summarize(r, h_tgt) for m, r in rows.items()}
    plots = plot_dynamics({m: [r] for m, r in rows.items()}, out / "dynamics", h_tgt=h_tgt)

    t = Table(title=f"STARE demo on the CPU toy (seed {seed}, {cfg.optim.total_steps} steps, H_tgt {h_tgt:g}, "
                    f"W {cfg.method.stare.W:g}, P {cfg.method.stare.P:g})")
    for col in ("method", "eval acc", "entropy start", "entropy end", "2nd-half band", "2nd-half trend /100 steps",
                "gate on"):
        t.add_column(col)
    for m, s in summ.items():
        acc = "–" if s.get("eval_acc") is None else f"{s['eval_acc']:.3f}"
        t.add_row(m, acc, f"{s['entropy_start']:.3f}", f"{s['entropy_end']:.3f}",
                  f"[{s['entropy_2nd_half_min']:.3f}, {s['entropy_2nd_half_max']:.3f}]",
                  f"{s['slope_2nd_half_per_100']:+.3f}", f"{100 * s['gate_on_share']:.0f}%")
    Console().print(t)
    print(f"plots: {', '.join(str(p) for p in plots)}")
    total = time.time() - t_start
    print(f"runs: {', '.join(str(d) for d in run_dirs.values())}")
    print(f"time: {total:.0f} s in all ({total - elapsed:.0f} s toy warm-up or cache check, {elapsed:.0f} s training)")
    result = {"seed": seed, "elapsed_s": elapsed, "total_s": total, "runs": {m: str(d) for m, d in run_dirs.items()}, "summary": summ,
              "plots": [str(p) for p in plots]}
    (out / f"demo-seed{seed}.json").write_text(json.dumps(result, indent=2))
    return result


def seeds_table(results: list[dict]) -> str:
    """A Markdown table over several demo results (one per seed): the Fig. 3 numbers per method."""
    import statistics

    lines = ["| method | seed | eval acc | entropy start | entropy end | 2nd-half band | 2nd-half trend /100 steps | gate on |",
             "|---|---|---|---|---|---|---|---|"]
    methods = list(results[0]["summary"])
    for m in methods:
        for r in results:
            s = r["summary"][m]
            acc = "–" if s.get("eval_acc") is None else f"{s['eval_acc']:.3f}"
            lines.append(f"| {m} | {r['seed']} | {acc} | {s['entropy_start']:.3f} | {s['entropy_end']:.3f} | "
                         f"[{s['entropy_2nd_half_min']:.3f}, {s['entropy_2nd_half_max']:.3f}] | "
                         f"{s['slope_2nd_half_per_100']:+.3f} | {100 * s['gate_on_share']:.0f}% |")
        ss = [r["summary"][m] for r in results]
        mean = lambda k: statistics.fmean(x[k] for x in ss if x.get(k) is not None)  # noqa: E731
        sd = lambda k: statistics.stdev([x[k] for x in ss]) if len(ss) > 1 else 0.0  # noqa: E731
        lines.append(f"| **{m}** | all {len(ss)} | {mean('eval_acc'):.3f} ± {sd('eval_acc'):.3f} | "
                     f"{mean('entropy_start'):.3f} | {mean('entropy_end'):.3f} ± {sd('entropy_end'):.3f} | "
                     f"[{min(x['entropy_2nd_half_min'] for x in ss):.3f}, {max(x['entropy_2nd_half_max'] for x in ss):.3f}] | "
                     f"{mean('slope_2nd_half_per_100'):+.3f} | {100 * mean('gate_on_share'):.0f}% |")
    return "\n".join(lines) + "\n"
