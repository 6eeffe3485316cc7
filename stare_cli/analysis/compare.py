"""`stare compare`: runs and evaluations beside each other and beside the paper's Table 2.

Inputs are any mix of run directories, sweeps, `stare eval` output folders and their parents: the one
reader (stare_kernel/reader.py) finds every evaluation record under them. Rows pool records whose
identity (stare_kernel/ledger.py: weights, run, data, protocol, grader, engine, ...) differs in the seed
alone: mean ± std over seeds with the seed count; records that differ in anything else are separate rows,
named by what differs, with no best and no delta between them. The paper's published numbers ship as
package data.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from importlib import resources
from collections import namedtuple
from pathlib import Path
from typing import NamedTuple, Optional

import yaml

from benchmarks.data.registry import BENCHMARKS, PAPER_ORDER
from stare_kernel.errors import StareError, table_console
from stare_kernel.io import read_jsonl
from stare_kernel.ledger import (IDENTITY_FIELDS, ROW_FIELDS, UNKNOWN, Record, differences, is_run_dir,
                                 labels_by_difference, pool_key, recipe_variant, run_acted, short)
from stare_kernel.reader import find_records
from stare_cli.core.runs import with_eval_points
from stare_cli.analysis.plots import save_figure

PAPER_MODELS = {
    "short-cot/qwen2.5-math-7b": ("short-cot", "Qwen2.5-Math-7B"),
    "short-cot/qwen2.5-14b-instruct": ("short-cot", "Qwen2.5-14B-Instruct"),
    "short-cot/qwen2.5-32b": ("short-cot", "Qwen2.5-32B"),
    "long-cot/r1-distill-qwen-1.5b": ("long-cot", "DeepSeek-R1-Distill-Qwen-1.5B"),
    "long-cot/qwen3-8b": ("long-cot", "Qwen3-8B"),
    "tool-use/qwen2.5-7b": ("tool-use", "Qwen2.5-7B"),
}


@dataclass
class Result:
    """One evaluated model (one seed) as a row takes it: metrics per benchmark, each with the identity of the
    record it comes from (the ledger's, stare_kernel/ledger.py)."""

    label: str  # the method (a training run's evaluations) or the model's name
    seed: Optional[str]  # the seed's name (ledger.seed_name): '1', or '1/eval 2' for a run's seed 1 sampled with 2
    source: str
    metrics: dict[str, dict] = field(default_factory=dict)  # bench -> metrics
    protocol: dict[str, "Identity"] = field(default_factory=dict)  # bench -> the record's identity
    metrics_rows: list[dict] = field(default_factory=list)
    config: dict[str, object] = field(default_factory=dict)  # what makes this run differ from another of its label
    acted: Optional[str] = None  # why the run's method never acted up to this step (ledger.run_acted), or None


# The identity of a row's cell: the ledger's fields, then whether it is the benchmark's paper protocol
# (derived from them: `paper_protocol`).
Identity = namedtuple("Identity", (*IDENTITY_FIELDS, "paper"))
_IDENTITY_FIELDS = IDENTITY_FIELDS


def paper_protocol(ident: dict) -> Optional[bool]:
    """Whether an evaluation follows its benchmark's paper protocol in every protocol field: samples,
    temperature, top_p, max tokens, template, all problems, no tools; None for a benchmark the paper has no
    protocol for, False where a field is unknown."""
    spec = BENCHMARKS.get(ident["benchmark"])
    if spec is None:
        return None
    return (ident["n"] == spec.n and ident["temperature"] == spec.temperature and ident["top_p"] == spec.top_p
            and ident["max_tokens"] == spec.max_tokens and ident["template"] == spec.template
            and ident["partial"] is False and ident["tools"] is None)


def make_identity(paper: Optional[bool] = None, **fields) -> Identity:
    """An Identity from keyword fields; those not given are None (a record that leaves them open)."""
    return Identity(**{f: fields.pop(f, None) for f in IDENTITY_FIELDS}, paper=paper, **fields)


def measured(p: Identity) -> Identity:
    """An identity less the fields that name a row (ledger.ROW_FIELDS: the method or model compared): what
    two rows must share to be set beside each other with a best and a delta."""
    return p._replace(**{f: None for f in ROW_FIELDS})


def _identity(rec: Record) -> Identity:
    return Identity(**rec.identity, paper=paper_protocol(rec.identity))


def load_inputs(paths: list[Path], step: Optional[int] = None, notes: Optional[list[str]] = None) -> list[Result]:
    """Every evaluation under `paths` (run directories, sweeps, evaluation folders, parents of them: the one
    reader, stare_kernel/reader.py), as Results: a training run's own evaluations at `step` (default: each
    run's last evaluated step), every other evaluation as it is, one Result per seed. What is not shown is
    said in `notes` (superseded records, copies, a run's earlier steps)."""
    found = find_records(paths)
    if notes is not None:
        notes.extend(found.notes)
    for p in paths:
        if not is_run_dir(p) and not any(_under(r, p) for r in found.records):
            raise StareError(f"compare: '{p}' is neither a run directory nor holds evaluation results "
                             "(records/ or results.json below it)",
                             hint="point at run directories, sweeps or `stare eval` output folders")
    own = [r for r in found.records if _own_run(r) is not None]
    last: dict[str, int] = {}
    for r in own:
        last[r.run["dir"]] = max(last.get(r.run["dir"], -1), r.identity["step"])
    if step is not None:
        for p in paths:
            steps = sorted({r.identity["step"] for r in own if _own_run(r) == Path(p).resolve()})
            if steps and step not in steps:
                raise StareError(f"compare: {p} has no evaluation at step {step} (evaluated at steps "
                                 f"{', '.join(map(str, steps))})", hint="--step one of those, or drop --step")
    shown, hidden = [], 0
    for r in found.records:
        if _own_run(r) is not None:
            at = step if step is not None else last[r.run["dir"]]
            if r.identity["step"] != at:
                hidden += 1
                continue
        shown.append(r)
    if hidden and notes is not None:
        notes.append(f"{hidden} evaluation{'s' if hidden > 1 else ''} of training runs at "
                     + ("other steps" if step is not None else "earlier steps")
                     + " not shown (a run's row is its evaluation at --step, by default its last evaluated step)")
    units: dict[tuple, list[Result]] = {}
    configs: dict[str, Optional[dict]] = {}  # each run's config.yaml, read once per call
    for r in shown:
        unit = _unit(r)
        res_list = units.setdefault(unit, [])
        res = next((x for x in res_list if r.identity["benchmark"] not in x.metrics), None)
        if res is None:
            res = _new_result(r, configs)
            res_list.append(res)
        res.metrics[r.identity["benchmark"]] = r.metrics
        res.protocol[r.identity["benchmark"]] = _identity(r)
    out = [x for rs in units.values() for x in rs]
    for p in paths:  # a run with no evaluation yet: its training dynamics still plot
        if is_run_dir(p) and not any(Path(x.source).resolve() == Path(p).resolve() for x in out):
            cfg = yaml.safe_load((Path(p) / "config.yaml").read_text())
            out.append(Result(label=cfg["method"]["name"], seed=str(cfg["optim"]["seed"]), source=str(p),
                              metrics_rows=read_jsonl(Path(p) / "metrics.jsonl", strict=True),
                              config=recipe_variant(cfg)))
    return out


def _under(r: Record, p: Path) -> bool:
    where = r.path or r.folder
    try:
        Path(where).resolve().relative_to(Path(p).resolve())
        return True
    except (TypeError, ValueError):
        return False


def _own_run(r: Record) -> Optional[Path]:
    """The run directory whose trainer made this evaluation (it lies in the run's eval/ folder, or is a verl
    run's own validation), or None."""
    if not r.run or r.identity.get("step") is None or r.folder is None:
        return None
    run = Path(r.run["dir"]).resolve()
    if r.extra.get("source") == "verl-validation":
        return run
    try:
        Path(r.folder).resolve().relative_to(run / "eval")
    except ValueError:
        return None
    return run


def _unit(r: Record) -> tuple:
    """What one Result holds: a run's evaluations at one step, or one evaluation command's at one seed."""
    if r.run and r.identity.get("step") is not None:
        return ("run", r.run["dir"], r.identity["step"], r.evaluation or "", r.seed_name)
    where = r.evaluation or str(Path(r.folder or ".").parent)
    return ("eval", where, r.model_path, r.seed_name)


def _new_result(r: Record, configs: dict[str, Optional[dict]]) -> Result:
    if r.run:
        run = Path(r.run["dir"])
        if str(run) not in configs:
            configs[str(run)] = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else None
        cfg = configs[str(run)]
        method = r.identity.get("method")
        label = method if method and method != UNKNOWN else (cfg or {}).get("method", {}).get("name", run.name)
        rows = read_jsonl(run / "metrics.jsonl", strict=True) if _own_run(r) is not None else []
        acted = run_acted(run, r.identity.get("step")) if (run / "metrics.jsonl").exists() else None
        return Result(label=label, seed=r.seed_name, source=str(run), metrics_rows=rows,
                      config=recipe_variant(cfg) if cfg else {}, acted=acted)
    model = str(r.model_path or "?")
    return Result(label=Path(model).name or model, seed=r.seed_name, source=str(r.folder.parent if r.folder else "?"),
                  config={"model": model})


def metric_key(metric: str, n: int) -> str:
    if metric == "avg":
        return f"avg@{n}"
    return metric


@dataclass
class Row:
    label: str
    cells: dict[str, Optional[tuple[float, float, int]]]  # bench -> (mean, std, seeds)
    avg: Optional[tuple[float, float, int]]
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)  # bench -> 95% interval (seeds, or problems)
    paper: bool = False
    prior: bool = False
    flagged: bool = False
    note: str = ""
    identity: dict[str, Identity] = field(default_factory=dict)  # bench -> what the row's cells measured
    step: str = ""  # the training step of a run's evaluation ("" for evaluation folders)
    not_paper: str = ""  # benchmarks evaluated under another protocol than the paper's, and how
    seed_avgs: dict[str, float] = field(default_factory=dict)  # seed -> its average over the benchmarks
    never_acted: str = ""  # the method never acted in the row's runs (STARE's gate never open, ...): why
    seeds: list[str] = field(default_factory=list)  # the seeds pooled


class Delta(NamedTuple):
    """A row's Δ Avg against the baseline row: the difference of the two means, and where both rows have
    the same two or more seeds, an interval of the difference paired by seed (seed_interval over the
    per-seed differences)."""

    value: float
    ci: Optional[tuple[float, float]] = None
    pairs: int = 0  # seeds paired
    kind: str = ""  # seed_interval's kind: "t95" or "range"


def columns(results: list[Result], with_paper: bool) -> tuple[str, ...]:
    """The six benchmarks in the paper's order (all six when any is present or beside the paper;
    missing ones show as '–'), then any other benchmark present (e.g. the toy's)."""
    present = {b for r in results for b in r.metrics}
    six = list(PAPER_ORDER) if with_paper or present & set(PAPER_ORDER) else []
    return tuple(six + sorted(present - set(PAPER_ORDER))) or PAPER_ORDER


def _dedupe_seeds(rs: list[Result], replaced: list[str]) -> list[Result]:
    """One result per seed within a group: a seed evaluated again replaces its earlier result (inputs come
    oldest first), never counts twice. Results without a seed are all kept."""
    keep: dict[object, Result] = {}
    for i, r in enumerate(rs):
        key = r.seed if r.seed is not None else ("no seed", i)
        if key in keep:
            replaced.append(f"{_title(r.label)}: seed {r.seed} appears twice ({keep[key].source}, {r.source}); "
                            "the later one counts")
        keep[key] = r
    return list(keep.values())


def _differences(ids: list[Identity]) -> list[str]:
    """The identity fields on which `ids` disagree, as 'field a/b' strings ('-' for a field one of them
    lacks: the step of an evaluation that is not a training run's): the ledger's `differences`."""
    return differences([x._asdict() for x in ids])


def build_rows(results: list[Result], metric: str = "avg", benches: tuple[str, ...] = PAPER_ORDER) -> tuple[list[Row], dict]:
    """Group by (label, identity of each benchmark); mean ± std over the seeds of a group (one result per
    seed). Returns rows and header info: `mixed` (benchmarks whose rows differ in more than the label: no
    best, no delta there), `why` (what differs), `intervals` (the kinds of interval shown)."""
    from benchmarks.evaluation.metrics import PERCENT, seed_interval

    by_method: dict[str, list[Result]] = {}
    for r in results:
        by_method.setdefault(r.label, []).append(r)
    by_label: dict[str, list[Result]] = {}
    for label, rs in by_method.items():
        # Runs of one method that differ in their recipe (beyond the seed) are different rows, labelled
        # by what differs: "STARE-O1 [method.stare.W=2.0]".
        keys = sorted({k for r in rs for k in r.config} )
        differ = [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in rs}) > 1]
        for r in rs:
            tag = ", ".join(f"{k.removeprefix('method.')}={r.config.get(k)}" for k in differ)
            by_label.setdefault(f"{label} [{tag}]" if tag else label, []).append(r)
    groups: dict[tuple, list[Result]] = {}
    for label, rs in by_label.items():
        # Split a label's results only where they disagree on a benchmark's identity (anything but the
        # seed); a result that lacks a benchmark does not split anything.
        conflict = [b for b in benches if len({r.protocol[b] for r in rs if b in r.protocol}) > 1]
        for r in rs:
            groups.setdefault((label, tuple(r.protocol.get(b) for b in conflict)), []).append(r)
    replaced: list[str] = []
    groups = {k: _dedupe_seeds(rs, replaced) for k, rs in groups.items()}
    # Groups of one label that differ get the difference in their label ("[N=2]", "[grader=...]"),
    # never the same name for different things.
    names = _protocol_labels(groups, benches)
    protos: dict[str, list[Identity]] = {b: [] for b in benches}
    for rs in groups.values():
        for r in rs:
            for b in benches:
                if b in r.protocol and measured(r.protocol[b]) not in protos[b]:
                    protos[b].append(measured(r.protocol[b]))
    mixed = {b for b, ps in protos.items() if len(ps) > 1}
    seed_sets = {tuple(sorted({r.seed for r in rs if r.seed is not None})) for rs in groups.values()}
    seed_txt = ("; seeds " + " / ".join(",".join(x) or "-" for x in sorted(seed_sets))) if len(seed_sets) > 1 else ""
    why = [f"{BENCHMARKS[b].title if b in BENCHMARKS else b}: {', '.join(_differences(protos[b]))}{seed_txt}"
           for b in benches if b in mixed]
    kinds: set[str] = set()
    rows = []
    for (label, conf), rs in groups.items():
        cells: dict[str, Optional[tuple[float, float, int]]] = {}
        ci: dict[str, tuple[float, float]] = {}
        for b in benches:
            vals, problem_ci = [], None
            for r in rs:
                if b in r.metrics:
                    m = r.metrics[b]
                    k = metric_key(metric, m["n"])
                    if k in m:
                        vals.append(m[k])
                        problem_ci = m.get(f"ci95/{k}")
            cells[b] = (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals)) if vals else None
            if len(vals) > 1:  # over seeds
                lo, hi, kind = seed_interval(vals, within=PERCENT)  # pass@k, avg@k, maj@k
                ci[b] = (lo, hi)
                kinds.add(kind)
            elif problem_ci:  # one seed: over problems (from results.json)
                ci[b] = tuple(problem_ci)
                kinds.add("problems")
        per_seed_avgs, seed_avgs = [], {}
        for r in rs:
            vs = [r.metrics[b][metric_key(metric, r.metrics[b]["n"])] for b in benches if b in r.metrics
                  and metric_key(metric, r.metrics[b]["n"]) in r.metrics[b]]
            if len(vs) == len(benches):
                per_seed_avgs.append(sum(vs) / len(vs))
                if r.seed is not None:
                    seed_avgs[r.seed] = per_seed_avgs[-1]
        avg = (statistics.fmean(per_seed_avgs), statistics.stdev(per_seed_avgs) if len(per_seed_avgs) > 1 else 0.0,
               len(per_seed_avgs)) if per_seed_avgs else None
        proto = {b: p for r in rs for b, p in r.protocol.items()}
        flagged = any(b in mixed for b in proto)
        lim = any(p.partial is not False for p in proto.values())
        note = "; ".join(f"{b}: {_describe(p)}" for b, p in proto.items() if b in mixed) if flagged else (
            "limited" if lim else "")
        if len(per_seed_avgs) > 1:
            lo, hi, kind = seed_interval(per_seed_avgs, within=PERCENT)
            ci["avg"] = (lo, hi)
            kinds.add(kind)
        steps = sorted({p.step for p in proto.values() if p.step is not None})
        not_paper = [f"{b}: {_describe(p)}" for b, p in proto.items() if p.paper is False]
        acted = sorted({r.acted for r in rs if r.acted})
        rows.append(Row(names[(label, conf)], cells, avg, ci=ci, flagged=flagged or lim, note=note,
                        identity=proto, step="/".join(map(str, steps)), not_paper="; ".join(not_paper),
                        seed_avgs=seed_avgs, never_acted="; ".join(acted) if acted and len(acted) == 1 and all(
                            r.acted for r in rs) else "", seeds=[r.seed for r in rs if r.seed is not None]))
    ns = sorted({r.metrics[b]["n"] for rs in groups.values() for r in rs for b in r.metrics})
    return rows, {"metric": metric, "ns": ns, "mixed": sorted(mixed), "why": why, "replaced": replaced,
                  "intervals": sorted(kinds)}


def _describe(p: Identity) -> str:
    """One benchmark's identity in a note: 'N=4 T=0.6 top_p=1.0 short max=64 limited (64 problems) grader=...'."""
    txt = f"N={p.n} T={p.temperature} top_p={p.top_p} {p.template} max={p.max_tokens}"
    txt += f" limited ({p.problems} problems)" if p.partial is True else (" problems unknown" if p.partial == UNKNOWN else "")
    txt += "".join(f" {k}={short(getattr(p, k))}" for k in ("tools", "grader", "engine", "dtype", "step")
                   if getattr(p, k) is not None)
    txt += " (recorded before the ledger: some fields unknown)" if p.ledger == 0 else ""
    return txt


def _protocol_labels(groups: dict[tuple, list[Result]], benches: tuple[str, ...]) -> dict[tuple, str]:
    """(label, conflicting identities) -> the row's label: the label itself where it names one row,
    else with the identity fields that tell its rows apart, e.g. 'arith-v1 [N=2, T=0.5]'."""
    by_label: dict[str, list[tuple]] = {}
    for key in groups:
        by_label.setdefault(key[0], []).append(key)
    out = {}
    for label, keys in by_label.items():
        if len(keys) == 1:
            out[keys[0]] = label
            continue
        protos = {k: {b: p for r in groups[k] for b, p in r.protocol.items()} for k in keys}
        for k in keys:
            parts = []
            for b in benches:
                mine = protos[k].get(b)
                for i, name in enumerate(_IDENTITY_FIELDS):
                    values = {p[b][i] for p in protos.values() if p.get(b) is not None}
                    if mine is not None and len(values) > 1 and f"{name}=" not in " ".join(parts):
                        parts.append(f"{name}={short(mine[i])}")
            out[k] = f"{label} [{', '.join(parts)}]" if parts else label
    return out


def paper_rows(scenario: str, benches: tuple[str, ...] = PAPER_ORDER) -> list[Row]:
    if scenario not in PAPER_MODELS:
        from stare_kernel.errors import did_you_mean

        raise StareError(f"unknown paper scenario '{scenario}'{did_you_mean(scenario, PAPER_MODELS)}; "
                         f"valid: {', '.join(PAPER_MODELS)}")
    sc, model = PAPER_MODELS[scenario]
    text = resources.files("benchmarks").joinpath("data/paper_table2.csv").read_text()
    rows = []
    for rec in csv.DictReader(io.StringIO(text)):
        if rec["scenario"] != sc or rec["base_model"] != model:
            continue
        cells = {b: ((float(rec[b]), 0.0, 0) if rec.get(b) else None) for b in benches}
        avg = (float(rec["avg"]), 0.0, 0) if rec["avg"] else None
        rows.append(Row(f"{rec['method']} (paper)", cells, avg, paper=True, prior=rec["from_prior_work"] == "yes"))
    return rows


def _title(label: str) -> str:
    from baselines.registry import METHODS

    name, sep, rest = label.partition(" [")
    return (METHODS[name].title if name in METHODS else name) + (sep + rest if sep else "")


def add_delta(rows: list[Row], baseline: Optional[str], info: Optional[dict] = None) -> dict[int, Optional[Delta]]:
    """Average delta of each row against the baseline method's row (ours first, else the paper's), with an
    interval paired by seed where both rows have the same two or more seeds (Delta). No delta for a row of
    ours whose evaluations differ from the baseline row's in anything but the method (step, grader, data,
    protocol, ...): `info["no_delta"]` says which and why; `info["paired"]` / `info["unpaired"]` which
    rows have a paired interval and which not (their seeds differ)."""
    from benchmarks.evaluation.metrics import PERCENT_DIFFERENCE, seed_interval

    if not baseline:
        return {}
    title = _title(baseline)
    base = next((r for r in rows if not r.paper and r.label == baseline), None) or next(
        (r for r in rows if r.paper and r.label == f"{title} (paper)"), None)
    if base is None or base.avg is None:
        split = [r.label for r in rows if not r.paper and r.label.partition(" [")[0] == baseline]
        if len(split) > 1:
            raise StareError(f"compare: the rows of baseline '{baseline}' differ in more than the seed, so none is "
                             f"the baseline: {'; '.join(_title(x) for x in split)}",
                             hint="keep one of them (--step S picks one step of every run), or compare them apart")
        if split:
            raise StareError(f"compare: the row of baseline '{baseline}' lacks a benchmark other rows have",
                             hint="evaluate it on every benchmark of the table, or compare those benchmarks only")
        raise StareError(f"compare: no row for baseline '{baseline}' with all benchmarks",
                         hint="name a method present in the inputs or the paper rows")
    out: dict[int, Optional[Delta]] = {}
    for i, r in enumerate(rows):
        diff = [] if (r.paper or base.paper or r is base) else [
            f"{b}: {', '.join(_differences([measured(base.identity[b]), measured(r.identity[b])]))}"
            for b in base.identity if b in r.identity and measured(base.identity[b]) != measured(r.identity[b])]
        if base.paper and not r.paper and r.not_paper:  # a paper number beside ours only under its protocol
            diff = [f"not the paper's protocol ({r.not_paper})"]
        if diff and info is not None:
            info.setdefault("no_delta", []).append(f"{_title(r.label)} (vs {_title(base.label)}: {'; '.join(diff)})")
        if not r.avg or diff:
            out[i] = None
            continue
        seeds = sorted(r.seed_avgs)
        paired = (r is not base and len(seeds) >= 2 and seeds == sorted(base.seed_avgs)
                  and len(seeds) == r.avg[2] == base.avg[2])  # every result of both rows has its seed
        if not paired:
            out[i] = Delta(r.avg[0] - base.avg[0])
            if r is not base and not base.paper and info is not None and len(seeds) >= 2:
                info.setdefault("unpaired", []).append(
                    f"{_title(r.label)} (seeds {', '.join(map(str, seeds))}; {_title(base.label)}: seeds "
                    f"{', '.join(map(str, sorted(base.seed_avgs))) or 'none'})")
            continue
        lo, hi, kind = seed_interval([r.seed_avgs[k] - base.seed_avgs[k] for k in seeds], within=PERCENT_DIFFERENCE)
        out[i] = Delta(r.avg[0] - base.avg[0], (lo, hi), len(seeds), kind)
        if info is not None:
            info.setdefault("paired", []).append(f"{_title(r.label)}: seeds {', '.join(map(str, seeds))}")
    return out


def mark_text(r: Row, beside_paper: bool) -> str:
    """The marks after a row's label: † prior work, * another or reduced protocol, ‡ not the paper's
    protocol (beside the paper's rows), § the method never acted."""
    return ((" †" if r.prior else "") + (" *" if r.flagged else "") + (" ‡" if beside_paper and r.not_paper else "")
            + (" §" if r.never_acted else ""))


def _identity_column(r: Row, f: str) -> str:
    """A row's value of identity field `f` for a CSV column: the value where its benchmarks agree, else
    'bench=value; ...'."""
    vals = {b: getattr(p, f) for b, p in r.identity.items()}
    if len({json.dumps(v, default=str) for v in vals.values()}) <= 1:
        return "" if not vals else ("" if next(iter(vals.values())) is None else str(next(iter(vals.values()))))
    return "; ".join(f"{b}={v}" for b, v in vals.items())


def _fmt(cell: Optional[tuple[float, float, int]], with_std: bool, ci: Optional[tuple[float, float]] = None) -> str:
    if cell is None:
        return "–"
    m, s, k = cell
    txt = f"{m:.1f} ± {s:.1f}" if with_std and k > 1 else f"{m:.1f}"
    return f"{txt} [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else txt


def render(rows: list[Row], info: dict, fmt: str, deltas: dict[int, Optional[Delta]],
           benches: tuple[str, ...] = PAPER_ORDER, with_ci: bool = False) -> str:
    metric = info["metric"]
    ns = info["ns"]
    mlabel = {"avg": "avg@N"}.get(metric, metric)
    n_txt = "N=" + "/".join(str(n) for n in ns) if ns else ""
    with_step = any(r.step for r in rows)
    header = (["Method", *[BENCHMARKS[b].title for b in benches], "Avg"] + (["Δ Avg"] if deltas else [])
              + (["step"] if with_step else []) + ["seeds"])
    beside_paper = any(r.paper for r in rows)
    best = {}
    mixed = set(info.get("mixed", ()))
    for b in [*benches, "avg"]:
        vals = [(r.avg if b == "avg" else r.cells.get(b)) for r in rows]
        vals = [v[0] for v in vals if v is not None]
        comparable = not (mixed & ({b} if b != "avg" else set(benches)))  # no "best" across protocols
        # bold means best of several that differ: rows all equal (a method that never acted) have no best
        best[b] = max(vals) if len(vals) >= 2 and comparable and max(vals) > min(vals) else None
    any_best = any(v is not None for v in best.values())
    info["best_marked"] = any_best
    body = []
    for i, r in enumerate(rows):
        label = _title(r.label) if not r.paper else r.label
        if fmt not in ("json", "csv"):
            label += mark_text(r, beside_paper)
        cells = []
        for b in [*benches, "avg"]:
            c = r.avg if b == "avg" else r.cells.get(b)
            cells.append((_fmt(c, fmt != "csv" and fmt != "json", r.ci.get(b) if with_ci else None),
                          c is not None and best[b] is not None and math.isclose(c[0], best[b], abs_tol=1e-9)))
        d = deltas.get(i) if deltas else None
        seeds = max((c[2] for c in [*r.cells.values(), r.avg] if c), default=0)
        seeds_txt = "paper" if r.paper else str(seeds)
        body.append((label, cells, d, f"{r.step or '–'} | {seeds_txt}" if with_step else seeds_txt, r))
    if fmt == "json":
        return json.dumps({
            "metric": metric, "n": ns, "benchmarks": list(benches), "mixed_protocols": info["mixed"],
            "not_comparable": info.get("why", []), "no_delta": info.get("no_delta", []),
            "intervals": info.get("intervals", []), "seeds_replaced": info.get("replaced", []),
            "notes": info.get("reader_notes", []),
            "rows": [{"label": lab, "paper": r.paper, "from_prior_work": r.prior, "flagged": r.flagged, "note": r.note,
                      "step": r.step or None, "not_paper_protocol": r.not_paper or None,
                      "never_acted": r.never_acted or None, "seed_list": r.seeds,
                      "identity": {b: p._asdict() for b, p in r.identity.items()},
                      "cells": {b: (None if (r.avg if b == "avg" else r.cells.get(b)) is None else
                                    {**dict(zip(("mean", "std", "seeds"), (r.avg if b == "avg" else r.cells[b]))),
                                     **({"ci95": list(r.ci[b])} if b in r.ci else {})})
                                for b in [*benches, "avg"]},
                      "delta_avg": None if d is None else d.value,
                      **({"delta_avg_ci95": list(d.ci), "delta_paired_seeds": d.pairs}
                         if d is not None and d.ci else {})} for lab, _, d, _, r in body],
        }, indent=2)
    def dtxt(d: Optional[Delta]) -> str:
        if d is None:
            return "–"
        return f"{d.value:+.1f}" + (f" [{d.ci[0]:+.1f}, {d.ci[1]:+.1f}]" if with_ci and d.ci else "")

    if fmt == "csv":  # numbers only: empty cells where there is none, marks in the notes column
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        cols = [*benches, "avg"]
        ci_head = [f"{h} CI{e}" for b, h in zip(cols, header[1:len(cols) + 1]) for e in (" low", " high")] if with_ci else []
        ci_head += ["Δ Avg CI low", "Δ Avg CI high"] if with_ci and deltas else []
        ident_head = [f"identity.{f}" for f in (*IDENTITY_FIELDS, "paper")]
        w.writerow([*header, *ci_head, "marks", "seed list", *ident_head, "notes"])
        for lab, _, d, seeds, r in body:
            vals = [(r.avg if b == "avg" else r.cells.get(b)) for b in cols]
            nums = ["" if v is None else f"{v[0]:.1f}" for v in vals]
            cis = [("" if b not in r.ci else f"{r.ci[b][i]:.1f}") for b in cols for i in (0, 1)] if with_ci else []
            cis += ["" if d is None or not d.ci else f"{d.ci[i]:.1f}" for i in (0, 1)] if with_ci and deltas else []
            note = "; ".join(x for x in ["from prior work (not run under the paper's recipe)" if r.prior else "",
                                         f"different or reduced protocol: {r.note}" if r.flagged else "",
                                         f"not the paper's protocol: {r.not_paper}" if beside_paper and r.not_paper else "",
                                         f"never acted: {r.never_acted}" if r.never_acted else ""] if x)
            name = _title(r.label) if not r.paper else r.label
            idents = [_identity_column(r, f) for f in (*IDENTITY_FIELDS, "paper")]
            w.writerow([name, *nums, *(["" if d is None else f"{d.value:.1f}"] if deltas else []),
                        *([x.replace("–", "") for x in seeds.split(" | ")] if with_step else [seeds]), *cis,
                        mark_text(r, beside_paper).strip(), " ".join(r.seeds), *idents, note])
        for rep_ in [*info.get("replaced", []), *info.get("reader_notes", [])]:
            w.writerow([f"# {rep_}"])
        return buf.getvalue()
    notes = []
    if any(r.prior for r in rows):
        notes.append("† copied by the paper from prior work (not run under its recipe)")
    if any(r.flagged for r in rows):
        notes.append("* made under a different or reduced protocol: " + "; ".join(
            f"{_title(r.label)}: {r.note}" for r in rows if r.flagged and r.note))
    if beside_paper and any(r.not_paper for r in rows):
        notes.append("‡ not the paper's protocol (samples, temperature, top_p or all problems): " + "; ".join(
            f"{_title(r.label)}: {r.not_paper}" for r in rows if r.not_paper))
    if any(r.never_acted for r in rows):
        notes.append("§ the method never acted in these runs, so they ran as its baseline: " + "; ".join(
            f"{_title(r.label)}: {r.never_acted}" for r in rows if r.never_acted))
    if info.get("why"):
        notes.append("No best is marked and no Δ is given where rows differ in more than the method or model: "
                     + "; ".join(info["why"]))
    notes += info.get("reader_notes", [])
    if info.get("no_delta"):
        notes.append("No Δ for " + "; ".join(info["no_delta"]))
    if with_ci and info.get("paired"):
        kinds = sorted({d.kind for d in deltas.values() if d is not None and d.ci}) if deltas else []
        what = {"t95": "95% t-interval", "range": "min-max range"}
        notes.append("Δ intervals: paired by seed (" + " / ".join(what[k] for k in kinds) + " of the per-seed "
                     "differences from the baseline): " + "; ".join(info["paired"]))
    if with_ci and info.get("unpaired"):
        notes.append("No Δ interval where the two rows have different seeds: " + "; ".join(info["unpaired"]))
    if with_ci and info.get("intervals"):
        kinds = {"t95": "95% t-interval over 3+ seeds", "range": "min-max range of 2 seeds",
                 "problems": "one seed: 95% bootstrap over problems"}
        notes.append("Intervals: " + "; ".join(kinds[k] for k in info["intervals"]))
    for rep in info.get("replaced", []):
        notes.append(f"Seed repeated: {rep}")
    if metric.startswith("maj@"):
        notes.append(f"{metric}: the expected majority vote over {metric[4:]} of the samples; answers that tie for most "
                     "votes go to the one seen first, so it can be below avg@N (benchmarks/evaluation/metrics.py)")
    if fmt == "md":
        lines = [f"Metric: {mlabel} ({n_txt})", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
        for lab, cells, d, seeds, _ in body:
            cs = [f"**{c}**" if b else c for c, b in cells]
            lines.append("| " + " | ".join([lab, *cs, *([dtxt(d)] if deltas else []), seeds]) + " |")
        return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
    if fmt == "latex":
        esc = lambda s: s.replace("%", "\\%").replace("&", "\\&").replace("_", "\\_").replace("±", "$\\pm$").replace("†", "$^\\dagger$").replace("Δ", "$\\Delta$")  # noqa: E731
        cols = "l" + "c" * (len(header) - 1)
        bold = " Best per column in bold." if any_best else ""
        out = ["\\begin{table}[t]", "\\centering", f"\\caption{{Accuracy ({esc(mlabel)}, {n_txt}).{bold}}}",
               f"\\begin{{tabular}}{{{cols}}}", "\\toprule", " & ".join(esc(h) for h in header) + " \\\\", "\\midrule"]
        for lab, cells, d, seeds, _ in body:
            cs = [f"\\textbf{{{esc(c)}}}" if b else esc(c) for c, b in cells]
            out.append(" & ".join([esc(lab), *cs, *([esc(dtxt(d))] if deltas else []), seeds.replace(" | ", " & ")])
                       + " \\\\")
        out += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(out + [f"% {esc(n)}" for n in notes]) + "\n"
    raise StareError(f"unknown format '{fmt}'")


def print_rich(rows: list[Row], info: dict, deltas, benches=PAPER_ORDER, with_ci: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    data = json.loads(render(rows, info, "json", deltas, benches))
    mlabel = {"avg": "avg@N"}.get(info["metric"], info["metric"])
    md = render(rows, info, "md", deltas, benches, with_ci).splitlines()
    bold = "; best per column in bold" if info.get("best_marked") else ""
    t = Table(title=f"Accuracy, {mlabel} (N={'/'.join(map(str, info['ns']))}){bold}")
    t.add_column("Method")
    for b in benches:
        t.add_column(BENCHMARKS[b].title, justify="right")
    t.add_column("Avg", justify="right")
    if deltas:
        t.add_column("Δ Avg", justify="right")
    if any(r.step for r in rows):
        t.add_column("step", justify="right")
    t.add_column("seeds", justify="right")
    table_lines = [ln for ln in md if ln.startswith("| ") and not ln.startswith("| Method")]
    for ln, r in zip(table_lines, data["rows"]):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        cells = [f"[bold]{c[2:-2]}[/bold]" if c.startswith("**") else c for c in cells]
        t.add_row(*cells, style="dim" if r["paper"] else None)
    c = table_console()
    c.print(t)
    for ln in md:
        if ln and not ln.startswith(("|", "Metric:")):
            c.print(ln, markup=False)


def write_plots(results: list[Result], plot_dir: Path, h_tgt: Optional[float] = None) -> list[Path]:
    """The training-dynamics plot (runs with metrics, one label per method/variant, seeds together;
    H_tgt from the first run's config when not given) and the pass@k plot, under `plot_dir`."""
    from stare_cli.analysis.plots import plot_dynamics

    runs_with_rows: dict[str, list] = {}
    for r in results:
        if r.metrics_rows:  # with the run's step-0 evaluation, which no metrics row holds
            runs_with_rows.setdefault(_title(r.label), []).append(with_eval_points(Path(r.source), r.metrics_rows))
    made: list[Path] = []
    if runs_with_rows:
        if h_tgt is None:
            cfgs = [Path(r.source) / "config.yaml" for r in results if (Path(r.source) / "config.yaml").exists()]
            if cfgs:
                h_tgt = yaml.safe_load(cfgs[0].read_text())["method"]["stare"]["h_tgt"]
        made += plot_dynamics(runs_with_rows, plot_dir / "dynamics", h_tgt=h_tgt)
    made += passk_plot(results, plot_dir)
    return made


def legend_labels(results: list[Result]) -> list[str]:
    """One legend entry per input, never two alike: the method and seed, then the folder if still ambiguous."""
    first = [f"{_title(r.label)} (seed {r.seed})" for r in results]
    return [f"{v} {Path(r.source).name}" if first.count(v) > 1 else v for v, r in zip(first, results)]


@dataclass
class PassKCurve:
    """pass@k against k for one legend entry: one run, or the mean over a label's seeds with a 95%
    bootstrap interval (lo/hi empty for a single run)."""

    ks: list[int]
    mean: list[float]
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)


def passk_curves(results: list[Result], bench: str) -> dict[str, PassKCurve]:
    """The pass@k curves to draw for a benchmark, by legend entry: the results of one label and one identity
    (the ledger's pool_key: they differ in the seed alone) become one curve, the mean over their seeds with
    `seed_interval`'s interval (95% t for 3+ seeds, the range for 2) where there are several; results of
    one label under different identities are separate curves named by what differs."""
    from benchmarks.evaluation.metrics import PERCENT, seed_interval

    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        if r.metrics.get(bench):
            groups.setdefault((r.label, pool_key(_fields(r, bench))), []).append(r)
    by_label: dict[str, list[tuple[str, str]]] = {}
    for key in groups:
        by_label.setdefault(key[0], []).append(key)
    out: dict[str, PassKCurve] = {}
    for label, keys in by_label.items():
        tags = labels_by_difference([_fields(groups[k][0], bench) for k in keys], skip=("paper",))
        for key, tag in zip(keys, tags):
            rs = list({r.seed: r for r in groups[key]}.values())  # one per seed (a repeat: the later)
            name = _title(label) + (f" [{tag}]" if tag else "")
            ks_of = [sorted(int(k.split("@")[1]) for k in r.metrics[bench] if k.startswith("pass@")) for r in rs]
            ks = sorted(set(ks_of[0]).intersection(*ks_of[1:]))
            if len(rs) > 1:
                vals = [[r.metrics[bench][f"pass@{k}"] for r in rs] for k in ks]
                cis = [seed_interval(v, within=PERCENT) for v in vals]
                what = {"t95": "95% t-interval", "range": "range"}[cis[0][2]] if cis else ""
                out[f"{name} ({len(rs)} seeds, mean, {what})"] = PassKCurve(
                    ks, [sum(v) / len(v) for v in vals], [c[0] for c in cis], [c[1] for c in cis])
            else:
                out[f"{name} (seed {rs[0].seed})"] = PassKCurve(ks, [rs[0].metrics[bench][f"pass@{k}"] for k in ks])
    return out


def _fields(r: Result, bench: str) -> dict:
    return r.protocol[bench]._asdict() if bench in r.protocol else {}


def passk_plot(results: list[Result], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {b for r in results for b in r.metrics}
    benches = [b for b in PAPER_ORDER if b in present] + sorted(present - set(PAPER_ORDER))
    if not benches:
        return []
    fig, axes = plt.subplots(1, len(benches), figsize=(3.6 * len(benches), 3.2), squeeze=False)
    for ax, b in zip(axes[0], benches):
        for name, curve in passk_curves(results, b).items():
            line, = ax.plot(curve.ks, curve.mean, marker="o", markersize=3 if curve.lo else 5, label=name)
            if curve.lo:
                ax.fill_between(curve.ks, curve.lo, curve.hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_title(BENCHMARKS[b].title)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # each panel its own: a label may be on some benchmarks only
            ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "passk")
