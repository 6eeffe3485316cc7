"""The method layer: one object that both training backends call for everything a method decides.

`MethodLayer.from_recipe(recipe)` is the only constructor. The embedded trainer builds it once; on
verl every process rebuilds it from the resolved recipe, which travels inside verl's own config
(`stare.recipe`) and, for the actor, inside each update's batch (stare_cli/backends/verl_ext.py).
So the two backends run the same code for:

1. the reward (`score`): the recipe's reward function (`reward.fn`), the truncation rule
   (`rollout.truncated`), the optional format penalty and DAPO's overlong shaping;
2. dynamic sampling (`keep_groups`): drop groups whose accuracy is the same for every response,
   keep groups of one response (the official trainer and verl both do);
3. advantages per response (`advantages`): GRPO, Dr.GRPO or W-REINFORCE;
4. the STARE controller (`begin_step`): once per step, from the batch's token-mean entropy of the
   old-log-prob pass; returns the `StareState` (gate, W, M) the loss calls need;
5. the per-batch transform (`transform_batch`): advantages over tokens, the truncation mask, the
   80/20 mask (as zero advantages), STAPO's spurious tokens and RSI-S's out-of-interval tokens (out of the
   loss mask), batch-scope STARE weights, the quadrant diagnostics;
6. the loss calls of a training batch (`update_plan`, `call_agg`): mini-batches, their micro-batches
   (the token budget or fixed rows), and how each call's loss is normalised and scaled: one token-mean
   over the mini-batch, or the official run's data-parallel layout emulated (`optim.loss_layout`);
7. the policy loss (`loss`): per-loss-call transforms (official-scope STARE on the current log-probs,
   the covariance Gaussian kernel, EntroAdv on the current entropy), one dispatch over the loss family
   (Clip-Cov/KL-Cov with their annealing factor for the step), and the entropy bonus.

Recipes are resolved with their method's defining keys below this layer (stare_cli/core/resolve.py:
`load_recipe`). The tensor math stays in `baselines/`.

Deviations from the official STARE code (all stated in docs/guide/fidelity.md): ties in
surprisal are broken by position (baselines/stare.py); the 80/20 rule and W-REINFORCE are expressed as
advantage transforms (exact for the PPO-clip family, since the loss is linear in A per token).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from baselines import (
    Agg,
    StareController,
    dynamic_sampling_keep,
    entro_adv,
    grpo_advantage,
    overlong_penalty,
    quadrant_stats,
    token_budget_micro_batches,
    top_entropy_mask,
    w_reinforce_advantage,
)
from baselines.aggregation import counted_agg
from baselines.entropy_control import AdaptiveEntropyController
from baselines.losses import clip_cov_loss, entropy_bonus, gspo_loss, kl_cov_loss, ppo_clip_loss
from baselines.micro_batches import LossCall, official_loss_calls
from baselines.registry import MethodSpec
from baselines.stare import stare_scale
from baselines.token_filters import anneal_factor, covariance_kernel_weights, rsi_keep_mask, spurious_mask
from stare_cli.core.config import Recipe
from stare_cli.core.resolve import check_method


# -------------------------------------------------------------------------------------- warnings
def method_warnings(recipe: Recipe) -> list[str]:
    """What the recipe makes of its method that its name does not say, one line each ([] for most).

    KL-Cov adds coef * |log pi - log pi_old| on its selected tokens. With one optimizer update per batch
    (optim.mini_batch_size = optim.train_batch_size, optim.ppo_epochs 1) that update's log-probs are the
    old ones (verl 0.9.1 takes `log_prob.detach()` as old when on-policy; the embedded trainer's old pass
    runs the update's own micro-batches, so on a deterministic device it gives the same bits), so the
    penalty is 0 with a 0 gradient and the run trains exactly as GRPO-ds
    (tests/test_baselines.py::test_kl_cov_with_one_update_per_batch_is_grpo_ds; issue 48's KL-Cov cell: 25
    steps bit-identical to GRPO-ds on the CPU)."""
    spec = check_method(recipe.method.name)
    O = recipe.optim
    out = []
    note = partition_note(recipe, spec)
    if note:
        out.append(note)
    if spec.loss == "kl_cov" and O.mini_batch_size == O.train_batch_size and O.ppo_epochs == 1:
        out.append(f"{spec.name} trains exactly as grpo-ds under this recipe: with one optimizer update per batch "
                   f"(optim.mini_batch_size = optim.train_batch_size = {O.train_batch_size}, optim.ppo_epochs 1) "
                   f"its penalty |log pi - log pi_old| is 0 with a 0 gradient; it acts from a batch's second update "
                   f"on (optim.mini_batch_size below optim.train_batch_size), or use clip-cov, which acts on-policy")
    return out


def partition_note(recipe: Recipe, spec: Optional[MethodSpec] = None) -> Optional[str]:
    """One line when the method computes something per loss call and the recipe splits a mini-batch into
    several calls under the global layout, so that a memory setting (optim.micro_batch_size,
    optim.micro_batch_tokens) changes the method's numbers, not only its memory (issue 69: at step 1 of the
    real-model recipe STARE selected 2.254%, 2.294% and 2.374% of the tokens with one, four and eight
    micro-batches). Per call: STARE's selection under method.stare.scope 'official' (the official code's
    scope), Clip-Cov's and KL-Cov's covariance and the covariance kernel's weights. Under optim.loss_layout
    'official' the calls are the official run's own (no note); the settings that do not change them:
    activation checkpointing, the chunked LM head, method.stare.scope 'batch'."""
    spec = spec or check_method(recipe.method.name)
    O = recipe.optim
    what = []
    if spec.stare and recipe.method.stare.scope == "official":
        what.append("STARE selects L+/L- per loss call")
    if spec.loss in ("clip_cov", "kl_cov"):
        what.append(f"{spec.title} centres its covariance per loss call")
    if spec.cov_kernel:
        what.append("the covariance kernel weighs tokens per loss call")
    if not what or O.loss_layout != "global":
        return None
    responses = O.mini_batch_size * recipe.rollout.n
    if O.micro_batch_tokens is not None:
        row = recipe.rollout.max_prompt_tokens + recipe.rollout.max_response_tokens
        most = -(-responses * row // O.micro_batch_tokens)
        if most <= 1:
            return None
        split = (f"optim.micro_batch_tokens = {O.micro_batch_tokens} splits each mini-batch of {responses} responses "
                 f"into as many loss calls as its tokens need (up to {min(most, responses)})")
    else:
        calls = -(-responses // O.micro_batch_size)
        if calls <= 1:
            return None
        split = (f"optim.micro_batch_size = {O.micro_batch_size} splits each mini-batch of {responses} responses into "
                 f"{calls} loss calls")
    return (f"{' and '.join(what)}, and {split}: a memory setting that changes the split changes which tokens "
            "are selected or weighted, not only the memory (activation checkpointing and the chunked LM head do not)")


# --------------------------------------------------------------------------------------- records
@dataclass
class RolloutScores:
    """Per response [B]: the training reward, the accuracy dynamic sampling filters on, the official
    format check and `score` field; plus the verdicts (grader name, extracted answer, reason)."""

    reward: Tensor
    acc: Tensor
    format: Tensor
    official_score: Tensor
    verdicts: list = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"reward": float(self.reward.mean()), "acc": float(self.acc.mean()),
                "format": float(self.format.mean()), "official_score": float(self.official_score.mean())}


@dataclass(frozen=True)
class StareState:
    """What a loss call needs from the step's controller (the official code passes the same through the
    batch's meta_info): STARE's gate and weights, or the adaptive entropy bonus's coefficient."""

    gate: bool
    W: float
    M: float
    entropy_coef: float = 0.0  # adaptive entropy control's alpha for this step (0 for STARE)

    def to_dict(self) -> dict[str, Any]:
        return {"gate": bool(self.gate), "W": float(self.W), "M": float(self.M), "entropy_coef": float(self.entropy_coef)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StareState":
        return cls(gate=bool(d["gate"]), W=float(d["W"]), M=float(d["M"]), entropy_coef=float(d.get("entropy_coef", 0.0)))


@dataclass
class BatchInputs:
    """One training batch after dynamic sampling. rewards, group, finished: [B]; mask, old_log_prob,
    entropy: [B, T] (mask: valid response tokens; tool observations already 0). Without old_log_prob and
    entropy the transform leaves out the metrics that read them (`policy_metrics` gives them later)."""

    rewards: Tensor
    group: Tensor
    mask: Tensor
    old_log_prob: Optional[Tensor]  # None: not known yet (a fused old pass); only for `transform_reads_policy` False
    entropy: Optional[Tensor]
    finished: Tensor


@dataclass
class BatchTransform:
    """Token advantages and the loss mask [B, T] the loss calls get, and the step's metrics."""

    advantages: Tensor
    mask: Tensor
    metrics: dict[str, float]


@dataclass
class LossInputs:
    """One loss call (a micro-batch), [b, T] each. log_prob and entropy are the current policy's
    (log_prob with grad; entropy with grad when the entropy bonus needs it, else may be None)."""

    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    mask: Tensor
    agg: Agg
    entropy: Optional[Tensor] = None
    stare: Optional[StareState] = None
    generator: Optional[torch.Generator] = None
    step: Optional[int] = None  # the training step (1-based); needed by an annealed Clip-Cov/KL-Cov


# ------------------------------------------------------------------------------------------ layer
def _advance(controller: Optional[Union[StareController, AdaptiveEntropyController]],
             entropy: float) -> tuple[Optional[StareState], dict[str, float]]:
    """Move `controller` (in place) with one step's batch entropy H; the state for the step's loss calls and
    its metrics (`MethodLayer.begin_step`)."""
    if controller is None:
        return None, {}
    if isinstance(controller, AdaptiveEntropyController):
        coef = controller.coefficient
        controller.update(entropy)
        return StareState(False, 1.0, 1.0, coef), {"entropy_control/coef": coef,
                                                  "entropy_control/next_coef": controller.coefficient}
    controller.update(entropy)
    return (StareState(controller.gate, controller.W, controller.M),
            {"stare/gate": float(controller.gate), "stare/W": controller.W, "stare/M": controller.M})


class MethodLayer:
    """Everything a method decides, for one run (module docstring). Build with `from_recipe`."""

    def __init__(self, recipe: Recipe, spec: MethodSpec):
        self.recipe = recipe
        self.spec = spec
        self.cfg = recipe.method
        self.controller: Optional[Union[StareController, AdaptiveEntropyController]] = None
        if spec.stare:
            s = self.cfg.stare
            self.controller = StareController(variant=spec.stare, P=s.P, W=s.W, M=s.M, h_tgt=s.h_tgt,
                                              adaptive=s.adaptive, alpha=s.alpha, w_max=s.w_max, m_min=s.m_min)
        elif self.cfg.adaptive_entropy.enable:
            a = self.cfg.adaptive_entropy
            self.controller = AdaptiveEntropyController(target=a.target, coef=a.coef_init, coef_min=a.coef_min,
                                                        coef_max=a.coef_max, delta=a.delta)
        self._reward_fn = None

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> "MethodLayer":
        """The one constructor: from a resolved recipe (or its serialised form, a dict)."""
        if isinstance(recipe, dict):
            recipe = Recipe.model_validate(recipe)
        return cls(recipe, check_method(recipe.method.name))

    # ---- properties the backends ask about
    @property
    def stare_scope(self) -> Optional[str]:
        """'official' or 'batch' for STARE methods, None otherwise."""
        return self.cfg.stare.scope if self.spec.stare else None

    @property
    def needs_entropy_in_loss(self) -> bool:
        """Whether loss calls need the current policy's token entropy (EntroAdv, the entropy bonus, the
        adaptive one included)."""
        return self.spec.entro_adv or self.cfg.entropy_coef > 0 or self.cfg.adaptive_entropy.enable

    @property
    def transform_reads_policy(self) -> bool:
        """Whether the batch transform (advantages, loss mask) reads pi_old's log-probs or token entropies:
        top-entropy, STAPO, RSI-S and batch-scope STARE. Without them every input of a loss call is known before
        the first training forward, except the controller's state (`peek_step`)."""
        return bool(self.spec.top_entropy or self.spec.stapo or self.spec.rsi
                    or (self.spec.stare and self.cfg.stare.scope == "batch"))

    # ---- 1. reward
    def reward_function(self, workers: int = 0):
        """The recipe's reward function (benchmarks.grading.rewards), created on first use; `close()` ends it."""
        if self._reward_fn is None:
            from benchmarks.grading.rewards import RewardFunction

            self._reward_fn = RewardFunction(self.recipe.reward.fn, timeout=self.recipe.reward.timeout_s,
                                             workers=workers)
        return self._reward_fn

    def close(self) -> None:
        if self._reward_fn is not None:
            self._reward_fn.close()
            self._reward_fn = None

    def score(self, texts: Sequence[str], golds: Sequence[str], finished: Sequence[bool],
              lengths: Sequence[int]) -> RolloutScores:
        """Training rewards of responses (texts, gold answers, whether each ended by itself, its
        length in tokens): the reward function's accuracy, 0 for cut responses under
        `rollout.truncated: zero`, -1 on a failed format check under `reward.format_penalty`, plus
        DAPO's overlong penalty when the method has it."""
        g = self.reward_function().grade(texts, golds)
        acc = torch.tensor(g.acc, dtype=torch.float32)
        if self.recipe.rollout.truncated == "zero":
            acc = acc * torch.tensor([float(f) for f in finished])
        fmt = torch.tensor(g.format, dtype=torch.float32)
        reward = torch.where(fmt > 0, acc, torch.full_like(acc, -1.0)) if self.recipe.reward.format_penalty else acc.clone()
        o = self.cfg.overlong
        if o.enable:
            reward = reward + overlong_penalty(torch.tensor(list(lengths)), self.recipe.rollout.max_response_tokens,
                                               o.buffer, o.factor)
        return RolloutScores(reward, acc, fmt, torch.tensor(g.official_score, dtype=torch.float32), g.verdicts)

    # ---- 2. dynamic sampling
    def keep_groups(self, acc: Tensor, group: Tensor) -> tuple[Tensor, int]:
        """(keep [B] bool, groups dropped): all kept without dynamic sampling."""
        if not self.cfg.dynamic_sampling:
            return torch.ones(acc.shape, dtype=torch.bool), 0
        return dynamic_sampling_keep(acc, group)

    # ---- 3. advantages
    def advantages(self, rewards: Tensor, group: Tensor) -> Tensor:
        """[B] advantage per response from [B] rewards and group ids."""
        if self.spec.advantage == "w_reinforce":
            return w_reinforce_advantage(rewards, self.cfg.w_reinforce_lambda)
        return grpo_advantage(rewards, group, eps=self.cfg.adv_eps, norm_by_std=self.cfg.adv_estimator == "grpo")

    # ---- 4. controller
    def begin_step(self, entropy: float) -> tuple[Optional[StareState], dict[str, float]]:
        """Update the step's controller with the batch's token-mean entropy H (once per step); returns the
        state for this step's loss calls (None for methods without a controller) and its metrics. STARE's
        gate reads this step's H; adaptive entropy control's coefficient is the one set by the steps before
        (Skywork-OR1 updates it after each step), then H moves it for the next step."""
        return _advance(self.controller, entropy)

    def peek_step(self, entropy: float) -> Optional[StareState]:
        """The state `begin_step(entropy)` would return, the controller left as it is (a copy is advanced): a
        prediction of this step's state from an estimate of H (a fused old pass's first micro-batch)."""
        return _advance(copy.deepcopy(self.controller), entropy)[0]

    # ---- 5. per-batch transform
    def transform_batch(self, b: BatchInputs, stare: Optional[StareState] = None) -> BatchTransform:
        """Token advantages [B, T] and the loss mask for this batch (module docstring, step 5)."""
        mask = b.mask.float()
        if self.recipe.rollout.truncated == "mask":
            mask = mask * b.finished.to(mask.device, torch.float32)[:, None]
        adv = self.advantages(b.rewards, b.group).to(mask.device, torch.float32)[:, None] * mask
        metrics: dict[str, float] = {}
        if (b.old_log_prob is None or b.entropy is None) and self.transform_reads_policy:
            raise ValueError(f"{self.cfg.name}'s batch transform reads pi_old's log-probs and entropies")
        if self.spec.top_entropy:
            adv = adv * top_entropy_mask(b.entropy, mask, self.cfg.top_entropy_frac)
        if self.spec.stapo:
            st = self.cfg.stapo
            spurious, tau_h = spurious_mask(adv, b.old_log_prob.float(), b.entropy.float(), mask, tau_p=st.tau_p,
                                            tau_h_quantile=st.tau_h_quantile)
            n_valid = float(mask.sum())
            mask = mask * (~spurious).to(mask.dtype)  # silenced: the aggregation renormalises over the rest
            adv = adv * mask
            metrics.update({"stapo/spurious_frac": float(spurious.sum()) / max(n_valid, 1.0),
                            "stapo/tau_h": float(tau_h)})
        if self.spec.rsi:
            r = self.cfg.rsi
            keep, st = rsi_keep_mask(b.old_log_prob.float(), b.entropy.float(), mask, low=r.low, high=r.high)
            mask = mask * keep.to(mask.dtype)  # dropped: the aggregation renormalises over the kept tokens
            adv = adv * mask
            metrics.update({f"rsi/{k}": float(v) for k, v in st.items()})
            metrics["rsi/dropped"] = metrics["rsi/below"] + metrics["rsi/above"]  # 0 at every step: never acted
        if self.spec.stare and self.cfg.stare.scope == "batch":
            if stare is None:
                raise ValueError("batch-scope STARE needs this step's StareState (begin_step)")
            adv, sel = self._stare(adv, b.old_log_prob.float(), mask, stare)
            metrics.update({k: float(v) for k, v in sel.items()})
        if b.old_log_prob is not None and b.entropy is not None:
            metrics.update(self.policy_metrics(adv, b.old_log_prob, b.entropy, mask))
        return BatchTransform(adv, mask, metrics)

    @staticmethod
    def policy_metrics(adv: Tensor, old_log_prob: Tensor, entropy: Tensor, mask: Tensor) -> dict[str, float]:
        """The transform's metrics that read pi_old ([B, T] each): the advantage x surprisal x entropy quadrants."""
        return {k: float(v) for k, v in quadrant_stats(adv, old_log_prob, entropy, mask).items()}

    def _stare(self, adv: Tensor, log_prob: Tensor, mask: Tensor, st: StareState) -> tuple[Tensor, dict[str, float]]:
        """w * A for one selection scope, and the shares of valid tokens in L+ and L- (selected whatever
        the gate, as the official code logs them)."""
        s = self.cfg.stare
        adv_eff, k_pos, k_neg, n = stare_scale(adv, log_prob, mask, P=s.P, W=st.W, M=st.M, variant=self.spec.stare,
                                               gate=st.gate)
        n = max(n, 1)
        return adv_eff, {"stare/sel_pos": k_pos / n, "stare/sel_neg": k_neg / n}  # on the host already

    # ---- 6. micro-batches
    def micro_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices (into `lengths`) of each micro-batch of one mini-batch: as few as fit
        `optim.micro_batch_tokens` (verl's dynamic batch size), or `optim.micro_batch_size` rows."""
        tokens = self.recipe.optim.micro_batch_tokens
        if tokens is not None:
            return token_budget_micro_batches(list(lengths), tokens)
        m = self.recipe.optim.micro_batch_size
        return [list(range(i, min(i + m, len(lengths)))) for i in range(0, len(lengths), m)]

    def update_plan(self, lengths: Sequence[int]) -> list[list[LossCall]]:
        """The loss calls of each mini-batch of one training batch ([B] tokens per row, prompt +
        response), under `optim.loss_layout`: 'global' takes the mini-batches in row order, the
        micro-batches above, each call normalised by the mini-batch's counts (scale 1); 'official'
        emulates the official run's ranks (baselines.micro_batches.official_loss_calls)."""
        O = self.recipe.optim
        per_mini = O.mini_batch_size * self.recipe.rollout.n
        lengths = [int(x) for x in lengths]
        if O.loss_layout == "official":
            return official_loss_calls(lengths, per_mini, O.official_ranks, O.micro_batch_tokens)
        plan = []
        for m0 in range(0, len(lengths), per_mini):
            mini = list(range(m0, min(m0 + per_mini, len(lengths))))
            plan.append([LossCall([mini[i] for i in mb], 1.0, False)
                         for mb in self.micro_batches([lengths[i] for i in mini])])
        return plan

    def call_agg(self, call: LossCall, mask: Tensor, mini_rows: Sequence[int]) -> Agg:
        """The aggregation of one loss call: its own counts under the official layout (the legacy
        worker's agg_loss without global counts), else the whole mini-batch's. mask: [B, T] loss mask."""
        rows = call.rows if call.own_norm else mini_rows
        return counted_agg(self.cfg.loss_agg, mask[list(rows)], self.recipe.rollout.max_response_tokens)

    def anneal(self, step: Optional[int]) -> float:
        """The factor on Clip-Cov's share and KL-Cov's coefficient at training step `step` (1-based)."""
        a = self.cfg.cov_anneal
        if a.schedule == "none":
            return 1.0
        if step is None:
            raise ValueError("an annealed Clip-Cov/KL-Cov loss call needs the training step (LossInputs.step)")
        return anneal_factor(step, a.steps or self.recipe.optim.total_steps, a.schedule, a.end)

    # ---- 7. loss
    def loss(self, x: LossInputs) -> tuple[Tensor, dict[str, Union[Tensor, float]]]:
        """The method's loss on one micro-batch (module docstring, step 7); stats are detached 0-dim
        tensors, or Python floats for numbers the host already has (the STARE shares): read them with
        `float()`."""
        cfg, spec = self.cfg, self.spec
        adv = x.advantages
        extra: dict[str, Union[Tensor, float]] = {}
        if spec.entro_adv:
            if x.entropy is None:
                raise ValueError("entro-adv needs the current policy's token entropy")
            adv = entro_adv(adv, x.entropy, cfg.entro_adv.alpha, cfg.entro_adv.kappa)
        if spec.stare and cfg.stare.scope == "official":
            if x.stare is None:
                raise ValueError("official-scope STARE needs this step's StareState")
            adv, extra = self._stare(adv, x.log_prob.detach().float(), x.mask, x.stare)
        if spec.cov_kernel:
            w, kstats = covariance_kernel_weights(adv, x.log_prob, x.mask)
            adv = adv * w
            extra.update({f"covk/{k}": v for k, v in kstats.items()})
        common = dict(log_prob=x.log_prob, old_log_prob=x.old_log_prob, adv=adv, mask=x.mask, agg=x.agg)
        if spec.loss == "ppo_clip":
            loss, stats = ppo_clip_loss(**common, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)
        elif spec.loss == "gspo":
            loss, stats = gspo_loss(**common, clip_low=cfg.gspo.clip_low, clip_high=cfg.gspo.clip_high)
        elif spec.loss == "clip_cov":
            c, s = cfg.clip_cov, self.anneal(x.step)
            loss, stats = clip_cov_loss(**common, clip_low=cfg.clip_low, clip_high=cfg.clip_high, ratio_frac=c.ratio * s,
                                        cov_lb=c.cov_lb, cov_ub=c.cov_ub, generator=x.generator)
            extra["cov_anneal"] = s
        elif spec.loss == "kl_cov":
            s = self.anneal(x.step)
            loss, stats = kl_cov_loss(**common, ratio_frac=cfg.kl_cov.ratio, coef=cfg.kl_cov.coef * s)
            extra["cov_anneal"] = s
        else:  # pragma: no cover - MethodSpec.loss is a closed Literal
            raise ValueError(spec.loss)
        coef = cfg.entropy_coef
        if cfg.adaptive_entropy.enable:
            if x.stare is None:
                raise ValueError("adaptive entropy control needs this step's state (begin_step)")
            coef += x.stare.entropy_coef
        if coef > 0:
            if x.entropy is None:
                raise ValueError("the entropy bonus needs the current policy's token entropy")
            bonus = entropy_bonus(x.entropy, x.mask, coef, x.agg)
            stats["entropy_bonus"] = bonus.detach()
            loss = loss + bonus
        stats.update(extra)
        return loss, {k: v.detach() if isinstance(v, Tensor) else v for k, v in stats.items()}
