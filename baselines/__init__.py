"""Policy losses, advantage estimators and STARE itself: pure tensor functions, no I/O.

Public names: `stare_token_weights`, `StareController`, the losses in `baselines.losses`, the
advantages in `baselines.advantages`, and the method registry `baselines.registry.METHODS`,
and the token-budget micro-batch partition. Nothing here imports the CLI, the benchmarks or a backend.
"""

from baselines.advantages import dynamic_sampling_keep, grpo_advantage, overlong_penalty, w_reinforce_advantage
from baselines.aggregation import Agg, agg_loss
from baselines.diagnostics import quadrant_stats
from baselines.losses import clip_cov_loss, entro_adv, gspo_loss, kl_cov_loss, ppo_clip_loss, top_entropy_mask
from baselines.micro_batches import token_budget_micro_batches
from baselines.registry import METHODS, MethodSpec, UnknownMethodError, lookup_method
from baselines.stare import StareController, stare_positions, stare_scale, stare_sets, stare_token_weights

__all__ = [
    "Agg", "METHODS", "MethodSpec", "StareController", "UnknownMethodError", "agg_loss", "clip_cov_loss",
    "dynamic_sampling_keep", "entro_adv", "grpo_advantage", "gspo_loss", "kl_cov_loss", "lookup_method",
    "overlong_penalty", "ppo_clip_loss", "quadrant_stats", "stare_positions", "stare_scale", "stare_sets", "stare_token_weights",
    "token_budget_micro_batches", "top_entropy_mask", "w_reinforce_advantage",
]
