"""The explore toy's two solution orders in a sweep's evaluations: `stare toy strategies DIR`.

Hard problems of the explore task (benchmarks/data/toy.py) are solved by the rare 'sub-first' order
and missed by the common 'add-first' one; these tables show how often each method takes each order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from stare_cli.analysis.sweep import SEED_INTERVALS, over_seeds_text, seeds_summary
from stare_kernel.errors import StareError
from stare_cli.core.runs import read_jsonl

_FIRST_STEP = re.compile(r"(\d+)\s*([+-])\s*(\d+)\s*=")


def explore_strategy(response: str) -> Optional[str]:
    """Which order a solution of the explore task takes: 'sub-first' (the rare one, right on hard
    problems), 'add-first' (the common one, which forgets the carry on hard problems), or None when
    no step `x+y=` / `x-y=` is written."""
    m = _FIRST_STEP.search(response)
    return None if m is None else ("add-first" if m.group(2) == "+" else "sub-first")


@dataclass
class StrategyShare:
    """How one evaluation's samples solve: the share taking each order and the accuracy within it."""

    samples: int
    sub_first: float  # share of samples
    add_first: float
    acc_sub_first: Optional[float]  # accuracy among sub-first samples (None without any)
    acc_add_first: Optional[float]


def strategy_share(rows: list[dict]) -> StrategyShare:
    """rows: one evaluation setting's sample rows (`samples.jsonl`: 'response', 'correct')."""
    by: dict[Optional[str], list[bool]] = {}
    for r in rows:
        by.setdefault(explore_strategy(r["response"]), []).append(bool(r["correct"]))
    n = len(rows)

    def acc(k: str) -> Optional[float]:
        return sum(by[k]) / len(by[k]) if by.get(k) else None

    return StrategyShare(n, len(by.get("sub-first", [])) / n if n else 0.0, len(by.get("add-first", [])) / n if n else 0.0,
                         acc("sub-first"), acc("add-first"))


def run_strategy_shares(run_dir: Path, bench: str = "toy:explore-hard") -> dict[str, StrategyShare]:
    """Every evaluation of `bench` in a run (in training, per step, and final ones), as
    '<step> n=<N>' -> StrategyShare, from each folder's settings (results/*.json) and samples."""
    from stare_kernel.reader import find_records

    out: dict[str, StrategyShare] = {}
    recs = find_records([run_dir / "eval"]).records if (run_dir / "eval").is_dir() else []
    for rec in sorted(recs, key=lambda r: r.written):  # through the one reader; a setting's newest record last
        if rec.identity["benchmark"] != bench or rec.folder is None:
            continue
        rows = read_jsonl(rec.folder / "samples.jsonl") if (rec.folder / "samples.jsonl").exists() else []
        mine = [r for r in rows if r.get("key") == rec.samples_key]
        if mine:
            out[f"{rec.folder.parent.name} n={rec.identity['n']}"] = strategy_share(mine)
    return out


def strategy_table(sweep_dir: Path, bench: str = "toy:explore-hard") -> str:
    """A Markdown table of a sweep's explore-task strategies: per method and evaluation, the share
    of sub-first samples and the accuracy within each order, mean ± std over seeds [95% interval]."""
    manifest = sweep_dir / "sweep.json"
    try:
        cells = json.loads(manifest.read_text())["cells"]
    except (OSError, ValueError, KeyError) as e:
        raise StareError(f"{manifest}: not a sweep manifest ({e})", hint="pass the directory `stare sweep` wrote") from None
    per: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        if not c.get("run_dir"):
            continue
        for key, s in run_strategy_shares(Path(c["run_dir"]), bench).items():
            per.setdefault((c["method"], key), []).append(
                {k: v for k, v in vars(s).items() if k != "samples" and v is not None})
    if not per:
        raise StareError(f"{sweep_dir}: no evaluation of {bench} with samples", hint=f"sweep with --eval {bench}")
    cols = ("sub_first", "acc_sub_first", "acc_add_first")
    lines = [f"Strategies on {bench} ({SEED_INTERVALS}; in %)", "",
             "| method | evaluation | seeds | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for (method, key), vals in sorted(per.items(), key=lambda kv: (kv[0][1].split()[1], kv[0][1], kv[0][0])):
        o = seeds_summary(vals, within=(0.0, 1.0))  # shares
        lines.append(f"| {method} | {key} | {len(vals)} | " + " | ".join(over_seeds_text(o.get(c), 1, 100) for c in cols) + " |")
    return "\n".join(lines) + "\n"
