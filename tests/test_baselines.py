"""The algorithm core: hand-computed cases (arithmetic in comments), invariants and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from baselines import (
    Agg,
    StareController,
    agg_loss,
    dynamic_sampling_keep,
    entro_adv,
    grpo_advantage,
    overlong_penalty,
    ppo_clip_loss,
    quadrant_stats,
    stare_token_weights,
    top_entropy_mask,
    w_reinforce_advantage,
)
from baselines.losses import gspo_token_losses, kl_cov_loss, ppo_clip_token_losses
from baselines.registry import METHODS, UnknownMethodError, lookup_method
from stare_kernel.errors import StareError
from stare_cli.method.layer import LossInputs, MethodLayer
from stare_cli.core.resolve import check_method, load_recipe


# ------------------------------------------------------------------------------------ advantages
def test_grpo_advantage_hand_computed():
    # Group 0: rewards 1,0,0,1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350...
    # A = +-0.5 / (0.577350 + 1e-6). Group 1 has one response: mean 0, std 1 -> A = 1 / (1 + 1e-6).
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([7, 7, 7, 7, 3])
    a = grpo_advantage(r, g)
    s = math.sqrt(1 / 3)
    expect = torch.tensor([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 1 / (1 + 1e-6)])
    assert_close(a, expect)


def test_drgrpo_has_no_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # mean 0.25
    assert_close(grpo_advantage(r, torch.zeros(4), norm_by_std=False), torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_zero_variance_group_gives_zero_advantage():
    a = grpo_advantage(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(a, torch.zeros(4))


def test_overlong_penalty_hand_computed():
    # L_max 20, L_buf 5: the ramp starts at 15. L=17 -> -(17-15)/5 = -0.4; L=20 -> -1; L<=15 -> 0.
    p = overlong_penalty(torch.tensor([10, 15, 17, 20]), max_len=20, buffer=5, factor=1.0)
    assert_close(p, torch.tensor([0.0, 0.0, -0.4, -1.0]))
    assert_close(overlong_penalty(torch.tensor([20]), 20, 5, factor=0.5), torch.tensor([-0.5]))


def test_dynamic_sampling_drops_all_equal_groups_and_keeps_single_responses():
    keep, dropped = dynamic_sampling_keep(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]),
                                          torch.tensor([0, 0, 1, 1, 2, 3, 3]))
    # group 0 varies (kept); group 1 all 1 and group 3 all 0 (dropped); group 2 has one response: kept,
    # as the official trainer (std > 0 or len == 1) and verl's replay buffer (len > 1 and std == 0) do
    assert keep.tolist() == [True, True, False, False, True, False, False]
    assert dropped == 2


def test_w_reinforce_advantage():
    assert_close(w_reinforce_advantage(torch.tensor([1.0, 0.0, 1.0]), lam=0.1), torch.tensor([0.1, -1.0, 0.1]))


# ----------------------------------------------------------------------------------- aggregation
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expect",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),  # 1 + 2 + 4: no normaliser
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / T (= 3)
    ],
)
def test_aggregation_hand_computed(mode, expect):
    assert agg_loss(LOSS, MASK, Agg(mode)).item() == pytest.approx(expect)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_independent_of_micro_batch_split(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(12, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(12, 9, generator=g) > 0.4).double()
    mask[3] = 0  # a fully masked row
    whole = agg_loss(loss, mask, Agg(mode))
    n_tok, n_seq = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    parts = sum(
        agg_loss(loss[i : i + 4], mask[i : i + 4], Agg(mode, num_tokens=n_tok, num_seqs=n_seq, scale=9)) for i in (0, 4, 8)
    )
    assert_close(parts, whole)


# ---------------------------------------------------------------------------------------- losses
def test_ppo_clip_hand_computed():
    # clip 0.2 / 0.28, dual-clip 10; old log-prob 0, so ratio = exp(log_prob).
    #  A=+1, r=1.5: max(-1.5, -1.28) = -1.28 (clipped)
    #  A=+1, r=0.5: max(-0.5, -0.8) = -0.5
    #  A=-1, r=1.5: max(1.5, 1.28) = 1.5; dual: min(10, 1.5) = 1.5
    #  A=-1, r=20:  max(20, 1.28) = 20; dual: min(10, 20) = 10 (dual-clip active)
    # token-mean: (-1.28 - 0.5 + 1.5 + 10) / 4 = 2.43
    ratio = torch.tensor([[1.5, 0.5, 1.5, 20.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, stats = ppo_clip_loss(ratio.log(), torch.zeros_like(ratio), adv, torch.ones_like(adv))
    assert loss.item() == pytest.approx(2.43)
    assert stats["clip_frac"].item() == pytest.approx(0.25)  # only the first token's clipped term is larger
    assert stats["clip_frac_lower"].item() == pytest.approx(0.25)
    loss_nodual, _ = ppo_clip_loss(ratio.log(), torch.zeros_like(ratio), adv, torch.ones_like(adv), dual_clip=None)
    assert loss_nodual.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 20) / 4)


def test_kl_cov_hand_computed():
    # Two valid tokens; A = [1, -1], log pi = [0, -1] (old = current, so ratio 1 and |log r| = 0).
    # cov = (A - 0)(logp + 0.5) = [0.5, 0.5]: both equal; k = max(1, int(2 * 0.5)) = 1 token penalised,
    # but |log r| = 0 so the loss is the plain PG: token-mean(-A) = (-1 + 1) / 2 = 0.
    lp = torch.tensor([[0.0, -1.0]])
    loss, stats = kl_cov_loss(lp, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), ratio_frac=0.5, coef=1.0)
    assert loss.item() == pytest.approx(0.0)
    assert stats["kl_frac"].item() == pytest.approx(0.5)


def test_kl_cov_with_one_update_per_batch_is_grpo_ds():
    """With one optimizer update per batch the update's log-probs are the old ones (verl 0.9.1 takes
    log_prob.detach() as old when on-policy), so KL-Cov's penalty coef * |log r| is 0 with a 0 gradient:
    the gradient is the plain policy gradient's to the bit (coef 0). A sweep's KL-Cov cell ran 23 steps
    bit-identical to GRPO-ds (docs/real-model-exploration.md); `method_warnings` now says so up front.
    Off-policy (old != current on the penalised tokens) the penalty moves the gradient."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=g) > 0.2).double()
    base = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 3

    def grad(old_shift: float, coef: float) -> torch.Tensor:
        lp = base.clone().requires_grad_(True)
        loss, _ = kl_cov_loss(lp, lp.detach() + old_shift, adv, mask, ratio_frac=0.2, coef=coef)
        loss.backward()
        return lp.grad

    assert torch.equal(grad(0.0, 1.0), grad(0.0, 0.0))  # on-policy: the penalty adds exactly nothing
    assert not torch.equal(grad(0.01, 1.0), grad(0.01, 0.0))  # a later update of the batch: it acts


def test_entro_adv_hand_computed():
    # A' = A + min(0.4 H, |A| / 2): A=1,H=1 -> 1 + min(0.4, 0.5) = 1.4; A=-1,H=2 -> -1 + min(0.8, 0.5) = -0.5
    out = entro_adv(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 2.0]), alpha=0.4, kappa=2.0)
    assert_close(out, torch.tensor([1.4, -0.5]))


def test_top_entropy_mask_keeps_top_fraction():
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.2], [5.0, 0.3, 0.8, 0.4, 0.6]])
    mask = torch.ones(2, 5)
    mask[1, 0] = 0  # the highest entropy is masked out and must not count
    m = top_entropy_mask(ent, mask, frac=0.2)  # 9 valid -> round(1.8) = 2 tokens: 0.9 and 0.8
    assert m.sum().item() == 2 and m[0, 1] == 1 and m[1, 2] == 1 and m[1, 0] == 0


# ------------------------------------------------------------------------------------------ STARE

STARE_PATHS = ("c", "numpy", "device")


def _use_stare_path(mp, path):
    """Force one of the three implementations: C on the host (the CPU default where it was built), NumPy
    on the host (its reference and fallback), and the torch path accelerators take, here on the CPU."""
    import baselines.stare as stare_mod

    if path == "c" and stare_mod._kernel is None:
        pytest.skip("the C selection was not built (no C compiler at install); the NumPy path runs instead")
    if path in ("numpy", "device"):
        mp.setattr(stare_mod, "_kernel", None)
    if path == "device":
        mp.setattr(stare_mod, "_on_host", lambda *args: False)


@pytest.fixture(params=STARE_PATHS)
def stare_path(request, monkeypatch):
    """Every STARE selection test runs on all three paths (_use_stare_path)."""
    _use_stare_path(monkeypatch, request.param)
    return request.param


def test_the_c_selection_is_built_where_a_compiler_is():
    """`pip install -e .` builds baselines/_stare_select.c (optional, so an install without a compiler
    still works): where the interpreter's C compiler exists, a missing kernel is a failed build."""
    import shlex
    import shutil
    import sysconfig

    import baselines.stare as stare_mod

    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the NumPy path runs")
    assert stare_mod._kernel is not None, "baselines/_stare_select.c did not build: run `pip install -e .` again and read its output"


def test_the_c_selection_refuses_what_it_cannot_read():
    import numpy as np

    import baselines.stare as stare_mod

    if stare_mod._kernel is None:
        pytest.skip("the C selection was not built")
    k = stare_mod._kernel
    a = np.ones(8, np.float32)
    out = np.empty(8, np.int64)
    with pytest.raises(TypeError, match="float32 or float64"):
        k.select(a.astype(np.float16), a, a.astype(np.float16), 0.5, True, out, out)
    with pytest.raises(TypeError, match="dtype"):
        k.select(a, a, a.astype(np.float64), 0.5, True, out, out)
    with pytest.raises(ValueError, match="same number"):
        k.select(a, a[:7], a, 0.5, True, out, out)
    with pytest.raises(ValueError, match="k\\(P, N\\)"):
        k.select(a, a, a, 0.5, True, out[:3], out)  # k(0.5, 8) = 4 positions may be written
    with pytest.raises(ValueError, match="dtype and size"):
        k.scale(a, a, a, 0.5, 1.1, 0.9, True, True, np.empty(8, np.float64))


def _case():
    # Row 0: A = +1 on 5 tokens with surprisal 0.1, 2.0, 0.5, 3.0, 1.0.
    # Row 1: A = -1 on 5 tokens with surprisal 5, 4, 3, 2, 1.
    s = torch.tensor([[0.1, 2.0, 0.5, 3.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    adv = torch.tensor([[1.0] * 5, [-1.0] * 5])
    return adv, -s, torch.ones(2, 5)


@pytest.mark.usefixtures("stare_path")
def test_stare_o1_hand_computed():
    adv, olp, mask = _case()
    # P 0.2: k = ceil(0.2 * 5) = 1 -> the surprisal-3.0 token of row 0 gets W.
    w = stare_token_weights(adv, olp, mask, P=0.2, W=1.1, variant="o1")
    expect = torch.ones(2, 5)
    expect[0, 3] = 1.1
    assert torch.equal(w, expect)
    # P 0.3: k = ceil(1.5) = 2 -> surprisal 3.0 and 2.0.
    w = stare_token_weights(adv, olp, mask, P=0.3, W=1.1)
    assert w[0].tolist() == pytest.approx([1, 1.1, 1, 1.1, 1])


@pytest.mark.usefixtures("stare_path")
def test_stare_c2_hand_computed():
    adv, olp, mask = _case()
    w = stare_token_weights(adv, olp, mask, P=0.2, W=1.1, M=0.9, variant="c2")
    expect = torch.ones(2, 5)
    expect[0, 3] = 1.1  # top of T+
    expect[1, 0] = 0.9  # top of T- (surprisal 5)
    assert torch.equal(w, expect)


@pytest.mark.usefixtures("stare_path")
def test_stare_ties_are_deterministic_by_position():
    adv = torch.ones(1, 6)
    olp = torch.full((1, 6), -1.0)  # every surprisal is 1.0
    w = stare_token_weights(adv, olp, torch.ones(1, 6), P=0.5, W=2.0)  # k = 3 -> the first three
    assert w.tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0, 1.0]]
    olp2 = torch.tensor([[-1.0, -3.0, -1.0, -1.0, -0.5, -1.0]])  # 3.0 first, then the ties of 1.0 in order
    w = stare_token_weights(adv, olp2, torch.ones(1, 6), P=0.5, W=2.0)
    assert w.tolist() == [[2.0, 2.0, 2.0, 1.0, 1.0, 1.0]]


@pytest.mark.usefixtures("stare_path")
def test_stare_empty_sets_masked_rows_and_zero_advantage():
    adv, olp, mask = _case()
    neg_only = -adv.abs()
    assert torch.equal(stare_token_weights(neg_only, olp, mask, P=0.2), torch.ones(2, 5))  # empty T+, O1
    w = stare_token_weights(neg_only, olp, mask, P=0.1, variant="c2", M=0.5)  # T- = 10 tokens, k = 1
    assert (w == 0.5).sum() == 1 and w[1, 0] == 0.5
    masked = mask.clone()
    masked[0] = 0  # row 0 masked: T+ is empty
    assert torch.equal(stare_token_weights(adv, olp, masked, P=1.0), torch.ones(2, 5))
    zero = torch.zeros_like(adv)
    assert torch.equal(stare_token_weights(zero, olp, mask, P=1.0, variant="c2"), torch.ones(2, 5))


@pytest.mark.usefixtures("stare_path")
def test_stare_p_zero_and_one_and_minimum_k():
    adv, olp, mask = _case()
    assert torch.equal(stare_token_weights(adv, olp, mask, P=0.0), torch.ones(2, 5))
    w = stare_token_weights(adv, olp, mask, P=1.0, W=1.1, M=0.9, variant="c2")
    assert_close(w, torch.tensor([[1.1] * 5, [0.9] * 5]))
    # |T+| = 5, P = 0.01 -> ceil(0.05) = 1: at least one token when T+ is non-empty.
    assert (stare_token_weights(adv, olp, mask, P=0.01) != 1).sum() == 1


@pytest.mark.usefixtures("stare_path")
def test_stare_k_is_exact_for_float_products():
    # 0.1 * 30 = 3.0000000000000004 in floating point; k must be 3, not 4.
    adv = torch.ones(1, 30)
    olp = -torch.arange(30, dtype=torch.float32).unsqueeze(0)
    w = stare_token_weights(adv, olp, torch.ones(1, 30), P=0.1, W=2.0)
    assert (w == 2.0).sum() == 3 and w[0, 27:].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.usefixtures("stare_path")
def test_stare_gate_off_gives_ones():
    adv, olp, mask = _case()
    assert torch.equal(stare_token_weights(adv, olp, mask, gate=False), torch.ones(2, 5))
    assert torch.equal(stare_token_weights(adv, olp, mask, P=0.2, gate=torch.tensor(False)), torch.ones(2, 5))
    assert stare_token_weights(adv, olp, mask, P=0.2, gate=torch.tensor(True)).max() == pytest.approx(1.1)


@pytest.mark.usefixtures("stare_path")
def test_stare_gate_is_coerced_with_bool():
    """numpy and integer gates mean what bool() says: np.bool_(False) and 0 are off."""
    import numpy as np

    adv, olp, mask = _case()
    for off in (np.bool_(False), 0, 0.0, np.int64(0)):
        assert torch.equal(stare_token_weights(adv, olp, mask, P=0.2, gate=off), torch.ones(2, 5)), off
    for on in (np.bool_(True), 1, np.int64(1)):
        assert stare_token_weights(adv, olp, mask, P=0.2, gate=on).max() == pytest.approx(1.1), on


def test_controller_takes_numpy_and_tensor_entropies():
    import numpy as np

    c = StareController(h_tgt=0.3)
    assert c.update(np.float32(0.1)) is True and c.update(torch.tensor(0.5)) is False
    assert isinstance(c.gate, bool) and c.steps == 2


@pytest.mark.parametrize("P", [-0.1, 1.5, float("nan")])
def test_stare_p_outside_unit_interval_is_rejected(P):
    adv, olp, mask = _case()
    with pytest.raises(ValueError, match=r"P must be in \[0, 1\]"):
        stare_token_weights(adv, olp, mask, P=P)
    with pytest.raises(ValueError, match=r"P must be in"):
        StareController(P=P)


@pytest.mark.usefixtures("stare_path")
def test_stare_variant_is_case_insensitive():
    adv, olp, mask = _case()
    assert torch.equal(stare_token_weights(adv, olp, mask, P=0.2, variant="C2"),
                       stare_token_weights(adv, olp, mask, P=0.2, variant="c2"))
    assert StareController(variant="O1").variant == "o1"
    with pytest.raises(ValueError, match="unknown STARE variant"):
        stare_token_weights(adv, olp, mask, variant="o2")


def test_stare_count_is_the_official_formula():
    """k = min(n, max(1, int(n P + 0.999999))): 0.1 * 30 -> 3 (float noise forgiven); a fraction above
    1e-6 rounds up (P 0.5, n 3 -> 2); one at or below it rounds down, as in the official code
    (P = 0.3333334, n 3: 1.0000002 + 0.999999 -> 1)."""
    from baselines.stare import _k

    assert _k(0.1, 30) == 3 and _k(0.5, 3) == 2 and _k(0.01, 5) == 1 and _k(1.0, 7) == 7 and _k(0.0, 7) == 0
    assert _k(0.3333334, 3) == 1


def test_stare_bf16_matches_fp32():
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(8, 64, generator=g)
    olp = -torch.rand(8, 64, generator=g) * 4
    mask = (torch.rand(8, 64, generator=g) > 0.3).float()
    w16 = stare_token_weights(adv.bfloat16(), olp.bfloat16(), mask, P=0.1, variant="c2")
    w32 = stare_token_weights(adv.bfloat16().float(), olp.bfloat16().float(), mask, P=0.1, variant="c2")
    assert torch.equal(w16, w32)
    assert w16.dtype == torch.float32


@pytest.mark.usefixtures("stare_path")
def test_stare_selection_size_on_random_batch():
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(16, 100, generator=g)
    olp = -torch.rand(16, 100, generator=g) * 5
    mask = (torch.rand(16, 100, generator=g) > 0.4).float()
    w = stare_token_weights(adv, olp, mask, P=0.1, W=1.1, M=0.9, variant="c2")
    n_pos = int(((adv > 0) & (mask > 0)).sum())
    n_neg = int(((adv < 0) & (mask > 0)).sum())
    assert int((w > 1).sum()) == math.ceil(0.1 * n_pos)
    assert int((w < 1).sum()) == math.ceil(0.1 * n_neg)
    # Every selected positive token is at least as surprising as every unselected one.
    s = -olp
    sel, rest = s[(w > 1)], s[(adv > 0) & (mask > 0) & (w == 1)]
    assert sel.min() >= rest.max()


def _reference_selection(adv, log_prob, mask, P, sign):
    """Brute force: the k = ceil-ish(P n) members of {valid, sign(A) = sign} ranked by surprisal
    |min(log pi, 0)| (NaN highest), ties to the earlier flat position."""
    from baselines.stare import _k

    a, lp, m = adv.double().reshape(-1).tolist(), log_prob.float().reshape(-1).tolist(), mask.reshape(-1).tolist()
    members = [i for i in range(len(a)) if m[i] != 0 and (a[i] * m[i] > 0 if sign > 0 else a[i] * m[i] < 0)]

    def rank(i):
        x = lp[i]
        return (1, 0.0, -i) if math.isnan(x) else (0, abs(min(x, 0.0)), -i)

    return sorted(sorted(members, key=rank, reverse=True)[:_k(P, len(members))])


def _selection_cases():
    """(name, adv, log_prob, mask): small and large, ties, +-0.0, log-probs above 0, +-NaN, infinities,
    float64 and mixed dtypes, bool masks, and a batch whose every-8th-member sample overestimates the threshold (the
    NumPy path's narrowing fails and falls back to the full partition)."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for n_rows, T in [(3, 7), (4, 600), (6, 1400)]:  # 6 x 1400: above the 1024-member narrowing
        adv = torch.randn(n_rows, 1, generator=g).expand(n_rows, T).contiguous()
        mask = (torch.rand(n_rows, T, generator=g) > 0.2).float()
        lp = -torch.rand(n_rows, T, generator=g) * 5
        cases.append((f"random {n_rows}x{T}", adv, lp, mask))
        cases.append((f"quantised ties {n_rows}x{T}", adv, (lp * 2).round() / 2, mask))
        odd = lp.clone().reshape(-1)
        odd[::5], odd[1::7], odd[2::11] = 0.0, -0.0, 0.25  # +0, -0 and a log-prob rounded above 0
        odd[3::13], odd[4::17], odd[6::19] = float("nan"), float("-inf"), float("inf")
        odd[8::23] = -float("nan")  # a NaN with the sign bit set: ranked as NaN too
        cases.append((f"+-0, >0, nan, inf {n_rows}x{T}", adv, odd.view(n_rows, T), mask.bool()))
        cases.append((f"float64 {n_rows}x{T}", adv.double(), lp.double(), mask))
        cases.append((f"float32 A, float64 log pi {n_rows}x{T}", adv, odd.view(n_rows, T).double(), mask))
        cases.append((f"float64 A, float32 log pi {n_rows}x{T}", adv.double(), odd.view(n_rows, T), mask))
    cases.append(("all tied, 1x5000", torch.ones(1, 5000), torch.full((1, 5000), -1.0), torch.ones(1, 5000)))  # keys sorted by position
    T = 4000  # one row of A > 0: the large surprisals sit exactly on the sampled members (every 8th)
    lp = torch.full((1, T), -0.5)
    lp[0, ::8] = -5.0 - torch.arange(0, T, 8) / T
    cases.append(("sample overestimates", torch.ones(1, T), lp, torch.ones(1, T)))
    return cases


@pytest.mark.parametrize("variant", ["o1", "c2"])
def test_stare_host_and_device_paths_agree_with_brute_force(variant, monkeypatch):
    """The C and NumPy host paths and the torch device path select what a brute-force ranking selects,
    and scale A to the same bits (stare_scale) and give the same weights (stare_token_weights)."""
    import baselines.stare as stare_mod
    from baselines.stare import stare_positions, stare_scale

    paths = [p for p in STARE_PATHS if p != "c" or stare_mod._kernel is not None]
    for name, adv, lp, mask in _selection_cases():
        for P in (0.1, 0.37):
            out = {}
            for path in paths:
                with monkeypatch.context() as mp:
                    _use_stare_path(mp, path)
                    pos, neg = stare_positions(adv, lp, mask, P=P, variant=variant)
                    out[path] = (sorted(pos.tolist()), sorted(neg.tolist()),
                                 stare_scale(adv, lp, mask, P=P, W=1.1, M=0.9, variant=variant),
                                 stare_token_weights(adv, lp, mask, P=P, W=1.1, M=0.9, variant=variant))
            ref_pos = _reference_selection(adv, lp, mask, P, +1)
            ref_neg = _reference_selection(adv, lp, mask, P, -1) if variant == "c2" else []
            d_adv, *d_counts = out["device"][2]
            for path in paths:
                assert out[path][0] == ref_pos and out[path][1] == ref_neg, (name, P, path)
                h_adv, *h_counts = out[path][2]
                assert h_adv.dtype == d_adv.dtype == adv.dtype and torch.equal(h_adv, d_adv) and h_counts == d_counts, (name, P, path)
                assert torch.equal(out[path][3], out["device"][3]), (name, P, path)


def test_stare_host_path_takes_cpu_tensors_only_outside_autograd():
    from baselines.stare import _on_host, stare_scale

    adv, olp, mask = torch.randn(2, 5), -torch.rand(2, 5), torch.ones(2, 5)
    assert _on_host(adv, olp, mask) and not _on_host(adv.bfloat16(), olp, mask)
    leaf = adv.clone().requires_grad_(True)
    assert not _on_host(leaf, olp, mask)
    out, *_ = stare_scale(leaf, olp, mask, P=0.5, W=2.0)  # the device path keeps the graph
    out.sum().backward()
    assert leaf.grad is not None and set(leaf.grad.unique().tolist()) <= {1.0, 2.0}
    scaled, *_ = stare_scale(adv, olp, mask, P=0.5, W=2.0)
    assert scaled.data_ptr() != adv.data_ptr()  # a copy: the caller's advantages are untouched


def test_controller_gate_adaptive_nan_and_state():
    c = StareController(h_tgt=0.3, W=1.1, M=0.9, adaptive=True, alpha=0.01, w_max=1.12, m_min=0.5)
    assert c.update(0.2) is True and c.W == pytest.approx(1.11) and c.M == pytest.approx(0.89)
    c.update(0.1)
    c.update(0.1)
    assert c.W == pytest.approx(1.12)  # clipped at w_max
    state = c.state_dict()
    assert c.update(float("nan")) is True and c.state_dict() == state  # NaN leaves it unchanged
    assert c.update(0.5) is False and c.W == pytest.approx(1.11) and c.M == pytest.approx(0.88)
    d = StareController()
    d.load_state_dict(c.state_dict())
    assert d == c
    fixed = StareController(adaptive=False)
    fixed.update(0.1)
    assert fixed.W == 1.1 and fixed.gate


# ------------------------------------------------------------------------------------ invariants
def _batch(seed=0, B=6, T=20, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    new = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).clone()
    adv[0] = 0.0  # a zero-variance group
    mask = (torch.rand(B, T, generator=g) > 0.25).to(dtype)
    mask[1] = 0  # a fully masked row
    return new, old, adv, mask


@pytest.mark.usefixtures("stare_path")
def test_unit_weights_or_gate_off_equal_grpo_loss():
    new, old, adv, mask = _batch()
    base, _ = ppo_clip_loss(new, old, adv, mask)
    for w in (
        stare_token_weights(adv, old, mask, W=1.0, M=1.0, variant="c2"),
        stare_token_weights(adv, old, mask, W=1.5, M=0.5, variant="c2", gate=False),
    ):
        loss, _ = ppo_clip_loss(new, old, adv * w.to(adv.dtype), mask)
        assert torch.equal(loss, base)


@pytest.mark.usefixtures("stare_path")
def test_c2_with_unit_m_equals_o1():
    new, old, adv, mask = _batch(1)
    assert torch.equal(
        stare_token_weights(adv, old, mask, W=1.3, M=1.0, variant="c2"), stare_token_weights(adv, old, mask, W=1.3)
    )


@pytest.mark.parametrize("dual", [10.0, None])
def test_advantage_transform_equals_loss_weighting_ppo_clip(dual):
    """w * clip-loss(A) == clip-loss(w * A) for w > 0, dual-clip included."""
    new, old, adv, mask = _batch(2)
    w = stare_token_weights(adv, old, mask, P=0.3, W=1.7, M=0.6, variant="c2").double()
    lhs, _ = ppo_clip_token_losses(new, old, adv * w, mask, dual_clip=dual)
    rhs, _ = ppo_clip_token_losses(new, old, adv, mask, dual_clip=dual)
    assert_close(lhs, w * rhs)
    # and after aggregation: token-mean of w * L == the loss with A_eff = w * A
    assert_close(agg_loss(w * rhs, mask), ppo_clip_loss(new, old, adv * w, mask, dual_clip=dual)[0])


def test_advantage_transform_equals_loss_weighting_gspo():
    new, old, adv, mask = _batch(3)
    w = 0.5 + torch.rand(adv.shape, generator=torch.Generator().manual_seed(0), dtype=adv.dtype)
    lhs, _ = gspo_token_losses(new, old, adv * w, mask)
    rhs, _ = gspo_token_losses(new, old, adv, mask)
    assert_close(lhs, w * rhs)


def test_entro_adv_breaks_the_identity():
    """Documented exception: EntroAdv's bonus is additive in A, so scaling A does not scale it."""
    adv = torch.tensor([1.0, -1.0])
    ent = torch.tensor([1.0, 0.1])
    assert not torch.allclose(entro_adv(2 * adv, ent), 2 * entro_adv(adv, ent))


# --------------------------------------------------------------------------------------- registry
def test_registry_names_and_did_you_mean():
    assert list(METHODS) == [
        "grpo", "grpo-ds", "dapo", "entropy-reg", "clip-cov", "kl-cov", "80-20", "entro-adv", "gspo",
        "w-reinforce", "stapo", "rsi-s", "cov-kernel", "adaptive-entropy", "stare-o1", "stare-c2",
    ]
    with pytest.raises(StareError, match=r"did you mean 'stare-c2'"):
        check_method("stare-c3")
    with pytest.raises(UnknownMethodError, match=r"did you mean 'grpo-ds'"):
        lookup_method("grpo-dz")
    assert lookup_method("STARE-O1") is METHODS["stare-o1"]  # names are case-insensitive
    assert load_recipe("tiny/arith", "GRPO-DS").method.name == "grpo-ds"  # and stored canonical
    assert METHODS["dapo"].defaults["method.overlong.enable"] is True
    assert METHODS["grpo-ds"].defaults["method.dynamic_sampling"] is True
    assert METHODS["grpo"].defaults["method.dynamic_sampling"] is False


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_loss_is_finite_and_differentiable(name):
    from stare_cli.method.layer import StareState

    layer = MethodLayer.from_recipe(load_recipe(None, name, list(METHODS[name].required_example)))
    new, old, adv, mask = _batch(4, dtype=torch.float32)
    new.requires_grad_(True)
    ent = torch.rand_like(new, requires_grad=True)
    loss, stats = layer.loss(LossInputs(log_prob=new, old_log_prob=old, advantages=adv, mask=mask, agg=Agg(),
                                        entropy=ent, stare=StareState(True, 1.1, 0.9),
                                        generator=torch.Generator().manual_seed(0)))
    loss.backward()
    assert torch.isfinite(loss) and new.grad is not None and torch.isfinite(new.grad).all()
    assert new.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ diagnostics
def test_quadrant_stats_hand_computed():
    # Tokens: (A, s, H): (+1, 2, 1) pos_high; (+1, 0.5, 1) pos_low; (-1, 3, 1) neg_high; (0, 1, 1) ignored.
    adv = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    s = torch.tensor([[2.0, 0.5, 3.0, 1.0]])
    h = torch.ones(1, 4)
    q = quadrant_stats(adv, -s, h, torch.ones(1, 4))
    assert q["quad/pos_high/share"].item() == pytest.approx(1 / 3)
    assert q["quad/neg_low/share"].item() == 0
    # dH = pi * A * (s - H) with pi = exp(-s): e^-2 * 1 * 1 for pos_high; e^-0.5 * 1 * (-0.5) for pos_low
    assert q["quad/pos_high/dH"].item() == pytest.approx(math.exp(-2))
    assert q["quad/pos_low/dH"].item() == pytest.approx(-0.5 * math.exp(-0.5))
    assert q["quad/neg_high/dH"].item() == pytest.approx(-2 * math.exp(-3))
    assert q["quad/neg_high/surprisal"].item() == pytest.approx(3.0)
