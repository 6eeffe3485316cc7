"""Shared test helpers: run the real CLI in-process, and locate ../shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("STARE_SHARED", REPO.parent / "shared"))
BENCH_DATA = SHARED / "data" / "benchmarks"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture
def cli(capsys):
    """Run `stare ARGS...` in-process; returns (exit_code, stdout, stderr)."""
    from stare_cli.cli import main

    def run(*args: str):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
