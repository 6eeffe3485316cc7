"""The kernel's file I/O, used by every layer: atomic writes, JSONL rows, folder locks, checkpoint
manifests and their checks, and the environment a result was made in. Nothing here knows a run
directory's layout (stare_cli/core/runs.py) or what an evaluation is (stare_kernel/ledger.py)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stare_kernel.errors import StareError

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


def is_disk_full(e: BaseException) -> bool:
    """A write that failed for want of space (or quota), as an OSError or as a library's own error text."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "os error 28" in str(e)


def disk_full(path: Path, kept: str) -> StareError:
    """The one error for a full disk: the file that could not be written, what is intact, what to do."""
    return StareError(f"{path}: no space left on device while writing it ({kept})",
                      hint="free space on that filesystem, then run the same command again (a run resumes from its "
                           "last checkpoint, an evaluation from the samples on disk)")


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: readers never see half a file. The
    file gets the mode a plain `open` would give it (0666 less the umask), not mkstemp's 0600:
    colleagues on shared storage read results as they read anything else of the user's. A full disk is
    a StareError naming the file (`disk_full`); the file is then as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(path, "it is as it was before: nothing was lost") from None
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


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
    except OSError as e:
        if is_disk_full(e):
            raise disk_full(path, "its earlier lines are intact; a torn last line is ignored and redone") from None
        raise


def read_jsonl(path: Path, strict: bool = False, torn_last_ok: bool = True,
               required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A torn last line (a crash mid-write) is ignored; with `strict`, any other
    line that is not a JSON object is an error naming the file and line (the last one too when not
    `torn_last_ok`: for readers that rewrite the file and must lose nothing). A row without one of
    the `required` fields is an error naming the file, line and field. Non-UTF-8 content is an error
    naming the file."""
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


def hold_run_lock(run_dir: Path, doing: str = "trained"):
    """An exclusive lock on `run_dir` for as long as the returned file stays open (the process's
    lifetime at most): two trainers never write one run directory, two evaluations or sweeps never one
    output folder. Raises StareError naming the holder when held. `doing`: what the holder does there."""
    import fcntl

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
