"""The verl backend without GPUs: generated overrides compose into verl's full config offline and
pass verl's validate_config for every scenario x method; the paper's algorithmic keys match the
official Short-CoT scripts; the driver-side transforms; dry-run, job script and data preparation."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from torch.testing import assert_close

from baselines.registry import METHODS
from conftest import BENCH_DATA
from stare_cli.backends.verl_backend import compose, method_payload, verl_overrides
from stare_cli.backends.verl_ext import make_controller, transform_advantages
from stare_cli.recipes import load_recipe

SCENARIOS = ["short-cot/qwen2.5-math-7b", "short-cot/qwen2.5-14b-instruct", "short-cot/qwen2.5-32b",
             "long-cot/r1-distill-qwen-1.5b", "long-cot/qwen3-8b", "tool-use/qwen2.5-7b"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_and_method_composes_and_validates(scenario, capsys):
    for method in METHODS:
        cfg = load_recipe(scenario, method)
        conf = compose(verl_overrides(cfg))
        assert conf.actor_rollout_ref.rollout.n == cfg.rollout.n
    assert "All configuration checks passed" in capsys.readouterr().out


# The official Short-CoT Qwen2.5-Math-7B scripts (../shared/paper/README.md), key by key.
OFFICIAL = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.filter_groups.enable": True,
    "algorithm.filter_groups.max_num_gen_batches": 10,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,
    "actor_rollout_ref.actor.clip_ratio_c": 10.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "data.train_batch_size": 64,
    "data.gen_batch_size": 192,
    "data.max_prompt_length": 1024,
    "data.max_response_length": 3072,
    "actor_rollout_ref.rollout.n": 8,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.7,
    "actor_rollout_ref.rollout.val_kwargs.n": 32,
}


def _get(conf, dotted):
    node = conf
    for k in dotted.split("."):
        node = node[k]
    return node


@pytest.mark.parametrize("method", ["stare-o1", "grpo-ds"])
def test_official_algorithmic_keys(method):
    cfg = load_recipe("short-cot/qwen2.5-math-7b", method)
    conf = compose(verl_overrides(cfg))
    for key, want in OFFICIAL.items():
        got = _get(conf, key)
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, (key, got, want)
    payload = method_payload(cfg)
    if method == "stare-o1":
        assert payload["stare"] == "o1"
        s = payload["stare_cfg"]
        assert (s["P"], s["W"], s["M"], s["h_tgt"], s["adaptive"]) == (0.1, 1.1, 0.9, 0.3, False)
        assert (s["alpha"], s["w_max"], s["m_min"]) == (0.01, 1.5, 0.5)
    else:
        assert payload["stare"] is None


def test_verl_native_methods_map_to_verl_losses():
    conf = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", "kl-cov")))
    assert conf.actor_rollout_ref.actor.policy_loss.loss_mode == "kl_cov"
    assert conf.actor_rollout_ref.actor.policy_loss.kl_cov_ratio == pytest.approx(0.002)
    assert conf.actor_rollout_ref.actor.policy_loss.ppo_kl_coef == pytest.approx(1.0)
    conf = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", "dapo")))
    assert conf.reward.reward_manager.name == "dapo"
    assert conf.reward.reward_kwargs.overlong_buffer_cfg.len == 512
    conf = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", "grpo")))
    assert conf.algorithm.filter_groups.enable is False and conf.data.gen_batch_size == 64


def test_driver_transforms():
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    old = -torch.tensor([[0.1, 3.0, 0.2, 9.0], [5.0, 0.1, 0.1, 0.1]])
    ent = torch.tensor([[0.5, 2.0, 0.1, 9.0], [0.2, 0.3, 0.4, 3.0]])
    rewards = torch.tensor([[0, 0, 0, 1.0], [0, 0, 0, 0.0]])
    cfg = load_recipe("short-cot/qwen2.5-math-7b", "stare-c2", ["method.stare.P=0.34"])
    payload = method_payload(cfg)
    ctl = make_controller(payload)
    ctl.update(0.1)  # H < 0.3: gate on
    out, m = transform_advantages(payload, ctl, adv, mask, old, ent, rewards)
    # T+ = 3 tokens, k = ceil(0.34 * 3) = 2: surprisal 3.0 and 0.2 get W; T- = 4 tokens, k = 2: 5.0 and the first 0.1
    assert_close(out, torch.tensor([[1.0, 1.1, 1.1, 0.0], [-0.9, -0.9, -1.0, -1.0]]))
    assert m["stare/gate"] == 1.0
    ctl.update(0.9)
    out, _ = transform_advantages(payload, ctl, adv, mask, old, ent, rewards)
    assert torch.equal(out, adv)  # gate off: plain GRPO
    w = method_payload(load_recipe("short-cot/qwen2.5-math-7b", "w-reinforce"))
    out, _ = transform_advantages(w, None, adv, mask, old, ent, rewards)
    assert_close(out, torch.tensor([[0.1, 0.1, 0.1, 0.0], [-1.0, -1.0, -1.0, -1.0]]))
    top = method_payload(load_recipe("short-cot/qwen2.5-math-7b", "80-20", ["method.top_entropy_frac=0.25"]))
    out, _ = transform_advantages(top, None, adv, mask, old, ent, rewards)
    # 7 valid tokens, round(0.25 * 7) = 2 highest entropies: 2.0 (row 0) and 3.0 (row 1)
    assert_close(out, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]]))


def test_dry_run_and_job_script(cli, tmp_path):
    code, out, err = cli("train", "--recipe", "short-cot/qwen2.5-math-7b", "--method", "stare-o1",
                         "--backend", "verl", "--dry-run")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert "actor_rollout_ref.actor.clip_ratio_high=0.28" in lines
    assert "actor_rollout_ref.model.external_lib=stare_cli.backends.verl_ext" in lines
    script = tmp_path / "job.sh"
    code, out, err = cli("train", "--recipe", "short-cot/qwen2.5-math-7b", "--method", "stare-o1", "--backend", "verl",
                         "--emit-script", str(script), "--out", str(tmp_path / "runs"))
    assert code == 0, err
    text = script.read_text()
    assert "ray job submit" in text and "VERL_USE_EXTERNAL_MODULES" in text and "verl.trainer.main_ppo" in text
    env = json.loads(text.split("--runtime-env-json=")[1].split(" -- ")[0].strip("'"))
    assert json.loads(env["env_vars"]["STARE_VERL_METHOD"])["stare"] == "o1"


def test_data_prepare_writes_verl_parquet(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("STARE_DATA_DIR", str(BENCH_DATA))
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "solution": str(i + 1)}) + "\n" for i in range(5)))
    code, out, err = cli("data", "prepare", "--recipe", "short-cot/qwen2.5-math-7b", "--out", str(tmp_path / "d"),
                         "-o", f"data.train={train}", "--limit", "3")
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "d" / "train.parquet")
    assert len(df) == 3 and df.iloc[0]["reward_model"]["ground_truth"] == "1"
    assert df.iloc[0]["prompt"][0]["content"].endswith("within \\boxed{}.")
    bench = pd.read_parquet(tmp_path / "d" / "minerva.parquet")
    assert set(bench["data_source"]) == {"minerva"} and len(bench) == 3


def test_reward_function_matches_the_grader():
    from stare_cli.backends.verl_reward import compute_score

    assert compute_score("aime24", "so \\boxed{\\dfrac12}", "\\frac{1}{2}") == {"score": 1.0, "acc": True}
    assert compute_score("math500", "so \\boxed{3}", "4")["acc"] is False


def test_tool_use_recipe_configures_verls_tool_agent_with_our_sandbox(tmp_path):
    import asyncio

    import yaml

    from stare_cli.backends.verl_tools import SandboxTool, tool_config
    from verl.tools.tool_registry import initialize_tools_from_config

    cfg = load_recipe("tool-use/qwen2.5-7b", "stare-o1")
    conf = compose(verl_overrides(cfg, run_dir=tmp_path))
    mt = conf.actor_rollout_ref.rollout.multi_turn
    assert mt.enable is True and mt.tool_config_path == str(tmp_path / "tools.yaml") and mt.max_assistant_turns == 5
    assert conf.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
    t = cfg.rollout.tools
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump(tool_config(t.cpu_s, t.wall_s, t.memory_mb, t.output_bytes)))
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
    from stare_cli.backends.verl_backend import compose, verl_overrides
    from stare_cli.recipes import load_recipe

    cfg = load_recipe("tiny/arith", "stare-o1", ["backend.verl.device=cpu", "optim.micro_batch_size=16"])
    ov = verl_overrides(cfg)
    conf = compose(ov)
    assert conf.actor_rollout_ref.rollout.name == "hf" and conf.trainer.device == "cpu"
    assert conf.ray_kwargs.ray_init.num_gpus == 1 and conf.actor_rollout_ref.model.use_remove_padding is False
    # the recipe's algorithmic values are untouched by the CPU path
    assert conf.actor_rollout_ref.actor.clip_ratio_high == 0.28 and conf.algorithm.filter_groups.enable is True
    assert sum(o.startswith("trainer.n_gpus_per_node=") for o in ov) == 1


def test_stare_micro_batch_scope_is_refused_on_verl():
    from stare_cli.backends.verl_backend import method_payload
    from stare_cli.errors import StareError
    from stare_cli.recipes import load_recipe

    cfg = load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", ["method.stare.scope=micro_batch"])
    with pytest.raises(StareError, match="scope=micro_batch"):
        method_payload(cfg)


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
