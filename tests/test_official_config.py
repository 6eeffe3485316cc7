"""Our verl configuration against the official STARE runs' effective configuration.

../shared/paper/official holds the official scripts' composed configuration (the fork of verl 0.7,
619 flattened keys). We compose our Short-CoT Qwen2.5-Math-7B recipes (STARE-O1 and GRPO-ds) with
verl 0.9.1's own defaults, flatten them the same way and compare every key present in both: any
difference must be a row of OFFICIAL_DIFFERENCES (stare_cli/backends/verl_backend.py, shown in the
docs/guide/fidelity.md), and every row must still be a difference. The official `stare.*` keys, which verl 0.9 does
not have, are compared with the method layer rebuilt from the recipe in verl's config."""

from __future__ import annotations

import ast
import json

import pytest
from omegaconf import OmegaConf

from conftest import REPO, SHARED
from stare_cli.backends.verl_backend import (
    OFFICIAL_DIFFERENCES, compose, official_difference, official_differences_markdown, verl_overrides,
)
from stare_cli.method.layer import MethodLayer
from stare_cli.core.resolve import load_recipe

OFFICIAL = SHARED / "paper" / "official"
METHODS = ["stare-o1", "grpo-ds"]


def flatten(d, prefix: str = "") -> dict:
    out = {}
    if isinstance(d, dict):
        if not d and prefix:
            out[prefix[:-1]] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _norm(v):
    # The official file writes lists and dicts as Python literals in strings.
    if isinstance(v, str) and v[:1] in "[{":
        try:
            return ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v
    return v


def _pair(method: str):
    path = OFFICIAL / f"short-cot_qwen2.5-math-7b_{method}.composed.json"
    if not path.exists():
        pytest.skip(f"needs the official runs' configuration in {OFFICIAL} (../shared is not beside this clone)")
    official = json.loads(path.read_text())
    conf = compose(verl_overrides(load_recipe("short-cot/qwen2.5-math-7b", method, [])))
    return official, flatten(OmegaConf.to_container(conf, resolve=True)), conf


def _differences(official: dict, ours: dict) -> dict[str, tuple]:
    return {k: (official[k], ours[k]) for k in sorted(set(official) & set(ours)) if _norm(official[k]) != _norm(ours[k])}


@pytest.mark.parametrize("method", METHODS)
def test_every_shared_key_has_the_official_value_or_a_stated_reason(method):
    official, ours, _ = _pair(method)
    shared = set(official) & set(ours)
    assert len(official) == 619 and len(shared) > 450
    unexplained = {k: v for k, v in _differences(official, ours).items() if official_difference(k) is None}
    assert unexplained == {}, "differences from the official run without a row in OFFICIAL_DIFFERENCES"


def test_every_stated_difference_is_still_a_difference():
    seen = set()
    for method in METHODS:
        official, ours, _ = _pair(method)
        for key in _differences(official, ours):
            for pattern, _, _ in OFFICIAL_DIFFERENCES:
                if official_difference(key) and (key == pattern or key.startswith(pattern.rstrip("*"))
                                                 or (pattern.startswith("*.") and key.endswith(pattern[1:]))):
                    seen.add(pattern)
    assert [p for p, _, _ in OFFICIAL_DIFFERENCES if p not in seen] == []


@pytest.mark.parametrize("method", METHODS)
def test_the_official_stare_keys_reach_the_method_layer(method):
    official, _, conf = _pair(method)
    stare = {k.removeprefix("actor_rollout_ref.actor.stare."): v for k, v in official.items()
             if k.startswith("actor_rollout_ref.actor.stare.")}
    assert len(stare) == 10
    layer = MethodLayer.from_recipe(OmegaConf.to_container(conf.stare.recipe, resolve=True))
    s = layer.cfg.stare
    assert stare["enabled"] is (layer.spec.stare is not None)
    if stare["enabled"]:
        assert stare["variant"].lower() == layer.spec.stare and s.scope == "official"
        ours = {"top_p_ratio": s.P, "reweight_w": s.W, "reweight_m": s.M, "target_entropy": s.h_tgt,
                "adaptive": s.adaptive, "alpha": s.alpha, "w_max": s.w_max, "m_min": s.m_min}
        assert {k: stare[k] for k in ours} == ours
    else:  # the official GRPO-ds run: the stare loss, disabled, with neutral weights -> plain GRPO
        assert stare["reweight_w"] == stare["reweight_m"] == 1.0 and stare["top_p_ratio"] == 0.0
    # the official loss and reward, by other means: the fork's loss_mode=stare and reward manager `stare`
    assert official["actor_rollout_ref.actor.policy_loss.loss_mode"] == "stare"
    assert official["reward_model.reward_manager"] == "stare" and layer.recipe.reward.fn == "stare-official"
    assert official["algorithm.filter_groups.metric"] == "acc"


def test_the_fidelity_page_shows_the_table():
    assert official_differences_markdown() in (REPO / "docs" / "guide" / "fidelity.md").read_text()
