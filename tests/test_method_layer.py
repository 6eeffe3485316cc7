"""The method layer (stare_cli/method/layer.py): the official STARE loss call reproduced on the same
micro-batches, one rollout batch through the embedded path and through verl's driver + actor loss
path (identical for every method and both scopes), the reward, dynamic sampling, and the import rules
that keep the layers apart."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from baselines import Agg, token_budget_micro_batches
from baselines.registry import METHODS
from benchmarks.perf.official_reference import official_loss, official_weights
from stare_cli.method.layer import BatchInputs, LossInputs, MethodLayer
from stare_cli.core.resolve import load_recipe


# ---------------------------------------------------------------------------- a rollout batch
def _rollout(seed: int, groups: int = 6, n: int = 4, T: int = 40, noise: float = 0.3):
    """A batch as a trainer has it after the rollout: prompt/response lengths, 0/1 rewards per response,
    old log-probs and entropies [B, T], and the current policy's log-probs (old + noise, so that some
    ratios leave the clip range). Surprisals are distinct (no ties)."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    resp = torch.randint(5, T + 1, (B,), generator=g)
    prompt = torch.randint(3, 12, (B,), generator=g)
    mask = (torch.arange(T)[None] < resp[:, None]).float()
    old = -(torch.rand(B, T, generator=g) * 3 + 0.01) * mask
    new = old + noise * torch.randn(B, T, generator=g) * mask
    ent = torch.rand(B, T, generator=g) * mask
    acc = torch.randint(0, 2, (B,), generator=g).float()
    acc[:n] = 1.0  # one all-correct group (zero advantages)
    return dict(B=B, n=n, T=T, mask=mask, old=old, new=new, ent=ent, acc=acc, prompt=prompt, resp=resp,
                group=torch.arange(groups).repeat_interleave(n), uids=[f"u{i // n}" for i in range(B)])


def _layer(method: str, scope: str, tokens) -> MethodLayer:
    o = ["rollout.refill=per_group", "optim.loss_layout=global", "method.stare.h_tgt=10", "method.stare.P=0.2", "method.stare.W=1.5",
         "method.stare.M=0.7", f"method.stare.scope={scope}", f"optim.micro_batch_tokens={'null' if tokens is None else tokens}",
         "optim.micro_batch_size=6", "optim.train_batch_size=6", "optim.mini_batch_size=6", "rollout.n=4",
         "rollout.max_prompt_tokens=12", "rollout.max_response_tokens=40", "eval.benchmarks=[]",
         "method.overlong.buffer=8"]
    if method.endswith("+token-sum"):  # verl 0.9's token-sum aggregation (issue 71), the loss and the entropy bonus
        method = method.removesuffix("+token-sum")
        o.append("method.loss_agg=token-sum")
    if method == "entropy-reg":
        o.append("method.entropy_coef=0.05")
    if method == "adaptive-entropy":  # a coefficient at step 1, so that the bonus acts in the loss compared
        o.append("method.adaptive_entropy.coef_init=0.004")
    if method == "stapo":  # the fixture's pi >= e^-3.01 = 0.049 and H ~ U(0, 1): thresholds that select some tokens
        o += ["method.stapo.tau_p=0.2", "method.stapo.tau_h_quantile=0.3"]
    if method == "rsi-s":  # s ~ U(0.01, 3.01), H ~ U(0, 1): RSI spreads over [0.01, inf), the interval keeps a part
        o += ["method.rsi.low=0.5", "method.rsi.high=4"]
    if method.endswith("+anneal"):  # step 3 of 5 on a cosine to 0.2: factor 0.2 + 0.8 (1 + cos(pi / 2)) / 2 = 0.6
        method = method.removesuffix("+anneal")
        o += ["method.cov_anneal.schedule=cosine", "method.cov_anneal.end=0.2", "optim.total_steps=5"]
    return MethodLayer.from_recipe(load_recipe("short-cot/qwen2.5-math-7b", method, o))


STEP = 3  # the training step the two-backend test runs (1-based)


# --------------------------------------------------------------- the official function, same rows
@pytest.mark.parametrize("variant", ["o1", "c2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_official_scope_selects_and_weights_as_the_official_loss_call(variant, seed):
    """Micro-batches of a 160-token budget (as verl forms them): in every loss call our official scope
    selects the official function's L+/L- on the current log-probs and gives the official loss."""
    b = _rollout(seed)
    layer = _layer(f"stare-{variant}", "official", 160)
    state, _ = layer.begin_step(0.05)
    bt = layer.transform_batch(BatchInputs(b["acc"], b["group"], b["mask"], b["old"], b["ent"],
                                           torch.ones(b["B"], dtype=torch.bool)), state)
    parts = layer.micro_batches((b["prompt"] + b["resp"]).tolist())
    assert len(parts) > 2  # several loss calls, each with its own selection
    n_tok = float(b["mask"].sum())
    weighted = 0
    for idx in parts:
        new = b["new"][idx].clone().requires_grad_(True)
        ours, stats = layer.loss(LossInputs(new, b["old"][idx], bt.advantages[idx], bt.mask[idx], Agg(num_tokens=n_tok),
                                            stare=state))
        new_ref = b["new"][idx].clone().requires_grad_(True)
        ref, ref_m = official_loss(b["old"][idx], new_ref, bt.advantages[idx], bt.mask[idx], num_tokens=n_tok,
                                   P=0.2, W=1.5, M=0.7, variant=variant.upper(), gate=True)
        assert_close(ours, ref)
        (g_ours,) = torch.autograd.grad(ours, new)
        (g_ref,) = torch.autograd.grad(ref, new_ref)
        assert_close(g_ours, g_ref)  # the same tokens weighted by the same factors
        assert float(stats["stare/sel_pos"]) == pytest.approx(ref_m["positive_reweight_ratio"])
        assert float(stats["stare/sel_neg"]) == pytest.approx(ref_m["negative_reweight_ratio"])
        # the official weights, and ours, from the current log-probs (not the old ones)
        w_ref, _ = official_weights(b["new"][idx], bt.advantages[idx], bt.mask[idx], P=0.2, W=1.5, M=0.7,
                                    variant=variant)
        weighted += int(((w_ref != 1) & (bt.mask[idx] > 0)).sum())
    assert weighted > 0


def test_official_scope_ties_select_as_many_tokens_by_position():
    """Ties aside, as documented: with tied surprisals both select k tokens with the same surprisals;
    ours takes the earliest positions, the official code whatever torch.topk returns."""
    adv = torch.ones(1, 10)
    lp = -torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0, 0.1, 0.2, 0.3, 0.4]])
    mask = torch.ones(1, 10)
    from baselines.stare import stare_sets

    l_pos, _ = stare_sets(adv, lp, mask, P=0.3, variant="o1")  # k = int(10 * 0.3 + 0.999999) = 3
    w_ref, _ = official_weights(lp, adv, mask, P=0.3, W=2.0)
    assert int(l_pos.sum()) == int((w_ref == 2.0).sum()) == 3
    assert sorted((-lp)[l_pos].tolist()) == sorted((-lp)[w_ref == 2.0].tolist()) == [2.0, 2.0, 2.0]
    assert l_pos[0].nonzero().squeeze(-1).tolist() == [1, 2, 3]  # four tokens tie at 2.0: the first three


def test_gate_off_official_scope_is_grpo():
    b = _rollout(3)
    layer = _layer("stare-o1", "official", 160)
    state, m = layer.begin_step(99.0)  # H above H_tgt = 10: gate off
    assert m["stare/gate"] == 0.0 and state.gate is False
    grpo = _layer("grpo-ds", "official", 160)
    x = dict(log_prob=b["new"], old_log_prob=b["old"], advantages=b["acc"][:, None] * b["mask"], mask=b["mask"], agg=Agg())
    assert torch.equal(layer.loss(LossInputs(**x, stare=state))[0], grpo.loss(LossInputs(**x))[0])


# ------------------------------------------------------------------- the two backends, one batch
def _embedded(layer: MethodLayer, b: dict):
    """The embedded trainer's steps 5-6 (stare_cli/backends/embedded.py) for one mini-batch."""
    m = b["mask"]
    H = float((b["ent"] * m).sum() / m.sum())
    state, _ = layer.begin_step(H)
    bt = layer.transform_batch(BatchInputs(b["acc"], b["group"], m, b["old"], b["ent"],
                                           torch.ones(b["B"], dtype=torch.bool)), state)
    agg = Agg(layer.cfg.loss_agg, num_tokens=float(bt.mask.sum()), num_seqs=float((bt.mask.sum(-1) > 0).sum()),
              scale=layer.recipe.rollout.max_response_tokens)
    new = b["new"].clone().requires_grad_(True)
    total = 0.0
    for k, idx in enumerate(layer.micro_batches((b["prompt"] + b["resp"]).tolist())):
        loss, _ = layer.loss(LossInputs(new[idx], b["old"][idx], bt.advantages[idx], bt.mask[idx], agg,
                                        entropy=b["ent_cur"][idx], stare=state,
                                        generator=torch.Generator().manual_seed(1000 + k), step=STEP))
        total = total + loss
    (grad,) = torch.autograd.grad(total, new)
    return bt.advantages, bt.mask, total.detach(), grad


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _verl(layer: MethodLayer, b: dict):
    """verl's path: our driver step (verl_ext.driver_step, as the patched _compute_advantage runs it),
    then the actor's micro-batches as verl 0.9.1 forms them (rearrange_micro_batches, or row chunks)
    and verl's own ppo_loss (wrapped by verl_ext) calling our registered policy loss."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils import losses

    import stare_cli.backends.verl_ext  # noqa: F401  registers stare_layer and wraps ppo_loss
    from stare_cli.backends.verl_ext import driver_step

    assert getattr(losses.ppo_loss, "_stare", False)
    scores = torch.zeros(b["B"], b["T"])
    scores[torch.arange(b["B"]), b["resp"] - 1] = b["acc"]  # verl puts the reward on the last token
    out = driver_step(layer, layer.recipe.model_dump(mode="json"), b["uids"], scores, b["mask"], b["old"], b["ent"], STEP)
    loss_mask = b["mask"] if out.loss_mask is None else out.loss_mask  # what the driver writes as verl's masks
    cfg = layer.recipe
    config = FSDPActorConfig(
        ppo_micro_batch_size_per_gpu=cfg.optim.micro_batch_size, rollout_n=cfg.rollout.n,
        ppo_mini_batch_size=cfg.optim.mini_batch_size, clip_ratio=0.2, clip_ratio_low=cfg.method.clip_low,
        clip_ratio_high=cfg.method.clip_high, clip_ratio_c=cfg.method.dual_clip, loss_agg_mode=cfg.method.loss_agg,
        entropy_coeff=0.0, policy_loss=PolicyLossConfig(loss_mode="stare_layer"),
        loss_scale_factor=cfg.rollout.max_response_tokens if cfg.method.loss_agg == "seq-mean-token-sum-norm" else None)
    new = b["new"].clone().requires_grad_(True)
    lens = (b["prompt"] + b["resp"]).tolist()
    if cfg.optim.micro_batch_tokens is not None:
        am = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
        _, parts = rearrange_micro_batches(TensorDict({"attention_mask": am, "input_ids": am}, batch_size=b["B"]),
                                           max_token_len=cfg.optim.micro_batch_tokens)
    else:
        m = cfg.optim.micro_batch_size
        parts = [list(range(i, min(i + m, b["B"]))) for i in range(0, b["B"], m)]
    total = 0.0
    for k, idx in enumerate(parts):
        full_lp, full_ent, rows = [], [], {}
        for i in idx:
            P, R = int(b["prompt"][i]), int(b["resp"][i])
            lp, en = torch.zeros(P + R), torch.zeros(P + R)
            lp = torch.cat([torch.zeros(P - 1), new[i, :R], torch.zeros(1)])  # position t predicts token t + 1
            en = torch.cat([torch.zeros(P - 1), b["ent_cur"][i, :R], torch.zeros(1)])
            full_lp.append(lp)
            full_ent.append(en)
            for name, t in (("old_log_probs", b["old"]), ("advantages", out.advantages), ("response_mask", loss_mask)):
                rows.setdefault(name, []).append(t[i, :R])
            rows.setdefault("prompts", []).append(torch.ones(P, dtype=torch.long))
            rows.setdefault("responses", []).append(torch.ones(R, dtype=torch.long))
        data = TensorDict({k2: _nested(v) for k2, v in rows.items()}, batch_size=len(idx))
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(loss_mask.sum()), global_batch_size=b["B"])
        tu.assign_non_tensor_data(data, "stare_layer", out.payload)
        torch.manual_seed(1000 + k)  # verl's Clip-Cov draws from the global RNG
        loss, _ = losses.ppo_loss(config, {"log_probs": _nested(full_lp), "entropy": _nested(full_ent)}, data)
        total = total + loss
    (grad,) = torch.autograd.grad(total, new)
    return out.advantages, loss_mask, total.detach(), grad


CASES = [(m, "official", 160) for m in METHODS] + [("stare-o1", "batch", 160), ("stare-c2", "batch", 160),
                                                  ("stare-c2", "official", None), ("grpo-ds", "official", None),
                                                  ("clip-cov+anneal", "official", 160),
                                                  ("kl-cov+anneal", "official", 160), ("stapo", "official", None),
                                                  ("rsi-s", "official", None),
                                                  ("stare-o1+token-sum", "official", 160),
                                                  ("entropy-reg+token-sum", "official", None)]


@pytest.mark.parametrize("method,scope,tokens", CASES, ids=[f"{m}-{s}-{t}" for m, s, t in CASES])
def test_one_batch_through_both_backends_gives_identical_advantages_weights_and_loss(method, scope, tokens):
    b = _rollout(7)
    b["ent_cur"] = (b["ent"] + 0.05 * b["mask"]).requires_grad_(False)  # the current policy's entropy
    adv_e, mask_e, loss_e, grad_e = _embedded(_layer(method, scope, tokens), b)
    adv_v, mask_v, loss_v, grad_v = _verl(_layer(method, scope, tokens), b)
    assert_close(adv_v, adv_e)
    assert torch.equal(mask_v, mask_e)
    if method in ("stapo", "rsi-s"):  # tokens were dropped: both backends renormalise over the same remaining ones
        assert 0 < (b["mask"] - mask_e).sum() < b["mask"].sum()
    assert_close(loss_v, loss_e)
    # d loss / d log pi carries every token's effective advantage (w * A): identical weights
    assert_close(grad_v, grad_e)
    assert grad_e.abs().sum() > 0
    # the clip branch is exercised: some ratios lie outside [0.8, 1.28] on valid tokens
    ratio = torch.exp(b["new"] - b["old"])[b["mask"] > 0]
    assert ((ratio < 0.8) | (ratio > 1.28)).any()


def test_the_micro_batches_are_verls():
    """The embedded backend's token-budget micro-batches equal verl 0.9.1's dynamic batches."""
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.choice([rng.randint(1, 4096), rng.randint(1, 300)]) for _ in range(rng.randint(1, 48))]
        budget = max(max(lens), rng.choice([4096, 8192, 12288]))
        am = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
        _, ref = rearrange_micro_batches(TensorDict({"attention_mask": am, "input_ids": am}, batch_size=len(lens)),
                                         max_token_len=budget)
        assert token_budget_micro_batches(lens, budget) == ref


def test_token_budget_micro_batches_hand_computed():
    # 4 rows of 6, 5, 2, 1 tokens, budget 7: ceil(14 / 7) = 2 parts -> {6, 1} and {5, 2} (7 tokens each);
    # ordered by workload 24576 L + L^2, heaviest first: {6, 1} = 24576*7 + 37 > {5, 2} = 24576*7 + 29.
    assert token_budget_micro_batches([6, 5, 2, 1], 7) == [[0, 3], [1, 2]]
    assert token_budget_micro_batches([3, 3, 3], 9) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget"):
        token_budget_micro_batches([10], 9)


# ------------------------------------------------------------------------- reward and sampling
def test_score_applies_truncation_format_penalty_and_overlong():
    texts = ["so \\boxed{7}", "so \\boxed{7}", "the answer is 7", "so \\boxed{8}"]
    golds = ["7"] * 4
    base = ["rollout.max_response_tokens=20", "method.overlong.buffer=10"]
    layer = MethodLayer.from_recipe(load_recipe("tiny/arith", "grpo-ds", [*base, "rollout.truncated=grade"]))
    s = layer.score(texts, golds, [True, False, True, True], [4, 20, 5, 4])
    # math-verify reward: the final box only (no fallbacks), graded whether or not cut
    assert s.acc.tolist() == [1.0, 1.0, 0.0, 0.0] and s.reward.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert s.format.tolist() == [1.0, 1.0, 0.0, 1.0] and s.official_score.tolist() == [1.0, 1.0, -1.0, 0.0]
    layer = MethodLayer.from_recipe(load_recipe("tiny/arith", "dapo", [*base, "rollout.truncated=zero",
                                                                       "reward.format_penalty=true"]))
    s = layer.score(texts, golds, [True, False, True, True], [4, 20, 5, 15])
    # cut -> acc 0; no box -> format fails -> -1; overlong ramp (20 - 10 = 10 tokens free): 15 tokens -> -0.5
    assert s.acc.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert_close(s.reward, torch.tensor([1.0, 0.0 - 1.0, -1.0, -0.5]))
    layer.close()


def test_stare_official_reward_is_the_official_accuracy():
    layer = MethodLayer.from_recipe(load_recipe("tiny/arith", "grpo-ds", ["reward.fn=stare-official"]))
    texts = ["Final Answer: \\boxed{\\frac{1}{2}}", "so \\boxed{2^{10}}", "\\boxed{\\sqrt{4}}", "\\boxed{2}"]
    golds = ["\\frac12", "1024", "2", "3"]
    s = layer.score(texts, golds, [True] * 4, [5] * 4)
    # as the official reward loop ran it, mathruler alone decides: it does not evaluate 2^{10} or \sqrt{4}
    assert s.acc.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert s.verdicts[0].grader == "stare-official@1"
    layer.close()
    three = MethodLayer.from_recipe(load_recipe("tiny/arith", "grpo-ds", ["reward.fn=stare-official-3way"]))
    assert three.score(texts, golds, [True] * 4, [5] * 4).acc.tolist() == [1.0, 1.0, 1.0, 0.0]  # math-verify does
    three.close()


def test_dynamic_sampling_filters_on_accuracy_not_on_the_shaped_reward():
    layer = MethodLayer.from_recipe(load_recipe("tiny/arith", "dapo"))
    acc = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0])
    keep, dropped = layer.keep_groups(acc, torch.tensor([0, 0, 1, 1, 2]))
    assert keep.tolist() == [False, False, False, False, True] and dropped == 2
    assert MethodLayer.from_recipe(load_recipe("tiny/arith", "grpo")).keep_groups(acc, torch.zeros(5))[0].all()


def test_a_recipe_that_makes_kl_cov_grpo_ds_says_so(cli, quick_toy):
    """KL-Cov with one optimizer update per batch trains exactly as GRPO-ds
    (tests/test_baselines.py::test_kl_cov_with_one_update_per_batch_is_grpo_ds): said before any work,
    naming the keys; not said where a batch has two updates or two epochs, nor for other methods."""
    from stare_cli.method.layer import method_warnings

    (w,) = method_warnings(load_recipe("tiny/arith", "kl-cov"))  # 16 prompts per batch and per update
    assert "kl-cov trains exactly as grpo-ds" in w and "optim.mini_batch_size = optim.train_batch_size = 16" in w
    assert method_warnings(load_recipe("tiny/arith", "kl-cov", ["optim.mini_batch_size=8", "optim.micro_batch_size=64"])) == []
    assert method_warnings(load_recipe("tiny/arith", "kl-cov", ["optim.ppo_epochs=2"])) == []
    assert all(method_warnings(load_recipe("tiny/arith", m)) == [] for m in METHODS if m != "kl-cov")
    code, _, err = cli("train", "--recipe", "tiny/arith", "--method", "kl-cov", "--dry-run", "-o", f"model.path={quick_toy}")
    assert code == 0 and err.startswith("warning: kl-cov trains exactly as grpo-ds"), err


def test_a_memory_setting_that_changes_the_methods_numbers_says_so(cli, tmp_path, quick_toy):
    """Issue 69: STARE selects per loss call, so optim.micro_batch_tokens changed which tokens were selected (2.254%,
    2.294%, 2.374% at one, four, eight micro-batches) and nothing said so. One line at validation, --dry-run and the
    start of `stare train`, and the run's card records it; the settings that do not change it stay silent."""
    from stare_cli.core.resolve import load_recipe
    from stare_cli.method.layer import partition_note

    real = "small/smollm2-135m-words"
    assert partition_note(load_recipe(real, "stare-o1")) is None  # one loss call per mini-batch: nothing changes
    note = partition_note(load_recipe(real, "stare-o1", ["optim.micro_batch_tokens=1600"]))
    # 8 prompts x 8 responses = 64 responses of at most 128 + 64 = 192 tokens: up to ceil(64 x 192 / 1600) = 8 calls
    assert note.startswith("STARE selects L+/L- per loss call, and optim.micro_batch_tokens = 1600 splits each "
                           "mini-batch of 64 responses into as many loss calls as its tokens need (up to 8)"), note
    assert "not only the memory" in note
    assert partition_note(load_recipe(real, "stare-o1", ["optim.micro_batch_tokens=1600", "method.stare.scope=batch"])) is None
    assert partition_note(load_recipe(real, "grpo-ds", ["optim.micro_batch_tokens=1600"])) is None  # nothing per call
    assert "Clip-Cov centres its covariance per loss call" in partition_note(
        load_recipe("tiny/arith", "clip-cov", ["optim.micro_batch_size=8"]))
    assert partition_note(load_recipe("short-cot/qwen2.5-math-7b", "stare-o1")) is None  # the official calls
    code, _, err = cli("recipes", "validate", "tiny/arith", "-m", "stare-o1", "-o", "optim.micro_batch_size=8")
    assert code == 0 and "note: tiny/arith (stare-o1): STARE selects L+/L- per loss call, and optim.micro_batch_size = 8" in err
    code, out, err = cli("train", "--recipe", "tiny/arith", "--method", "stare-o1", "--out", str(tmp_path / "runs"),
                         "-o", f"model.path={quick_toy}", "-o", "optim.micro_batch_size=8", "-o", "optim.total_steps=1",
                         "-o", "eval.benchmarks=[]", "-o", "rollout.max_response_tokens=24")
    assert code == 0, err
    assert "warning: STARE selects L+/L- per loss call" in err
    card = (Path(out.strip().splitlines()[-1]) / "REPRODUCE.md").read_text()
    assert "- note: STARE selects L+/L- per loss call, and optim.micro_batch_size = 8" in card
