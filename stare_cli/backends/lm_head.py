"""Token log-probs and entropies straight from the last hidden state, in chunks of positions.

The plain path (`model(...).logits`, then log-softmax and entropy) holds the logits of every position of
a micro-batch over the whole vocabulary in float32, and autograd keeps several such [positions x V]
tensors for the backward pass (the log-softmax, its exponential, their product for the entropy, their
gradients). At a real vocabulary that is the trainer's peak: 6,400 positions x 49,152 x 4 bytes = 1.26 GB
a copy for SmolLM2; 8,192 x 151,936 x 4 = 5 GB a copy for Qwen2.5.

`head_logprob_entropy` computes the same two numbers per position with one custom autograd function:
- forward: for each chunk of positions, logits z = h W^T (+ b), divided by the sampling temperature,
  in float32; log pi(y) = log_softmax(z)[y] and H = -sum p log p; the chunk's logits are then dropped.
  Saved for backward: the hidden states and the two outputs ([N] each), nothing [N x V].
- backward: each chunk's logits are recomputed (one more LM-head product per chunk) and the gradient
  with respect to them is formed in closed form,
      d log pi(y) / dz = onehot(y) - p,      dH / dz = -p (log p + H),
  so dL/dz = g_lp (onehot(y) - p) - g_H p (log p + H), scaled by 1 / temperature; then dL/dh = dL/dz W
  and dL/dW += dL/dz^T h (dL/db += sum dL/dz).
Exactness. Every gradient of a softmax's outputs sums to 0 over the vocabulary, and the LM head's
products (dL/dh = dL/dz W) amplify a nonzero row sum by the mean output embedding, which is large (SmolLM2:
|mean row| 2.18 against a mean row norm of 3.2). The float32 p = exp(log_softmax) sums to 1 only up to the
rounding of the log-sum-exp; used as it is, the closed form's rows summed to up to 8.5e-5 on SmolLM2's
real head, and the entropy term's dL/dh and dL/dW came out 1.4-14x further from a float64 reference than
autograd's (issue 68). The backward therefore normalises p to sum 1 and removes the row sum's residue
along p (dL/dz -= p sum_j dL/dz_j): the closed form's dL/dz is then ~150x closer to the float64 gradient
at the same logits than autograd's, and dL/dh, dL/dW are as close as the plain path's or closer (the
test states the bound).
Peak memory beyond the model: a few [chunk x V] float32 tensors. Arithmetic: the LM head's products go
from 3 (forward, two gradients) to 4 per position; in exchange no product is spent on prompt or padding
positions (the caller passes response positions only) and the elementwise passes over [N x V] run on
chunks that stay in cache. Equal to the plain path up to float32 rounding (tests/test_lm_head.py states
the bound against a float64 reference).

Used for the architectures whose logits are exactly `lm_head(last hidden state)` (`supports`); any other
model keeps the plain path.
"""

from __future__ import annotations

import torch
from torch import Tensor

# A chunk's float32 logits take at most this many bytes (positions per chunk = this / (4 V), at least 16).
CHUNK_BYTES = 64 * 2**20

# model_type values whose causal-LM head is logits = lm_head(last hidden state), nothing after it
# (checked in transformers 5.x's modeling files); gemma3 only without final_logit_softcapping.
PLAIN_HEADS = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma3", "olmo2", "phi3"})


def supports(model) -> bool:
    """Whether `model`'s logits are its output embedding applied to its decoder's last hidden state."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in PLAIN_HEADS:
        return False
    if getattr(cfg, "final_logit_softcapping", None) is not None or getattr(cfg, "logit_scale", None) is not None:
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return isinstance(head, torch.nn.Linear) and hasattr(model, "model")


def chunk_positions(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's float32 logits take at most chunk_bytes (at least 16)."""
    return max(16, chunk_bytes // (4 * vocab))


class _HeadLogProbEntropy(torch.autograd.Function):
    """Module docstring. Inputs: h [N, d], W [V, d], b [V] or None, y [N] (long), temperature, chunk,
    need_entropy. Outputs: log pi(y) [N], H [N] (float32; H zeros when not needed)."""

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, b: Tensor | None, y: Tensor, temperature: float, chunk: int,
                need_entropy: bool):
        N = h.shape[0]
        lp = torch.empty(N, dtype=torch.float32, device=h.device)
        H = torch.zeros(N, dtype=torch.float32, device=h.device)
        for s in range(0, N, chunk):
            logp = _chunk_logp(h[s:s + chunk], W, b, temperature)
            lp[s:s + chunk] = logp.gather(-1, y[s:s + chunk, None]).squeeze(-1)
            if need_entropy:
                H[s:s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(h, W, b, y, H)
        ctx.temperature, ctx.chunk, ctx.need_entropy = temperature, chunk, need_entropy
        ctx.mark_non_differentiable(y)
        return lp, H

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_H: Tensor | None):
        h, W, b, y, H = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        use_H = ctx.need_entropy and g_H is not None
        gh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        gW = torch.zeros(W.shape, dtype=torch.float32, device=W.device) if ctx.needs_input_grad[1] else None
        gb = torch.zeros(W.shape[0], dtype=torch.float32, device=W.device) \
            if (b is not None and ctx.needs_input_grad[2]) else None
        for s in range(0, h.shape[0], chunk):
            hs = h[s:s + chunk]
            logp = _chunk_logp(hs, W, b, t)
            # p normalised to sum 1 in float32: exp(log_softmax) sums to 1 only up to the rounding of the
            # log-sum-exp, a factor common to the whole row that would leave sum_j dL/dz_j != 0 (module
            # docstring, "Exactness")
            p = logp.exp()
            p = p / p.sum(-1, keepdim=True)
            # dL/dz = g_lp (onehot(y) - p) - g_H p (log p + H)   (module docstring)
            coef = torch.zeros(hs.shape[0], 1, dtype=torch.float32, device=h.device)
            if g_lp is not None:
                coef = coef + g_lp[s:s + chunk, None].float()
            gz = p * coef
            if use_H:
                gz = gz + g_H[s:s + chunk, None].float() * p * (logp + H[s:s + chunk, None])
            gz = -gz
            if g_lp is not None:
                gz.scatter_add_(-1, y[s:s + chunk, None], g_lp[s:s + chunk, None].float())
            # the exact dL/dz sums to 0 over the vocabulary (adding a constant to every logit changes
            # nothing): remove the float32 residue along p, the direction it enters by
            gz -= p * gz.sum(-1, keepdim=True)
            gz = gz / t
            if gh is not None:
                gh[s:s + chunk] = (gz.to(W.dtype) @ W).to(h.dtype)
            if gW is not None:
                gW.addmm_(gz.T, hs.float())
            if gb is not None:
                gb += gz.sum(0)
        return (gh, gW.to(W.dtype) if gW is not None else None, gb.to(b.dtype) if gb is not None else None,
                None, None, None, None)


def _chunk_logp(hs: Tensor, W: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """log_softmax of one chunk's logits, [c, V] float32, as the plain path computes them: the product in
    the model's dtype, then float32, then divided by the temperature."""
    z = hs @ W.T if b is None else torch.addmm(b, hs, W.T)
    return torch.log_softmax(z.float() / temperature, dim=-1)


def head_logprob_entropy(h: Tensor, W: Tensor, b: Tensor | None, y: Tensor, temperature: float = 1.0,
                         need_entropy: bool = True, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """log pi(y_n) and H_n for every position n, from hidden states, never holding [N x V] logits.

    Args:
        h: [N, d] last hidden states of the positions that predict y (any float dtype).
        W: [V, d] output embedding (lm_head.weight); b: [V] its bias, or None.
        y: [N] target token ids.
        temperature: logits are divided by it (the rollout distribution).
        need_entropy: when False, H is zeros and carries no gradient work.
        chunk: positions per chunk (default: `chunk_positions(V)`).
    Returns:
        lp: [N] float32 log pi(y_n); H: [N] float32 entropy of pi at n.
    """
    if chunk is None:
        chunk = chunk_positions(W.shape[0])
    return _HeadLogProbEntropy.apply(h, W, b, y, float(temperature), int(chunk), bool(need_entropy))
