"""Loss aggregation over [B, T] token losses, independent of how a batch is split.

Modes (verl 0.9.1's `agg_loss`): token-mean (over the valid tokens), token-sum (their sum: the loss grows
with the batch's tokens, so its learning rate is not comparable to token-mean's), seq-mean-token-sum,
seq-mean-token-mean, seq-mean-token-sum-norm (Dr.GRPO's constant divisor).

Pass the counts of the *whole* mini-batch (`num_tokens`, `num_seqs`) when a loss is computed in
micro-batches or on several data-parallel ranks: the per-part losses then sum to the loss of the
whole. Without them each call normalises by its own counts (verl's behaviour for dp_size=1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                              "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Agg:
    """How to reduce token losses: the mode, and the global counts it divides by.

    num_tokens: valid tokens of the whole mini-batch (token-mean).
    num_seqs: sequences with at least one valid token in the whole mini-batch (seq-mean-*).
    scale: the constant divisor of seq-mean-token-sum-norm, applied after the seq-mean
        (default: T of the call), as verl 0.9.1.
    factor: token-sum's multiplier (verl 0.9.1 multiplies each rank's token sum by dp_size, since its
        ranks' gradients are averaged: the reduced gradient is the global batch's sum); 1 in one process.
    """

    mode: AggMode = "token-mean"
    num_tokens: Optional[float] = None
    num_seqs: Optional[float] = None
    scale: Optional[float] = None
    factor: float = 1.0


def counted_agg(mode: AggMode, mask: Tensor, scale: Optional[float] = None) -> Agg:
    """An Agg that divides by the counts of `mask` [b, T] (its valid tokens and sequences, at least 1
    each, so that a part without valid tokens adds 0, not NaN)."""
    return Agg(mode, num_tokens=max(float(mask.sum()), 1.0), num_seqs=max(float((mask.sum(-1) > 0).sum()), 1.0),
               scale=scale)


def agg_loss(loss_mat: Tensor, mask: Tensor, agg: Agg = Agg()) -> Tensor:
    """Reduce token losses to a scalar.

    Args:
        loss_mat: [B, T] per-token losses.
        mask: [B, T] 1 for tokens that count, 0 elsewhere.
        agg: mode and global counts.
    Returns:
        scalar loss.
    """
    mask = mask.to(loss_mat.dtype)
    if agg.mode == "token-mean":
        n = mask.sum() if agg.num_tokens is None else agg.num_tokens
        return (loss_mat * mask).sum() / n
    if agg.mode == "token-sum":  # verl 0.9's agg_loss: no normaliser, so no global count either
        loss = (loss_mat * mask).sum()
        return loss * agg.factor if agg.factor != 1.0 else loss
    if agg.mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = (loss_mat * mask).sum(-1)
        valid = (mask.sum(-1) > 0).to(loss_mat.dtype)
        n = valid.sum() if agg.num_seqs is None else agg.num_seqs
        loss = (seq * valid).sum() / n
        if agg.mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant divisor instead of lengths
            loss = loss / (loss_mat.shape[-1] if agg.scale is None else agg.scale)
        return loss
    if agg.mode == "seq-mean-token-mean":
        lens = mask.sum(-1)
        seq = (loss_mat * mask).sum(-1) / (lens + 1e-8)
        valid = (lens > 0).to(loss_mat.dtype)
        n = valid.sum() if agg.num_seqs is None else agg.num_seqs
        return (seq * valid).sum() / n
    raise ValueError(f"unknown loss aggregation '{agg.mode}'; valid: {', '.join(AGG_MODES)}")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask == 1 (0 when the mask is empty), verl's form. x, mask: same shape."""
    mask = mask.to(x.dtype)
    return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)
