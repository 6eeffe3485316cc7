"""The verl backend: a resolved recipe becomes verl 0.9.x configuration (Hydra overrides of verl's
`ppo_trainer`), launched locally or written as a `ray job submit` script.

One table, `TABLE`, says for every recipe key what verl does with it: translated to verl keys
(`verl`), honoured by the method layer running inside verl's processes (`layer`), honoured when
`stare data prepare` writes the parquet files (`data`), recipe metadata with no effect on training
(`meta`), or another backend's section (`other`). A row may refuse the recipe's value with a reason:
`check()` fails validation naming the key (`stare recipes validate R --backend verl`); nothing is
translated silently. `verl_overrides()` is built from the same table, and tests check it key by key.

Every method runs from the method layer (stare_cli/method/layer.py): the resolved recipe travels in
verl's own config (`+stare.recipe`), our extension (verl_ext.py, imported in every verl process)
rebuilds the layer from it with the same constructor and runs rewards (a verl reward manager),
advantages, the controller and the batch transform (verl's driver) and the policy loss (verl's actor,
inside verl's loss call, so official-scope STARE selects on exactly the micro-batches verl forms).

`backend.verl.device: cpu` (`stare train --device cpu`) runs verl's real trainer on CPU through the
project's support module `verl_cpu.py`; what that does not exercise is listed there.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from stare_cli.core.config import Recipe
from stare_kernel.errors import StareError, install_hint
from benchmarks.data.registry import dir_name

if TYPE_CHECKING:
    from stare_cli.backends.verl_launchers import LaunchSpec
    from stare_cli.core.resume import ResumePlan

EXT_MODULE = "stare_cli.backends.verl_ext"
LOSS_MODE = "stare_layer"  # our policy loss in verl's registry: the method layer's loss
REWARD_MANAGER = ("pkg://stare_cli.backends.verl_reward", "StareRewardManager")
SAMPLER = ("pkg://stare_cli.backends.verl_sampler", "OfficialGenBatches")  # verl_sampler.py (imports verl)
A = "actor_rollout_ref.actor"
R_ = "actor_rollout_ref.rollout"


# ------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Row:
    """What verl does with one or more recipe keys.

    kind: 'verl' (to_verl gives the overrides), 'layer', 'data', 'meta' or 'other' (module docstring).
    refuse: (the key, the reason) when the recipe's values cannot be honoured, else None.
    """

    keys: tuple[str, ...]
    kind: str
    note: str
    to_verl: Optional[Callable[[Recipe], dict[str, Any]]] = None
    refuse: Optional[Callable[[Recipe], Optional[tuple[str, str]]]] = None


def _default(cfg: Recipe, dotted: str) -> bool:
    """Whether `dotted` has the schema's default value in `cfg`."""
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    return getattr(node, last) == type(node).model_fields[last].get_default(call_default_factory=True)


def _unless_default(*keys: str, why: str) -> Callable[[Recipe], Optional[tuple[str, str]]]:
    def check(cfg: Recipe) -> Optional[tuple[str, str]]:
        changed = [k for k in keys if not _default(cfg, k)]
        return (changed[0], why) if changed else None

    return check


def _precision(cfg: Recipe) -> dict[str, Any]:
    # verl 0.9.1's FSDP engine: master weights in fsdp_config.model_dtype (fp32, as the official runs'
    # fork), compute dtype from fsdp_config.mixed_precision.param_dtype (fp16 gets ShardedGradScaler).
    p = cfg.optim.precision
    dtype = {"fp16": "float16", "bf16": "bfloat16", "fp32": "bfloat16"}[p]  # fsdp_config.dtype knows no fp32
    return {f"{A}.fsdp_config.model_dtype": "fp32", f"+{A}.fsdp_config.mixed_precision.param_dtype": p,
            f"+{A}.fsdp_config.mixed_precision.reduce_dtype": "fp32",
            f"+{A}.fsdp_config.mixed_precision.buffer_dtype": "fp32",
            f"{A}.fsdp_config.dtype": dtype, "actor_rollout_ref.ref.fsdp_config.dtype": dtype}


def _micro_batches(cfg: Recipe) -> dict[str, Any]:
    O, V = cfg.optim, cfg.backend.verl
    if O.micro_batch_tokens is not None:
        return {f"{A}.use_dynamic_bsz": True, f"{A}.ppo_max_token_len_per_gpu": O.micro_batch_tokens,
                f"{R_}.log_prob_use_dynamic_bsz": True, f"{R_}.log_prob_max_token_len_per_gpu": O.micro_batch_tokens,
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True,
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": O.micro_batch_tokens}
    n_gpus = V.n_gpus_per_node * V.nnodes
    per_gpu = max(1, O.micro_batch_size // n_gpus)
    return {f"{A}.use_dynamic_bsz": False, f"{A}.ppo_micro_batch_size_per_gpu": per_gpu,
            f"{R_}.log_prob_micro_batch_size_per_gpu": per_gpu, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": per_gpu}


def _dynamic_sampling(cfg: Recipe) -> dict[str, Any]:
    on = cfg.method.dynamic_sampling
    R = cfg.rollout
    if on and R.refill == "gen_batches":
        # The official generation batches through our verl sampler (verl_sampler.py). verl forces
        # data.gen_batch_size to 1 whenever groups are filtered (its refills are per prompt): we write 1, what
        # it runs with; the sampler dispatches whole generation batches through those refills.
        return {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
                "algorithm.filter_groups.max_num_gen_batches": R.max_gen_batches, "data.gen_batch_size": 1,
                "trainer.v1.sampler.custom_sampler.path": SAMPLER[0],
                "trainer.v1.sampler.custom_sampler.name": SAMPLER[1],
                "+trainer.v1.sampler.sampler_kwargs.gen_batch_size": R.gen_batch_size,
                "+trainer.v1.sampler.sampler_kwargs.max_gen_batches": R.max_gen_batches,
                "+trainer.v1.sampler.sampler_kwargs.metric": "acc"}
    # verl's own replay buffer: gen_batch_size forced to 1 with group filtering, max_num_gen_batches ignored;
    # we write what it runs with, so the effective config is the written one.
    return {"algorithm.filter_groups.enable": on, "algorithm.filter_groups.metric": "acc",
            "algorithm.filter_groups.max_num_gen_batches": 0,
            "data.gen_batch_size": 1 if on else cfg.optim.train_batch_size}


def _real_ranks(cfg: Recipe) -> int:
    """verl's data-parallel ranks for this recipe: one process on the CPU debug path (verl_cpu.py)."""
    V = cfg.backend.verl
    return 1 if V.device == "cpu" else V.nnodes * V.n_gpus_per_node


def _refuse_refill(cfg: Recipe) -> Optional[tuple[str, str]]:
    if cfg.method.dynamic_sampling and cfg.rollout.refill == "gen_batches" and cfg.rollout.on_short_batch == "train":
        return ("rollout.on_short_batch", "verl's trainer needs a full train batch every step: a short batch after "
                "rollout.max_gen_batches generation batches stops the run ('error', as the official trainer); "
                "'train' runs on the embedded backend")
    return None


def _templates(cfg: Recipe) -> dict[str, Any]:
    from benchmarks.data.toy import RAW_CHAT_TEMPLATE

    t = cfg.data.template.value
    if t in ("raw", "plain") or cfg.model.chat_template == "none":
        # the prompt text as written by `stare data prepare`, plus a newline: the embedded backend's raw/plain
        return {"actor_rollout_ref.model.custom_chat_template": RAW_CHAT_TEMPLATE}
    return {}


def _eval(cfg: Recipe) -> dict[str, Any]:
    E = cfg.eval
    s = _eval_protocol(cfg)
    out = {"trainer.test_freq": E.every or -1, "trainer.val_before_train": bool(E.benchmarks) and E.at_start}
    if s is not None:
        n, temperature, top_p = s
        out.update({f"{R_}.val_kwargs.n": n, f"{R_}.val_kwargs.temperature": temperature,
                    f"{R_}.val_kwargs.top_p": top_p, f"{R_}.val_kwargs.do_sample": True})
    return out


def _eval_protocol(cfg: Recipe) -> Optional[tuple[int, float, float]]:
    """(n, temperature, top_p) shared by every benchmark evaluated during training, None without
    benchmarks; raises ValueError listing the benchmarks when they differ."""
    from benchmarks.data.registry import check_benchmark

    E = cfg.eval
    if not E.benchmarks:
        return None
    sets = {}
    for b in E.benchmarks:
        spec = check_benchmark(b)
        sets[b] = (E.n or spec.n, spec.temperature if E.temperature is None else E.temperature,
                   spec.top_p if E.top_p is None else E.top_p)
    if len(set(sets.values())) > 1:
        raise ValueError(", ".join(f"{b}: n={v[0]} T={v[1]} top_p={v[2]}" for b, v in sets.items()))
    return next(iter(sets.values()))


def _refuse_eval(cfg: Recipe) -> Optional[tuple[str, str]]:
    try:
        _eval_protocol(cfg)
    except ValueError as e:
        return ("eval.n", f"verl 0.9 validates every benchmark with one sampling setting, but the benchmarks' protocols differ "
                f"({e}); set eval.n / eval.temperature / eval.top_p, or evaluate with `stare eval` after training")
    if cfg.eval.max_tokens is not None and cfg.eval.max_tokens != cfg.rollout.max_response_tokens:
        return ("eval.max_tokens", "verl 0.9 validates with the rollout's response length; eval.max_tokens must equal "
                "rollout.max_response_tokens")
    return None


def _run_name(cfg: Recipe) -> str:
    return cfg.logging.run_name or f"{cfg.name.replace('/', '-')}__{cfg.method.name}__seed{cfg.optim.seed}"


TABLE: list[Row] = [
    # metadata
    Row(("name", "logging.run_name"), "verl", "experiment name", lambda c: {"trainer.experiment_name": _run_name(c)}),
    Row(("description", "paper", "backend.name"), "meta", "no effect on training"),
    # model
    Row(("model.path",), "verl", "the model directory or hub id (toy: resolved at launch)",
        lambda c: {"actor_rollout_ref.model.path": c.model.path}),
    Row(("model.dtype",), "verl", "the rollout engine's weights dtype", lambda c: {f"{R_}.dtype": c.model.dtype.value}),
    Row(("model.trust_remote_code",), "verl", "", lambda c: {"actor_rollout_ref.model.trust_remote_code": c.model.trust_remote_code,
                                                           "data.trust_remote_code": c.model.trust_remote_code}),
    Row(("data.template", "model.chat_template"), "verl",
        "paper/short: the model's chat template over the user turn; raw/plain (or chat_template none): the prompt text and a "
        "newline through a custom chat template", _templates,
        lambda c: ("data.template", "verl's rollout cannot open the assistant turn with <think> (the r1 template); "
                   "use the embedded backend") if c.data.template.value == "r1" else None),
    # data (written by `stare data prepare`; the training run reads the parquet files)
    Row(("data.train", "data.split", "data.subset", "data.prompt_field", "data.answer_field", "data.max_samples",
         "eval.limit"), "data", "read when `stare data prepare` writes the parquet files"),
    Row(("data.shuffle",), "verl", "", lambda c: {"data.shuffle": c.data.shuffle}),
    # rollout
    Row(("rollout.n",), "verl", "", lambda c: {f"{R_}.n": c.rollout.n}),
    Row(("rollout.temperature", "rollout.top_p", "rollout.top_k"), "verl", "",
        lambda c: {f"{R_}.temperature": c.rollout.temperature, f"{R_}.top_p": c.rollout.top_p, f"{R_}.top_k": c.rollout.top_k}),
    Row(("rollout.max_prompt_tokens",), "verl", "prompts longer are cut from the left",
        lambda c: {"data.max_prompt_length": c.rollout.max_prompt_tokens, "data.truncation": "left",
                   "data.filter_overlong_prompts": False}),
    Row(("rollout.max_response_tokens",), "verl", "", lambda c: {"data.max_response_length": c.rollout.max_response_tokens}),
    Row(("method.dynamic_sampling", "rollout.refill", "rollout.gen_batch_size", "rollout.max_gen_batches",
         "rollout.on_short_batch"), "verl",
        "gen_batches: the official generation batches with their cap (our verl sampler, verl_sampler.py); "
        "per_group: verl's replay buffer refills one prompt per dropped group; both filter groups on acc "
        "(single-response groups kept)", _dynamic_sampling, _refuse_refill),
    Row(("rollout.truncated",), "layer", "grade/zero: the method layer's reward",
        refuse=lambda c: ("rollout.truncated", "verl's actor takes its loss mask from the rollout; leaving cut responses "
                          "out of the loss (truncated: mask) is embedded-only") if c.rollout.truncated == "mask" else None),
    Row(("rollout.engine", "rollout.vllm_gpu_memory_utilization"), "other",
        "the embedded backend's rollout engine (verl: vLLM, or the HF server with --device cpu)",
        refuse=_unless_default("rollout.engine", "rollout.vllm_gpu_memory_utilization",
                               why="the embedded backend's rollout engine settings; verl's are backend.verl.*")),
    Row(("rollout.tools.enable", "rollout.tools.format", "rollout.tools.system_prompt", "rollout.tools.max_turns",
         "rollout.tools.cpu_s",
         "rollout.tools.wall_s", "rollout.tools.memory_mb", "rollout.tools.output_bytes", "rollout.tools.file_mb",
         "rollout.tools.nproc", "rollout.tools.python", "rollout.tools.unsafe_no_isolation"), "verl",
        "verl's tool agent with our sandbox (tools.yaml in the run directory)",
        lambda c: {f"{R_}.multi_turn.enable": True, f"{R_}.multi_turn.max_assistant_turns": c.rollout.tools.max_turns + 1,
                   f"{R_}.multi_turn.max_tool_response_length": c.rollout.tools.output_bytes,
                   f"{R_}.agent.default_agent_loop": "tool_agent"} if c.rollout.tools.enable else {},
        lambda c: (("rollout.tools.format", f"verl's tool agent parses hermes <tool_call> JSON, not the recipe's "
                    f"{c.rollout.tools.format} blocks (rollout.tools.format: hermes runs on both backends)")
                   if c.rollout.tools.enable and c.rollout.tools.format != "hermes" else
                   ("rollout.tools.system_prompt", "verl's tool agent describes the tool through the chat template's "
                    "tools section only") if c.rollout.tools.enable and c.rollout.tools.system_prompt else None)),
    # optimisation
    Row(("optim.lr",), "verl", "", lambda c: {f"{A}.optim.lr": c.optim.lr}),
    Row(("optim.schedule", "optim.warmup_steps"), "verl", "",
        lambda c: {f"{A}.optim.lr_scheduler_type": c.optim.schedule, f"{A}.optim.lr_warmup_steps": c.optim.warmup_steps or -1,
                   f"{A}.optim.min_lr_ratio": 0.0, f"{A}.optim.num_cycles": 0.5},
        lambda c: ("optim.schedule", "verl 0.9.1's FSDP engine has constant and cosine schedules only")
        if c.optim.schedule == "linear" else None),
    Row(("optim.weight_decay",), "verl", "", lambda c: {f"{A}.optim.weight_decay": c.optim.weight_decay}),
    Row(("optim.grad_clip",), "verl", "the engine reads optim.clip_grad (actor.grad_clip is not read in 0.9.1's "
        "V1 path, so we do not write it)", lambda c: {f"{A}.optim.clip_grad": c.optim.grad_clip}),
    Row(("optim.train_batch_size",), "verl", "", lambda c: {"data.train_batch_size": c.optim.train_batch_size}),
    Row(("optim.mini_batch_size",), "verl", "", lambda c: {f"{A}.ppo_mini_batch_size": c.optim.mini_batch_size}),
    Row(("optim.micro_batch_size", "optim.micro_batch_tokens"), "verl",
        "token budget: verl's dynamic batch size (per GPU); else rows per GPU", _micro_batches),
    Row(("optim.loss_layout", "optim.official_ranks"), "layer",
        "official: our driver places the official run's ranks and micro-batches on verl's real ranks (in place of "
        "verl's batch balancing) and the policy loss normalises each micro-batch by its own tokens times its scale "
        "(verl_ext.official_balance); global: verl 0.9.1's own micro-batches and global token-mean",
        lambda c: {f"{A}.shuffle": False} if c.optim.loss_layout == "official" else {},
        lambda c: ("optim.official_ranks", f"the official layout places {c.optim.official_ranks} emulated ranks on "
                   f"{_real_ranks(c)} GPUs (backend.verl.nnodes x n_gpus_per_node): each GPU must hold whole "
                   "emulated ranks") if c.optim.loss_layout == "official" and c.optim.official_ranks % _real_ranks(c)
        else None),
    Row(("optim.ppo_epochs",), "verl", "", lambda c: {f"{A}.ppo_epochs": c.optim.ppo_epochs}),
    Row(("optim.total_steps",), "verl", "", lambda c: {"trainer.total_training_steps": c.optim.total_steps}),
    Row(("optim.seed",), "verl", "", lambda c: {"data.seed": c.optim.seed, f"{A}.data_loader_seed": c.optim.seed}),
    Row(("optim.precision",), "verl", "fp32 master weights; compute dtype from the recipe", _precision),
    # method: verl's own keys get the recipe's values (effective config), the method layer runs them
    Row(("method.name",), "layer", "the method layer (our policy loss, advantages, controller)",
        lambda c: {f"{A}.policy_loss.loss_mode": LOSS_MODE}),
    Row(("method.adv_estimator", "method.adv_eps"), "layer", "advantages from the method layer (verl's GRPO equals ours)",
        lambda c: {"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": c.method.adv_estimator == "grpo"}),
    Row(("method.clip_low", "method.clip_high", "method.dual_clip"), "layer", "the method layer's loss (verl's keys mirror them)",
        lambda c: {f"{A}.clip_ratio_low": c.method.clip_low, f"{A}.clip_ratio_high": c.method.clip_high,
                   f"{A}.clip_ratio_c": c.method.dual_clip if c.method.dual_clip is not None else 1e9}),
    Row(("method.loss_agg",), "layer", "the method layer's loss (verl's key mirrors it)",
        lambda c: {f"{A}.loss_agg_mode": c.method.loss_agg, f"{A}.loss_scale_factor":
                   c.rollout.max_response_tokens if c.method.loss_agg == "seq-mean-token-sum-norm" else None}),
    Row(("method.entropy_coef",), "layer", "the method layer adds the entropy bonus inside the policy loss; verl's "
        "entropy_coeff stays 0 so it is not added twice",
        lambda c: {f"{A}.entropy_coeff": 0.0, f"{A}.calculate_entropy": c.method.entropy_coef > 0 or c.method.name == "entro-adv"
                   or c.method.adaptive_entropy.enable}),
    Row(tuple(f"method.{k}" for k in ("overlong.enable", "overlong.buffer", "overlong.factor", "stare.P", "stare.W",
                                      "stare.M", "stare.h_tgt", "stare.adaptive", "stare.alpha", "stare.w_max",
                                      "stare.m_min", "stare.scope", "clip_cov.ratio", "clip_cov.cov_lb",
                                      "clip_cov.cov_ub", "kl_cov.ratio", "kl_cov.coef", "gspo.clip_low",
                                      "gspo.clip_high", "entro_adv.alpha", "entro_adv.kappa", "top_entropy_frac",
                                      "w_reinforce_lambda", "stapo.tau_p", "stapo.tau_h_quantile", "rsi.low", "rsi.high",
                                      "cov_anneal.schedule", "cov_anneal.end", "cov_anneal.steps",
                                      "adaptive_entropy.enable", "adaptive_entropy.target", "adaptive_entropy.coef_init",
                                      "adaptive_entropy.coef_min", "adaptive_entropy.coef_max",
                                      "adaptive_entropy.delta")),
        "layer", "the method layer inside verl's processes"),
    Row(("reward.fn", "reward.format_penalty", "reward.timeout_s"), "layer", "the method layer's reward, as verl's "
        "reward manager", lambda c: {"reward.reward_manager.source": "importlib",
                                     "reward.reward_manager.module.path": REWARD_MANAGER[0],
                                     "reward.reward_manager.name": REWARD_MANAGER[1]}),
    # evaluation during training
    Row(("eval.benchmarks",), "data", "validation files written by `stare data prepare`"),
    Row(("eval.n", "eval.temperature", "eval.top_p", "eval.max_tokens", "eval.every", "eval.at_start"), "verl",
        "one sampling setting for all benchmarks", _eval, _refuse_eval),
    # backends
    Row(("backend.embedded.device", "backend.embedded.threads", "backend.embedded.length_buckets",
         "backend.embedded.share_prompts", "backend.embedded.lm_head", "backend.embedded.lean_activations",
         "backend.embedded.fused_old_pass", "backend.embedded.heap", "backend.embedded.activation_checkpointing"),
        "other",
        "the embedded backend's section"),
    Row(("backend.verl.nnodes", "backend.verl.n_gpus_per_node"), "verl", "",
        lambda c: {"trainer.nnodes": c.backend.verl.nnodes, "trainer.n_gpus_per_node": c.backend.verl.n_gpus_per_node}),
    Row(("backend.verl.tensor_parallel_size", "backend.verl.gpu_memory_utilization"), "verl", "",
        lambda c: {f"{R_}.tensor_model_parallel_size": c.backend.verl.tensor_parallel_size,
                   f"{R_}.gpu_memory_utilization": c.backend.verl.gpu_memory_utilization}),
    Row(("backend.verl.device",), "verl", "cpu: the CPU debug path's overrides (verl_cpu.py)"),
    Row(("backend.verl.shared_dir",), "verl", "--emit-script: the run directory, data, checkpoints and tools file "
        "live under it (absolute paths in the overrides)"),
    Row(("backend.verl.extra_overrides",), "verl", "appended verbatim"),
    # logging and checkpoints
    Row(("logging.wandb", "logging.project"), "verl", "",
        lambda c: {"trainer.logger": ["console"] if c.logging.wandb == "disabled" else ["console", "wandb"],
                   "trainer.project_name": c.logging.project}),
    Row(("logging.samples_every", "logging.reflection_words"), "layer",
        "our driver extension writes samples/ and the reflection-word rate, as the embedded backend"),
    Row(("checkpoint.every", "checkpoint.keep_last"), "verl", "",
        lambda c: {"trainer.save_freq": c.checkpoint.every or -1, "trainer.max_actor_ckpt_to_keep": c.checkpoint.keep_last}),
]


def check(cfg: Recipe) -> None:
    """Fail validation when verl cannot honour the recipe: one line naming the key and the reason."""
    from stare_cli.backends.refusal import raise_first

    raise_first("verl", refusals(cfg))


def refusals(cfg: Recipe) -> list[tuple[str, str]]:
    """(key, reason) of every table row that refuses the recipe's values, then of every extra
    override that would set a verl key the recipe already sets (`owned_by_recipe`)."""
    out = [r for r in (row.refuse(cfg) for row in TABLE if row.refuse is not None) if r is not None]
    if out:
        return out
    owned = owned_by_recipe(cfg)
    for o in cfg.backend.verl.extra_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in owned:
            out.append(("backend.verl.extra_overrides",
                        f"'{o}' sets {key}, which the recipe's {' / '.join(owned[key])} translate(s) to; verl would run "
                        "a value the recipe does not say: change the recipe key instead"))
    return out


def owned_by_recipe(cfg: Recipe) -> dict[str, tuple[str, ...]]:
    """verl key -> the recipe keys whose translation sets it (the table's rows)."""
    owned: dict[str, tuple[str, ...]] = {}
    for row in TABLE:
        if row.to_verl is not None:
            for k in row.to_verl(cfg):
                owned.setdefault(k, row.keys)
    return owned


# ---------------------------------------------------------------------------------- the overrides
def hydra_value(v: Any) -> str:
    """A Python value as a Hydra override value: strings single-quoted (so any character survives,
    OmegaConf interpolations escaped), dicts and lists as Hydra literals."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${") + "'"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as a Hydra value")


def _plain(v: Any) -> str:
    """Override values as verl's own scripts write them (numbers, booleans, bare words); strings with
    characters Hydra's grammar would read, and lists, as Hydra literals."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple, dict)):
        return hydra_value(v)
    if isinstance(v, str) and any(c in v for c in " {}[]()%'\"\n,:=$"):
        return hydra_value(v)
    return str(v)


def verl_overrides(cfg: Recipe, run_dir: Optional[Path] = None, data_dir: Optional[Path] = None,
                   job: bool = False) -> list[str]:
    """Hydra overrides of verl's ppo_trainer for this recipe (after `check`): the table's
    translations, the fixed wiring of our extension, the CPU path's values (`--device cpu`), then
    `backend.verl.extra_overrides` verbatim. `run_dir` and `data_dir` should be absolute on a cluster;
    `job`: for a `ray job submit` script (the Ray cluster exists already: no Ray start-up settings)."""
    check(cfg)
    data_dir = data_dir or Path("data") / cfg.name.replace("/", "-")
    run_dir = run_dir or Path("runs") / "verl"
    ov: dict[str, Any] = {}
    for row in TABLE:
        if row.to_verl is not None:
            ov.update(row.to_verl(cfg))
    ov.update({
        "data.train_files": str(data_dir / "train.parquet"),
        "data.val_files": [str(data_dir / bench_file(b)) for b in cfg.eval.benchmarks] if cfg.eval.benchmarks
        else str(data_dir / "train.parquet"),
        "data.prompt_key": "prompt",
        # no KL anywhere (the paper recipe); the unused coefficients are 0, as in the official runs
        "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.0,
        f"{A}.use_kl_loss": False, f"{A}.kl_loss_coef": 0.0,
        # checkpoints with a Hugging Face copy (as the official runs), which `stare eval` reads
        f"{A}.checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"],
        "trainer.log_val_generations": 10,
        "actor_rollout_ref.model.external_lib": EXT_MODULE,
        f"{R_}.name": "vllm",
        "trainer.use_v1": True,  # our driver extension patches the V1 trainer
        "trainer.default_local_dir": str(run_dir / "checkpoints"),
        "hydra.run.dir": str(run_dir / "hydra"),  # Hydra's output folder inside the run, not ./outputs
        # The method layer's recipe and the run directory, inside verl's own config: every verl process
        # that holds the config rebuilds the layer with the same constructor (no environment JSON).
        "+stare.run_dir": str(run_dir),
    })
    if cfg.rollout.tools.enable:
        ov[f"{R_}.multi_turn.tool_config_path"] = str(run_dir / "tools.yaml")
    if cfg.backend.verl.device == "cpu":  # the CPU debug path (verl_cpu.py): its values win over the recipe's
        from stare_cli.backends.verl_cpu import cpu_overrides

        ov.update(cpu_overrides(job=job))
    out = [f"{k}={_plain(v)}" for k, v in ov.items()]
    out.append(f"+stare.recipe={hydra_value(cfg.model_dump(mode='json'))}")
    out += list(cfg.backend.verl.extra_overrides)
    return out


def bench_file(bench: str) -> str:
    """Parquet file name of a benchmark (`toy:arith` -> toy-arith.parquet)."""
    return dir_name(bench) + ".parquet"


def compose(overrides: list[str]):
    """verl's full config from the overrides, offline, then verl's own validate_config (Hydra's own
    `hydra.*` settings apply to a launched run only and are left out)."""
    import verl
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl.utils.config import validate_config

    cfg_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        conf = hcompose(config_name="ppo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")])
    validate_config(conf, use_reference_policy=False, use_critic=False)
    return conf


def describe(cfg: Recipe) -> list[str]:
    """What the method layer will run inside verl (for --dry-run): method, reward, STARE's values."""
    from stare_cli.method.layer import MethodLayer

    layer = MethodLayer.from_recipe(cfg)
    m = cfg.method
    lines = [f"method: {layer.spec.name} ({layer.spec.summary})",
             f"reward: {cfg.reward.fn} (format_penalty={cfg.reward.format_penalty}, truncated={cfg.rollout.truncated})"]
    if layer.spec.stare:
        s = m.stare
        lines.append(f"stare: variant={layer.spec.stare} scope={s.scope} P={s.P} W={s.W} M={s.M} h_tgt={s.h_tgt} "
                     f"adaptive={s.adaptive} alpha={s.alpha} w_max={s.w_max} m_min={s.m_min}")
    O, R = cfg.optim, cfg.rollout
    if O.loss_layout == "official":
        lines.append(f"loss layout: official ({O.official_ranks} emulated ranks on {_real_ranks(cfg)} GPU(s), "
                     f"verl 0.7 micro-batches of {O.micro_batch_tokens} tokens, each normalised by its own tokens)")
    else:
        lines.append("loss layout: global (verl 0.9.1's micro-batches, one token-mean over the mini-batch)")
    if m.dynamic_sampling:
        lines.append(f"dynamic sampling on acc: generation batches of {R.gen_batch_size} prompts, at most "
                     f"{R.max_gen_batches}, then an error" if R.refill == "gen_batches" else
                     "dynamic sampling on acc: one fresh prompt per dropped group (verl's replay buffer), no cap")
    return lines


def launch_command(cfg: Recipe, overrides: list[str]) -> list[str]:
    return ["python3", "-m", "verl.trainer.main_ppo", *overrides]


def environment(cfg: Recipe, run_dir: Path) -> dict[str, str]:
    """Environment of verl's processes: which modules verl imports (module names only; the method's
    configuration travels in verl's config)."""
    env = {"VERL_USE_EXTERNAL_MODULES": EXT_MODULE}
    if cfg.backend.verl.device == "cpu":
        from stare_cli.backends import verl_cpu

        env.update(verl_cpu.environment())
        env["VERL_USE_EXTERNAL_MODULES"] = f"{verl_cpu.MODULE},{EXT_MODULE}"
    return env


def package_dirs() -> list[str]:
    """Our packages' directories, shipped with a job (Ray's py_modules) so every node imports this code."""
    import importlib

    return [str(Path(importlib.import_module(p).__file__).parent) for p in ("stare_cli", "baselines", "benchmarks", "recipes")]


def job_script(cfg: Recipe, overrides: list[str], run_dir: Path, launch: Optional["LaunchSpec"] = None) -> str:
    """The job script of the chosen launcher (verl_launchers.py): every path in it is absolute under the
    shared directory, verl loads our reward manager and extension by package, and our packages travel
    with the job (py_modules)."""
    from stare_cli.backends.verl_launchers import LaunchSpec, job_script as write

    runtime_env = {"env_vars": environment(cfg, run_dir), "py_modules": package_dirs()}
    return write(cfg, run_dir, runtime_env, launch_command(cfg, overrides), launch or LaunchSpec())


def prepare_data(cfg: Recipe, out_dir: Path, limit: Optional[int] = None) -> list[Path]:
    """verl's parquet format (chat messages, reward_model.ground_truth, data_source) for the
    training data and the recipe's evaluation benchmarks."""
    import pandas as pd

    from benchmarks.data.registry import load_benchmark
    from benchmarks.generation.templates import user_text
    from benchmarks.data.prompts import load_prompts

    def frame(rows: list[dict], source: str, split: str) -> "pd.DataFrame":
        recs = []
        for i, r in enumerate(rows[:limit] if limit else rows):
            content = user_text(r["problem"], cfg.data.template.value)
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
    from stare_kernel.errors import StareError

    if not (run_dir / "meta.json").exists():
        # verl's checkpoint loaders unpickle: only run directories stare created (and that you trust)
        raise StareError(f"--resume: '{run_dir}' is not a run directory stare created (no meta.json)",
                         hint="resume only run directories you trust: verl's checkpoint loading runs pickle")
    from stare_cli.core.resume import no_checkpoint_error
    from stare_cli.core.runs import VERL_TRACKER, atomic_write_text, verl_checkpoint

    step, skipped = verl_checkpoint(run_dir)
    if step is None:
        raise no_checkpoint_error(run_dir, skipped)
    if skipped:  # verl resumes from what the tracker names: point it at the newest complete one
        print(f"warning: skipping checkpoint: {skipped[0]}; resuming from global_step_{step}", file=sys.stderr)
        atomic_write_text(run_dir / "checkpoints" / VERL_TRACKER, str(step))
    meta = json.loads((run_dir / "meta.json").read_text())
    train = next((o.split("=", 1)[1] for o in meta.get("overrides", []) if o.startswith("data.train_files=")), None)
    return step, Path(train).parent if train else None


def run(cfg: Recipe, out_root: Path, dry_run: bool = False, emit_script: Optional[Path] = None,
        data_dir: Optional[Path] = None, resume: Optional["ResumePlan"] = None,
        launch: Optional["LaunchSpec"] = None) -> Optional[Path]:
    """Dry-run (print overrides), write a Ray job script, or launch verl locally. With `resume`,
    verl continues that run from its latest checkpoint (its own resume_mode=auto; our controller
    state comes back with it) and metrics rows after that checkpoint are dropped, to be redone; with
    `resume.restart` the run starts again from step 1 (earlier outputs set aside)."""
    import os
    import subprocess
    import sys

    from stare_kernel.errors import StareError
    from stare_cli.core.runs import new_run_dir, write_run_meta

    check(cfg)
    if dry_run:
        for line in describe(cfg):
            print(f"# {line}")
        for o in verl_overrides(cfg, data_dir=data_dir):
            print(o)
        return None
    shared = None
    if emit_script:  # every node must see the run directory, the data, the checkpoints and the tools file
        if not cfg.backend.verl.shared_dir:
            raise StareError("--emit-script needs a directory every node of the cluster sees",
                             hint="--shared-dir /abs/shared/path (or backend.verl.shared_dir in the recipe)")
        shared = Path(cfg.backend.verl.shared_dir)
        out_root = shared / "runs"
        data_dir = data_dir or shared / "data" / cfg.name.replace("/", "-")
    from benchmarks.data.models import resolve_model_path

    resolved = resolve_model_path(cfg.model.path)  # a toy or short name: verl needs the folder
    if resolved != cfg.model.path:  # (on a cluster: a copy under the shared dir)
        path = Path(resolved)
        if shared is not None:
            import shutil

            copy = shared / "models" / path.name
            if not copy.exists():
                shutil.copytree(path, copy)
            path = copy
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(path)})})
    resumed_at = None
    if resume is not None:
        from stare_cli.core.resume import set_aside
        from stare_cli.core.runs import atomic_write_text, read_jsonl

        run_dir = Path(resume.run_dir)
        if resume.restart:
            set_aside(run_dir)
        else:
            resumed_at, used_data = resume_point(run_dir)
            if resumed_at >= cfg.optim.total_steps and not (dry_run or emit_script):
                from stare_cli.core.resume import finished_note

                print(finished_note(run_dir, cfg.optim.total_steps, resumed_at), file=sys.stderr)
                return run_dir
            data_dir = data_dir or used_data
            rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) <= resumed_at]
            atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    else:
        run_dir = new_run_dir(cfg, out_root)
    run_dir = run_dir.resolve()  # verl's processes may run elsewhere: absolute paths only
    data_dir = data_dir.resolve() if data_dir is not None else (Path("data") / cfg.name.replace("/", "-")).resolve()
    if not (data_dir / "train.parquet").exists():
        raise StareError(f"verl data not found: {data_dir / 'train.parquet'}",
                         hint=f"stare data prepare --recipe {cfg.name} --out {data_dir}")
    overrides = verl_overrides(cfg, run_dir=run_dir, data_dir=data_dir, job=emit_script is not None)
    if cfg.rollout.tools.enable:
        import yaml

        from stare_cli.backends.verl_tools import tool_config

        from benchmarks.generation.tools import tool_limits
        from benchmarks.generation.sandbox import require_isolation

        limits = tool_limits(cfg.rollout.tools)
        require_isolation(limits)  # here too, before the job starts (the workers check again)
        (run_dir / "tools.yaml").write_text(yaml.safe_dump(tool_config(limits)))
    from stare_cli.method.layer import MethodLayer, method_warnings

    from stare_cli.core.runs import record_config

    if resumed_at is None:  # a new run, or a restart: meta.json describes this start
        write_run_meta(run_dir, cfg, {"backend": "verl", "overrides": overrides,
                                      "reward_grader": MethodLayer.from_recipe(cfg).reward_function().grader.tag,
                                      "method_notes": method_warnings(cfg)})
    record_config(run_dir, cfg, "start" if resume is None else ("restart" if resume.restart else "resume"),
                  resumed_at or 0, list(resume.overrides) if resume else [], resume.changed if resume else {},
                  extra={"verl_overrides": overrides})
    from stare_cli.core.card import write_card

    write_card(run_dir, "started" if resumed_at is None else "resumed")
    if emit_script:
        emit_script.write_text(job_script(cfg, overrides, run_dir, launch))
        emit_script.chmod(0o755)
        print(f"wrote {emit_script}", file=sys.stderr)
        return run_dir
    try:
        import verl  # noqa: F401
    except ImportError:
        raise StareError("verl is not installed", hint=install_hint("verl")) from None
    env = {**os.environ, **environment(cfg, run_dir)}
    # verl's output (its console logger included) goes to stderr and to verl.log in the run directory;
    # stdout carries only the run directory, as with the embedded backend.
    with open(run_dir / "verl.log", "a" if resumed_at is not None else "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        oom = None  # the first line in which Ray says its memory monitor killed a worker
        try:
            for line in proc.stdout:
                log.write(line)
                sys.stderr.write(line)
                if oom is None and ray_killed_for_memory(line):
                    oom = line.strip()[:300]
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
    write_card(run_dir, "stopped" if code else "finished")
    if code and oom:
        raise StareError(f"verl exited with code {code}: Ray's memory monitor killed a worker, the machine ran low "
                         f"on memory (verl.log: \"{oom[:160]}\")",
                         hint="free memory (other processes), or raise Ray's threshold (RAY_memory_usage_threshold, "
                              "default 0.95); the run resumes from its last checkpoint: stare train --resume "
                              f"{run_dir}")
    if code:
        raise StareError(f"verl exited with code {code}", hint=f"see {run_dir / 'verl.log'}")
    return run_dir


_RAY_OOM = ("OutOfMemoryError", "running low on memory", "memory monitor", "killed due to memory pressure")


def ray_killed_for_memory(line: str) -> bool:
    """Whether a line of verl's output is Ray saying that its memory monitor killed a task or actor (Ray writes
    `ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory`)."""
    return any(sig in line for sig in _RAY_OOM)


# --------------------------------------------------------------- the official run's effective values
# Every key of the official runs' composed configuration (../shared/paper/official/*.composed.json,
# the fork of verl 0.7) that is also in ours, composed for the Short-CoT 7B recipe with verl 0.9.1's
# defaults, has the same value, except these. A key ending in ".*" covers its subtree, one starting
# with "*." any path ending so. tests/test_official_config.py fails on any other difference, and on a
# row here that no longer differs. kind: version (verl 0.7 fork vs verl 0.9.1), local (paths and
# names on the official cluster), hardware (cluster size, engine capacity), deliberate (our choice,
# with the reason), verl (what verl 0.9's V1 trainer runs with, whatever is written).
OFFICIAL_DIFFERENCES: list[tuple[str, str, str]] = [
    ("*._target_", "version", "the fork's recipe config classes vs verl 0.9.1's"),
    ("reward_model.*", "version", "verl 0.9 moved reward settings to reward.*; the reward is our manager "
     "around the method layer (docs/guide/fidelity.md, reward)"),
    ("custom_reward_function.*", "version", "verl 0.9 moved it to reward.custom_reward_function (unused: our manager)"),
    ("critic.*", "version", "no critic in GRPO; defaults differ between the versions"),
    ("trainer.rollout_data_dir", "version", "'' in the fork, null in 0.9.1: no dump either way"),
    ("trainer.validation_data_dir", "version", "'' in the fork, null in 0.9.1: no dump either way"),
    ("actor_rollout_ref.model.path", "local", "the official cluster's model folder; ours the hub id"),
    ("actor_rollout_ref.rollout.prometheus.*", "local", "paths on the official cluster"),
    ("data.train_files", "local", "the official parquet; ours from `stare data prepare` (same source, Fidelity)"),
    ("data.val_files", "local", "the same benchmarks, written by `stare data prepare`"),
    ("trainer.default_local_dir", "local", "checkpoint folder: inside our run directory"),
    ("trainer.experiment_name", "local", "run names"),
    ("trainer.project_name", "local", "wandb project"),
    ("trainer.nnodes", "hardware", ("2 nodes x 8 GPUs officially; ours from backend.verl (1 node by default). Not only speed: each "
     "rank partitions its own rows into micro-batches, so which rows share a loss call (and STARE's selection) "
     "follows the rank count; the official 16-rank layout is emulated on any number of GPUs (optim.loss_layout)")),
    ("actor_rollout_ref.rollout.max_num_batched_tokens", "hardware", "vLLM scheduler capacity: speed, not values"),
    ("actor_rollout_ref.rollout.max_num_seqs", "hardware", "vLLM scheduler capacity: speed, not values"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "hardware", "micro-batches of the no-grad "
     "old-log-prob pass (memory only: nothing is selected there; ours = optim.micro_batch_tokens)"),
    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "hardware", "reference pass, unused (no KL)"),
    ("data.gen_batch_size", "verl", "verl 0.9's V1 trainer forces 1 whenever groups are filtered (its refills are per "
     "prompt); the official 192-prompt generation batches, at most 10, are drawn by our verl sampler through those "
     "refills (trainer.v1.sampler.custom_sampler: stare_cli/backends/verl_sampler.py)"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "deliberate", "the method layer's loss (`stare_layer`) runs "
     "STARE's selection inside verl's loss call, as the fork's `stare` loss did"),
    ("actor_rollout_ref.model.external_lib", "deliberate", "our extension (method layer in verl's processes)"),
    ("actor_rollout_ref.actor.calculate_entropy", "deliberate", "the fork computes the current entropy only to log "
     "it; the method layer's STARE needs none (entropy methods switch it on)"),
    ("data.seed", "deliberate", "the data order is seeded from optim.seed. The fork sets `data.seed: null`, and its "
     "sampler (`create_rl_sampler` in `recipe/STARE/main_stare.py`) then draws from a `torch.Generator()` never "
     "seeded, which starts from torch's fixed default seed (67280421310721): the official order is **the same on "
     "every run**, not a fresh one per run. Ours is a different order for each optim.seed; matching the official "
     "one would need torchdata's stateful `RandomSampler` over that generator on both backends (not done: the data "
     "order is then no longer a seed)"),
    ("actor_rollout_ref.actor.data_loader_seed", "deliberate", "seeded from optim.seed"),
    ("trainer.total_training_steps", "deliberate", "paper silent on the run length: optim.total_steps (500)"),
    ("trainer.total_epochs", "deliberate", "bounded by total_training_steps instead"),
    ("trainer.max_actor_ckpt_to_keep", "deliberate", "checkpoint.keep_last (disk); all kept officially"),
    ("trainer.val_before_train", "deliberate", "eval.at_start (default true): a step-0 point for `stare compare`; no "
     "effect on training"),
]


def official_difference(key: str) -> Optional[tuple[str, str]]:
    """(kind, reason) of the OFFICIAL_DIFFERENCES row covering `key`, or None."""
    for pattern, kind, reason in OFFICIAL_DIFFERENCES:
        if (pattern.endswith(".*") and key.startswith(pattern[:-1])) or \
                (pattern.startswith("*.") and key.endswith(pattern[1:])) or key == pattern:
            return kind, reason
    return None


def official_differences_markdown() -> str:
    """The table as docs/guide/fidelity.md shows it."""
    rows = ["| verl key | kind | why it differs from the official run |", "|---|---|---|"]
    rows += [f"| `{p}` | {k} | {r} |" for p, k, r in OFFICIAL_DIFFERENCES]
    return "\n".join(rows) + "\n"
