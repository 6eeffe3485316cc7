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

Guarantees (README, "Reliability"): run directories are created atomically (two processes never
share one); a checkpoint directory appears under its final name only once complete and fsynced, with
a manifest of its files' sizes written last; `latest` moves after that. A resume picks the newest
checkpoint whose manifest, safetensors header and state match the files, names any it skips, and
refuses (with `--restart` as the way out) when there is none.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stare_cli.core.config import Recipe


def run_name(recipe: Recipe, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{recipe.name.replace('/', '-')}__{recipe.method.name}__seed{recipe.optim.seed}__{stamp}"


def refuse_run_dir_as_parent(root: Path, what: str = "--out") -> None:
    """StareError when `root`, a folder that should hold run directories, is itself a run directory (its
    config.yaml and meta.json): a new run would be written inside another run's records."""
    from stare_cli.core.errors import StareError

    root = Path(root)
    if (root / "config.yaml").is_file() and (root / "meta.json").is_file():
        raise StareError(f"{what} {root} is a run directory: new runs are created inside a parent folder",
                         hint=f"to continue that run: stare train --resume {root}; else choose its parent, "
                              f"e.g. {what} {root.parent}")


def make_out_dir(path: str | Path, what: str, hint: str) -> Path:
    """Create the folder `path` (and its parents) for `what` (an option, e.g. "--out"), or a StareError
    naming it and why not: a file in the way, or a folder this user cannot write."""
    from stare_cli.core.errors import StareError

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
    from stare_cli.core.errors import StareError

    refuse_run_dir_as_parent(Path(root))
    try:
        path = make_unique_dir(Path(root) / run_name(recipe))
    except OSError as e:  # --out is a file, or a folder this user cannot write
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


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root` itself): after this, a crash or power
    cut cannot leave the tree half-written on a filesystem that honours fsync."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """fsync a directory: makes the creation, rename or removal of its entries durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: readers never see half a file. The
    file gets the mode a plain `open` would give it (0666 less the umask), not mkstemp's 0600:
    colleagues on shared storage read results as they read anything else of the user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_pretrained_readable(model, tokenizer, folder: Path) -> None:
    """`save_pretrained` of a model and its tokenizer, every file given the mode a plain `open` gives
    (0666 less the umask): safetensors writes its weights 0600, which left a shared run's or cache's
    weights unreadable by colleagues while every other file of it was readable."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    for f in Path(folder).iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~_UMASK)


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


def git_sha(cwd: Path | None = None) -> str | None:
    """The SHA of the source checkout this code runs from (None outside a git checkout)."""
    here = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def source_diff(cwd: Path | None = None) -> str | None:
    """`git diff HEAD` of the checkout this code runs from (tracked files, as `git_sha`'s -dirty sees them):
    what a dirty run ran beyond its commit; None when there is none or no checkout."""
    here = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "diff", "HEAD", "--no-color", "--no-ext-diff"], cwd=here, capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def environment_summary() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for pkg in ("stare-rl", "torch", "transformers", "math-verify", "verl", "vllm", "lm-eval"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    gpus: list[str] = []
    torch = sys.modules.get("torch")  # only when already loaded: this summary never imports torch
    if torch is not None and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "packages": versions,
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


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


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_jsonl(path: Path, strict: bool = False, torn_last_ok: bool = True,
               required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A torn last line (a crash mid-write) is ignored; with `strict`, any other
    line that is not a JSON object is an error naming the file and line (the last one too when not
    `torn_last_ok`: for readers that rewrite the file and must lose nothing). A row without one of
    the `required` fields is an error naming the file, line and field. Non-UTF-8 content is an error
    naming the file."""
    from stare_cli.core.errors import StareError

    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StareError(f"{path}: not UTF-8 text (byte {e.start})", hint="is this the file stare wrote?") from None
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            missing = [k for k in required if k not in row]
            if missing:
                raise StareError(f"{path}:{i}: no '{missing[0]}' field", hint="is this a file stare wrote?")
            rows.append(row)
        elif strict and (i < len(lines) or not torn_last_ok):
            raise StareError(f"{path}:{i}: not a JSON object", hint="each line of a .jsonl file is one JSON object; "
                             "fix or remove that line (nothing was changed)")
    return rows


# ----------------------------------------------------------------------------------- checkpoints
MANIFEST = "manifest.json"
STATE = "state.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: Path) -> None:
    """Record the size and SHA-256 of every file of a finished checkpoint directory (written last,
    fsynced). Hashing reads each file once more (~1 s per GB here)."""
    files = {str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(ckpt.rglob("*")) if p.is_file()}
    atomic_write_text(ckpt / MANIFEST, json.dumps({"files": files}, indent=1))


def checkpoint_problem(ckpt: Path, content: bool = True) -> str | None:
    """Why `ckpt` cannot be resumed from (naming the file), or None when it is intact: the manifest
    exists and every file in it has its recorded size and (with `content`) SHA-256, `state.json`
    parses, and each safetensors file's header parses and accounts for the file's length. Catches
    truncation, partial copies and changed bytes (zeroed tensors, bit flips). Manifests written before
    hashes were recorded are checked by size only."""
    if not ckpt.is_dir():
        return f"{ckpt}: missing"
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{ckpt / MANIFEST}: missing or unreadable (the checkpoint was never finished)"
    for name, rec in files.items():
        f = ckpt / name
        size, digest = (rec.get("size"), rec.get("sha256")) if isinstance(rec, dict) else (rec, None)
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, {size} when written (truncated or replaced)"
        if content and digest and file_sha256(f) != digest:
            return f"{f}: content differs from when it was written (SHA-256 mismatch: corrupted or replaced)"
    try:
        state = json.loads((ckpt / STATE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return f"{ckpt / STATE}: no step recorded"
    except (OSError, ValueError):
        return f"{ckpt / STATE}: missing or not JSON"
    for f in sorted(ckpt.glob("*.safetensors")):
        problem = _safetensors_problem(f)
        if problem:
            return f"{f}: {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensor bytes; the header's
    largest end offset must end exactly at the end of the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return "incomplete header"
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError):
        return "unreadable header"
    if 8 + n + max(ends, default=0) != size:
        return f"{size} bytes, the header needs {8 + n + max(ends, default=0)} (truncated)"
    return None


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


def hold_run_lock(run_dir: Path, doing: str = "trained"):
    """An exclusive lock on `run_dir` for as long as the returned file stays open (the process's
    lifetime at most): two trainers never write one run directory, two evaluations or sweeps never one
    output folder. Raises StareError naming the holder when held. `doing`: what the holder does there."""
    import fcntl

    from stare_cli.core.errors import StareError

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise StareError(f"{run_dir} is being {doing} by another process (pid {holder})",
                         hint="wait for it to finish, or stop it first") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


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
