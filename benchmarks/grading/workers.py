"""Worker processes that cannot deadlock or outlive their owner (grading's hard time limits).

`WorkerPool` runs a module-level function on argument tuples in N worker processes, with a hard
wall-clock limit per item that kills the one worker stuck on it. Why not `multiprocessing.Pool`:
- A forked child of a threaded process (a vLLM engine, tokenizers, torch's intra-op threads, Ray)
  inherits locks in whatever state other threads held them; a Pool worker forked there blocked for
  ever on its task-queue lock, and `Pool.terminate` then waited for it without end (issue 36).
  Workers here are new interpreters (`python -c`, started by fork+exec as `subprocess` does):
  nothing of the caller's threads, locks or memory crosses. Unlike multiprocessing's spawn and
  forkserver methods they never re-import the caller's main script.
- Pool workers share one task queue and its lock: a worker killed while waiting for a task (as
  `terminate` does) leaves that lock held, and anything that takes it later waits for ever. Here
  each worker has pipes of its own and shares nothing, so killing one affects no other.
- Pool workers inherit the caller's signal handlers (the CLI's SIGTERM handler only asks the
  program to stop later), so `terminate` could not end them. Here every worker has the default
  SIGTERM and ignores SIGINT (the owner, which gets Ctrl-C with the whole process group, finishes
  or closes the pool itself).
- `close` asks, then terminates, then kills, each step with a short grace period: it always returns.
A worker whose owner dies sees its pipe close and exits.

Start-up: a worker imports the PRELOAD modules before its first task (~0.6 s on this machine for the
grading modules, math-verify and sympy); the N workers start in parallel, once per pool, and a pool
lives as long as its `Grader` (one per command or training run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

# Imported by each worker before its first task.
PRELOAD = ["benchmarks.grading.graders", "math_verify", "sympy"]

_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
         "from benchmarks.grading.workers import _worker_main; _worker_main(int(sys.argv[2]), int(sys.argv[3]))")


def _worker_main(fd_in: int, fd_out: int) -> None:
    """A worker's loop: receive (fn, args), send ("ok", result) or ("error", "Type: message");
    None or a closed pipe ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    rx, tx = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    while True:
        try:
            task = rx.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        fn, args = task
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # math-verify's TimeoutException derives from BaseException
            reply = ("error", f"{type(e).__name__}: {e}"[:500])
        try:
            tx.send(reply)
        except (BrokenPipeError, OSError):
            return


@dataclass
class Outcome:
    """What became of one item: `value` when `status` is "ok"; "error" (the function raised, or its
    worker died: `detail` says which) or "timeout" (the worker was killed after the hard limit)."""

    status: str
    value: Any = None
    detail: str = ""


@dataclass
class _Worker:
    process: subprocess.Popen
    tx: Connection  # tasks to the worker
    rx: Connection  # replies from it
    item: Optional[int] = None  # the index it works on (one at a time: a slow item never holds up
    since: float = 0.0          # another behind it while a second worker idles); since when

    def exited(self, timeout: float) -> Optional[int]:
        """The exit code once it has exited within `timeout` s, else None."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class WorkerPool:
    """`workers` processes, started on first use and kept until `close` (use as a context manager).

    `run(fn, items, hard_timeout)` returns one Outcome per argument tuple, in order. `fn` must be a
    module-level function (it is pickled by name). An item running longer than `hard_timeout`
    seconds has its worker killed (a hung sympy call holds the GIL: only killing the process stops
    it) and replaced; the other items go on."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.size = workers
        self._workers: list[_Worker] = []

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _start(self) -> _Worker:
        task_r, task_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            p = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), str(task_r), str(reply_w)],
                                 pass_fds=(task_r, reply_w), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(task_r)
            os.close(reply_w)
        return _Worker(p, Connection(task_w, readable=False), Connection(reply_r, writable=False))

    def _discard(self, w: _Worker) -> None:
        """Kill one worker now (it is stuck or broken) and forget it."""
        _kill_all([w], grace=0.0)
        self._workers.remove(w)

    def run(self, fn: Callable, items: Sequence[tuple], hard_timeout: float) -> list[Outcome]:
        out: list[Optional[Outcome]] = [None] * len(items)
        pending = deque(range(len(items)))
        while len(self._workers) < min(self.size, len(items)):
            self._workers.append(self._start())

        def end(w: _Worker, outcome: Outcome) -> None:
            """`w` failed on its item: record it, kill `w`, start another if work remains."""
            out[w.item] = outcome
            self._discard(w)
            if pending:
                self._workers.append(self._start())

        while pending or any(w.item is not None for w in self._workers):
            for w in list(self._workers):  # hand out work
                if w.item is None and pending:
                    w.item, w.since = pending.popleft(), time.monotonic()
                    try:
                        w.tx.send((fn, items[w.item]))
                    except (BrokenPipeError, OSError) as e:
                        end(w, Outcome("error", detail=f"worker died: {type(e).__name__}"))
            busy = [w for w in self._workers if w.item is not None]
            if not busy:
                continue
            deadline = min(w.since for w in busy) + hard_timeout
            ready = set(wait([w.rx for w in busy], timeout=max(0.0, deadline - time.monotonic())))
            for w in busy:
                if w.rx in ready:
                    try:
                        status, value = w.rx.recv()
                    except (EOFError, OSError):  # its pipe closed: it died
                        end(w, Outcome("error", detail=f"worker died (exit code {w.exited(1.0)})"))
                        continue
                    out[w.item] = Outcome("ok", value) if status == "ok" else Outcome("error", detail=value)
                    w.item = None
                elif time.monotonic() - w.since >= hard_timeout:
                    end(w, Outcome("timeout", detail=f"over the hard limit of {hard_timeout:g} s"))
        return [o for o in out if o is not None]

    def close(self, grace: float = 2.0) -> None:
        """End every worker for certain: ask (None), then SIGTERM, then SIGKILL, `grace` s apart."""
        workers, self._workers = self._workers, []
        for w in workers:
            if w.item is None:
                try:
                    w.tx.send(None)
                except (BrokenPipeError, OSError):
                    pass
        _kill_all(workers, grace)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if self._workers:
            self.close(grace=0.0)


def _kill_all(workers: list[_Worker], grace: float) -> None:
    """Wait up to `grace` s for each to exit, then SIGTERM, then SIGKILL; reap them; close pipes."""
    def wait_exit(limit: float) -> None:
        end = time.monotonic() + limit
        for w in workers:
            w.exited(max(0.0, end - time.monotonic()))

    if grace:
        wait_exit(grace)
    for send in (subprocess.Popen.terminate, subprocess.Popen.kill):
        alive = [w for w in workers if w.process.poll() is None]
        if not alive:
            break
        for w in alive:
            try:
                send(w.process)
            except OSError:
                pass
        wait_exit(grace if grace else 1.0)
    for w in workers:
        w.tx.close()
        w.rx.close()
