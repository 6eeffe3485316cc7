"""Parity with verl 0.9.1's core_algos on random inputs (the test extra installs verl).

Each check draws fresh random inputs with masked tokens, a fully masked row and a zero-variance
group, and compares with default tolerances of torch.testing.assert_close (float32: 1.3e-6 rtol).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from baselines import Agg, agg_loss, grpo_advantage
from baselines.losses import clip_cov_loss, gspo_loss, kl_cov_loss, ppo_clip_loss

# A hard import: `make test` installs the verl extra, and a missing verl must fail, not skip.
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig  # noqa: E402


def _config(loss_mode="vanilla", clip_high=0.28, c=10.0, clip_low=0.2, **policy_loss):
    return FSDPActorConfig(
        ppo_micro_batch_size_per_gpu=4, rollout_n=4, ppo_mini_batch_size=4,
        clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=c,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy_loss),
    )


def _inputs(seed, B=16, T=48):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    new = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    adv[2] = 0.0
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[5] = 0.0
    return new, old, adv, mask


SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_high,c", [(0.28, 10.0), (0.2, 3.0)])
def test_ppo_clip_matches_verl_vanilla(seed, clip_high, c):
    new, old, adv, mask = _inputs(seed)
    ref, ref_m = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
        config=_config(clip_high=clip_high, c=c),
    )
    ours, st = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=clip_high, dual_clip=c)
    assert_close(ours, ref)
    assert st["clip_frac"].item() == pytest.approx(ref_m["actor/pg_clipfrac"], abs=1e-6)
    assert st["clip_frac_lower"].item() == pytest.approx(ref_m["actor/pg_clipfrac_lower"], abs=1e-6)
    assert st["ppo_kl"].item() == pytest.approx(ref_m["actor/ppo_kl"], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_verl(seed):
    new, old, adv, mask = _inputs(seed)
    new = old + 0.0005 * (new - old)  # inside GSPO's tiny clip range for some sequences
    cfg = _config("gspo", clip_low=3e-4, clip_high=4e-4)
    ref, _ = core_algos.compute_policy_loss_gspo(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="seq-mean-token-mean", config=cfg
    )
    ours, _ = gspo_loss(new, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    assert_close(ours, ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_matches_verl_with_same_rng(seed):
    new, old, adv, mask = _inputs(seed)
    new.requires_grad_(True)
    cfg = _config("clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-5.0, clip_cov_ub=5.0)
    torch.manual_seed(1234)  # verl draws from the global RNG
    ref, ref_m = core_algos.compute_policy_loss_clip_cov(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", config=cfg
    )
    (g_ref,) = torch.autograd.grad(ref, new)
    ours, st = clip_cov_loss(
        new, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio_frac=0.05, cov_lb=-5.0, cov_ub=5.0,
        generator=torch.Generator().manual_seed(1234),
    )
    (g_ours,) = torch.autograd.grad(ours, new)
    assert_close(ours, ref)
    assert_close(g_ours, g_ref)  # the same tokens were detached
    assert st["clip_frac"].item() == pytest.approx(ref_m["actor/pg_clipfrac"], abs=1e-6)
    assert st["clip_frac"].item() > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_cov_matches_verl(seed):
    new, old, adv, mask = _inputs(seed)
    cfg = _config("kl_cov", kl_cov_ratio=0.02, ppo_kl_coef=1.0)
    ref, ref_m = core_algos.compute_policy_loss_kl_cov(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", config=cfg
    )
    ours, st = kl_cov_loss(new, old, adv, mask, ratio_frac=0.02, coef=1.0)
    assert_close(ours, ref)
    assert st["ppo_kl"].item() == pytest.approx(ref_m["actor/ppo_kl"], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_matches_verl(seed, mode):
    loss_mat, _, _, mask = _inputs(seed)
    assert_close(agg_loss(loss_mat, mask, Agg(mode)), core_algos.agg_loss(loss_mat, mask, mode))
    # with global counts, as in micro-batching
    n_tok, n_seq = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    assert_close(
        agg_loss(loss_mat, mask, Agg(mode, num_tokens=n_tok, num_seqs=n_seq, scale=100)),
        core_algos.agg_loss(loss_mat, mask, mode, batch_num_tokens=n_tok, global_batch_size=n_seq, loss_scale_factor=100),
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantage_matches_verl(seed, norm):
    g = torch.Generator().manual_seed(seed)
    groups = torch.arange(12).repeat_interleave(4)[:45]  # the last group has one response
    rewards = torch.randint(0, 2, (45,), generator=g).float() + 0.1 * torch.randn(45, generator=g)
    rewards[:4] = 1.0  # a zero-variance group
    T = 7
    mask = torch.ones(45, T)
    token_rewards = torch.zeros(45, T)
    token_rewards[:, -1] = rewards
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards, response_mask=mask, index=np.array(groups.tolist()), norm_adv_by_std_in_grpo=norm
    )
    ours = grpo_advantage(rewards, groups, norm_by_std=norm)
    assert_close(ours.unsqueeze(-1).expand(45, T), ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method,verl_fn,cfg_kw", [
    ("grpo-ds", "compute_policy_loss_vanilla", {}),
    ("kl-cov", "compute_policy_loss_kl_cov", {"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}),
    ("gspo", "compute_policy_loss_gspo", {}),
])
def test_registered_layer_loss_equals_verl_builtins(seed, method, verl_fn, cfg_kw):
    """Our policy loss in verl's registry (`stare_layer`, the method layer's loss) gives verl's own
    numbers for the methods verl also implements, with the recipe's parameters."""
    from stare_cli.backends.verl_ext import _CALL, _Call
    from stare_cli.method.layer import MethodLayer
    from stare_cli.core.resolve import load_recipe

    layer = MethodLayer.from_recipe(load_recipe("short-cot/qwen2.5-math-7b", method))
    new, old, adv, mask = _inputs(seed)
    if method == "gspo":
        new = old + 0.0005 * (new - old)
        cfg = _config("gspo", clip_low=3e-4, clip_high=4e-4)
    else:
        cfg = _config(verl_fn.removeprefix("compute_policy_loss_"), **cfg_kw)  # vanilla / kl_cov
    token = _CALL.set(_Call(layer, None, None))
    try:
        ours, m = core_algos.get_policy_loss_fn("stare_layer")(
            old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
            loss_agg_mode=layer.cfg.loss_agg, config=cfg)
    finally:
        _CALL.reset(token)
    ref, ref_m = getattr(core_algos, verl_fn)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                              loss_agg_mode=layer.cfg.loss_agg, config=cfg)
    assert_close(ours, ref)
    assert m["actor/ppo_kl"] == pytest.approx(ref_m["actor/ppo_kl"], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean"])
def test_aggregation_on_two_data_parallel_ranks_matches_verl(seed, mode):
    """verl_ext.verl_agg turns verl's global batch info into our Agg: on dp_size 2 each rank's loss is
    verl's (token-sum: the rank's sum x 2, since the ranks' gradients are averaged)."""
    from types import SimpleNamespace

    from stare_cli.backends.verl_ext import verl_agg

    loss_mat, _, _, mask = _inputs(seed)
    n_tok, n_seq = int(mask.sum()) * 2, int((mask.sum(-1) > 0).sum()) * 2  # this rank's half of the batch
    cfg = SimpleNamespace(global_batch_info={"dp_size": 2, "batch_num_tokens": n_tok, "global_batch_size": n_seq})
    assert_close(agg_loss(loss_mat, mask, verl_agg(mode, cfg)),
                 core_algos.agg_loss(loss_mat, mask, mode, dp_size=2, batch_num_tokens=n_tok, global_batch_size=n_seq))
