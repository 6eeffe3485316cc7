"""Grading workers that cannot deadlock or outlive their pool (issue 36).

The hang seen in CI: a grading pool forked from a process whose other threads (vLLM's engine) held
locks, and workers that inherited the CLI's SIGTERM handler, so `Pool.terminate` waited for ever.
Each case runs in a child interpreter with a time limit, so a regression fails here instead of
hanging the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.grading.workers import WorkerPool
from conftest import REPO

HELD = threading.Lock()  # held by a thread of the owner while its workers start (see below)


def _try_held_lock() -> bool:
    """In a worker: can this module's HELD lock be taken? A fork of the owner copies it held."""
    ok = HELD.acquire(timeout=0.5)
    if ok:
        HELD.release()
    return ok


def _sigterm_disposition() -> str:
    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and "default" or "handler"


def _sleep(s: float) -> float:
    time.sleep(s)
    return s


def _boom(x: int) -> int:
    raise ValueError(f"bad {x}")


def _die(code: int) -> None:
    os._exit(code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_are_not_forks_of_a_threaded_owner():
    """Fails on the old Pool (fork): the worker's copy of a lock another thread held is held for ever."""
    HELD.acquire()
    release = threading.Event()
    t = threading.Thread(target=lambda: (release.wait(), None))
    t.start()
    try:
        with WorkerPool(2) as pool:
            got = pool.run(_try_held_lock, [()] * 2, hard_timeout=30)
    finally:
        HELD.release()
        release.set()
        t.join()
    assert [o.value for o in got] == [True, True]


def test_workers_restore_the_default_sigterm_even_when_the_owner_handles_it():
    old = signal.signal(signal.SIGTERM, lambda *a: None)  # as the CLI's stop-at-step-boundary handler
    try:
        with WorkerPool(1) as pool:
            assert pool.run(_sigterm_disposition, [()], hard_timeout=30)[0].value == "default"
    finally:
        signal.signal(signal.SIGTERM, old)


def test_results_in_order_errors_named_and_a_hung_item_kills_only_its_worker():
    with WorkerPool(2) as pool:
        out = pool.run(_sleep, [(0.0,), (60.0,), (0.1,), (0.0,)], hard_timeout=3)
        assert [o.status for o in out] == ["ok", "timeout", "ok", "ok"]
        assert [o.value for o in out if o.status == "ok"] == [0.0, 0.1, 0.0]
        err = pool.run(_boom, [(7,)], hard_timeout=30)[0]
        assert (err.status, err.detail) == ("error", "ValueError: bad 7")
        died = pool.run(_die, [(3,)], hard_timeout=30)[0]
        assert died.status == "error" and "exit code 3" in died.detail
        assert [o.value for o in pool.run(_sleep, [(0.0,)] * 3, hard_timeout=30)] == [0.0] * 3  # still works
        pids = pool.pids
    assert pids and not any(_alive(p) for p in pids)


def test_close_ends_workers_that_ignore_sigterm_and_returns():
    pool = WorkerPool(2)
    pool.run(_sleep, [(0.0,)] * 2, hard_timeout=30)
    for pid in pool.pids:  # as a worker stuck with a handler that does not exit would behave
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    pids = pool.pids
    pool.close(grace=0.5)
    assert time.monotonic() - t0 < 10
    assert not any(_alive(p) for p in pids)


CHILD = """
import signal, sys, threading, time
sys.path.insert(0, {repo!r})
from benchmarks.grading.graders import Grader
from stare_cli.core.signals import terminate_as_interrupt

stop = threading.Event()
threads = [threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(stop.is_set, True)], daemon=True)
           for _ in range(4)]
for t in threads:
    t.start()  # an engine's threads, running while the pool starts
signal.signal(signal.SIGTERM, terminate_as_interrupt)  # the CLI's handler
g = Grader(workers=2)
for i in range({rounds}):
    v = g.grade_many(["so $x = \\\\frac{{1}}{{2}}$, \\\\boxed{{\\\\frac{{2}}{{4}}}}"] * 4, ["1/2"] * 4)
    assert all(x.correct for x in v), v
    g.cache.clear()
    g.close()
stop.set()
print("closed", flush=True)
"""


def test_a_grader_in_a_threaded_cli_process_closes_cleanly_every_time():
    """The `stare grade audit` / vLLM-test situation: fails on the old Pool (hangs, or workers print
    tracebacks from the CLI's SIGTERM handler)."""
    code = CHILD.format(repo=str(REPO), rounds=5)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "closed"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("workers", [1, 3])
def test_the_grader_pool_gives_the_in_process_verdicts(workers):
    from benchmarks.grading.graders import Grader

    responses = ["\\boxed{3}", "\\boxed{\\frac{1}{2}}", "the answer is 0.5", "nothing", "\\boxed{x^2+1}"]
    golds = ["3", "0.5", "1/2", "4", "1+x^2"]
    with Grader(workers=0) as inproc, Grader(workers=workers) as pooled:
        a = inproc.grade_many(responses, golds)
        b = pooled.grade_many(responses, golds)
    assert [v.correct for v in a] == [v.correct for v in b] == [True, True, True, False, True]


def test_a_hung_test_fails_alone_under_the_configured_time_limit(tmp_path):
    """pytest-timeout is on for every test (pyproject), so a hang fails one test with a stack dump."""
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(600)\n\n"
                                           "def test_after():\n    assert True\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2",
                        str(tmp_path / "test_hang.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1
    assert "Timeout" in r.stdout and "1 failed, 1 passed" in r.stdout, r.stdout[-1500:]


def test_the_project_configures_a_time_limit_for_every_test(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 0 < float(pytestconfig.getini("timeout")) <= 300
