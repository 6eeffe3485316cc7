"""Whether a rerun reproduces a run: two training run directories compared record by record.

`stare compare RUN RERUN --same` answers the question a reproduction card raises ("does the command on
the card give the same run?") without a hand-written diff. Over the steps both runs have logged, it
compares
    metrics.jsonl            every key both rows have, to the bit (JSON's own float text), except the
                             wall-clock and memory keys (`time/...`, `memory/...`), which no rerun repeats;
    samples/step-N.jsonl     the training rollouts kept at step N, line by line;
    eval/step-N/<bench>/     each evaluation's settings (the model's path aside: each run names its own
                             checkpoint), its metrics and its samples (prompt, response, verdicts) line by
                             line, but for their `key` (a hash of the settings, path included).
A rerun that is still running, or was stopped, is compared over its prefix: the answer says how many of
the original's steps it covers. Keys logged by one run only at the steps compared (a newer commit may log
more) are named and not compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from stare_kernel.errors import StareError
from stare_cli.core.runs import read_jsonl

NOT_COMPARED = ("time/", "memory/")  # wall clock and memory: no rerun repeats them
EVAL_OWN = ("model",)  # an evaluation's settings that name the run itself (its checkpoint's path)
SAMPLE_OWN = ("key",)  # a sample line's hash of those settings


@dataclass(frozen=True)
class Difference:
    """One record that differs: where (step, file, line), which key, and the two values."""

    where: str  # 'step 17', 'step 15 words:two-step sample 3', 'samples/step-000010.jsonl line 4'
    key: str
    a: object
    b: object

    def text(self) -> str:
        return f"{self.where}: {self.key} {_short(self.a)} vs {_short(self.b)}"


@dataclass
class RunAgreement:
    """What `compare_runs` compared, and every difference it found (empty: the rerun reproduces the run)."""

    steps_a: int  # the last step each run logged
    steps_b: int
    steps: list[int] = field(default_factory=list)  # the steps both logged: compared
    values: int = 0  # metric values compared
    evaluations: list[str] = field(default_factory=list)  # 'step 15 words:two-step n=32' compared
    eval_samples: int = 0  # evaluation sample lines compared
    train_samples: int = 0  # training sample lines compared
    only_in: dict[str, list[str]] = field(default_factory=dict)  # 'a'/'b' -> what only that run has
    differences: list[Difference] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return bool(self.steps) and not self.differences


def _n(k: int, noun: str) -> str:
    return f"{k:,} {noun}{'' if k == 1 else 's'}"


def _short(v: object) -> str:
    s = json.dumps(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _rows_by_step(run: Path) -> dict[int, dict]:
    """The run's metrics rows by step; a step logged twice (a resume that redid it) counts as its last row."""
    return {r["step"]: r for r in read_jsonl(run / "metrics.jsonl", strict=True) if isinstance(r.get("step"), int)}


def _same_value(x: object, y: object) -> bool:
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)  # NaN == NaN, 0.1 != 0.1000000001


@dataclass(frozen=True)
class _Evaluation:
    settings: dict
    metrics: dict
    samples: Path


def _evaluations(run: Path) -> dict[str, _Evaluation]:
    """'step S <bench> n=N [grader]' -> the evaluation made during training at step S (its identity as the
    ledger records it, metrics, its samples.jsonl), through the one reader."""
    from stare_kernel.reader import find_records

    out = {}
    for r in sorted(find_records([run / "eval"]).records if (run / "eval").is_dir() else [], key=lambda r: r.written):
        if r.identity.get("step") is None or r.folder is None:
            continue
        out[f"step {r.identity['step']} {r.identity['benchmark']} n={r.metrics.get('n')} {r.identity['grader']}"] = \
            _Evaluation(dict(r.identity), r.metrics, r.folder / "samples.jsonl")
    return out


def _compare_lines(where: str, a: list[dict], b: list[dict], found: list[Difference], skip: tuple = ()) -> int:
    """Line i of one file against line i of the other (every key but `skip`); returns the lines compared."""
    if len(a) != len(b):
        found.append(Difference(where, "lines", len(a), len(b)))
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted((set(x) | set(y)) - set(skip)):
            if not _same_value(x.get(k), y.get(k)):
                found.append(Difference(f"{where} line {i + 1}", k, x.get(k), y.get(k)))
                break  # one difference per line is enough to say the line differs
    return min(len(a), len(b))


def compare_runs(a: Path, b: Path) -> RunAgreement:
    """Run `b` (a rerun) against run `a`, over the steps both logged (module docstring)."""
    for run in (a, b):
        if not (run / "metrics.jsonl").exists():
            raise StareError(f"{run}: not a training run directory (no metrics.jsonl)",
                             hint="--same compares two run directories written by `stare train`")
    ra, rb = _rows_by_step(a), _rows_by_step(b)
    ag = RunAgreement(max(ra, default=0), max(rb, default=0))
    ag.steps = sorted(set(ra) & set(rb))
    # keys over the compared steps only: a key the original logs past a partial rerun's last step (an
    # evaluation's, at step 15 of a rerun stopped at 9) is not yet logged, not logged by one run only
    keys_a = {k for s in ag.steps for k in ra[s] if not k.startswith(NOT_COMPARED)}
    keys_b = {k for s in ag.steps for k in rb[s] if not k.startswith(NOT_COMPARED)}
    for side, mine, theirs in (("a", keys_a, keys_b), ("b", keys_b, keys_a)):
        if mine - theirs:
            ag.only_in.setdefault(side, []).append("metrics " + ", ".join(sorted(mine - theirs)))
    for s in ag.steps:
        x, y = ra[s], rb[s]
        for k in sorted((set(x) & set(y)) - {"step"}):
            if k.startswith(NOT_COMPARED):
                continue
            ag.values += 1
            if not _same_value(x[k], y[k]):
                ag.differences.append(Difference(f"step {s}", k, x[k], y[k]))
    last = max(ag.steps, default=-1)
    for name in sorted({p.name for p in (a / "samples").glob("step-*.jsonl")} & {p.name for p in (b / "samples").glob("step-*.jsonl")}):
        if int(name.split("-")[1].split(".")[0]) <= last:
            ag.train_samples += _compare_lines(f"samples/{name}", read_jsonl(a / "samples" / name, strict=True),
                                               read_jsonl(b / "samples" / name, strict=True), ag.differences)
    ea, eb = _evaluations(a), _evaluations(b)
    for key in sorted(set(ea) & set(eb), key=lambda k: (int(k.split()[1]), k)):
        if int(key.split()[1]) > last:
            continue
        ag.evaluations.append(key)
        x, y = ea[key], eb[key]
        for what, da, db in (("settings", x.settings, y.settings), ("metrics", x.metrics, y.metrics)):
            for k in sorted(set(da) | set(db)):
                if not (what == "settings" and k in EVAL_OWN) and not _same_value(da.get(k), db.get(k)):
                    ag.differences.append(Difference(key, f"{what}.{k}", da.get(k), db.get(k)))
        ag.eval_samples += _compare_lines(key + " samples", read_jsonl(x.samples, strict=True),
                                          read_jsonl(y.samples, strict=True), ag.differences, SAMPLE_OWN)
    for side, mine, theirs in (("a", ea, eb), ("b", eb, ea)):
        extra = [k for k in mine if k not in theirs and int(k.split()[1]) <= last]
        if extra:
            ag.only_in.setdefault(side, []).append("evaluations " + ", ".join(extra))
    return ag


def agreement_text(ag: RunAgreement, a: Path, b: Path, show: int = 10) -> str:
    """The answer as lines: what was compared, what only one run has, and the first `show` differences."""
    if not ag.steps:
        return f"no step in common: {a} logged steps up to {ag.steps_a}, {b} up to {ag.steps_b}\n"
    span = f"steps {ag.steps[0]}-{ag.steps[-1]}" if len(ag.steps) > 1 else f"step {ag.steps[0]}"
    cover = f"{span} ({len(ag.steps)} of {ag.steps_a} logged by {a.name}, {ag.steps_b} by {b.name})"
    what = (f"{_n(ag.values, 'metric value')}, {_n(len(ag.evaluations), 'evaluation')} "
            f"({_n(ag.eval_samples, 'sample')}) and {_n(ag.train_samples, 'training sample')}")
    lines = []
    if ag.same:
        lines.append(f"same: over {cover}, {what} are equal to the bit ({', '.join(NOT_COMPARED)} not compared)")
    else:
        steps = sorted({d.where for d in ag.differences if d.where.startswith("step ") and " " not in d.where[5:]},
                       key=lambda w: int(w[5:]))
        lines.append(f"differ: {_n(len(ag.differences), 'difference')} over {cover}; compared {what}"
                     + (f"; metrics differ at {_n(len(steps), 'step')}, first {steps[0]}" if steps else ""))
        lines += [f"  {d.text()}" for d in ag.differences[:show]]
        if len(ag.differences) > show:
            lines.append(f"  ... and {len(ag.differences) - show} more")
    for side, run in (("a", a), ("b", b)):
        for item in ag.only_in.get(side, []):
            lines.append(f"only in {run.name} (not compared): {item}")
    return "\n".join(lines) + "\n"

