"""The run directory layout; the one module that knows it.

runs/<recipe>__<method>__seed<k>__<YYYYmmdd-HHMMSS>/
    config.yaml        the fully resolved recipe in effect (after any resume overrides)
    config-history.jsonl  one row per start, resume and restart: step, overrides, the keys they changed,
                          argv, commit
    meta.json          git SHA, command line, package versions, host, device (of the start the steps
                       count from: the first, or the last --restart)
    metrics.jsonl      one JSON object per training step (and eval rows with "eval/..." keys)
    checkpoints/       step-<n>/ (model.safetensors, trainer.pt, state.json, manifest.json);
                       `latest` names the newest
    samples/           step-<n>.jsonl rollout samples
    eval/              evaluation outputs (results.json, samples.jsonl per benchmark)

Guarantees (docs/guide/reliability.md): run directories are created atomically (two processes never
share one); a checkpoint directory appears under its final name only once complete and fsynced, with
a manifest of its files' sizes written last; `latest` moves after that. A resume picks the newest
checkpoint whose manifest, safetensors header and state match the files, names any it skips, and
refuses (with `--restart` as the way out) when there is none.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from stare_cli.core.config import Recipe
# The run directory is written with the kernel's file I/O; these names are also imported from here by the
# trainer, the sweep and the card (stare_kernel/io.py defines them).
from stare_kernel.io import (STATE, append_jsonl, atomic_write_text, checkpoint_problem,  # noqa: F401
                             environment_summary, file_sha256, fsync_dir, fsync_tree, git_sha, hold_run_lock,
                             read_jsonl, save_pretrained_readable, source_diff, write_manifest)


def run_name(recipe: Recipe, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{recipe.name.replace('/', '-')}__{recipe.method.name}__seed{recipe.optim.seed}__{stamp}"


def refuse_run_dir_as_parent(root: Path, what: str = "--out") -> None:
    """StareError when `root`, a folder that should hold run directories, is itself a run directory (its
    config.yaml and meta.json): a new run would be written inside another run's records."""
    from stare_kernel.errors import StareError

    root = Path(root)
    if (root / "config.yaml").is_file() and (root / "meta.json").is_file():
        raise StareError(f"{what} {root} is a run directory: new runs are created inside a parent folder",
                         hint=f"to continue that run: stare train --resume {root}; else choose its parent, "
                              f"e.g. {what} {root.parent}")


def make_out_dir(path: str | Path, what: str, hint: str) -> Path:
    """Create the folder `path` (and its parents) for `what` (an option, e.g. "--out"), or a StareError
    naming it and why not: a file in the way, or a folder this user cannot write."""
    from stare_kernel.errors import StareError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file" if blocker is not None else e.strerror
        raise StareError(f"{what} {path}: cannot create that folder ({why})", hint=hint) from None
    return path


def new_run_dir(recipe: Recipe, root: str | Path = "runs") -> Path:
    """Create a fresh run directory. `mkdir` either creates the directory or fails, so two processes
    starting in the same second never share one: the loser takes the next suffix (-2, -3, ...)."""
    from stare_kernel.errors import StareError

    refuse_run_dir_as_parent(Path(root))
    try:
        path = make_unique_dir(Path(root) / run_name(recipe))
    except OSError as e:  # --out is a file, or a folder this user cannot write; or the name is too long
        import errno

        if e.errno == errno.ENAMETOOLONG:
            name = run_name(recipe)
            raise StareError(f"the run's name is {len(name.encode())} bytes, more than this filesystem allows for a "
                             f"folder name (255): it is built from the recipe's name '{recipe.name[:60]}...'",
                             hint="give the recipe a shorter `name:` (or -o name=...)") from None
        why = "it is a file" if Path(root).is_file() else e.strerror
        raise StareError(f"--out {root}: cannot create a run directory there ({why})",
                         hint="choose a folder you can write, e.g. --out runs") from None
    for sub in ("checkpoints", "samples", "eval"):
        (path / sub).mkdir()
    return path


def make_unique_dir(base: Path) -> Path:
    """Create `base`, or `base-2`, `base-3`, ... (the first that does not exist), atomically."""
    base.parent.mkdir(parents=True, exist_ok=True)
    i = 1
    while True:
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            i += 1


def with_eval_points(run_dir: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's metrics rows preceded by its own evaluations at steps no row has (step 0's, made before
    any training step): what a dynamics plot draws, so that its evaluation panel starts at step 0."""
    trained = {r.get("step") for r in rows}
    return [p for p in run_eval_points(run_dir) if p["step"] not in trained] + rows


def run_eval_points(run_dir: Path) -> list[dict[str, Any]]:
    """The run's own evaluations (eval/step-N/<bench>/results.json, written by `stare train`, step 0
    included) as metrics rows, oldest step first: {"step": N, "eval/<bench>/acc": avg@n / 100,
    "eval/<bench>/len": mean length}. Unreadable files are left out (compare names them)."""
    import re

    by_step: dict[int, dict[str, Any]] = {}
    for f in sorted((Path(run_dir) / "eval").glob("step-*/*/results.json")):
        try:
            res = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        m = re.search(r"@step-(\d+)$", str(res.get("settings", {}).get("model", "")))
        metrics, bench = res.get("metrics", {}), res.get("benchmark")
        if not m or not bench or f"avg@{metrics.get('n')}" not in metrics:
            continue
        row = by_step.setdefault(int(m.group(1)), {"step": int(m.group(1))})
        row[f"eval/{bench}/acc"] = metrics[f"avg@{metrics['n']}"] / 100
        if "len/mean" in metrics:
            row[f"eval/{bench}/len"] = metrics["len/mean"]
    return [by_step[k] for k in sorted(by_step)]


def write_run_meta(run_dir: Path, recipe: Recipe, extra: dict[str, Any] | None = None) -> None:
    from stare_cli.core.recipes import recipe_to_yaml

    atomic_write_text(run_dir / "config.yaml", recipe_to_yaml(recipe))
    meta = {"git_sha": git_sha(), **environment_summary(), **(extra or {})}
    atomic_write_text(run_dir / "meta.json", json.dumps(meta, indent=2))


def record_config(run_dir: Path, recipe: Recipe, event: str, step: int, overrides: list[str],
                  changed: dict[str, list] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write the recipe in effect to config.yaml and append what happened to config-history.jsonl:
    `event` (start, resume, restart), the step training continues from, the overrides given and the
    keys they changed ([old, new])."""
    from stare_cli.core.recipes import recipe_to_yaml

    atomic_write_text(run_dir / "config.yaml", recipe_to_yaml(recipe))
    sha = git_sha()
    row = {"event": event, "step": step, "overrides": list(overrides), "changed": changed or {},
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": sha, "argv": sys.argv, **(extra or {})}
    diff = source_diff() if sha and sha.endswith("-dirty") else None
    if diff:  # what the code ran beyond its commit, kept beside the records it made
        name = f"source-{event}-step{step}.diff"
        atomic_write_text(run_dir / name, diff)
        row["source_diff"] = name
    append_jsonl(run_dir / "config-history.jsonl", row)


# ----------------------------------------------------------------------------------- checkpoints
def checkpoint_steps(run_dir: Path) -> list[Path]:
    """The run's step-N checkpoint directories (N digits only: a folder named step-zzz is not one, so
    it never counts toward checkpoint.keep_last), newest first by step."""
    root = run_dir / "checkpoints"
    steps = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]), reverse=True)


def usable_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from: the newest intact one (a checkpoint appears under its final name
    only when complete, and `latest` moves after that, so a run killed in between has a newer intact
    checkpoint than `latest` names). Returns it (None when there is none) and the reasons for every
    newer one skipped (a dangling `latest` among them)."""
    latest = run_dir / "checkpoints" / "latest"
    skipped: list[str] = []
    candidates = checkpoint_steps(run_dir)
    if latest.is_symlink() or latest.exists():
        target = latest.resolve()
        if not target.exists():
            skipped.append(f"{latest} points to {target.name}, which does not exist")
    for c in candidates:
        problem = checkpoint_problem(c)
        if problem is None:
            return c, skipped
        skipped.append(problem)
    return None, skipped


def clean_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the half-written checkpoint directories a killed run leaves (`.tmp-step-*`)."""
    gone = []
    for tmp in (run_dir / "checkpoints").glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        gone.append(tmp)
    return gone


def run_total_steps(run_dir: Path) -> int | None:
    """A run directory's optim.total_steps (its config.yaml), None when unreadable."""
    import yaml

    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["total_steps"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def run_finished(run_dir: Path) -> bool:
    """Whether a run directory's newest checkpoint is its last step (config.yaml's optim.total_steps),
    for either backend's checkpoint layout."""
    total = run_total_steps(run_dir)
    if total is None:
        return False
    ckpt, _ = usable_checkpoint(run_dir)
    if ckpt is not None:
        return json.loads((ckpt / STATE).read_text()).get("step") == total
    return verl_checkpoint(run_dir)[0] == total


VERL_TRACKER = "latest_checkpointed_iteration.txt"  # verl's: the step its resume_mode=auto loads


def is_verl_checkpoint(path: Path) -> bool:
    """A verl checkpoint directory (global_step_N with actor/ shards)."""
    path = Path(path)
    return path.name.startswith("global_step_") and (path / "actor").is_dir()


def verl_checkpoint(run_dir: Path) -> tuple[int | None, list[str]]:
    """The step a verl run directory resumes from: the one verl's tracker file names when its
    global_step_N/actor exists, otherwise the newest global_step_N that has an actor/ (verl trains from
    scratch without a tracker, so `--resume` rewrites it to name this step). Returns the step (None
    when there is no checkpoint) and why the tracker was passed over (empty when it was used)."""
    ckpts = run_dir / "checkpoints"
    steps = sorted((int(n) for p in ckpts.glob("global_step_*")
                    if (n := p.name.removeprefix("global_step_")).isdigit() and is_verl_checkpoint(p)), reverse=True)
    tracker = ckpts / VERL_TRACKER
    try:
        named = tracker.read_text().strip()
    except FileNotFoundError:
        return (steps[0], [f"{tracker} does not exist"]) if steps else (None, [])
    except (OSError, UnicodeDecodeError) as e:
        why = f"{tracker}: unreadable ({type(e).__name__})"
    else:
        if named.isdigit() and int(named) in steps:
            return int(named), []
        why = (f"{tracker} names step {named!r}, whose global_step_{named}/actor does not exist"
               if named.isdigit() else f"{tracker} holds {named[:40]!r}, not a step number")
    return (steps[0] if steps else None), [why]
