"""`stare train --backend verl --emit-script` produces a job that runs on a Ray cluster: a local Ray head
(127.0.0.1, its own temporary directory), the emitted script submitted with `ray job submit` from a
different working directory, the 2-step CPU toy run completing with its metrics and checkpoint in
the shared directory. Every path in the job is absolute under the shared directory; the reward manager
and extension are loaded by package; the project's code travels with the job (py_modules)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)  # a Ray cluster and a 2-step verl job: ~2 min here

SMALL = ["rollout.n=4", "rollout.gen_batch_size=4", "optim.train_batch_size=4", "optim.mini_batch_size=4",
         "optim.micro_batch_size=16", "optim.total_steps=2", "eval.limit=8", "eval.n=2", "eval.every=2",
         "checkpoint.every=2", "rollout.refill=per_group", "method.stare.h_tgt=10"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A local Ray head with one "GPU" slot (the CPU platform's, see verl_cpu.py) and 16 CPUs."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    port, dash = _free_port(), _free_port()
    subprocess.run([str(bin_dir / "ray"), "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
                    f"--temp-dir={temp}", "--num-cpus=16", "--num-gpus=1", "--disable-usage-stats",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1"], env=env, check=True,
                   capture_output=True, timeout=120)
    try:
        yield {**env, "RAY_ADDRESS": f"http://127.0.0.1:{dash}"}
    finally:
        subprocess.run([str(bin_dir / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_emitted_job_runs_on_a_ray_cluster(cli, tmp_path, quick_toy, ray_head):
    shared = tmp_path / "shared"
    code, _, err = cli("data", "prepare", "-r", "tiny/arith", "--out", str(shared / "data" / "tiny-arith"),
                       "--limit", "64", "-o", "eval.limit=8")
    assert code == 0, err
    script = shared / "job.sh"
    args = ["train", "-r", "tiny/arith", "-m", "stare-o1", "--backend", "verl", "--device", "cpu",
            "--shared-dir", str(shared), "--emit-script", str(script), "-o", f"model.path={quick_toy}"]
    for o in SMALL:
        args += ["-o", o]
    code, out, err = cli(*args)
    assert code == 0, err
    run = Path(out.strip().splitlines()[-1])
    assert run.parent == shared / "runs" and (run / "meta.json").exists()
    text = script.read_text()
    overrides = json.loads((run / "meta.json").read_text())["overrides"]
    for o in overrides:  # every path the job uses is absolute and under the shared directory
        key, _, value = o.partition("=")
        if key.endswith(("_files", "_dir", ".dir", "tool_config_path")):
            assert value.strip("'[]").startswith(str(shared)), o
    assert "reward.reward_manager.module.path='pkg://stare_cli.backends.verl_reward'" in overrides
    env = json.loads(text.split("--runtime-env-json=")[1].split(" -- ")[0].strip("'"))
    assert {Path(p).name for p in env["py_modules"]} == {"stare_cli", "baselines", "benchmarks", "recipes"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = subprocess.run(["bash", str(script)], cwd=elsewhere, env=ray_head, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["stare/gate"] == 1.0 and "acc" in r for r in train)
    assert (run / "checkpoints" / "global_step_2" / "stare_controller.json").exists()
    assert (run / "hydra").is_dir() and not (elsewhere / "outputs").exists()


def test_emit_script_needs_a_shared_directory(cli, tmp_path):
    code, _, err = cli("train", "-r", "tiny/arith", "-m", "stare-o1", "--backend", "verl", "--device", "cpu",
                       "--emit-script", str(tmp_path / "job.sh"), "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global")
    assert code == 1 and "--emit-script needs a directory every node of the cluster sees" in err
    code, _, err = cli("train", "-r", "tiny/arith", "-m", "stare-o1", "--backend", "verl",
                       "-o", "backend.verl.shared_dir=relative/path", "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global", "--dry-run")
    assert code == 1 and "backend.verl.shared_dir" in err and "absolute" in err
