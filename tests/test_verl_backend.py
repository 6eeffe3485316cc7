"""The verl backend without GPUs: one translation table covers every recipe key, each translated key
reaches verl's composed config (key by key), refused values fail validation by name, every scenario x
method composes and passes verl's validate_config, the driver step of the method layer, dry-run and job
script, data preparation, the reward manager and the tool config."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.testing import assert_close

from baselines.registry import METHODS
from conftest import FIXTURE_DATA
from stare_cli.backends.verl_backend import TABLE, compose, refusals, verl_overrides
from stare_cli.backends.verl_ext import driver_step
from stare_cli.core.config import Recipe
from stare_cli.method.layer import MethodLayer
from stare_cli.core.resolve import load_recipe

SCENARIOS = ["short-cot/qwen2.5-math-7b", "short-cot/qwen2.5-14b-instruct", "short-cot/qwen2.5-32b",
             "long-cot/r1-distill-qwen-1.5b", "long-cot/qwen3-8b", "tool-use/qwen2.5-7b"]
PER_GROUP = ["rollout.refill=per_group", "optim.loss_layout=global"]  # verl 0.9's V1 refill; verl runs verl's own loss layout


def _leaves(model, prefix=()):
    from pydantic import BaseModel

    for name, f in model.model_fields.items():
        a = f.annotation
        if isinstance(a, type) and issubclass(a, BaseModel):
            yield from _leaves(a, (*prefix, name))
        else:
            yield ".".join((*prefix, name))


def _get(conf, dotted):
    node = conf
    for k in dotted.split("."):
        if k not in node:  # a key only some recipes write (e.g. our sampler's kwargs)
            return None
        node = node[k]
    return node


def test_table_covers_every_recipe_key_exactly_once():
    keys = [k for row in TABLE for k in row.keys]
    assert sorted(keys) == sorted(_leaves(Recipe)), set(keys) ^ set(_leaves(Recipe))
    assert len(keys) == len(set(keys))
    assert {row.kind for row in TABLE} <= {"verl", "layer", "data", "meta", "other"}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_and_method_composes_or_is_refused_by_name(scenario, capsys):
    expected = {"long-cot/r1-distill-qwen-1.5b": "data.template"}  # tool-use: hermes, which verl's tool agent runs
    for method in METHODS:
        cfg = load_recipe(scenario, method, PER_GROUP + list(METHODS[method].required_example))
        refused = [k for k, _ in refusals(cfg)]
        if scenario in expected:
            assert refused == [expected[scenario]]
            continue
        assert refused == []
        conf = compose(verl_overrides(cfg))
        assert conf.actor_rollout_ref.rollout.n == cfg.rollout.n
        assert conf.actor_rollout_ref.actor.policy_loss.loss_mode == "stare_layer"
        assert conf.stare.recipe.method.name == method  # the method layer's recipe travels in verl's config
    assert scenario in expected or "All configuration checks passed" in capsys.readouterr().out


# Every translated key, one override at a time: the value reaches the verl key verl reads (composed).
PROBES = [
    ("model.path=/models/m", {"actor_rollout_ref.model.path": "/models/m"}),
    ("model.dtype=bfloat16", {"actor_rollout_ref.rollout.dtype": "bfloat16"}),
    ("model.trust_remote_code=true", {"actor_rollout_ref.model.trust_remote_code": True, "data.trust_remote_code": True}),
    ("data.template=raw", {"actor_rollout_ref.model.custom_chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}),
    ("model.chat_template=none", {"actor_rollout_ref.model.custom_chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}),
    ("data.shuffle=false", {"data.shuffle": False}),
    ("rollout.n=5", {"actor_rollout_ref.rollout.n": 5}),
    ("rollout.temperature=0.6", {"actor_rollout_ref.rollout.temperature": 0.6}),
    ("rollout.top_p=0.9", {"actor_rollout_ref.rollout.top_p": 0.9}),
    ("rollout.top_k=20", {"actor_rollout_ref.rollout.top_k": 20}),
    ("rollout.max_prompt_tokens=512", {"data.max_prompt_length": 512, "data.truncation": "left"}),
    ("rollout.max_response_tokens=2048", {"data.max_response_length": 2048}),
    ("method.dynamic_sampling=false", {"algorithm.filter_groups.enable": False, "data.gen_batch_size": 64}),
    ("optim.lr=3e-6", {"actor_rollout_ref.actor.optim.lr": 3e-6}),
    ("optim.schedule=cosine", {"actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine"}),
    ("optim.warmup_steps=7", {"actor_rollout_ref.actor.optim.lr_warmup_steps": 7}),
    ("optim.weight_decay=0.1", {"actor_rollout_ref.actor.optim.weight_decay": 0.1}),
    ("optim.grad_clip=0.5", {"actor_rollout_ref.actor.optim.clip_grad": 0.5}),
    ("optim.train_batch_size=128", {"data.train_batch_size": 128}),
    ("optim.mini_batch_size=32", {"actor_rollout_ref.actor.ppo_mini_batch_size": 32}),
    ("optim.micro_batch_tokens=10000", {"actor_rollout_ref.actor.use_dynamic_bsz": True,
                                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 10000}),
    ("optim.micro_batch_tokens=null", {"actor_rollout_ref.actor.use_dynamic_bsz": False,
                                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2}),
    ("optim.ppo_epochs=2", {"actor_rollout_ref.actor.ppo_epochs": 2}),
    ("optim.total_steps=77", {"trainer.total_training_steps": 77}),
    ("optim.seed=9", {"data.seed": 9, "actor_rollout_ref.actor.data_loader_seed": 9}),
    ("optim.precision=bf16", {"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "bf16",
                              "actor_rollout_ref.actor.fsdp_config.model_dtype": "fp32"}),
    ("method.adv_estimator=drgrpo", {"algorithm.norm_adv_by_std_in_grpo": False}),
    ("method.clip_high=0.3", {"actor_rollout_ref.actor.clip_ratio_high": 0.3}),
    ("method.clip_low=0.1", {"actor_rollout_ref.actor.clip_ratio_low": 0.1}),
    ("method.dual_clip=5.0", {"actor_rollout_ref.actor.clip_ratio_c": 5.0}),
    ("method.loss_agg=seq-mean-token-mean", {"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"}),
    ("method.entropy_coef=0.01", {"actor_rollout_ref.actor.entropy_coeff": 0.0,
                                  "actor_rollout_ref.actor.calculate_entropy": True}),
    ("eval.every=5", {"trainer.test_freq": 5}),
    ("eval.n=8", {"actor_rollout_ref.rollout.val_kwargs.n": 8}),
    ("eval.temperature=0.8", {"actor_rollout_ref.rollout.val_kwargs.temperature": 0.8}),
    ("eval.top_p=0.95", {"actor_rollout_ref.rollout.val_kwargs.top_p": 0.95}),
    ("backend.verl.nnodes=3", {"trainer.nnodes": 3}),
    ("backend.verl.n_gpus_per_node=4", {"trainer.n_gpus_per_node": 4}),
    ("backend.verl.tensor_parallel_size=2", {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}),
    ("backend.verl.gpu_memory_utilization=0.5", {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.5}),
    ("logging.wandb=disabled", {"trainer.logger": ["console"]}),
    ("logging.project=p2", {"trainer.project_name": "p2"}),
    ("logging.run_name=r2", {"trainer.experiment_name": "r2"}),
    ("checkpoint.every=3", {"trainer.save_freq": 3}),
    ("checkpoint.keep_last=5", {"trainer.max_actor_ckpt_to_keep": 5}),
    ('backend.verl.extra_overrides=["trainer.balance_batch=False"]', {"trainer.balance_batch": False}),
    # the official generation batches (rollout.refill: gen_batches, the paper default): our verl sampler
    ("rollout.refill=gen_batches", {"trainer.v1.sampler.custom_sampler.name": "OfficialGenBatches",
                                    "trainer.v1.sampler.custom_sampler.path": "pkg://stare_cli.backends.verl_sampler",
                                    "trainer.v1.sampler.sampler_kwargs.gen_batch_size": 192,
                                    "trainer.v1.sampler.sampler_kwargs.max_gen_batches": 10,
                                    "algorithm.filter_groups.max_num_gen_batches": 10, "data.gen_batch_size": 1}),
]


@pytest.mark.parametrize("override,expect", PROBES, ids=[p[0] for p in PROBES])
def test_each_translated_key_reaches_verls_config(override, expect):
    base = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", PER_GROUP)))
    conf = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", [*PER_GROUP, override])))
    for key, want in expect.items():
        got = _get(conf, key)
        got = list(got) if hasattr(got, "__iter__") and not isinstance(got, str) else got
        assert got == (pytest.approx(want) if isinstance(want, float) else want), (key, got)
    changed = [k for k in expect if _get(base, k) != _get(conf, k)]
    assert changed, f"{override} changed none of {list(expect)}: the probe must not test a default"


@pytest.mark.parametrize("override,key", [
    ("rollout.on_short_batch=train", "rollout.on_short_batch"),
    ("backend.verl.nnodes=3", "optim.official_ranks"),  # 16 official ranks do not split over 24 GPUs
    ("rollout.truncated=mask", "rollout.truncated"),
    ("optim.schedule=linear", "optim.schedule"),
    ("data.template=r1", "data.template"),
    ("rollout.engine=hf", "rollout.engine"),
    ("rollout.vllm_gpu_memory_utilization=0.5", "rollout.vllm_gpu_memory_utilization"),
    ("eval.max_tokens=100", "eval.max_tokens"),
    ("eval.n=null", "eval.n"),
])
def test_values_verl_cannot_honour_fail_validation_by_name(cli, override, key):
    extra = {"eval.n": ["-o", "eval.benchmarks=[aime24,math500]"],
             "rollout.on_short_batch": ["-o", "rollout.refill=gen_batches"],
             "optim.official_ranks": ["-o", "optim.loss_layout=official"]}.get(key, [])
    code, out, err = cli("recipes", "validate", "short-cot/qwen2.5-math-7b", "--backend", "verl",
                         "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global", "-o", override, *extra)
    assert code == 1 and f"{key}: " in err, err
    code, out, err = cli("train", "-r", "short-cot/qwen2.5-math-7b", "-m", "stare-o1", "--backend", "verl", "--dry-run",
                         "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global", "-o", override, *extra)
    assert code == 1 and err.startswith(f"error: {key}: the verl backend cannot honour") and len(err.splitlines()) == 1


def test_verl_keys_mirror_the_official_short_cot_values():
    """The paper's algorithmic values reach verl's config (the official scripts' keys, ../shared/paper)."""
    conf = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", PER_GROUP)))
    official = {
        "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True,
        "algorithm.use_kl_in_reward": False, "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "acc", "actor_rollout_ref.actor.clip_ratio_low": 0.2,
        "actor_rollout_ref.actor.clip_ratio_high": 0.28, "actor_rollout_ref.actor.clip_ratio_c": 10.0,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "actor_rollout_ref.actor.optim.lr": 1e-6,
        "actor_rollout_ref.actor.optim.clip_grad": 1.0, "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
        "actor_rollout_ref.actor.ppo_epochs": 1, "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 8192, "data.train_batch_size": 64,
        "data.max_prompt_length": 1024, "data.max_response_length": 3072, "data.truncation": "left",
        "actor_rollout_ref.rollout.n": 8, "actor_rollout_ref.rollout.temperature": 1.0,
        "actor_rollout_ref.rollout.top_p": 1.0, "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,
        "actor_rollout_ref.rollout.val_kwargs.top_p": 0.7, "actor_rollout_ref.rollout.val_kwargs.n": 32,
        "trainer.test_freq": 10, "trainer.save_freq": 10,
    }
    for key, want in official.items():
        got = _get(conf, key)
        assert got == (pytest.approx(want) if isinstance(want, float) else want), (key, got, want)
    layer = MethodLayer.from_recipe(load_recipe(None, None, []).model_validate(dict(conf.stare.recipe)))
    s = layer.cfg.stare  # the official stare.* keys reach the method layer rebuilt from verl's config
    assert (layer.spec.stare, s.P, s.W, s.M, s.h_tgt, s.adaptive, s.scope) == ("o1", 0.1, 1.1, 0.9, 0.3, False, "official")
    assert (s.alpha, s.w_max, s.m_min) == (0.01, 1.5, 0.5) and layer.recipe.reward.fn == "stare-official"


def test_driver_step_runs_the_method_layer():
    """One batch of two responses (groups 0 and 1, two responses each), hand-computed."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    old = -torch.tensor([[0.1, 3.0, 0.2, 9.0], [5.0, 0.1, 0.1, 0.1], [1.0, 2.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    ent = torch.full((4, 4), 0.1)
    scores = torch.zeros(4, 4)
    scores[0, 2] = 1.0  # response 0 right, response 1 wrong (group a); group b: both wrong
    uids = ["a", "a", "b", "b"]
    cfg = load_recipe("short-cot/qwen2.5-math-7b", "stare-c2", [*PER_GROUP, "method.stare.P=0.34",
                                                                "method.stare.scope=batch"])
    layer = MethodLayer.from_recipe(cfg)
    out = driver_step(layer, cfg.model_dump(mode="json"), uids, scores, mask, old, ent, 1)
    # GRPO: group a: mean 0.5, unbiased std of [1, 0] = 0.7071 -> A = +-0.5 / 0.7071 = +-0.7071; group b: 0.
    # Gate on (H = 0.1 < 0.3).
    # T+ = 3 tokens of row 0, k = int(3 * 0.34 + 0.999999) = 2: surprisal 3.0 and 0.2 get W = 1.1;
    # T- = 4 tokens of row 1, k = 2: 5.0, then the first of the tied 0.1s (position order).
    a = 0.5 / (0.70710678 + 1e-6)
    want = torch.tensor([[a, 1.1 * a, 1.1 * a, 0], [-0.9 * a, -0.9 * a, -a, -a], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert_close(out.advantages, want)
    assert out.metrics["stare/gate"] == 1.0 and out.payload["state"] == {"gate": True, "W": 1.1, "M": 0.9, "entropy_coef": 0.0}
    official = MethodLayer.from_recipe(load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", PER_GROUP))
    out = driver_step(official, {}, uids, scores, mask, old, ent, 1)
    assert_close(out.advantages[0], torch.tensor([a, a, a, 0.0]))  # official scope: weights come in the loss
    assert "stare/sel_pos" not in out.metrics


def test_dry_run_and_job_script(cli, tmp_path):
    code, out, err = cli("train", "--recipe", "short-cot/qwen2.5-math-7b", "--method", "stare-o1",
                         "--backend", "verl", "--dry-run", "-o", "optim.loss_layout=global")
    assert code == 0, err
    lines = out.strip().splitlines()
    # the official dynamic sampling, no override needed: 192-prompt generation batches, at most 10
    assert "trainer.v1.sampler.custom_sampler.name=OfficialGenBatches" in lines
    assert "+trainer.v1.sampler.sampler_kwargs.gen_batch_size=192" in lines
    assert "+trainer.v1.sampler.sampler_kwargs.max_gen_batches=10" in lines
    assert "algorithm.filter_groups.metric=acc" in lines
    assert "# dynamic sampling on acc: generation batches of 192 prompts, at most 10, then an error" in lines
    code, out, err = cli("train", "--recipe", "short-cot/qwen2.5-math-7b", "--method", "stare-o1", "--backend", "verl",
                         "--dry-run")  # the paper recipe as it is: the official loss layout too
    assert code == 0, err
    assert ("# loss layout: official (16 emulated ranks on 8 GPU(s), verl 0.7 micro-batches of 8192 tokens, each "
            "normalised by its own tokens)") in out.splitlines()
    assert "actor_rollout_ref.actor.shuffle=False" in out.splitlines()
    assert "# stare: variant=o1 scope=official P=0.1 W=1.1 M=0.9 h_tgt=0.3 adaptive=False alpha=0.01 w_max=1.5 m_min=0.5" in lines
    assert any(line.startswith("# reward: stare-official") for line in lines)
    assert "actor_rollout_ref.actor.clip_ratio_high=0.28" in lines
    assert "actor_rollout_ref.model.external_lib=stare_cli.backends.verl_ext" in lines
    assert "reward.reward_manager.module.path='pkg://stare_cli.backends.verl_reward'" in lines
    assert any(line.startswith("+stare.recipe={name:'short-cot/qwen2.5-math-7b'") for line in lines)
    script = tmp_path / "job.sh"
    data = tmp_path / "shared" / "data" / "short-cot-qwen2.5-math-7b"  # `stare data prepare` puts it here
    data.mkdir(parents=True)
    (data / "train.parquet").touch()  # checked for, not read, when the script is written
    code, out, err = cli("train", "--recipe", "short-cot/qwen2.5-math-7b", "--method", "stare-o1", "--backend", "verl",
                         "--emit-script", str(script), "--shared-dir", str(tmp_path / "shared"),
                         "-o", "rollout.refill=per_group", "-o", "optim.loss_layout=global")
    assert code == 0, err
    assert Path(out.strip()).parent == tmp_path / "shared" / "runs"
    text = script.read_text()
    assert "ray job submit" in text and "VERL_USE_EXTERNAL_MODULES" in text and "verl.trainer.main_ppo" in text
    env = json.loads(text.split("--runtime-env-json=")[1].split(" -- ")[0].strip("'"))
    assert set(env["env_vars"]) == {"VERL_USE_EXTERNAL_MODULES"}  # module names only, no configuration


def test_data_prepare_writes_verl_parquet(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("STARE_DATA_DIR", str(FIXTURE_DATA))
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "target": str(i + 1)}) + "\n" for i in range(5)))
    code, out, err = cli("data", "prepare", "--recipe", "short-cot/qwen2.5-math-7b", "--out", str(tmp_path / "d"),
                         "-o", f"data.train={train}", "-o", "eval.benchmarks=[minerva]", "--limit", "3")
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "d" / "train.parquet")
    assert len(df) == 3 and df.iloc[0]["reward_model"]["ground_truth"] == "1"
    assert df.iloc[0]["prompt"][0]["content"].endswith("within \\boxed{}.")
    bench = pd.read_parquet(tmp_path / "d" / "minerva.parquet")
    assert set(bench["data_source"]) == {"minerva"} and len(bench) == 3


def _reward_item(tok, response: str, gold: str, max_len: int):
    import numpy as np

    from verl import DataProto

    ids = tok(response, add_special_tokens=False)["input_ids"][:max_len]
    prompt = tok("Compute 1+1.\n", add_special_tokens=False)["input_ids"]
    resp = torch.tensor(ids + [tok.pad_token_id or 0] * (max_len - len(ids)))
    attn = torch.tensor([1] * len(prompt) + [1] * len(ids) + [0] * (max_len - len(ids)))
    return DataProto.from_dict({"prompts": torch.tensor([prompt]), "responses": resp[None], "attention_mask": attn[None]},
                               non_tensors={"reward_model": np.array([{"ground_truth": gold}], dtype=object)})


def test_reward_manager_is_the_method_layers_score(quick_toy):
    from omegaconf import OmegaConf

    from benchmarks.generation.engines import load_tokenizer
    from stare_cli.backends.verl_reward import StareRewardManager

    tok = load_tokenizer(str(quick_toy))
    cfg = load_recipe("tiny/arith", "grpo-ds", ["reward.fn=stare-official", "reward.format_penalty=true",
                                                "rollout.truncated=zero"])
    conf = OmegaConf.create({"stare": {"recipe": cfg.model_dump(mode="json")}, "data": {"max_response_length": 16}})
    manager = StareRewardManager(conf, tok)
    try:
        run = lambda text, gold: manager.loop.run_until_complete(  # noqa: E731
            manager.run_single(_reward_item(tok, text, gold, 16)))
        right = run("= \\boxed{2}" + tok.eos_token, "2")
        assert right["reward_score"] == 1.0 and right["reward_extra_info"] == {"acc": 1.0, "format": 1.0, "official_score": 1.0}
        wrong = run("= \\boxed{3}" + tok.eos_token, "2")
        assert wrong["reward_score"] == 0.0 and wrong["reward_extra_info"]["acc"] == 0.0
        no_format = run("2" + tok.eos_token, "2")  # no box: the format check fails -> -1 (format_penalty)
        assert no_format["reward_score"] == -1.0 and no_format["reward_extra_info"]["format"] == 0.0
        cut = run("= \\boxed{2} " + "1 " * 40, "2")  # fills the 16-token budget without EOS: zero under truncated: zero
        assert cut["reward_score"] == 0.0 and cut["reward_extra_info"]["acc"] == 0.0
    finally:
        manager.layer.close()


def test_tool_config_loads_through_verls_loader_and_runs_our_sandbox(tmp_path):
    import asyncio

    import yaml

    from stare_cli.backends.verl_tools import SandboxTool, tool_config
    from verl.tools.tool_registry import initialize_tools_from_config

    cfg = load_recipe("tool-use/qwen2.5-7b", "stare-o1", PER_GROUP)
    assert refusals(cfg) == []  # hermes: the protocol verl's tool agent parses
    md = load_recipe("tool-use/qwen2.5-7b", "stare-o1", [*PER_GROUP, "rollout.tools.format=markdown"])
    assert [k for k, _ in refusals(md)] == ["rollout.tools.format"]  # markdown blocks: refused by name on verl
    sp = load_recipe("tool-use/qwen2.5-7b", "stare-o1", [*PER_GROUP, "rollout.tools.system_prompt=Use Python."])
    assert [k for k, _ in refusals(sp)] == ["rollout.tools.system_prompt"]
    from benchmarks.generation.tools import tool_limits

    (tmp_path / "tools.yaml").write_text(yaml.safe_dump(tool_config(tool_limits(cfg.rollout.tools))))
    (tool,) = initialize_tools_from_config(str(tmp_path / "tools.yaml"))  # verl's own loader
    assert isinstance(tool, SandboxTool)

    async def call(code):
        iid, _ = await tool.create()
        resp, reward, metrics = await tool.execute(iid, {"code": code})
        await tool.release(iid)
        return resp.text, metrics["status"]

    assert asyncio.run(call("print(6 * 7)")) == ("42", "ok")
    text, status = asyncio.run(call("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9', timeout=2)"))
    assert status == "error" and "[error]" in text


def test_cpu_device_overrides_compose_and_validate():
    cfg = load_recipe("tiny/arith", "stare-o1", ["backend.verl.device=cpu", "optim.micro_batch_size=16", *PER_GROUP])
    ov = verl_overrides(cfg)
    conf = compose(ov)
    assert conf.actor_rollout_ref.rollout.name == "hf" and conf.trainer.device == "cpu"
    assert conf.ray_kwargs.ray_init.num_gpus == 1 and conf.actor_rollout_ref.model.use_remove_padding is False
    # the recipe's algorithmic values are untouched by the CPU path
    assert conf.actor_rollout_ref.actor.clip_ratio_high == 0.28 and conf.algorithm.filter_groups.enable is True
    assert sum(o.startswith("trainer.n_gpus_per_node=") for o in ov) == 1


def test_hf_rollout_server_batches_requests_and_takes_weights(quick_toy):
    import asyncio

    import torch
    from safetensors.torch import load_file

    from stare_cli.backends.verl_cpu import HFServer

    server = HFServer(str(quick_toy), response_length=12, prompt_length=16, seed=0)
    calls = []
    orig = server.model.generate
    server.model.generate = lambda *a, **k: calls.append(k["input_ids"].shape) or orig(*a, **k)
    prompts = [[3, 32, 17, 26, 18, 29, 34], [3, 32, 18, 29, 34]]

    async def go():
        return await asyncio.gather(*[server.generate(p, {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                          "logprobs": True}, f"r{i}") for i, p in enumerate(prompts * 3)])

    outs = asyncio.run(go())
    assert calls == [(6, 7)]  # six concurrent requests, one left-padded batch
    for o in outs:
        assert 1 <= len(o.token_ids) <= 12 and len(o.log_probs) == len(o.token_ids)
        assert all(lp <= 0 for lp in o.log_probs)
        assert o.stop_reason in ("completed", "length")
        assert (o.stop_reason == "completed") == (o.token_ids[-1] in server.eos_ids)
    state = load_file(str(quick_toy / "model.safetensors"))
    zeroed = {k: torch.zeros_like(v) for k, v in state.items()}
    assert server.load_weights(zeroed, global_steps=3) == len(state)
    assert all(float(p.detach().abs().sum()) == 0 for p in server.model.parameters())
    assert asyncio.run(server.generate([3, 32], {"temperature": 0}, "x")).extra_fields["global_steps"] == 3
    with pytest.raises(KeyError, match="does not have"):
        server.load_weights({"not.a.weight": torch.zeros(1)}, global_steps=4)


def test_resume_refuses_run_directories_stare_did_not_create(cli, tmp_path):
    """verl's checkpoint loaders unpickle: a folder without our meta.json is not resumed."""
    from stare_cli.core.recipes import recipe_to_yaml

    run = tmp_path / "foreign"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(recipe_to_yaml(load_recipe("tiny/arith", "stare-o1", [*PER_GROUP, "backend.name=verl"])))
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    code, _, err = cli("train", "--resume", str(run))
    assert code == 1 and "not a run directory stare created (no meta.json)" in err and "trust" in err


def test_resuming_a_finished_verl_run_says_so_and_launches_nothing(cli, tmp_path, monkeypatch):
    """Issue 31: a --resume of a run already at optim.total_steps exited 0 without a word."""
    from stare_cli.backends import verl_backend
    from stare_cli.core.recipes import recipe_to_yaml

    run = tmp_path / "done"
    (run / "checkpoints" / "global_step_2" / "actor").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    cfg = load_recipe("tiny/arith", "stare-o1", [*PER_GROUP, "backend.name=verl", "optim.total_steps=2"])
    (run / "config.yaml").write_text(recipe_to_yaml(cfg))
    (run / "meta.json").write_text("{}")
    monkeypatch.setattr(verl_backend, "verl_overrides", lambda *a, **k: pytest.fail("verl was set up for a finished run"))
    code, out, err = cli("train", "--resume", str(run))
    assert code == 0 and "is finished" in err and "optim.total_steps (2)" in err, err


@pytest.mark.parametrize("override, owner", [
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "method.loss_agg"),  # ran while the recipe said token-mean
    ("+actor_rollout_ref.actor.clip_ratio_low=0.3", "method.clip_low"),
])
def test_an_extra_override_of_a_key_the_recipe_owns_is_refused_naming_both(override, owner):
    """Issue 29, item 5: extra_overrides silently won over the recipe's own translated keys."""
    from stare_kernel.errors import StareError

    cfg = load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", [*PER_GROUP, f'backend.verl.extra_overrides=["{override}"]'])
    with pytest.raises(StareError) as e:
        verl_overrides(cfg)
    key = override.split("=")[0].lstrip("+")
    assert "backend.verl.extra_overrides" in str(e.value) and key in str(e.value) and owner in str(e.value)
