"""`stare demo`: GRPO-ds and STARE-O1 on the CPU toy under one recipe and the same seeds, side by side.

A preset of `stare sweep` (stare_cli/analysis/sweep.py): the two methods x the given seeds, two cells at a
time with one torch thread each (the machine has two cores), resumable by running it again. Then a
table of the Fig. 3 numbers per method and seed (stdout), the comparison table and the
training-dynamics plot in the sweep directory.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

from stare_kernel.errors import StareError, table_console
from stare_cli.core.runs import read_jsonl
from stare_cli.analysis.sweep import SweepSpec, dynamics_summary, run_sweep

DEMO_RECIPE = "tiny/arith"
DEMO_METHODS = ("grpo-ds", "stare-o1")


def run_demo(out: Path, steps: Optional[int] = None, seeds: list[int] = (1,), methods=DEMO_METHODS,
             overrides: Optional[list[str]] = None, parallel: int = 2) -> dict:
    """Run the demo sweep; print the per-seed table (and the over-seeds table for several seeds).
    Returns {seed: {method: summary}} (also written to demo.json)."""
    from rich.console import Console
    from rich.table import Table

    from stare_cli.core.resolve import load_recipe
    from benchmarks.data.toy import ensure_toy_model

    base = [*(overrides or []), *([f"optim.total_steps={steps}"] if steps else [])]
    cfg = load_recipe(DEMO_RECIPE, methods[0], base)
    t0 = time.time()
    ensure_toy_model("arith")  # once, before the parallel cells share it
    spec = SweepSpec(recipe=DEMO_RECIPE, methods=tuple(methods), seeds=tuple(seeds), overrides=tuple(base))
    res = run_sweep(spec, out, parallel=parallel, threads=1)
    if res.failed:
        c = res.failed[0]
        raise StareError(f"demo: training {c.name} failed: {c.error}", hint=f"see {out / 'logs' / (c.name + '.log')}")
    h_tgt = cfg.method.stare.h_tgt
    summ: dict[int, dict[str, dict]] = {}
    for c in res.cells:
        summ.setdefault(c.seed, {})[c.method] = dynamics_summary(read_jsonl(Path(c.run_dir) / "metrics.jsonl"), h_tgt)
    for s in seeds:
        t = Table(title=f"STARE demo on the CPU toy (seed {s}, {cfg.optim.total_steps} steps, H_tgt {h_tgt:g}, "
                        f"W {cfg.method.stare.W:g}, P {cfg.method.stare.P:g})")
        for col in ("method", "eval acc", "entropy start", "entropy end", "2nd-half band", "2nd-half trend /100 steps",
                    "gate on"):
            t.add_column(col)
        for m in methods:
            x = summ[s][m]
            acc = "–" if x.get("eval_acc") is None else f"{x['eval_acc']:.3f}"
            t.add_row(m, acc, f"{x['entropy_start']:.3f}", f"{x['entropy_end']:.3f}",
                      f"[{x['entropy_2nd_half_min']:.3f}, {x['entropy_2nd_half_max']:.3f}]",
                      f"{x['slope_2nd_half_per_100']:+.3f}", f"{100 * x['gate_on_share']:.0f}%")
        table_console().print(t)
    if len(seeds) > 1:
        table = seeds_table([{"seed": s, "summary": summ[s]} for s in seeds])
        (out / "seeds.md").write_text(table)
        print(table)
    for line in verdicts(summ, h_tgt):
        print(line)
    print(f"plots: {', '.join(res.plots)}")
    print(f"runs: {', '.join(c.run_dir for c in res.cells)}")
    print(f"time: {time.time() - t0:.0f} s (sweep directory {out})")
    (out / "demo.json").write_text(json.dumps({str(s): v for s, v in summ.items()}, indent=2))
    return summ


# The demo's claims (the paper's Fig. 3 on the toy), each checked per seed from the run's numbers.
FLAT = 0.01  # |trend| per 100 steps under which the entropy counts as not moving
BAND = 0.03  # STARE-O1 holds the entropy within this of H_tgt (second-half mean)


def verdicts(summ: dict[int, dict[str, dict]], h_tgt: float) -> list[str]:
    """One line per claim: how many seeds show it, and which."""
    claims = [
        ("GRPO-ds: entropy ends below H_tgt and is still falling",
         lambda s: s["grpo-ds"]["entropy_end"] < h_tgt and s["grpo-ds"]["slope_2nd_half_per_100"] < -FLAT),
        (f"STARE-O1: entropy held within {BAND} of H_tgt over the second half, not falling",
         lambda s: abs(s["stare-o1"]["entropy_2nd_half_mean"] - h_tgt) <= BAND
         and s["stare-o1"]["slope_2nd_half_per_100"] >= -FLAT),
        ("STARE-O1 ends with more entropy than GRPO-ds",
         lambda s: s["stare-o1"]["entropy_end"] > s["grpo-ds"]["entropy_end"]),
    ]
    out = []
    seeds = sorted(summ)
    for text, holds in claims:
        yes = [s for s in seeds if {"grpo-ds", "stare-o1"} <= set(summ[s]) and holds(summ[s])]
        out.append(f"verdict: {text}: {len(yes)}/{len(seeds)} seeds" + (f" ({', '.join(map(str, yes))})" if yes else ""))
    return out


def seeds_table(results: list[dict]) -> str:
    """A Markdown table over several demo results (one per seed): the Fig. 3 numbers per method."""
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
