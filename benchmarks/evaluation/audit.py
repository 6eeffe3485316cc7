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
from pathlib import Path
from typing import Optional

from benchmarks.grading.graders import Grader
from stare_kernel.errors import StareError
from stare_kernel.ledger import Record, labels_by_difference
from stare_kernel.io import atomic_write_text, read_jsonl

DEFAULT_GRADERS = ("math-verify", "math-verify-plain", "stare-official-3way", "mathruler")


def audit(folder: Path, graders: tuple[str, ...] = DEFAULT_GRADERS, workers: Optional[int] = None) -> dict:
    """Grade every saved sample under `folder` with every grader, one evaluation setting at a time (a
    benchmark folder can hold several: other n, limit, seed, model...; their samples are never pooled);
    returns the summary (also written). Each benchmark folder is locked while it is read, so a running
    evaluation is refused by name instead of being audited half-written."""
    import contextlib

    from stare_kernel.io import hold_run_lock
    from stare_kernel.reader import find_records

    folder = Path(folder)
    benches = [folder] if (folder / "samples.jsonl").exists() else sorted(p.parent for p in folder.glob("*/samples.jsonl"))
    if not benches:
        raise StareError(f"{folder}: no samples.jsonl here or in its subfolders", hint="point at a `stare eval` output")
    summary: dict[str, dict] = {}
    disagreements: list[dict] = []
    pools = [Grader(workers=workers, name=g) for g in graders]
    try:
        work = []
        for bench_dir in benches:
            with contextlib.closing(hold_run_lock(bench_dir, "evaluated or audited")):
                # a broken line is named, not skipped: the last one too (an evaluation stopped mid-write,
                # whose resume rewrites the file; auditing the rest would audit a part of a setting)
                rows_all = read_jsonl(bench_dir / "samples.jsonl", strict=True, torn_last_ok=False)
                records = find_records([bench_dir]).records
            by_key: dict[str, dict[tuple, dict]] = {}
            for r in rows_all:  # one row per generated sample of a setting
                by_key.setdefault(r["key"], {})[(r["idx"], r["sample"])] = r
            for key, keyed in by_key.items():
                rec = next((x for x in records if x.samples_key == key), None)
                work.append((bench_dir, key, keyed, rec))
        names = setting_names([(bench_dir, key, rec) for bench_dir, key, _, rec in work])
        for (bench_dir, key, keyed, rec), name in zip(work, names):
            rows = list(keyed.values())
            s = rec
            verdicts = {p.tag: p.grade_many([r["response"] for r in rows], [r["gold"] for r in rows]) for p in pools}
            tags = list(verdicts)
            ok = {t: [v.correct and r["finished"] for v, r in zip(verdicts[t], rows)] for t in tags}
            n = len(rows)
            agree_all = sum(len({ok[t][i] for t in tags}) == 1 for i in range(n))
            summary[name] = {
                "benchmark": bench_dir.name, "key": key,
                "identity": None if s is None else s.identity, "seed": None if s is None else s.seed_name,
                "record": None if s is None or s.path is None else str(s.path),
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


def setting_names(work: list[tuple[Path, str, Optional[Record]]]) -> list[str]:
    """One name per audited setting (benchmark folder, samples key, its record or None): the folder, then the
    identity fields that tell it from the other settings (the ledger's labels_by_difference; the grader aside,
    since every grader is audited) and its seed. Never two settings under one name: where everything recorded
    agrees, the samples key tells them apart."""
    idents = [{**(rec.identity if rec else {"samples": key}), "grader": None} for _, key, rec in work]
    tags = labels_by_difference(idents, skip=("grader", "benchmark_version"))
    names: list[str] = []
    for (bench_dir, key, rec), tag in zip(work, tags):
        name = f"{Path(bench_dir).name} [{tag or 'the setting'}" + (
            f", seed {rec.seed_name}" if rec else f", samples {key}") + "]"
        names.append(name if name not in names else f"{name[:-1]}, samples {key}]")
    return names
