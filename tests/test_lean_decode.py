"""The rollout's lean decode step (benchmarks/generation/lean_decode.py) gives the model's own numbers bit for
bit, and declines every model it does not reproduce exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import benchmarks.generation.lean_decode as L
from benchmarks.generation.attention import use_gqa_sdpa_on_cpu
from benchmarks.generation.engines import SamplingParams, load_tokenizer, sample_decode
from benchmarks.data.toy import build_model


def _switched(seed: int = 3, dtype=torch.float32):
    m = build_model(40, seed=seed).to(dtype).eval()  # Qwen2, 4 query heads on 2 KV heads
    assert use_gqa_sdpa_on_cpu(m)
    return m


def _prefill(model, ids, mask):
    from transformers import DynamicCache

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return cache, pos[:, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False])
def test_lean_step_gives_the_models_logits_and_cache_bit_for_bit(dtype, padded):
    model = _switched(dtype=dtype)
    step = L.lean_decode_step(model)
    assert step is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 40, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # left padding: the mask branch (no padding: no mask, as transformers decides)
        mask[0, :4] = 0
        mask[2, :1] = 0
    ref_cache, last = _prefill(model, ids, mask)
    lean_cache = copy.deepcopy(ref_cache)
    nxt = torch.randint(2, 40, (3,), generator=g)
    with torch.no_grad():
        for _ in range(6):
            mask = torch.cat([mask, mask.new_ones(3, 1)], 1)
            last = last + 1
            ref = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                        past_key_values=ref_cache, use_cache=True).logits[:, -1]
            ours = step(nxt[:, None], mask, last[:, None], lean_cache.layers)
            assert ours.dtype == ref.dtype and torch.equal(ours, ref)
            for a, b in zip(ref_cache.layers, lean_cache.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            nxt = torch.multinomial(ref.float().softmax(-1), 1, generator=g).squeeze(-1)


def test_lean_step_sees_in_place_parameter_updates():
    """The step reads each layer's tensors once, when it is made; the optimizer updates them in place,
    so a step made before an update still gives the updated model's logits."""
    model = _switched()
    step = L.lean_decode_step(model)
    ids = torch.randint(2, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref_cache, last = _prefill(model, ids, mask)
    lean_cache = copy.deepcopy(ref_cache)
    with torch.no_grad():
        before = step(ids[:, -1:], torch.cat([mask, mask.new_ones(2, 1)], 1), last[:, None] + 1,
                      copy.deepcopy(ref_cache).layers)
        for p in model.parameters():  # what AdamW's step does: write into the same tensors
            p.mul_(0.9).add_(0.01)
        mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
        ref = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=last[:, None] + 1,
                    past_key_values=ref_cache, use_cache=True).logits[:, -1]
        ours = step(ids[:, -1:], mask, last[:, None] + 1, lean_cache.layers)
    assert torch.equal(ours, ref) and not torch.equal(ours, before)


def test_sampling_with_the_lean_step_equals_sampling_with_the_models_forward(quick_toy, monkeypatch):
    """The whole rollout loop (shared prefill, rows leaving at EOS, cache rows selected) samples the
    same tokens with the same log-probs either way, and the lean step is what ran."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(quick_toy))
    model = AutoModelForCausalLM.from_pretrained(quick_toy, dtype=torch.float32).eval()
    assert use_gqa_sdpa_on_cpu(model)
    prompts = ["Compute 1+2-3.\n"] * 4 + ["Compute 13+14-26.\n"] * 4 + ["Compute 9+9-9.\n"] * 4
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    n = max(map(len, ids))
    inp = torch.tensor([[0] * (n - len(x)) + x for x in ids])
    attn = (torch.arange(n)[None] >= torch.tensor([n - len(x) for x in ids])[:, None]).long()
    sp = SamplingParams(temperature=1.0, max_new_tokens=40)
    calls = []
    real = L.lean_decode_step

    def counting(m):
        step = real(m)
        return None if step is None else (lambda *a: calls.append(1) or step(*a))

    runs = []
    for lean in (counting, lambda m: None):
        monkeypatch.setattr(L, "lean_decode_step", lean)
        torch.manual_seed(11)
        lps: list = []
        with torch.no_grad():
            runs.append((sample_decode(model, inp, attn, sp, [tok.eos_token_id], logprobs=lps), lps))
    assert calls, "the lean step did not run"
    assert runs[0] == runs[1]
    rows = runs[0][0]
    assert len({len(r) for r in rows}) > 1 and any(r[-1] == tok.eos_token_id for r in rows)  # rows left apart


def _hooked():
    m = _switched()
    m.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    return m


def _plain_sdpa():
    return build_model(40, seed=3).eval()  # transformers' own sdpa attention: not switched


def _config_variant(**changes):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.data.toy import TOY_MODEL

    cfg = Qwen2Config(vocab_size=40, pad_token_id=0, eos_token_id=1, bos_token_id=None, **{**TOY_MODEL, **changes})
    m = Qwen2ForCausalLM(cfg).eval()
    assert use_gqa_sdpa_on_cpu(m)  # declined for the change alone, not for the attention
    return m


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    assert use_gqa_sdpa_on_cpu(m)
    return m


@pytest.mark.parametrize("make", [
    _hooked,
    _plain_sdpa,
    lambda: _config_variant(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    lambda: _config_variant(hidden_act="gelu"),
    _llama,
], ids=["forward-hook", "transformers-sdpa", "linear-rope", "gelu", "llama"])
def test_lean_step_declines_models_it_does_not_reproduce(make):
    assert L.lean_decode_step(make()) is None


def test_declined_model_still_samples_through_its_forward(quick_toy):
    """A hook on the model (say, an adapter's) keeps working: the loop runs the model's forward."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(quick_toy))
    model = AutoModelForCausalLM.from_pretrained(quick_toy, dtype=torch.float32).eval()
    use_gqa_sdpa_on_cpu(model)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.shape[1]))
    ids = torch.tensor([tok("Compute 1+2-3.\n", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        rows = sample_decode(model, ids, torch.ones_like(ids), SamplingParams(max_new_tokens=5), [tok.eos_token_id])
    # The prefill, then one call per sampled token but the last (nothing is fed back after it).
    assert len(rows[0]) > 1 and len(seen) == len(rows[0])
