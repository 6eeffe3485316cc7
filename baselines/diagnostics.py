"""Four-quadrant token diagnostics (the paper's Section 3 analysis).

Each valid token with A != 0 falls in one quadrant: advantage sign (pos/neg) x whether its
surprisal s = -log pi_old(o_t) is above or below the token's own entropy H_t (high/low).
Per quadrant: share of those tokens, mean entropy, mean surprisal, and the summed first-order
entropy change estimate dH_t = pi_t * A_t * (s_t - H_t), the change of H_t under a unit logit step
eta * A_t on the sampled token of a softmax policy (dH = -sum_j dpi_j(log pi_j + H) with
dz = A e_a gives pi_a A (s_a - H)). Positive A on a surprising token raises entropy; positive A on
an unsurprising token lowers it; negative A does the opposite.
"""

from __future__ import annotations

import torch
from torch import Tensor

QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")


def quadrant_stats(adv: Tensor, old_log_prob: Tensor, entropy: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-quadrant share, mean entropy, mean surprisal and summed dH estimate.

    Args:
        adv, old_log_prob, entropy, mask: [B, T].
    Returns:
        {'quad/<q>/share', 'quad/<q>/entropy', 'quad/<q>/surprisal', 'quad/<q>/dH'} as 0-dim tensors.
    """
    a = adv.float()
    s = -old_log_prob.float()
    h = entropy.float()
    valid = mask > 0
    high = s > h
    dH = torch.exp(-s) * a * (s - h)
    members = {
        "pos_high": valid & (a > 0) & high,
        "pos_low": valid & (a > 0) & ~high,
        "neg_high": valid & (a < 0) & high,
        "neg_low": valid & (a < 0) & ~high,
    }
    total = (valid & (a != 0)).sum().clamp(min=1).float()
    out: dict[str, Tensor] = {}
    for q, m in members.items():
        mf = m.float()
        n = mf.sum()
        out[f"quad/{q}/share"] = n / total
        out[f"quad/{q}/entropy"] = (h * mf).sum() / n.clamp(min=1)
        out[f"quad/{q}/surprisal"] = (s * mf).sum() / n.clamp(min=1)
        out[f"quad/{q}/dH"] = (dH * mf).sum()
    return out
