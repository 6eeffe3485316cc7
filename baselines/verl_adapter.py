"""Registers our policy losses into verl's registry under our method names (verl 0.9.x).

`register_all()` imports verl only when called, so nothing else in `baselines` needs verl. Each
registered function takes verl's keyword signature (old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights) and returns (loss, metrics of floats).
Token-level transforms that need the batch (STARE weights, the 80/20 mask, EntroAdv, W-REINFORCE)
are applied to the advantages in verl's driver (stare_cli/backends/verl_ext.py), so here every
method reduces to its policy loss, read from verl's actor config.
"""

from __future__ import annotations

from typing import Callable

from baselines.aggregation import Agg
from baselines.losses import clip_cov_loss, gspo_loss, kl_cov_loss, ppo_clip_loss
from baselines.registry import METHODS


def _agg(loss_agg_mode: str, config) -> Agg:
    info = dict(getattr(config, "global_batch_info", {}) or {})
    dp = info.get("dp_size", 1) or 1
    n_tok, n_seq = info.get("batch_num_tokens"), info.get("global_batch_size")
    # verl multiplies by dp_size after dividing by global counts; dividing the counts by dp is the same.
    return Agg(loss_agg_mode, num_tokens=None if n_tok is None else n_tok / dp,
               num_seqs=None if n_seq is None else n_seq / dp, scale=info.get("loss_scale_factor"))


def make_verl_loss(loss: str) -> Callable:
    def fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
           rollout_is_weights=None):
        if rollout_is_weights is not None:  # verl multiplies token losses by these; so does scaling A (w > 0)
            advantages = advantages * rollout_is_weights
        agg = _agg(loss_agg_mode, config)
        low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
        high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
        pl = config.policy_loss
        common = dict(log_prob=log_prob, old_log_prob=old_log_prob, adv=advantages, mask=response_mask, agg=agg)
        if loss == "ppo_clip":
            out, st = ppo_clip_loss(**common, clip_low=low, clip_high=high, dual_clip=config.get("clip_ratio_c", 3.0))
        elif loss == "gspo":
            out, st = gspo_loss(**common, clip_low=low, clip_high=high)
        elif loss == "clip_cov":
            out, st = clip_cov_loss(**common, clip_low=low, clip_high=high, ratio_frac=pl.clip_cov_ratio,
                                    cov_lb=pl.clip_cov_lb, cov_ub=pl.clip_cov_ub)
        else:
            out, st = kl_cov_loss(**common, ratio_frac=pl.kl_cov_ratio, coef=pl.ppo_kl_coef)
        names = {"clip_frac": "actor/pg_clipfrac", "clip_frac_lower": "actor/pg_clipfrac_lower", "ppo_kl": "actor/ppo_kl"}
        return out, {names.get(k, f"actor/{k}"): float(v.detach()) for k, v in st.items()}

    return fn


def register_all() -> list[str]:
    """Register every method's loss in verl under the method's name; returns the names."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    for name, spec in METHODS.items():
        register_policy_loss(name)(make_verl_loss(spec.loss))
    return list(METHODS)
