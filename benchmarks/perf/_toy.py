"""The warmed-up arith toy as the embedded trainer loads it on the CPU (fp32, grouped-KV SDPA), with
an HF rollout engine: the common setup of the perf scripts beside this file."""

from __future__ import annotations

from typing import Optional


def toy_engine(batch_size: int = 128, max_prompt_tokens: Optional[int] = None):
    """(model, tokenizer, HFEngine) for the shipped arith toy, one torch thread."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.generation.attention import use_gqa_sdpa_on_cpu
    from benchmarks.generation.engines import HFEngine, load_tokenizer
    from benchmarks.data.toy import ensure_toy_model

    torch.set_num_threads(1)
    path = str(ensure_toy_model("arith"))
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    use_gqa_sdpa_on_cpu(model)
    return model, tok, HFEngine(model, tok, batch_size=batch_size, max_prompt_tokens=max_prompt_tokens)
