"""STARE: surprisal-guided token-level advantage reweighting (arXiv 2606.19236).

Given GRPO advantages A and the rollout policy's log-probs, STARE selects
  L+ = the top-P fraction of T+ = {valid tokens with A > 0} by surprisal s = -log pi_old(o_t),
  L- = the same fraction of T- = {valid tokens with A < 0} (variant C2 only),
and weights them W (L+) and M (L-), 1 elsewhere, while a closed-loop gate is on (batch-mean token
entropy H < H_tgt). Since w > 0, w * clip-loss(A) == clip-loss(w * A): the weights are a token-level
advantage transform A_eff = w * A that composes with any loss of the PPO-clip family.

Deviations from the paper's text, stated: |L+| = ceil(P |T+|), at least 1 when T+ is non-empty,
except P = 0, which selects nothing; ties in surprisal at the threshold are broken by position
(earlier flat index first), so selection is deterministic on every device. A == 0 tokens are never
weighted. The selection scope (whole batch, or each loss call as the official code) is the
caller's choice: call this function on what it should see.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, Union

import torch
from torch import Tensor

Variant = Literal["o1", "c2"]


def _top_k_positions(old_log_prob: Tensor, members: Tensor, n: int, k: int) -> Tensor:
    """Flat positions of the k members with the largest surprisal; ties go to the earlier position.

    old_log_prob: flat [N]; members: flat bool [N]; n = members.sum(), known on the host; 0 < k <= n.
    Each member gets a unique int64 key (the float's bits, which order like the floats for s >= 0,
    then the position), so a plain top-k is exact and deterministic with no further host sync.
    """
    if members.numel() >= 2**31:
        raise ValueError(f"STARE selection supports fewer than 2**31 tokens per call, got {members.numel()}")
    if members.device.type == "cpu":  # a host sync is free on the CPU, and nonzero is 2x faster there
        pos = torch.nonzero(members).squeeze(1)
    else:  # no sync: the size is known
        pos = torch.nonzero_static(members, size=n).squeeze(1)
    # Surprisal of the members only. A log-prob rounded above 0 counts as surprisal 0; "+ 0.0" turns
    # -0.0 into +0.0. Non-negative float32 bits then order like the floats themselves.
    s = (-old_log_prob[pos].to(torch.float32)).clamp_(min=0.0) + 0.0
    key = s.view(torch.int32).to(torch.int64) * 2**31 - pos  # unique; ties go to the earlier position
    return pos[torch.topk(key, k, sorted=False).indices]


def _k(P: float, n: int) -> int:
    if n == 0 or P <= 0:
        return 0
    # round() first: 0.1 * 30 is 3.0000000000000004 in floating point, whose ceil would be 4.
    return min(n, max(1, math.ceil(round(P * n, 9))))


def stare_token_weights(
    adv: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    *,
    P: float = 0.1,
    W: float = 1.1,
    M: float = 0.9,
    variant: Variant = "o1",
    gate: Union[bool, Tensor] = True,
) -> Tensor:
    """STARE token weights w: W on L+, M on L- (C2), 1 elsewhere; all 1 while the gate is off.

    Args:
        adv: [B, T] token advantages (any float dtype).
        old_log_prob: [B, T] log pi_old of the sampled tokens.
        mask: [B, T] 1 for valid response tokens.
        P: fraction of T+ (and T-) selected, in [0, 1].
        W: weight on L+; M: weight on L- (variant 'c2' only).
        variant: 'o1' (reweight L+ only) or 'c2' (L+ and L-).
        gate: the controller's gate; a Python bool, or a 0-dim bool tensor (no host sync).
    Returns:
        [B, T] float32 weights. At most one host synchronisation (the sizes of T+ and T-).
    """
    if variant not in ("o1", "c2"):
        raise ValueError(f"unknown STARE variant '{variant}'; valid: o1, c2")
    if (isinstance(gate, bool) and not gate) or P <= 0:
        return torch.ones(adv.shape, dtype=torch.float32, device=adv.device)
    shape = adv.shape
    olp = old_log_prob.reshape(-1)
    # mask is 0/1, so sign(A * mask) is sign(A) on valid tokens and 0 elsewhere: one pass for both sets.
    am = adv.reshape(-1) * mask.reshape(-1).to(adv.dtype)
    sets = [(am > 0, W)]
    if variant == "c2":
        sets.append((am < 0, M))
    counts = torch.stack([torch.count_nonzero(m) for m, _ in sets]).tolist()  # the one host sync
    w = torch.ones(olp.shape, dtype=torch.float32, device=adv.device)
    for (members, weight), n in zip(sets, counts):
        k = _k(P, int(n))
        if k:
            w[_top_k_positions(olp, members, int(n), k)] = weight
    w = w.reshape(shape)
    if isinstance(gate, Tensor):
        w = torch.where(gate.to(w.device), w, torch.ones_like(w))
    return w


@dataclass
class StareController:
    """Closed-loop gate and optional adaptive W/M, updated once per step from the batch entropy.

    gate = H < h_tgt. Adaptive: W += alpha * sgn(h_tgt - H) clipped to [1, w_max];
    M -= alpha * sgn(h_tgt - H) clipped to [m_min, 1]. A NaN or infinite H changes nothing.
    Defaults are the paper's (O1, P 0.1, W 1.1, M 0.9, H_tgt 0.3, adaptive off).
    """

    variant: Variant = "o1"
    P: float = 0.1
    W: float = 1.1
    M: float = 0.9
    h_tgt: float = 0.3
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    gate: bool = False
    steps: int = 0
    steps_on: int = 0

    def update(self, entropy: float) -> bool:
        """Take the batch-mean token entropy H (a float); return the new gate."""
        if not math.isfinite(entropy):
            return self.gate
        self.steps += 1
        self.gate = entropy < self.h_tgt
        self.steps_on += int(self.gate)
        if self.adaptive:
            sgn = (self.h_tgt > entropy) - (self.h_tgt < entropy)
            self.W = min(max(self.W + self.alpha * sgn, 1.0), self.w_max)
            self.M = min(max(self.M - self.alpha * sgn, self.m_min), 1.0)
        return self.gate

    def weights(self, adv: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
        """stare_token_weights with the current state. Shapes as there."""
        return stare_token_weights(
            adv, old_log_prob, mask, P=self.P, W=self.W, M=self.M, variant=self.variant, gate=self.gate
        )

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            if not hasattr(self, k):
                raise KeyError(f"unknown StareController state key '{k}'")
            setattr(self, k, v)
