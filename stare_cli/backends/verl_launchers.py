"""Job scripts for a verl run on a cluster, as verl users launch them (`stare train --backend verl
--emit-script FILE --launcher ray|slurm|skypilot`).

One code path writes all three. Every launcher ends in the same `ray job submit` command
(`submit_command`): the runtime environment names our modules, our packages travel with the job,
and every path is absolute under the shared directory (verl_backend.run). What differs is how the
Ray cluster comes to exist:
- `ray`: it already runs. Submit from a machine that reaches its head: `RAY_ADDRESS=http://<head>:8265 bash job.sh`.
- `slurm`: an sbatch script. It starts the Ray head on the first allocated node and a worker on each
  of the others (`srun --nodes=1 --ntasks=1 -w NODE ray start ... --block &`), waits until every node
  has joined, then submits. The layout follows verl's multinode guide (docs/start/multinode.rst).
- `skypilot`: a SkyPilot task YAML. Node 0 starts the head and the others join, using SkyPilot's
  node variables (SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES); node 0 then submits.
  Launch it with `sky launch -c NAME job.yaml`.

NCCL and Gloo bind to the network interface given with `--network-interface` (NCCL_SOCKET_IFNAME,
GLOO_SOCKET_IFNAME, the variables verl's guide names). A wrong interface is the most common
multi-node failure in verl's issue tracker. NCCL_DEBUG=WARN is set, and a longer NCCL timeout can
be set through the recipe's `backend.verl.extra_overrides`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from stare_cli.core.config import Recipe

Launcher = Literal["ray", "slurm", "skypilot"]
RAY_PORT, DASHBOARD_PORT = 6379, 8265


@dataclass(frozen=True)
class LaunchSpec:
    """How the job script starts the cluster: the launcher, and what SLURM or SkyPilot need."""

    launcher: Launcher = "ray"
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None  # SLURM time limit, e.g. 24:00:00
    network_interface: Optional[str] = None  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    accelerator: str = "H100"  # SkyPilot: the GPU type (SkyPilot's accelerator names)


def submit_command(runtime_env: dict, command: list[str]) -> str:
    """The one `ray job submit` line every launcher runs (RAY_ADDRESS set beforehand)."""
    cmd = " \\\n    ".join(shlex.quote(x) for x in command)
    return f"ray job submit --runtime-env-json={shlex.quote(json.dumps(runtime_env))} -- \\\n    {cmd}"


def _network_env(spec: LaunchSpec) -> dict[str, str]:
    env = {"NCCL_DEBUG": "WARN"}
    if spec.network_interface:
        env.update({"NCCL_SOCKET_IFNAME": spec.network_interface, "GLOO_SOCKET_IFNAME": spec.network_interface})
    return env


def _resources(cfg: Recipe) -> tuple[int, int, int]:
    """(nodes, GPUs per node, CPUs per node) the cluster is started with (the CPU debug path: one
    "GPU" slot and 16 CPUs per node, see verl_cpu.py)."""
    V = cfg.backend.verl
    if V.device == "cpu":
        return V.nnodes, 1, 16
    return V.nnodes, V.n_gpus_per_node, 8 * V.n_gpus_per_node


def _header(cfg: Recipe, run_dir: Path, how: str) -> list[str]:
    return [f"# stare: {cfg.name} with {cfg.method.name} on verl ({how}).",
            f"# The run directory is {run_dir} (on the shared filesystem every node mounts).",
            "# Every node needs the dependencies (pip install -e '.[verl]' in a stare checkout); the project's own "
            "code travels with the job."]


def ray_script(cfg: Recipe, run_dir: Path, submit: str, spec: LaunchSpec) -> str:
    how = ("the CPU debug path: a Ray cluster started with --num-gpus 1 --num-cpus 16" if cfg.backend.verl.device == "cpu"
           else f"{cfg.backend.verl.nnodes} node(s) x {cfg.backend.verl.n_gpus_per_node} GPUs")
    lines = ["#!/usr/bin/env bash", *_header(cfg, run_dir, how),
             "# Submit from a machine that reaches the Ray head:", "#   RAY_ADDRESS=http://<head>:8265 bash this_script.sh",
             "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in _network_env(spec).items() if k != "NCCL_DEBUG"]
    return "\n".join(lines + [submit, ""])


PORTS = [f'ray_port="${{STARE_RAY_PORT:-{RAY_PORT}}}"', f'dash_port="${{STARE_RAY_DASHBOARD_PORT:-{DASHBOARD_PORT}}}"']


def _start_node(head: bool, gpus: int, cpus: int, ip: str, block: bool = True) -> str:
    """`ray start` for the head (its IP, ports) or a worker (the head's address); `block`: stay in the
    foreground (a SLURM job step), else return once the node runs (SkyPilot)."""
    tail = " --block" if block else ""
    if head:
        return (f'ray start --head --node-ip-address={ip} --port="$ray_port" --include-dashboard=true '
                f'--dashboard-host=0.0.0.0 --dashboard-port="$dash_port" --num-gpus={gpus} --num-cpus={cpus} '
                f"--disable-usage-stats{tail}")
    return f'ray start --address={ip}:"$ray_port" --num-gpus={gpus} --num-cpus={cpus}{tail}'


def _wait_for_nodes(n: str, ip: str) -> list[str]:
    """Shell lines that wait (up to 10 minutes) until n nodes are alive in the cluster at ip."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(sum(x['Alive'] for x in ray.nodes()))")
    return ["for _ in $(seq 1 120); do",
            f"  alive=$(python3 -c {shlex.quote(probe)} \"{ip}:$ray_port\" 2>/dev/null || echo 0)",
            f"  [ \"$alive\" -ge \"{n}\" ] && break",
            "  sleep 5",
            "done",
            f"[ \"$alive\" -ge \"{n}\" ] || {{ echo \"only $alive of {n} Ray nodes joined\" >&2; exit 1; }}"]


def slurm_script(cfg: Recipe, run_dir: Path, submit: str, spec: LaunchSpec) -> str:
    nodes, gpus, cpus = _resources(cfg)
    sb = ["#!/usr/bin/env bash", f"#SBATCH --job-name=stare-{cfg.method.name}", f"#SBATCH --nodes={nodes}",
          "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={cpus}"]
    if cfg.backend.verl.device != "cpu":
        sb.append(f"#SBATCH --gpus-per-node={gpus}")
    sb += [f"#SBATCH --{k}={v}" for k, v in (("partition", spec.partition), ("account", spec.account),
                                             ("time", spec.time)) if v]
    sb.append(f"#SBATCH --output={run_dir}/slurm-%j.out")
    lines = sb + _header(cfg, run_dir, f"SLURM: Ray head on the first node, workers on the others; {nodes} node(s) "
                         f"x {gpus} GPU slot(s)") + ["# Submit: sbatch this_script.sh", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in _network_env(spec).items()]
    lines += [*PORTS, 'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              'head="${nodes[0]}"',
              'head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk \'{print $1}\')',
              # the nodes' Ray processes log into the run directory (and keep no pipe of this script open)
              f'srun --nodes=1 --ntasks=1 -w "$head" {_start_node(True, gpus, cpus, "$head_ip")} '
              f'> {shlex.quote(str(run_dir))}/ray-head.log 2>&1 &',
              *_wait_for_nodes("1", "$head_ip"),
              'for node in "${nodes[@]:1}"; do',
              f'  srun --nodes=1 --ntasks=1 -w "$node" {_start_node(False, gpus, cpus, "$head_ip")} '
              f'> {shlex.quote(str(run_dir))}/ray-worker-"$node".log 2>&1 &',
              "done",
              *_wait_for_nodes("${#nodes[@]}", "$head_ip"),
              'export RAY_ADDRESS="http://$head_ip:$dash_port"',
              submit, ""]
    return "\n".join(lines)


def skypilot_task(cfg: Recipe, run_dir: Path, submit: str, spec: LaunchSpec) -> str:
    import yaml

    nodes, gpus, cpus = _resources(cfg)
    head_ip = '$(echo "$SKYPILOT_NODE_IPS" | head -n1)'
    run = "\n".join([
        "set -euo pipefail",
        *PORTS,
        f'head_ip={head_ip}',
        'if [ "$SKYPILOT_NODE_RANK" = "0" ]; then',
        f'  {_start_node(True, gpus, cpus, "$head_ip", block=False)}',
        *["  " + x for x in _wait_for_nodes("$SKYPILOT_NUM_NODES", "$head_ip")],
        '  export RAY_ADDRESS="http://$head_ip:$dash_port"',
        "  " + submit.replace("\n", "\n  "),
        "else",
        "  sleep 10",
        f'  {_start_node(False, gpus, cpus, "$head_ip", block=False)}',
        "fi",
    ])
    task = {
        "name": f"stare-{cfg.method.name}",
        "num_nodes": nodes,
        "resources": ({"cpus": f"{cpus}+"} if cfg.backend.verl.device == "cpu"
                      else {"accelerators": f"{spec.accelerator}:{gpus}"}),
        "envs": _network_env(spec),
        "setup": "# the nodes need stare's dependencies and the shared filesystem mounted at the same path:\n"
                 f"# {run_dir.parent.parent} (run directories, data, checkpoints)\n"
                 "pip install -e '.[verl]'",
        "run": run,
    }
    head = "\n".join("# " + x.lstrip("# ") for x in _header(
        cfg, run_dir, f"SkyPilot: {nodes} node(s) x {spec.accelerator}:{gpus}")) + "\n# Launch: sky launch -c stare job.yaml\n"
    return head + yaml.safe_dump(task, sort_keys=False, width=1000)


WRITERS = {"ray": ray_script, "slurm": slurm_script, "skypilot": skypilot_task}


def job_script(cfg: Recipe, run_dir: Path, runtime_env: dict, command: list[str], spec: LaunchSpec) -> str:
    """The job script of `spec.launcher` (module docstring)."""
    return WRITERS[spec.launcher](cfg, run_dir, submit_command(runtime_env, command), spec)
