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


def _select_top(s: Tensor, members: Tensor, n: int, k: int) -> Tensor:
    """Bool mask of the k members with the largest s (ties: lowest flat index first).

    s, members: flat [N]; n: members.sum() (already on the host); 0 < k <= n.
    """
    key = torch.where(members, s, torch.full_like(s, float("inf")))
    # The k-th largest of n members is the (n - k + 1)-th smallest once non-members sit at +inf.
    thr = torch.kthvalue(key, n - k + 1).values
    above = members & (s > thr)
    tie = members & (s == thr)
    need = k - above.sum()
    rank = torch.cumsum(tie.to(torch.int32), 0)
    return above | (tie & (rank <= need))


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
    ones = torch.ones(adv.shape, dtype=torch.float32, device=adv.device)
    if (isinstance(gate, bool) and not gate) or P <= 0:
        return ones
    shape = adv.shape
    a = adv.reshape(-1)
    s = (-old_log_prob.reshape(-1)).to(torch.float32)
    valid = mask.reshape(-1) > 0
    pos = valid & (a > 0)
    sets = [(pos, W)]
    if variant == "c2":
        sets.append((valid & (a < 0), M))
    counts = torch.stack([m.sum() for m, _ in sets]).tolist()  # the one host sync
    w = ones.reshape(-1)
    for (members, weight), n in zip(sets, counts):
        k = _k(P, int(n))
        if k:
            w = torch.where(_select_top(s, members, int(n), k), torch.full_like(w, weight), w)
    w = w.reshape(shape)
    if isinstance(gate, Tensor):
        w = torch.where(gate.to(w.device), w, ones)
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
