"""Adaptive entropy control (baselines/entropy_control.py, Skywork-OR1; issue 71): the controller on a
hand-computed sequence, against a transcription of the released update rule on any sequence, and in the
method layer's loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.entropy_control import AdaptiveEntropyController


def test_hand_computed_sequence():
    c = AdaptiveEntropyController(target=0.2, coef=0.0, coef_min=0.0, coef_max=0.005, delta=1e-4)
    seen = []
    for H in (0.3, 0.15, 0.1, 0.25, float("nan"), 0.1):
        seen.append(c.coefficient)  # the step's alpha, from the steps before
        c.update(H)
    # step 1: c 0, on  -> alpha 0; H 0.3 >= 0.2: c = clip(0 - 1e-4) = 0, off
    # step 2: alpha 0 (off); H 0.15 < 0.2: c = 1e-4, on
    # step 3: alpha 1e-4; H 0.1: c = 2e-4, on
    # step 4: alpha 2e-4; H 0.25: c = 1e-4, off
    # step 5: alpha 0 (off); H NaN: nothing changes
    # step 6: alpha 0 (still off); H 0.1: c = 2e-4, on
    assert seen == pytest.approx([0.0, 0.0, 1e-4, 2e-4, 0.0, 0.0])
    assert c.coefficient == pytest.approx(2e-4) and c.steps == 5 and c.steps_on == 3


def test_the_coefficient_stays_in_its_bounds():
    c = AdaptiveEntropyController(target=1.0, coef=0.0049, coef_max=0.005, delta=1e-4)
    for _ in range(5):
        c.update(0.1)
    assert c.coefficient == 0.005
    c.load_state_dict(AdaptiveEntropyController(coef=0.003, enabled=False).state_dict())
    assert c.coef == 0.003 and c.coefficient == 0.0


def _released(H_seq, init, lo, hi, delta, target):
    """Skywork-OR1's EntController.update and its use in the actor (value * entropy_loss_enabled), as
    released (verl/trainer/ppo/core_algos.py, verl/workers/actor/dp_actor.py), written out again."""
    value, enabled, out = init, 1, []
    for H in H_seq:
        out.append(value * enabled)
        value = value + delta if H < target else value - delta
        value = float(min(max(value, lo), hi))
        enabled = int(H < target)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 2.0), min_size=1, max_size=40), st.floats(0.0, 0.005), st.floats(1e-5, 1e-3),
       st.floats(0.05, 1.5))
def test_equals_the_released_rule_on_any_finite_sequence(H_seq, init, delta, target):
    c = AdaptiveEntropyController(target=target, coef=init, coef_min=0.0, coef_max=0.005, delta=delta)
    ours = []
    for H in H_seq:
        ours.append(c.coefficient)
        c.update(H)
    assert ours == _released(H_seq, init, 0.0, 0.005, delta, target)


def test_the_method_layer_adds_the_steps_bonus_and_moves_the_coefficient_after():
    from baselines.aggregation import Agg
    from stare_cli.core.resolve import load_recipe
    from stare_cli.method.layer import LossInputs, MethodLayer

    layer = MethodLayer.from_recipe(load_recipe("tiny/arith", "adaptive-entropy", ["method.adaptive_entropy.coef_init=0.003"]))
    grpo = MethodLayer.from_recipe(load_recipe("tiny/arith", "grpo-ds", []))
    assert layer.needs_entropy_in_loss and not grpo.needs_entropy_in_loss
    state, m = layer.begin_step(0.5)  # step 1: alpha = 0.003 (on at the start); H 0.5 > 0.2 turns it off after
    assert state.entropy_coef == pytest.approx(0.003) and m["entropy_control/next_coef"] == 0.0
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g)
    ent = torch.rand(4, 6, generator=g)
    mask = torch.ones(4, 6)
    adv = torch.randn(4, 1, generator=g).expand(4, 6)
    x = LossInputs(log_prob=lp, old_log_prob=lp, advantages=adv, mask=mask, agg=Agg(), entropy=ent, stare=state)
    loss, st_ = layer.loss(x)
    base, _ = grpo.loss(LossInputs(log_prob=lp, old_log_prob=lp, advantages=adv, mask=mask, agg=Agg()))
    # the bonus: -alpha * token-mean(H) = -0.003 * mean(ent)
    assert float(loss) == pytest.approx(float(base) - 0.003 * float(ent.mean()), abs=1e-7)
    assert float(st_["entropy_bonus"]) == pytest.approx(-0.003 * float(ent.mean()), abs=1e-8)
    state2, _ = layer.begin_step(0.1)  # step 2: off after step 1's H: alpha 0
    assert state2.entropy_coef == 0.0


def test_stare_refuses_the_adaptive_bonus_by_name():
    from stare_cli.core.resolve import load_recipe
    from stare_kernel.errors import StareError

    with pytest.raises(StareError, match="adaptive_entropy"):
        load_recipe("tiny/arith", "stare-o1", ["method.adaptive_entropy.enable=true"])
    # the released default, and the toys' own target (their H_tgt, stated in recipes/tiny/arith.yaml)
    assert math.isclose(load_recipe("short-cot/qwen2.5-math-7b", "adaptive-entropy", []).method.adaptive_entropy.target, 0.2)
    assert math.isclose(load_recipe("tiny/arith", "adaptive-entropy", []).method.adaptive_entropy.target, 0.35)
