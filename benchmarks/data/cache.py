"""The local cache (`$STARE_CACHE_DIR`, default ~/.cache/stare): warmed-up toys and converted models,
each entry built once, whoever asks at the same time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("STARE_CACHE_DIR", Path.home() / ".cache" / "stare"))


def build_once(path: Path, build: Callable[[Path], None], force: bool = False) -> bool:
    """Make the cache entry `path` with `build(tmp_dir)`, once, whoever asks at the same time.

    Holders of an exclusive lock on `<path>.lock` build; a process that waited finds the entry made
    and returns (False). The entry is built in a temporary sibling and renamed into place, so readers
    never see half of one; temporaries of killed builders are removed under the lock. Returns True
    when this call built it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also when the process dies)
        if path.exists() and not force:
            return False
        for stale in path.parent.glob(path.name + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir()
        try:
            build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if path.exists():
            old = path.with_name(path.name + f".tmp{os.getpid()}-old")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        return True
