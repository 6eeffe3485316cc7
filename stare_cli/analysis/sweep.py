"""`stare sweep`: a methods x seeds grid under one recipe, resumable, ending in the table and plots.

A sweep directory holds
    sweep.json     the manifest: recipe, overrides, backend, evaluation, and every cell (method, seed,
                   run directory, state, exit code, times), rewritten atomically as cells change
    sweep.log      one line per cell event with the overall ETA (also on stderr)
    cells/<method>-seed<k>/<run dir>   each cell an ordinary run directory (`stare train --resume`,
                   `stare compare` work on it)
    logs/<method>-seed<k>.log          each cell's own log (stderr: progress, warnings, errors)
    logs/<method>-seed<k>.out          its stdout (the run directory, last line)
    table.md, table.csv, report.md, summary.json, dynamics.png/.svg, passk*.png/.svg   over the finished
                   cells: written when the cells are done, and before that after each finished cell and
                   when the sweep is stopped (report.md's first line says how many of the cells it holds;
                   its last section, Provenance, the command of the grid, the commit that wrote it, and
                   each cell's run directory, steps, every start and resume with its commit, and graders)

Running the same command again is idempotent: a finished cell (its newest checkpoint is its last
step) is skipped, an interrupted one resumes from its checkpoint (`stare train --resume`), one
without a usable checkpoint starts again (`--resume --restart`), and a missing one starts. A
failed cell does not stop the others; the summary names it and the command exits 1.

Each cell is a `stare train` process of its own (one torch thread each by default), in its own
process group and killed with the sweep (parent-death signal), so a killed sweep leaves no trainer
writing behind it; SIGINT/SIGTERM to the sweep are passed to the running cells once (each finishes
its step and checkpoints; one in its step-0 evaluation finishes that and stops without a checkpoint)
and the sweep exits 130/143, naming each stopped cell's checkpoint step. The verl backend runs cells
one after another, or writes one job script per cell (`--emit-script DIR`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, TextIO

from stare_kernel.errors import Interrupted, StareError, UsageError
from stare_kernel.ledger import run_acted
from stare_kernel.reader import find_records
from stare_cli.analysis.plots import plot_evals_over_training
from stare_cli.core.runs import (atomic_write_text, git_sha, hold_run_lock, make_out_dir, read_jsonl,
                                 refuse_run_dir_as_parent, run_finished, run_total_steps)

MANIFEST = "sweep.json"


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep is: the same spec always means the same sweep directory and cells."""

    recipe: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    backend: Optional[str] = None
    evals: tuple[str, ...] = ()
    eval_n: Optional[int] = None
    eval_limit: Optional[int] = None

    def settings(self) -> dict:
        """The keys that must match when a sweep directory is run again (cells may be added)."""
        return {"recipe": self.recipe, "overrides": list(self.overrides), "backend": self.backend,
                "evals": list(self.evals), "eval_n": self.eval_n, "eval_limit": self.eval_limit}

    def default_dir(self) -> Path:
        blob = json.dumps({**self.settings(), "methods": sorted(self.methods), "seeds": sorted(self.seeds)},
                          sort_keys=True)
        return Path("sweeps") / f"{self.recipe.replace('/', '-')}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


@dataclass
class Cell:
    method: str
    seed: int
    run_dir: Optional[str] = None
    state: str = "pending"  # pending | running | done | failed | interrupted | emitted
    exit_code: Optional[int] = None
    error: Optional[str] = None
    seconds: Optional[float] = None
    script: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"


@dataclass
class SweepResult:
    out: Path
    cells: list[Cell]
    table: Optional[str] = None
    plots: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Cell]:
        return [c for c in self.cells if c.state == "failed"]


# ------------------------------------------------------------------------------------ manifest
def _load_manifest(out: Path, spec: SweepSpec) -> list[Cell]:
    """The cells of this command, with what an earlier run of it recorded; refuses a directory that
    holds a sweep of other settings."""
    f = out / MANIFEST
    old: dict[tuple[str, int], Cell] = {}
    if f.exists():
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            raise StareError(f"{f}: not a sweep manifest", hint="use another --out") from None
        if data.get("settings") != spec.settings():
            diff = [k for k in spec.settings() if data.get("settings", {}).get(k) != spec.settings()[k]]
            raise StareError(f"{out} holds a sweep with other settings ({', '.join(diff)})",
                             hint="run it with its own settings (sweep.json), or use another --out")
        old = {(c["method"], c["seed"]): Cell(**c) for c in data.get("cells", [])}
    # seed-major: a sweep stopped part-way holds whole seeds (every method), which pair by seed
    cells = [old.pop((m, s), Cell(m, s)) for s in spec.seeds for m in spec.methods]
    # cells of earlier commands stay in the manifest and, once finished, in the table; only the cells a
    # command names are run by it
    return cells + list(old.values())


def _save_manifest(out: Path, spec: SweepSpec, cells: list[Cell]) -> None:
    atomic_write_text(out / MANIFEST, json.dumps({"settings": spec.settings(), "cells": [asdict(c) for c in cells]},
                                                 indent=2))


def cell_run_dir(out: Path, cell: Cell) -> Optional[Path]:
    """The cell's run directory: the one under cells/<cell>/ that stare created (has meta.json)."""
    found = sorted(p for p in (out / "cells" / cell.name).glob("*") if (p / "meta.json").exists())
    return found[-1] if found else None


# ------------------------------------------------------------------------------------- commands
def _train_command(spec: SweepSpec, out: Path, cell: Cell, threads: int, run_dir: Optional[Path],
                   emit: Optional[Path], shared_dir: Optional[Path]) -> list[str]:
    cmd = [sys.executable, "-m", "stare_cli", "train"]
    if run_dir is not None:  # resume (or restart) the cell's own run
        cmd += ["--resume", str(run_dir)]
        if not _has_checkpoint(run_dir):
            cmd.append("--restart")
    else:
        cmd += ["--recipe", spec.recipe, "--method", cell.method, "--out", str(out / "cells" / cell.name)]
        for o in (*spec.overrides, f"optim.seed={cell.seed}"):
            cmd += ["-o", o]
        if spec.backend:
            cmd += ["--backend", spec.backend]
    if spec.backend != "verl":
        cmd += ["--threads", str(threads)]
    if emit is not None:
        cmd += ["--emit-script", str(emit / f"{cell.name}.sh")]
        if shared_dir is not None:
            cmd += ["--shared-dir", str(shared_dir)]
    return cmd


def _has_checkpoint(run_dir: Path) -> bool:
    return _checkpoint_step(run_dir) is not None


def _checkpoint_step(run_dir: Path) -> Optional[int]:
    """The step of the checkpoint a resume starts from (embedded: the newest intact one; verl: the one its
    tracker file names, or the newest complete one when the tracker is missing or wrong), None when
    there is none."""
    from stare_cli.core.runs import usable_checkpoint, verl_checkpoint

    ckpt = usable_checkpoint(run_dir)[0]
    if ckpt is not None:
        return int(ckpt.name[5:])
    return verl_checkpoint(run_dir)[0]


def _how_it_resumes(run_dir: Optional[Path]) -> str:
    """An interrupted cell's state for the log and the manifest: where the same command takes it up."""
    step = None if run_dir is None else _checkpoint_step(run_dir)
    if step is None:
        return "stopped before its first checkpoint (the same command starts it again)"
    return f"stopped with a checkpoint at step {step} (the same command resumes from it)"


def _die_with_sweep() -> None:
    """In each cell process before exec: killed when the sweep dies (even by SIGKILL)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class _Log:
    """Lines on stderr and in sweep.log."""

    def __init__(self, path: Path, stream: TextIO):
        self.file = open(path, "a")
        self.stream = stream

    def __call__(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        print(line, file=self.stream, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _fmt_s(s: float) -> str:
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{int(s // 60)}m{int(s % 60):02d}s"


# ------------------------------------------------------------------------------------------ run
def run_sweep(spec: SweepSpec, out: Optional[Path] = None, parallel: Optional[int] = None, threads: int = 1,
              emit_script: Optional[Path] = None, shared_dir: Optional[Path] = None, paper: Optional[str] = None,
              stream: Optional[TextIO] = None) -> SweepResult:
    """Train (or resume, or skip) every cell, then evaluate, tabulate and plot. Returns the result;
    `result.failed` lists failed cells (the CLI exits 1 when there are any)."""
    from stare_cli.backends import check as check_backend
    from stare_cli.core.resolve import load_recipe
    from stare_cli.method.layer import method_warnings

    if not spec.methods or not spec.seeds:
        raise UsageError("a sweep needs at least one --method and one --seed")
    for flag, values in (("--method", spec.methods), ("--seed", spec.seeds)):
        twice = [str(v) for v in dict.fromkeys(values) if list(values).count(v) > 1]
        if twice:  # one cell each: a repeat would be silently merged
            raise UsageError(f"{flag} {', '.join(twice)} given more than once", hint=f"name each {flag[2:]} once")
    if spec.evals:  # an unknown benchmark fails now, not after every cell has trained
        from benchmarks.data.registry import check_benchmark, expand

        for b in expand(list(spec.evals)):
            check_benchmark(b)
    verl = spec.backend == "verl"
    if verl and parallel not in (None, 1) and emit_script is None:
        raise UsageError("the verl backend runs a sweep's cells one after another", hint="drop --parallel")
    if emit_script is not None and not verl:
        raise UsageError("--emit-script writes verl job scripts", hint="add --backend verl")
    notes = []
    for m in spec.methods:  # every cell's recipe resolves and the backend takes it, before anything runs
        cfg = load_recipe(spec.recipe, m, [*spec.overrides, *([f"backend.name={spec.backend}"] if spec.backend else [])])
        check_backend(cfg)
        notes += method_warnings(cfg)
    for w in notes:  # before any cell runs (each cell's log says it again)
        print(f"warning: {w}", file=stream or sys.stderr, flush=True)
    parallel = 1 if verl else (parallel or max(1, (os.cpu_count() or 1) // threads))
    out = Path(out) if out is not None else spec.default_dir()
    refuse_run_dir_as_parent(out)  # a sweep folder holds run directories; it is never one
    make_out_dir(out / "logs", "--out", "choose a folder you can write, e.g. --out sweeps/mine")
    lock = hold_run_lock(out, "swept")  # the same sweep started twice on one folder: the second refused
    try:
        return _run_sweep_locked(spec, out, parallel, threads, emit_script, shared_dir, paper, stream)
    finally:
        lock.close()


def _run_sweep_locked(spec: SweepSpec, out: Path, parallel: int, threads: int, emit_script: Optional[Path],
                      shared_dir: Optional[Path], paper: Optional[str], stream: Optional[TextIO]) -> SweepResult:
    cells = _load_manifest(out, spec)
    log = _Log(out / "sweep.log", stream or sys.stderr)
    try:
        if emit_script is not None:
            _emit(spec, out, cells, emit_script, shared_dir, log)
            return SweepResult(out, cells)
        try:
            _train_cells(spec, out, cells, parallel, threads, log, lambda: _interim_report(spec, out, cells, paper, log))
        except Interrupted:
            _interim_report(spec, out, cells, paper, log)
            raise
        done = [c for c in cells if c.state == "done"]
        if spec.evals and done:
            _evaluate_cells(spec, out, done, log)
        result = SweepResult(out, cells)
        if done:
            result.table, result.plots = _report(spec, out, done, paper, cells)
        failed = result.failed
        log(f"sweep done: {len(done)} of {len(cells)} cells finished" +
            (f"; failed: {', '.join(f'{c.name} ({c.error})' for c in failed)}" if failed else ""))
        return result
    finally:
        log.close()


@dataclass
class _Running:
    """A cell's training process and its open log (stderr) and stdout files."""

    proc: subprocess.Popen
    cell: Cell
    start: float
    log: TextIO
    stdout: TextIO

    def close(self) -> None:
        self.log.close()
        self.stdout.close()


PROGRESS_FIRST_S, PROGRESS_EVERY_S = 10.0, 30.0  # a line on the running cells: first after 10 s, then every 30 s


_CLOCK = re.compile(r"^\d\d:\d\d:\d\d ")  # the time a phase line starts with


@dataclass(frozen=True)
class CellProgress:
    """A running cell as the sweep's progress line shows it, and the time it says it has left."""

    text: str  # 'grpo-ds-seed1 step 12/30, 0.70 steps/min, ETA 3m10s + 1 evaluation'
    left_s: Optional[float] = None  # its own ETA in seconds (None before its first step line)
    unpriced_evals: int = 0  # evaluations its ETA leaves out: it has timed none since it (re)started


_ETA = re.compile(r"ETA (?:(\d+)h)?(\d+)m(\d+)s(?: \+ (\d+) evaluations?)?")


def _cell_progress(out: Path, name: str) -> CellProgress:
    """A running cell's latest step line from its log ('grpo-ds-seed1 step 12/30, 0.70 steps/min, ETA
    3m10s'), or before its first step its latest line ('grpo-ds-seed1: words:two-step: 16/32 problems in
    4m00s, ..., ETA 4m00s')."""
    try:
        with open(out / "logs" / f"{name}.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return CellProgress(f"{name} starting")
    step = next((ln for ln in reversed(lines) if ln.startswith("step ")), None)
    if step is None:  # before its first step: its latest line (loading, the step-0 evaluation's progress)
        last = next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln.startswith("$ ")), None)
        return CellProgress(f"{name}: {_CLOCK.sub('', last)[:120]}" if last else f"{name} setting up")
    words = step.split()
    rate = next((f"{words[i - 1]} steps/min" for i, w in enumerate(words) if w == "steps/min"), "")
    m = _ETA.search(step)
    eta = step[m.start():m.end()] if m else next((f"ETA {words[i + 1]}" for i, w in enumerate(words[:-1])
                                                  if w == "ETA"), "")
    text = ", ".join(x for x in (f"{name} {words[0]} {words[1]}", rate, eta) if x)
    if m is None:  # 'ETA ?': no step timed yet
        return CellProgress(text)
    h, mi, se, evals = m.groups()
    return CellProgress(text, 3600 * int(h or 0) + 60 * int(mi) + int(se), int(evals or 0))


def cell_cost_s(run_dir: Path) -> Optional[float]:
    """What a cell's run took, however often it was stopped and resumed: its steps' `time/step` plus its
    evaluations' `elapsed_s` (eval/step-*/<bench>/results.json); loading the model is left out. None when
    its steps logged no `time/step`."""
    steps = [r["time/step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("time/step") is not None]
    if not steps:
        return None
    evals = []
    for f in (run_dir / "eval").glob("step-*/*/results.json"):
        try:
            evals.append(float(json.loads(f.read_text()).get("elapsed_s") or 0.0))
        except (OSError, ValueError, TypeError):
            pass
    return sum(steps) + sum(evals)


def sweep_time_left(running_left: list[Optional[float]], waiting_costs: list[Optional[float]],
                    parallel: int) -> Optional[float]:
    """Seconds until the last cell ends: each waiting cell, in order, starts in the slot that frees first
    (the running cells' own times left, then idle slots at 0) and takes its cost. None when any time or
    cost is unknown.
        running_left: [len(running)] seconds each running cell has left
        waiting_costs: [len(waiting)] seconds each waiting cell will take"""
    if any(x is None for x in (*running_left, *waiting_costs)):
        return None
    slots = sorted([float(x) for x in running_left] + [0.0] * max(0, parallel - len(running_left)))
    for cost in waiting_costs:
        slots[0] += float(cost)
        slots.sort()
    return max(slots, default=0.0)


class _SweepClock:
    """The sweep's ETA from what its finished cells took (`cell_cost_s`, per method; every finished cell's
    mean for a method none of whose cells has finished) and what the running cells say they have left."""

    def __init__(self, out: Path, parallel: int):
        self.out, self.parallel = out, parallel
        self.costs: dict[str, tuple[str, Optional[float]]] = {}  # cell name -> (method, cost)

    def finished(self, cell: Cell) -> None:
        """Record a finished cell's cost: by its records, else (a run that logs no `time/step`, as verl's)
        the wall time of the command that finished it."""
        if cell.state == "done" and cell.run_dir and cell.name not in self.costs:
            cost = cell_cost_s(Path(cell.run_dir))
            self.costs[cell.name] = (cell.method, cell.seconds if cost is None else cost)

    def cost(self, method: str) -> Optional[float]:
        own = [c for m, c in self.costs.values() if m == method and c is not None]
        every = [c for _, c in self.costs.values() if c is not None]
        return statistics.fmean(own or every) if (own or every) else None

    def eval_s(self) -> Optional[float]:
        """The mean time of the in-training evaluations after step 0 on record in the sweep."""
        times = []
        for f in self.out.glob("cells/*/*/eval/step-*/*/results.json"):
            if f.parent.parent.name != "step-000000":
                try:
                    times.append(float(json.loads(f.read_text())["elapsed_s"]))
                except (OSError, ValueError, KeyError, TypeError):
                    pass
        return statistics.fmean(times) if times else None

    def left(self, running: dict[str, "_Running"], todo: list[Cell],
             progress: Optional[dict[str, CellProgress]] = None) -> Optional[float]:
        """Seconds until the sweep ends; `progress`: the running cells' `_cell_progress`, when already read."""
        lefts: list[Optional[float]] = []
        for name, r in running.items():
            p = progress[name] if progress is not None else _cell_progress(self.out, name)
            if p.left_s is None:  # before its first step line: its method's cost, less the steps it has run
                cost = self.cost(r.cell.method)
                lefts.append(None if cost is None else cost * _share_left(cell_run_dir(self.out, r.cell)))
            elif p.unpriced_evals:
                e = self.eval_s()
                lefts.append(None if e is None else p.left_s + p.unpriced_evals * e)
            else:
                lefts.append(p.left_s)
        return sweep_time_left(lefts, [self.cost(c.method) for c in todo], self.parallel)


def _share_left(run_dir: Optional[Path]) -> float:
    """The share of a cell's steps still to run: 1 for a cell without a run directory or steps yet."""
    total = run_total_steps(run_dir) if run_dir is not None else None
    if not total:
        return 1.0
    return max(0.0, 1.0 - _last_logged_step(run_dir) / total)


def _last_logged_step(run_dir: Path) -> int:
    """The last step in a run directory's metrics.jsonl, 0 before its first."""
    return max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)), default=0)


def _interim_report(spec: SweepSpec, out: Path, cells: list[Cell], paper: Optional[str], log: _Log) -> None:
    """The report over the cells finished so far, while others still wait or run (after each finished cell,
    and when the sweep is stopped); a report that fails says why in the log and the sweep goes on."""
    done = [c for c in cells if c.state == "done"]
    if not done:
        return
    try:
        _report(spec, out, done, paper, cells)
    except Exception as e:  # noqa: BLE001 - a report must not stop the cells training
        log(f"warning: the report of the {len(done)} finished cells was not written: {type(e).__name__}: {e}")
        return
    log(f"report of the {len(done)} of {len(cells)} cells finished so far: {out / 'report.md'}")


def _train_cells(spec: SweepSpec, out: Path, cells: list[Cell], parallel: int, threads: int, log: _Log,
                 on_done=None) -> None:
    """Run the named unfinished cells, `parallel` at a time, each a `stare train` process; `on_done()` after
    each cell that finishes while others are still to run (the interim report)."""
    todo: list[Cell] = []
    unnamed: list[Cell] = []  # an earlier command's unfinished cells: left as they are
    for c in cells:
        rd = cell_run_dir(out, c)
        c.run_dir = str(rd) if rd else None
        if rd is not None and run_finished(rd):
            c.state = "done"
        elif c.method not in spec.methods or c.seed not in spec.seeds:
            unnamed.append(c)
        else:
            c.state = "pending"
            todo.append(c)
    _save_manifest(out, spec, cells)
    named = len(cells) - len(unnamed)
    log(f"sweep {out}: {named} cells ({named - len(todo)} already finished, {len(todo)} to run, {parallel} at a time)")
    for c in unnamed:
        log(f"{c.name} ({c.state}) is not named by this command: not run (name its method and seed to run it)")
    if not todo:
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    running: dict[str, _Running] = {}
    clock = _SweepClock(out, parallel)
    for c in cells:  # what the cells an earlier command finished took
        clock.finished(c)
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    forwarded = 0
    stopped: list[Cell] = []  # the cells this command interrupted
    t0 = time.time()
    next_progress = t0 + PROGRESS_FIRST_S
    try:
        while running or (todo and not got):
            if running and time.time() >= next_progress:  # the cells' own step lines: step, rate, ETA
                progress = {name: _cell_progress(out, name) for name in running}
                left = clock.left(running, todo, progress)
                log("progress: " + "; ".join(p.text for p in progress.values())
                    + ("" if left is None else f"; sweep ETA {_fmt_s(left)}"))
                next_progress = time.time() + PROGRESS_EVERY_S
            while todo and len(running) < parallel and not got:
                c = todo.pop(0)
                rd = cell_run_dir(out, c)
                cmd = _train_command(spec, out, c, threads, rd, None, None)
                f = open(out / "logs" / f"{c.name}.log", "a")
                f.write(f"\n$ {' '.join(cmd)}\n")
                f.flush()
                # stdout to a file, not a pipe: a pipe nobody reads until exit blocks a chatty cell
                fo = open(out / "logs" / f"{c.name}.out", "w")
                p = subprocess.Popen(cmd, stdout=fo, stderr=f, text=True, env=env,
                                     start_new_session=True, preexec_fn=_die_with_sweep)
                c.state = "running"
                running[c.name] = _Running(p, c, time.time(), f, fo)
                _save_manifest(out, spec, cells)
                log(f"start {c.name} ({'resume' if rd else 'new'}){' ' + str(rd) if rd else ''}")
            if len(got) > forwarded:  # pass each signal on once: the cells checkpoint and stop
                for r in running.values():
                    try:
                        r.proc.send_signal(got[forwarded])
                    except ProcessLookupError:
                        pass
                forwarded = len(got)
            for name, r in list(running.items()):
                p, c, start = r.proc, r.cell, r.start
                if p.poll() is None:
                    continue
                r.close()
                stdout = Path(r.stdout.name).read_text(errors="replace")
                del running[name]
                c.exit_code, c.seconds = p.returncode, round(time.time() - start, 1)
                rd = cell_run_dir(out, c)
                c.run_dir = str(rd) if rd else (stdout.strip().splitlines() or [None])[-1]
                if p.returncode == 0:
                    c.state, c.error = "done", None
                    clock.finished(c)
                elif p.returncode in (130, 143) and got:
                    c.state, c.error = "interrupted", _how_it_resumes(rd)
                    stopped.append(c)
                else:
                    c.state = "failed"
                    tail = (out / "logs" / f"{c.name}.log").read_text().strip().splitlines()
                    errs = [x for x in tail if x.startswith("error:")]
                    c.error = (errs or tail or ["no output"])[-1].removeprefix("error: ")[:300]
                _save_manifest(out, spec, cells)
                finished = sum(x.state in ("done", "failed") for x in cells)
                left = clock.left(running, todo) if (todo or running) and not got else None
                eta = "" if left is None else f"; ETA {_fmt_s(left)}"
                log(f"[{finished}/{len(cells)}] {c.name} {c.state} in {_fmt_s(c.seconds)} (exit {c.exit_code})"
                    f"{'' if c.state == 'done' else ': ' + (c.error or '')}; {len(running)} running, "
                    f"{len(todo)} waiting{eta}")
                if c.state == "done" and (todo or running) and not got and on_done is not None:
                    on_done()
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for r in running.values():  # only when this loop itself failed
            r.proc.kill()
            r.close()
    if got:
        code = 128 + got[0]
        cells_now = "; ".join(f"{c.name} {c.error}" for c in stopped) or "no cell was running"
        raise Interrupted(f"sweep interrupted after {_fmt_s(time.time() - t0)}; {cells_now}; "
                          f"run the same command again to finish it", code)


def _emit(spec: SweepSpec, out: Path, cells: list[Cell], emit: Path, shared_dir: Optional[Path], log: _Log) -> None:
    emit.mkdir(parents=True, exist_ok=True)
    for c in cells:
        if c.script and Path(c.script).exists():
            log(f"{c.name}: {c.script} (written before)")
            continue
        cmd = _train_command(spec, out, c, 1, None, emit, shared_dir)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            c.state, c.error = "failed", (r.stderr.strip().splitlines() or ["no output"])[-1]
        else:
            c.state, c.script = "emitted", str(emit / f"{c.name}.sh")
            c.run_dir = r.stdout.strip().splitlines()[-1]
        _save_manifest(out, spec, cells)
        log(f"{c.name}: {c.state} {c.script or c.error}")


def cell_eval_dir(out: Path, cell: Cell) -> Path:
    """Where a cell's --eval evaluations go: SWEEP/evals/<cell>/, never into the run (whose evaluation
    folders its trainer alone writes)."""
    return out / "evals" / cell.name


def _evaluate_cells(spec: SweepSpec, out: Path, done: list[Cell], log: _Log) -> None:
    """Each final checkpoint on the --eval benchmarks, prompted as it was trained (the recipe's
    data.template), under each benchmark's protocol unless --eval-n / --eval-limit say otherwise; into
    `cell_eval_dir`."""
    import yaml

    from benchmarks.evaluation.evaluate import run_eval

    for c in done:
        ckpt = Path(c.run_dir) / "checkpoints" / "latest"
        template = yaml.safe_load((Path(c.run_dir) / "config.yaml").read_text())["data"]["template"]
        t = time.time()
        run_eval(str(ckpt), list(spec.evals), n=spec.eval_n, limit=spec.eval_limit,  # keyed: re-runs skip work
                 template=template, seed=c.seed, out=cell_eval_dir(out, c))
        log(f"evaluated {c.name} on {', '.join(spec.evals)} into {cell_eval_dir(out, c)} in {_fmt_s(time.time() - t)}")


# --------------------------------------------------------------------------------------- report
def dynamics_summary(rows: list[dict], h_tgt: float) -> dict:
    """Numbers that say whether a run shows the Fig. 3 shape: the entropy at the start and end, its
    band and least-squares trend over the second half, the gate's on-share, the last evaluation."""
    train = [r for r in rows if "entropy" in r]
    if not train:
        return {}
    ent = [r["entropy"] for r in train]
    half = ent[len(ent) // 2 :]
    tail = ent[-max(5, len(ent) // 5) :]
    xs = list(range(len(half)))
    mx, my = sum(xs) / len(xs), sum(half) / len(half)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, half)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    evals = [r for r in rows if any(k.startswith("eval/") and k.endswith("/acc") for k in r)]
    last_eval = evals[-1] if evals else {}
    acc = next((v for k, v in last_eval.items() if k.startswith("eval/") and k.endswith("/acc")), None)
    return {
        "steps": train[-1]["step"],
        "entropy_start": ent[0],
        "entropy_end": sum(tail) / len(tail),
        "entropy_2nd_half_min": min(half),
        "entropy_2nd_half_max": max(half),
        "entropy_2nd_half_mean": sum(half) / len(half),
        "slope_2nd_half_per_100": 100 * slope,
        "still_falling": 100 * slope < -0.01,
        "gate_on_share": sum(r.get("stare/gate", 0.0) for r in train) / len(train),
        "eval_acc": acc,
        "train_reward_last": sum(r["reward"] for r in train[-10:]) / len(train[-10:]),
        **_logged_mean(train, "len/mean", "len_end"),
        **_logged_mean(train, "reflection_rate", "reflection_rate_end"),
        **_logged_mean(train, "stapo/spurious_frac", "silenced_share", tail=False),
        **_logged_mean(train, "rsi/kept", "rsi_kept_share", tail=False),
        **_logged_mean(train, "actor/covk/mean_w", "kernel_mean_w", tail=False),
        **_logged_mean(train, "stare/sel_pos", "stare_sel_pos", tail=False),
        **_logged_mean(train, "stare/sel_neg", "stare_sel_neg", tail=False),
        **_logged_mean(train, "actor/kl_frac", "kl_cov_share", tail=False),
        **_logged_mean(train, "actor/clip_frac", "cut_share", tail=False),
        "h_tgt": h_tgt,
    }


def _logged_mean(rows: list[dict], key: str, name: str, tail: bool = True) -> dict:
    """{name: mean of `key` over the last fifth of the rows that logged it (at least 5), or over all of them
    with tail=False (a method's own number: STAPO's silenced share, the covariance kernel's mean weight)},
    or {} when never logged."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    if tail:
        vals = vals[-max(5, len(vals) // 5):]
    return {name: sum(vals) / len(vals)} if vals else {}


def seeds_summary(per_seed: list[dict], within: Optional[tuple[float, float]] = None) -> dict:
    """Mean, sample std and interval over seeds of every numeric summary value: {key: {"mean", "std", "n",
    "ci95", "kind"}}, the interval `seed_interval`'s (95% t for 3+ seeds, the range for 2, as `stare compare
    --ci` and the paired differences; cut to `within`, the range every value's mean can take), none for
    one seed ("ci95" None, std 0)."""
    from benchmarks.evaluation.metrics import seed_interval

    out: dict[str, dict] = {}
    keys = [k for k in per_seed[0] if isinstance(per_seed[0][k], (int, float)) and not isinstance(per_seed[0][k], bool)]
    for k in keys:
        vals = [float(s[k]) for s in per_seed if s.get(k) is not None]
        if not vals:
            continue
        lo, hi, kind = seed_interval(vals, within) if len(vals) > 1 else (None, None, "one seed")
        out[k] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                  "n": len(vals), "ci95": None if lo is None else [lo, hi], "kind": kind}
    return out


def sweep_command(spec: SweepSpec, cells: list[Cell], out: Path) -> str:
    """The `stare sweep` command of the whole grid in `out`: the spec's settings with every method and
    seed of the manifest's cells, in its order (seed-major, so methods and seeds in the order they
    first ran). Running it again skips the finished cells and resumes the others."""
    import shlex

    argv = ["stare", "sweep", "--recipe", spec.recipe]
    for m in dict.fromkeys(c.method for c in cells):
        argv += ["-m", m]
    for seed in dict.fromkeys(c.seed for c in cells):
        argv += ["-s", str(seed)]
    for o in spec.overrides:
        argv += ["-o", o]
    if spec.backend:
        argv += ["--backend", spec.backend]
    for b in spec.evals:
        argv += ["--eval", b]
    for flag, v in (("--eval-n", spec.eval_n), ("--eval-limit", spec.eval_limit)):
        if v is not None:
            argv += [flag, str(v)]
    return shlex.join([*argv, "--out", str(out)])


def _short_sha(sha: Optional[str]) -> str:
    if not sha:
        return "unknown"
    return sha[:7] + ("-dirty" if sha.endswith("-dirty") else "")


def cell_provenance(out: Path, cell: Cell) -> dict:
    """Where a cell's numbers come from: its run directory (relative to the sweep folder when inside it),
    the last step it logged of its total, each start, resume and restart with its step and commit (its
    config-history.jsonl), the training reward's grader (meta.json) and the evaluations' graders."""
    run = Path(cell.run_dir) if cell.run_dir else cell_run_dir(out, cell)
    d: dict = {"cell": cell.name, "state": cell.state, "run_dir": None, "steps": None, "of": None,
               "history": [], "reward_grader": None, "eval_graders": []}
    if run is None or not run.exists():
        return d
    inside = run.resolve().is_relative_to(out.resolve())  # the manifest's paths are absolute, --out may not be
    d["run_dir"] = str(run.resolve().relative_to(out.resolve())) if inside else str(run)
    d["steps"] = _last_logged_step(run)
    d["of"] = run_total_steps(run)
    d["history"] = [{"event": h.get("event", "?"), "step": h.get("step"), "commit": h.get("git_sha")}
                    for h in read_jsonl(run / "config-history.jsonl")]
    try:
        d["reward_grader"] = json.loads((run / "meta.json").read_text()).get("reward_grader")
    except (OSError, ValueError):
        pass
    d["eval_graders"] = sorted({str(r.identity["grader"]) for r in find_records(
        [run, *([cell_eval_dir(out, cell)] if cell_eval_dir(out, cell).is_dir() else [])]).records})
    return d


def provenance_markdown(prov: dict) -> list[str]:
    """The report's last section: the grid's command, what wrote the report, and one row per cell."""
    lines = ["", "## Provenance", "",
             f"The grid: `{prov['command']}` (its manifest: sweep.json; the same command resumes or skips each "
             f"cell). This report was written at {prov['written']} by stare at commit {prov['commit'] or 'unknown'}.",
             "", "Each cell is a run directory with its reproduction card (REPRODUCE.md) and its "
             "config-history.jsonl (every start, resume and restart, with the command and the commit):", "",
             "| cell | state | steps | run directory | starts and resumes (step, commit) | graders: reward; evaluation |",
             "|---|---|---|---|---|---|"]
    for c in prov["cells"]:
        steps = "-" if c["steps"] is None else f"{c['steps']} of {c['of'] if c['of'] is not None else '?'}"
        hist = "; ".join(f"{h['event']} {h['step']} {_short_sha(h['commit'])}" for h in c["history"]) or "-"
        graders = f"{c['reward_grader'] or '-'}; {', '.join(c['eval_graders']) or '-'}"
        lines.append(f"| {c['cell']} | {c['state']} | {steps} | {c['run_dir'] or '-'} | {hist} | {graders} |")
    return lines


def _report(spec: SweepSpec, out: Path, done: list[Cell], paper: Optional[str],
            cells: Optional[list[Cell]] = None) -> tuple[str, list[str]]:
    """table.md / table.csv (`stare compare` over the finished cells), the dynamics plot, and
    summary.json with the per-seed Fig. 3 numbers and their mean, spread and interval per method;
    `cells` (the manifest's) for the count of finished cells and the names of those not yet in it."""
    import yaml

    from stare_cli.analysis import compare as C

    runs = [Path(c.run_dir) for c in done]
    notes: list[str] = []
    results = C.load_inputs(runs, notes=notes)  # the table: each run's own evaluations at its last step
    cols = C.columns(results, with_paper=paper is not None)
    rows, info = C.build_rows(results, "avg", cols)
    info["reader_notes"] = notes
    if paper:
        rows = rows + C.paper_rows(paper, cols)
    md = C.render(rows, info, "md", C.add_delta(rows, None), cols, True)
    atomic_write_text(out / "table.md", md)
    atomic_write_text(out / "table.csv", C.render(rows, info, "csv", C.add_delta(rows, None), cols, True))
    h_tgt = yaml.safe_load((runs[0] / "config.yaml").read_text())["method"]["stare"]["h_tgt"]
    plots = [str(p) for p in C.write_plots(results, out, h_tgt)]
    per_method: dict[str, dict] = {}
    for c in done:
        s = dynamics_summary(read_jsonl(Path(c.run_dir) / "metrics.jsonl"), h_tgt)
        per_method.setdefault(c.method, {"seeds": {}})["seeds"][c.seed] = s
    from benchmarks.evaluation.metrics import PERCENT

    evals = cell_evaluations(out, done)
    per_seed_evals = {m: {c.seed: evals[c.name] for c in done if c.method == m} for m in per_method}
    baseline = next((m for m in spec.methods if m in per_method), None)
    for m, d in per_method.items():
        d["over_seeds"] = seeds_summary(list(d["seeds"].values()))
        d["evaluations"] = {k: seeds_summary(v, within=PERCENT) for k, v in sorted(
            _by_key([evals[c.name] for c in done if c.method == m]).items(), key=lambda kv: _eval_order(kv[0]))}
        if m != baseline:
            d["paired_vs_baseline"] = paired_differences(per_seed_evals[m], per_seed_evals[baseline])
        quiet = {c.seed: why for c in done if c.method == m and (why := run_acted(Path(c.run_dir), None))}
        if quiet:  # each cell's metrics read once
            d["never_acted"] = quiet
    cells = cells if cells is not None else done
    summary = {"settings": spec.settings(), "baseline": baseline,
               "cells": {"finished": [c.name for c in cells if c.state == "done"],
                         "not_finished": {c.name: c.state for c in cells if c.state != "done"}},
               "methods": per_method,
               "provenance": {"command": sweep_command(spec, cells, out),
                              "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_sha(),
                              "cells": [cell_provenance(out, c) for c in cells]}}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    atomic_write_text(out / "report.md", report_markdown(summary))
    plots += [str(p) for p in plot_evals_over_training(
        {m: d["evaluations"] for m, d in per_method.items()}, out / "passk_over_training")]
    return md, plots


def cell_evaluations(out: Optional[Path], cells: list[Cell]) -> dict[str, dict[str, dict]]:
    """Every evaluation of each cell (its run's own, and its --eval ones under `cell_eval_dir`), read through
    the one reader and keyed by the one identity: {cell name: {key: metrics (avg@, pass@, maj@)}}. A key is
    '<bench> n=<N> step=<S>', with '[field=value, ...]' added where evaluations differ in more (the ledger's
    identity less the method, which tells the cells apart): two records never share a key unless they differ
    in the seed and the method alone."""
    from stare_kernel.reader import find_records

    recs: dict[str, list] = {}
    for c in cells:
        paths = [Path(c.run_dir)] + ([cell_eval_dir(out, c)] if out is not None and cell_eval_dir(out, c).is_dir() else [])
        recs[c.name] = find_records(paths).records
    return _keyed(recs)


def _keyed(recs: dict[str, list]) -> dict[str, dict[str, dict]]:
    from stare_kernel.ledger import labels_by_difference, pool_key

    # The method (and its parameters, where every cell of a method has the same) tells the cells apart: the
    # rest of the identity, the recipe included, is what an evaluation key must share to be paired.
    params: dict = {}
    for rs in recs.values():
        for r in rs:
            params.setdefault(r.identity.get("method"), set()).add(json.dumps(r.identity.get("method_params")))
    drop = ("method",) + (("method_params",) if all(len(v) <= 1 for v in params.values()) else ())

    def eval_identity(r) -> dict:
        return {**r.identity, **{f: None for f in drop}}

    distinct = {pool_key(eval_identity(r)): eval_identity(r) for rs in recs.values() for r in rs}
    names: dict[str, str] = {}
    by_head: dict[str, list[str]] = {}
    for k, ident in distinct.items():
        head = f"{ident['benchmark']} n={ident['n']} step={'?' if ident['step'] is None else ident['step']}"
        by_head.setdefault(head, []).append(k)
    for head, keys in by_head.items():
        tags = labels_by_difference([distinct[k] for k in keys])
        for k, tag in zip(keys, tags):
            names[k] = head + (f" [{tag}]" if tag else "")
    out: dict[str, dict[str, dict]] = {}
    for cell, rs in recs.items():
        mine: dict[str, dict] = {}
        for r in sorted(rs, key=lambda r: r.written):  # a seed evaluated twice: the later
            mine[names[pool_key(eval_identity(r))]] = {k: v for k, v in r.metrics.items()
                                                       if k.startswith(("avg@", "pass@", "maj@"))}
        out[cell] = mine
    return out


def _by_key(per_cell: list[dict[str, dict]]) -> dict[str, list[dict]]:
    per: dict[str, list[dict]] = {}
    for ev in per_cell:
        for key, metrics in ev.items():
            per.setdefault(key, []).append(metrics)
    return per


def eval_summary(runs: list[Path]) -> dict:
    """Evaluation metrics of a method's runs (seeds), per evaluation key (`cell_evaluations`): each metric's
    mean, std and 95% interval over seeds (all percentages)."""
    from benchmarks.evaluation.metrics import PERCENT
    from stare_kernel.reader import find_records

    keyed = _keyed({str(r): find_records([r]).records for r in runs})
    per = _by_key(list(keyed.values()))
    return {k: seeds_summary(per[k], within=PERCENT) for k in sorted(per, key=_eval_order)}


def _eval_order(key: str) -> tuple:
    bench, n, step = key.split()[:3]
    return bench, int(n[2:]), int(step[5:]) if step[5:].isdigit() else 1 << 30, key


def paired_differences(method: dict[int, dict[str, dict]], baseline: dict[int, dict[str, dict]]) -> dict:
    """Per evaluation key and metric, the method's value minus the baseline's, paired by seed, over the
    seeds that have the key in both (two or more): {key: {metric: {"mean", "ci95", "kind", "seeds"}}},
    the interval `seed_interval`'s (95% t for 3+ seeds, the range for 2). Arguments: seed -> key -> metrics
    (`_run_evaluations` per seed)."""
    from benchmarks.evaluation.metrics import PERCENT_DIFFERENCE, seed_interval

    keys = sorted({k for ev in method.values() for k in ev}, key=_eval_order)
    out: dict[str, dict] = {}
    for key in keys:
        seeds = sorted(s for s in method if key in method[s] and key in baseline.get(s, {}))
        if len(seeds) < 2:
            continue
        metrics = [x for x in method[seeds[0]][key] if all(x in method[s][key] and x in baseline[s][key] for s in seeds)]
        for x in metrics:
            diffs = [method[s][key][x] - baseline[s][key][x] for s in seeds]
            lo, hi, kind = seed_interval(diffs, within=PERCENT_DIFFERENCE)
            out.setdefault(key, {})[x] = {"mean": statistics.fmean(diffs), "ci95": [lo, hi], "kind": kind,
                                          "seeds": seeds}
    return out


SEED_INTERVALS = "mean ± std over seeds [95% t-interval for 3+ seeds, the range for 2]; one seed: its value"


def over_seeds_text(o: Optional[dict], digits: int, scale: float = 1.0) -> str:
    """One `seeds_summary` entry as "mean ± std [lo, hi]" (values times `scale`), the value alone for one
    seed, "–" when absent."""
    if not o:
        return "–"
    m = scale * o["mean"]
    if not o.get("ci95"):
        return f"{m:.{digits}f}"
    sd, (lo, hi) = scale * o["std"], (scale * v for v in o["ci95"])
    return f"{m:.{digits}f} ± {sd:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def report_markdown(summary: dict) -> str:
    """summary.json as tables: the Fig. 3 numbers, each evaluation's pass@k over seeds, the paired
    differences, then the provenance (where summary.json has it)."""
    lines = [f"# Sweep report: {summary['settings']['recipe']}", ""]
    cells = summary.get("cells")
    if cells:
        n_done, rest = len(cells["finished"]), cells["not_finished"]
        lines += [f"Cells: {n_done} of {n_done + len(rest)} finished" + (
            "" if not rest else "; **interim**: the tables hold the finished cells only; not in them: "
            + ", ".join(f"{name} ({state})" for name, state in rest.items())), ""]
    lines += [f"{SEED_INTERVALS[0].upper()}{SEED_INTERVALS[1:]}; n = seeds.", ""]
    methods = summary["methods"]
    keys = ("entropy_start", "entropy_end", "entropy_2nd_half_mean", "slope_2nd_half_per_100", "train_reward_last",
            "len_end", "reflection_rate_end")
    quiet = {m: d["never_acted"] for m, d in methods.items() if d.get("never_acted")}
    if quiet:
        lines += ["**The method never acted** (these runs trained as the baseline did): " + "; ".join(
            f"{m} seed{'s' if len(v) > 1 else ''} {', '.join(map(str, v))}: {next(iter(v.values()))}"
            for m, v in quiet.items()), ""]
    lines += ["| method | n | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for m, d in methods.items():
        o = d["over_seeds"]
        cells = [over_seeds_text(o.get(k), 3) for k in keys]
        lines.append(f"| {m} | {len(d['seeds'])} | " + " | ".join(cells) + " |")
    own = ("gate_on_share", "stare_sel_pos", "stare_sel_neg", "silenced_share", "rsi_kept_share", "kernel_mean_w",
           "kl_cov_share", "cut_share")  # what each method did, averaged over its steps
    lines += ["", "Per method, over all steps: the STARE gate's on-share and the shares of valid tokens in L+ and L- "
              "(selected whatever the gate), STAPO's silenced share, RSI-S's kept share, the covariance kernel's "
              "mean weight, the share "
              "KL-Cov penalises, and the share whose gradient is cut (PPO's clip; Clip-Cov's detached tokens).", "",
              "| method | " + " | ".join(own) + " |", "|---|" + "---|" * len(own)]
    for m, d in methods.items():
        lines.append(f"| {m} | " + " | ".join(over_seeds_text(d["over_seeds"].get(k), 4) for k in own) + " |")
    evals = list(dict.fromkeys(k for d in methods.values() for k in d.get("evaluations", {})))
    for key in evals:
        metrics = sorted({x for d in methods.values() for x in d["evaluations"].get(key, {})},
                         key=lambda x: (x.split("@")[0], int(x.split("@")[1])))
        metrics = [x for x in metrics if not x.startswith("maj@")]
        lines += ["", f"## {key}", "", "| method | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
        for m, d in methods.items():
            e = d["evaluations"].get(key, {})
            lines.append(f"| {m} | " + " | ".join(over_seeds_text(e.get(x), 1) for x in metrics) + " |")
    base = summary.get("baseline")
    for m, d in methods.items():
        paired = d.get("paired_vs_baseline")
        if not paired:
            continue
        metrics = sorted({x for e in paired.values() for x in e if not x.startswith("maj@")},
                         key=lambda x: (x.split("@")[0], int(x.split("@")[1])))
        lines += ["", f"## Paired by seed: {m} minus {base}", "",
                  "Mean of the per-seed differences [95% t-interval for 3+ seeds, the range for 2]; seeds paired.", "",
                  "| evaluation | seeds | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
        for key, e in paired.items():
            seeds = next(iter(e.values()))["seeds"]
            cells = ["–" if x not in e else f"{e[x]['mean']:+.1f} [{e[x]['ci95'][0]:+.1f}, {e[x]['ci95'][1]:+.1f}]"
                     for x in metrics]
            lines.append(f"| {key} | {', '.join(map(str, seeds))} | " + " | ".join(cells) + " |")
    if summary.get("provenance"):
        lines += provenance_markdown(summary["provenance"])
    return "\n".join(lines) + "\n"
