"""The one reader of results: every record under any mix of paths, and a note for every results file
it does not show.

`find_records(paths)` takes run directories, sweep directories (or their `cells/`), `stare eval` output
folders, benchmark folders, and parents of any of them, walks them all, and returns every record once:
- `records/*.json` (the ledger, stare_kernel/ledger.py);
- results files written before the ledger (`results/<key>-<grader>.json`, `results.json`) that no record
  covers, as records of format 0 (their missing identity fields read 'unknown');
- a verl run's validation metrics (metrics.jsonl's `val-core/<bench>/acc/mean@N`), as records of format 0.
What it leaves out is named in `notes`: records another record supersedes, results files that are copies
of what is shown (a folder's `results.json`). A file that cannot be read is an error naming it, never a
table silently missing a result.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from stare_kernel.errors import StareError
from stare_kernel.io import read_jsonl
from stare_kernel.ledger import (IDENTITY_FIELDS, RECORDS, TRAINED, UNKNOWN, Record, is_run_dir, record_from_json,
                                 run_fields)

RESULTS_KEYS = {"benchmark": (), "metrics": (), "settings": ("model",),
                "protocol": ("n", "temperature", "top_p", "template", "max_tokens")}
_PRUNE = {"checkpoints", "lm_eval", "audit", "__pycache__", "wandb"}  # never hold results


@dataclass
class Found:
    records: list[Record] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_records(paths: Iterable[Path]) -> Found:
    """Every record under `paths` (each a folder that exists), each once, in a stable order (folder, then
    the time it was written). StareError naming a path that does not exist or a file that is unreadable."""
    found = Found()
    seen: set[str] = set()
    views = 0
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise StareError(f"'{p}' does not exist")
        if not p.is_dir():
            raise StareError(f"'{p}' is a file", hint="name the folder that holds it (a run, a sweep, an evaluation)")
        for dirpath, dirnames, files in os.walk(p):
            here = Path(dirpath)
            real = os.path.realpath(here)
            if real in seen:
                dirnames[:] = []
                continue
            seen.add(real)
            run = is_run_dir(here)
            dirnames[:] = sorted(d for d in dirnames if d not in _PRUNE and not d.startswith(".")
                                 and not (run and d == "samples") and d not in (RECORDS, "results"))
            if run and (here / "metrics.jsonl").exists():
                found.records.extend(verl_records(here))
            if RECORDS in os.listdir(here) or "results.json" in files or (here / "results").is_dir():
                recs, v = _folder_records(here)
                found.records.extend(recs)
                views += v
    gone = {i: r for r in found.records for i in r.supersedes}
    if gone:
        kept = []
        for r in found.records:
            if r.id in gone:
                found.notes.append(f"superseded: {r.path} (the same evaluation regraded with corrected golds: "
                                   f"{gone[r.id].path})")
            else:
                kept.append(r)
        found.records = kept
    if views:
        found.notes.append(f"{views} results file{'s' if views > 1 else ''} not shown as rows of their own: a "
                           "folder's results.json, a copy of its latest result, which is shown")
    return found


def _load(f: Path) -> dict:
    try:
        res = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise StareError(f"{f}: unreadable results file ({type(e).__name__})",
                         hint="remove it, or run the evaluation again to rewrite it") from None
    if not isinstance(res, dict):
        raise StareError(f"{f}: not a results file stare wrote", hint="remove it, or run the evaluation again")
    return res


def check_results_file(f: Path, res) -> None:
    """StareError naming `f` and what it lacks, when it is not a results file `stare eval` wrote."""
    missing = [k for k in RESULTS_KEYS if not isinstance(res, dict) or k not in res]
    missing += [f"{k}.{sub}" for k, subs in RESULTS_KEYS.items() if k not in missing for sub in subs
                if not isinstance(res[k], dict) or sub not in res[k]]
    if missing:
        raise StareError(f"{f}: not a results file `stare eval` wrote (no {', '.join(missing)})",
                         hint="remove it, or run the evaluation again to rewrite it")


def _folder_records(folder: Path) -> tuple[list[Record], int]:
    """A benchmark folder's records, then its older results files that no record covers; and the count of
    results files left out as copies of what is shown."""
    recs = [record_from_json(_load(f), f) for f in sorted((folder / RECORDS).glob("*.json"))]
    covered = {(r.samples_key, r.identity.get("grader")) for r in recs}
    views, legacy_seen = 0, set()
    for f in [*sorted((folder / "results").glob("*.json")), folder / "results.json"]:
        if not f.is_file():
            continue
        res = _load(f)
        check_results_file(f, res)
        k = (res.get("key"), res.get("grader"))
        if k in covered or k in legacy_seen:
            views += f.name == "results.json"
            continue
        legacy_seen.add(k)
        recs.append(legacy_record(res, f, folder))
    recs.sort(key=lambda r: r.written)
    return recs, views


def legacy_record(res: dict, path: Path, folder: Path) -> Record:
    """A results file written before the ledger, as a record of format 0: what it records, 'unknown' for the
    rest. An evaluation a trainer made ('<run>@step-N') takes method, recipe and learning rate from its run
    directory where that is still there."""
    s, p = res.get("settings", {}), res["protocol"]
    data = res.get("data") if isinstance(res.get("data"), dict) else {}
    sha = data.get("sha256") or s.get("data")
    m = re.search(r"^(.*)@step-(\d+)$", str(s.get("model", "")))
    ident = {k: UNKNOWN for k in IDENTITY_FIELDS}
    ident.update(ledger=0, benchmark=res["benchmark"], benchmark_version=res.get("benchmark_version", UNKNOWN),
                 data=sha or UNKNOWN, problems=res["metrics"].get("problems", UNKNOWN),
                 partial=bool(data["partial"]) if "partial" in data else s.get("limit") is not None,
                 n=p["n"], temperature=p["temperature"], top_p=p["top_p"], max_tokens=p["max_tokens"],
                 template=p["template"], tools=s.get("tools"), grader=res.get("grader", UNKNOWN),
                 dtype=s.get("dtype"), method=None, method_params=None, recipe=None, step=None, lr=None)
    if s.get("engine"):
        ident["engine"] = f"{s['engine']}@{UNKNOWN}"
    run, train_seed = None, None
    if m:
        run_dir = Path(m.group(1))
        ident.update(weights=TRAINED, step=int(m.group(2)), method=UNKNOWN, method_params=UNKNOWN, recipe=UNKNOWN,
                     lr=UNKNOWN)
        cfg = _run_config(run_dir)
        if cfg:
            ident.update(**run_fields(cfg), lr=step_lr(run_dir, int(m.group(2))))
            train_seed = cfg.get("optim", {}).get("seed")
            if s.get("seed") in (None, 0, train_seed):  # the trainer sampled with the run's seed
                s = {**s, "seed": train_seed}
        run = {"dir": str(run_dir), "name": run_dir.name}
    return Record(identity=ident, metrics=res["metrics"], seed=s.get("seed"), train_seed=train_seed, path=path,
                  folder=folder, samples_key=res.get("key"), evaluation=res.get("evaluation"), run=run,
                  written=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(path.stat().st_mtime)),
                  model_path=str(s.get("model")), extra={k: res[k] for k in ("protocol", "data", "harness", "step")
                                                         if k in res})


def _run_config(run_dir: Path) -> Optional[dict]:
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        return cfg if isinstance(cfg, dict) and isinstance(cfg.get("method"), dict) else None
    except (OSError, ValueError, yaml.YAMLError):
        return None


def step_lr(run_dir: Path, step: int) -> Optional[float]:
    """The learning rate a run logged at `step` (None at step 0, before any training; UNKNOWN where the
    metrics do not say)."""
    if step == 0:
        return None
    for r in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if r.get("step") == step and "lr" in r:
            return r["lr"]
    return UNKNOWN  # type: ignore[return-value]


def verl_records(run: Path) -> list[Record]:
    """A verl run's validation metrics as records of format 0, one per benchmark and step that validated:
    verl's `val-core/<bench>/acc/mean@N` is avg@N over the validation set."""
    pat = re.compile(r"^val-core/(.+)/acc/mean@(\d+)$")
    cfg = _run_config(run)
    if not cfg or cfg.get("backend", {}).get("name") != "verl":
        return []
    latest: dict[tuple[str, int], tuple[int, int, float]] = {}
    for row in read_jsonl(run / "metrics.jsonl"):
        for k, v in row.items():
            m = pat.match(k)
            if m:
                step = int(row.get("step", 0))
                latest[(m.group(1), step)] = (step, int(m.group(2)), float(v))
    if not latest:
        return []
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
    out = []
    for (bench, _), (step, n, acc) in latest.items():
        ident = {k: UNKNOWN for k in IDENTITY_FIELDS}
        ident.update(ledger=0, benchmark=bench, weights=TRAINED, **run_fields(cfg), step=step, lr=step_lr(run, step), n=n,
                     temperature=ev.get("temperature"), top_p=ev.get("top_p"),
                     template=cfg.get("data", {}).get("template"), max_tokens=ro.get("max_response_tokens"),
                     problems=counts.get(bench, UNKNOWN), partial=ev.get("limit") is not None or UNKNOWN,
                     engine=f"verl@{UNKNOWN}", tools=None)
        out.append(Record(identity=ident, metrics={"n": n, "problems": ident["problems"], f"avg@{n}": 100.0 * acc},
                          seed=cfg.get("optim", {}).get("seed"), train_seed=cfg.get("optim", {}).get("seed"),
                          path=run / "metrics.jsonl", folder=run, run={"dir": str(run), "name": run.name},
                          written=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime((run / "metrics.jsonl").stat().st_mtime)),
                          model_path=str(run), extra={"source": "verl-validation"}))
    return out
