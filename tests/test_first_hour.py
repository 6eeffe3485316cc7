"""Issue 44, a researcher's first hour: a piped run says what it does within seconds, a mistyped model
fails in one line with a suggestion and leaves no folder behind, and `stare eval --help` gives each
benchmark's own defaults. (Progress phrases, the closing summary and the run's plot: test_embedded.py;
the README's eval line: test_real_model.py; samples reused across --limit, the eval folder: test_eval.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from conftest import REPO
from test_embedded import FAST

# The first lines come once Python has started and imported torch: issue 44 asks for them within 10 seconds.
# How long that takes is measured by benchmarks/perf/first_lines.py, not asserted here (issue 68: a
# wall-clock bound failed at 13.3 s on a busy machine); the test asserts the order of events.


def test_a_piped_run_says_what_it_does_before_the_model_loads(tmp_path, quick_toy):
    """Before: `stare train` printed nothing at all for about 4 minutes when piped to a file. The first lines
    (the run directory, what loads) come before the model is loaded and before any step: the order of events
    (their time: benchmarks/perf/first_lines.py)."""
    args = [sys.executable, "-m", "stare_cli", "train", "--recipe", "tiny/arith", "--method", "stare-o1",
            "--out", str(tmp_path / "runs"), "-o", f"model.path={quick_toy}"]
    for o in [*FAST, "optim.total_steps=1"]:
        args += ["-o", o]
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"})
    seen: list[tuple[float, str]] = []  # (seconds since the start, line), as `stare train ... 2>&1 | tee` shows them
    assert p.stdout is not None
    for line in p.stdout:
        seen.append((time.monotonic() - t0, line.rstrip("\n")))
    assert p.wait(timeout=300) == 0, "\n".join(x for _, x in seen)

    def first(phrase: str) -> float:
        return next(t for t, x in seen if phrase in x)

    def index(phrase: str) -> int:
        return next(i for i, (_, x) in enumerate(seen) if phrase in x)

    # in order: the run directory and what loads, the model loaded, each phase of the step, the closing summary
    order = [index(p) for p in ("run directory", "loading", "model loaded in", "step 1/1: rollout",
                                "step 1/1: training on", "done: 1 steps", "card: ", "plot: ")]
    assert order == sorted(order) and len(set(order)) == len(order), seen
    assert index("loading") < 3, seen[:4]  # nothing slow comes first: the run directory, then what loads


def test_a_mistyped_model_is_one_line_with_a_suggestion_and_leaves_nothing(cli, tmp_path, monkeypatch):
    """Before: `--model smollm2` went to the hub (66 s of retries, then a network error), left an empty
    evals/smollm2/ that broke a later `stare compare runs/* evals/*`, and in training an empty run folder."""
    monkeypatch.chdir(tmp_path)
    for args, start in [(("eval", "--bench", "words:add-sub", "--model", "smollm2", "-n", "1", "--limit", "2"),
                         "error: --model smollm2: not a local folder, a run directory or a short name"),
                        (("train", "--recipe", "tiny/arith", "--method", "grpo-ds", "-o", "model.path=smollm2"),
                         "error: model.path smollm2: not a local folder, a run directory or a short name")]:
        import socket

        def no_network(*_a, **_k):  # the name has no org/ part: no hub is asked (before: 66 s of retries)
            raise AssertionError("a network connection was attempted")

        with monkeypatch.context() as m:
            m.setattr(socket.socket, "connect", no_network)
            m.setattr(socket, "create_connection", no_network)
            code, out, err = cli(*args)
        assert code == 1 and err.startswith(start) and len(err.strip().splitlines()) == 1, err
        assert "did you mean 'smollm2-135m'" in err and "stare model list" in err
    assert sorted(os.listdir(tmp_path)) == []  # no evals/smollm2/, no runs/<run>/


def test_a_hub_name_that_cannot_be_fetched_is_one_line(cli, tmp_path, monkeypatch):
    """An org/name that is not on this machine: one line (where the hub cannot be reached, it says so
    and how to bring a model here; where it can, the hub's own answer), and no folder left behind."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / ".hf"))
    code, _, err = cli("eval", "--bench", "words:add-sub", "--model", "stare-test/no-such-model", "-n", "1",
                       "--limit", "2")
    assert code == 1 and err.startswith("error: --model stare-test/no-such-model") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "evals").exists()


def test_eval_help_gives_each_benchmarks_own_defaults(cli, monkeypatch):
    """Before: the help said 1.0 / 0.7 / 3072 tokens, where words:add-sub runs 0.6 / 1.0 / 64 and n = 4."""
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = cli("eval", "--help")
    assert code == 0
    text = re.sub(r"\s+", " ", out.replace("│", " "))
    for expected in ("Samples per problem. Default: the benchmark's own: 32 (aime24, aime25, amc23); 4 (math500, "
                     "minerva, olympiadbench, words:add-sub,",
                     "Default: the benchmark's own: 1.0 (aime24, aime25, amc23, math500, minerva, olympiadbench,",
                     "0.6 (words:add-sub, words:multi-step, words:two-step)",
                     "Default: the benchmark's own: 0.7 (aime24, aime25, amc23, math500, minerva, olympiadbench); 1.0 (",
                     "Max new tokens. Default: the benchmark's own: 3072 (aime24, aime25, amc23, math500, minerva, "
                     "olympiadbench);",
                     "64 (toy:tool, words:add-sub)"):
        assert expected in text, expected


def test_the_eta_counts_the_evaluations_to_come(tmp_path):
    """Before: after step 1 of the real-model recipe the ETA read 3m24s with 9.5 minutes left: the
    final evaluation was not counted. Hand-computed: 10 steps, evaluations after steps 5 and 10. The
    step's time carries its unit (it read 'time/step 95')."""
    from stare_cli.backends.embedded import StepLog

    log = StepLog(10, 0, tmp_path / "train.log", evals_left=lambda step: (step < 5) + (step < 10))
    log.log(1, {"time/step": 20.0})
    # before any evaluation has run: 9 steps x 20 s = 180 s, and the 2 evaluations named, not guessed
    assert log.eta(1) == "3m00s + 2 evaluations"
    log.log(5, {"time/step": 40.0, "time/eval": 90.0})  # the step-5 evaluation took 90 s
    # 5 steps left x mean step 30 s = 150 s, plus 1 evaluation x 90 s = 240 s
    assert log.eta(5) == "4m00s"
    log.close()
    last = (tmp_path / "train.log").read_text().splitlines()[-1]
    assert last.startswith("step 5/10  time/step 40s  ") and last.endswith("steps/min  ETA 4m00s"), last


def test_a_resumed_runs_eta_counts_the_steps_and_evaluations_before_the_stop(tmp_path):
    """Before: a cell resumed at step 52 of 60 printed 'ETA 20m17s + 1 evaluation' from its one new step,
    though the run had timed three evaluations before it stopped. Hand-computed: 10 steps, evaluations
    after steps 5 and 10, resumed at step 6 with steps 1-6 timed 20 s each and the step-5 evaluation 90 s;
    rows after the resume step (written before the stop, replaced by the resumed run) do not count."""
    from stare_cli.backends.embedded import StepLog

    log = StepLog(10, 6, tmp_path / "train.log", evals_left=lambda step: (step < 5) + (step < 10))
    rows = [{"step": k, "time/step": 20.0} for k in range(1, 7)] + [{"step": 7, "time/step": 999.0}]
    rows[4]["time/eval"] = 90.0
    log.resume_from(rows)
    log.log(7, {"time/step": 27.0})
    # mean step (6 x 20 + 27) / 7 = 21 s; 3 steps left = 63 s; 1 evaluation at 90 s -> 153 s
    assert log.eta(7) == "2m33s"
    log.close()


def test_a_smoothed_line_says_its_window_and_the_raw_values_stay_visible(tmp_path, monkeypatch):
    """Before: the thick line was a 10-step trailing mean whatever the run's length, and the legend said
    only 'mean of 2'. Now the window is at most a tenth of the run, named in the legend, with each step
    drawn thin beside it. Hand-computed: 30 steps -> window 3; entropy 0.5 - 0.01 (step - 1), so the
    3-step trailing mean at step 30 is the value at step 29, 0.22."""
    from stare_cli.analysis import plots

    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, base: figs.append(fig) or [])
    rows = [{"step": s, "entropy": 0.5 - 0.01 * (s - 1)} for s in range(1, 31)]
    plots.plot_dynamics({"grpo-ds": [rows]}, tmp_path / "d")
    ax = figs[0].axes[0]
    raw, thick = ax.lines[0], ax.lines[1]
    assert list(raw.get_ydata()) == [r["entropy"] for r in rows]  # every step, unsmoothed
    assert abs(thick.get_ydata()[-1] - 0.22) < 1e-12 and thick.get_linewidth() > raw.get_linewidth()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["grpo-ds: 3-step trailing mean; thin: each step"]
