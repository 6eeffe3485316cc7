"""`stare compare`: runs and evaluations beside each other and beside the paper's Table 2.

Inputs are training run directories (evaluation results under `eval/`, `metrics.jsonl`) and
`stare eval` output directories (`<bench>/results.json`). Rows are grouped by method and protocol:
mean ± std over seeds with the seed count. Results made under different protocols (N,
temperature, top_p, template, max tokens, or a --limit) are never averaged together: they get
separate rows, flagged. The paper's published numbers ship as package data.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import NamedTuple, Optional

import yaml

from benchmarks.data.registry import BENCHMARKS, PAPER_ORDER
from stare_cli.core.config import dotted_items
from stare_cli.core.errors import StareError, table_console
from stare_cli.core.runs import read_jsonl, with_eval_points
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
    """One evaluated model (one seed): metric per benchmark, with the protocol it was made under."""

    label: str  # the method (runs) or the model name (eval directories)
    seed: Optional[int]
    source: str
    metrics: dict[str, dict] = field(default_factory=dict)  # bench -> metrics
    protocol: dict[str, Identity] = field(default_factory=dict)  # bench -> what was measured (Identity)
    metrics_rows: list[dict] = field(default_factory=list)
    config: dict[str, object] = field(default_factory=dict)  # what makes this run differ from another of its label


# Recipe keys that tell runs of one method apart (the seed makes seeds of one run, not a new run).
_NOT_A_VARIANT = ("name", "description", "optim.seed", "optim.total_steps", "logging.", "checkpoint.", "eval.",
                  "backend.embedded.", "backend.verl.nnodes", "backend.verl.n_gpus_per_node", "backend.verl.shared_dir",
                  "backend.verl.device", "backend.verl.extra_overrides", "paper")


def _variant(cfg: dict) -> dict[str, object]:
    return {k: v for k, v in dotted_items(cfg).items() if not k.startswith(_NOT_A_VARIANT) and k not in _NOT_A_VARIANT}


class Identity(NamedTuple):
    """What one benchmark's result measured, apart from the sampling seed: results pool as seeds only when
    every field is equal; rows that differ are labelled by the fields that differ."""

    N: int
    T: float
    top_p: float
    template: str
    max: int
    limited: bool
    problems: Optional[int] = None  # how many problems were graded
    data: Optional[str] = None  # SHA-256 (first 12 hex digits) of the problems and golds
    grader: Optional[str] = None  # name@version
    engine: Optional[str] = None  # hf, vllm, lm-eval-hf, ...
    dtype: Optional[str] = None
    tools: Optional[str] = None
    step: Optional[int] = None  # a training run's evaluation: the step it was made at
    paper: Optional[bool] = None  # the benchmark's paper protocol (n, temperature, top_p, all problems)


_IDENTITY_FIELDS = Identity._fields


def _identity(res: dict, step: Optional[int] = None) -> Identity:
    """The identity of one results.json (fields missing from older files stay None)."""
    p, s = res["protocol"], res.get("settings", {})
    spec = BENCHMARKS.get(res["benchmark"])
    data = res.get("data")
    if isinstance(data, dict) and "partial" in data:  # recorded: a --limit, a smaller local file, a subset
        limited = bool(data["partial"])
    else:  # results written before the data record: from the settings
        limited = s.get("limit") is not None and (spec is None or res["metrics"].get("problems", 0) < spec.size)
    sha = (data.get("sha256") if isinstance(data, dict) else None) or s.get("data")
    return Identity(p["n"], p["temperature"], p["top_p"], p["template"], p["max_tokens"], limited,
                    problems=res.get("metrics", {}).get("problems"), data=sha[:12] if sha else None,
                    grader=res.get("grader"), engine=s.get("engine"), dtype=s.get("dtype"), tools=s.get("tools"),
                    step=step if step is not None else res.get("step"), paper=p.get("paper_protocol"))


RESULTS_KEYS = {"benchmark": (), "metrics": (), "settings": ("model",),
                "protocol": ("n", "temperature", "top_p", "template", "max_tokens")}


def _check_results_file(f: Path, res) -> None:
    """StareError naming `f` and what it lacks, when it is not a results file `stare eval` wrote."""
    missing = [k for k in RESULTS_KEYS if not isinstance(res, dict) or k not in res]
    missing += [f"{k}.{sub}" for k, subs in RESULTS_KEYS.items() if k not in missing for sub in subs
                if not isinstance(res[k], dict) or sub not in res[k]]
    if missing:
        raise StareError(f"{f}: not a results file `stare eval` wrote (no {', '.join(missing)})",
                         hint="remove it, or run the evaluation again to rewrite it")


def _collect_results(folder: Path) -> dict[str, dict]:
    """bench -> results.json found below `folder` (the newest when several)."""
    found: dict[str, tuple[float, dict]] = {}
    for f in folder.rglob("results.json"):
        try:
            res = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:  # never a table silently missing a result
            raise StareError(f"{f}: unreadable results file ({type(e).__name__})",
                             hint="remove it, or run the evaluation again to rewrite it") from None
        _check_results_file(f, res)
        b = res.get("benchmark")
        if b and (b not in found or f.stat().st_mtime > found[b][0]):
            found[b] = (f.stat().st_mtime, res)
    return {b: r for b, (_, r) in found.items()}


def _verl_results(run: Path, cfg: dict, rows: list[dict]) -> dict[str, dict]:
    """bench -> a results.json-like dict from a verl run's mirrored validation metrics (the last
    step that validated): verl's `val-core/<bench>/acc/mean@N` is avg@N over the validation set."""
    import re

    pat = re.compile(r"^val-core/(.+)/acc/mean@(\d+)$")
    latest: dict[str, tuple[int, int, float]] = {}
    for row in rows:
        for k, v in row.items():
            m = pat.match(k)
            if m:
                latest[m.group(1)] = (int(row.get("step", 0)), int(m.group(2)), float(v))
    if not latest:
        return {}
    counts: dict[str, int] = {}
    meta = json.loads((run / "meta.json").read_text()) if (run / "meta.json").exists() else {}
    val = next((o.split("=", 1)[1] for o in meta.get("overrides", []) if o.startswith("data.val_files=")), "")
    for f in val.strip("[]").split(","):
        try:
            import pandas as pd

            df = pd.read_parquet(f, columns=["data_source"])
            for src, c in df["data_source"].value_counts().items():
                counts[str(src)] = counts.get(str(src), 0) + int(c)
        except Exception:  # the data may live on the cluster only
            continue
    ev, ro = cfg.get("eval", {}), cfg.get("rollout", {})
    out = {}
    for bench, (step, n, acc) in latest.items():
        spec = BENCHMARKS.get(bench)
        problems = counts.get(bench) or (min(ev.get("limit") or spec.size, spec.size) if spec else 0)
        out[bench] = {
            "benchmark": bench, "step": step,
            "settings": {"model": str(run), "limit": ev.get("limit"), "seed": cfg.get("optim", {}).get("seed")},
            "protocol": {"n": n, "temperature": ev.get("temperature"), "top_p": ev.get("top_p"),
                         "template": cfg.get("data", {}).get("template"), "max_tokens": ro.get("max_response_tokens")},
            "metrics": {"n": n, "problems": problems, f"avg@{n}": 100.0 * acc},
        }
    return out


def _run_evaluations(run: Path) -> dict[int, dict[str, dict]]:
    """step -> bench -> results.json of the run's own evaluations: those the trainer made (settings.model
    '<run dir>@step-N', under eval/step-N/). An ad-hoc `stare eval` of one of its checkpoints, written under
    the same eval/ folder, is not the run's row (compare that folder itself to see it)."""
    import re

    out: dict[int, dict[str, tuple[float, dict]]] = {}
    for f in (run / "eval").rglob("results.json"):
        try:
            res = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StareError(f"{f}: unreadable results file ({type(e).__name__})",
                             hint="remove it, or run the evaluation again to rewrite it") from None
        m = re.search(r"@step-(\d+)$", str(res.get("settings", {}).get("model", "")))
        b = res.get("benchmark")
        if not m or not b:
            continue
        cur = out.setdefault(int(m.group(1)), {})
        if b not in cur or f.stat().st_mtime > cur[b][0]:
            cur[b] = (f.stat().st_mtime, res)
    return {st: {b: r for b, (_, r) in bs.items()} for st, bs in out.items()}


def load_inputs(paths: list[Path], step: Optional[int] = None) -> list[Result]:
    """Results of run directories (each run's own evaluation at `step`, default its last evaluated step)
    and of `stare eval` output folders (each evaluation in them, per seed)."""
    out = []
    for p in paths:
        if not p.exists():
            raise StareError(f"compare: '{p}' does not exist")
        if (p / "config.yaml").exists():  # a training run
            cfg = yaml.safe_load((p / "config.yaml").read_text())
            r = Result(label=cfg["method"]["name"], seed=cfg["optim"]["seed"], source=str(p), config=_variant(cfg))
            r.metrics_rows = read_jsonl(p / "metrics.jsonl", strict=True)
            by_step = _run_evaluations(p) if (p / "eval").exists() else {}
            if not by_step and cfg.get("backend", {}).get("name") == "verl":
                rows = [x for x in r.metrics_rows if step is None or x.get("step") == step]
                results = _verl_results(p, cfg, rows)
                by_step = {max(x["step"] for x in results.values()): results} if results else {}
            if step is not None and by_step and step not in by_step:
                raise StareError(f"compare: {p} has no evaluation at step {step} (evaluated at steps "
                                 f"{', '.join(map(str, sorted(by_step)))})", hint="--step one of those, or drop --step")
            at = step if step is not None else (max(by_step) if by_step else None)
            results = by_step.get(at, {}) if at is not None else {}
            _fill(r, results, at)
            out.extend(_per_eval_seed(r, results, p))
            continue
        if not _collect_results(p):
            raise StareError(f"compare: '{p}' is neither a run directory nor holds results.json files")
        for results in _collect_evaluations(p):  # each `stare eval` into the folder: its own row(s)
            model = next(iter(results.values()))["settings"]["model"]
            r = Result(label=Path(model).name or model, seed=next(iter(results.values()))["settings"].get("seed"),
                       source=str(p), config={"model": model})
            _fill(r, results)
            out.extend(_per_eval_seed(r, results, p))
    return out


def _fill(r: Result, results: dict[str, dict], step: Optional[int] = None) -> None:
    for b, res in results.items():
        r.metrics[b] = res["metrics"]
        r.protocol[b] = _identity(res, step)


def _collect_evaluations(folder: Path) -> list[dict[str, dict]]:
    """bench -> results, once per evaluation written below an evaluation folder (the `evaluation` id
    every `stare eval` command records), under each benchmark folder's latest grader; newest last.
    Results written before the id existed form one evaluation of their newest per benchmark."""
    groups: dict[str, dict[str, tuple[float, dict]]] = {}
    for f in folder.rglob("results.json"):
        latest = json.loads(f.read_text())  # readable: _collect_results checked it
        grader = str(latest.get("grader", "")).split("@")[0]
        files = [g for g in sorted((f.parent / "results").glob("*.json")) if g.name.split("-", 1)[-1] == f"{grader}.json"]
        for g in files or [f]:  # a folder without per-setting files: its results.json alone
            try:
                res = json.loads(g.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise StareError(f"{g}: unreadable results file ({type(e).__name__})",
                                 hint="remove it, or run the evaluation again to rewrite it") from None
            ev, b, t = res.get("evaluation") or "", res.get("benchmark"), g.stat().st_mtime
            cur = groups.setdefault(ev, {})
            if b and (b not in cur or t > cur[b][0]):  # within one evaluation: its last seed (with over_seeds)
                cur[b] = (t, res)
    if not groups:
        return [_collect_results(folder)]
    ordered = sorted(groups.values(), key=lambda g: max(t for t, _ in g.values()))
    return [{b: res for b, (_, res) in g.items()} for g in ordered]


def _per_eval_seed(r: Result, results: dict[str, dict], source: Path) -> list[Result]:
    """One Result per evaluation seed where `stare eval --seed A --seed B ...` recorded them
    (`over_seeds`: the seeds' results files), so that rows show mean ± std over them like training
    seeds; else [r]. A seed's file that is gone is an error, never a silently smaller spread."""
    spread = {b: res["over_seeds"] for b, res in results.items() if res.get("over_seeds")}
    if not spread:
        return [r]
    k = max(len(sp["results"]) for sp in spread.values())
    out = []
    for i in range(k):
        ri = Result(label=r.label, seed=r.seed, source=r.source, protocol=dict(r.protocol),
                    metrics_rows=r.metrics_rows if i == 0 else [], config=r.config)
        for b, m in r.metrics.items():
            if b not in spread:
                ri.metrics[b] = m if i == 0 else None
                continue
            files = list(source.rglob(spread[b]["results"][i])) if i < len(spread[b]["results"]) else []
            if not files:
                raise StareError(f"{source}: {b}'s seed {i + 1} results file is missing ({spread[b]['results'][i]})",
                                 hint="run the evaluation with the same seeds again to rewrite it")
            res = json.loads(files[0].read_text())
            ri.metrics[b] = res["metrics"]
            ri.protocol[b] = _identity(res, r.protocol[b].step)
            ri.seed = res.get("settings", {}).get("seed", ri.seed)  # each seed's own (a repeat replaces it)
        ri.metrics = {b: m for b, m in ri.metrics.items() if m is not None}
        out.append(ri)
    return out


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
    seed_avgs: dict[int, float] = field(default_factory=dict)  # seed -> its average over the benchmarks


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
    lacks: the step of an evaluation that is not a training run's)."""
    out = []
    for i, name in enumerate(_IDENTITY_FIELDS):
        vals = []
        for x in ids:
            if x[i] not in vals:
                vals.append(x[i])
        if len(vals) > 1:
            out.append(f"{name} {'/'.join('-' if v is None else str(v) for v in vals)}")
    return out


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
                if b in r.protocol and r.protocol[b] not in protos[b]:
                    protos[b].append(r.protocol[b])
    mixed = {b for b, ps in protos.items() if len(ps) > 1}
    why = [f"{BENCHMARKS[b].title if b in BENCHMARKS else b}: {', '.join(_differences(protos[b]))}" for b in benches
           if b in mixed]
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
                    seed_avgs[int(r.seed)] = per_seed_avgs[-1]
        avg = (statistics.fmean(per_seed_avgs), statistics.stdev(per_seed_avgs) if len(per_seed_avgs) > 1 else 0.0,
               len(per_seed_avgs)) if per_seed_avgs else None
        proto = {b: p for r in rs for b, p in r.protocol.items()}
        flagged = any(b in mixed for b in proto)
        lim = any(p.limited for p in proto.values())
        note = "; ".join(f"{b}: {_describe(p)}" for b, p in proto.items() if b in mixed) if flagged else (
            "limited" if lim else "")
        if len(per_seed_avgs) > 1:
            lo, hi, kind = seed_interval(per_seed_avgs, within=PERCENT)
            ci["avg"] = (lo, hi)
            kinds.add(kind)
        steps = sorted({p.step for p in proto.values() if p.step is not None})
        not_paper = [f"{b}: {_describe(p)}" for b, p in proto.items() if p.paper is False]
        rows.append(Row(names[(label, conf)], cells, avg, ci=ci, flagged=flagged or lim, note=note,
                        identity=proto, step="/".join(map(str, steps)), not_paper="; ".join(not_paper),
                        seed_avgs=seed_avgs))
    ns = sorted({r.metrics[b]["n"] for rs in groups.values() for r in rs for b in r.metrics})
    return rows, {"metric": metric, "ns": ns, "mixed": sorted(mixed), "why": why, "replaced": replaced,
                  "intervals": sorted(kinds)}


def _describe(p: Identity) -> str:
    """One benchmark's identity in a note: 'N=4 T=0.6 top_p=1.0 short max=64 limited (64 problems) grader=...'."""
    txt = f"N={p.N} T={p.T} top_p={p.top_p} {p.template} max={p.max}"
    txt += f" limited ({p.problems} problems)" if p.limited else ""
    txt += "".join(f" {k}={getattr(p, k)}" for k in ("grader", "engine", "step") if getattr(p, k) is not None)
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
                        parts.append(f"{name}={mine[i]}")
            out[k] = f"{label} [{', '.join(parts)}]" if parts else label
    return out


def paper_rows(scenario: str, benches: tuple[str, ...] = PAPER_ORDER) -> list[Row]:
    if scenario not in PAPER_MODELS:
        from stare_cli.core.errors import did_you_mean

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
        raise StareError(f"compare: no row for baseline '{baseline}' with all benchmarks",
                         hint="name a method present in the inputs or the paper rows")
    out: dict[int, Optional[Delta]] = {}
    for i, r in enumerate(rows):
        diff = [] if (r.paper or base.paper or r is base) else [
            f"{b}: {', '.join(_differences([base.identity[b], r.identity[b]]))}"
            for b in base.identity if b in r.identity and base.identity[b] != r.identity[b]]
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
        best[b] = max(vals) if len(vals) >= 2 and comparable else None  # bold means best of several
    body = []
    for i, r in enumerate(rows):
        label = _title(r.label) if not r.paper else r.label
        if fmt != "json":
            label += " †" if r.prior else ""
            label += " *" if r.flagged else ""
            label += " ‡" if beside_paper and r.not_paper else ""
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
            "rows": [{"label": lab, "paper": r.paper, "from_prior_work": r.prior, "flagged": r.flagged, "note": r.note,
                      "step": r.step or None, "not_paper_protocol": r.not_paper or None,
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
        w.writerow([*header, *ci_head, "notes"])
        for lab, _, d, seeds, r in body:
            vals = [(r.avg if b == "avg" else r.cells.get(b)) for b in cols]
            nums = ["" if v is None else f"{v[0]:.1f}" for v in vals]
            cis = [("" if b not in r.ci else f"{r.ci[b][i]:.1f}") for b in cols for i in (0, 1)] if with_ci else []
            cis += ["" if d is None or not d.ci else f"{d.ci[i]:.1f}" for i in (0, 1)] if with_ci and deltas else []
            note = "; ".join(x for x in ["from prior work (not run under the paper's recipe)" if r.prior else "",
                                         f"different or reduced protocol: {r.note}" if r.flagged else ""] if x)
            name = _title(r.label) if not r.paper else r.label
            w.writerow([name, *nums, *(["" if d is None else f"{d.value:.1f}"] if deltas else []),
                        *([x.replace("–", "") for x in seeds.split(" | ")] if with_step else [seeds]), *cis, note])
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
    if info.get("why"):
        notes.append("No best is marked and no Δ is given where rows differ in more than the method or model: "
                     + "; ".join(info["why"]))
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
        out = ["\\begin{table}[t]", "\\centering", f"\\caption{{Accuracy ({esc(mlabel)}, {n_txt}). Best per column in bold.}}",
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
    t = Table(title=f"Accuracy, {mlabel} (N={'/'.join(map(str, info['ns']))}); best per column in bold")
    t.add_column("Method")
    for b in benches:
        t.add_column(BENCHMARKS[b].title, justify="right")
    t.add_column("Avg", justify="right")
    if deltas:
        t.add_column("Δ Avg", justify="right")
    if any(r.step for r in rows):
        t.add_column("step", justify="right")
    t.add_column("seeds", justify="right")
    md = render(rows, info, "md", deltas, benches, with_ci).splitlines()
    table_lines = [ln for ln in md if ln.startswith("| ") and not ln.startswith("| Method")]
    for ln, r in zip(table_lines, data["rows"]):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        cells = [f"[bold]{c[2:-2]}[/bold]" if c.startswith("**") else c for c in cells]
        t.add_row(*cells, style="dim" if r["paper"] else None)
    c = table_console()
    c.print(t)
    for ln in md:
        if ln.startswith(("†", "*", "‡", "No ", "Intervals", "Δ intervals", "Seed repeated")):
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
    """The pass@k curves to draw for a benchmark, by legend entry: the seeds of one label (several
    runs with distinct seeds) become one mean curve with `seed_interval`'s interval (95% t for 3+ seeds,
    the range for 2); everything else one curve per run."""
    from benchmarks.evaluation.metrics import PERCENT, seed_interval

    labels = dict(zip(map(id, results), legend_labels(results)))
    by_label: dict[str, list[Result]] = {}
    for r in results:
        if r.metrics.get(bench):
            by_label.setdefault(r.label, []).append(r)
    out: dict[str, PassKCurve] = {}
    for label, rs in by_label.items():
        ks_of = [sorted(int(k.split("@")[1]) for k in r.metrics[bench] if k.startswith("pass@")) for r in rs]
        if len(rs) > 1 and len({r.seed for r in rs}) == len(rs) and all(ks == ks_of[0] for ks in ks_of):
            ks = ks_of[0]
            vals = [[r.metrics[bench][f"pass@{k}"] for r in rs] for k in ks]
            cis = [seed_interval(v, within=PERCENT) for v in vals]
            what = {"t95": "95% t-interval", "range": "range"}[cis[0][2]]
            out[f"{_title(label)} ({len(rs)} seeds, mean, {what})"] = PassKCurve(
                ks, [sum(v) / len(v) for v in vals], [c[0] for c in cis], [c[1] for c in cis])
        else:
            for r, ks in zip(rs, ks_of):
                out[labels[id(r)]] = PassKCurve(ks, [r.metrics[bench][f"pass@{k}"] for k in ks])
    return out


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
