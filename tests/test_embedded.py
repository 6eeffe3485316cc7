"""The embedded trainer through the real CLI on a tiny local model: every method trains, the run
directory is complete, and a run killed with SIGKILL mid-step resumes to identical metrics."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from baselines.registry import METHODS
from conftest import REPO

# Small and fast: 4 prompts x 8 samples, 24 new tokens, one generation batch.
FAST = [
    "rollout.n=8", "rollout.gen_batch_size=4", "rollout.max_gen_batches=2", "rollout.max_response_tokens=40",
    "optim.train_batch_size=4", "optim.mini_batch_size=2", "optim.micro_batch_size=8", "optim.lr=1e-3",
    "eval.limit=8", "eval.every=0", "logging.samples_every=1", "method.stare.h_tgt=10", "method.overlong.buffer=8",
]


def _train(cli, tmp_path, model_dir, method, *extra):
    args = ["train", "--recipe", "tiny/arith", "--method", method, "--out", str(tmp_path / "runs"),
            "-o", f"model.path={model_dir}"]
    for o in [*FAST, *extra]:
        args += ["-o", o]
    code, out, err = cli(*args)
    assert code == 0, err
    return Path(out.strip().splitlines()[-1])


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_on_the_toy(cli, tmp_path, quick_toy, method):
    run = _train(cli, tmp_path, quick_toy, method, "optim.total_steps=3", "method.dynamic_sampling=false")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert torch.isfinite(torch.tensor(r["loss"])), r
    assert any(r["grad_norm"] > 0 for r in rows)  # a step whose groups all score 0 has no gradient
    before = load_file(str(quick_toy / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before), "parameters did not change"
    if METHODS[method].stare:
        assert all(r["stare/gate"] == 1.0 for r in rows)  # H_tgt 10: the gate is on
        assert any(r["stare/sel_pos"] > 0 for r in rows)
        if method == "stare-c2":
            assert any(r["stare/sel_neg"] > 0 for r in rows)
    cfg = (run / "config.yaml").read_text()
    assert f"name: {method}" in cfg


def test_run_directory_is_complete(cli, tmp_path, quick_toy):
    # dynamic sampling off: a step whose groups all score alike would otherwise be skipped, and the
    # last row would lack the training metrics checked below
    run = _train(cli, tmp_path, quick_toy, "stare-o1", "optim.total_steps=2", "eval.every=2",
                 "method.dynamic_sampling=false")
    assert run.name.startswith("tiny-arith__stare-o1__seed1__")
    meta = json.loads((run / "meta.json").read_text())
    assert "git_sha" in meta and "torch" in meta["packages"]
    assert (run / "checkpoints" / "latest").is_symlink()
    assert (run / "checkpoints" / "latest" / "state.json").exists()
    assert (run / "samples" / "step-000002.jsonl").exists()
    # issue 44, item 8: the weights were written 0600 (safetensors), every other file 0644
    umask = os.umask(0)
    os.umask(umask)
    for f in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((run / "checkpoints" / "latest" / f).stat().st_mode) == 0o666 & ~umask, f
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    log = (run / "train.log").read_text().splitlines()
    steps = [x for x in log if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["1/2", "2/2"] and all("steps/min  ETA" in x for x in steps)
    # issue 44: what the run is doing, phase by phase, with the time, then a summary and the plot
    text = "\n".join(log)
    for phrase in ("run directory", "loading", "model loaded in", "step 0: evaluating", "step 1/2: rollout",
                   "step 1/2: training on", "step 2/2: evaluating", "step 2/2: toy:arith avg ", "done: 2 steps", "held-out: step 0:", "card: ",
                   "plot: "):
        assert phrase in text, phrase
    assert (run / "plots" / "dynamics.png").exists() and (run / "eval" / "step-000000").is_dir()
    for key in ("reward", "acc", "full_solve", "entropy", "len/mean", "len/truncated", "actor/clip_frac",
                "actor/ppo_kl", "grad_norm", "lr", "stare/gate", "stare/W", "quad/pos_high/share",
                "reflection_rate", "time/generate", "time/score", "time/train", "eval/toy:arith/acc"):
        assert key in last, key
    # the reproduction card (stare_cli/core/card.py): status, commit, the recipe's hash, and a rerun
    # command that works
    import hashlib
    import shlex

    card = (run / "REPRODUCE.md").read_text()
    # issue 44, item 8: the start records the -o overrides it was given (the card's "Starts and resumes"
    # said `overrides []` for a run started with -o)
    start = json.loads((run / "config-history.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and any(o.startswith("model.path=") for o in start["overrides"]), start
    assert "Status: **finished**, step 2 of 2" in card
    # the card rebuilt from the records alone, as its first line says, still knows the run finished
    # (it said "started" for any run before)
    from stare_cli.core.card import write_card

    assert "Status: **finished**, step 2 of 2" in write_card(run).read_text()
    # the command this test typed (main(argv) records it; it recorded pytest's command line before)
    assert f"```bash\nstare train --recipe tiny/arith --method stare-o1 --out {tmp_path / 'runs'} -o " in card
    assert f"`{meta['git_sha']}`" in card
    assert hashlib.sha256((run / "config.yaml").read_bytes()).hexdigest() in card
    assert "- last training step 2: reward" in card and "- last evaluation (step 2): eval/toy:arith/acc" in card
    rerun = card.split("From the resolved recipe")[1].split("```bash\n")[1].split("\n```")[0]
    argv = shlex.split(rerun)
    assert argv[:3] == ["stare", "train", "--recipe"] and argv[3] == str(run / "config.yaml")
    argv[argv.index("--out") + 1] = str(tmp_path / "rerun")
    code, out, err = cli(*argv[1:])
    assert code == 0, err
    again = Path(out.strip().splitlines()[-1])
    assert "Status: **finished**, step 2 of 2" in (again / "REPRODUCE.md").read_text()
    # ... and it is the same run: every metric, sample and evaluation to the bit (issue 48)
    code, out, err = cli("compare", str(run), str(again), "--same")
    assert code == 0 and out.startswith("same: over steps 1-2 (2 of 2 logged by"), (out, err)


def test_dynamic_sampling_drops_groups_and_draws_again(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=3", "rollout.max_gen_batches=3")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train_groups"] <= 4 for r in rows)
    assert sum(r["groups_dropped"] for r in rows) > 0  # the quick toy solves some prompts never/always
    assert any(r["gen_batches"] > 1 for r in rows)


def _rows_without_time(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]


def test_kill_9_mid_step_then_resume_equals_uninterrupted(cli, tmp_path, quick_toy):
    extra = ["optim.total_steps=5", "checkpoint.every=2", "checkpoint.keep_last=1"]
    ref = _train(cli, tmp_path / "a", quick_toy, "stare-o1", *extra)
    # The same run in a subprocess, killed with SIGKILL during step 3 (after the step-2 checkpoint).
    args = [sys.executable, "-m", "stare_cli", "train", "--recipe", "tiny/arith", "--method", "stare-o1",
            "--out", str(tmp_path / "b"), "-o", f"model.path={quick_toy}"]
    for o in [*FAST, *extra]:
        args += ["-o", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    deadline = time.time() + 300
    run = None
    while time.time() < deadline:
        runs = list((tmp_path / "b").glob("tiny-arith__stare-o1__*"))
        if runs and (runs[0] / "checkpoints" / "latest").exists():
            run = runs[0]
            break
        time.sleep(0.05)
    assert run is not None, "the run never checkpointed"
    time.sleep(0.3)  # inside step 3
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    rows_at_kill = (run / "metrics.jsonl").read_text().splitlines()
    assert 2 <= len(rows_at_kill) < 5
    code, out, err = cli("train", "--resume", str(run))
    assert code == 0, err
    assert _rows_without_time(run / "metrics.jsonl") == _rows_without_time(ref / "metrics.jsonl")
    a = load_file(str(ref / "checkpoints" / "latest" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_requires_a_run_directory(cli, tmp_path):
    code, _, err = cli("train", "--resume", str(tmp_path))
    assert code == 1 and "not a run directory" in err


@pytest.mark.parametrize("scope", ["official", "batch"])
def test_stare_scopes_train(cli, tmp_path, quick_toy, scope):
    """official: L+ / L- chosen inside each loss call, on token-budget micro-batches (150 tokens: several
    per mini-batch); batch: once over the training batch. Both log the gate and the selected shares."""
    run = _train(cli, tmp_path, quick_toy, "stare-c2", "optim.total_steps=2", "method.dynamic_sampling=false",
                 f"method.stare.scope={scope}", "optim.micro_batch_tokens=150", "reward.fn=stare-official",
                 "optim.lr=2e-4")  # the toy's RL rate: FAST's 1e-3 can leave step 2 with no correct response
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["stare/gate"] == 1.0 and r["stare/sel_pos"] > 0 and r["stare/sel_neg"] > 0 for r in rows)
    # the official accuracy beside the official format check and shaped score; the reward is the accuracy
    assert all(r["reward"] == r["acc"] and {"format", "official_score"} <= set(r) for r in rows)
    assert all(r["micro_batches"] > 2 for r in rows)  # 16 responses of up to 32 + 40 tokens
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_per_group_refill_fills_the_batch_one_prompt_per_missing_group(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=2", "rollout.refill=per_group",
                 "reward.fn=stare-official")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train_groups"] == 4 for r in rows)  # always full (no cap)
    assert sum(r["groups_dropped"] for r in rows) > 0 and any(r["gen_batches"] > 1 for r in rows)


def test_short_batch_stops_with_a_clear_error_as_the_official_trainer(cli, tmp_path, quick_toy):
    """One-token responses never finish: every group scores 0 and is dropped; after max_gen_batches
    draws the official trainer raises, and so do we under on_short_batch: error."""
    code, out, err = cli("train", "--recipe", "tiny/arith", "--method", "grpo-ds", "--out", str(tmp_path / "runs"),
                         "-o", f"model.path={quick_toy}", *[x for o in FAST for x in ("-o", o)],
                         "-o", "rollout.max_response_tokens=1", "-o", "rollout.on_short_batch=error",
                         "-o", "method.overlong.enable=false")
    assert code == 1 and "2 generation batches kept 0 groups" in err and "on_short_batch=train" in err


def test_hf_engine_stops_at_tool_blocks_and_masks_observations(quick_toy, monkeypatch):
    """The real HF path: generation stops at the block's closing string, the tool runs, and the
    observation tokens get loss-mask 0 (the toy writes "a+b=" often; "+" opens and "=" closes here)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.generation import tools as T
    from benchmarks.generation.engines import HFEngine, SamplingParams, load_tokenizer
    from benchmarks.generation.sandbox import Limits

    monkeypatch.setitem(T.FORMATS, "markdown", ("+", "="))
    tok = load_tokenizer(str(quick_toy))
    eng = HFEngine(AutoModelForCausalLM.from_pretrained(quick_toy), tok)
    spec = T.ToolSpec(max_turns=1, limits=Limits(cpu_s=2, wall_s=5))
    samples = eng.generate(["Compute 3+4-2.\n"] * 2, SamplingParams(n=4, max_new_tokens=40, seed=0), spec)
    called = [s for g in samples for s in g if s.tool_calls]
    assert called, "the toy never produced a '+ ... =' block"
    for s in called:
        assert 0 in s.loss_mask and len(s.loss_mask) == len(s.response_ids)
        first_obs = s.loss_mask.index(0)
        assert tok.decode(s.response_ids[:first_obs]).rstrip().endswith("=")  # stopped right at the closer


def test_training_with_tools_enabled_logs_tool_metrics(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false",
                 "rollout.tools.enable=true")
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"tools/calls_per_response", "tools/error_rate", "tools/turns"} <= set(row)


def test_tool_toy_evaluation_follows_its_training_reward(cli, tmp_path, quick_tool_toy):
    """Evaluation during training goes through the training rollout path: the tool runs in the
    evaluation too, so its accuracy tracks the training accuracy (before, evaluation never ran the
    tool and scored ~0 while the training reward climbed)."""
    args = ["train", "--recipe", "tiny/tool", "--method", "grpo-ds", "--out", str(tmp_path / "runs"),
            "-o", f"model.path={quick_tool_toy}"]
    for o in ["optim.total_steps=3", "eval.every=1", "eval.limit=48", "method.dynamic_sampling=false",
              "rollout.gen_batch_size=8", "optim.train_batch_size=8", "optim.mini_batch_size=8",
              "optim.micro_batch_size=64"]:
        args += ["-o", o]
    code, out, err = cli(*args)
    assert code == 0, err
    rows = [json.loads(line) for line in Path(out.strip().splitlines()[-1], "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["tools/calls_per_response"] > 0.1 and r["eval/toy:tool/tool_calls"] > 0.1, r
    train = sum(r["acc"] for r in rows) / len(rows)
    evaluated = sum(r["eval/toy:tool/acc"] for r in rows) / len(rows)
    assert abs(train - evaluated) < 0.2, (train, evaluated)


def test_bf16_autocast_trains_on_cpu(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "stare-o1", "optim.total_steps=2", "optim.precision=bf16",
                 "method.dynamic_sampling=false")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_one_lr_1e_6_step_moves_the_fp32_master_weights(cli, tmp_path, quick_toy):
    """Master weights stay fp32 under bf16 compute: after one AdamW step at lr 1e-6 (each weight
    moves by about 1e-6, far below bf16's resolution near 0.05, about 4e-4) almost every weight
    changed. With bf16 weights only a few percent would."""
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "optim.lr=1e-6", "optim.precision=bf16",
                 "method.dynamic_sampling=false", "eval.benchmarks=[]")
    before = load_file(str(quick_toy / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in after.values())
    changed = sum(int((before[k] != after[k]).sum()) for k in before) / sum(v.numel() for v in before.values())
    assert changed > 0.99, changed


def test_fp16_needs_cuda(cli, tmp_path, quick_toy):
    code, _, err = cli("train", "--recipe", "tiny/arith", "-o", f"model.path={quick_toy}", "-o", "optim.precision=fp16",
                       "-o", "backend.embedded.device=cpu", "--out", str(tmp_path))
    assert code == 1 and err.startswith("error: optim.precision: the embedded backend cannot honour") and "CUDA" in err


def test_vllm_rollout_gets_the_trained_weights_before_every_step(cli, tmp_path, quick_toy, monkeypatch):
    """The colocated vLLM path with a stand-in `vllm` (tests/fixtures/fake_vllm.py): before each
    step's rollout the engine holds exactly the weights of the previous step's checkpoint."""
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    import fake_vllm

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    fake_vllm.LLM.instances.clear()
    run = _train(cli, tmp_path, quick_toy, "stare-o1", "optim.total_steps=3", "method.dynamic_sampling=false",
                 "rollout.engine=vllm", "checkpoint.every=1", "checkpoint.keep_last=3")
    (llm,) = fake_vllm.LLM.instances
    assert llm.in_process and llm.kwargs["max_model_len"] == 32 + 40
    # the step-0 evaluation, rollouts of steps 1-3, then the final evaluation; new weights before steps 2, 3
    # and the final evaluation
    assert len(llm.generate_digests) == 5 and llm.loads == 3 and llm.resets == 3
    assert llm.generate_digests.pop(0) == llm.generate_digests[0]  # step 0 evaluates the initial weights
    from transformers import AutoModelForCausalLM

    def digest(path):  # loaded as a model, so tied weights appear as in the trainer's state_dict
        return fake_vllm.weights_digest(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())

    assert llm.generate_digests[0] == digest(quick_toy)
    for k in (1, 2, 3):
        assert llm.generate_digests[k] == digest(run / "checkpoints" / f"step-{k:06d}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_skipped_steps_still_checkpoint_evaluate_and_resume(cli, tmp_path, quick_toy):
    """One-token responses never finish, so every group scores 0 and dynamic sampling drops them
    all: each step is skipped, yet the last one still evaluates and writes its checkpoint."""
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=2", "rollout.max_response_tokens=1",
                 "method.overlong.enable=false")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("skipped")) for r in rows] == [(1, 1), (2, 1)]
    assert "eval/toy:arith/acc" in rows[-1]
    assert json.loads((run / "checkpoints" / "latest" / "state.json").read_text())["step"] == 2
    code, out, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=3")
    assert code == 0, err
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]


@pytest.mark.parametrize("batching", [["optim.mini_batch_size=4", "optim.micro_batch_size=32"], []],
                         ids=["fused", "micro-batches"])
@pytest.mark.parametrize("setting", [("length_buckets", "true", "false"), ("share_prompts", "true", "false")],
                         ids=["length_buckets", "share_prompts"])
def test_forward_layouts_leave_the_training_step_unchanged(cli, tmp_path, quick_toy, batching, setting):
    # Step 1 rolls out from the same weights either way, so every number of it must agree: bucketed
    # forwards and shared-prompt forwards compute the same log-probs, entropies, STARE sets, loss
    # and gradient as one padded forward per micro-batch and one sequence per row.
    key, on, off = setting
    rows = {}
    for b in (on, off):
        run = _train(cli, tmp_path / b, quick_toy, "stare-o1", "optim.total_steps=1", "method.dynamic_sampling=false",
                     f"backend.embedded.{key}={b}", *batching)
        rows[b] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    keys = [k for k in rows[on] if not k.startswith(("time/", "memory/")) and isinstance(rows[on][k], (int, float))]
    assert {"entropy", "loss", "grad_norm", "stare/sel_pos", "actor/clip_frac"} <= set(keys)
    torch.testing.assert_close(torch.tensor([rows[on][k] for k in keys], dtype=torch.float32),
                               torch.tensor([rows[off][k] for k in keys], dtype=torch.float32))


def test_the_official_layout_trains_on_the_toy(cli, tmp_path, quick_toy):
    """optim.loss_layout: official through the CLI: 16 responses per mini-batch over 4 emulated ranks,
    each rank's micro-batches by verl 0.7's rule (tests/test_official_layout.py checks the loss path)."""
    run = _train(cli, tmp_path, quick_toy, "stare-c2", "optim.total_steps=2", "method.dynamic_sampling=false",
                 "optim.loss_layout=official", "optim.official_ranks=4", "optim.micro_batch_tokens=80")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # 2 mini-batches per step, each at least one micro-batch on each of 4 ranks
    assert all(r["micro_batches"] >= 8 for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["grad_norm"] > 0 for r in rows)
    assert any(r["stare/sel_pos"] > 0 for r in rows)
    assert "loss_layout: official" in (run / "config.yaml").read_text()


def test_compare_prints_the_runs_cards(cli, tmp_path, quick_toy):
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    code, out, err = cli("compare", str(run), "--cards", "--format", "csv")
    assert code == 0, err
    import csv
    import hashlib
    import io

    (row,) = list(csv.DictReader(io.StringIO(out)))
    meta = json.loads((run / "meta.json").read_text())
    assert row["run"] == run.name and row["commit"] == meta["git_sha"] and row["method"] == "grpo-ds"
    assert row["recipe_sha256"] == hashlib.sha256((run / "config.yaml").read_bytes()).hexdigest()[:12]
    assert (row["steps"], row["of"], row["backend"]) == ("1", "1", "embedded")
    code, out, err = cli("compare", str(tmp_path), "--cards")
    assert code == 1 and "no training run directories" in err


def test_a_run_from_a_checkout_with_uncommitted_changes_keeps_the_diff(cli, tmp_path, quick_toy, monkeypatch):
    """A run's commit ends in -dirty when the checkout had uncommitted changes; the changes themselves are
    kept in the run directory (source-<event>-step<k>.diff), named in config-history.jsonl and the card."""
    import subprocess

    from stare_cli.core import runs as R

    repo = tmp_path / "src"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert not R.git_sha(repo).endswith("-dirty") and R.source_diff(repo) is None
    (repo / "a.py").write_text("x = 2\n")
    assert R.git_sha(repo).endswith("-dirty") and "+x = 2" in R.source_diff(repo)
    sha, diff = R.git_sha, R.source_diff
    monkeypatch.setattr(R, "git_sha", lambda cwd=None: sha(repo))
    monkeypatch.setattr(R, "source_diff", lambda cwd=None: diff(repo))
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    (start,) = [json.loads(line) for line in (run / "config-history.jsonl").read_text().splitlines()]
    assert start["git_sha"].endswith("-dirty") and start["source_diff"] == "source-start-step0.diff"
    assert "+x = 2" in (run / "source-start-step0.diff").read_text()
    assert "(uncommitted changes in the checkout: `source-start-step0.diff`)" in (run / "REPRODUCE.md").read_text()


def test_export_of_an_embedded_checkpoint(cli, tmp_path, quick_toy):
    from safetensors.torch import load_file

    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false")
    code, out, err = cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert code == 0, err
    hf = Path(out.strip())
    names = {p.name for p in hf.iterdir()}
    assert {"model.safetensors", "config.json", "export.json"} <= names and not names & {"trainer.pt", "state.json"}
    ck = run / "checkpoints" / "latest"
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(ck / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((hf / "export.json").read_text())["step"] == 1
    code, out, err = cli("export", str(run), "--out", str(tmp_path / "hf"))  # not over an earlier export
    assert code == 1 and "is not empty" in err
    code, out, err = cli("export", str(run), "--step", "7", "--out", str(tmp_path / "hf7"))
    assert code == 1 and "no checkpoint of step 7" in err


def test_resume_names_metrics_it_cannot_recover(cli, tmp_path, quick_toy):
    """Issue 47, item 3: with metrics.jsonl cut mid-row, resume rewrote it as steps 1-5, 11, 12 without a
    word; a deleted metrics.jsonl was accepted silently. The gap is named (it cannot be recovered)."""
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=3", "method.dynamic_sampling=false",
                 "checkpoint.every=1", "eval.benchmarks=[]")
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # step 1, then step 2 cut mid-row
    code, _, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=4")
    assert code == 0, err
    assert "lacks the metrics of steps 2-3 of the 3 the checkpoint holds" in err, err
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 4]
    metrics.unlink()
    code, _, err = cli("train", "--resume", str(run), "-o", "optim.total_steps=5")
    assert code == 0 and "lacks the metrics of steps 1-4 of the 4" in err, err


def test_out_that_is_a_run_directory_is_refused(cli, tmp_path, quick_toy):
    """Issue 47, item 5: `stare train --out RUN` and `stare sweep --out RUN` wrote into an existing run."""
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=1", "method.dynamic_sampling=false",
                 "eval.benchmarks=[]")
    before = sorted(p.name for p in run.iterdir())
    code, _, err = cli("train", "--recipe", "tiny/arith", "--out", str(run), "-o", f"model.path={quick_toy}")
    assert code == 1 and "is a run directory" in err and "--resume" in err, err
    code, _, err = cli("sweep", "--recipe", "tiny/arith", "-m", "grpo-ds", "-s", "1", "--out", str(run),
                       "-o", f"model.path={quick_toy}")
    assert code == 1 and "is a run directory" in err, err
    assert sorted(p.name for p in run.iterdir()) == before


def test_unclear_errors_name_their_cause(cli, tmp_path):
    """Issue 47, item 6: these printed an exception class, hung, or nothing useful."""
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        (["train", "--recipe", str(fifo)], "not a regular file"),  # reading a FIFO blocked for ever
        (["train", "--recipe", "tiny/arith", "--out", str(a_file)], "it is a file"),
        (["train", "--recipe", "tiny/arith", "-o", f"model.path={a_file}"], "a file, not a model folder"),
        (["train", "--recipe", "tiny/arith", "-o", f"model.path={tmp_path / 'empty'}"], "no config.json"),
    ]
    for args, said in cases:
        code, _, err = cli(*args)
        assert code == 1 and err.startswith("error: ") and said in err and "Error:" not in err, (args, err)


def test_large_blocks_are_mapped_in_training_only_where_the_recipe_asks_on_the_cpu(monkeypatch):
    """backend.embedded.heap: 'mapped' fixes glibc's mmap threshold at 128 KiB (mallopt(-3, 131072)) for the
    training phase on the CPU and sets it to 32 MiB after, also when training raises; never on CUDA. 'auto' (the
    default) and 'glibc' change nothing, with one micro-batch or several, for a real vocabulary or a toy's:
    mapping cost 25-45% more training time where a smaller micro-batch saved as much memory (issue 69)."""
    import ctypes

    import torch

    from stare_cli.backends import embedded as E
    from stare_cli.core.resolve import load_recipe

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())

    def recipe(heap, *extra):  # small/smollm2-135m-words: one micro-batch of 64 responses
        return load_recipe("small/smollm2-135m-words", None, [f"backend.embedded.heap={heap}", *extra])

    cpu, cuda = E.Hardware(torch.device("cpu"), False), E.Hardware(torch.device("cuda"), False)
    mb8, ckpt, tokens = "optim.micro_batch_size=8", "backend.embedded.activation_checkpointing=true", \
        "optim.micro_batch_tokens=1600"
    cases = [(recipe("mapped"), cpu, True), (recipe("mapped", mb8), cpu, True), (recipe("mapped"), cuda, False),
             (recipe("auto"), cpu, False), (recipe("auto", mb8), cpu, False), (recipe("auto", ckpt), cpu, False),
             (recipe("auto", tokens), cpu, False), (recipe("glibc", mb8), cpu, False)]
    for i, (cfg, hw, mapped) in enumerate(cases):
        calls.clear()
        h = E.Heap.choose(hw, cfg)
        assert calls == []  # nothing changes before the training phase
        with h.training():
            assert calls == ([(-3, 128 * 1024)] if mapped else []), i
        assert calls == ([(-3, 128 * 1024), (-3, 32 * 2**20)] if mapped else []), i
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        with E.Heap.choose(cpu, recipe("mapped")).training():
            raise KeyboardInterrupt
    assert calls == [(-3, 128 * 1024), (-3, 32 * 2**20)]


def test_the_heap_is_trimmed_only_above_a_resident_set_where_it_pays(monkeypatch):
    """Issue 69: the trim between phases made every toy step fault its working set back in (about 15% of a
    toy step); it now runs only above TRIM_ABOVE_BYTES (the real model's resident set is above it)."""
    import ctypes

    import torch

    from stare_cli.backends import embedded as E

    calls = []

    class Libc:
        def malloc_trim(self, pad):
            calls.append(pad)

    real_rss = E.resident_bytes
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    hw = E.Hardware(torch.device("cpu"), False)
    monkeypatch.setattr(E, "resident_bytes", lambda: E.TRIM_ABOVE_BYTES - 1)
    E.release_freed_memory(hw)
    assert calls == []  # a small process: nothing handed back
    monkeypatch.setattr(E, "resident_bytes", lambda: E.TRIM_ABOVE_BYTES)
    E.release_freed_memory(hw)
    assert calls == [0]
    monkeypatch.setattr(E, "resident_bytes", lambda: None)  # unknown: trimmed, as before
    E.release_freed_memory(hw)
    assert calls == [0, 0]
    assert real_rss() > 0  # this machine's /proc/self/statm is read


def test_gradients_are_freed_after_each_optimizer_step(cli, tmp_path, quick_toy, monkeypatch):
    """The last update's gradients do not live through the next rollout and forward (issue 69: on the real
    model they were 0.5 GiB on top of the forward's saved activations, the step's peak): at every rollout
    and every old-log-prob pass no parameter holds a gradient, and the optimizer still stepped (weights
    moved) with mini-batches of two calls each (accumulation within a mini-batch is unchanged)."""
    import stare_cli.backends.embedded as E

    seen = []

    def watch(name, fn):
        def wrapped(*a, **k):
            model = getattr(a[0], "model", None) if name == "old_pass" else seen_model[0]
            if model is not None:
                seen.append((name, any(p.grad is not None for p in model.parameters())))
            return fn(*a, **k)
        return wrapped

    seen_model = [None]
    real_load = E.load_policy

    def load(*a, **k):
        p = real_load(*a, **k)
        seen_model[0] = p.model
        return p

    monkeypatch.setattr(E, "load_policy", load)
    monkeypatch.setattr(E, "collect_rollouts", watch("rollout", E.collect_rollouts))
    monkeypatch.setattr(E, "old_pass", watch("old_pass", E.old_pass))
    run = _train(cli, tmp_path, quick_toy, "grpo-ds", "optim.total_steps=3", "method.dynamic_sampling=false")
    assert [n for n, _ in seen] == ["rollout", "old_pass"] * 3
    assert not any(has_grad for _, has_grad in seen)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in rows)


def _weights(run):
    from safetensors.torch import load_file

    (f,) = (run / "checkpoints" / "latest").glob("*.safetensors")
    return load_file(f)


@pytest.mark.parametrize("case", [
    ("stare-c2", []),  # FAST's h_tgt 10: the gate is on at every step, W and M act
    ("stare-o1", ["method.stare.adaptive=true", "method.stare.w_max=2.5", "method.stare.h_tgt=0.3"]),  # H > 0.3: W falls
    ("grpo-ds", []),
    ("stare-o1", ["peek-wrong"]),  # every prediction of the controller's state wrong: every step reruns
], ids=["stare-c2", "stare-o1-adaptive", "grpo-ds", "stare-o1-mispredicted"])
def test_a_fused_old_pass_over_micro_batches_is_the_separate_pass(cli, tmp_path, quick_toy, monkeypatch, case):
    """One mini-batch (32 responses) in 4 micro-batches of 8: the weights cannot change before the
    training forwards, so their detached log-probs and entropies are pi_old's, and the step is the one
    a separate no-grad pass gives. The controller's state is predicted from the first micro-batch's
    entropy and checked against the batch's H; a wrong prediction reruns the micro-batches. Equal to
    the bit: the same kernels on the same rows compute both (the no-grad pass only skips the graph)."""
    method, extra = case
    if extra == ["peek-wrong"]:
        from dataclasses import replace

        from stare_cli.method.layer import MethodLayer

        right = MethodLayer.peek_step
        monkeypatch.setattr(MethodLayer, "peek_step",
                            lambda self, H: replace(s := right(self, H), gate=not s.gate, W=s.W + 0.5))
        extra = []
    rows, weights = {}, {}
    for fused in ("true", "false"):
        run = _train(cli, tmp_path / fused, quick_toy, method, "optim.total_steps=2", "method.dynamic_sampling=false",
                     "optim.mini_batch_size=4", f"backend.embedded.fused_old_pass={fused}", *extra)
        rows[fused] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        weights[fused] = _weights(run)
    for a, b in zip(rows["true"], rows["false"]):
        assert a["micro_batches"] == 4
        assert a.pop("fused/rerun") == (1.0 if case[1] == ["peek-wrong"] else 0.0) and "fused/rerun" not in b
        keys = [k for k in b if not k.startswith(("time/", "memory/")) and isinstance(b[k], (int, float))]
        assert sorted(keys) == sorted(k for k in a if not k.startswith(("time/", "memory/"))
                                      and isinstance(a[k], (int, float)))
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert rows["true"][0]["rollout/lp_abs_diff_max"] > 0  # pi_old was recorded, not left at zero
    for k, w in weights["false"].items():
        assert torch.equal(weights["true"][k], w), k
