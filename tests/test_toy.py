"""The toy (issue 17): shipped warm-ups checked by hash, rebuilds that honour the thread setting, the
exploration task's construction, and the demo's verdicts."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.data import toy
from stare_cli.analysis import strategies
from stare_kernel.errors import StareError


@pytest.mark.parametrize("task", sorted(toy.SHIPPED))
def test_every_shipped_warm_up_matches_its_released_hash(task):
    path = toy.ensure_toy_model(task)
    assert path == toy.shipped_dir(task) and (path / "config.json").exists()
    meta = json.loads((path / "toy.json").read_text())
    assert meta["task"] == task and meta["version"] == toy.TOY_VERSION


def test_a_changed_shipped_file_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "arith-v1"
    shutil.copytree(toy.shipped_dir("arith"), copy)
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    monkeypatch.setattr(toy, "ASSETS", tmp_path)
    monkeypatch.setattr(toy, "_VERIFIED", set())
    with pytest.raises(StareError, match="is [0-9a-f]{12}, not the released 883ec986e9a3"):
        toy.ensure_toy_model("arith")


def test_a_rebuild_honours_the_thread_setting_and_runs_once(tmp_path, capsys):
    before = torch.get_num_threads()
    out = toy.build_toy("arith", seed=3, threads=1, out=tmp_path / "m", steps=3)
    meta = json.loads((out / "toy.json").read_text())
    assert meta["threads"] == 1 and meta["sft"]["seed"] == 3 and torch.get_num_threads() == before
    assert "building the arith toy" in capsys.readouterr().out
    assert toy.build_toy("arith", seed=3, threads=1, out=tmp_path / "m", steps=3) == out  # cached: no second build
    assert "building" not in capsys.readouterr().out
    assert toy.toy_key("arith", 3) != toy.toy_key("arith") and toy.toy_dir("arith", 3) != toy.toy_dir("arith")


def test_explore_problems_split_by_kind_and_hard_add_first_solutions_forget_the_carry():
    rows = toy.explore_problems(4000, seed=0, hard_share=0.1)
    hard = [r for r in rows if r["hard"]]
    assert 0.08 < len(hard) / len(rows) < 0.12
    assert all(r["a"] + r["b"] >= 20 and r["c"] <= max(r["a"], r["b"]) for r in hard)
    assert all(r["a"] + r["b"] < 20 for r in rows if not r["hard"])
    rng = random.Random(0)
    right = {"+": [0, 0], "-": [0, 0]}  # order of the first step -> [correct, total] on hard problems
    for r in hard:
        demo = toy.explore_demonstration(r, rng)
        first_op = "+" if "+" in demo.split("=")[0] else "-"
        right[first_op][1] += 1
        right[first_op][0] += demo.endswith(f"\\boxed{{{r['answer']}}}")
    assert right["+"][0] / right["+"][1] < 0.2  # add-first forgets the carry (90%)
    assert right["-"][0] / right["-"][1] > 0.85  # subtract-first is right (5% noise)
    eval_hard = toy.eval_problems("toy:explore-hard", 50)
    assert len(eval_hard) == 50 and all(int(p["answer"]) >= 0 for p in eval_hard)


def test_demo_verdicts_count_seeds_per_claim():
    from stare_cli.analysis.demo import verdicts

    def s(end, slope, mean):
        return {"entropy_end": end, "slope_2nd_half_per_100": slope, "entropy_2nd_half_mean": mean}

    summ = {1: {"grpo-ds": s(0.28, -0.05, 0.30), "stare-o1": s(0.35, 0.0, 0.352)},
            2: {"grpo-ds": s(0.36, 0.01, 0.37), "stare-o1": s(0.36, -0.02, 0.36)}}
    lines = verdicts(summ, 0.35)
    assert lines[0] == "verdict: GRPO-ds: entropy ends below H_tgt and is still falling: 1/2 seeds (1)"
    assert lines[1].endswith("not falling: 1/2 seeds (1)")  # seed 2: -0.02 per 100 steps is falling
    assert lines[2] == "verdict: STARE-O1 ends with more entropy than GRPO-ds: 1/2 seeds (1)"


def test_explore_strategy_reads_the_first_step():
    assert strategies.explore_strategy("first 11+12=23, then 23-4=19. \\boxed{19}") == "add-first"
    assert strategies.explore_strategy("we get 12 - 4 = 8 and 8 +11 =19. \\boxed{19}") == "sub-first"
    assert strategies.explore_strategy("\\boxed{19}") is None  # no step written
    rows = [{"response": "12-4=8, 8+11=19", "correct": True}, {"response": "12-4=9, 9+11=20", "correct": False},
            {"response": "11+12=13, 13-4=9", "correct": False}, {"response": "\\boxed{1}", "correct": False}]
    s = strategies.strategy_share(rows)
    # 2 of 4 subtract first (1 of them right), 1 of 4 adds first (wrong), 1 writes no step
    assert (s.samples, s.sub_first, s.add_first, s.acc_sub_first, s.acc_add_first) == (4, 0.5, 0.25, 0.5, 0.0)
    assert strategies.strategy_share(rows[3:]).acc_sub_first is None


def _sweep_with_strategies(root: Path, shares: dict[tuple[str, int], tuple[int, int]]) -> Path:
    """A sweep manifest whose cells each hold one final explore-hard evaluation: (sub-first, add-first)
    sample counts per (method, seed), every sub-first sample right, every add-first one wrong."""
    cells = []
    for (method, seed), (sub, add) in shares.items():
        run = root / f"{method}-{seed}"
        folder = run / "eval" / "step-000200" / "toy-explore-hard"
        (folder / "results").mkdir(parents=True)
        key = f"k{seed:04d}"
        res = json.dumps({"benchmark": "toy:explore-hard", "key": key, "grader": "math-verify@4",
                          "protocol": {"n": 4, "temperature": 1.0, "top_p": 1.0, "template": "raw", "max_tokens": 56},
                          "settings": {"model": f"{run}@step-200", "seed": seed}, "metrics": {"n": 4, "problems": 1}})
        (folder / "results" / f"{key}-math-verify.json").write_text(res)
        (folder / "results.json").write_text(res)  # the latest setting, as `stare eval` writes it
        rows = [{"key": key, "response": "12-4=8, 8+11=19", "correct": True}] * sub + \
               [{"key": key, "response": "12+11=13, 13-4=9", "correct": False}] * add + \
               [{"key": "other", "response": "12-4=8", "correct": True}] * 3  # another setting's rows: not counted
        (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cells.append({"method": method, "seed": seed, "run_dir": str(run), "state": "done"})
    (root / "sweep.json").write_text(json.dumps({"cells": cells}))
    return root


def test_strategy_table_over_seeds(tmp_path, cli):
    sweep = _sweep_with_strategies(tmp_path, {("grpo-ds", 1): (1, 3), ("grpo-ds", 2): (3, 1), ("stare-o1", 1): (2, 2)})
    code, out, err = cli("toy", "strategies", str(sweep))
    assert code == 0, err
    # grpo-ds: sub-first shares 1/4 and 3/4 -> mean 50.0, sample std 35.4; stare-o1: 2/4 = 50.0 over 1 seed
    assert "| grpo-ds | step-000200 n=4 | 2 | 50.0 ± 35.4 [25.0, 75.0]" in out  # two seeds: their range
    assert "| stare-o1 | step-000200 n=4 | 1 | 50.0 | 100.0" in out  # one seed: the value alone
    code, _, err = cli("toy", "strategies", str(tmp_path / "nowhere"))
    assert code == 1 and "not a sweep manifest" in err
