"""`stare grade agreement A B`: two evaluations of the same problems side by side (e.g. the HF and the
vLLM engine, greedy): how often they wrote the same response, where they part, and each one's accuracy.

For every benchmark folder present in both, each side's latest setting (results.json) is read with
its samples; samples are paired by (problem, sample index). Reported per benchmark:
- `identical`: the share of pairs whose responses are the same text (greedy decoding on two engines:
  the same tokens unless a near-tie in the logits flips an argmax, after which they diverge);
- `common_prefix_chars`: the mean length of the common start of the two texts, and the mean
  response lengths, to show how far they run together before they part;
- `first_divergence`: for up to 5 pairs that differ, the text around where they part;
- each side's accuracy under its recorded grader, with the 95% bootstrap interval over problems.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.evaluation.metrics import bootstrap_ci
from stare_kernel.errors import StareError
from stare_kernel.io import read_jsonl


def _latest(bench_dir: Path) -> tuple[dict, dict[tuple[int, int], dict]]:
    """(results.json, samples of its setting by (idx, sample))."""
    try:
        res = json.loads((bench_dir / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise StareError(f"{bench_dir / 'results.json'}: unreadable ({type(e).__name__})",
                         hint="point at `stare eval` outputs") from None
    rows = {(r["idx"], r["sample"]): r for r in read_jsonl(bench_dir / "samples.jsonl", strict=True)
            if r.get("key") == res["key"]}
    return res, rows


def agreement(a: Path, b: Path) -> dict:
    """Per benchmark present under both folders: identical share, common prefix, divergences, accuracies."""
    a, b = Path(a), Path(b)

    def benches(folder: Path) -> dict[str, Path]:
        if (folder / "results.json").exists():
            return {folder.name: folder}
        return {p.parent.name: p.parent for p in folder.glob("*/results.json")}

    ba, bb = benches(a), benches(b)
    common = sorted(set(ba) & set(bb))
    if not common:
        raise StareError(f"{a} and {b} share no benchmark folder", hint="pass two `stare eval --out` folders")
    out: dict[str, dict] = {}
    for name in common:
        (ra, sa), (rb, sb) = _latest(ba[name]), _latest(bb[name])
        pairs = sorted(set(sa) & set(sb))
        if not pairs:
            continue
        same, prefix, diverge = 0, [], []
        for k in pairs:
            x, y = sa[k]["response"], sb[k]["response"]
            common_len = len(os.path.commonprefix([x, y]))
            prefix.append(common_len)
            if x == y:
                same += 1
            elif len(diverge) < 5:
                lo = max(0, common_len - 40)
                diverge.append({"idx": k[0], "sample": k[1], "at_char": common_len,
                                "a": x[lo:common_len + 60], "b": y[lo:common_len + 60]})

        def acc(rows: dict, grader: str) -> dict:
            per_problem: dict[int, list[float]] = {}
            for (idx, _), r in rows.items():
                v = r.get("verdicts", {}).get(grader, r)
                per_problem.setdefault(idx, []).append(float(bool(v["correct"])))
            means = [sum(v) / len(v) for v in per_problem.values()]
            lo, hi = bootstrap_ci(means) if len(means) > 1 else (float("nan"), float("nan"))
            return {"avg": 100 * sum(means) / len(means), "ci95": [100 * lo, 100 * hi], "grader": grader}

        out[name] = {
            "pairs": len(pairs), "identical": same / len(pairs),
            "common_prefix_chars": sum(prefix) / len(prefix),
            "mean_chars": [sum(len(sa[k]["response"]) for k in pairs) / len(pairs),
                           sum(len(sb[k]["response"]) for k in pairs) / len(pairs)],
            "engines": [ra["settings"]["engine"], rb["settings"]["engine"]],
            "temperature": [ra["settings"]["temperature"], rb["settings"]["temperature"]],
            "accuracy": [acc({k: sa[k] for k in pairs}, ra["grader"]), acc({k: sb[k] for k in pairs}, rb["grader"])],
            "first_divergence": diverge,
        }
    return {"a": str(a), "b": str(b), "benchmarks": out}
