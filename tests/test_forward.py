"""The training forward: right-aligned packing, length-sorted buckets and the GQA attention switch
give the numbers of a plain per-row forward."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.generation.attention import GQA_SDPA, use_gqa_sdpa_on_cpu
from benchmarks.generation.engines import Sample
from stare_cli.backends.forward import length_buckets, pack, token_logprobs_entropy
from benchmarks.data.toy import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(40, seed=3)  # Qwen2-style, 4 query heads on 2 KV heads
    m.eval()
    return m


def _samples(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(2, 40) for _ in range(rng.randint(1, 9))]
        r = [rng.randrange(2, 40) for _ in range(rng.randint(1, 23))]
        out.append(Sample(text="", prompt_ids=p, response_ids=r))
    return out


def _reference(model, s: Sample, temperature: float):
    """One row alone, no padding anywhere: log-probs and entropies of its response tokens."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
    return lp, -(logp_all.exp() * logp_all).sum(-1)


def test_length_buckets_hand_computed():
    # lengths 10, 10, 50, 50. One bucket: 4 rows x 50 + overhead. Two: 2 x 10 + 2 x 50 + 2 x overhead.
    # overhead 20: 220 vs 160 -> split; overhead 100: 300 vs 320 -> one bucket.
    assert length_buckets([50, 10, 50, 10], 20) == [[1, 3], [0, 2]]
    assert length_buckets([50, 10, 50, 10], 100) == [[1, 3, 0, 2]]
    # Overhead 0: every distinct length its own bucket (ties share one: no padding either way).
    assert length_buckets([3, 1, 2, 1], 0) == [[1, 3], [2], [0]]
    assert length_buckets([], 10) == []


@pytest.mark.parametrize("buckets", [True, False])
def test_packed_forward_equals_per_row_forward(model, buckets):
    samples = _samples(24, seed=1)
    batch = pack(samples, pad_id=0, device="cpu")
    T = batch["response_mask"].shape[1]
    rows = [5, 0, 17, 3, 11, 23, 8]  # a micro-batch in any order
    with torch.no_grad():
        lp, ent = token_logprobs_entropy(model, batch, rows, temperature=0.7, buckets=buckets)
        assert lp.shape == ent.shape == (len(rows), T)
        for k, r in enumerate(rows):
            ref_lp, ref_ent = _reference(model, samples[r], 0.7)
            n = len(samples[r].response_ids)
            torch.testing.assert_close(lp[k, :n], ref_lp)
            torch.testing.assert_close(ent[k, :n], ref_ent)
            assert (lp[k, n:] == 0).all() and (ent[k, n:] == 0).all()  # padding: exactly 0, never NaN


def test_buckets_change_neither_values_nor_gradients(model):
    samples = _samples(32, seed=2)
    batch = pack(samples, pad_id=0, device="cpu")
    assert len(length_buckets(batch["seq_len"].tolist())) > 1  # the case under test really splits
    grads = []
    for buckets in (True, False):
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs_entropy(model, batch, range(32), temperature=1.0, buckets=buckets)
        ((lp - 0.1 * ent) * batch["response_mask"]).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        if buckets:
            lp_b = lp.detach()
        else:
            torch.testing.assert_close(lp.detach(), lp_b)
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k])


def test_pack_lays_rows_out_from_position_zero():
    s = [Sample(text="", prompt_ids=[7, 8], response_ids=[9]), Sample(text="", prompt_ids=[5], response_ids=[6, 4, 3])]
    b = pack(s, pad_id=0, device="cpu")
    assert b["input_ids"].tolist() == [[7, 8, 9, 0], [5, 6, 4, 3]]
    assert b["prompt_len"].tolist() == [2, 1] and b["seq_len"].tolist() == [3, 4]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]


def test_gqa_sdpa_switch_keeps_padded_batch_logits():
    torch.manual_seed(0)
    ref, fast = build_model(40, seed=4), build_model(40, seed=4)
    assert use_gqa_sdpa_on_cpu(fast) and fast.config._attn_implementation == GQA_SDPA
    ids = torch.randint(2, 40, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: transformers builds a mask, where it would copy the KV heads out
    mask[1, :1] = 0
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=ids, attention_mask=mask).logits,
                                   ref(input_ids=ids, attention_mask=mask).logits)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mha = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2))
    assert not use_gqa_sdpa_on_cpu(mha)  # nothing to gain without grouped KV heads
    assert mha.config._attn_implementation == "sdpa"


def test_empty_responses_score_zero(model, monkeypatch):
    import stare_cli.backends.forward as E

    monkeypatch.setattr(E, "BUCKET_OVERHEAD_TOKENS", 0)  # every length its own bucket
    # Two rows with a prompt and no response (same prompt length: their own bucket) beside a normal row.
    s = [Sample(text="", prompt_ids=[4, 5], response_ids=[]), Sample(text="", prompt_ids=[6, 7], response_ids=[]),
         Sample(text="", prompt_ids=[2, 3, 4, 5, 6, 7, 8, 9], response_ids=[10, 11, 12])]
    batch = pack(s, pad_id=0, device="cpu")
    assert E.length_buckets(batch["seq_len"].tolist()) == [[0, 1], [2]]
    for buckets in (True, False):
        lp, ent = token_logprobs_entropy(model, batch, range(3), temperature=1.0, buckets=buckets)
        assert lp.shape == (3, 3) and (lp[:2] == 0).all() and (ent[:2] == 0).all()
        torch.testing.assert_close(lp[2], _reference(model, s[2], 1.0)[0].detach())


def _grouped_samples(n_prompts: int, n: int, seed: int) -> list[Sample]:
    """GRPO-style rows: n responses per prompt, adjacent; prompt lengths 1-9, responses 0-23 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_prompts):
        p = [rng.randrange(2, 40) for _ in range(rng.randint(1, 9))]
        for _ in range(n):
            r = [rng.randrange(2, 40) for _ in range(rng.choice([0, 1, 2] + list(range(3, 24))))]
            out.append(Sample(text="", prompt_ids=list(p), response_ids=r))
    return out


def test_pack_numbers_rows_by_prompt():
    s = [Sample(text="", prompt_ids=[7, 8], response_ids=[9]), Sample(text="", prompt_ids=[5], response_ids=[6]),
         Sample(text="", prompt_ids=[7, 8], response_ids=[4, 3]), Sample(text="", prompt_ids=[7], response_ids=[1])]
    assert pack(s, pad_id=0, device="cpu")["prompt_group"].tolist() == [0, 1, 0, 2]


@pytest.mark.parametrize("buckets", [True, False])
def test_shared_prompt_forward_equals_per_row_forward(model, buckets):
    samples = _grouped_samples(6, 4, seed=5)
    samples[1].response_ids, samples[2].response_ids = [], [5]  # an empty and a one-token response
    batch = pack(samples, pad_id=0, device="cpu")
    T = batch["response_mask"].shape[1]
    rows = [9, 0, 17, 3, 11, 23, 8, 1, 2, 10]  # a micro-batch in any order; prompts 0, 1, 2, 4, 5 shared or not
    with torch.no_grad():
        lp, ent = token_logprobs_entropy(model, batch, rows, temperature=0.7, buckets=buckets, share_prompts=True)
        lp_only, none = token_logprobs_entropy(model, batch, rows, temperature=0.7, need_entropy=False,
                                               buckets=buckets, share_prompts=True)
    assert none is None and torch.equal(lp_only, lp)
    assert lp.shape == ent.shape == (len(rows), T)
    for k, r in enumerate(rows):
        n = len(samples[r].response_ids)
        if n:
            ref_lp, ref_ent = _reference(model, samples[r], 0.7)
            torch.testing.assert_close(lp[k, :n], ref_lp)
            torch.testing.assert_close(ent[k, :n], ref_ent)
        assert (lp[k, n:] == 0).all() and (ent[k, n:] == 0).all()


def _grads(model, batch, share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs and the gradient of sum(mask * (lp - 0.1 * entropy)) over 32 rows."""
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs_entropy(model, batch, range(32), temperature=1.0, share_prompts=share)
    ((lp - 0.1 * ent) * batch["response_mask"]).sum().backward()
    return lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_shared_prompt_forward_gives_the_row_forwards_gradients(model, monkeypatch):
    """Both layouts against a float64 run of the row layout. They sum the same terms in another order,
    so each may differ from the exact gradient by float32 rounding only. Bound, per tensor, in norm:
    each gradient is a sum over the batch's ~400 response tokens of products through 4 layers; with
    unit roundoff u = 6e-8 the usual relative error bound for such sums is O(n u) = 2.4e-5 worst case
    (sqrt(n) u = 1.2e-6 typically); we allow 1e-4 of the tensor's norm (plus 1e-9 absolute, for
    tensors whose gradient is zero). A layout bug (a wrong row, mask or position) moves a gradient
    by O(1) of its norm: far outside."""
    import copy

    import stare_cli.backends.forward as E

    samples = _grouped_samples(8, 4, seed=6)
    batch = pack(samples, pad_id=0, device="cpu")
    rlens = [len(s.response_ids) for s in samples]
    assert len(length_buckets(rlens)) > 1  # the responses really go through in several buckets
    calls = []
    real = E._shared_prompt_logprobs_entropy
    monkeypatch.setattr(E, "_shared_prompt_logprobs_entropy", lambda *a: calls.append(1) or real(*a))
    (lp_shared, g_shared), (lp_rows, g_rows) = _grads(model, batch, True), _grads(model, batch, False)
    assert calls == [1]  # the shared path ran once, the row path once
    exact = copy.deepcopy(model).double()
    lp64, g64 = _grads(exact, batch, False)
    for lp in (lp_shared, lp_rows):
        assert float((lp.double() - lp64).abs().max()) < 1e-5  # log-probs of O(1): a few float32 ulps
    for k, ref in g64.items():
        scale = float(ref.norm())
        for name, g in (("shared", g_shared), ("rows", g_rows)):
            err = float((g[k].double() - ref).norm())
            assert err <= 1e-4 * scale + 1e-9, (name, k, err, scale)


def test_rows_without_a_shared_prompt_take_the_row_path(model, monkeypatch):
    import stare_cli.backends.forward as E

    monkeypatch.setattr(E, "_shared_prompt_logprobs_entropy", lambda *a: pytest.fail("nothing to share"))
    samples = _grouped_samples(4, 3, seed=7)
    batch = pack(samples, pad_id=0, device="cpu")
    with torch.no_grad():
        lp, _ = token_logprobs_entropy(model, batch, [0, 3, 6, 9], temperature=1.0, share_prompts=True)
    torch.testing.assert_close(lp[1, :len(samples[3].response_ids)], _reference(model, samples[3], 1.0)[0])
