"""One decode step of a transformers Qwen2 model on its key/value cache, without transformers'
per-call machinery: the same torch operations on the same tensors as the model's own forward (so the
same logits, bit for bit), minus what a one-token step with a cache does not need from it (building a
4-D mask through `masking_utils`, output records, decorators, module-call dispatch).

Why: a decode step of the CPU toy (128 rows, 4 layers of width 128) costs ~3 ms of transformers'
Python per call before any arithmetic, and the rollout makes ~45 such calls per training step. With
this step the toy rollout takes ~15% less time (benchmarks/perf/lean_decode.py: 1.18x), with the same
samples and log-probs (tests/test_lean_decode.py compares them with the model's forward exactly).

It is used only where it is exact by construction: a plain `Qwen2ForCausalLM` (no adapters or hooks,
unmodified modules) whose attention runs `benchmarks.engines._sdpa_gqa_forward` (the CPU path with
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
    """Qwen2RMSNorm.forward, operation for operation."""
    import torch

    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(h.dtype)


def _rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _supported(model) -> bool:
    import torch
    from torch.nn.modules import module as torch_module

    from benchmarks.engines import GQA_SDPA

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

    inner = model.model
    head_dim = inner.layers[0].self_attn.head_dim
    parts = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
             for layer in inner.layers]

    def step(input_ids, attention_mask, position_ids, layers):
        B = input_ids.shape[0]
        h = F.embedding(input_ids, inner.embed_tokens.weight, inner.embed_tokens.padding_idx)
        cos, sin = inner.rotary_emb(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # transformers' sdpa mask for one query token with a cache: none without padding, else the
        # padding mask as [B, 1, 1, L] booleans (masking_utils.sdpa_mask), which SDPA turns into 0 / -inf
        # added to the scores in every layer; made here once, as those floats.
        mask = None
        if not bool(attention_mask.all()):
            mask = torch.zeros(attention_mask.shape, dtype=h.dtype, device=h.device).masked_fill_(
                attention_mask == 0, float("-inf"))[:, None, None, :]
        for (norm1, attn, norm2, mlp), cache in zip(parts, layers):
            x = _rms_norm(norm1, h)
            shape = (B, 1, -1, head_dim)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(shape).transpose(1, 2)
            k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(shape).transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            cache.keys = torch.cat([cache.keys, k], dim=-2)
            cache.values = torch.cat([cache.values, v], dim=-2)
            o = F.scaled_dot_product_attention(q, cache.keys, cache.values, attn_mask=mask, dropout_p=0.0,
                                               scale=attn.scaling, is_causal=False,
                                               enable_gqa=cache.keys.shape[1] != q.shape[1])
            h = h + F.linear(o.transpose(1, 2).contiguous().reshape(B, 1, -1), attn.o_proj.weight)
            x = _rms_norm(norm2, h)
            h = h + F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                             mlp.down_proj.weight)
        return F.linear(_rms_norm(inner.norm, h), model.lm_head.weight)[:, -1]

    return step
