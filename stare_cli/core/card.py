"""The reproduction card of a run: REPRODUCE.md in its run directory, from which a person can rerun it.

Written when a run starts (what it will run) and again when it stops, finished or not (how far it
got, its last metrics). Everything on it is read from the run directory's own records
(stare_cli/core/runs.py: meta.json, config.yaml, config-history.jsonl, metrics.jsonl, and for verl
runs verl_effective_config.json), so a card can be rebuilt at any time with `write_card(run_dir)`:
- the command as typed, and a command that reruns the run from its resolved recipe;
- the source commit (with `-dirty` when the checkout had uncommitted changes), package versions,
  Python, platform, host, device;
- the resolved recipe's SHA-256 (config.yaml), and the effective verl configuration's where verl ran;
- the data: local files with their SHA-256 (the training file, verl's parquet files, the evaluation
  data directory's files), named sources otherwise;
- the experiment tracker (wandb mode, project, run name, the local wandb folder);
- the steps done and the last training and evaluation metrics.
`card_row` gives the same facts as one table row (`stare compare --cards`).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import yaml

from stare_cli.core.runs import atomic_write_text, file_sha256, read_jsonl

CARD = "REPRODUCE.md"
TRAIN_KEYS = ("reward", "acc", "entropy", "len/mean", "grad_norm", "stare/gate")


def _load(run_dir: Path) -> dict[str, Any]:
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() else {}
    cfg_text = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").exists() else ""
    cfg = yaml.safe_load(cfg_text) or {}
    history = read_jsonl(run_dir / "config-history.jsonl") if (run_dir / "config-history.jsonl").exists() else []
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return {"meta": meta, "cfg": cfg, "cfg_text": cfg_text, "history": history, "rows": rows}


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def data_files(run_dir: Path, cfg: dict, meta: dict) -> list[tuple[str, str]]:
    """(what, sha256 or a note) for the data the run read: local files are hashed, named sources listed."""
    out: list[tuple[str, str]] = []
    train = str((cfg.get("data") or {}).get("train", ""))
    if train and Path(train).is_file():
        out.append((train, file_sha256(Path(train))))
    elif train:
        out.append((train, "named source (hub dataset or built-in set): no local file"))
    for key in ("data.train_files", "data.val_files"):  # verl: the parquet files `stare data prepare` wrote
        for f in _override_paths(meta, key):
            if Path(f).is_file():
                out.append((f, file_sha256(Path(f))))
    env_dir = meta.get("stare_data_dir") or os.environ.get("STARE_DATA_DIR")
    if env_dir and Path(env_dir).is_dir():
        for b in (cfg.get("eval") or {}).get("benchmarks") or []:
            f = Path(env_dir) / f"{b}.jsonl"
            if f.is_file():
                out.append((str(f), file_sha256(f)))
    return out


def _rerun(run_dir: Path, cfg: dict, meta: dict) -> str:
    m = (cfg.get("method") or {}).get("name", "?")
    backend = meta.get("backend") or (cfg.get("backend") or {}).get("name", "embedded")
    cmd = f"stare train --recipe {shlex.quote(str(run_dir / 'config.yaml'))} --method {m} --backend {backend}"
    for f in _override_paths(meta, "data.train_files")[:1]:  # verl: the directory `stare data prepare` wrote
        cmd += f" --data-dir {shlex.quote(str(Path(f).parent))}"
    return cmd + " --out runs"


def _typed(argv: Optional[list[str]]) -> str:
    """A recorded sys.argv as the command a person types (`stare ...`)."""
    return "stare " + " ".join(shlex.quote(a) for a in argv[1:]) if argv else "(not recorded)"


def _override_paths(meta: dict, key: str) -> list[str]:
    """The paths a verl run's override `key=...` gave (a path, or a list of them), from meta.json."""
    for o in meta.get("overrides") or []:
        k, _, val = str(o).partition("=")
        if k == key:
            return [f.strip().strip("'\"") for f in val.strip("[]").split(",") if f.strip().strip("'\"")]
    return []


def _tracker(run_dir: Path, cfg: dict) -> str:
    L = cfg.get("logging") or {}
    mode = L.get("wandb", "?")
    local = sorted(run_dir.glob("wandb/*run-*"))
    where = f"; local folder {local[-1]}" if local else ""
    return f"wandb {mode} (project {L.get('project')}, run {L.get('run_name') or run_dir.name}){where}"


def _last(rows: list[dict], pred) -> Optional[dict]:
    picked = [r for r in rows if pred(r)]
    return picked[-1] if picked else None


def card_row(run_dir: Path, d: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The card's facts as one row (run, commit, recipe hash, method, backend, step, packages); `d`:
    the run's records when already read."""
    d = d or _load(Path(run_dir))
    meta, cfg, rows = d["meta"], d["cfg"], d["rows"]
    pk = meta.get("packages", {})
    return {"run": Path(run_dir).name, "commit": meta.get("git_sha") or "unknown",
            "recipe_sha256": _sha(d["cfg_text"])[:12] if d["cfg_text"] else "-",
            "method": (cfg.get("method") or {}).get("name", "?"), "backend": meta.get("backend", "?"),
            "steps": max((int(r["step"]) for r in rows if "step" in r), default=0),
            "of": (cfg.get("optim") or {}).get("total_steps"),
            "torch": pk.get("torch", "-"), "verl": pk.get("verl", "-"), "host": meta.get("host", "-")}


def write_card(run_dir: Path, status: Optional[str] = None) -> Path:
    """Write run_dir/REPRODUCE.md from the run's records. `status`: what the trainer knows (started,
    resumed, finished, stopped); None, when a card is rebuilt from the records alone: finished if the
    last logged step reached the total, else "not finished" (the records cannot tell a running run
    from a stopped one)."""
    run_dir = Path(run_dir)
    d = _load(run_dir)
    meta, cfg, rows, history = d["meta"], d["cfg"], d["rows"], d["history"]
    first = next((h for h in history if h.get("event") == "start"), {})
    typed = _typed(first.get("argv") or meta.get("argv"))  # a --restart rewrites meta.json, not the start
    row = card_row(run_dir, d)
    if status is None:
        status = "finished" if row["of"] is not None and row["steps"] >= int(row["of"]) else "not finished"
    lines = [f"# Reproduction card: {run_dir.name}", "",
             f"Status: **{status}**, step {row['steps']} of {row['of']}. Written by stare from this run directory's "
             "records; rebuild it with `python -c \"from stare_cli.core.card import write_card; write_card('DIR')\"`.",
             "", "## Rerun", "", "As typed (the first start):", "", "```bash", typed, "```", "",
             "From the resolved recipe (every value in effect, whatever the defaults become):", "", "```bash",
             _rerun(run_dir, cfg, meta), "```", ""]
    if len(history) > 1:
        lines += ["Starts and resumes (config-history.jsonl):", ""]
        lines += [f"- {h.get('event')} at step {h.get('step')} ({h.get('time', '?')}): `{_typed(h.get('argv'))}`; "
                  f"overrides {h.get('overrides') or '[]'}, commit {h.get('git_sha')}"
                  + (f" (its uncommitted changes: `{h['source_diff']}`)" if h.get("source_diff") else "")
                  for h in history]
        lines.append("")
    pk = meta.get("packages", {})
    # meta.json describes the start the steps count from: the first, or the last --restart
    since = next((h for h in reversed(history) if h.get("event") in ("start", "restart")), {})
    about_commit = []
    if str(meta.get("git_sha", "")).endswith("-dirty"):
        about_commit.append("uncommitted changes in the checkout"
                            + (f": `{since['source_diff']}`" if since.get("source_diff") else ""))
    if since.get("event") == "restart":
        about_commit.append("of the restart the steps count from")
    lines += ["## Code and environment", "",
              f"- commit: `{meta.get('git_sha') or 'unknown (not a git checkout)'}`"
              + "".join(f" ({a})" for a in about_commit),
              f"- packages: {', '.join(f'{k} {v}' for k, v in pk.items()) or 'not recorded'}",
              f"- python {meta.get('python', '?')} on {meta.get('platform', '?')}, host {meta.get('host', '?')}",
              f"- backend {meta.get('backend', '?')}, device {meta.get('device', (cfg.get('backend') or {}).get('verl', {}).get('device', '?'))}; "
              f"this machine: {meta.get('cpus', '?')} CPUs, GPUs: {', '.join(meta.get('gpus') or []) or 'none'}"
              + (f"; verl: {(cfg.get('backend') or {}).get('verl', {}).get('nnodes')} node(s) x "
                 f"{(cfg.get('backend') or {}).get('verl', {}).get('n_gpus_per_node')} GPUs"
                 if meta.get("backend") == "verl" else ""),
              "", "## Configuration", "",
              f"- resolved recipe: `config.yaml`, SHA-256 `{_sha(d['cfg_text']) if d['cfg_text'] else '-'}`"]
    eff = run_dir / "verl_effective_config.json"
    if eff.exists():
        lines.append(f"- verl's effective configuration: `verl_effective_config.json`, SHA-256 `{file_sha256(eff)}`")
    if meta.get("reward_grader"):
        lines.append(f"- training reward grader: `{meta['reward_grader']}`")
    for note in meta.get("method_notes") or []:  # what the recipe makes of its method (method_warnings)
        lines.append(f"- note: {note}")
    lines += ["", "## Data", ""]
    lines += [f"- `{what}`: {h if len(h) != 64 else f'SHA-256 `{h}`'}" for what, h in data_files(run_dir, cfg, meta)] or ["- none recorded"]
    lines += ["", "## Tracking", "", f"- {_tracker(run_dir, cfg)}", "", "## Results", ""]
    last_train = _last(rows, lambda r: "step" in r and any(k in r for k in TRAIN_KEYS))
    if last_train:
        vals = ", ".join(f"{k} {last_train[k]:.4g}" for k in TRAIN_KEYS if isinstance(last_train.get(k), (int, float)))
        lines.append(f"- last training step {last_train['step']}: {vals}")
    last_eval = _last(rows, lambda r: any(k.startswith(("eval/", "val-core/")) for k in r))
    if last_eval:
        ev = {k: v for k, v in last_eval.items() if k.startswith(("eval/", "val-core/")) and isinstance(v, (int, float))}
        lines.append(f"- last evaluation (step {last_eval.get('step')}): "
                     + ", ".join(f"{k} {v:.4g}" for k, v in sorted(ev.items())[:12]))
    if not (last_train or last_eval):
        lines.append("- no metrics yet")
    lines += ["", "All metrics: `metrics.jsonl`; samples: `samples/`; evaluations: `eval/`.", ""]
    path = run_dir / CARD
    atomic_write_text(path, "\n".join(lines))
    return path


def cards_table(run_dirs: list[Path], fmt: str = "md") -> str:
    """The cards of several runs as one table (md, csv, json or latex; `stare compare --cards`)."""
    rows = [card_row(Path(d)) for d in run_dirs]
    if not rows:
        return ""
    keys = list(rows[0])
    if fmt == "json":
        return json.dumps(rows, indent=1) + "\n"
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue()
    if fmt == "latex":
        esc = lambda v: str(v).replace("_", "\\_").replace("%", "\\%")  # noqa: E731
        body = [" & ".join(esc(r[k]) for k in keys) + " \\\\" for r in rows]
        return ("\\begin{tabular}{" + "l" * len(keys) + "}\n" + " & ".join(esc(k) for k in keys) + " \\\\\n\\hline\n"
                + "\n".join(body) + "\n\\end{tabular}\n")
    head = "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
    return head + "".join("| " + " | ".join(str(r[k]) for k in keys) + " |\n" for r in rows)
