"""verl's real trainer (main_ppo, V1 trainer, FSDP2, agent-loop rollout, reward loop, TransferQueue)
end to end on CPU through `stare train --backend verl --device cpu`, through the method layer: the
official STARE reward (`reward.fn: stare-official`, our reward manager), the official generation
batches (our verl sampler), the official loss layout (4 emulated ranks) and the official selection
scope (inside verl's loss calls). STARE-O1 and STAPO, 2 steps each on the tiny toy model, validation
before and after, a checkpoint with the controller's state, and a resumed third step.

What it does not exercise is listed in stare_cli/backends/verl_cpu.py (vLLM, NCCL, multi-GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)  # verl's real trainer on the CPU: ~2-4 min a run here

W = 10.0
N = 4  # responses per prompt

SMALL = [
    f"rollout.n={N}", "rollout.gen_batch_size=6", "rollout.max_gen_batches=4", "optim.train_batch_size=4",
    "optim.mini_batch_size=4", "optim.micro_batch_size=16", "optim.total_steps=2", "eval.limit=8", "eval.n=2",
    "eval.every=2", "checkpoint.every=2", "method.stare.h_tgt=10", f"method.stare.W={W}",
    # the official dynamic sampling: generation batches of 6 prompts, at most 4, the first 4 kept groups
    "rollout.refill=gen_batches", "rollout.on_short_batch=error",
    # the official loss layout: 16 responses over 4 emulated ranks, verl 0.7's micro-batches of 100 tokens
    "optim.loss_layout=official", "optim.official_ranks=4", "optim.micro_batch_tokens=100",
    "reward.fn=stare-official", "method.stare.scope=official",
    # the rollout server returns its log-probs, so verl compares them with the actor's (weight sync)
    'backend.verl.extra_overrides=["actor_rollout_ref.rollout.calculate_log_probs=True"]',
]


def _train(tmp, quick_toy, method: str, *extra: str) -> Path:
    from stare_cli.cli import main

    data = tmp / "data"
    if not data.exists():
        assert main(["data", "prepare", "-r", "tiny/arith", "--out", str(data), "--limit", "64", "-o", "eval.limit=8"]) == 0
    args = ["train", "-r", "tiny/arith", "--method", method, "--backend", "verl", "--device", "cpu",
            "--data-dir", str(data), "--out", str(tmp / "runs" / method), "-o", f"model.path={quick_toy}"]
    for o in [*SMALL, *extra]:
        args += ["-o", o]
    code = main(args)
    run = next((tmp / "runs" / method).iterdir())
    assert code == 0, (run / "verl.log").read_text()[-5000:]
    return run


# Session scope, not module: under `--dist loadgroup` the Ray group's tests from three modules reach their
# worker interleaved, and a module fixture torn down between them ran this ~6-minute verl training twice.
@pytest.fixture(scope="session")
def verl_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("verl_cpu")


@pytest.fixture(scope="session")
def verl_run(verl_tmp, quick_toy):
    return _train(verl_tmp, quick_toy, "stare-o1")


def test_verl_trains_two_steps_on_cpu_with_stare_active(verl_run):
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        # the gate is on (H_tgt 10 > any entropy), the controller saw verl's old-log-prob entropy
        assert r["stare/gate"] == 1.0 and r["stare/W"] == W
        assert r["entropy"] == pytest.approx(r["actor/entropy"])
        # official scope: L+ is chosen inside verl's loss calls (the actor's statistics), and the
        # driver's advantages stay plain GRPO (n = 4: at most 1.5, one right of four: 0.75 / 0.5)
        assert 0 < r["stare/sel_pos"] < 1 and r["stare/sel_neg"] == 0.0
        assert r["critic/advantages/max"] <= 1.5 + 1e-4
        # the official accuracy beside the shaped `score` and the format check (our reward manager)
        assert 0 <= r["acc"] <= 1 and 0 <= r["format"] <= 1 and -1 <= r["official_score"] <= 1
        assert r["reward"] == pytest.approx(r["acc"])  # the official managers train on acc
        for key in ("reward", "grad_norm", "len/mean", "timing_s/step", "reflection_rate"):
            assert key in r, key
        # the official generation batches (our verl sampler): a full train batch of 4 groups, from whole
        # generation batches of 6 prompts (the dropped and the surplus groups add up to what was drawn)
        assert r["train_groups"] == 4 and 1 <= r["gen_batches"] <= 4
        assert r["train_groups"] + r["groups_dropped"] + r["groups_surplus"] == 6 * r["gen_batches"]
        # the official loss layout: the actor ran exactly our loss calls (one real rank, one mini-batch:
        # the calls' scales sum to 1, so their mean, as verl averages loss statistics, is 1 / calls)
        assert r["layout/loss_calls"] >= 4
        assert r["actor/layout/scale"] == pytest.approx(1 / r["layout/loss_calls"], rel=1e-6)
        # The HF rollout server samples from the weights the actor just pushed: its log-probs match
        # the actor's old-log-prob pass (both fp32) at every step, the second included.
        assert r["training/rollout_probs_diff_max"] < 1e-3
    # validation through our grader, before training and after the last step
    val = [r for r in rows if "val-core/toy:arith/acc/mean@2" in r]
    assert [r["step"] for r in val] == [0, 2]


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_verl_ran_with_every_value_we_wrote(verl_run):
    """verl adjusts some settings when its trainer starts (e.g. data.gen_batch_size under group filtering);
    the configuration its driver ran with (dumped by our extension) must hold every value we wrote."""
    from omegaconf import OmegaConf

    from stare_cli.backends.verl_backend import compose

    meta = json.loads((verl_run / "meta.json").read_text())
    written = _flat(OmegaConf.to_container(compose(meta["overrides"]), resolve=True))
    effective = _flat(json.loads((verl_run / "verl_effective_config.json").read_text()))
    keys = [o.split("=", 1)[0].lstrip("+") for o in meta["overrides"] if not o.startswith(("hydra.", "+stare."))]
    assert len(keys) > 80
    changed = {k: (written[k], effective.get(k)) for k in keys if k in written and effective.get(k) != written[k]
               and not (isinstance(written[k], list) and effective.get(k) == [str(x) for x in written[k]])}
    assert changed == {}, changed


def test_verl_checkpoint_carries_the_controller(verl_run):
    step = verl_run / "checkpoints" / "global_step_2"
    assert (step / "actor").is_dir()
    state = json.loads((step / "stare_controller.json").read_text())
    assert state["W"] == W and state["gate"] is True and state["steps"] == state["steps_on"] == 2
    meta = json.loads((verl_run / "meta.json").read_text())
    assert any(o == "actor_rollout_ref.rollout.name=hf" for o in meta["overrides"])
    assert meta["reward_grader"] == "stare-official@1"
    assert "step:2" in (verl_run / "verl.log").read_text()
    assert (verl_run / "hydra").is_dir()  # Hydra's output folder is inside the run, not ./outputs
    # the reproduction card: finished, verl's effective configuration and the parquet files hashed
    import hashlib

    card = (verl_run / "REPRODUCE.md").read_text()
    assert "Status: **finished**, step 2 of 2" in card
    assert hashlib.sha256((verl_run / "verl_effective_config.json").read_bytes()).hexdigest() in card
    train = verl_run.parent.parent.parent / "data" / "train.parquet"
    assert f"`{train}`: SHA-256 `{hashlib.sha256(train.read_bytes()).hexdigest()}`" in card
    assert f"--data-dir {train.parent}" in card and "--backend verl" in card


def test_compare_reads_the_verl_run(verl_run, cli):
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val-core/toy:arith/acc/mean@2" in r][-1]["val-core/toy:arith/acc/mean@2"]
    code, out, err = cli("compare", str(verl_run), "--format", "csv")
    assert code == 0, err
    import csv
    import io

    header, row = list(csv.reader(io.StringIO(out)))[:2]
    cells = dict(zip(header, row))
    assert cells["Method"] == "STARE-O1"  # numbers and labels only in CSV; marks go to the notes column
    assert "reduced protocol" in cells["notes"]  # flagged: evaluated on a subset (eval.limit=8)
    assert cells["Toy arith"] == f"{100 * last:.1f}"  # avg@2 in percent, as compare prints it


def test_a_baseline_trains_on_verl_through_the_same_layer_with_fp32_master_weights(verl_tmp, quick_toy):
    """A baseline through the same layer: STAPO (GRPO-ds whose spurious tokens leave the loss mask; the
    driver writes that mask as verl's response and loss masks, which the actor then trains on), with
    thresholds that silence some of the toy's tokens; bf16 compute and lr 1e-6 through verl's FSDP2
    engine: the master weights are fp32 (fsdp_config.model_dtype), so two AdamW steps of ~1e-6 move
    almost every weight (bf16 weights near 0.05 have a resolution of ~4e-4 and would barely move)."""
    from safetensors.torch import load_file

    # verl's own replay buffer (one prompt per dropped group) and verl's own loss layout
    run = _train(verl_tmp, quick_toy, "stapo", "optim.precision=bf16", "optim.lr=1e-6",
                 "rollout.refill=per_group", "optim.loss_layout=global", "optim.micro_batch_tokens=null",
                 "method.stapo.tau_p=0.5", "method.stapo.tau_h_quantile=0.9")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert "stare/gate" not in r and "stare/sel_pos" not in r
        assert r["reward"] == pytest.approx(r["acc"]) and "official_score" in r and "format" in r
        assert 0 < r["stapo/spurious_frac"] < 0.9 and 0 < r["stapo/tau_h"]
    assert not (run / "checkpoints" / "global_step_2" / "stare_controller.json").exists()
    (hf,) = list((run / "checkpoints" / "global_step_2" / "actor").rglob("model.safetensors"))
    before, after = load_file(str(quick_toy / "model.safetensors")), load_file(str(hf))
    assert all(v.dtype == torch.float32 for v in after.values())
    common = [k for k in before if k in after]
    changed = sum(int((before[k] != after[k]).sum()) for k in common) / sum(before[k].numel() for k in common)
    assert changed > 0.99, changed
    effective = json.loads((run / "verl_effective_config.json").read_text())
    assert effective["actor_rollout_ref"]["actor"]["fsdp_config"]["mixed_precision"]["param_dtype"] == "bf16"


def test_export_turns_the_verl_checkpoint_into_a_hugging_face_folder(verl_run, cli, tmp_path):
    """`stare export` of global_step_2: the Hugging Face copy verl wrote at save time (fp32); its
    weights are the trainer's own (the FSDP shard's), so its log-probs on the same tokens are the
    trainer's. Without that copy, verl's merger runs (it writes bf16: the same weights rounded). And
    `stare eval --model RUN/checkpoints/global_step_2` evaluates the export."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    code, out, err = cli("export", str(verl_run), "--step", "2", "--out", str(tmp_path / "hf"))
    assert code == 0, err
    hf = Path(out.strip())
    meta = json.loads((hf / "export.json").read_text())
    assert meta["step"] == 2 and meta["method"] == "stare-o1" and "fp32" in meta["how"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in hf.iterdir()}
    shard = torch.load(verl_run / "checkpoints" / "global_step_2" / "actor" / "model_world_size_1_rank_0.pt",
                       weights_only=False, map_location="cpu")
    trainer = {k: getattr(v, "_local_tensor", v).float() for k, v in shard.items()}
    exported = load_file(str(hf / "model.safetensors"))
    assert set(exported) <= set(trainer) and all(torch.equal(exported[k], trainer[k]) for k in exported)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ref.load_state_dict({k: trainer[k] for k in ref.state_dict()}, strict=True)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 2, 4]])
    with torch.no_grad():
        assert torch.equal(torch.log_softmax(model(ids).logits, -1), torch.log_softmax(ref(ids).logits, -1))
    # without verl's copy: the merger (bf16)
    ck = tmp_path / "global_step_2"
    shutil.copytree(verl_run / "checkpoints" / "global_step_2", ck)
    for f in (ck / "actor" / "huggingface").glob("*.safetensors"):
        f.unlink()
    code, out, err = cli("export", str(ck), "--out", str(tmp_path / "merged"))
    assert code == 0, err
    merged = load_file(str(Path(out.strip()) / "model.safetensors"))
    assert "merger" in json.loads((Path(out.strip()) / "export.json").read_text())["how"]
    assert all(torch.equal(merged[k].float(), trainer[k].bfloat16().float()) for k in merged)
    # stare eval on the verl checkpoint itself: exported once into the cache
    code, out, err = cli("eval", "--bench", "toy:arith", "--model", str(verl_run / "checkpoints" / "global_step_2"),
                         "--limit", "2", "-n", "1", "--out", str(tmp_path / "eval"), "--json")
    assert code == 0, err
    assert "evaluating the export of the verl checkpoint" in err


def test_verl_run_resumes_from_its_checkpoint(verl_run):
    """Runs last in this module: it extends the shared run by one step."""
    from stare_cli.cli import main

    assert main(["train", "--resume", str(verl_run), "-o", "optim.total_steps=3"]) == 0
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]
    # the controller continued from global_step_2's state: 3 steps seen, gate on in all of them
    state = json.loads((verl_run / "checkpoints" / "global_step_3" / "stare_controller.json").read_text())
    assert state["steps"] == state["steps_on"] == 3
    history = [json.loads(x) for x in (verl_run / "config-history.jsonl").read_text().splitlines()]
    assert [(h["event"], h["step"]) for h in history] == [("start", 0), ("resume", 2)]
    assert history[-1]["changed"] == {"optim.total_steps": [2, 3]} and history[-1]["verl_overrides"]
    log = (verl_run / "verl.log").read_text()
    assert "global_step_2" in log and "step:3" in log
