"""verl's real trainer (main_ppo, V1 trainer, FSDP2, agent-loop rollout, reward loop, TransferQueue)
end to end on CPU through `stare train --backend verl --device cpu`, with STARE active: 2 steps on
the tiny toy model, validation before and after, a checkpoint with the controller's state.

What it does not exercise is listed in stare_cli/backends/verl_cpu.py (vLLM, NCCL, multi-GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

W = 10.0
N = 4  # responses per prompt

SMALL = [
    f"rollout.n={N}", "rollout.gen_batch_size=4", "rollout.max_gen_batches=4", "optim.train_batch_size=4",
    "optim.mini_batch_size=4", "optim.micro_batch_size=16", "optim.total_steps=2", "eval.limit=8", "eval.n=2",
    "eval.every=2", "checkpoint.every=2", "method.stare.h_tgt=10", f"method.stare.W={W}",
    # the rollout server returns its log-probs, so verl compares them with the actor's (weight sync)
    'backend.verl.extra_overrides=["actor_rollout_ref.rollout.calculate_log_probs=True"]',
]


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory, quick_toy):
    from stare_cli.cli import main

    tmp = tmp_path_factory.mktemp("verl_cpu")
    data = tmp / "data"
    assert main(["data", "prepare", "-r", "tiny/arith", "--out", str(data), "--limit", "64", "-o", "eval.limit=8"]) == 0
    args = ["train", "-r", "tiny/arith", "--method", "stare-o1", "--backend", "verl", "--device", "cpu",
            "--data-dir", str(data), "--out", str(tmp / "runs"), "-o", f"model.path={quick_toy}"]
    for o in SMALL:
        args += ["-o", o]
    assert main(args) == 0, (next((tmp / "runs").iterdir()) / "verl.log").read_text()[-5000:]
    return next((tmp / "runs").iterdir())


def test_verl_trains_two_steps_on_cpu_with_stare_active(verl_run):
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        # the gate is on (H_tgt 10 > any entropy), the controller saw verl's old-log-prob entropy
        assert r["stare/gate"] == 1.0 and r["stare/W"] == W
        assert r["entropy"] == pytest.approx(r["actor/entropy"])
        assert 0 < r["stare/sel_pos"] < 1
        # Plain GRPO advantages with n = 4 are at most 1.5 (one right of four: 0.75 / std 0.5), and the
        # smallest positive one is 0.5 (three right: 0.25 / 0.5). verl's own advantage statistics are
        # taken after our transform, so a selected token shows up as >= 0.5 * W = 5.
        assert r["critic/advantages/max"] >= 0.5 * W
        assert r["critic/advantages/max"] <= 1.5 * W + 1e-4
        for key in ("reward", "grad_norm", "len/mean", "timing_s/step"):
            assert key in r, key
        # The HF rollout server samples from the weights the actor just pushed: its log-probs match
        # the actor's old-log-prob pass (both fp32) at every step, the second included.
        assert r["training/rollout_probs_diff_max"] < 1e-3
    # validation through our grader, before training and after the last step
    val = [r for r in rows if "val-core/toy:arith/acc/mean@2" in r]
    assert [r["step"] for r in val] == [0, 2]


def test_verl_checkpoint_carries_the_controller(verl_run):
    step = verl_run / "checkpoints" / "global_step_2"
    assert (step / "actor").is_dir()
    state = json.loads((step / "stare_controller.json").read_text())
    assert state["W"] == W and state["gate"] is True and state["steps"] == state["steps_on"] == 2
    meta = json.loads((verl_run / "meta.json").read_text())
    assert any(o == "actor_rollout_ref.rollout.name=hf" for o in meta["overrides"])
    assert "step:2" in (verl_run / "verl.log").read_text()


def test_compare_reads_the_verl_run(verl_run, cli):
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val-core/toy:arith/acc/mean@2" in r][-1]["val-core/toy:arith/acc/mean@2"]
    code, out, err = cli("compare", str(verl_run), "--format", "csv")
    assert code == 0, err
    header, row = out.strip().splitlines()[:2]
    cells = dict(zip(header.split(","), row.split(",")))
    assert cells["Method"] == "STARE-O1 *"  # flagged: evaluated on a subset (eval.limit=8)
    assert cells["Toy arith"] == f"{100 * last:.1f}"  # avg@2 in percent, as compare prints it


def test_verl_run_resumes_from_its_checkpoint(verl_run):
    """Runs last in this module: it extends the shared run by one step."""
    from stare_cli.cli import main

    assert main(["train", "--resume", str(verl_run), "-o", "optim.total_steps=3"]) == 0
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]
    # the controller continued from global_step_2's state: 3 steps seen, gate on in all of them
    state = json.loads((verl_run / "checkpoints" / "global_step_3" / "stare_controller.json").read_text())
    assert state["steps"] == state["steps_on"] == 3
    assert json.loads((verl_run / "meta.json").read_text())["resumed_at_step"] == 2
    log = (verl_run / "verl.log").read_text()
    assert "global_step_2" in log and "step:3" in log
