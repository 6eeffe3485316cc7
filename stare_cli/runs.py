"""The run directory layout; the one module that knows it.

runs/<recipe>__<method>__seed<k>__<YYYYmmdd-HHMMSS>/
    config.yaml        the fully resolved recipe
    meta.json          git SHA, command line, package versions, host, device
    metrics.jsonl      one JSON object per training step (and eval rows with "eval/..." keys)
    checkpoints/       step-<n>/ (model.safetensors, optimizer.pt, state.json); `latest` names the newest
    samples/           step-<n>.jsonl rollout samples
    eval/              evaluation outputs (results.json, samples.jsonl per benchmark)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stare_cli.config import Recipe


def run_name(recipe: Recipe, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{recipe.name.replace('/', '-')}__{recipe.method.name}__seed{recipe.optim.seed}__{stamp}"


def new_run_dir(recipe: Recipe, root: str | Path = "runs") -> Path:
    """Create a fresh run directory (a suffix avoids collisions within one second)."""
    base = Path(root) / run_name(recipe)
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    for sub in ("checkpoints", "samples", "eval"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def environment_summary() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for pkg in ("stare", "torch", "transformers", "math-verify", "verl", "vllm", "lm-eval"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),
        "packages": versions,
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_run_meta(run_dir: Path, recipe: Recipe, extra: dict[str, Any] | None = None) -> None:
    from stare_cli.recipes import recipe_to_yaml

    atomic_write_text(run_dir / "config.yaml", recipe_to_yaml(recipe))
    meta = {"git_sha": git_sha(), **environment_summary(), **(extra or {})}
    atomic_write_text(run_dir / "meta.json", json.dumps(meta, indent=2))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a torn last line (a crash mid-write) is ignored."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
