"""The CPU attention path: transformers' sdpa attention with grouped key/value heads kept grouped.

Used by the generation engines, the lean decode step and the training forward; on its own so that
none of them imports another for it.
"""

from __future__ import annotations

GQA_SDPA = "sdpa_gqa"


def _sdpa_gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' sdpa attention, except that grouped key/value heads go to torch's SDPA as they
    are (`enable_gqa`) also when there is a padding mask. transformers copies them out to one head per
    query head in that case, i.e. the whole KV cache at every decode step; on CPU that copy cost
    more than the attention itself (toy rollout: 0.29 vs 0.35-0.39 s, identical samples)."""
    import torch

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa_on_cpu(model) -> bool:
    """Switch a CPU model that uses transformers' sdpa attention and grouped KV heads to
    `_sdpa_gqa_forward` (same numbers). CUDA keeps transformers' choice: there, a mask with
    `enable_gqa` selects PyTorch's slow math kernel. Returns whether it switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = model.config
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if (next(model.parameters()).device.type != "cpu" or getattr(cfg, "_attn_implementation", None) != "sdpa"
            or not heads or not kv or heads == kv):
        return False
    AttentionInterface.register(GQA_SDPA, _sdpa_gqa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return True
