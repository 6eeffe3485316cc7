"""The prepared device check (benchmarks/gpu/check.py, issue 70) cannot rot before a GPU appears: its CPU
form runs here end to end, and the GPU-only branches are reached with what can be faked (a device without
CUDA, a refusal, a failing part, the deadline), without asserting any GPU number."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import check

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_cpu_check_passes_and_writes_a_small_flat_report(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.check", "--device", "cpu", "--quick", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    parts = {p["name"]: p for p in doc["parts"]}
    assert list(parts) == list(check.PARTS)
    assert all(p["ok"] is True for p in parts.values()), {n: p["summary"] for n, p in parts.items()}
    # what each part measured is there, by name
    assert parts["environment"]["data"]["stare_host_path"] in ("C", "NumPy")
    assert parts["selection"]["data"]["mismatches"] == [] and parts["selection"]["data"]["selected"] > 0
    rows = parts["lm_head"]["data"]["rows"]
    assert {(x["compute"], x["quantity"]) for x in rows} == {(c, q) for c in ("fp32", "bf16")
                                                            for q in ("log_prob", "entropy", "dL/dh", "dL/dW")}
    runs = parts["toy"]["data"]["runs"]
    assert {(x["method"], x["precision"]) for x in runs} == {(m, p) for m in ("grpo-ds", "stare-o1")
                                                              for p in ("fp32", "bf16", "fp16")}
    fp16 = [x for x in runs if x["precision"] == "fp16"]
    assert all(x.get("refused") and x["expected"] for x in fp16)  # fp16 needs CUDA: refused by name on the CPU
    assert all(not x["non_finite"] and x["steps"] == 2 for x in runs if "refused" not in x)
    steps = parts["real_shapes"]["data"]["steps"]
    assert [s["activation_checkpointing"] for s in steps] == [False, True] and all(s["finite"] for s in steps)
    assert parts["real_shapes"]["data"]["generation"][0]["tokens_per_s"] > 0
    # one folder, a few KiB (the issue: under 16 MiB, no deeper than two folders)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {"report.json", "report.md"}
    assert sum(p.stat().st_size for p in files) < 16 * 2**20
    md = (out / "report.md").read_text()
    assert "| selection | pass |" in md and "| lm_head | pass |" in md and "refused (expected)" in md


def test_cuda_asked_without_a_cuda_device_fails_that_part_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    part = check.part_environment(check.Settings.for_run("cuda", quick=True))
    assert part.ok is False and "no CUDA device" in part.summary


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path):
    s = check.Settings.for_run("cpu", quick=True)
    order = []

    def boom():
        order.append("selection")
        raise RuntimeError("CUDA error: an illegal memory access\nsecond line")

    def fine():
        order.append("lm_head")
        return check.Part("lm_head", True, 0.0, "fine")

    parts = check.run_parts(s, tmp_path, ("selection", "lm_head"), budget_s=600,
                            runners={"selection": boom, "lm_head": fine})
    assert order == ["selection", "lm_head"]
    assert [p.ok for p in parts] == [False, True]
    assert parts[0].summary == "RuntimeError: CUDA error: an illegal memory access" and "Traceback" in parts[0].error
    doc = json.loads((tmp_path / "report.json").read_text())
    assert [p["ok"] for p in doc["parts"]] == [False, True]
    assert check.main(["--device", "cpu", "--parts", "selection,nonsense", "--out", str(tmp_path)]) == 2


def test_parts_not_begun_by_the_deadline_are_skipped_and_reported(tmp_path):
    s = check.Settings.for_run("cpu", quick=True)

    def slow():
        time.sleep(0.05)
        return check.Part("selection", True, 0.0, "ok")

    parts = check.run_parts(s, tmp_path, ("selection", "lm_head"), budget_s=0.01,
                            runners={"selection": slow, "lm_head": slow})
    assert [p.ok for p in parts] == [True, None] and "budget" in parts[1].summary
    assert "| lm_head | skipped |" in (tmp_path / "report.md").read_text()


def test_toy_part_counts_refusals_and_non_finite_metrics_on_a_gpu_device(monkeypatch):
    """The GPU mode's toy bookkeeping, with the trainer faked: on a CUDA device an fp16 refusal is a
    failure (it is expected on the CPU only), and a NaN in any logged metric fails the part by name."""
    def fake(method, device, precision, steps, out, extra=()):
        if device == "cuda" and precision == "fp16":
            return {"refused": "optim.precision fp16 needs a CUDA device"}
        rows = [{"step": k + 1, "entropy": 0.5 - 0.01 * k, "stare/gate": k > 0, "actor/scaler_skipped": 1 if precision == "fp16" else 0,
                 "loss": float("nan") if (precision == "bf16" and k == 1) else 0.1} for k in range(steps)]
        return {"rows": rows}

    monkeypatch.setattr(check, "_train_toy", fake)
    part = check.part_toy(check.Settings.for_run("cuda", quick=True))
    assert part.ok is False
    assert "grpo-ds fp16: refused" in part.summary and "grpo-ds bf16: non-finite loss" in part.summary
    cpu_rows = [r for r in part.data["runs"] if r["device"] == "cpu"]
    assert len(cpu_rows) == 2 and all(r["gate_on_steps"] == 1 for r in cpu_rows)  # steps 2 of 2 had the gate on


def test_toy_summary_arithmetic():
    # 6 steps: k = min(5, 6 // 3) = 2; first (0.6 + 0.5) / 2 = 0.55, last (0.2 + 0.1) / 2 = 0.15
    rows = [{"entropy": e, "stare/gate": e < 0.35, "actor/scaler_skipped": 1} for e in (0.6, 0.5, 0.4, 0.3, 0.2, 0.1)]
    s = check._toy_summary(rows)
    assert math.isclose(s["entropy_first"], 0.55) and math.isclose(s["entropy_last"], 0.15)
    assert s["gate_on_steps"] == 3 and s["scaler_skipped"] == 6 and s["non_finite"] == []


@pytest.mark.parametrize("name,params", [
    ("qwen2.5-1.5b", 1_777_088_000),  # DeepSeek-R1-Distill-Qwen-1.5B's published parameter count (untied head)
    ("qwen2.5-7b", 7_615_616_512),    # Qwen2.5(-Math)-7B's
])
def test_the_real_shape_configs_are_the_recipes_models(name, params):
    """The configs written in the repo build the recipes' models (on the meta device: no memory): their
    parameter counts are the published ones, so the check's peaks and plans are at the real shapes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(check.model_config(name))
    assert sum(p.numel() for p in m.parameters()) == params
    assert m.config.vocab_size in (151936, 152064)


def test_scaler_step_reports_a_skipped_fp16_step():
    """embedded.scaler_step (the trainer's fp16 step; the check sums actor/scaler_skipped): a finite gradient
    steps (0), an inf gradient is skipped (1) and leaves the weights as they were."""
    from stare_cli.backends.embedded import scaler_step

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(m(torch.ones(1, 2)).sum()).backward()
    assert scaler_step(scaler, opt) == 0
    opt.zero_grad()
    scaler.scale(m(torch.ones(1, 2)).sum()).backward()
    m.weight.grad[0, 0] = float("inf")
    before = m.weight.detach().clone()
    assert scaler_step(scaler, opt) == 1 and torch.equal(before, m.weight) and scaler.get_scale() == 512.0


@pytest.mark.parametrize("path", ["device", "numpy"])
def test_forced_selection_paths_restore_the_module(path):
    from baselines import stare

    saved = stare._on_host, stare._kernel
    with check._stare_path(path):
        assert (stare._on_host, stare._kernel) != saved or (path == "numpy" and saved[1] is None)
    assert (stare._on_host, stare._kernel) == saved


def test_the_real_shape_step_compares_a_device_peak_with_the_plan(monkeypatch, tmp_path):
    """The CUDA branch of the real-shape step, its device peak faked (3 GiB): the step runs the trainer's
    steps 4-6 on the tiny config, and the plan error is (plan / peak - 1), written into both reports."""
    s = check.Settings.for_run("cpu", quick=True)
    monkeypatch.setattr(check, "peak_bytes", lambda device: 3 * 2**30)
    r = check.training_step("tiny", s, False, tmp_path)
    assert r["peak_gib"] == 3.0 and r["plan_error"] == round(r["planned_gib"] / 3.0 - 1, 3)
    assert r["finite"] and r["micro_batches"] == 16 and r["rows"] == 16  # one row per emulated official rank
    part = check.Part("real_shapes", True, 0.0, "x", data={"steps": [r], "generation": []})
    check.write_report(tmp_path / "rep", [part], s, "now")
    assert f"peak 3.0 GiB, plan {r['planned_gib']} GiB" in (tmp_path / "rep" / "report.md").read_text()
