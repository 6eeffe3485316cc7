"""Shared test helpers: run the real CLI in-process, and locate ../shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("STARE_SHARED", REPO.parent / "shared"))
BENCH_DATA = SHARED / "data" / "benchmarks"  # the full benchmark files (CI has ../shared; a fresh clone may not)
FIXTURE_DATA = REPO / "tests" / "fixtures" / "benchmarks"  # a few rows per benchmark, shipped with the tests


def full_benchmarks() -> Path:
    """The full benchmark files, or a skip (with the reason) when ../shared is not beside the clone."""
    if not (BENCH_DATA / "aime24.jsonl").exists():
        pytest.skip(f"needs the full benchmark files in {BENCH_DATA} (../shared is not beside this clone)")
    return BENCH_DATA

# Disk: the suite writes converted models, runs and checkpoints under the temporary folder. With passed
# tests' folders deleted as they end (pyproject: tmp_path_retention_policy), it held at most 0.13 GiB there at
# once (sampled every 20 s over `make test` on a clean clone, 2026-12-07; a session kept 2.3-3.1 GiB before).
# SUITE_DISK_GIB leaves room for the folders of failed tests, which are kept. Below it, the suite stops
# before any test with one line that says so, instead of ninety tests failing on "no space left on device".
SUITE_DISK_GIB = 1.0


def disk_shortfall(folder: str, need_gib: float = SUITE_DISK_GIB) -> str | None:
    """The one-line reason the suite cannot run in `folder` for want of disk, or None when it can."""
    import shutil

    existing = Path(folder).absolute()
    while not existing.exists():  # --basetemp may name a folder pytest has yet to make
        existing = existing.parent
    free_gib = shutil.disk_usage(existing).free / 2**30
    if free_gib >= need_gib:
        return None
    return (f"only {free_gib:.1f} GiB free in {folder}, and the suite writes up to {need_gib:.1f} GiB there "
            f"(converted models, runs, checkpoints): free some space, or point TMPDIR at a larger filesystem")


def pytest_sessionstart(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller checks once, for its workers too
        return
    import tempfile

    reason = disk_shortfall(str(session.config.option.basetemp or tempfile.gettempdir()))
    if reason:
        pytest.exit(reason, returncode=1)


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


@pytest.fixture(scope="session")
def quick_toy(tmp_path_factory):
    """A copy of the shipped arith toy (hash-checked weights: the same model on every machine; it
    writes boxed answers, about 45% right, at a token entropy of ~0.44). A warm-up run here instead
    would differ from CPU to CPU by float rounding: one on an AVX-512 machine ended with accuracy 0."""
    import shutil

    from benchmarks.data.toy import ensure_toy_model

    path = tmp_path_factory.mktemp("quick_toy") / "arith"
    shutil.copytree(ensure_toy_model("arith"), path)
    return path


@pytest.fixture(scope="session")
def quick_tool_toy(tmp_path_factory):
    """The tool toy after a short warm-up (200 steps): it calls the Python tool in some responses."""
    import torch

    from benchmarks.data.toy import build_model, build_tokenizer, sft

    path = tmp_path_factory.mktemp("quick_tool_toy")
    torch.set_num_threads(1)
    tok = build_tokenizer("tool")
    model = build_model(len(tok), seed=0)
    sft(model, tok, steps=200, batch=32, lr=3e-3, seed=0, log_every=0, task="tool")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`). Tests that start Ray
# (the verl runs) share one group, so they run one after another on one worker: two Ray clusters on one
# machine compete for the same ports and memory. (Until 2026-12-07 the group never formed: xdist's worker hook
# read the marks before this one added them, so both workers ran the verl run at once, each for itself.)
_ONE_AT_A_TIME = {"test_verl_backend.py": "ray", "test_verl_cpu.py": "ray", "test_verl_job.py": "ray"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group into the node id: the
def pytest_collection_modifyitems(config, items):  # worker registers it after this file, so it ran first
    for item in items:
        group = _ONE_AT_A_TIME.get(item.path.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


# Memory per test (issue 68: no test process above 6 GB resident). After each test, its process's peak
# resident set so far (ru_maxrss, never decreasing) and the largest peak of the processes it waited for
# (subprocesses: `stare` CLIs, grader workers) go to $STARE_TEST_PEAKS/<worker>.jsonl when that variable
# names a folder; benchmarks/perf/suite_memory.py runs the suite with it and prints the table.
def pytest_runtest_logfinish(nodeid, location):
    folder = os.environ.get("STARE_TEST_PEAKS")
    if not folder:
        return
    import json
    import resource

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    kib = 1024  # ru_maxrss is in KiB on Linux
    row = {"test": nodeid, "pid": os.getpid(), "worker": worker,
           "self_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 2**30,
           "children_peak_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib / 2**30}
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            row["rss_now_gib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        pass
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
