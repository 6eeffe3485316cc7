"""`stare sweep` through the real CLI on the quick toy (issue 16): a 2 methods x 2 seeds grid runs
end to end, is killed with SIGKILL midway, and the same command finishes it with every cell's
metrics equal to an uninterrupted sweep's, then writes the table and the plot."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_embedded import FAST, _rows_without_time


def _args(out: Path, model: Path, *extra: str) -> list[str]:
    args = ["sweep", "--recipe", "tiny/arith", "--method", "grpo-ds", "--method", "stare-o1", "--seed", "1",
            "--seed", "2", "--parallel", "2", "--out", str(out), "-o", f"model.path={model}"]
    for o in [*FAST, "optim.total_steps=4", "checkpoint.every=1", "checkpoint.keep_last=1", *extra]:
        args += ["-o", o]
    return args


def _cells(out: Path) -> dict[str, dict]:
    return {f"{c['method']}-seed{c['seed']}": c for c in json.loads((out / "sweep.json").read_text())["cells"]}


def _procs_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(pid)
            except OSError:
                pass
    return found


def test_sweep_killed_midway_finishes_like_an_uninterrupted_one(cli, tmp_path, quick_toy):
    ref = tmp_path / "ref"
    code, out, err = cli(*_args(ref, quick_toy))
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith(("| GRPO-ds", "| STARE-O1"))]
    assert len(rows) == 2 and all(r.endswith("| 2 |") for r in rows), out  # one row per method, 2 seeds each
    assert {c["state"] for c in _cells(ref).values()} == {"done"} and len(_cells(ref)) == 4
    assert (ref / "table.md").read_text() == out and (ref / "dynamics.png").exists()
    summary = json.loads((ref / "summary.json").read_text())
    assert set(summary["methods"]) == {"grpo-ds", "stare-o1"}
    over = summary["methods"]["stare-o1"]["over_seeds"]["entropy_end"]
    assert over["n"] == 2 and over["ci95"][0] <= over["mean"] <= over["ci95"][1]
    report = (ref / "report.md").read_text()  # the dynamics over seeds, then every evaluation over seeds
    assert "| stare-o1 | 2 |" in report and "## toy:arith n=1 step=4" in report
    assert summary["methods"]["grpo-ds"]["evaluations"]["toy:arith n=1 step=4"]["avg@1"]["n"] == 2
    log = (ref / "sweep.log").read_text()
    assert log.count(" done in ") == 4 and "ETA" in log
    # the report was written over the first finished cell while the others ran, then over all four
    assert f"report of the 1 of 4 cells finished so far: {ref / 'report.md'}" in log
    assert report.startswith("# Sweep report: tiny/arith\n\nCells: 4 of 4 finished\n") and "interim" not in report
    # ... and ends with where every number comes from (issue 48: traceable to commit and command)
    prov = report.split("## Provenance\n")[1]
    assert (f"The grid: `stare sweep --recipe tiny/arith -m grpo-ds -m stare-o1 -s 1 -s 2 -o model.path={quick_toy}"
            in prov and f"--out {ref}`" in prov)
    for name, cell in _cells(ref).items():
        sha = json.loads((Path(cell["run_dir"]) / "meta.json").read_text())["git_sha"]
        assert (f"| {name} | done | 4 of 4 | cells/{name}/{Path(cell['run_dir']).name} | start 0 {sha[:7]}"
                f"{'-dirty' if sha.endswith('-dirty') else ''} | math-verify@8; math-verify@8 |") in prov, name

    # the same sweep in a process of its own, killed with SIGKILL once a cell has checkpointed twice
    b = tmp_path / "b"
    p = subprocess.Popen([sys.executable, "-m", "stare_cli", *_args(b, quick_toy)], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline:
        rows = [len(m.read_text().splitlines()) for m in b.glob("cells/*/*/metrics.jsonl")]
        if rows and max(rows) >= 2:
            break
        time.sleep(0.05)
    p.kill()
    p.wait()
    time.sleep(1.0)
    assert not _procs_with(str(b)), "a cell kept training after the sweep was killed"
    states = {c["state"] for c in _cells(b).values()}
    assert "running" in states and "done" not in states  # killed midway

    code, out, err = cli(*_args(b, quick_toy))
    assert code == 0, err
    for name, cell in _cells(b).items():
        assert cell["state"] == "done", (name, cell)
        mine = _rows_without_time(Path(cell["run_dir"]) / "metrics.jsonl")
        theirs = _rows_without_time(Path(_cells(ref)[name]["run_dir"]) / "metrics.jsonl")
        assert mine == theirs, name
    assert (b / "table.md").exists() and (b / "dynamics.png").exists()
    # the killed cells' rows in the provenance name their resume, at the step of the checkpoint it took
    assert re.search(r"\| start 0 \w+(-dirty)?; resume [1-3] \w+", (b / "report.md").read_text().split("## Provenance")[1])

    # once more: nothing left to do, nothing redone
    code, _, err = cli(*_args(b, quick_toy))
    assert code == 0 and "4 already finished, 0 to run" in err


def test_a_failed_cell_does_not_stop_the_others(cli, tmp_path, quick_toy, monkeypatch):
    from stare_cli.analysis import sweep

    monkeypatch.setattr(sweep, "PROGRESS_FIRST_S", 0.0)  # (issue 30, item 13: the running cells' steps and ETA)
    monkeypatch.setattr(sweep, "PROGRESS_EVERY_S", 1.0)
    out = tmp_path / "s"
    # one cell's run directory is broken before the sweep runs (its resume fails); the rest train
    bad = out / "cells" / "grpo-ds-seed1" / "broken"
    bad.mkdir(parents=True)
    (bad / "meta.json").write_text("{}")
    (bad / "config.yaml").write_text("optim: [not, a, mapping]\n")
    code, _, err = cli(*_args(out, quick_toy))
    assert code == 1 and "1 of 4 cells failed: grpo-ds-seed1" in err
    cells = _cells(out)
    assert cells["grpo-ds-seed1"]["state"] == "failed" and cells["grpo-ds-seed1"]["error"]
    assert all(c["state"] == "done" for n, c in cells.items() if n != "grpo-ds-seed1")
    assert (out / "table.md").exists()  # the table of the cells that finished
    progress = [ln for ln in (out / "sweep.log").read_text().splitlines() if " progress: " in ln]
    assert progress and any(" step " in ln and "steps/min" in ln and "ETA" in ln for ln in progress), progress
    assert any(" progress: " in ln for ln in err.splitlines())  # on stderr too


def test_a_cells_progress_is_read_from_its_log(tmp_path):
    from stare_cli.analysis.sweep import _cell_progress

    (tmp_path / "logs").mkdir()
    assert _cell_progress(tmp_path, "a").text == "a starting"
    (tmp_path / "logs" / "a.log").write_text("$ stare train ...\n")
    assert _cell_progress(tmp_path, "a").text == "a setting up"
    # before the first step, the latest line, without its clock (it said 'setting up' for the 8 minutes
    # of a step-0 evaluation); no time left is read from an evaluation's own ETA
    with open(tmp_path / "logs" / "a.log", "a") as f:
        f.write("14:09:50 step 0: evaluating words:two-step before training\n")
    assert _cell_progress(tmp_path, "a").text == "a: step 0: evaluating words:two-step before training"
    with open(tmp_path / "logs" / "a.log", "a") as f:
        f.write("words:two-step: 16/32 problems in 4m00s, 34729 tokens at 144.7 tok/s, ETA 4m00s\n")
    p = _cell_progress(tmp_path, "a")
    assert p.text == "a: words:two-step: 16/32 problems in 4m00s, 34729 tokens at 144.7 tok/s, ETA 4m00s"
    assert p.left_s is None
    with open(tmp_path / "logs" / "a.log", "a") as f:
        f.write("step 3/30  reward 0.5  entropy 0.4  time/step 60s  0.75 steps/min  ETA ?\n")
    p = _cell_progress(tmp_path, "a")
    assert p.text == "a step 3/30, 0.75 steps/min, ETA ?" and p.left_s is None
    with open(tmp_path / "logs" / "a.log", "a") as f:
        f.write("step 4/30  reward 0.6  entropy 0.4  time/step 60s  0.72 steps/min  ETA 31m50s\n")
    p = _cell_progress(tmp_path, "a")
    assert p.text == "a step 4/30, 0.72 steps/min, ETA 31m50s"
    assert (p.left_s, p.unpriced_evals) == (31 * 60 + 50, 0)
    # a resumed cell has timed no evaluation yet: its ETA says how many it leaves out, and so does the
    # sweep's line (it read 'ETA 20m17s' for '20m17s + 1 evaluation')
    with open(tmp_path / "logs" / "a.log", "a") as f:
        f.write("step 53/60  reward 0.469  entropy 0.0713  time/step 90.3s  0.62 steps/min  ETA 1h10m32s + 2 evaluations\n")
    p = _cell_progress(tmp_path, "a")
    assert p.text == "a step 53/60, 0.62 steps/min, ETA 1h10m32s + 2 evaluations"
    assert (p.left_s, p.unpriced_evals) == (3600 + 10 * 60 + 32, 2)


def test_sweep_time_left_schedules_the_waiting_cells_on_the_slot_that_frees_first():
    from stare_cli.analysis.sweep import sweep_time_left

    # two slots, running cells with 600 s and 300 s left; two waiting cells of 1000 s each:
    # the first starts at 300 (ends 1300), the second at 600 (ends 1600) -> 1600
    assert sweep_time_left([600, 300], [1000, 1000], 2) == 1600
    # one running cell (200 s left) and an idle slot: the waiting 500 s cell starts at once -> max(200, 500)
    assert sweep_time_left([200], [500], 2) == 500
    # one slot: everything in a row, 100 + 50 + 70
    assert sweep_time_left([100], [50, 70], 1) == 220
    assert sweep_time_left([], [], 2) == 0
    # an unknown time or cost gives no ETA rather than a wrong one
    assert sweep_time_left([None, 300], [1000], 2) is None
    assert sweep_time_left([600], [None], 2) is None


def _finished_cell(root: Path, steps: list[float], evals: dict[int, float], total: int) -> Path:
    run = root / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(f"optim: {{total_steps: {total}}}\n")
    rows = [{"step": k + 1, "entropy": 0.5, "time/step": t} for k, t in enumerate(steps)]
    for step, t in evals.items():
        d = run / "eval" / f"step-{step:06d}" / "words-two-step"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"elapsed_s": t, "metrics": {}}))
        (d / "results").mkdir()  # the per-grader copies: not counted twice
        (d / "results" / "k-math-verify.json").write_text(json.dumps({"elapsed_s": t}))
        if step:
            rows[step - 1]["time/eval"] = t
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_cells_cost_counts_its_steps_and_evaluations_however_often_it_was_resumed(tmp_path):
    """The sweep's ETA took the mean wall time of the cells finished by this command: after a resume, a
    cell that ran its last 8 of 60 steps in 25 minutes made a 10-hour sweep read 'ETA 2h30m'. A cell's
    cost is read from its records instead."""
    from stare_cli.analysis.sweep import Cell, _share_left, _SweepClock, cell_cost_s

    run = _finished_cell(tmp_path / "a", [60.0, 60.0, 90.0], {0: 100.0, 3: 50.0}, total=3)
    assert cell_cost_s(run) == 60 + 60 + 90 + 100 + 50  # 360; time/eval on step 3 is the same evaluation
    assert _share_left(run) == 0.0 and _share_left(None) == 1.0
    (run / "config.yaml").write_text("optim: {total_steps: 12}\n")
    assert _share_left(run) == 0.75  # 3 of 12 steps run
    assert cell_cost_s(_finished_cell(tmp_path / "b", [], {}, total=3)) is None  # no time/step logged

    out = tmp_path / "sweep"
    (out / "logs").mkdir(parents=True)
    clock = _SweepClock(out, parallel=2)
    assert clock.cost("grpo-ds") is None  # nothing finished: no estimate
    clock.finished(Cell("grpo-ds", 1, run_dir=str(run), state="done"))
    clock.finished(Cell("stare-o1", 1, run_dir=str(_finished_cell(tmp_path / "c", [100.0] * 3, {}, 3)), state="done"))
    clock.finished(Cell("kl-cov", 1, run_dir=str(run), state="failed"))  # only finished cells count
    assert clock.cost("grpo-ds") == 360 and clock.cost("stare-o1") == 300
    assert clock.cost("kl-cov") == (360 + 300) / 2  # no kl-cov cell finished: every finished cell's mean
    # no cell running, three waiting on two slots: 360 | 300, then kl-cov (330) after stare-o1 -> 630
    assert clock.left({}, [Cell("grpo-ds", 2), Cell("stare-o1", 2), Cell("kl-cov", 2)]) == 630
    # a run that logs no time/step (verl's): the wall time of the command that finished it
    clock.finished(Cell("dapo", 1, run_dir=str(tmp_path / "b" / "run"), state="done", seconds=1000.0))
    assert clock.cost("dapo") == 1000


def test_cells_run_seed_by_seed_and_earlier_cells_keep_their_place(tmp_path):
    """A sweep stopped part-way should hold whole seeds (every method of seed 1 before any of seed 2):
    the comparison pairs methods by seed. Cells an earlier command recorded stay in the manifest."""
    from stare_cli.analysis.sweep import SweepSpec, _load_manifest, _save_manifest

    spec = SweepSpec("tiny/arith", ("grpo-ds", "stare-o1", "kl-cov"), (1, 2))
    cells = _load_manifest(tmp_path, spec)
    assert [c.name for c in cells] == ["grpo-ds-seed1", "stare-o1-seed1", "kl-cov-seed1",
                                       "grpo-ds-seed2", "stare-o1-seed2", "kl-cov-seed2"]
    cells[0].state = "done"
    _save_manifest(tmp_path, spec, cells)
    # the next command asks for seed 3 only: its cells first, the earlier six after them, state kept
    more = _load_manifest(tmp_path, SweepSpec("tiny/arith", ("grpo-ds", "stare-o1"), (3,)))
    assert [c.name for c in more][:2] == ["grpo-ds-seed3", "stare-o1-seed3"]
    assert len(more) == 8 and next(c for c in more if c.name == "grpo-ds-seed1").state == "done"


def test_a_sweep_directory_keeps_its_settings(cli, tmp_path, quick_toy):
    out = tmp_path / "s"
    out.mkdir()
    settings = {"recipe": "tiny/arith", "overrides": ["optim.lr=1e-4"], "backend": None, "evals": [], "eval_n": None,
                "eval_limit": None}
    (out / "sweep.json").write_text(json.dumps({"settings": settings, "cells": []}))
    code, _, err = cli(*_args(out, quick_toy))
    assert code == 1 and "holds a sweep with other settings (overrides)" in err


def test_sweep_usage_errors(cli, tmp_path):
    code, _, err = cli("sweep", "--recipe", "tiny/arith", "--method", "grpo-ds", "--seed", "1", "--backend", "verl",
                       "--parallel", "2", "--out", str(tmp_path / "x"))
    assert code == 2 and "one after another" in err
    code, _, err = cli("sweep", "--recipe", "tiny/arith", "--method", "grpo-dz", "--seed", "1")
    assert code == 1 and "did you mean 'grpo-ds'" in err


def _setting(folder: Path, key: str, n: int, limit: int, avg: float, grader: str = "math-verify") -> None:
    """A results file as a trainer wrote it before the ledger: FOLDER = <run>/eval/step-N/<bench>."""
    (folder / "results").mkdir(parents=True, exist_ok=True)
    step = int(folder.parent.name.split("-")[1])
    res = {"benchmark": "toy:arith", "key": key, "grader": f"{grader}@3",
           "protocol": {"n": n, "temperature": 1.0, "top_p": 1.0, "template": "raw", "max_tokens": 56},
           "settings": {"model": f"{folder.parent.parent.parent}@step-{step}", "n": n, "limit": limit},
           "metrics": {"n": n, "problems": limit, f"avg@{n}": avg, "pass@1": avg}}
    (folder / "results" / f"{key}-{grader}.json").write_text(json.dumps(res))
    (folder / "results.json").write_text(json.dumps(res))


def test_eval_summary_reads_every_setting_of_a_folder_once_per_run(tmp_path):
    """An in-training evaluation (n=2) and a final one (n=4) land in one folder as two settings; both
    count. Every other setting (another limit, another grader) is an evaluation of its own, named by what
    differs (issue 67: the summary read one per folder and grader, and pooled what differed); the same
    evaluation twice counts once per run: n stays the seeds."""
    from stare_cli.analysis.sweep import eval_summary

    runs = []
    for seed, (a, b) in enumerate([(10.0, 20.0), (30.0, 40.0)], start=1):
        run = tmp_path / f"run{seed}"
        folder = run / "eval" / "step-000004" / "toy-arith"
        _setting(folder, "aaaa", 2, 8, a)
        _setting(folder, "bbbb", 4, 8, b)
        os.utime(folder / "results" / "bbbb-math-verify.json", (1, 1))  # older than cccc below
        _setting(folder, "cccc", 4, 16, b + 1)  # n=4 again with another limit: the newest wins
        _setting(folder, "dddd", 4, 8, 99.0, grader="stare-official")  # another grader's file: not the latest
        (folder / "results.json").write_text((folder / "results" / "cccc-math-verify.json").read_text())
        _setting(folder, "eeee", 4, 16, b + 2)  # cccc's setting evaluated again: the newer counts, once
        runs.append(run)
    s = eval_summary(runs)
    assert list(s) == ["toy:arith n=2 step=4", "toy:arith n=4 step=4 [problems=16, grader=math-verify@3]",
                       "toy:arith n=4 step=4 [problems=8, grader=math-verify@3]",
                       "toy:arith n=4 step=4 [problems=8, grader=stare-official@3]"], list(s)
    assert s["toy:arith n=2 step=4"]["avg@2"]["mean"] == 20.0  # (10 + 30) / 2
    assert s["toy:arith n=4 step=4 [problems=8, grader=math-verify@3]"]["avg@4"]["mean"] == 30.0  # (20 + 40) / 2
    sixteen = s["toy:arith n=4 step=4 [problems=16, grader=math-verify@3]"]["avg@4"]
    assert sixteen["n"] == 2 and sixteen["mean"] == 32.0  # one per run, the newer: (22 + 42) / 2
    assert s["toy:arith n=4 step=4 [problems=8, grader=stare-official@3]"]["avg@4"]["mean"] == 99.0


def test_pass_at_k_over_training_is_drawn_only_with_two_steps(tmp_path):
    from stare_cli.analysis.plots import plot_evals_over_training

    one = {"m": {"toy:arith n=4 step=10": {"pass@1": {"mean": 1.0, "ci95": [0.5, 1.5]}}}}
    assert plot_evals_over_training(one, tmp_path / "x") == []
    two = {"m": {"toy:arith n=4 step=10": {"pass@1": {"mean": 1.0, "ci95": [0.5, 1.5]}, "pass@4": {"mean": 3.0, "ci95": [2.0, 4.0]}},
                 "toy:arith n=4 step=20": {"pass@1": {"mean": 2.0, "ci95": [1.5, 2.5]}, "pass@4": {"mean": 4.0, "ci95": [3.0, 5.0]}}}}
    paths = plot_evals_over_training(two, tmp_path / "x")
    assert [p.name for p in paths] == ["x.png", "x.svg"] and all(p.stat().st_size > 0 for p in paths)


def test_demo_runs_from_another_warm_up_and_prints_its_verdicts(cli, tmp_path, quick_toy):
    """`stare demo -o model.path=DIR` (how the README's rebuilt-warm-up claims are measured): the
    cells train from DIR, the table, verdicts and demo.json come out."""
    args = ["demo", "--out", str(tmp_path / "demo"), "--steps", "3", "--seed", "1", "--parallel", "2",
            "-o", f"model.path={quick_toy}"]
    for o in FAST:
        args += ["-o", o]
    code, out, err = cli(*args)
    assert code == 0, err
    assert out.count("verdict: ") == 3 and out.count("/1 seeds") == 3
    summ = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert set(summ["1"]) == {"grpo-ds", "stare-o1"} and summ["1"]["grpo-ds"]["steps"] == 3
    for cell in _cells(tmp_path / "demo").values():
        cfg = (Path(cell["run_dir"]) / "config.yaml").read_text()
        assert f"path: {quick_toy}" in cfg


def test_a_cell_that_prints_more_than_a_pipe_holds_still_finishes(tmp_path, monkeypatch):
    """A cell's stdout goes to a file: a cell that prints 1 MB (a pipe holds 64 KB, and the sweep reads
    a cell's output only once it exits) finishes, and its last line still names its run directory."""
    from stare_cli.analysis import sweep

    script = "for _ in range(10000): print('x' * 100)\nprint('/runs/the-run-dir')\n"
    monkeypatch.setattr(sweep, "_train_command", lambda *a, **k: [sys.executable, "-c", script])
    out = tmp_path / "sw"
    (out / "logs").mkdir(parents=True)
    spec = sweep.SweepSpec(recipe="tiny/arith", methods=("grpo-ds",), seeds=(1,))
    cells = [sweep.Cell("grpo-ds", 1)]

    def too_long(signum, frame):
        raise TimeoutError("the sweep waited on a cell blocked writing to a full pipe")

    old = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)
    try:
        sweep._train_cells(spec, out, cells, 1, 1, lambda m: None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert cells[0].state == "done" and cells[0].exit_code == 0 and cells[0].run_dir == "/runs/the-run-dir"


def test_a_command_runs_only_the_cells_it_names(tmp_path, monkeypatch):
    """Issue 48's sweep swapped its covariance baseline (KL-Cov for Clip-Cov): the command without
    `-m kl-cov` still trained the earlier command's KL-Cov cells, since every unfinished cell in the
    manifest ran. Now a command runs the cells it names; the others stay in the manifest as they were."""
    from stare_cli.analysis import sweep

    ran = tmp_path / "ran"
    ran.mkdir()
    script = f"import sys, pathlib; pathlib.Path({str(ran)!r}, sys.argv[1]).touch(); print('/runs/x')"
    monkeypatch.setattr(sweep, "_train_command", lambda spec, out, cell, *a: [sys.executable, "-c", script, cell.name])
    out = tmp_path / "sw"
    (out / "logs").mkdir(parents=True)
    spec = sweep.SweepSpec(recipe="tiny/arith", methods=("grpo-ds", "clip-cov"), seeds=(1,))
    cells = [sweep.Cell("grpo-ds", 1), sweep.Cell("clip-cov", 1),
             sweep.Cell("kl-cov", 1, state="interrupted"), sweep.Cell("grpo-ds", 2)]
    lines = []
    sweep._train_cells(spec, out, cells, 2, 1, lines.append)
    assert sorted(p.name for p in ran.iterdir()) == ["clip-cov-seed1", "grpo-ds-seed1"]
    assert [c.state for c in cells] == ["done", "done", "interrupted", "pending"]
    assert lines[0].endswith(": 2 cells (0 already finished, 2 to run, 2 at a time)")
    assert "kl-cov-seed1 (interrupted) is not named by this command: not run" in lines[1]


def _keyed_runs(runs: dict[int, Path]) -> dict[int, dict[str, dict]]:
    """seed -> evaluation key -> metrics of each run, as the sweep's report keys them (cell_evaluations)."""
    from stare_cli.analysis.sweep import _keyed
    from stare_kernel.reader import find_records

    keyed = _keyed({str(s): find_records([r]).records for s, r in runs.items()})
    return {s: keyed[str(s)] for s in runs}


def test_evaluations_are_paired_by_seed_against_the_first_method(tmp_path):
    """Issue 48: held-out results at each step, each method minus the baseline, paired by seed."""
    from stare_cli.analysis.sweep import paired_differences, report_markdown

    def run(name: str, step_values: dict[int, float]) -> Path:
        for step, v in step_values.items():
            _setting(tmp_path / name / "eval" / f"step-{step:06d}" / "toy-arith", "aaaa", 4, 8, v)
        return tmp_path / name

    base = {1: run("g1", {0: 10.0, 6: 30.0}), 2: run("g2", {0: 12.0, 6: 34.0}), 3: run("g3", {0: 11.0, 6: 38.0})}
    # seed 3 of the method has no step-6 evaluation: step 6 pairs seeds 1 and 2 only
    meth = {1: run("s1", {0: 10.0, 6: 33.0}), 2: run("s2", {0: 12.0, 6: 40.0}), 3: run("s3", {0: 11.0})}
    d = paired_differences(_keyed_runs(meth), _keyed_runs(base))
    # step 0: differences 0, 0, 0 -> mean 0, t-interval of zero width
    assert d["toy:arith n=4 step=0"]["avg@4"] == {"mean": 0.0, "ci95": [0.0, 0.0], "kind": "t95", "seeds": [1, 2, 3]}
    # step 6: 33 - 30 = 3 and 40 - 34 = 6 -> mean 4.5, two seeds: their range [3, 6]
    assert d["toy:arith n=4 step=6"]["pass@1"] == {"mean": 4.5, "ci95": [3.0, 6.0], "kind": "range", "seeds": [1, 2]}
    report = report_markdown({"settings": {"recipe": "r"}, "baseline": "grpo-ds",
                              "methods": {"grpo-ds": {"seeds": {}, "over_seeds": {}, "evaluations": {}},
                                          "stare-o1": {"seeds": {}, "over_seeds": {}, "evaluations": {},
                                                       "paired_vs_baseline": d}}})
    assert "## Paired by seed: stare-o1 minus grpo-ds" in report
    assert "| toy:arith n=4 step=6 | 1, 2 | +4.5 [+3.0, +6.0] | +4.5 [+3.0, +6.0] |" in report


def test_an_interval_over_seeds_holds_only_values_the_mean_can_take(tmp_path):
    """pass@k is a percentage, so its mean over seeds lies in [0, 100] and a difference of two in
    [-100, 100]; a t-interval is cut there (issue 48's report printed pass@32 as 85.2 [64.7, 105.6])."""
    from benchmarks.evaluation.metrics import seed_interval
    from stare_cli.analysis.sweep import eval_summary, paired_differences

    # 75, 100, 100, 100: mean 93.75; squared deviations 18.75^2 + 3 x 6.25^2 = 351.5625 + 117.1875 = 468.75,
    # /3 -> sd 12.5; half width t_{0.975,3} 3.182 x 12.5 / sqrt(4) = 19.8875 -> [73.8625, 113.6375]
    lo, hi, kind = seed_interval([75.0, 100.0, 100.0, 100.0])
    assert (lo, hi, kind) == (pytest.approx(73.8625), pytest.approx(113.6375), "t95")
    lo, hi, kind = seed_interval([75.0, 100.0, 100.0, 100.0], within=(0.0, 100.0))
    assert (lo, hi, kind) == (pytest.approx(73.8625), 100.0, "t95")
    assert seed_interval([5.0, 0.0, 0.0, 0.0], within=(0.0, 100.0))[0] == 0.0  # mirrored: -3.6375 cut at 0
    assert seed_interval([90.0, 100.0], within=(0.0, 100.0)) == (90.0, 100.0, "range")  # a range is never cut

    def run(name: str, v: float) -> Path:
        _setting(tmp_path / name / "eval" / "step-000006" / "toy-arith", "aaaa", 4, 8, v)
        return tmp_path / name

    meth = {s: run(f"m{s}", v) for s, v in zip((1, 2, 3, 4), (75.0, 100.0, 100.0, 100.0))}
    base = {s: run(f"b{s}", v) for s, v in zip((1, 2, 3, 4), (25.0, 0.0, 0.0, 0.0))}
    s = eval_summary(list(meth.values()))["toy:arith n=4 step=6"]["pass@1"]
    assert s["mean"] == 93.75 and s["ci95"] == [pytest.approx(73.8625), 100.0]
    # differences 50, 100, 100, 100: mean 87.5, sd 25, half width 3.182 x 25 / 2 = 39.775 -> [47.725, 127.275]
    d = paired_differences(_keyed_runs(meth), _keyed_runs(base))["toy:arith n=4 step=6"]["pass@1"]
    assert d["mean"] == 87.5 and d["ci95"] == [pytest.approx(47.725), 100.0]


def test_summary_carries_each_methods_own_numbers():
    """STAPO's silenced share, RSI-S's kept share, the covariance kernel's mean weight, STARE's L+/L- shares
    and KL-Cov's penalised share are averaged over the steps that logged them; methods that never log them have no
    such key, and the report shows "–" there."""
    from stare_cli.analysis.sweep import dynamics_summary, report_markdown, seeds_summary

    base = [{"step": i, "entropy": 0.4, "reward": 0.5} for i in range(1, 5)]
    stapo = [{**r, "stapo/spurious_frac": f} for r, f in zip(base, (0.0, 0.01, 0.03, 0.0))]
    covk = [{**r, "actor/covk/mean_w": w} for r, w in zip(base, (0.8, 0.9, 0.7, 0.8))]
    stare = [{**r, "stare/gate": gt, "stare/sel_pos": p, "stare/sel_neg": 0.0}
             for r, gt, p in zip(base, (0.0, 1.0, 1.0, 0.0), (0.02, 0.04, 0.03, 0.03))]
    klcov = [{**r, "actor/kl_frac": 0.002} for r in base]
    rsi = [{**r, "rsi/kept": f} for r, f in zip(base, (0.4, 0.5, 0.3, 0.4))]
    clipcov = [{**r, "actor/clip_frac": f} for r, f in zip(base, (0.0005, 0.0007, 0.0, 0.0004))]
    s, k, g = dynamics_summary(stapo, 0.3), dynamics_summary(covk, 0.3), dynamics_summary(base, 0.3)
    st, kl = dynamics_summary(stare, 0.3), dynamics_summary(klcov, 0.3)
    assert s["silenced_share"] == pytest.approx(0.01)  # (0 + 0.01 + 0.03 + 0) / 4
    assert k["kernel_mean_w"] == pytest.approx(0.8)  # (0.8 + 0.9 + 0.7 + 0.8) / 4
    assert st["gate_on_share"] == 0.5 and st["stare_sel_pos"] == pytest.approx(0.03)  # (2 + 4 + 3 + 3) / 4 %
    assert kl["kl_cov_share"] == pytest.approx(0.002)
    assert "silenced_share" not in g and "kernel_mean_w" not in g and g["gate_on_share"] == 0.0
    assert "stare_sel_pos" not in g and "kl_cov_share" not in g and "cut_share" not in g
    rs = dynamics_summary(rsi, 0.3)
    assert rs["rsi_kept_share"] == pytest.approx(0.4) and "rsi_kept_share" not in g  # (0.4 + 0.5 + 0.3 + 0.4) / 4
    cc = dynamics_summary(clipcov, 0.3)
    assert cc["cut_share"] == pytest.approx(0.0004)  # (0.0005 + 0.0007 + 0 + 0.0004) / 4
    methods = {name: {"seeds": {1: x}, "over_seeds": seeds_summary([x]), "evaluations": {}}
               for name, x in (("stapo", s), ("cov-kernel", k), ("grpo-ds", g), ("stare-o1", st), ("kl-cov", kl),
                               ("clip-cov", cc), ("rsi-s", rs))}
    report = report_markdown({"settings": {"recipe": "tiny/explore"}, "methods": methods})
    z = "0.0000"  # one seed each: the value alone, no spread and no interval
    assert f"| stapo | {z} | – | – | 0.0100 | – | – | – | – |" in report
    assert f"| grpo-ds | {z} | – | – | – | – | – | – | – |" in report
    assert f"| stare-o1 | 0.5000 | 0.0300 | {z} | – | – | – | – | – |" in report
    assert f"| kl-cov | {z} | – | – | – | – | – | 0.0020 | – |" in report
    assert f"| clip-cov | {z} | – | – | – | – | – | – | 0.0004 |" in report
    assert f"| rsi-s | {z} | – | – | – | 0.4000 | – | – | – |" in report


def test_over_seeds_a_sweep_gives_the_same_interval_as_compare():
    """The report's interval over seeds is `seed_interval`'s, as `stare compare --ci` and the paired
    differences: a 95% t-interval for 3+ seeds, the range for 2, none for one. (It was a percentile
    bootstrap, which over 4 seeds is about half as wide as the t-interval: it resamples 4 values and
    takes no account of the spread being estimated from them.)"""
    from stare_cli.analysis.sweep import over_seeds_text, report_markdown, seeds_summary

    four = seeds_summary([{"acc": v} for v in (0.1, 0.2, 0.3, 0.6)])["acc"]
    # mean 0.3; squared deviations 0.04 + 0.01 + 0 + 0.09 = 0.14, /3 -> sd 0.216025;
    # half width t_{0.975,3} 3.182 x 0.216025 / sqrt(4) = 0.343696
    assert four["mean"] == pytest.approx(0.3) and four["std"] == pytest.approx(0.216025, abs=1e-6)
    assert four["ci95"] == pytest.approx([0.3 - 0.343696, 0.3 + 0.343696], abs=1e-6) and four["kind"] == "t95"
    assert over_seeds_text(four, 3) == "0.300 ± 0.216 [-0.044, 0.644]"
    two = seeds_summary([{"acc": 0.2}, {"acc": 0.4}])["acc"]
    assert two["ci95"] == [0.2, 0.4] and two["kind"] == "range"  # the two values themselves
    one = seeds_summary([{"acc": 0.25}])["acc"]
    assert one["ci95"] is None and one["kind"] == "one seed" and over_seeds_text(one, 2, 100) == "25.00"
    report = report_markdown({"settings": {"recipe": "r"}, "methods": {"m": {"seeds": {1: {}, 2: {}, 3: {}, 4: {}},
                                                                             "over_seeds": {}, "evaluations": {}}}})
    assert "Mean ± std over seeds [95% t-interval for 3+ seeds, the range for 2]; one seed: its value" in report


def test_the_report_covers_the_finished_cells_while_others_run_and_when_the_sweep_is_stopped(tmp_path, monkeypatch):
    """A sweep of 12 cells runs for most of a day (issue 48): its report is written over the cells finished
    so far after each finished cell while others are still to run, and when the sweep is stopped; a report
    that fails is a warning in the log, not the end of the sweep. Its first line says what it holds."""
    from stare_cli.analysis import sweep
    from stare_kernel.errors import Interrupted

    monkeypatch.setattr(sweep, "_train_command", lambda *a, **k: [sys.executable, "-c", "print('/runs/x')"])
    out = tmp_path / "sw"
    (out / "logs").mkdir(parents=True)
    spec = sweep.SweepSpec(recipe="tiny/arith", methods=("grpo-ds",), seeds=(1, 2, 3))
    cells = [sweep.Cell("grpo-ds", s) for s in (1, 2, 3)]
    calls: list[list[str]] = []
    sweep._train_cells(spec, out, cells, 1, 1, lambda m: None,
                       on_done=lambda: calls.append([c.name for c in cells if c.state == "done"]))
    assert calls == [["grpo-ds-seed1"], ["grpo-ds-seed1", "grpo-ds-seed2"]]  # not after the last: the final report

    reports: list[tuple[list[str], int]] = []
    monkeypatch.setattr(sweep, "_report", lambda spec, out, done, paper, cells: reports.append(
        ([c.name for c in done], len(cells))))

    def stopped(spec, out, cells, *a):
        cells[0].state = "done"
        cells[1].state = "interrupted"
        raise Interrupted("sweep interrupted", 130)

    monkeypatch.setattr(sweep, "_train_cells", stopped)
    out = tmp_path / "sw2"  # a new sweep: three pending cells
    (out / "logs").mkdir(parents=True)
    lines: list[str] = []
    monkeypatch.setattr(sweep, "_Log", lambda path, stream: type("L", (), {"__call__": lambda self, m: lines.append(m),
                                                                            "close": lambda self: None})())
    with pytest.raises(Interrupted):
        sweep._run_sweep_locked(spec, out, 1, 1, None, None, None, None)
    assert reports == [(["grpo-ds-seed1"], 3)]
    assert lines == [f"report of the 1 of 3 cells finished so far: {out / 'report.md'}"]

    def broken(*a):
        raise ValueError("boom")

    monkeypatch.setattr(sweep, "_report", broken)
    lines.clear()
    with pytest.raises(Interrupted):  # the sweep's own outcome, not the report's error
        sweep._run_sweep_locked(spec, out, 1, 1, None, None, None, None)
    assert lines == ["warning: the report of the 1 finished cells was not written: ValueError: boom"]

    text = sweep.report_markdown({"settings": {"recipe": "r"}, "methods": {},
                                  "cells": {"finished": ["grpo-ds-seed1"],
                                            "not_finished": {"grpo-ds-seed2": "interrupted", "grpo-ds-seed3": "pending"}}})
    assert text.splitlines()[2] == ("Cells: 1 of 3 finished; **interim**: the tables hold the finished cells only; "
                                    "not in them: grpo-ds-seed2 (interrupted), grpo-ds-seed3 (pending)")


def test_a_stopped_sweep_names_where_each_cell_takes_up_again(tmp_path, monkeypatch):
    """Issue 48: a cell stopped in its step-0 evaluation has no checkpoint, yet the stopped sweep said
    "the cells wrote checkpoints". Now the log line of each stopped cell and the sweep's last line say,
    per cell, the step its checkpoint holds or that it starts again. The fake cells stand for `stare
    train`: a run directory, a checkpoint at step 7 for seed 1 (verl's layout) and none for seed 2;
    they exit 130 on the SIGINT the sweep forwards."""
    import textwrap
    import threading

    from stare_cli.analysis import sweep
    from stare_kernel.errors import Interrupted

    script = textwrap.dedent("""
        import pathlib, signal, sys, time
        run = pathlib.Path(sys.argv[1])
        (run / "checkpoints").mkdir(parents=True)
        (run / "meta.json").write_text("{}")
        if sys.argv[2] == "1":
            (run / "checkpoints" / "global_step_7" / "actor").mkdir(parents=True)
            (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("7")
        signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
        (run / "ready").write_text("")
        time.sleep(120)
    """)
    out = tmp_path / "sw"
    (out / "logs").mkdir(parents=True)
    monkeypatch.setattr(sweep, "_train_command", lambda spec, out, c, *a: [
        sys.executable, "-c", script, str(out / "cells" / c.name / "run"), str(c.seed)])
    spec = sweep.SweepSpec(recipe="tiny/arith", methods=("grpo-ds",), seeds=(1, 2))
    cells = [sweep.Cell("grpo-ds", s) for s in (1, 2)]

    def interrupt_when_both_run():
        deadline = time.time() + 120
        while len(list(out.glob("cells/*/run/ready"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the sweep's own handler takes it (installed before the cells start)

    t = threading.Thread(target=interrupt_when_both_run)
    t.start()
    lines: list[str] = []
    with pytest.raises(Interrupted) as e:
        sweep._train_cells(spec, out, cells, 2, 1, lines.append)
    t.join()
    assert e.value.exit_code == 130
    one = "stopped with a checkpoint at step 7 (the same command resumes from it)"
    two = "stopped before its first checkpoint (the same command starts it again)"
    message = str(e.value)
    assert message.startswith("sweep interrupted after ") and "wrote checkpoints" not in message
    assert f"; grpo-ds-seed1 {one}" in message and f"; grpo-ds-seed2 {two}" in message
    assert message.endswith("; run the same command again to finish it")
    assert [c.state for c in cells] == ["interrupted", "interrupted"]
    assert sum(x.startswith("[0/2] grpo-ds-seed1 interrupted in ") and f"(exit 130): {one}; " in x for x in lines) == 1
    assert sum(x.startswith("[0/2] grpo-ds-seed2 interrupted in ") and f"(exit 130): {two}; " in x for x in lines) == 1
    assert [c["error"] for c in json.loads((out / "sweep.json").read_text())["cells"]] == [one, two]


def test_the_provenance_names_the_grid_command_and_each_cells_starts_with_their_commits(tmp_path):
    """report.md's Provenance (issue 48): the grid's command from the manifest's cells in their order, and
    per cell its run directory relative to the sweep, the steps it logged of its total, every start,
    restart and resume from config-history.jsonl with the commit shortened to 7 characters (-dirty kept),
    and the graders; a cell not started yet has dashes."""
    from stare_cli.analysis.sweep import Cell, SweepSpec, cell_provenance, provenance_markdown, sweep_command

    out = tmp_path / "sw"
    spec = SweepSpec(recipe="small/r", methods=("stare-o1",), seeds=(1,), overrides=("optim.total_steps=3",),
                     eval_n=4)
    # an earlier command's cells come first in the manifest; the grid command names them all, once each
    cells = [Cell("grpo-ds", 2), Cell("stare-o1", 2), Cell("grpo-ds", 1, state="done"), Cell("stare-o1", 1)]
    assert sweep_command(spec, cells, out) == (
        f"stare sweep --recipe small/r -m grpo-ds -m stare-o1 -s 2 -s 1 -o optim.total_steps=3 --eval-n 4 --out {out}")
    run = out / "cells" / "grpo-ds-seed1" / "r__grpo-ds__seed1"
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"reward_grader": "math-verify@7"}))
    (run / "config.yaml").write_text("optim:\n  total_steps: 3\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 0.1}) + "\n" for i in (1, 2, 3)))
    (run / "config-history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in (
        {"event": "start", "step": 0, "git_sha": "a" * 40 + "-dirty"},
        {"event": "restart", "step": 0, "git_sha": "b" * 40},
        {"event": "resume", "step": 2, "git_sha": "c" * 40})))
    cells[2].run_dir = str(run)
    rows = provenance_markdown({"command": "stare sweep ...", "written": "T", "commit": "abc",
                                "cells": [cell_provenance(out, c) for c in cells[2:]]})
    assert rows[-2] == ("| grpo-ds-seed1 | done | 3 of 3 | cells/grpo-ds-seed1/r__grpo-ds__seed1 | start 0 aaaaaaa-dirty; "
                        "restart 0 bbbbbbb; resume 2 ccccccc | math-verify@7; - |")
    assert rows[-1] == "| stare-o1-seed1 | pending | - | - | - | -; - |"
