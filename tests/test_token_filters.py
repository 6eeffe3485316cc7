"""STAPO's spurious-token mask, RSI-S's relative-surprisal interval, the covariance Gaussian-kernel weights and the Clip-Cov/KL-Cov annealing
(baselines/token_filters.py), by hand and through the method layer; the invariants each paper states."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from baselines.aggregation import Agg, agg_loss, masked_mean
from baselines.losses import clip_cov_loss, kl_cov_loss, ppo_clip_token_losses
from baselines.token_filters import (anneal_factor, covariance_kernel_weights, masked_quantile,
                                    relative_surprisal_index, rsi_keep_mask, spurious_mask)
from stare_kernel.errors import StareError
from stare_cli.core.resolve import load_recipe
from stare_cli.method.layer import BatchInputs, LossInputs, MethodLayer


def _layer(method: str, *o: str) -> MethodLayer:
    return MethodLayer.from_recipe(load_recipe("tiny/arith", method, list(o)))


# ------------------------------------------------------------------------------------ quantile
def test_masked_quantile_interpolates_like_numpy():
    # valid values 4, 1, 3, 2 (the 9 and 7 are masked): sorted 1 2 3 4; q = 0.5 -> position 1.5 -> 2.5;
    # q = 0.05 -> position 0.15 -> 1 + 0.15 (2 - 1) = 1.15; q = 0 -> 1; q = 1 -> 4
    x = torch.tensor([[4.0, 1.0, 9.0], [3.0, 2.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    for q, want in ((0.5, 2.5), (0.05, 1.15), (0.0, 1.0), (1.0, 4.0)):
        assert float(masked_quantile(x, m, q)) == pytest.approx(want, abs=1e-6)
    assert math.isinf(float(masked_quantile(x, torch.zeros_like(m), 0.05)))


# ------------------------------------------------------------------------------------- STAPO
def test_spurious_mask_hand_computed():
    # tokens (A, pi, H); valid entropies 0.1 0.5 0.2 0.3 0.4 0.3 -> sorted 0.1 0.2 0.3 0.3 0.4 0.5:
    # the 0.5-quantile sits at position 2.5 -> 0.3 + 0.5 (0.3 - 0.3) = 0.3
    #   t0: A>0, pi 0.005 < 0.01, H 0.1                 -> spurious
    #   t1: A>0, pi 0.005,        H 0.5 (high entropy)  -> kept
    #   t2: A>0, pi 0.5 (likely), H 0.2                 -> kept
    #   t3: A<0, pi 0.005,        H 0.3                 -> kept (negative advantage)
    #   t4: A=0, pi 0.005,        H 0.4                 -> kept (zero advantage)
    #   t5: A>0, pi 0.009,        H 0.3                 -> kept: H < tau_h is strict
    #   t6: A>0, pi 0.001,        H 0.0 but masked out  -> not valid, not spurious
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, 0.0, 1.0, 1.0]])
    pi = torch.tensor([[0.005, 0.005, 0.5, 0.005, 0.005, 0.009, 0.001]])
    H = torch.tensor([[0.1, 0.5, 0.2, 0.3, 0.4, 0.3, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 0]])
    sp, tau_h = spurious_mask(adv, pi.log(), H, mask, tau_p=0.01, tau_h_quantile=0.5)
    assert float(tau_h) == pytest.approx(0.3)
    assert sp.tolist() == [[True, False, False, False, False, False, False]]
    # q 0.9: position 4.5 -> 0.4 + 0.5 (0.5 - 0.4) = 0.45: t5 (H 0.3) now spurious too, t1 (H 0.5) not
    sp, _ = spurious_mask(adv, pi.log(), H, mask, tau_p=0.01, tau_h_quantile=0.9)
    assert sp.tolist() == [[True, False, False, False, False, True, False]]
    sp, _ = spurious_mask(adv, pi.log(), H, mask, tau_p=0.005, tau_h_quantile=0.9)  # pi < 0.005 strictly: none
    assert not sp.any()


def test_stapo_silences_spurious_tokens_and_renormalises_over_the_rest():
    """STAPO's loss equals PPO-clip token-mean over the non-spurious tokens only (the paper's
    renormalisation), and spurious tokens get exactly zero gradient."""
    layer = _layer("stapo", "method.stapo.tau_p=0.01", "method.stapo.tau_h_quantile=0.5")
    # one group of 2: rewards 1, 0 -> A = +0.7071, -0.7071 (std with Bessel, 2 samples: (1-0.5)/0.7071)
    old = torch.tensor([[math.log(0.005), math.log(0.6), math.log(0.5), -0.2],
                        [math.log(0.005), math.log(0.6), -1.0, 0.0]])
    ent = torch.tensor([[0.05, 0.9, 0.8, 0.7], [0.05, 0.9, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    bt = layer.transform_batch(BatchInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, old, ent,
                                           torch.ones(2, dtype=torch.bool)))
    # valid entropies 0.05 0.9 0.8 0.7 0.05 0.9 0.6 -> sorted 0.05 0.05 0.6 0.7 0.8 0.9 0.9: median 0.7
    # spurious: row 0 token 0 only (A > 0, pi 0.005, H 0.05); row 1 token 0 has A < 0
    assert bt.mask.tolist() == [[0.0, 1, 1, 1], [1, 1, 1, 0]]
    assert bt.metrics["stapo/spurious_frac"] == pytest.approx(1 / 7)
    assert bt.metrics["stapo/tau_h"] == pytest.approx(0.7)
    new = (old + 0.1).requires_grad_(True)
    loss, _ = layer.loss(LossInputs(new, old, bt.advantages, bt.mask, Agg(num_tokens=float(bt.mask.sum()))))
    (g,) = torch.autograd.grad(loss, new)
    assert g[0, 0] == 0 and (g[0, 1:] != 0).all()
    # the same number by hand: token-mean of the PPO-clip losses over the 6 remaining tokens
    A = bt.advantages
    tl, _ = ppo_clip_token_losses(new.detach(), old, A, bt.mask)
    assert_close(loss.detach(), (tl * bt.mask).sum() / 6)


def test_stapo_with_no_spurious_token_is_grpo_ds():
    b = _batch(0)
    stapo, ds = _layer("stapo"), _layer("grpo-ds")  # paper thresholds: no fixture token has pi < 0.01
    x = BatchInputs(b["r"], b["g"], b["m"], b["old"], b["ent"], torch.ones(len(b["r"]), dtype=torch.bool))
    t1, t2 = stapo.transform_batch(x), ds.transform_batch(x)
    assert torch.equal(t1.mask, t2.mask) and torch.equal(t1.advantages, t2.advantages)
    assert t1.metrics["stapo/spurious_frac"] == 0.0


# ------------------------------------------------------------------------------------- RSI-S
def test_relative_surprisal_index_hand_computed():
    # RSI = -log pi / H:
    #   t0: pi 0.5 (s = ln 2 = 0.6931), H 0.6931            -> 1.0 (a token as surprising as its position)
    #   t1: pi 0.9 (s = 0.10536),       H 0.5                -> 0.21072
    #   t2: pi 0.01 (s = 4.6052),       H 0.5                -> 9.2103
    #   t3: pi 1 (s = 0),               H 0 (a certain token) -> 0
    #   t4: pi 0.2 (s = 1.6094),        H 0 (rounded away)    -> +inf
    #   t5: masked out                                        -> 0
    pi = torch.tensor([[0.5, 0.9, 0.01, 1.0, 0.2, 0.3]])
    H = torch.tensor([[math.log(2), 0.5, 0.5, 0.0, 0.0, 0.4]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    rsi = relative_surprisal_index(pi.log(), H, mask)
    assert rsi[0, :3].tolist() == pytest.approx([1.0, 0.21072, 9.2103], rel=1e-4)
    assert rsi[0, 3] == 0 and math.isinf(rsi[0, 4]) and rsi[0, 5] == 0
    # interval [0.2, 1.0], closed: t0 (1.0) and t1 (0.21) kept; t2 and t4 above; t3 below
    keep, stats = rsi_keep_mask(pi.log(), H, mask, low=0.2, high=1.0)
    assert keep.tolist() == [[True, True, False, False, False, False]]
    assert float(stats["kept"]) == pytest.approx(2 / 5) and float(stats["below"]) == pytest.approx(1 / 5)
    assert float(stats["above"]) == pytest.approx(2 / 5)
    # mean over the valid tokens of finite RSI: (1 + 0.21072 + 9.2103 + 0) / 4 = 2.6053
    assert float(stats["mean"]) == pytest.approx(2.6053, rel=1e-4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 12.0), st.floats(0.0, 6.0), st.booleans()), min_size=1, max_size=40),
       st.floats(0.0, 3.0), st.floats(0.01, 5.0))
def test_rsi_selection_partitions_the_valid_tokens_as_float64_says(tokens, low, width):
    """For every batch and interval: kept, below and above partition the valid tokens; a token is kept
    exactly when float64's s / H lies in [low, high] (s and H are float32 values, exact in float64; the
    division rounds once, so only a value within 2 ulps of float64 of an end could differ: the test spares
    2 ulps of float32); invalid tokens are never kept; widening the interval never drops a kept token.
    (Hypothesis found the float32 path's faults: a lower end of 5e-77 rounded to 0, and a subnormal
    s / H that underflowed to 0.)"""
    high = low + width
    s = torch.tensor([[t[0] for t in tokens]], dtype=torch.float32)
    H = torch.tensor([[t[1] for t in tokens]], dtype=torch.float32)
    mask = torch.tensor([[float(t[2]) for t in tokens]])
    keep, stats = rsi_keep_mask(-s, H, mask, low=low, high=high)
    rsi = relative_surprisal_index(-s, H, mask)
    valid = mask > 0
    below, above = valid & (rsi < low), valid & (rsi > high)
    assert torch.equal(keep | below | above, valid) and not (keep & below).any() and not (keep & above).any()
    n = max(int(valid.sum()), 1)
    assert float(stats["kept"]) == pytest.approx(int(keep.sum()) / n)
    for i, (si, hi, v) in enumerate(tokens):
        s64, h64 = float(s[0, i].double()), float(H[0, i].double())
        r64 = s64 / h64 if h64 > 0 else (math.inf if s64 > 0 else 0.0)
        near = any(math.isfinite(r64) and abs(r64 - e) <= 2 * 2**-24 * max(abs(r64), abs(e)) for e in (low, high))
        if not v:
            assert not keep[0, i]
        elif not near:
            assert bool(keep[0, i]) == (low <= r64 <= high), (si, hi, low, high)
    wider, _ = rsi_keep_mask(-s, H, mask, low=low / 2, high=high * 2)
    assert not (keep & ~wider).any()


def test_rsi_s_drops_out_of_interval_tokens_and_renormalises_over_the_rest():
    """RSI-S's loss is PPO-clip token-mean over the tokens of RSI in the interval, and the others get
    exactly zero gradient, whatever their advantage's sign."""
    layer = _layer("rsi-s", "method.rsi.low=0.5", "method.rsi.high=2")
    # one group of 2: rewards 1, 0 -> A = +0.7071, -0.7071
    # RSI = -old / ent: row 0: 0.05/0.5 = 0.1 (below), 0.5/0.5 = 1 (kept), 1.6/0.8 = 2 (kept: closed), 3/1 = 3 (above)
    #                   row 1: 0.4/0.4 = 1 (kept), 0.3/0.2 = 1.5 (kept), 2.4/0.6 = 4 (above), padding
    old = -torch.tensor([[0.05, 0.5, 1.6, 3.0], [0.4, 0.3, 2.4, 0.0]])
    ent = torch.tensor([[0.5, 0.5, 0.8, 1.0], [0.4, 0.2, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    bt = layer.transform_batch(BatchInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, old, ent,
                                           torch.ones(2, dtype=torch.bool)))
    assert bt.mask.tolist() == [[0.0, 1, 1, 0], [1, 1, 0, 0]]
    assert bt.metrics["rsi/kept"] == pytest.approx(4 / 7) and bt.metrics["rsi/below"] == pytest.approx(1 / 7)
    assert bt.metrics["rsi/above"] == pytest.approx(2 / 7)
    new = (old + 0.1).requires_grad_(True)
    loss, _ = layer.loss(LossInputs(new, old, bt.advantages, bt.mask, Agg(num_tokens=float(bt.mask.sum()))))
    (g,) = torch.autograd.grad(loss, new)
    assert (g[bt.mask == 0] == 0).all() and (g[bt.mask > 0] != 0).all()
    tl, _ = ppo_clip_token_losses(new.detach(), old, bt.advantages, bt.mask)
    assert_close(loss.detach(), (tl * bt.mask).sum() / 4)


def test_rsi_s_refuses_to_run_without_its_interval():
    with pytest.raises(StareError, match=r"method.rsi.low / method.rsi.high: rsi-s needs them and has no default"):
        load_recipe("short-cot/qwen2.5-math-7b", "rsi-s")
    with pytest.raises(StareError, match=r"method.rsi.high: rsi-s needs it and has no default"):
        load_recipe("short-cot/qwen2.5-math-7b", "rsi-s", ["method.rsi.low=0.5"])
    with pytest.raises(StareError, match=r"low < high"):
        load_recipe("short-cot/qwen2.5-math-7b", "rsi-s", ["method.rsi.low=2", "method.rsi.high=2"])
    # other methods do not read the keys (a sweep sets them for every cell)
    assert load_recipe("short-cot/qwen2.5-math-7b", "grpo-ds", ["method.rsi.low=0.5"]).method.rsi.low == 0.5


def test_rsi_s_with_an_interval_that_keeps_every_token_is_grpo_ds():
    b = _batch(0)
    rsi, ds = _layer("rsi-s", "method.rsi.low=0", "method.rsi.high=1e30"), _layer("grpo-ds")
    b["ent"] = b["ent"] + 0.01 * b["m"]  # no zero entropy on a valid token (its RSI would be infinite)
    x = BatchInputs(b["r"], b["g"], b["m"], b["old"], b["ent"], torch.ones(len(b["r"]), dtype=torch.bool))
    t1, t2 = rsi.transform_batch(x), ds.transform_batch(x)
    assert torch.equal(t1.mask, t2.mask) and torch.equal(t1.advantages, t2.advantages)
    assert t1.metrics["rsi/kept"] == 1.0


def _batch(seed: int, B: int = 8, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    m = (torch.arange(T)[None] < torch.randint(3, T + 1, (B,), generator=g)[:, None]).float()
    old = -(torch.rand(B, T, generator=g) * 3 + 0.01) * m
    return dict(r=torch.randint(0, 2, (B,), generator=g).float(), g=torch.arange(B) // 4, m=m, old=old,
                new=old + 0.2 * torch.randn(B, T, generator=g) * m, ent=torch.rand(B, T, generator=g) * m)


# ---------------------------------------------------------------------------- covariance kernel
def test_covariance_kernel_weights_hand_computed():
    # 4 valid tokens: log pi = 0, -1, -2, -3 (mean -1.5) and A = 1, 1, -1, -1 (mean 0)
    # c = (lp + 1.5) A = 1.5, 0.5, 0.5, 1.5; mu = 1; var = (0.25 + 0.25 + 0.25 + 0.25) / 4 = 0.25
    # w = exp(-(c - 1)^2 / (2 * 0.25)) = exp(-0.25 / 0.5) = exp(-0.5) for all four
    lp = torch.tensor([[0.0, -1.0, -2.0, -3.0, -9.0]])
    A = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]])
    m = torch.tensor([[1.0, 1, 1, 1, 0]])
    w, st = covariance_kernel_weights(A, lp, m)
    assert_close(w, torch.tensor([[math.exp(-0.5)] * 4 + [1.0]]))
    assert float(st["sigma_c"]) == pytest.approx(0.5)
    # one extreme token: log pi 0, -1, -1, -1, -1 (mean -0.8), A 1, 0, 0, 0, 0 (mean 0.2)
    # c = (0.8)(0.8) = 0.64 for token 0, (-0.2)(-0.2) = 0.04 for the others; mu = (0.64 + 4 * 0.04) / 5 = 0.16
    # var = (0.48^2 + 4 * 0.12^2) / 5 = (0.2304 + 0.0576) / 5 = 0.0576
    # w0 = exp(-0.2304 / 0.1152) = exp(-2); others exp(-0.0144 / 0.1152) = exp(-0.125)
    lp = torch.tensor([[0.0, -1, -1, -1, -1]])
    A = torch.tensor([[1.0, 0, 0, 0, 0]])
    w, st = covariance_kernel_weights(A, lp, torch.ones_like(A))
    assert_close(w, torch.tensor([[math.exp(-2), *[math.exp(-0.125)] * 4]]))
    assert float(st["mean_w"]) == pytest.approx((math.exp(-2) + 4 * math.exp(-0.125)) / 5, rel=1e-6)


def test_covariance_kernel_invariants():
    """Weights lie in (0, 1], equal 1 only at the mean covariance, and fall with the distance from it;
    constant covariance (sigma 0) and masked tokens give 1; the weights do not depend on a shift of log pi
    or of A (the centring) and are symmetric in the sign of A."""
    b = _batch(3)
    A = (b["r"][:, None] - 0.5) * b["m"] * torch.linspace(0.5, 1.5, 12)[None]
    w, _ = covariance_kernel_weights(A, b["new"], b["m"])
    v = b["m"] > 0
    assert ((w > 0) & (w <= 1)).all() and (w[~v] == 1).all()
    lp, a = b["new"].detach(), A
    mlp = (lp * b["m"]).sum() / b["m"].sum()
    ma = (a * b["m"]).sum() / b["m"].sum()
    c = ((lp - mlp) * (a - ma))[v]
    d = (c - c.mean()).abs()
    order = torch.argsort(d)
    assert (w[v][order].diff() <= 1e-6).all()  # monotone in |c - mu|
    # shift invariance, against a float64 reference: |dw/dz| <= e^-1/2 and z = (c - mu) / sigma; float32
    # centring of values up to 6 (ulp 4.8e-7) leaves errors of ~1e-6 in c, so with sigma_c >= 0.1 the
    # weights are within 2e-5 of the exact ones (measured over 200 seeds: at most 5e-6 apart)
    lp64, a64, m64 = b["new"].double(), A.double(), b["m"].double()
    n = m64.sum()
    c64 = (lp64 - (lp64 * m64).sum() / n) * (a64 - (a64 * m64).sum() / n)
    mu64 = (c64 * m64).sum() / n
    var64 = (((c64 - mu64) ** 2) * m64).sum() / n
    assert var64.sqrt() >= 0.1
    ref = torch.where(m64 > 0, torch.exp(-((c64 - mu64) ** 2) / (2 * var64)), torch.ones_like(c64))
    w2, _ = covariance_kernel_weights(A + 3.0 * b["m"], b["new"] - 2.0 * b["m"], b["m"])
    assert_close(w.double(), ref, atol=2e-5, rtol=0)
    assert_close(w2.double(), ref, atol=2e-5, rtol=0)
    w3, _ = covariance_kernel_weights(-A, b["new"], b["m"])
    assert_close(w3, w)
    w4, st = covariance_kernel_weights(torch.ones_like(A), b["new"], b["m"])  # A constant: c = 0 everywhere
    assert (w4 == 1).all() and float(st["sigma_c"]) == 0.0


def test_covariance_kernel_one_advantage_value_gives_weight_one():
    # A loss call whose valid tokens all carry one advantage value (one group, or groups sharing a solve
    # count): c = (lp - mean lp) * 0 = 0, so w must be exactly 1. The float32 mean of such values is not
    # always the value itself: below, for a = 0.1 + k/7 (k = 0..99), 30 values out of 100 have a float32
    # masked mean != a (checked: the test asserts such a case is present), and the scale-free kernel turned
    # that residue into weights near 0 before the fix (issue 49, item 1).
    g = torch.Generator().manual_seed(0)
    lp = -3 * torch.rand(6, 50, generator=g)
    m = (torch.rand(6, 50, generator=g) > 0.2).float()
    residues = 0
    for k in range(100):
        a = torch.tensor(0.1 + k / 7, dtype=torch.float32)
        A = a * torch.ones(6, 50)
        residues += int(float(masked_mean(A, m)) != float(a))
        w, st = covariance_kernel_weights(A, lp, m)
        assert (w == 1).all() and float(st["sigma_c"]) == 0.0, k
        w, _ = covariance_kernel_weights(torch.randn(6, 50, generator=g), lp.new_full((6, 50), -0.7), m)  # lp uniform
        assert (w == 1).all(), k
    assert residues > 0  # the case the fix is for occurs in this sample


def test_cov_kernel_loss_is_ppo_clip_on_weighted_advantages():
    b = _batch(5)
    layer = _layer("cov-kernel")
    A = (b["r"][:, None] - 0.5) * b["m"]
    new = b["new"].clone().requires_grad_(True)
    agg = Agg(num_tokens=float(b["m"].sum()))
    loss, st = layer.loss(LossInputs(new, b["old"], A, b["m"], agg))
    w, _ = covariance_kernel_weights(A, b["new"], b["m"])
    tl, _ = ppo_clip_token_losses(b["new"], b["old"], A * w, b["m"], clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    assert_close(loss.detach(), agg_loss(tl, b["m"], agg))
    assert 0 < float(st["covk/mean_w"]) < 1
    (g,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


# ----------------------------------------------------------------------------------- annealing
def test_anneal_factor_hand_computed():
    # 5 steps: progress (step - 1) / 4 = 0, 0.25, 0.5, 0.75, 1
    assert [anneal_factor(s, 5, "linear", 0.0) for s in range(1, 7)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    # linear to 0.2: 1 - 0.8 p
    assert anneal_factor(3, 5, "linear", 0.2) == pytest.approx(0.6)
    # cosine: end + (1 - end)(1 + cos(pi p)) / 2; p = 0.25: (1 + 0.70711) / 2 = 0.85355
    assert anneal_factor(2, 5, "cosine", 0.0) == pytest.approx(0.853553, abs=1e-6)
    assert anneal_factor(3, 5, "cosine", 0.2) == pytest.approx(0.6)
    assert anneal_factor(5, 5, "cosine", 0.1) == pytest.approx(0.1)
    assert anneal_factor(1, 1, "linear", 0.3) == pytest.approx(0.3)  # one step: already at the end
    assert anneal_factor(7, 5, "none") == 1.0
    with pytest.raises(ValueError):
        anneal_factor(0, 5, "linear")


def test_annealed_kl_cov_scales_the_coefficient_and_clip_cov_the_share():
    b = _batch(2, B=8, T=12)
    A = (b["r"][:, None] - 0.5) * 2 * b["m"]
    agg = Agg(num_tokens=float(b["m"].sum()))
    kl = _layer("kl-cov", "method.cov_anneal.schedule=linear", "method.cov_anneal.end=0.0", "optim.total_steps=5",
                "method.kl_cov.ratio=0.2")
    for step, s in ((1, 1.0), (2, 0.75), (5, 0.0)):
        got, st = kl.loss(LossInputs(b["new"], b["old"], A, b["m"], agg, step=step))
        want, _ = kl_cov_loss(b["new"], b["old"], A, b["m"], ratio_frac=0.2, coef=s, agg=agg)
        assert_close(got, want)
        assert st["cov_anneal"] == s
    # at the end of the annealing KL-Cov is the plain policy gradient -A r
    end, _ = kl.loss(LossInputs(b["new"], b["old"], A, b["m"], agg, step=9))
    assert_close(end, agg_loss(-A * torch.exp(b["new"] - b["old"]), b["m"], agg))
    with pytest.raises(ValueError, match="training step"):
        kl.loss(LossInputs(b["new"], b["old"], A, b["m"], agg))
    cc = _layer("clip-cov", "method.cov_anneal.schedule=linear", "optim.total_steps=3", "method.clip_cov.ratio=0.5",
                "method.clip_cov.cov_lb=-100", "method.clip_cov.cov_ub=100")
    n = int(b["m"].sum())
    detached = []
    for step in (1, 2, 3):
        _, st = cc.loss(LossInputs(b["new"], b["old"], A, b["m"], agg, step=step,
                                   generator=torch.Generator().manual_seed(0)))
        detached.append(round(float(st["clip_frac"]) * n))
    # share 0.5, 0.25, 0 of the n valid tokens (capped by those PPO-clip left unclipped)
    unclipped = int(((torch.maximum(-A * torch.exp(b["new"] - b["old"]),
                                    -A * torch.clamp(torch.exp(b["new"] - b["old"]), 0.8, 1.28))
                      == -A * torch.exp(b["new"] - b["old"])) & (b["m"] > 0)).sum())
    assert detached == [min(int(0.5 * n), unclipped), min(int(0.25 * n), unclipped), 0]
    # unannealed: the configured share every step
    plain = _layer("clip-cov", "method.clip_cov.ratio=0.5", "method.clip_cov.cov_lb=-100", "method.clip_cov.cov_ub=100")
    _, st = plain.loss(LossInputs(b["new"], b["old"], A, b["m"], agg, step=3, generator=torch.Generator().manual_seed(0)))
    assert round(float(st["clip_frac"]) * n) == detached[0]
    # the loss function itself: share 0 detaches nothing; any share > 0 at least one token (verl)
    l0, s0 = clip_cov_loss(b["new"], b["old"], A, b["m"], ratio_frac=0.0, cov_lb=-100, cov_ub=100, agg=agg)
    assert float(s0["clip_frac"]) == 0.0
    _, s1 = clip_cov_loss(b["new"], b["old"], A, b["m"], ratio_frac=1e-9, cov_lb=-100, cov_ub=100, agg=agg)
    assert round(float(s1["clip_frac"]) * n) == 1


def test_cov_anneal_is_refused_for_other_methods_naming_file_line_and_key(tmp_path):
    with pytest.raises(StareError, match=r"-o method.cov_anneal.schedule=linear: method.cov_anneal.schedule"):
        load_recipe("tiny/arith", "stare-o1", ["method.cov_anneal.schedule=linear"])
    from conftest import REPO

    f = tmp_path / "r.yaml"
    f.write_text(f"include: {REPO / 'recipes' / 'tiny' / 'arith.yaml'}\nmethod:\n  cov_anneal:\n    schedule: cosine\n")
    with pytest.raises(StareError, match=rf"{f}:4: method.cov_anneal.schedule \('cosine'\) anneals Clip-Cov and KL-Cov"):
        load_recipe(str(f), "grpo-ds")
    assert load_recipe(str(f), "kl-cov").method.cov_anneal.schedule == "cosine"  # accepted where it is read


def test_an_rsi_s_run_whose_interval_dropped_nothing_never_acted(tmp_path):
    """An interval wide enough to keep every token trains as GRPO-ds: `stare compare` and the sweep mark the
    run (§) from its logged dropped share, 0 at every step; one step with a dropped token is acting."""
    import json

    from stare_kernel.ledger import run_acted

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "rsi/dropped": 0.0}) + "\n" for i in (1, 2, 3)))
    assert run_acted(tmp_path, None) == "RSI-S's interval never dropped a token (3 of 3 steps)"
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "rsi/dropped": 0.02}) + "\n")
    assert run_acted(tmp_path, None) is None and run_acted(tmp_path, 3) is not None
