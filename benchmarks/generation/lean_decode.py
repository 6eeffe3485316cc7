"""One decode step of a transformers Qwen2 model on its key/value cache, without transformers'
per-call machinery: the same torch operations on the same tensors as the model's own forward (so the
same logits, bit for bit), minus what a one-token step with a cache does not need from it (building a
4-D mask through `masking_utils`, output records, decorators, module-call dispatch, the rotary
module's decorators, module attribute lookups, 3-D views of a one-token hidden state).

Why: a decode step of the CPU toy (128 rows, 4 layers of width 128) costs ~3 ms of transformers'
Python per call before any arithmetic, and the rollout makes ~45 such calls per training step. With
this step the toy rollout takes ~20% less time (benchmarks/perf/lean_decode.py: 1.25x; a one-row
step costs ~1.0 ms instead of ~1.6 ms with the first version of this step, which still went through
the modules' attributes and 3-D views), with the same samples and log-probs (tests/test_lean_decode.py
compares them with the model's forward exactly).

It is used only where it is exact by construction: a plain `Qwen2ForCausalLM` (no adapters or hooks,
unmodified modules) whose attention runs `benchmarks.generation.attention._sdpa_gqa_forward` (the CPU path with
grouped KV heads that `use_gqa_sdpa_on_cpu` switches on), full attention in every layer, the default
rotary embedding and SiLU. Anything else returns None from `lean_decode_step`, and the caller runs
the model's forward. On CUDA transformers keeps its own attention, so this never runs there.
The operations follow transformers' Qwen2 code of the version window pyproject.toml pins (checked
against 5.10.4); the parity tests compare with whatever version is installed, so a change there
fails them rather than changing samples silently.
"""

from __future__ import annotations

from typing import Callable, Optional


def _rms_norm(norm, h):
    """Qwen2RMSNorm.forward, operation for operation. norm: (weight, variance_epsilon)."""
    import torch

    weight, eps = norm
    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(h.dtype)


def _supported(model) -> bool:
    import torch
    from torch.nn.modules import module as torch_module

    from benchmarks.generation.attention import GQA_SDPA

    if type(model).__name__ != "Qwen2ForCausalLM" or type(getattr(model, "model", None)).__name__ != "Qwen2Model":
        return False
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if (getattr(cfg, "_attn_implementation", None) != GQA_SDPA or cfg.hidden_act != "silu"
            or rope.get("rope_type", "default") != "default" or getattr(cfg, "attention_dropout", 0.0) != 0.0
            or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or [])):
        return False
    inner = model.model
    if len(inner.layers) != cfg.num_hidden_layers or type(inner.rotary_emb).__name__ != "Qwen2RotaryEmbedding":
        return False
    if type(inner.embed_tokens) is not torch.nn.Embedding or type(model.lm_head) is not torch.nn.Linear:
        return False
    if model.lm_head.bias is not None or type(inner.norm).__name__ != "Qwen2RMSNorm":
        return False
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if (type(layer).__name__ != "Qwen2DecoderLayer" or type(a).__name__ != "Qwen2Attention"
                or type(m).__name__ != "Qwen2MLP" or any(type(x) is not torch.nn.Linear for x in linears)
                or type(m.act_fn).__name__ != "SiLUActivation"
                or type(layer.input_layernorm).__name__ != "Qwen2RMSNorm"
                or type(layer.post_attention_layernorm).__name__ != "Qwen2RMSNorm"
                or a.o_proj.bias is not None or any(x.bias is not None for x in linears[4:])):
            return False
    # Module hooks would be skipped here (e.g. adapters, offloading): leave such models to their forward.
    if any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules()):
        return False
    return not (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def lean_decode_step(model) -> Optional[Callable]:
    """A function step(input_ids [B, 1], attention_mask [B, L], position_ids [B, 1], layers) ->
    logits [B, V] of the new token, where `layers` are the model's `DynamicLayer`s holding L - 1
    cached positions (each gets the new key/value appended, as `DynamicLayer.update` does), and
    attention_mask is the 2-D padding mask over the L positions. Same numbers as
    `model(input_ids=..., attention_mask=..., position_ids=..., past_key_values=cache).logits[:, -1]`.
    None when `model` is not one this step reproduces exactly (see the module docstring)."""
    if not _supported(model):
        return None
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    inner = model.model
    head_dim = inner.layers[0].self_attn.head_dim
    gqa = model.config.num_key_value_heads != model.config.num_attention_heads
    rope = inner.rotary_emb
    emb_w, pad_idx = inner.embed_tokens.weight, inner.embed_tokens.padding_idx
    final_norm, head_w = (inner.norm.weight, inner.norm.variance_epsilon), model.lm_head.weight
    # Each layer's tensors, read once per rollout (module attribute lookups cost more than the
    # arithmetic of a small decode step). The optimizer updates parameters in place, and a step
    # function lives for one rollout.
    layers_w = [(
        (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
        (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
        layer.self_attn.q_proj.weight, layer.self_attn.q_proj.bias, layer.self_attn.k_proj.weight,
        layer.self_attn.k_proj.bias, layer.self_attn.v_proj.weight, layer.self_attn.v_proj.bias,
        layer.self_attn.o_proj.weight, layer.self_attn.scaling,
        layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight,
    ) for layer in inner.layers]

    def step(input_ids, attention_mask, position_ids, layers):
        # Hidden states are kept [B, hidden]: transformers' [B, 1, hidden] linears run the same
        # matrix product on the same memory (`linear` flattens a 3-D input).
        B = input_ids.shape[0]
        h = F.embedding(input_ids.view(B), emb_w, pad_idx)
        # Qwen2RotaryEmbedding.forward's operations, without its decorators and autocast context.
        inv_freq = rope.inv_freq[None, :, None].float().expand(B, -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * rope.attention_scaling).to(h.dtype)  # [B, 1, head_dim]
        sin = (emb.sin() * rope.attention_scaling).to(h.dtype)
        # transformers' sdpa mask for one query token with a cache: none without padding, else the
        # padding mask as [B, 1, 1, L] booleans (masking_utils.sdpa_mask), which SDPA turns into 0 / -inf
        # added to the scores in every layer; made here once, as those floats.
        mask = None
        if not bool(attention_mask.all()):
            mask = torch.zeros(attention_mask.shape, dtype=h.dtype, device=h.device).masked_fill_(
                attention_mask == 0, float("-inf"))[:, None, None, :]
        for (n1, n2, wq, bq, wk, bk, wv, bv, wo, scaling, wg, wu, wd), cache in zip(layers_w, layers):
            x = _rms_norm(n1, h)
            q = F.linear(x, wq, bq).view(B, -1, head_dim)  # [B, heads, head_dim]
            k = F.linear(x, wk, bk).view(B, -1, head_dim)
            v = F.linear(x, wv, bv).view(B, -1, 1, head_dim)
            q = ((q * cos) + (rotate_half(q) * sin)).unsqueeze(2)  # [B, heads, 1, head_dim]
            k = ((k * cos) + (rotate_half(k) * sin)).unsqueeze(2)
            cache.keys = torch.cat([cache.keys, k], dim=-2)
            cache.values = torch.cat([cache.values, v], dim=-2)
            o = F.scaled_dot_product_attention(q, cache.keys, cache.values, attn_mask=mask, dropout_p=0.0,
                                               scale=scaling, is_causal=False, enable_gqa=gqa)
            h = h + F.linear(o.transpose(1, 2).contiguous().view(B, -1), wo)
            x = _rms_norm(n2, h)
            h = h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        return F.linear(_rms_norm(final_norm, h), head_w)

    return step
