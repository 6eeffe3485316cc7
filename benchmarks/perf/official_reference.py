"""A reference implementation of the official STARE loss call, for tests and the performance script.

Written from reading hp-luo/STARE (`verl/trainer/ppo/core_algos.py`: compute_stare_token_weights and
compute_policy_loss_stare); it reproduces what that code does, step by step, so that our method layer
can be compared with it on the same micro-batches. It is not used for training.

What the official loss call does (per micro-batch, on the current policy's log-probs):
- weights start as ones in the advantages' dtype; candidates T+ = valid & A > 0, T- = valid & A < 0;
- for each set (T- only for C2): n = its size (a host read), k = min(n, max(1, int(n P + 0.999999))),
  the surprisals -log_prob (detached) of the members by boolean indexing, `torch.topk(k)`, and the
  members' flat positions through `nonzero`; the selected positions get W (L+) then M (L-) while the
  gate is on;
- its metrics, computed every call: candidate shares, reweighted shares, mean weight (host reads);
- the loss: PPO-clip with dual-clip on the unweighted advantages, times the weights, aggregated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def official_weights(log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *, P: float = 0.1,
                     W: float = 1.1, M: float = 0.9, variant: str = "O1", gate: bool = True,
                     with_metrics: bool = True) -> tuple[Tensor, dict[str, float]]:
    """(weights [B, T] in the advantages' dtype, metrics) as the official function computes them."""
    variant = variant.upper()
    if variant not in ("O1", "C2"):
        raise ValueError(variant)
    if not 0.0 <= P <= 1.0:
        raise ValueError(P)
    weights = torch.ones_like(advantages)
    valid = response_mask > 0
    pos = valid & (advantages > 0)
    neg = valid & (advantages < 0)
    surprisal = -log_prob.detach()

    def top(candidates: Tensor) -> Tensor:
        chosen = torch.zeros_like(candidates, dtype=torch.bool)
        n = int(candidates.sum().item())
        if n == 0 or P <= 0.0:
            return chosen
        k = min(n, max(1, int(n * P + 0.999999)))
        _, local = torch.topk(surprisal[candidates], k=k, largest=True)
        flat = candidates.reshape(-1).nonzero(as_tuple=False).squeeze(-1)
        chosen.reshape(-1)[flat[local]] = True
        return chosen

    l_pos = top(pos)
    l_neg = top(neg) if variant == "C2" else torch.zeros_like(valid)
    if gate:
        weights = torch.where(l_pos, torch.full_like(weights, W), weights)
        if variant == "C2":
            weights = torch.where(l_neg, torch.full_like(weights, M), weights)
    metrics: dict[str, float] = {}
    if with_metrics:
        n_valid = valid.float().sum().clamp_min(1.0)
        metrics = {
            "positive_candidate_ratio": float(pos.float().sum().item() / n_valid.item()),
            "negative_candidate_ratio": float(neg.float().sum().item() / n_valid.item()),
            "positive_reweight_ratio": float((l_pos.float() * valid.float()).sum().item() / n_valid.item()),
            "negative_reweight_ratio": float((l_neg.float() * valid.float()).sum().item() / n_valid.item()),
            "mean_weight": float((weights * valid.float()).sum().item() / n_valid.item()),
        }
    return weights, metrics


def official_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.28, clip_c: float = 10.0,
                  num_tokens: Optional[float] = None, **stare) -> tuple[Tensor, dict[str, float]]:
    """The official STARE policy loss on one micro-batch, token-mean over `num_tokens` (default: the
    call's own valid tokens)."""
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -advantages * clip_c
    losses = torch.where(advantages < 0, torch.min(pg3, clipped), clipped)
    weights, metrics = official_weights(log_prob, advantages, response_mask, **stare)
    losses = losses * weights
    mask = response_mask.to(losses.dtype)
    n = mask.sum() if num_tokens is None else num_tokens
    return (losses * mask).sum() / n, metrics
