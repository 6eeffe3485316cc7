"""The verl backend: a resolved recipe becomes verl 0.9.x configuration (Hydra overrides of
verl's `ppo_trainer`), launched locally or written as a `ray job submit` script.

Methods use verl's own machinery where verl has it (GRPO advantage, clip-higher, dual-clip,
filter_groups dynamic sampling, Clip-Cov, KL-Cov, GSPO, entropy_coeff, DAPO's overlong reward) and
our code where it does not: STARE, 80/20, EntroAdv and W-REINFORCE run as advantage transforms in
verl's driver (see `verl_ext.py`, imported in every verl process through VERL_USE_EXTERNAL_MODULES),
using the old-log-prob pass's log-probs and token entropies. Rewards come from our grader
(`verl_reward.py`), so verdicts equal `stare eval`'s.

`backend.verl.device: cpu` (`stare train --device cpu`) runs verl's real trainer on CPU through the
project's support module `verl_cpu.py` (CPU platform, gloo, FSDP2 on CPU, an HF-generate rollout
server in place of vLLM); a CI test trains 2 steps that way with STARE active. What that does not
exercise (vLLM, NCCL, multi-GPU sharding, flash-attention) is listed in `verl_cpu.py`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

from stare_cli.config import Recipe

EXT_MODULE = "stare_cli.backends.verl_ext"
LOSS_MODE = {"ppo_clip": "vanilla", "gspo": "gspo", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}


def method_payload(cfg: Recipe) -> dict:
    """What our verl extension needs at run time (passed as STARE_VERL_METHOD, JSON)."""
    from baselines.registry import check_method

    spec = check_method(cfg.method.name)
    m = cfg.method
    if spec.stare and m.stare.scope != "batch":
        from stare_cli.errors import StareError

        raise StareError(f"method.stare.scope={m.stare.scope}: the verl backend selects L+/L- over the whole batch",
                         hint="use method.stare.scope=batch, or the embedded backend for per-micro-batch selection")
    return {
        "method": spec.name, "stare": spec.stare, "stare_cfg": m.stare.model_dump(), "top_entropy": spec.top_entropy,
        "top_entropy_frac": m.top_entropy_frac, "entro_adv": spec.entro_adv, "entro_adv_cfg": m.entro_adv.model_dump(),
        "w_reinforce": spec.advantage == "w_reinforce", "w_reinforce_lambda": m.w_reinforce_lambda,
    }


def verl_overrides(cfg: Recipe, run_dir: Optional[Path] = None, data_dir: Optional[Path] = None) -> list[str]:
    """Hydra overrides of verl's ppo_trainer for this recipe and method (no `+` keys needed)."""
    from baselines.registry import check_method

    spec = check_method(cfg.method.name)
    m, R, O, V = cfg.method, cfg.rollout, cfg.optim, cfg.backend.verl
    data_dir = data_dir or Path("data") / cfg.name.replace("/", "-")
    run_dir = run_dir or Path("runs") / "verl"
    n_gpus = V.n_gpus_per_node * V.nnodes
    micro_per_gpu = max(1, O.micro_batch_size // max(1, n_gpus)) if O.micro_batch_size >= n_gpus else 1
    ov = {
        # algorithm
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": m.adv_estimator == "grpo",
        "algorithm.use_kl_in_reward": False,
        "algorithm.filter_groups.enable": m.dynamic_sampling,
        "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_num_gen_batches": R.max_gen_batches if m.dynamic_sampling else 0,
        # data
        "data.train_files": str(data_dir / "train.parquet"),
        "data.val_files": "[" + ",".join(str(data_dir / bench_file(b)) for b in cfg.eval.benchmarks) + "]"
        if cfg.eval.benchmarks else str(data_dir / "train.parquet"),
        "data.prompt_key": "prompt",
        "data.max_prompt_length": R.max_prompt_tokens,
        "data.max_response_length": R.max_response_tokens,
        "data.train_batch_size": O.train_batch_size,
        "data.gen_batch_size": R.gen_batch_size if m.dynamic_sampling else O.train_batch_size,
        "data.truncation": "left",
        "data.filter_overlong_prompts": True,
        "data.seed": O.seed,
        # model
        "actor_rollout_ref.model.path": cfg.model.path,
        "actor_rollout_ref.model.trust_remote_code": cfg.model.trust_remote_code,
        "actor_rollout_ref.model.external_lib": EXT_MODULE,
        # actor
        "actor_rollout_ref.actor.optim.lr": O.lr,
        "actor_rollout_ref.actor.optim.weight_decay": O.weight_decay,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": O.warmup_steps if O.warmup_steps else -1,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": O.schedule if O.schedule != "linear" else "constant",
        "actor_rollout_ref.actor.grad_clip": O.grad_clip,
        "actor_rollout_ref.actor.ppo_mini_batch_size": O.mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro_per_gpu,
        "actor_rollout_ref.actor.ppo_epochs": O.ppo_epochs,
        "actor_rollout_ref.actor.clip_ratio_low": m.clip_low,
        "actor_rollout_ref.actor.clip_ratio_high": m.clip_high,
        "actor_rollout_ref.actor.clip_ratio_c": m.dual_clip if m.dual_clip is not None else 1e9,
        "actor_rollout_ref.actor.loss_agg_mode": m.loss_agg,
        "actor_rollout_ref.actor.entropy_coeff": m.entropy_coef,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.policy_loss.loss_mode": LOSS_MODE[spec.loss],
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": m.clip_cov.ratio,
        "actor_rollout_ref.actor.policy_loss.clip_cov_lb": m.clip_cov.cov_lb,
        "actor_rollout_ref.actor.policy_loss.clip_cov_ub": m.clip_cov.cov_ub,
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": m.kl_cov.ratio,
        "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": m.kl_cov.coef,
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16" if O.precision != "fp32" else "fp32",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": micro_per_gpu,
        # rollout
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": R.n,
        "actor_rollout_ref.rollout.temperature": R.temperature,
        "actor_rollout_ref.rollout.top_p": R.top_p,
        "actor_rollout_ref.rollout.top_k": R.top_k,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": V.tensor_parallel_size,
        "actor_rollout_ref.rollout.gpu_memory_utilization": V.gpu_memory_utilization,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro_per_gpu,
        "actor_rollout_ref.rollout.val_kwargs.temperature": cfg.eval.temperature,
        "actor_rollout_ref.rollout.val_kwargs.top_p": cfg.eval.top_p,
        "actor_rollout_ref.rollout.val_kwargs.n": cfg.eval.n or 32,
        "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
        # reward: our grader (verl's default routes math data to a string matcher)
        "reward.custom_reward_function.path": str(Path(__file__).with_name("verl_reward.py")),
        "reward.custom_reward_function.name": "compute_score",
        "reward.reward_manager.name": "dapo" if m.overlong.enable else "naive",
        # trainer
        "trainer.use_v1": True,  # our driver extension patches the V1 trainer
        "trainer.total_training_steps": O.total_steps,
        "trainer.nnodes": V.nnodes,
        "trainer.n_gpus_per_node": V.n_gpus_per_node,
        "trainer.test_freq": cfg.eval.every or -1,
        "trainer.save_freq": cfg.checkpoint.every or -1,
        "trainer.max_actor_ckpt_to_keep": cfg.checkpoint.keep_last,
        "trainer.project_name": cfg.logging.project,
        "trainer.experiment_name": cfg.logging.run_name or f"{cfg.name.replace('/', '-')}__{m.name}__seed{O.seed}",
        "trainer.default_local_dir": str(run_dir / "checkpoints"),
        "trainer.logger": "[console]" if cfg.logging.wandb == "disabled" else "[console,wandb]",
        "trainer.val_before_train": bool(cfg.eval.benchmarks),
    }
    t = R.tools
    if t.enable:  # verl's multi-turn tool agent with our sandbox (tool config written beside the run)
        ov.update({
            "actor_rollout_ref.rollout.multi_turn.enable": True,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(run_dir / "tools.yaml"),
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": t.max_turns + 1,
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": t.output_bytes,
            "actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent",
        })
    if O.precision == "fp32":  # verl's FSDP otherwise computes in bf16 (its default mixed precision)
        ov["+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] = "fp32"
        ov["actor_rollout_ref.rollout.dtype"] = "float32"
    for item in V.extra_overrides:
        key, _, value = item.partition("=")
        ov[key] = value
    if V.device == "cpu":  # the CPU debug path (verl_cpu.py): its values win over the recipe's
        from stare_cli.backends.verl_cpu import cpu_overrides

        ov.update(cpu_overrides())
    out = [f"{k}={_val(v)}" for k, v in ov.items()]
    if m.overlong.enable:
        out += [
            f"+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            f"+reward.reward_kwargs.overlong_buffer_cfg.len={m.overlong.buffer}",
            f"+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor={m.overlong.factor}",
            "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
            f"+reward.reward_kwargs.max_resp_len={R.max_response_tokens}",
        ]
    return out


def bench_file(bench: str) -> str:
    """Parquet file name of a benchmark (`toy:arith` -> toy-arith.parquet)."""
    return bench.replace(":", "-").replace("/", "-") + ".parquet"


def _val(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def compose(overrides: list[str]):
    """verl's full config from the overrides, offline, then verl's own validate_config."""
    import verl
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl.utils.config import validate_config

    cfg_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        conf = hcompose(config_name="ppo_trainer", overrides=overrides)
    validate_config(conf, use_reference_policy=False, use_critic=False)
    return conf


def launch_command(cfg: Recipe, overrides: list[str]) -> list[str]:
    return ["python3", "-m", "verl.trainer.main_ppo", *overrides]


def environment(cfg: Recipe, run_dir: Path) -> dict[str, str]:
    env = {
        "VERL_USE_EXTERNAL_MODULES": EXT_MODULE,
        "STARE_VERL_METHOD": json.dumps(method_payload(cfg)),
        "STARE_RUN_DIR": str(run_dir),
    }
    if cfg.backend.verl.device == "cpu":
        from stare_cli.backends import verl_cpu

        env.update(verl_cpu.environment())
        env["VERL_USE_EXTERNAL_MODULES"] = f"{verl_cpu.MODULE},{EXT_MODULE}"
    return env


def ray_job_script(cfg: Recipe, overrides: list[str], run_dir: Path) -> str:
    env = environment(cfg, run_dir)
    runtime_env = {"env_vars": env, "working_dir": "."}
    cmd = " \\\n    ".join(shlex.quote(x) for x in launch_command(cfg, overrides))
    return (
        "#!/usr/bin/env bash\n"
        f"# stare: {cfg.name} with {cfg.method.name} on verl ({cfg.backend.verl.nnodes} node(s) x "
        f"{cfg.backend.verl.n_gpus_per_node} GPUs). Submit from a machine that reaches the Ray head:\n"
        "#   RAY_ADDRESS=http://<head>:8265 bash this_script.sh\n"
        "# Every node needs this package installed (pip install 'stare[verl]'), since the method's\n"
        "# extension module is imported in every verl process.\n"
        "set -euo pipefail\n"
        f"ray job submit --runtime-env-json={shlex.quote(json.dumps(runtime_env))} -- \\\n    {cmd}\n"
    )


def prepare_data(cfg: Recipe, out_dir: Path, limit: Optional[int] = None) -> list[Path]:
    """verl's parquet format (chat messages, reward_model.ground_truth, data_source) for the
    training data and the recipe's evaluation benchmarks."""
    import pandas as pd

    from benchmarks.registry import load_benchmark
    from benchmarks.templates import with_instruction
    from stare_cli.backends.embedded import load_prompts

    def frame(rows: list[dict], source: str, split: str) -> "pd.DataFrame":
        recs = []
        for i, r in enumerate(rows[:limit] if limit else rows):
            content = r["problem"] if cfg.data.template.value == "raw" else with_instruction(r["problem"])
            recs.append({
                "data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(r["answer"])},
                "extra_info": {"split": split, "index": i},
            })
        return pd.DataFrame.from_records(recs)

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    p = out_dir / "train.parquet"
    frame(load_prompts(cfg), cfg.data.train, "train").to_parquet(p)
    written.append(p)
    for b in cfg.eval.benchmarks:
        p = out_dir / bench_file(b)
        frame(load_benchmark(b, limit=cfg.eval.limit), b, "test").to_parquet(p)
        written.append(p)
    return written


def resume_point(run_dir: Path) -> tuple[int, Optional[Path]]:
    """(last checkpointed step, the data folder the run used) of a verl run directory."""
    from stare_cli.errors import StareError

    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        raise StareError(f"--resume: '{run_dir}' has no verl checkpoint yet",
                         hint="start a new run (checkpoint.every sets how often verl saves)")
    meta = json.loads((run_dir / "meta.json").read_text())
    train = next((o.split("=", 1)[1] for o in meta.get("overrides", []) if o.startswith("data.train_files=")), None)
    return int(tracker.read_text().strip()), Path(train).parent if train else None


def run(cfg: Recipe, out_root: Path, dry_run: bool = False, emit_script: Optional[Path] = None,
        data_dir: Optional[Path] = None, resume_dir: Optional[Path] = None) -> Optional[Path]:
    """Dry-run (print overrides), write a Ray job script, or launch verl locally. With `resume_dir`,
    verl continues that run from its latest checkpoint (its own resume_mode=auto; our controller
    state comes back with it) and metrics rows after that checkpoint are dropped, to be redone."""
    import os
    import subprocess
    import sys

    from stare_cli.errors import StareError
    from stare_cli.runs import new_run_dir, write_run_meta

    if dry_run:
        for o in verl_overrides(cfg, data_dir=data_dir):
            print(o)
        return None
    if cfg.model.path.startswith("toy:") and not emit_script:  # verl needs a model directory
        from stare_cli.backends.embedded import resolve_model_path

        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"path": resolve_model_path(cfg.model.path)})})
    resumed_at = None
    if resume_dir is not None:
        from stare_cli.runs import atomic_write_text, read_jsonl

        run_dir = Path(resume_dir)
        resumed_at, used_data = resume_point(run_dir)
        data_dir = data_dir or used_data
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) <= resumed_at]
        atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    else:
        run_dir = new_run_dir(cfg, out_root)
    overrides = verl_overrides(cfg, run_dir=run_dir, data_dir=data_dir)
    if cfg.rollout.tools.enable:
        import yaml

        from stare_cli.backends.verl_tools import tool_config

        t = cfg.rollout.tools
        (run_dir / "tools.yaml").write_text(yaml.safe_dump(tool_config(t.cpu_s, t.wall_s, t.memory_mb, t.output_bytes)))
    write_run_meta(run_dir, cfg, {"backend": "verl", "overrides": overrides, "resumed_at_step": resumed_at})
    if emit_script:
        emit_script.write_text(ray_job_script(cfg, overrides, run_dir))
        emit_script.chmod(0o755)
        print(f"wrote {emit_script}", file=sys.stderr)
        return run_dir
    try:
        import verl  # noqa: F401
    except ImportError:
        raise StareError("verl is not installed", hint="pip install 'stare[verl]' on the cluster") from None
    train_file = Path(next(o for o in overrides if o.startswith("data.train_files=")).split("=", 1)[1])
    if not train_file.exists():
        raise StareError(f"verl data not found: {train_file}", hint=f"stare data prepare --recipe {cfg.name}")
    env = {**os.environ, **environment(cfg, run_dir)}
    # verl's output (its console logger included) goes to stderr and to verl.log in the run directory;
    # stdout carries only the run directory, as with the embedded backend.
    with open(run_dir / "verl.log", "a" if resumed_at is not None else "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        try:
            for line in proc.stdout:
                log.write(line)
                sys.stderr.write(line)
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
    if code:
        raise StareError(f"verl exited with code {code}", hint=f"see {run_dir / 'verl.log'}")
    return run_dir
