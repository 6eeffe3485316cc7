"""Outcome advantages, reward shaping and dynamic sampling as pure tensor functions.

Conventions follow verl's core_algos: GRPO uses the unbiased std of each group, and a group of one
response gets mean 0 and std 1 (so its advantage is r / (1 + eps)). Tensors are [B] (one entry per
response) unless stated; `group` holds any integer id per response (the prompt it answers).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _group_stats(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-response (mean, unbiased std, size) of its group, and the compact group index [B]."""
    _, inv = torch.unique(group, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.to(torch.float64)  # sums of many rewards in float64, like a careful reference
    count = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
    mean = total / count
    sq = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, inv, (r - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inv], std[inv], count[inv], inv


def grpo_advantage(rewards: Tensor, group: Tensor, eps: float = 1e-6, norm_by_std: bool = True) -> Tensor:
    """GRPO outcome advantage A_i = (r_i - mean_g r) / (std_g r + eps); Dr.GRPO drops the std.

    Args:
        rewards: [B] scalar reward of each response.
        group: [B] integer id of each response's prompt.
        eps: added to the std.
        norm_by_std: False gives Dr.GRPO (arXiv 2503.20783): A_i = r_i - mean_g r.
    Returns:
        [B] advantages, in the dtype of `rewards` (float32 for integer rewards).
    """
    mean, std, _, _ = _group_stats(rewards, group)
    r = rewards.to(torch.float64)
    adv = (r - mean) / (std + eps) if norm_by_std else r - mean
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(out_dtype)


def w_reinforce_advantage(rewards: Tensor, lam: float = 0.1) -> Tensor:
    """W-REINFORCE (arXiv 2506.01347): A = lambda for correct responses (r > 0), -1 otherwise.

    Args:
        rewards: [B] rewards; > 0 counts as a positive sample.
        lam: weight of positive samples (paper: 0.1).
    Returns:
        [B] float32 advantages.
    """
    pos = rewards > 0
    return torch.where(pos, torch.full_like(rewards, lam, dtype=torch.float32), torch.full_like(rewards, -1.0, dtype=torch.float32))


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO overlong reward shaping: min(-(L - (L_max - L_buf)) / L_buf * factor, 0).

    Args:
        lengths: [B] response lengths in tokens.
        max_len: L_max, the maximum response length.
        buffer: L_buf, the length of the ramp before L_max.
        factor: the penalty reached at L = L_max.
    Returns:
        [B] float32 penalties (<= 0) to add to the rewards.
    """
    exceed = lengths.to(torch.float32) - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def dynamic_sampling_keep(metric: Tensor, group: Tensor) -> tuple[Tensor, int]:
    """DAPO dynamic sampling as a pure filter: drop groups whose metric is the same for every
    response, as the official STARE trainer and verl's replay buffer do.

    A group of one response is kept (as in both of them: its spread is undefined, not zero); its
    GRPO advantage is r / (1 + eps) by verl's convention. The metric is whatever the recipe filters
    on: the official trainer filters on `acc`, not on the shaped training reward.

    Args:
        metric: [B] per-response values (e.g. accuracy 0/1).
        group: [B] integer group ids.
    Returns:
        keep: [B] bool, True for responses of kept groups.
        dropped: the number of groups dropped.
    """
    _, inv = torch.unique(group, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    r = metric.to(torch.float64)
    lo = torch.full((G,), float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amin")
    hi = torch.full((G,), float("-inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amax")
    size = torch.zeros(G, dtype=torch.int64, device=r.device).index_add_(0, inv, torch.ones_like(inv))
    keep_group = (hi > lo) | (size == 1)
    return keep_group[inv], int((~keep_group).sum())
