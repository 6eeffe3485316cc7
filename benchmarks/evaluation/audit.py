"""`stare grade audit DIR`: several graders side by side on saved samples (no generation), one evaluation setting at a time.

Rule-based graders disagree on a share of answers (published audits find 10-20% of correct answers
missed by some of them). For every benchmark folder under DIR (a `stare eval` output) this grades
each saved sample with each grader and writes, under DIR/audit/:
- summary.json: per benchmark, the samples graded, each grader's accuracy, the share of samples on
  which all graders agree, and the agreement of every pair of graders;
- disagreements.jsonl: every sample on which the graders disagree (benchmark, problem, sample, gold,
  the end of the response, each grader's verdict and extracted answer), for a person to judge.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from benchmarks.grading.graders import Grader
from stare_cli.core.errors import StareError
from stare_cli.core.runs import atomic_write_text, read_jsonl

DEFAULT_GRADERS = ("math-verify", "math-verify-plain", "stare-official-3way", "mathruler")


def audit(folder: Path, graders: tuple[str, ...] = DEFAULT_GRADERS, workers: Optional[int] = None) -> dict:
    """Grade every saved sample under `folder` with every grader, one evaluation setting at a time (a
    benchmark folder can hold several: other n, limit, seed, model...; their samples are never pooled);
    returns the summary (also written). Each benchmark folder is locked while it is read, so a running
    evaluation is refused by name instead of being audited half-written."""
    import contextlib

    from benchmarks.evaluation.evaluate import _settings_by_key
    from stare_cli.core.runs import hold_run_lock

    folder = Path(folder)
    benches = [folder] if (folder / "samples.jsonl").exists() else sorted(p.parent for p in folder.glob("*/samples.jsonl"))
    if not benches:
        raise StareError(f"{folder}: no samples.jsonl here or in its subfolders", hint="point at a `stare eval` output")
    summary: dict[str, dict] = {}
    disagreements: list[dict] = []
    pools = [Grader(workers=workers, name=g) for g in graders]
    try:
        for bench_dir in benches:
            with contextlib.closing(hold_run_lock(bench_dir, "evaluated or audited")):
                # a broken line is named, not skipped: the last one too (an evaluation stopped mid-write,
                # whose resume rewrites the file; auditing the rest would audit a part of a setting)
                rows_all = read_jsonl(bench_dir / "samples.jsonl", strict=True, torn_last_ok=False)
                settings = _settings_by_key(bench_dir)
            by_key: dict[str, dict[tuple, dict]] = {}
            for r in rows_all:  # one row per generated sample of a setting
                by_key.setdefault(r["key"], {})[(r["idx"], r["sample"])] = r
            for key, keyed in by_key.items():
                rows = list(keyed.values())
                s = settings.get(key)
                name = f"{bench_dir.name} [{_setting_label(s[0]) if s else 'settings ' + key}]"
                verdicts = {p.tag: p.grade_many([r["response"] for r in rows], [r["gold"] for r in rows]) for p in pools}
                tags = list(verdicts)
                ok = {t: [v.correct and r["finished"] for v, r in zip(verdicts[t], rows)] for t in tags}
                n = len(rows)
                agree_all = sum(len({ok[t][i] for t in tags}) == 1 for i in range(n))
                summary[name] = {
                    "benchmark": bench_dir.name, "key": key,
                    "settings": None if s is None else {k: v for k, v in asdict(s[0]).items() if v is not None},
                    "problems": len({r["idx"] for r in rows}),
                    "samples": n,
                    "accuracy": {t: sum(ok[t]) / n for t in tags},
                    "all_agree": agree_all / n,
                    "disagree": 1 - agree_all / n,
                    "pairwise_agreement": {f"{a} vs {b}": sum(x == y for x, y in zip(ok[a], ok[b])) / n
                                           for a, b in itertools.combinations(tags, 2)},
                }
                for i, r in enumerate(rows):
                    if len({ok[t][i] for t in tags}) > 1:
                        disagreements.append({
                            "benchmark": bench_dir.name, "key": key, "idx": r["idx"], "sample": r["sample"],
                            "gold": r["gold"], "response_end": r["response"][-600:], "finished": r["finished"],
                            "verdicts": {t: {"correct": ok[t][i], "extracted": verdicts[t][i].extracted,
                                             "reason": verdicts[t][i].reason} for t in tags}})
    finally:
        for p in pools:
            p.close()
    out = folder / "audit"
    atomic_write_text(out / "summary.json", json.dumps({"graders": [p.tag for p in pools], "benchmarks": summary},
                                                       indent=2))
    atomic_write_text(out / "disagreements.jsonl", "".join(json.dumps(d) + "\n" for d in disagreements))
    return {"graders": [p.tag for p in pools], "benchmarks": summary, "disagreements": len(disagreements),
            "out": str(out)}


def _setting_label(s) -> str:
    """A short readable name of one evaluation setting: 'n=4 T=0.6 limit=64 seed=1 hf'."""
    parts = [f"n={s.n}", f"T={s.temperature}", f"top_p={s.top_p}", f"max={s.max_tokens}"]
    parts += [f"limit={s.limit}"] if s.limit is not None else []
    parts += [f"seed={s.seed}", s.engine, Path(str(s.model)).name or str(s.model)]
    return " ".join(parts)
