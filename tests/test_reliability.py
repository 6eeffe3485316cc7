"""Resume that never silently restarts, interrupts that checkpoint, run directories and caches that
concurrent processes cannot share by accident, durable checkpoints, and bad input that names where
it is (issue 14). Runs the real CLI on the quick toy."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from test_embedded import FAST, _rows_without_time, _train


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _history(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "config-history.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------- resume refusals
def test_resume_without_any_checkpoint_refuses_and_restart_starts_again(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    # as if killed before its first checkpoint: the run dir has metrics but no checkpoint
    for p in (run / "checkpoints").iterdir():
        p.unlink() if p.is_symlink() else __import__("shutil").rmtree(p)
    before = (run / "metrics.jsonl").read_text()
    code, out, err = cli("train", "--resume", str(run))
    assert code == 1 and out == ""
    assert "has no usable checkpoint (it stopped before its first checkpoint)" in err and "--restart" in err
    assert (run / "metrics.jsonl").read_text() == before  # nothing touched
    code, out, err = cli("train", "--resume", str(run), "--restart")
    assert code == 0, err
    assert _steps(run) == [1]  # started again, rows not duplicated
    aside = list((run / "restarts").iterdir())
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == before
    assert [h["event"] for h in _history(run)] == ["start", "restart"]
    # the card types the first start's command, not the restart's (which rewrote meta.json), and lists both
    card = (run / "REPRODUCE.md").read_text()
    typed = card.split("As typed (the first start):")[1].split("```bash\n")[1].split("\n```")[0]
    assert typed.startswith("stare train --recipe tiny/arith --method grpo-ds --out ") and "--restart" not in typed
    assert "(of the restart the steps count from)" in card
    assert "- restart at step 0 (" in card and f"`stare train --resume {run} --restart`" in card, card


def test_dangling_latest_is_named_and_refused(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    target = (run / "checkpoints" / "latest").resolve()
    __import__("shutil").rmtree(target)
    code, _, err = cli("train", "--resume", str(run))
    assert code == 1 and f"points to {target.name}, which does not exist" in err


def test_truncated_latest_falls_back_to_the_previous_checkpoint_with_a_warning(cli, tmp_path, quick_toy):
    extra = ["optim.total_steps=3", "checkpoint.every=1", "checkpoint.keep_last=2", "method.dynamic_sampling=false",
             "optim.schedule=constant", "optim.warmup_steps=0"]  # then the lr does not depend on total_steps
    run = _train(cli, tmp_path / "a", quick_toy, "stare-o1", *extra)
    ref = _train(cli, tmp_path / "b", quick_toy, "stare-o1", *extra[1:], "optim.total_steps=4")
    weights = (run / "checkpoints" / "latest" / "model.safetensors").resolve()
    assert weights.parent.name == "step-000003"
    with open(weights, "r+b") as f:  # a copy cut short
        f.truncate(weights.stat().st_size // 2)
    code, _, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=4")
    assert code == 0, err
    assert f"warning: skipping checkpoint: {weights}" in err and "truncated" in err
    assert "resuming from step-000002" in err
    # issue 68, reliability 6: the older checkpoint taken is not "newer and intact"
    assert "newer and intact" not in err
    assert "checkpoints/latest names step-000003, which is damaged (skipped above): resuming from step-000002" in err
    assert _steps(run) == [1, 2, 3, 4]  # step 3 redone, not duplicated
    # redone from step 2's state, the run equals an uninterrupted 4-step run (total_steps only sets the end)
    assert _rows_without_time(run / "metrics.jsonl") == _rows_without_time(ref / "metrics.jsonl")


def test_resume_takes_the_newest_intact_checkpoint_even_when_latest_names_an_older_one(cli, tmp_path, quick_toy):
    """Issue 47, item 8: a run stopped after step-2 was complete but before `latest` moved resumed from
    step 1 (what `latest` named), redoing a step it had; the README says the newest intact one."""
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=2", "checkpoint.every=1",
                 "checkpoint.keep_last=2", "method.dynamic_sampling=false")
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    latest.symlink_to("step-000001")
    code, _, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=3")
    assert code == 0, err
    assert "checkpoints/latest names step-000001, but step-000002 is newer and intact" in err, err
    assert _steps(run) == [1, 2, 3]
    assert json.loads((run / "checkpoints" / "latest" / "state.json").read_text())["step"] == 3
    log = (run / "train.log").read_text()  # appended to; the resume is marked where it starts
    assert "resumed from step-000002: the lines below for steps after 2 replace any above" in log


def test_a_checkpoint_without_its_manifest_is_not_used(tmp_path):
    from stare_cli.core.runs import checkpoint_problem, usable_checkpoint

    ck = tmp_path / "checkpoints" / "step-000001"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text('{"step": 1}')
    assert "manifest.json: missing" in checkpoint_problem(ck)
    assert usable_checkpoint(tmp_path) == (None, [checkpoint_problem(ck)])


def _verl_checkpoints(run: Path, steps: tuple[int, ...], tracker: str | bytes | None,
                      without_actor: tuple[int, ...] = ()):
    for n in steps:
        (run / "checkpoints" / f"global_step_{n}" / "actor").mkdir(parents=True)
    for n in without_actor:  # a folder verl began and never filled
        (run / "checkpoints" / f"global_step_{n}").mkdir(parents=True)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    if isinstance(tracker, bytes):  # not text at all
        (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    elif tracker is not None:
        (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(tracker)


@pytest.mark.parametrize("steps, tracker, without_actor, step, why", [
    ((3, 5), "5\n", (), 5, None),  # the tracker names a complete checkpoint: verl's own choice
    ((3, 5), "3", (), 3, None),  # ... even an older one (verl loads what the tracker names)
    ((3, 5), "9", (), 5, "names step '9', whose global_step_9/actor does not exist"),
    ((3, 5), "7", (7,), 5, "names step '7', whose global_step_7/actor does not exist"),  # 7 has no actor/
    ((3, 5), "garbage", (), 5, "holds 'garbage', not a step number"),  # was read as "a checkpoint at step 0"
    ((3, 5), b"\xff\xfe", (), 5, "latest_checkpointed_iteration.txt: unreadable (UnicodeDecodeError)"),
    ((3, 5), None, (), 5, "latest_checkpointed_iteration.txt does not exist"),  # verl would start from scratch
    ((), "4", (), None, "names step '4'"),
    ((), None, (2,), None, None),  # no checkpoint at all: nothing to say beyond that
])
def test_the_verl_checkpoint_a_resume_takes(tmp_path, steps, tracker, without_actor, step, why):
    """One reading of verl's checkpoint folder for resume, the sweep and "is it finished": the step the
    tracker names when its global_step_N/actor exists, else the newest complete one, with the reason."""
    from stare_cli.core.runs import verl_checkpoint

    _verl_checkpoints(tmp_path, steps, tracker, without_actor)
    found, skipped = verl_checkpoint(tmp_path)
    assert found == step
    assert (skipped == []) if why is None else (len(skipped) == 1 and why in skipped[0]), skipped


def test_a_verl_resume_points_a_missing_or_wrong_tracker_at_the_newest_checkpoint(tmp_path, capsys):
    """verl's resume_mode=auto trains from scratch without a tracker or with one naming a missing step
    (and fails on one that is not a number), while our resume trims metrics.jsonl to the step we name:
    the tracker must name that same step (verl/utils/checkpoint/checkpoint_manager.py,
    find_latest_ckpt_path)."""
    from stare_cli.backends.verl_backend import resume_point
    from stare_kernel.errors import StareError

    tracker = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    (tmp_path / "meta.json").write_text('{"overrides": ["data.train_files=/d/train.parquet"]}')
    _verl_checkpoints(tmp_path, (2, 4), None)
    assert resume_point(tmp_path) == (4, Path("/d"))
    assert tracker.read_text() == "4" and "resuming from global_step_4" in capsys.readouterr().err
    tracker.write_text("6")
    assert resume_point(tmp_path)[0] == 4 and tracker.read_text() == "4"
    assert resume_point(tmp_path)[0] == 4 and capsys.readouterr().err.count("warning") == 1  # now silent
    for n in (2, 4):
        (tmp_path / "checkpoints" / f"global_step_{n}" / "actor").rmdir()
    with pytest.raises(StareError, match="no usable checkpoint"):
        resume_point(tmp_path)


def test_a_verl_run_is_finished_only_when_its_last_step_is_a_checkpoint(tmp_path):
    from stare_cli.core.recipes import recipe_to_yaml
    from stare_cli.core.resolve import load_recipe
    from stare_cli.core.runs import run_finished

    cfg = load_recipe("tiny/arith", "grpo-ds", ["backend.name=verl", "optim.total_steps=4"])
    (tmp_path / "config.yaml").write_text(recipe_to_yaml(cfg))
    _verl_checkpoints(tmp_path, (2,), "4")  # the tracker says 4, but global_step_4 is not there
    assert not run_finished(tmp_path)
    _verl_checkpoints(tmp_path, (4,), None)
    assert run_finished(tmp_path)


# --------------------------------------------------------------------------- overrides on resume
def test_overrides_on_resume_are_applied_and_recorded(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=2", "method.dynamic_sampling=false",
                 "optim.schedule=constant", "optim.warmup_steps=0")
    code, _, err = cli("train", "--resume", str(run), "-o", "optim.lr=5e-4", "-o", "optim.total_steps=4")
    assert code == 0, err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 5e-4, 5e-4]  # FAST sets 1e-3; the new lr takes effect
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["optim"]["lr"] == 5e-4 and cfg["optim"]["total_steps"] == 4
    last = _history(run)[-1]
    assert last["event"] == "resume" and last["step"] == 2
    assert last["changed"] == {"optim.lr": [1e-3, 5e-4], "optim.total_steps": [2, 4]}


@pytest.mark.parametrize("override,key", [("model.path=toy:tool", "model.path"), ("method.name=grpo", "method.name"),
                                          ("optim.seed=7", "optim.seed")])
def test_overrides_that_change_what_the_run_is_are_refused_by_name(cli, tmp_path, quick_toy, override, key):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    before = (run / "config.yaml").read_text()
    code, _, err = cli("train", "--resume", str(run), "-o", override)
    assert code == 1 and f"--resume: {key} cannot change on resume" in err
    assert (run / "config.yaml").read_text() == before


def test_verl_refuses_an_lr_change_on_resume(tmp_path):
    from stare_cli.core.resolve import load_recipe
    from stare_cli.core.recipes import recipe_to_yaml
    from stare_kernel.errors import StareError
    from stare_cli.core.resume import plan_resume

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(recipe_to_yaml(load_recipe("tiny/arith", "grpo-ds", ["backend.name=verl"])))
    (run / "meta.json").write_text("{}")
    assert plan_resume(run, ["optim.total_steps=9"]).changed == {"optim.total_steps": [200, 9]}
    with pytest.raises(StareError, match="optim.lr cannot change on resume .* verl restores the optimizer"):
        plan_resume(run, ["optim.lr=1e-3"])


# ------------------------------------------------------------------------------------ interrupts
def _spawn_train(out: Path, model: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "stare_cli", "train", "--recipe", "tiny/arith", "--method", "grpo-ds",
            "--out", str(out), "-o", f"model.path={model}"]
    for o in [*FAST, *extra]:
        args += ["-o", o]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_rows(out: Path, n: int, timeout: float = 300) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for run in out.glob("tiny-arith__*"):
            m = run / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= n:
                return run
        time.sleep(0.05)
    raise AssertionError("the run never reached its first steps")


@contextlib.contextmanager
def _killed_if_stuck(p: subprocess.Popen, seconds: float = 300):
    """Kill `p` after `seconds`: a blocking readline on its stderr must not wait forever on a stuck run."""
    guard = threading.Timer(seconds, p.kill)
    guard.start()
    try:
        yield
    finally:
        guard.cancel()


def _stderr_until(p: subprocess.Popen, text: str) -> list[str]:
    """p's stderr lines up to and including the first that holds `text` (fails if p ends first)."""
    seen: list[str] = []
    while not any(text in x for x in seen):
        line = p.stderr.readline()
        assert line, "".join(seen)
        seen.append(line)
    return seen


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_at_the_step_boundary_and_says_how_to_resume(tmp_path, quick_toy, sig, code):
    p = _spawn_train(tmp_path, quick_toy, "optim.total_steps=200", "checkpoint.every=0",
                     "method.dynamic_sampling=false")
    run = _wait_for_rows(tmp_path, 1)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == code, err
    n = len(_steps(run))
    assert f"interrupted at step {n} (checkpoint written); resume with: stare train --resume {run}" in err
    assert json.loads((run / "checkpoints" / "latest" / "state.json").read_text())["step"] == n
    assert _steps(run) == list(range(1, n + 1))


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path, quick_toy):
    """The second SIGINT goes out as soon as the trainer acknowledges the first, which arrived well
    inside step 2 (steps of ~1-2 s): a fixed delay between the two raced the step's end on a busy
    machine (the first signal then landed at the boundary and the run stopped with a checkpoint)."""
    p = _spawn_train(tmp_path, quick_toy, "optim.total_steps=200", "checkpoint.every=0",
                     "method.dynamic_sampling=false", "rollout.n=32", "rollout.max_response_tokens=64")
    with _killed_if_stuck(p):
        _wait_for_rows(tmp_path, 1)
        time.sleep(0.2)  # past step 1's boundary work (its metrics row comes before its log line)
        p.send_signal(signal.SIGINT)
        seen = _stderr_until(p, "stopping after")
        assert "stopping after step 2 of 200" in seen[-1], "".join(seen)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=300)
    err = "".join(seen) + err
    assert p.returncode == 130, err
    assert "SIGINT again during step 2" in err and "stopped without a checkpoint" in err


def test_a_signal_during_the_step0_evaluation_stops_at_its_end_without_training(tmp_path, quick_toy):
    """Before, the stop was looked at only after a step: a SIGINT in the step-0 evaluation let the
    evaluation and all of step 1 run (12 minutes on the real-model recipe, issue 48). Now the run stops
    when the evaluation ends: no step trained, no checkpoint, and the message says how to start again."""
    p = _spawn_train(tmp_path, quick_toy, "optim.total_steps=200", "checkpoint.every=1",
                     "method.dynamic_sampling=false", "eval.limit=256", "eval.n=8")
    with _killed_if_stuck(p):
        seen = _stderr_until(p, "step 0: evaluating")  # sent in the evaluation (2,048 samples: seconds)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=300)
    err = "".join(seen) + err
    assert p.returncode == 130, err
    assert "SIGINT: stopping after the step-0 evaluation (no step trained: no checkpoint)" in err
    run = next(tmp_path.glob("tiny-arith__*"))
    assert f"interrupted after the step-0 evaluation, before step 1 (no checkpoint); start it again with: " \
           f"stare train --resume {run} --restart" in err
    assert (run / "eval" / "step-000000" / "toy-arith" / "results.json").exists()  # the evaluation finished
    assert not (run / "metrics.jsonl").exists() and "step 1/200" not in err  # step 1 never started
    assert list((run / "checkpoints").iterdir()) == []
    assert "Status: **stopped**, step 0 of 200" in (run / "REPRODUCE.md").read_text()


# ------------------------------------------------------------------- run dirs, caches, durability
def _make_dir(args) -> str:
    root, barrier_time = args
    from stare_cli.core.resolve import load_recipe
    from stare_cli.core.runs import new_run_dir

    cfg = load_recipe("tiny/arith", "grpo-ds")
    while time.time() < barrier_time:  # all processes create at the same moment
        pass
    return str(new_run_dir(cfg, root))


def test_processes_creating_run_dirs_at_once_never_share_one(tmp_path):
    ctx = mp.get_context("fork")
    for trial in range(5):
        with ctx.Pool(6) as pool:
            dirs = pool.map(_make_dir, [(tmp_path / str(trial), time.time() + 0.5)] * 6)
        assert len(set(dirs)) == 6, dirs


def _build_counting(args) -> bool:
    path, counter = args
    from benchmarks.data.cache import build_once

    def build(tmp: Path) -> None:
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.5)  # a slow build: the others arrive while it runs
        (tmp / "weights").write_text("w")

    return build_once(Path(path), build)


def test_toy_cache_is_built_once_by_concurrent_processes(tmp_path):
    path, counter = tmp_path / "cache" / "toy-x", tmp_path / "count"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "toy-x.tmp999").mkdir()  # left by a killed builder
    with mp.get_context("fork").Pool(4) as pool:
        built = pool.map(_build_counting, [(str(path), str(counter))] * 4)
    assert sorted(built) == [False, False, False, True] and counter.read_text() == "x"
    assert (path / "weights").read_text() == "w"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["toy-x", "toy-x.lock"]


def test_checkpoint_files_are_fsynced_before_latest_moves(tmp_path, quick_toy, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_cli.backends import checkpoints

    model = AutoModelForCausalLM.from_pretrained(quick_toy)
    tok = AutoTokenizer.from_pretrained(quick_toy)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                   real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    (tmp_path / "checkpoints").mkdir()
    final = checkpoints.save_checkpoint(tmp_path, 7, model, tok, opt, sched, {"step": 7, "cursor": 0}, keep_last=2)
    latest_at = events.index(("replace", str(tmp_path / "checkpoints" / "latest")))
    synced_before = {p for kind, p in events[:latest_at] if kind == "fsync"}
    tmp = str(tmp_path / "checkpoints" / ".tmp-step-000007")
    for f in final.rglob("*"):
        assert str(f).replace(str(final), tmp) in synced_before, f  # every file, and every directory
    assert tmp in synced_before
    assert ("fsync", str(tmp_path / "checkpoints")) in events[latest_at:]  # the swap made durable


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("args,message", [
    (["train", "--recipe", "tiny/arith", "-o", "optim.lr"], "override 'optim.lr' is not key.path=value"),
    (["train"], "stare train needs --recipe"),
    (["train", "--resume", "x", "--recipe", "tiny/arith"], "--resume continues a run with its own recipe"),
    (["train", "--recipe", "tiny/arith", "--restart"], "--restart applies to --resume"),
])
def test_usage_errors_exit_2(cli, args, message):
    code, _, err = cli(*args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_garbage_and_non_utf8_files_are_named(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    rows = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text("not json\n" + rows)
    code, _, err = cli("compare", str(run), "--plot", str(tmp_path / "p.png"))
    assert code == 1 and f"{run / 'metrics.jsonl'}:1: not a JSON object" in err
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe" + rows.encode())
    code, _, err = cli("compare", str(run))
    assert code == 1 and f"{run / 'metrics.jsonl'}: not UTF-8 text" in err
    bad = tmp_path / "r.yaml"
    bad.write_bytes(b"optim:\n  lr: \xff\n")
    code, _, err = cli("recipes", "validate", str(bad))
    assert code == 1 and "r.yaml" in err and "Traceback" not in err


def test_a_junk_folder_named_like_a_checkpoint_never_counts_toward_keep_last(tmp_path, quick_toy):
    """`step-zzz` used to sort first and count as the newest checkpoint, so keep_last deleted a real one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_cli.backends import checkpoints
    from stare_cli.core.runs import checkpoint_steps

    model = AutoModelForCausalLM.from_pretrained(quick_toy)
    tok = AutoTokenizer.from_pretrained(quick_toy)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    (tmp_path / "checkpoints" / "step-zzz").mkdir(parents=True)
    for step in (9, 10):
        checkpoints.save_checkpoint(tmp_path, step, model, tok, opt, sched, {"step": step, "cursor": 0}, keep_last=2)
    assert [p.name for p in checkpoint_steps(tmp_path)] == ["step-000010", "step-000009"]
    assert (tmp_path / "checkpoints" / "step-zzz").is_dir()  # not ours to delete either


def test_a_checkpoint_whose_bytes_changed_is_named_and_skipped(cli, tmp_path, quick_toy):
    """Zeroed tensor bytes (size and header intact) used to be resumed from without a word; a garbled
    safetensors header gave `KeyError: 'data_offsets'`. Now the manifest's SHA-256 names the file."""
    from stare_cli.core.runs import checkpoint_problem

    run = _train_two_checkpoints(cli, tmp_path, quick_toy)
    last = run / "checkpoints" / "step-000002" / "model.safetensors"
    data = bytearray(last.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n:8 + n + 4096] = bytes(4096)  # zero the first tensor bytes: size and header unchanged
    last.write_bytes(bytes(data))
    assert "SHA-256 mismatch" in checkpoint_problem(last.parent)
    out = tmp_path / "ev"
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", str(last.parent), "--limit", "2", "--workers", "0",
                       "--out", str(out))
    assert code == 1 and "the checkpoint is damaged" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()  # refused before anything is written: no empty folder left behind
    code, _, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=3")  # redoes step 2 from step 1
    assert code == 0 and "skipping checkpoint" in err and "SHA-256 mismatch" in err and "resuming from step-000001" in err
    header = run / "checkpoints" / "step-000001" / "model.safetensors"
    raw = bytearray(header.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    garbled = raw[8:8 + n].replace(b"data_offsets", b"data_offsetz")
    header.write_bytes(bytes(raw[:8]) + bytes(garbled) + bytes(raw[8 + n:]))
    assert "model.safetensors" in checkpoint_problem(header.parent)  # named, not a KeyError


def _train_two_checkpoints(cli, tmp_path, model) -> Path:
    code, out, err = cli("train", "--recipe", "tiny/arith", "--method", "grpo", "--out", str(tmp_path / "runs"),
                         "-o", f"model.path={model}", "-o", "optim.total_steps=2", "-o", "checkpoint.every=1",
                         "-o", "checkpoint.keep_last=3", "-o", "eval.benchmarks=[]", "-o", "rollout.n=4",
                         "-o", "optim.train_batch_size=2", "-o", "rollout.gen_batch_size=2",
                         "-o", "optim.mini_batch_size=2", "-o", "optim.micro_batch_size=8",
                         "-o", "rollout.max_response_tokens=24", "-o", "method.dynamic_sampling=false")
    assert code == 0, err
    return Path(out.strip().splitlines()[-1])


def test_two_writers_of_one_evaluation_folder_or_sweep_the_second_is_refused(cli, tmp_path):
    from stare_cli.core.runs import hold_run_lock

    bench = tmp_path / "ev" / "toy-arith"
    held = hold_run_lock(bench, "evaluated")  # as a first `stare eval` would, while it runs
    try:
        code, _, err = cli("eval", "--bench", "toy:arith", "--model", "toy:arith", "--limit", "2", "-n", "1",
                           "--out", str(tmp_path / "ev"), "--workers", "0")
        assert code == 1 and f"{bench} is being evaluated by another process (pid {os.getpid()})" in err
    finally:
        held.close()
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", "toy:arith", "--limit", "2", "-n", "1",
                       "--out", str(tmp_path / "ev"), "--workers", "0")
    assert code == 0, err
    sweep_dir = tmp_path / "sw"
    held = hold_run_lock(sweep_dir, "swept")
    try:
        code, _, err = cli("sweep", "-r", "tiny/arith", "-m", "grpo", "-s", "1", "--out", str(sweep_dir))
        assert code == 1 and f"{sweep_dir} is being swept by another process" in err
    finally:
        held.close()


# ------------------------------------------------------------------ inputs that hung or passed (issue 31, items 4-5)
def _alias_bomb(levels: int = 8) -> str:
    """8 levels of 8 aliases: 8^9 = 134M values once expanded, ~600 bytes written."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 8) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_fails_at_once_with_its_line(cli, tmp_path):
    # before the check, `stare recipes show` on this file ran until killed (60 s here)
    arith = REPO / "recipes" / "tiny" / "arith.yaml"
    f = tmp_path / "bomb.yaml"
    f.write_text(f"include: {arith}\n" + _alias_bomb().replace("a8: &a8", "description:"))
    t = time.monotonic()
    code, _, err = cli("recipes", "show", str(f))
    assert code == 1 and "YAML aliases expand to" in err and f"{f}:" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("recipes", "show", "tiny/arith", "-o", "description=" + _alias_bomb(6))  # 8^7 values
    assert code == 2 and "override 'description'" in err and "YAML aliases expand to" in err
    assert time.monotonic() - t < 20
    small = tmp_path / "small.yaml"  # aliases that expand to little still load
    small.write_text(f"include: {arith}\ndescription: &d a toy\nlogging: {{run_name: *d}}\n")
    code, out, err = cli("recipes", "show", str(small))
    assert code == 0 and "aliases" not in err


def test_errors_name_their_cause_not_an_exception_class(cli, tmp_path):
    """Issue 47, item 6: each of these printed `RecursionError`, `FileExistsError`, `NotADirectoryError`
    or `KeyError: 'settings'` with the STARE_DEBUG hint instead of what was wrong."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("x:\n" + "".join("  " * (i + 1) + "y:\n" for i in range(3000)))
    code, _, err = cli("recipes", "show", str(deep))
    assert code == 1 and "deep.yaml: nested too deeply to read" in err and "Error" not in err, err
    afile = tmp_path / "afile"
    afile.write_text("")
    code, _, err = cli("sweep", "--recipe", "tiny/arith", "-m", "grpo", "-s", "1", "--out", str(afile))
    assert code == 1 and f"--out {afile}/logs: cannot create that folder ({afile} is a file)" in err, err
    ev = tmp_path / "ev" / "m" / "math500"
    ev.mkdir(parents=True)
    (ev / "results.json").write_text(json.dumps({"benchmark": "math500", "metrics": {"n": 1}}))
    code, _, err = cli("compare", str(tmp_path / "ev"))
    assert code == 1 and "results.json: not a results file `stare eval` wrote (no settings, protocol)" in err, err
    (ev / "results.json").write_text(json.dumps({
        "benchmark": "math500", "metrics": {"n": 1, "avg@1": 50.0, "problems": 1}, "settings": {"model": "m", "seed": 0},
        "protocol": {"n": 1, "temperature": 1.0, "top_p": 1.0, "template": "paper", "max_tokens": 8}}))
    code, _, err = cli("compare", str(tmp_path / "ev"), "--format", "md", "--out", str(afile / "t.md"))
    assert code == 1 and f"cannot create that folder ({afile} is a file)" in err, err
    code, _, err = cli("compare", str(tmp_path / "ev"), "--format", "md", "--out", str(tmp_path))
    assert code == 1 and f"--out {tmp_path}: cannot write the table (Is a directory)" in err, err


@pytest.mark.parametrize("override, key", [
    ("optim.grad_clip=.inf", "optim.grad_clip"),
    ("optim.weight_decay=.nan", "optim.weight_decay"),
    ("optim.total_steps=100000000000000000000000000000", "optim.total_steps"),
    ("rollout.n=999999999999", "rollout.n"),
    ("rollout.max_response_tokens=1000000000000", "rollout.max_response_tokens"),
    ("rollout.gen_batch_size=1000000000000", "rollout.gen_batch_size"),  # hung before: drew 10^12 prompts
    ("eval.max_tokens=1000000000000", "eval.max_tokens"),
])
def test_values_no_run_can_use_are_refused_by_key(cli, override, key):
    code, _, err = cli("recipes", "show", "tiny/arith", "-o", override)
    assert code == 1 and key in err and len(err.strip().splitlines()) == 1, err


def test_eval_max_tokens_and_n_have_ceilings(cli):
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", "toy:arith", "--max-tokens", "1000000000000")
    assert code == 2 and "--max-tokens" in err
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", "toy:arith", "-n", "999999999")
    assert code == 2 and "-n" in err


@pytest.mark.parametrize("args, message", [
    (["--eval", "math5000"], "unknown benchmark 'math5000'"),  # hung before: the cells trained, the sweep never ended
    (["-s", "2"], "--seed 1 given more than once"),
    (["-m", "grpo-ds"], "--method grpo-ds given more than once"),
])
def test_a_sweep_refuses_bad_arguments_before_any_cell_runs(cli, tmp_path, args, message):
    out = tmp_path / "sw"
    base = ["sweep", "--recipe", "tiny/arith", "-m", "grpo-ds", "-s", "1", "--out", str(out)]
    if args[0] == "-s":
        args = ["-s", "1"]
    code, _, err = cli(*base, *args)
    assert code in (1, 2) and message in err, err
    assert not (out / "cells").exists()


# ---------------------------------------------------- issue 31, item 5: inputs accepted silently before
def test_a_group_of_one_is_refused_by_key(cli):
    """rollout.n=1 trained before with every advantage 0: (r - mean r) over one response is 0."""
    code, _, err = cli("recipes", "show", "tiny/arith", "-o", "rollout.n=1")
    assert code == 1 and "rollout.n" in err and "group of 1" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = cli("recipes", "show", "tiny/arith", "-o", "rollout.n=2", "-o", "optim.micro_batch_size=32")
    assert code == 0, err


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", "a\\b", ""])
def test_a_run_name_with_path_parts_is_refused(cli, name):
    """verl puts logging.run_name into its checkpoint path (trainer.experiment_name): '../x' wrote
    outside the run's folder before; it was accepted."""
    for key in ("logging.run_name", "logging.project"):  # verl: checkpoints/<project>/<run_name>
        code, _, err = cli("recipes", "show", "tiny/arith", "-o", f"{key}={name}")
        assert code == 1 and key in err, err


@pytest.mark.parametrize("answer, word", [("null", "null"), ('"  "', "empty")])
def test_a_training_row_with_a_null_or_empty_answer_is_named(cli, tmp_path, quick_toy, answer, word):
    """Before: the row trained as reward 0 on every response (answer 'None')."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1=", "answer": "2"}\n' f'{{"problem": "2+2=", "answer": {answer}}}\n')
    code, out, err = cli("train", "--recipe", "tiny/arith", "--method", "grpo-ds", "--out", str(tmp_path / "runs"),
                         "-o", f"model.path={quick_toy}", "-o", f"data.train={data}", "-o", "optim.total_steps=1")
    assert code == 1 and f"{data} row 2" in err and f"'answer' is {word}" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_training_file_that_is_not_jsonl_is_named_with_its_line(cli, tmp_path, quick_toy):
    """Before: the `datasets` library's error (no line); now our reader's file:line."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1=", "answer": "2"}\n{"problem": \n')
    code, _, err = cli("train", "--recipe", "tiny/arith", "--method", "grpo-ds", "--out", str(tmp_path / "runs"),
                       "-o", f"model.path={quick_toy}", "-o", f"data.train={data}", "-o", "optim.total_steps=1")
    assert code == 1 and f"{data}:2: not valid JSON" in err and len(err.strip().splitlines()) == 1, err
    data.write_bytes(b'\xff{"problem": "1"}\n')
    code, _, err = cli("train", "--recipe", "tiny/arith", "--method", "grpo-ds", "--out", str(tmp_path / "runs"),
                       "-o", f"model.path={quick_toy}", "-o", f"data.train={data}", "-o", "optim.total_steps=1")
    assert code == 1 and "not UTF-8" in err, err


def test_a_data_file_with_a_generated_benchmark_is_refused(cli, tmp_path, quick_toy):
    """Before: `--data-file` was ignored and the toy's own problems were evaluated under its name."""
    data = tmp_path / "mine.jsonl"
    data.write_text('{"problem": "1+1=", "answer": "2"}\n')
    code, _, err = cli("eval", "--bench", "toy:arith", "--data-file", str(data), "--model", str(quick_toy),
                       "--limit", "1", "--out", str(tmp_path / "ev"))
    assert code == 1 and "toy:arith is generated" in err and str(data) in err, err
    assert not (tmp_path / "ev" / "toy-arith").exists()


@pytest.mark.parametrize("metric", ["pass@0", "maj@0", "pass@01", "pass@100000"])
def test_compare_refuses_a_k_no_evaluation_has(cli, tmp_path, metric):
    code, _, err = cli("compare", str(tmp_path), "--metric", metric)
    assert code == 2 and f"unknown metric '{metric}'" in err, err


def test_resuming_a_finished_run_says_so(cli, tmp_path, quick_toy):
    """Before: exit 0, nothing on stderr, and the model loaded for nothing."""
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    before = (run / "metrics.jsonl").read_text()
    code, out, err = cli("train", "--resume", str(run))
    assert code == 0 and out.strip() == str(run)
    assert "is finished" in err and "step-000001" in err and "optim.total_steps=N" in err, err
    assert (run / "metrics.jsonl").read_text() == before
    code, out, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=2")  # and it can go on
    assert code == 0 and "is finished" not in err and _steps(run) == [1, 2], err
    # a total below the checkpoint's step names the checkpoint's step (issue 47: it said "at ... (1)")
    code, out, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=1")
    assert code == 0 and "its checkpoint is at step 2, past optim.total_steps (1)" in err, err
    assert "optim.total_steps=N, N > 2" in err


# ------------------------------------------------------------------------- issue 68: a full disk
def _no_space(*_a, **_k):
    raise OSError(28, "No space left on device")


def test_a_full_disk_in_training_names_the_checkpoint_and_keeps_the_earlier_ones(cli, tmp_path, quick_toy, monkeypatch):
    """Issue 68, reliability 3: a full disk printed `error: OSError: [Errno 28] No space left on device`,
    naming no file and saying nothing of what to do."""
    import torch

    calls = {"n": 0}
    real_save = torch.save

    def save_twice_then_full(*a, **k):  # the first checkpoint is written, the second finds the disk full
        calls["n"] += 1
        if calls["n"] > 1:
            _no_space()
        return real_save(*a, **k)

    monkeypatch.setattr(torch, "save", save_twice_then_full)
    code, _, err = cli("train", "--recipe", "tiny/arith", "--method", "grpo", "--out", str(tmp_path / "runs"),
                       "-o", f"model.path={quick_toy}", "-o", "optim.total_steps=2", "-o", "checkpoint.every=1",
                       "-o", "eval.benchmarks=[]", "-o", "rollout.n=4", "-o", "optim.train_batch_size=2",
                       "-o", "rollout.gen_batch_size=2", "-o", "optim.mini_batch_size=2", "-o", "optim.micro_batch_size=8",
                       "-o", "rollout.max_response_tokens=24", "-o", "method.dynamic_sampling=false")
    assert code == 1
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "step-000002: no space left on device while writing it" in line and "earlier checkpoints are intact" in line
    assert "free space" in line and "OSError" not in line
    (run,) = (tmp_path / "runs").iterdir()
    assert [p.name for p in sorted((run / "checkpoints").glob("step-*"))] == ["step-000001"]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the half-written copy is gone


def test_a_full_disk_in_an_evaluation_names_the_file_and_loses_nothing(cli, tmp_path, quick_toy, monkeypatch):
    out = tmp_path / "ev"
    args = ["eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "8", "-n", "1", "--out", str(out),
            "--engine", "hf", "--workers", "0"]
    assert cli(*args)[0] == 0
    before = (out / "toy-arith" / "results.json").read_text()
    import stare_kernel.io as kio

    monkeypatch.setattr(kio.os, "fsync", _no_space)
    code, _, err = cli(*args[:8], "2", *args[9:])  # -n 2: a new setting, whose results cannot be written
    assert code == 1
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "no space left on device while writing it" in line and str(out / "toy-arith") in line, line
    assert "nothing was lost" in line
    assert (out / "toy-arith" / "results.json").read_text() == before
