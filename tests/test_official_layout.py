"""The official run's data-parallel layout, emulated (`optim.loss_layout: official`; issue 29).

The official STARE run trains with verl 0.7's legacy worker on 16 ranks: the trainer balances the batch
over ranks (`_balance_batch`), each rank forms `ceil(tokens / 8192)` micro-batches (the count maxed over
ranks, no check that each fits), every micro-batch's loss is a token-mean over its own tokens times its
share of the rank's rows (`loss_scale_factor`), and FSDP averages gradients over ranks. The references
below are written from reading that code (hp-luo/STARE: ray_trainer._balance_batch, dp_actor.update_policy,
seqlen_balancing.rearrange_micro_batches, core_algos.agg_loss) on top of verl's own partition functions,
whose Karmarkar-Karp is identical in 0.7 and 0.9.1 (checked line by line)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from baselines.micro_batches import (
    balanced_partitions,
    legacy_micro_batches,
    official_loss_calls,
    rank_split,
    token_budget_micro_batches,
)
from benchmarks.perf.official_reference import official_loss, official_weights
from stare_cli.core.resolve import load_recipe
from stare_cli.method.layer import BatchInputs, LossInputs, MethodLayer

seqlen = pytest.importorskip("verl.utils.seqlen_balancing")


# ----------------------------------------------------------------- references (the official code)
def _ref_balance_batch(lengths: list[int], ranks: int) -> list[list[int]]:
    """ray_trainer._balance_batch (keep_minibatch False) and the equal split to ranks."""
    work = seqlen.calculate_workload(torch.tensor(lengths)).tolist()
    parts = seqlen.get_seqlen_balanced_partitions(work, k_partitions=ranks, equal_size=True)
    out = []
    for p in parts:
        p = sorted(p, key=lambda x: (work[x], x))
        out.append(p[::2] + p[1::2][::-1])
    return out


def _ref_rearrange(rank_lengths: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """verl 0.7 rearrange_micro_batches on every rank (same_micro_num_in_dp: the MAX all-reduce)."""
    n = max(min(len(ls), -(-sum(ls) // max_tokens)) for ls in rank_lengths)
    out = []
    for ls in rank_lengths:
        work = seqlen.calculate_workload(torch.tensor(ls)).tolist()
        parts = seqlen.get_seqlen_balanced_partitions(work, n, equal_size=False)
        parts.sort(key=lambda p: (sum(work[i] for i in p), p[0] if p else 0), reverse=True)
        out.append(parts[::2][::-1] + parts[1::2])
    return out


# ---------------------------------------------------------------------------- the partitions
def test_equal_size_partitions_are_verls():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.choice([1, 2, 4, 8, 16])
        values = [rng.randint(1, 10**8) for _ in range(k * rng.randint(1, 8))]
        assert balanced_partitions(values, k, equal_size=True) == \
            seqlen.get_seqlen_balanced_partitions(values, k_partitions=k, equal_size=True)
    with pytest.raises(ValueError, match="equal size"):
        balanced_partitions([1, 2, 3], 2, equal_size=True)


def test_rank_split_hand_computed():
    # Workloads w(L) = 24576 L + L^2 rise with L. Equal-size differencing with k = 2 starts from the pairs
    # {L=2 | L=1} (spread w2 - w1 = 24579) and {L=4 | L=3} (spread w4 - w3 = 24583); the larger spread is
    # merged first, its larger set taking the other's smaller: {4, 1} and {3, 2} (rows [0, 3] and [1, 2]).
    # Within a rank, rows by workload with the light ones at both ends: [0, 3] -> [0] + [3]; [1, 2] likewise.
    assert rank_split([1, 2, 3, 4], 2) == [[0, 3], [1, 2]]


def test_rank_split_is_the_official_balance_batch():
    rng = random.Random(1)
    for _ in range(100):
        ranks = rng.choice([1, 2, 4, 8, 16])
        lengths = [rng.randint(20, 4096) for _ in range(ranks * rng.randint(1, 8))]
        split = rank_split(lengths, ranks)
        assert split == _ref_balance_batch(lengths, ranks)
        assert sorted(i for r in split for i in r) == list(range(len(lengths)))


def test_legacy_micro_batches_hand_computed():
    # One rank of three 4-token rows, budget 6: ceil(12 / 6) = 2 micro-batches, not checked against the
    # budget: {4} and {4, 4} (8 tokens > 6). verl 0.9.1's rule (token_budget_micro_batches) adds a third.
    parts = legacy_micro_batches([[4, 4, 4]], 6)[0]
    assert sorted(len(p) for p in parts) == [1, 2]
    assert len(token_budget_micro_batches([4, 4, 4], 6)) == 3
    # The count is agreed over ranks (the MAX all-reduce): rank 0 needs ceil(5 / 100) = 1, rank 1 two
    # (ceil(150 / 100) = 2), so rank 0 also splits into 2.
    assert [len(r) for r in legacy_micro_batches([[2, 3], [70, 80]], 100)] == [2, 2]
    with pytest.raises(ValueError, match="holds only 1 rows"):
        legacy_micro_batches([[2], [90, 90]], 100)


def test_legacy_micro_batches_are_verl_07s_and_can_exceed_the_budget():
    rng = random.Random(2)
    over = differ = 0
    for _ in range(150):
        ranks = rng.choice([1, 2, 4])
        per_rank = rng.randint(4, 32)
        rank_lengths = [[rng.choice([rng.randint(50, 300), rng.randint(2000, 4096)]) for _ in range(per_rank)]
                        for _ in range(ranks)]
        ours = legacy_micro_batches(rank_lengths, 8192)
        assert ours == _ref_rearrange(rank_lengths, 8192)
        for ls, parts in zip(rank_lengths, ours):
            over += any(sum(ls[i] for i in p) > 8192 for p in parts)
            differ += parts != token_budget_micro_batches(ls, 8192)
    assert over > 0 and differ > 0  # long responses: the two verl versions partition differently


def test_official_loss_calls_scale_to_the_rank_average():
    lengths = [random.Random(3).randint(100, 2000) for _ in range(32)]
    plan = official_loss_calls(lengths, rows_per_mini=16, ranks=4, max_tokens=4096)
    assert len(plan) == 2  # two mini-batches of 16 rows: 4 per rank each
    for calls in plan:
        rows = [i for c in calls for i in c.rows]
        assert len(rows) == len(set(rows)) == 16
        # each rank's scales sum to 1 (its rows' shares), and there are 4 ranks averaged: total 1
        assert sum(c.scale for c in calls) == pytest.approx(1.0)
        assert all(c.own_norm for c in calls)
        for r in range(4):
            assert sum(c.scale for c in calls if c.rank == r) == pytest.approx(0.25)
    split = rank_split(lengths, 4)
    # each rank's mini-batches are its rows in order, 4 at a time (the legacy worker's data.split)
    assert {i for c in plan[0] if c.rank == 1 for i in c.rows} == set(split[1][:4])
    assert {i for c in plan[1] if c.rank == 1 for i in c.rows} == set(split[1][4:8])


# --------------------------------------------------------------- the loss path, against the worker's
def _batch(seed: int, B: int, T: int = 48):
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(4, T + 1, (B,), generator=g)
    prompt = torch.randint(3, 16, (B,), generator=g)
    mask = (torch.arange(T)[None] < resp[:, None]).double()
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 3 + 0.01) * mask
    new = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * mask
    acc = torch.randint(0, 2, (B,), generator=g).double()
    return dict(B=B, mask=mask, old=old, new=new, ent=ent, acc=acc, lengths=(prompt + resp).tolist())


def _layer(method: str, ranks: int, tokens: int, layout: str = "official") -> MethodLayer:
    o = ["rollout.refill=per_group", f"optim.loss_layout={layout}", f"optim.official_ranks={ranks}",
         f"optim.micro_batch_tokens={tokens}", "optim.train_batch_size=8", "optim.mini_batch_size=8", "rollout.n=4",
         "optim.micro_batch_size=4", "rollout.max_prompt_tokens=16", "rollout.max_response_tokens=48",
         "eval.benchmarks=[]", "method.overlong.buffer=8", "method.stare.h_tgt=10", "method.stare.P=0.2",
         "method.stare.W=1.5", "method.stare.M=0.7"]
    return MethodLayer.from_recipe(load_recipe("short-cot/qwen2.5-math-7b", method, o))


def _ours(layer: MethodLayer, b: dict):
    """The embedded trainer's steps 5-6: the layer's plan, each call's loss normalised by call_agg and
    multiplied by its scale; gradients accumulate over calls."""
    state, _ = layer.begin_step(0.05)
    bt = layer.transform_batch(BatchInputs(b["acc"], torch.arange(b["B"]) // 4, b["mask"], b["old"], b["ent"],
                                           torch.ones(b["B"], dtype=torch.bool)), state)
    (calls,) = layer.update_plan(b["lengths"])
    mini = [i for c in calls for i in c.rows]
    new = b["new"].clone().requires_grad_(True)
    total = 0.0
    for c in calls:
        loss, _ = layer.loss(LossInputs(new[c.rows], b["old"][c.rows], bt.advantages[c.rows], bt.mask[c.rows],
                                        layer.call_agg(c, bt.mask, mini), stare=state))
        total = total + loss * c.scale
    (grad,) = torch.autograd.grad(total, new)
    return bt.advantages, [c.rows for c in calls], total.detach(), grad


def _official_worker(adv: torch.Tensor, b: dict, ranks: int, tokens: int, variant: str):
    """The official run's path: balance over ranks, each rank's micro-batches (verl 0.7), the official
    STARE loss per micro-batch over its own tokens times rows / rows per rank, gradients averaged over ranks."""
    split = _ref_balance_batch(b["lengths"], ranks)
    per_rank = b["B"] // ranks
    mbs = _ref_rearrange([[b["lengths"][i] for i in rows] for rows in split], tokens)
    new = b["new"].clone().requires_grad_(True)
    order, selected, total, magnitude = [], [], 0.0, 0.0
    for rows, parts in zip(split, mbs):
        rank_loss = 0.0
        for p in parts:
            idx = [rows[i] for i in p]
            order.append(idx)
            loss, _ = official_loss(b["old"][idx], new[idx], adv[idx], b["mask"][idx], P=0.2, W=1.5, M=0.7,
                                    variant=variant, gate=True)
            w, _ = official_weights(b["new"][idx], adv[idx], b["mask"][idx], P=0.2, W=1.5, M=0.7, variant=variant)
            # the sum of |token terms| of this call, for the rounding bound (|A| w max(ratio, clip) / n)
            ratio = torch.exp(b["new"][idx] - b["old"][idx]).clamp(min=0.8)
            magnitude += float((adv[idx].abs() * w * ratio * b["mask"][idx]).sum() / b["mask"][idx].sum()
                               * len(idx) / per_rank / ranks)
            selected += [(idx[r], t) for r, t in ((w != 1) & (b["mask"][idx] > 0)).nonzero().tolist()]
            rank_loss = rank_loss + loss * (len(idx) / per_rank)  # loss_scale_factor
        total = total + rank_loss
    total = total / ranks  # the all-reduce's mean over data-parallel ranks
    (grad,) = torch.autograd.grad(total, new)
    return order, sorted(selected), total.detach(), grad, magnitude


@pytest.mark.parametrize("variant", ["o1", "c2"])
@pytest.mark.parametrize("ranks,tokens", [(1, 256), (4, 128), (8, 64)])
def test_loss_gradients_and_selection_are_the_official_workers(variant, ranks, tokens):
    """One 32-row mini-batch, 1, 4 or 8 emulated ranks: the same loss calls, the same loss, the same
    per-token gradient, the same selected tokens. Tolerance: the log-probs are float64, but the method
    layer's advantages are float32 and it scales A by w there (the official code scales the token loss
    in the log-probs' dtype), so each token term carries one float32 rounding of w A: relative error
    <= 2^-24 per term; the loss is bounded by 2^-23 x the sum of |terms| (float64 sums add ~1e-16)."""
    b = _batch(10 + ranks, 32)
    layer = _layer(f"stare-{variant}", ranks, tokens)
    adv, calls, loss, grad = _ours(layer, b)
    order, selected, ref_loss, ref_grad, magnitude = _official_worker(adv, b, ranks, tokens, variant.upper())
    assert calls == order
    assert len(calls) > ranks  # several micro-batches per rank, each with its own selection
    assert abs(float(loss) - float(ref_loss)) <= 2**-23 * magnitude
    assert_close(grad, ref_grad, rtol=2**-23, atol=1e-18)
    ours_sel = []
    state = layer.begin_step(0.05)[0]
    for idx in calls:
        from baselines.stare import stare_sets

        l_pos, l_neg = stare_sets(adv[idx], b["new"][idx], b["mask"][idx], P=0.2, variant=variant)
        ours_sel += [(idx[r], t) for r, t in (l_pos | l_neg).nonzero().tolist()]
    assert state.gate and sorted(ours_sel) == selected and selected


def test_one_rank_one_micro_batch_is_the_global_token_mean():
    """With one rank and a budget that holds the whole mini-batch, both layouts are one call over all
    tokens: identical gradients."""
    b = _batch(5, 32)
    _, _, l_off, g_off = _ours(_layer("stare-o1", 1, 4096), b)
    _, _, l_glob, g_glob = _ours(_layer("stare-o1", 1, 4096, layout="global"), b)
    assert_close(l_off, l_glob, rtol=1e-12, atol=0)
    assert_close(g_off, g_glob, rtol=1e-12, atol=1e-18)


def test_the_layouts_weight_tokens_differently():
    """Several micro-batches: the official layout weights a token by 1 / (its micro-batch's tokens x
    ranks) x its micro-batch's row share, the global one by 1 / the mini-batch's tokens."""
    b = _batch(6, 32)
    b["acc"] = torch.tensor([1.0, 0.0] * 16, dtype=torch.float64)
    _, _, _, g_off = _ours(_layer("grpo-ds", 4, 128), b)
    _, _, _, g_glob = _ours(_layer("grpo-ds", 4, 128, layout="global"), b)
    valid = (b["mask"] > 0) & (g_glob != 0)
    ratio = (g_off[valid] / g_glob[valid])
    assert ratio.min() < 0.95 and ratio.max() > 1.05


# ------------------------------------------------------------------------------------ on verl
def test_real_rank_order_places_whole_emulated_ranks_on_each_real_rank():
    """verl hands each real rank an equal contiguous chunk and splits it into mini-batches in order:
    the placed rows must give every real rank whole emulated ranks, mini-batch by mini-batch, and
    one micro-batch per loss call (verl_ext.layout_micro_batches) in the plan's order."""
    from baselines.micro_batches import real_rank_order
    from stare_cli.backends.verl_ext import layout_micro_batches

    lengths = [random.Random(4).randint(50, 900) for _ in range(64)]
    plan = official_loss_calls(lengths, rows_per_mini=32, ranks=8, max_tokens=2048)  # 2 mini-batches
    for real in (1, 2, 4, 8):
        placed = real_rank_order(plan, 8, real)
        assert sorted(p.row for p in placed) == list(range(64))
        chunk = 64 // real
        for q in range(real):
            mine = placed[q * chunk:(q + 1) * chunk]
            for j in range(2):  # the rank's j-th mini-batch: its rows of plan[j], call by call
                mini = mine[j * chunk // 2:(j + 1) * chunk // 2]
                want = [c for c in plan[j] if q * 8 // real <= c.rank < (q + 1) * 8 // real]
                got = [[mini[i].row for i in idx] for idx in layout_micro_batches([p.call for p in mini])]
                assert got == [c.rows for c in want]
                assert [mini[idx[0]].scale for idx in layout_micro_batches([p.call for p in mini])] == [c.scale for c in want]
    with pytest.raises(ValueError, match="do not split over 3"):
        real_rank_order(plan, 8, 3)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@pytest.mark.parametrize("variant", ["o1", "c2"])
def test_verls_loss_path_under_the_official_layout_is_the_official_workers(variant):
    """verl's own ppo_loss (wrapped by verl_ext) calling our registered policy loss, once per loss call
    as the patched prepare_micro_batches forms them, each call carrying its scale: the same loss and
    gradient as the official worker's path, on 4 emulated ranks placed on 2 real ranks (dp_size 2:
    the engine's all-reduce then averages the two real ranks, which the test does by hand)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils import losses

    import stare_cli.backends.verl_ext  # noqa: F401  registers stare_layer and wraps ppo_loss
    from baselines.micro_batches import real_rank_order
    from stare_cli.backends.verl_ext import SCALE_FIELD, driver_step, layout_micro_batches

    b = _batch(21, 32)
    b["prompt"] = [random.Random(5).randint(3, 15) for _ in range(32)]
    b["resp"] = [int(m.sum()) for m in b["mask"]]
    b["lengths"] = [p + r for p, r in zip(b["prompt"], b["resp"])]
    layer = _layer(f"stare-{variant}", 4, 128)
    cfg = layer.recipe
    scores = torch.zeros(32, b["mask"].shape[1])
    scores[torch.arange(32), torch.tensor(b["resp"]) - 1] = b["acc"].float()
    out = driver_step(layer, cfg.model_dump(mode="json"), [f"u{i // 4}" for i in range(32)], scores,
                      b["mask"].float(), b["old"].float(), b["ent"].float(), 1)
    config = FSDPActorConfig(
        ppo_micro_batch_size_per_gpu=4, rollout_n=cfg.rollout.n, ppo_mini_batch_size=cfg.optim.mini_batch_size,
        clip_ratio=0.2, clip_ratio_low=cfg.method.clip_low, clip_ratio_high=cfg.method.clip_high,
        clip_ratio_c=cfg.method.dual_clip, loss_agg_mode=cfg.method.loss_agg, entropy_coeff=0.0,
        policy_loss=PolicyLossConfig(loss_mode="stare_layer"))
    (plan,) = layer.update_plan(b["lengths"])
    placed = real_rank_order([plan], 4, 2)
    new = b["new"].clone().requires_grad_(True)
    total = 0.0
    for q in range(2):  # each real rank: its chunk, one micro-batch per loss call
        mine = placed[q * 16:(q + 1) * 16]
        rank_loss = 0.0
        for idx in layout_micro_batches([p.call for p in mine]):
            rows = [mine[i].row for i in idx]
            fields: dict[str, list] = {}
            full_lp = []
            for i in rows:
                P, R = b["prompt"][i], b["resp"][i]
                full_lp.append(torch.cat([torch.zeros(P - 1, dtype=torch.float64), new[i, :R],
                                          torch.zeros(1, dtype=torch.float64)]))
                for name, t in (("old_log_probs", b["old"]), ("advantages", out.advantages), ("response_mask", b["mask"])):
                    fields.setdefault(name, []).append(t[i, :R])
                fields.setdefault("prompts", []).append(torch.ones(P, dtype=torch.long))
                fields.setdefault("responses", []).append(torch.ones(R, dtype=torch.long))
            data = TensorDict({k: _nested(v) for k, v in fields.items()}, batch_size=len(rows))
            data[SCALE_FIELD] = torch.tensor([mine[i].scale for i in idx], dtype=torch.float64)
            tu.assign_non_tensor(data, dp_size=2, batch_num_tokens=int(b["mask"].sum()), global_batch_size=32)
            tu.assign_non_tensor_data(data, "stare_layer", out.payload)
            loss, _ = losses.ppo_loss(config, {"log_probs": _nested(full_lp)}, data)
            rank_loss = rank_loss + loss
        total = total + rank_loss / 2  # FSDP's gradient all-reduce: the mean over the 2 real ranks
    (grad,) = torch.autograd.grad(total, new)
    _, _, ref_loss, ref_grad, magnitude = _official_worker(out.advantages, b, 4, 128, variant.upper())
    assert abs(float(total) - float(ref_loss)) <= 2**-23 * magnitude
    assert_close(grad, ref_grad, rtol=2**-23, atol=1e-18)


# ------------------------------------------------------------------------------------- recipes
def test_paper_recipes_default_to_the_official_layout_on_both_backends():
    from stare_cli.backends.verl_backend import refusals, verl_overrides

    r = load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", [])
    assert (r.optim.loss_layout, r.optim.official_ranks, r.optim.micro_batch_tokens) == ("official", 16, 8192)
    assert refusals(r) == []  # verl runs the paper recipe as it is: official layout and generation batches
    assert "actor_rollout_ref.actor.shuffle=False" in verl_overrides(r)
    # 16 emulated ranks on 3 x 8 = 24 GPUs cannot be placed: refused by name
    bad = load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", ["backend.verl.nnodes=3"])
    assert [k for k, _ in refusals(bad)] == ["optim.official_ranks"]


@pytest.mark.parametrize("override,message", [
    (["optim.micro_batch_tokens=null"], "set optim.micro_batch_tokens"),
    (["optim.official_ranks=7"], "must divide the responses of a mini-batch"),
    (["rollout.on_short_batch=train"], "on_short_batch 'train'"),
])
def test_the_official_layout_refuses_what_it_cannot_emulate(override, message):
    from stare_kernel.errors import StareError

    with pytest.raises((StareError, ValueError), match=message):
        load_recipe("short-cot/qwen2.5-math-7b", "stare-o1", override)
