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


STAND_INS = {
    # srun: drop its options, run the command here (every "node" is this machine)
    "srun": '#!/usr/bin/env bash\nwhile [[ "${1:-}" == -* ]]; do case "$1" in -w|--nodelist) shift 2;; *) shift;; esac; done\n'
            'exec "$@"\n',
    # scontrol show hostnames: two nodes
    "scontrol": '#!/usr/bin/env bash\nprintf "node0\\nnode1\\n"\n',
}


@pytest.fixture
def slurm_env(tmp_path):
    """Stand-ins for SLURM's srun and scontrol on PATH, Ray's state in a short temporary folder, free
    ports; Ray stopped afterwards (the script leaves the head and the worker running, as a real
    allocation would until it ends)."""
    bin_dir = Path(sys.executable).parent
    fake = tmp_path / "fake-slurm"
    fake.mkdir()
    for name, body in STAND_INS.items():
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "PATH": f"{fake}:{bin_dir}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "RAY_TMPDIR": temp, "SLURM_JOB_NODELIST": "node[0-1]",
           "STARE_RAY_PORT": str(_free_port()), "STARE_RAY_DASHBOARD_PORT": str(_free_port())}
    try:
        yield env
    finally:
        subprocess.run([str(bin_dir / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def _emit(cli, shared: Path, quick_toy, launcher: str, *extra: str, method: str = "stare-o1") -> tuple[Path, Path]:
    script = shared / f"job-{launcher}.sh"
    args = ["train", "-r", "tiny/arith", "-m", method, "--backend", "verl", "--device", "cpu",
            "--shared-dir", str(shared), "--emit-script", str(script), "--launcher", launcher,
            "-o", f"model.path={quick_toy}", *extra]
    for o in SMALL:
        args += ["-o", o]
    code, out, err = cli(*args)
    assert code == 0, err
    return Path(out.strip().splitlines()[-1]), script


def test_the_slurm_script_starts_ray_on_its_nodes_and_runs_the_job(cli, tmp_path, quick_toy, slurm_env):
    """The SLURM launcher's script, run with stand-ins for srun and scontrol: it starts the Ray head
    and one worker (two "nodes", both here), waits for both, and submits the 2-step CPU toy job with
    the same `ray job submit` line every launcher writes; the job leaves its metrics and checkpoint in
    the shared directory. The job trains RSI-S (issue 71), so that its run on verl's real trainer is in
    CI without a verl run of its own (each costs about 2 minutes; STARE-O1's run through verl, its
    controller saved and restored, is tests/test_verl_cpu.py's): the layer's kept-token mask becomes
    verl's loss mask inside the job, with the tiny recipe's interval [0.5, 2]."""
    shared = tmp_path / "shared"
    code, _, err = cli("data", "prepare", "-r", "tiny/arith", "--out", str(shared / "data" / "tiny-arith"),
                       "--limit", "64", "-o", "eval.limit=8")
    assert code == 0, err
    run, script = _emit(cli, shared, quick_toy, "slurm", "--network-interface", "lo", method="rsi-s")
    assert run.parent == shared / "runs" and (run / "meta.json").exists()
    text = script.read_text()
    assert "#SBATCH --nodes=1" in text and "export NCCL_SOCKET_IFNAME=lo" in text and "GLOO_SOCKET_IFNAME=lo" in text
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
    p = subprocess.run(["bash", str(script)], cwd=elsewhere, env=slurm_env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # RSI-S acted in the job: some tokens kept, some dropped, and the shares add up
        assert "acc" in r and "stare/gate" not in r
        assert 0 < r["rsi/kept"] < 1 and 0 < r["rsi/dropped"] < 1
        assert r["rsi/kept"] + r["rsi/dropped"] == pytest.approx(1.0, abs=1e-6)
    assert (run / "checkpoints" / "global_step_2").is_dir()
    assert (run / "hydra").is_dir() and not (elsewhere / "outputs").exists()
    # both nodes joined the cluster the job ran on
    probe = "import ray; ray.init(address='127.0.0.1:' + __import__('os').environ['STARE_RAY_PORT']); " \
            "print(sum(n['Alive'] for n in ray.nodes()))"
    alive = subprocess.run([sys.executable, "-c", probe], env=slurm_env, capture_output=True, text=True, timeout=120)
    assert alive.stdout.strip().splitlines()[-1] == "2", alive.stderr[-2000:]


def test_the_three_launchers_are_written_by_one_code_path(cli, tmp_path, quick_toy):
    """ray, slurm and skypilot: the same `ray job submit` line; bash parses the scripts; the SkyPilot
    task loads as YAML with the recipe's nodes and GPUs, and its run section parses as bash."""
    import yaml

    shared = tmp_path / "shared"
    data = shared / "data" / "short-cot-qwen2.5-math-7b"
    data.mkdir(parents=True)
    (data / "train.parquet").touch()  # checked for, not read, when a script is written
    submits = {}
    for launcher in ("ray", "slurm", "skypilot"):
        script = tmp_path / f"job-{launcher}"
        code, out, err = cli("train", "-r", "short-cot/qwen2.5-math-7b", "-m", "stare-o1", "--backend", "verl",
                             "--shared-dir", str(shared), "--emit-script", str(script), "--launcher", launcher,
                             "--partition", "gpu", "--account", "lab", "--time", "48:00:00",
                             "--network-interface", "ib0", "--accelerator", "A100-80GB")
        assert code == 0, err
        text = script.read_text()
        if launcher == "skypilot":
            task = yaml.safe_load(text)
            assert task["num_nodes"] == 1 and task["resources"] == {"accelerators": "A100-80GB:8"}
            assert task["envs"]["NCCL_SOCKET_IFNAME"] == task["envs"]["GLOO_SOCKET_IFNAME"] == "ib0"
            assert "SKYPILOT_NODE_RANK" in task["run"] and "SKYPILOT_NODE_IPS" in task["run"]
            body = task["run"]
        else:
            body = text
        check = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        run = out.strip().splitlines()[-1]  # each script is a run of its own: its directory differs
        submits[launcher] = ("ray job submit" + body.split("ray job submit", 1)[1].split("\n\n")[0]).replace(run, "RUN")
        submits[launcher] = submits[launcher].replace(Path(run).name, "RUN")
    slurm = (tmp_path / "job-slurm").read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
                 "#SBATCH --time=48:00:00", "export NCCL_SOCKET_IFNAME=ib0"):
        assert line in slurm, line
    # one code path: the submit command is the same in all three (indentation aside)
    norm = {k: " ".join(v.split()) for k, v in submits.items()}
    assert norm["ray"] in norm["slurm"] and norm["ray"] in norm["skypilot"]
    code, out, err = cli("train", "-r", "short-cot/qwen2.5-math-7b", "-m", "stare-o1", "--backend", "verl",
                         "--launcher", "slurm")
    assert code == 2 and "--launcher slurm writes a job script" in err


def test_emit_script_needs_a_shared_directory(cli, tmp_path):
    code, _, err = cli("train", "-r", "tiny/arith", "-m", "stare-o1", "--backend", "verl", "--device", "cpu",
                       "--emit-script", str(tmp_path / "job.sh"), "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global")
    assert code == 1 and "--emit-script needs a directory every node of the cluster sees" in err
    code, _, err = cli("train", "-r", "tiny/arith", "-m", "stare-o1", "--backend", "verl",
                       "-o", "backend.verl.shared_dir=relative/path", "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global", "--dry-run")
    assert code == 1 and "backend.verl.shared_dir" in err and "absolute" in err


def test_a_worker_killed_by_rays_memory_monitor_is_said_plainly(cli, tmp_path, quick_toy, monkeypatch):
    """Issue 68: on a busy machine Ray's memory monitor killed verl's actors and the run ended with an exit code
    and a dump; the error now says that the machine ran low on memory, and what to do."""
    import subprocess as sp

    from stare_cli.backends import verl_backend

    line = ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory. "
            "Memory on the node (IP: 127.0.0.1) was 22.1GB / 23.2GB (0.95), which exceeds the memory usage threshold")
    assert verl_backend.ray_killed_for_memory(line) and not verl_backend.ray_killed_for_memory("step:1 - loss: 0.1")
    real = sp.Popen

    class FakeVerl(real):  # verl's process as Ray ends it: its OOM line, exit 1 (any other process: real)
        def __init__(self, args, *a, **kw):
            if "verl.trainer.main_ppo" in list(args):
                args = [sys.executable, "-c", f"print({line!r}); raise SystemExit(1)"]
            super().__init__(args, *a, **kw)

    data = tmp_path / "data"
    assert cli("data", "prepare", "-r", "tiny/arith", "--out", str(data), "--limit", "16", "-o", "eval.limit=8")[0] == 0
    monkeypatch.setattr(sp, "Popen", FakeVerl)
    args = ["train", "-r", "tiny/arith", "-m", "stare-o1", "--backend", "verl", "--device", "cpu",
            "--data-dir", str(data), "--out", str(tmp_path / "runs"), "-o", f"model.path={quick_toy}"]
    for o in SMALL:
        args += ["-o", o]
    code, _, err = cli(*args)
    assert code == 1
    (msg,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Ray's memory monitor killed a worker, the machine ran low on memory" in msg and "--resume" in msg, msg
