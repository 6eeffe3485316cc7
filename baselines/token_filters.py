"""Two 2026 token-level methods that act on the same lever as STARE, and an annealing schedule for the
covariance baselines: pure tensor functions, no I/O.

STAPO (arXiv 2602.15620, "Silencing Rare Spurious Tokens"): a token t is *spurious* when
    A_t > 0  and  pi(o_t) < tau_p  and  H_t < tau_h,
its update is silenced (mask M_t = 1 removes it from the loss) and the loss is renormalised over the
remaining tokens. The paper's defaults as reported: tau_p = 0.01, tau_h = the 5th percentile of the
token-entropy distribution (about 0.01% of tokens end up spurious).
Choices where the paper as we could read it is silent (stated here and in docs/guide/fidelity.md's Fidelity
section; no official code was found):
- pi and H are the rollout policy's (the old-log-prob pass), and the 5th percentile is taken over the
  valid response tokens of the whole training batch, once per step (`spurious_mask` takes whatever
  tokens the caller gives it; stare_cli/method/layer.py passes the batch). On the first mini-batch of
  an on-policy step pi_old == pi_theta, so this differs from the current policy only on later
  mini-batches / epochs.
- the percentile is linearly interpolated between order statistics (numpy's default), and the
  comparisons are strict (H < tau_h: at most the given share of tokens can pass the entropy test).
- "renormalise over the remaining tokens" is implemented by removing the spurious tokens from the
  loss mask, so every aggregation (token-mean and the seq-mean modes) divides by the counts without them.

RSI-S (arXiv 2606.31575, "Which Tokens Matter? Adaptive Token Selection for RLVR with the Relative Surprisal
Index"): the relative surprisal index of a sampled token couples its surprisal with its position's entropy,
    RSI_t = s_t / H_t,   s_t = -log pi(o_t),   H_t = -sum_v pi(v) log pi(v),
and RSI-S trains only on the tokens whose RSI lies in a stable interval [low, high], dropping both the
redundant low-surprisal tokens and the unstable high-surprisal tail. Under the policy's own sampling
E[s_t] = H_t, so RSI centres on 1 whatever the entropy: that normalisation is what makes the filter
entropy-adaptive. Only the abstract and two third-party re-implementations (not the authors'; their
intervals are their own guesses) were readable here, so:
- the paper's interval is not known: `method.rsi.low` / `method.rsi.high` have no default and the rsi-s
  method refuses to run without both (stare_cli/core/config.py);
- choices where the abstract is silent (stated in docs/guide/fidelity.md): pi and H are the rollout
  policy's (the old-log-prob pass), as for STAPO; the interval is closed; both advantage signs are
  filtered; dropped tokens leave the loss mask, so every aggregation renormalises over the kept tokens;
  H_t = 0 gives RSI 0 when s_t = 0 (a certain token: redundant) and an infinite RSI otherwise.

Covariance-aware Gaussian-kernel reweighting (arXiv 2605.11538, "Taming Extreme Tokens"): entropy
change under softmax policies is driven by the covariance between a token's log-probability and its
advantage; the per-token covariance term
    c_t = (log pi_t - mean log pi) (A_t - mean A)
(the centred product Clip-Cov/KL-Cov rank tokens by, arXiv 2505.22617) is turned into a weight by a
Gaussian kernel whose centre and bandwidth come from the same tokens, so there is no hyperparameter:
    w_t = exp(-(c_t - mu_c)^2 / (2 sigma_c^2)),   mu_c = mean c,  sigma_c = std c (population),
and the loss is PPO-clip on w_t A_t. Tokens with extreme covariance (either sign) are down-weighted;
typical tokens keep w close to 1. Choices where the paper as we could read it is silent: the means are
over the valid tokens of one loss call on the current policy's log-probs (detached), as verl computes
Clip-Cov/KL-Cov's covariance; the weights are not renormalised to mean 1 (a pure down-weighting; the
run's metrics log the mean weight); sigma_c = 0 (all terms equal) gives w = 1.

Annealing (arXiv 2604.09676 argues Clip-Cov and KL-Cov are asymptotically unbiased only when their
coefficient is annealed): `anneal_factor` gives the factor s(step) in [end, 1] that multiplies
KL-Cov's coefficient and Clip-Cov's detached share.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from baselines.aggregation import masked_mean


def masked_quantile(x: Tensor, mask: Tensor, q: float) -> Tensor:
    """The q-quantile of x over mask > 0, linearly interpolated between order statistics (numpy's default).

    Args:
        x, mask: [B, T]; q in [0, 1].
    Returns:
        0-dim float32 tensor; +inf when no token is valid.
    """
    v = x.detach()[mask > 0].float().reshape(-1)
    if v.numel() == 0:
        return torch.tensor(float("inf"), device=x.device)
    v, _ = torch.sort(v)
    pos = q * (v.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, v.numel() - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


def spurious_mask(adv: Tensor, log_prob: Tensor, entropy: Tensor, mask: Tensor, *, tau_p: float = 0.01,
                  tau_h_quantile: float = 0.05) -> tuple[Tensor, Tensor]:
    """STAPO's S2T mask (module docstring): spurious = valid & A > 0 & pi < tau_p & H < tau_h, where tau_h
    is the tau_h_quantile-quantile of H over the valid tokens given.

    Args:
        adv: [B, T] token advantages; log_prob: [B, T] log pi(o_t); entropy: [B, T] token entropies H_t;
        mask: [B, T] valid tokens.
        tau_p: probability threshold (paper: 0.01).
        tau_h_quantile: the entropy threshold as a quantile of H over valid tokens (paper: 0.05).
    Returns:
        spurious: [B, T] bool; tau_h: 0-dim tensor (the entropy threshold used).
    """
    valid = mask > 0
    tau_h = masked_quantile(entropy, mask, tau_h_quantile)
    low_p = log_prob.detach() < math.log(tau_p)  # pi < tau_p, compared in log space (no underflow)
    spurious = valid & (adv > 0) & low_p & (entropy.detach() < tau_h)
    return spurious, tau_h


def relative_surprisal_index(log_prob: Tensor, entropy: Tensor, mask: Tensor) -> Tensor:
    """RSI_t = -log pi(o_t) / H_t (module docstring), 0 on invalid tokens, in float64: one division of the
    given values rounded once, so that which side of an interval end a token falls on is float64's (in
    float32 a subnormal s_t / H_t underflows to 0).

    Args:
        log_prob: [B, T] log pi(o_t); entropy: [B, T] token entropies H_t >= 0; mask: [B, T] valid tokens.
    Returns:
        rsi: [B, T] float64; where H_t = 0: 0 if s_t = 0, +inf if s_t > 0.
    """
    s = -log_prob.detach().double()
    H = entropy.detach().double()
    rsi = torch.where(H > 0, s / H.clamp(min=torch.finfo(torch.float64).tiny),
                      torch.where(s > 0, torch.inf, 0.0))
    return torch.where(mask > 0, rsi, 0.0)


def rsi_keep_mask(log_prob: Tensor, entropy: Tensor, mask: Tensor, *, low: float,
                  high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """RSI-S's selection: keep = valid & low <= RSI <= high (module docstring).

    Args:
        log_prob, entropy, mask: [B, T] as in `relative_surprisal_index`; low < high: the interval.
    Returns:
        keep: [B, T] bool; stats (0-dim, shares of the valid tokens): kept, below (RSI < low), above
        (RSI > high), and the mean RSI of the valid tokens of finite RSI.
    """
    valid = mask > 0
    rsi = relative_surprisal_index(log_prob, entropy, mask)  # float64: the ends are not rounded to float32 either
    below, above = valid & (rsi < low), valid & (rsi > high)
    keep = valid & ~below & ~above
    n = valid.sum().clamp(min=1).float()
    finite = valid & torch.isfinite(rsi)
    mean = (torch.where(finite, rsi, 0.0).sum() / finite.sum().clamp(min=1)).float()
    return keep, {"kept": keep.sum() / n, "below": below.sum() / n, "above": above.sum() / n, "mean": mean}


def _centred(x: Tensor, mask: Tensor) -> Tensor:
    """x - mean x over mask > 0, in float32, exactly 0 where all valid values are equal.

    A float32 mean of n equal values need not equal them (0.57735 * 3 / 3 rounds), and the kernel is
    scale-free (it divides by the variance of c), so a rounding residue of 1e-8 would act like a real
    spread. Equality is tested on the values themselves, not on the rounded mean. Shapes: [B, T] -> [B, T].
    """
    v = x.detach().float()
    valid = mask > 0
    hi = torch.where(valid, v, -torch.inf).amax()
    lo = torch.where(valid, v, torch.inf).amin()
    return torch.where(hi == lo, 0.0, v - masked_mean(v, mask))  # no host sync


def covariance_kernel_weights(adv: Tensor, log_prob: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The Gaussian-kernel token weights of covariance-aware GRPO (module docstring).

    c_t = (log pi_t - mean log pi)(A_t - mean A); w_t = exp(-(c_t - mu_c)^2 / (2 sigma_c^2)), with means and the
    (population) standard deviation over the valid tokens; w = 1 where sigma_c = 0 and on invalid tokens. A
    factor whose valid values are all equal (one advantage value in the call) is centred to exactly 0, so
    such a call gives c = 0 and w = 1 (not a float32 rounding residue of the mean, which the scale-free
    kernel would amplify).

    Args:
        adv: [B, T] token advantages; log_prob: [B, T] log pi(o_t) (detached here); mask: [B, T].
    Returns:
        w: [B, T] float32 in (0, 1]; stats: mean_w (over valid tokens), sigma_c.
    """
    valid = mask > 0
    c = _centred(log_prob, mask) * _centred(adv, mask)
    d2 = (c - masked_mean(c, mask)) ** 2
    var = masked_mean(d2, mask)
    z2 = torch.where(var > 0, d2 / (2 * var).clamp(min=torch.finfo(torch.float32).tiny), 0.0)  # no host sync
    w = torch.where(valid, torch.exp(-z2), 1.0)
    return w, {"mean_w": masked_mean(w, mask), "sigma_c": var.sqrt()}


Schedule = Literal["none", "linear", "cosine"]


def anneal_factor(step: int, steps: int, schedule: Schedule = "none", end: float = 0.0) -> float:
    """The factor s in [end, 1] for training step `step` (1-based) of an annealing over `steps` steps.

    Progress p = min((step - 1) / (steps - 1), 1) (p = 1 when steps == 1): the first step runs the full
    coefficient, step `steps` and later the end value.
        none:   s = 1
        linear: s = 1 - (1 - end) p
        cosine: s = end + (1 - end) (1 + cos(pi p)) / 2
    """
    if schedule == "none":
        return 1.0
    if step < 1 or steps < 1:
        raise ValueError(f"step and steps are 1-based, got step={step}, steps={steps}")
    p = 1.0 if steps == 1 else min((step - 1) / (steps - 1), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - end) * p
    if schedule == "cosine":
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown schedule {schedule!r}")
