"""Lean saved activations (stare_cli/backends/lean_activations.py, issue 69): the same forward, the MLP's
gradients bit for bit, the norms' within float32 rounding of a float64 reference, fewer bytes kept."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from stare_cli.backends import lean_activations as lean

U = 2.0**-24


def _model(kind: str = "llama", vocab: int = 96, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    m = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))).float()
    m.train()
    return m


def _grads(model, ids, w):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.double().log_softmax(-1)[..., 1] * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved_bytes(model, ids) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.model(input_ids=ids).last_hidden_state
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_forward_is_the_same_bits_and_the_mlp_gradients_too(kind):
    plain = _model(kind)
    mlp_only = copy.deepcopy(plain)
    for m in mlp_only.modules():  # the MLPs alone: their backward replays autograd's own operations
        if lean._is_mlp(m):
            m._stare_plain_forward = m.forward
            m.forward = lean._mlp_forward.__get__(m)
    ids = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(1))
    w = torch.linspace(-1, 1, 40, dtype=torch.float64)
    a, ga = _grads(plain, ids, w)
    b, gb = _grads(mlp_only, ids, w)
    assert torch.equal(a, b)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    full = copy.deepcopy(plain)
    assert lean.apply(full) == 2 * 3 + 1  # per layer an MLP and two RMSNorms, plus the final norm
    c, _ = _grads(full, ids, w)
    assert torch.equal(a, c)  # the norms' forward too: the same operations


def test_apply_counts_and_is_idempotent():
    m = _model("llama", layers=3)
    # 3 layers x (MLP + 2 RMSNorms) + the final norm = 10
    assert lean.apply(m) == 10 and lean.apply(m) == 10
    assert m.model.layers[0].mlp._stare_plain_forward.__func__ is not lean._mlp_forward


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gradients_within_float32_rounding_of_a_float64_reference(kind):
    """The norms' input gradient sums three contributions (its pow, its product, the residual) in another
    order than autograd: each path is compared with float64 and must be as close as the plain path is,
    up to a few ulps of the gradient's scale (3 additions reordered: at most 3 u of the largest term)."""
    plain = _model(kind, seed=3)
    ref = copy.deepcopy(plain).double()
    leanm = copy.deepcopy(plain)
    assert lean.apply(leanm) > 0
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(4))
    w = torch.linspace(-1, 1, 48, dtype=torch.float64)
    _, gp = _grads(plain, ids, w)
    _, gl = _grads(leanm, ids, w)
    _, gr = _grads(ref, ids, w)
    for k in gr:
        scale = float(gr[k].abs().max())
        err_p = float((gp[k].double() - gr[k]).abs().max())
        err_l = float((gl[k].double() - gr[k]).abs().max())
        assert err_l <= err_p + 64 * U * scale, (k, err_l, err_p, scale)


def test_fewer_bytes_are_saved_by_the_predicted_amount():
    """Per token and layer the MLP keeps 2 x intermediate floats fewer (SiLU's output and the product),
    each RMSNorm one hidden-size float fewer (the normalised input): (2 x 160 + 2 x 64) x 4 bytes = 1,792;
    the projections after the two norms keep no normalised input (recomputed): 2 x 64 x 4 = 512 more;
    and the final norm 64 x 4 = 256 per token once. 2 layers, 2 x 48 tokens:
    96 x (2 x (1,792 + 512) + 256) = 466,944 bytes."""
    plain = _model("llama", seed=5)
    leanm = copy.deepcopy(plain)
    lean.apply(leanm)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(6))
    assert _saved_bytes(plain, ids) - _saved_bytes(leanm, ids) == 96 * (2 * (1792 + 512) + 256)


def _without_recompute(model):
    """`model` leaner by the norms and MLPs only: the decoder's own forward (no `_NormRecompute`)."""
    model.model.forward = model.model._stare_plain_forward
    return model


def test_recomputed_norm_outputs_give_the_same_gradients_bit_for_bit():
    """The projections' saved input is recomputed by the forward's own elementwise products, so every
    gradient equals the one from the saved tensor exactly; the recompute runs once per norm and backward."""
    plain = _model("qwen2", seed=11)
    a, b = copy.deepcopy(plain), copy.deepcopy(plain)
    lean.apply(a)
    lean.apply(b)
    _without_recompute(b)
    ids = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(12))
    w = torch.linspace(-1, 1, 40, dtype=torch.float64)
    calls = []
    real = lean._Cell.get

    def counting(self):
        calls.append(self.value is None)
        return real(self)

    lean._Cell.get = counting
    try:
        la, ga = _grads(a, ids, w)
    finally:
        lean._Cell.get = real
    lb, gb = _grads(b, ids, w)
    assert torch.equal(la, lb)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    # per layer: q, k, v (input norm) and the MLP (post-attention norm) unpack; 2 of the 4 recompute
    assert len(calls) == 2 * 4 and sum(calls) == 2 * 2


def test_recompute_composes_with_checkpointing_and_with_an_outer_trace():
    """Under activation checkpointing the checkpoint's hooks are on top: nothing is registered and the
    gradients are the plain lean ones; under an outer saved-tensor hook (the memory plan's trace), every
    tensor that is not recomputed still reaches it."""
    plain = _model("llama", seed=13)
    a, b = copy.deepcopy(plain), copy.deepcopy(plain)
    lean.apply(a)
    lean.apply(b)
    _without_recompute(b)
    a.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(14))
    w = torch.linspace(-1, 1, 32, dtype=torch.float64)
    _, ga = _grads(a, ids, w)
    _, gb = _grads(b, ids, w)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    c = copy.deepcopy(plain)
    lean.apply(c)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: packed.append(x.shape) or x, lambda x: x):
        y = c.model(input_ids=ids).last_hidden_state
    assert len(packed) > 0 and y.grad_fn is not None
    assert not lean._NormRecompute._stack  # the context is left with the forward


def test_no_grad_and_autocast_keep_the_modules_own_forward():
    m = _model("llama", seed=7)
    lean.apply(m)
    ids = torch.randint(0, 96, (1, 16))
    with torch.no_grad():  # inference: nothing is saved, so the plain forward (no custom function) runs
        out = m.model.layers[0].mlp(torch.randn(1, 4, 64))
    assert out.grad_fn is None
    x = torch.randn(1, 4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m.model.layers[0].mlp(x)
        z = m.model.norm(x)
    assert "SwiGLU" not in type(y.grad_fn).__name__ and "RMSNorm" not in type(z.grad_fn).__name__
    assert "SwiGLU" in type(m.model.layers[0].mlp(x).grad_fn).__name__
    m(input_ids=ids)


def test_unsupported_models_are_left_alone():
    from benchmarks.data.toy import build_model

    toy = build_model(40, seed=3)  # a Qwen2-style toy: supported, but 'auto' leaves it to its own numbers
    from types import SimpleNamespace

    from stare_cli.backends.embedded import lean_activations

    assert lean_activations(SimpleNamespace(lean_activations="auto"), toy) is False
    assert lean_activations(SimpleNamespace(lean_activations=True), toy) is True
    assert lean_activations(SimpleNamespace(lean_activations="auto"), _model("llama", vocab=4096)) is True
    assert lean_activations(SimpleNamespace(lean_activations=False), _model("llama", vocab=4096)) is False
    gpt = SimpleNamespace(config=SimpleNamespace(model_type="gpt2", hidden_act="gelu_new"), modules=lambda: [])
    assert lean.apply(gpt) == 0
