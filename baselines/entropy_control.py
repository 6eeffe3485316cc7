"""Adaptive entropy control (Skywork-OR1, arXiv 2505.22312): an entropy bonus whose coefficient is steered
toward a target entropy, the published rival to STARE's gate at H_tgt.

Read from Skywork-OR1's released code (verl/trainer/ppo/core_algos.py `EntController`; the actor's loss
in verl/workers/actor/dp_actor.py; the defaults in or1_scripts/train/7b_8k.sh), per training step k with
the batch's entropy H_k:
- the step's loss is  L_pg - alpha_k * H_loss  with  alpha_k = c_k * e_k  (c_k the coefficient, e_k in {0, 1}
  whether the bonus is on), both from the controller's state before step k's entropy is seen;
- then  c_{k+1} = clip(c_k + delta if H_k < target else c_k - delta, c_min, c_max)  and
  e_{k+1} = 1 if H_k < target else 0.
Initial state: c_1 = the initial coefficient (0 in the released scripts), e_1 = 1. A NaN or infinite H
changes nothing (as STARE's controller; the released code would propagate it).
Defaults (7b_8k.sh): target 0.2, c in [0, 0.005], delta 1e-4, c_1 = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdaptiveEntropyController:
    """The coefficient c and the switch e of the entropy bonus (module docstring); `coefficient` is the
    bonus's alpha for the coming step, `update(H)` moves the state with that step's entropy."""

    target: float = 0.2
    coef: float = 0.0
    coef_min: float = 0.0
    coef_max: float = 0.005
    delta: float = 1e-4
    enabled: bool = True
    steps: int = 0
    steps_on: int = 0

    @property
    def coefficient(self) -> float:
        """alpha = c * e: the entropy bonus's coefficient for the step about to run."""
        return self.coef if self.enabled else 0.0

    def update(self, entropy: float) -> float:
        """Move the state with this step's batch entropy H; returns the new coefficient."""
        if not math.isfinite(entropy):
            return self.coefficient
        below = entropy < self.target
        self.coef = min(max(self.coef + (self.delta if below else -self.delta), self.coef_min), self.coef_max)
        self.enabled = below
        self.steps += 1
        self.steps_on += int(below)
        return self.coefficient

    def state_dict(self) -> dict:
        return {"coef": self.coef, "enabled": self.enabled, "steps": self.steps, "steps_on": self.steps_on}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.enabled = float(state["coef"]), bool(state["enabled"])
        self.steps, self.steps_on = int(state.get("steps", 0)), int(state.get("steps_on", 0))
