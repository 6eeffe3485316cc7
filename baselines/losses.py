"""Policy losses with one signature, usable by the embedded trainer and registrable into verl.

Every loss takes [B, T] tensors: `log_prob` (current policy, with grad), `old_log_prob` (rollout
policy), `adv` (token-level advantages), `mask` (1 for response tokens that count), plus its own
keyword parameters and an `Agg`. It returns (scalar loss, stats), where stats are 0-dim tensors
(no host synchronisation). Formulas and defaults match verl 0.9.1's core_algos; tests check parity.

The identity w * loss(A) == loss(w * A) for per-token w > 0 holds for ppo_clip_loss (with
clip-higher and dual-clip), gspo_loss and the masked/weighted forms (80/20, W-REINFORCE), because
each token loss is a max/min of terms linear in A with sign-preserving scaling. It does not hold for
clip_cov_loss and kl_cov_loss (which tokens are selected depends on the covariance with A), for the
EntroAdv shaping (additive in A) or for the entropy bonus (not multiplied by A).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from baselines.aggregation import Agg, agg_loss, masked_mean


def _ratio(log_prob: Tensor, old_log_prob: Tensor) -> tuple[Tensor, Tensor]:
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # verl's guard against overflow
    return torch.exp(neg_kl), neg_kl


def ppo_clip_token_losses(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: Optional[float] = 10.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO-clip losses [B, T] (before aggregation) and stats; see ppo_clip_loss."""
    ratio, neg_kl = _ratio(log_prob, old_log_prob)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    stats = {"clip_frac": masked_mean(torch.gt(pg2, pg1).float(), mask), "ppo_kl": masked_mean(-neg_kl, mask)}
    if dual_clip is None:
        stats["clip_frac_lower"] = torch.zeros((), device=adv.device)
        return clipped, stats
    pg3 = -adv * dual_clip
    stats["clip_frac_lower"] = masked_mean(torch.gt(clipped, pg3).float() * (adv < 0).float(), mask)
    return torch.where(adv < 0, torch.minimum(pg3, clipped), clipped), stats


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: Optional[float] = 10.0,
    agg: Agg = Agg(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip with asymmetric clip (clip-higher, DAPO) and dual-clip c (Ye et al. 2020).

    L_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); for A < 0 also min(L_t, -A c).

    Args:
        log_prob, old_log_prob, adv, mask: [B, T].
        clip_low, clip_high: epsilon below and above 1.
        dual_clip: c > 1, or None to disable.
        agg: aggregation mode and global counts.
    Returns:
        loss: scalar; stats: clip_frac, clip_frac_lower (dual-clip active), ppo_kl.
    """
    token_loss, stats = ppo_clip_token_losses(
        log_prob, old_log_prob, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    return agg_loss(token_loss, mask, agg), stats


def gspo_token_losses(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO losses [B, T] and stats; see gspo_loss."""
    neg_kl = log_prob - old_log_prob
    m = mask.to(neg_kl.dtype)
    seq_kl = (neg_kl * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_ratio = log_prob - log_prob.detach() + seq_kl.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    stats = {"clip_frac": masked_mean(torch.gt(pg2, pg1).float(), mask), "ppo_kl": masked_mean(-neg_kl, mask)}
    return torch.maximum(pg1, pg2), stats


def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: Agg = Agg("seq-mean-token-mean"),
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv 2507.18071): the sequence-level ratio s_i = exp(mean_t log(pi/pi_old)), clipped.

    The per-token form s_i,t = sg[s_i] * pi_t / sg[pi_t] gives the GSPO-token gradient (verl).

    Args:
        log_prob, old_log_prob, adv, mask: [B, T].
        clip_low, clip_high: the (small) sequence-ratio clip range.
        agg: the paper and verl use seq-mean-token-mean.
    Returns:
        loss; stats: clip_frac, ppo_kl.
    """
    token_loss, stats = gspo_token_losses(log_prob, old_log_prob, adv, mask, clip_low=clip_low, clip_high=clip_high)
    return agg_loss(token_loss, mask, agg), stats


def clip_cov_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ratio_frac: float = 0.0002,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
    agg: Agg = Agg(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (arXiv 2505.22617): detach the gradient of a few random tokens whose centred
    covariance (A - mean A)(log pi - mean log pi) lies in (cov_lb, cov_ub), among tokens PPO-clip
    did not already clip; ceil-free count max(int(ratio_frac * N), 1), as verl.

    Args:
        log_prob, old_log_prob, adv, mask: [B, T].
        clip_low, clip_high: the PPO clip range.
        ratio_frac: share of valid tokens detached (0: none, the end of an annealing; any share > 0
            detaches at least one token, as verl).
        cov_lb, cov_ub: the covariance window.
        generator: RNG for the random choice (verl uses the global RNG; pass one for parity).
        agg: aggregation.
    Returns:
        loss; stats: clip_frac (share detached), ppo_kl.
    """
    neg_kl = log_prob - old_log_prob  # unclamped, as verl's clip_cov
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (log_prob - masked_mean(log_prob.detach(), mask))
    cov = cov.detach().masked_fill(mask == 0, -torch.inf).masked_fill(clip_by_origin, -torch.inf)
    n_clip = max(int(ratio_frac * mask.sum().item()), 1) if ratio_frac > 0 else 0  # 0: annealed off
    idx = torch.nonzero((cov < cov_ub) & (cov > cov_lb) & (mask > 0))
    if n_clip and len(idx):
        perm = torch.randperm(len(idx), generator=generator)
        idx = idx[perm[: min(n_clip, len(idx))].to(idx.device)]
    else:
        idx = idx[:0]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    token_loss = torch.maximum(pg1, pg2) * corr
    stats = {"clip_frac": masked_mean((corr == 0).float(), mask), "ppo_kl": masked_mean(-neg_kl, mask)}
    return agg_loss(token_loss, mask, agg), stats


def kl_cov_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    ratio_frac: float = 0.002,
    coef: float = 1.0,
    agg: Agg = Agg(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (arXiv 2505.22617): policy gradient -A r, plus coef * |log r| on the top
    max(int(ratio_frac * N), 1) valid tokens by covariance (A - mean A)(log pi - mean log pi).

    Args:
        log_prob, old_log_prob, adv, mask: [B, T].
        ratio_frac: share of valid tokens penalised (published 7B: 0.002).
        coef: the KL coefficient (published 7B: 1).
        agg: aggregation.
    Returns:
        loss; stats: ppo_kl (mean |log r|), kl_frac (share penalised).
    """
    neg_kl = log_prob - old_log_prob
    ratio = torch.exp(neg_kl)
    pg = -adv * ratio
    pg_kl = pg + coef * neg_kl.abs()
    valid = mask > 0
    flat_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a = adv[valid].detach().reshape(-1)
    lp = log_prob[valid].detach().reshape(-1)
    sel = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
    if a.numel() > 0:
        cov = (a - a.mean()) * (lp - lp.mean())
        k = max(1, int(a.numel() * ratio_frac))
        sel[flat_idx[torch.topk(cov, k, largest=True).indices]] = True
    sel = sel.view_as(adv)
    token_loss = torch.where(sel, pg_kl, pg)
    stats = {"ppo_kl": masked_mean(neg_kl.abs(), mask), "kl_frac": masked_mean(sel.float(), mask)}
    return agg_loss(token_loss, mask, agg), stats


def entro_adv(adv: Tensor, entropy: Tensor, alpha: float = 0.4, kappa: float = 2.0) -> Tensor:
    """EntroAdv shaping (arXiv 2506.14758): A' = A + min(alpha * sg[H], |A| / kappa).

    Args:
        adv: [B, T] advantages; entropy: [B, T] token entropies of the current policy.
    Returns:
        [B, T] shaped advantages (no gradient through the bonus).
    """
    return adv + torch.minimum(alpha * entropy.detach(), adv.abs() / kappa)


def top_entropy_mask(entropy: Tensor, mask: Tensor, frac: float = 0.2) -> Tensor:
    """80/20 rule (arXiv 2506.01939): keep the top `frac` of valid tokens by entropy.

    Ties at the threshold are all kept (a threshold rule, like the paper's quantile).

    Args:
        entropy: [B, T] token entropies; mask: [B, T] valid tokens; frac: share kept.
    Returns:
        [B, T] float mask, 1 on kept valid tokens.
    """
    valid = mask > 0
    ent = entropy.detach().float()
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(mask, dtype=torch.float32)
    k = max(1, int(round(frac * n)))
    thr = torch.topk(ent[valid], k, largest=True, sorted=False).values.min()
    return ((ent >= thr) & valid).float()


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, agg: Agg = Agg()) -> Tensor:
    """Entropy regularisation term to add to the loss: -coef * agg(H).

    Args:
        entropy: [B, T] token entropies with grad; mask: [B, T]; coef >= 0.
    Returns:
        scalar (<= 0 for coef > 0).
    """
    return -coef * agg_loss(entropy, mask, agg)
