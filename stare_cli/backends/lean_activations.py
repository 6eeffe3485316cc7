"""Leaner saved activations for Llama-family decoder layers: the same forward, fewer tensors kept for backward.

What autograd keeps per token and decoder layer of SmolLM2-135M in fp32 (traced with saved-tensor hooks,
issue 69): about 50 KB, of which the SwiGLU MLP keeps four [intermediate] tensors (gate_proj's output for
SiLU, SiLU's output and up_proj's output for the product, the product for down_proj: 4 x 1,536 x 4 bytes)
and each RMSNorm keeps its input, 1/rms and the normalised input (for the weight's gradient).

Two autograd functions replace them, computing the forward with the very same operations:
- `_SwiGLU`: y = down(silu(gate(x)) * up(x)); saves x, gate(x), up(x) and recomputes silu(gate) and the
  product in backward (two elementwise passes); saves 2 x intermediate floats per token and layer.
- `_RMSNorm`: y = w * (h * rsqrt(mean(h^2) + eps)); saves h and 1/rms, recomputes h / rms in backward;
  saves one hidden-size tensor per token and norm.
Backward uses the formulas autograd itself applies (derivatives.yaml: silu_backward, mul, rsqrt's
-0.5 g r^3, mean's expand / N, pow's 2 h g; linear as mm on the flattened tokens), so the gradients equal
autograd's up to float32 rounding of the same products (tests/test_lean_activations.py: bitwise equal on
the CPU where the kernels agree, and within the plain path's own error of a float64 reference in any case).
SmolLM2: about 17 of 50 KB per token and layer (34%).

`apply(model)` swaps the forward of every MLP and RMSNorm module of a supported architecture (model_type in
`SUPPORTED`, activation `silu`, no autocast: fp32 compute) in place; `backend.embedded.lean_activations`
('auto': with a real vocabulary, as the chunked head; true; false) decides where the trainer and its memory
plan apply it. Under autocast (bf16/fp16 on CUDA) the modules keep their own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor

# Llama-family decoders whose MLP is down(act(gate(x)) * up(x)) and whose RMSNorm is w * (h * rsqrt(mean h^2 +
# eps)) in float32 (checked in transformers 5.x's modeling files)
SUPPORTED = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def _linear_backward(dy2: Tensor, x2: Tensor, W: Tensor, need_b: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dx, dW, db) of y = x W^T (+ b) on flattened tokens, as autograd's mm backward forms them."""
    dx = dy2.mm(W)
    dW = x2.t().mm(dy2).t()
    return dx, dW, (dy2.sum(0) if need_b else None)


class _SwiGLU(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) saving x, gate(x), up(x) only. x: [..., d]; W_gate, W_up: [I, d];
    W_down: [d, I]; biases or None. Returns [..., d]."""

    @staticmethod
    def forward(ctx, x, Wg, bg, Wu, bu, Wd, bd):
        g = F.linear(x, Wg, bg)
        u = F.linear(x, Wu, bu)
        y = F.linear(F.silu(g) * u, Wd, bd)
        ctx.save_for_backward(x, g, u, Wg, Wu, Wd)
        ctx.biases = (bg is not None, bu is not None, bd is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, u, Wg, Wu, Wd = ctx.saved_tensors
        has_bg, has_bu, has_bd = ctx.biases
        a = F.silu(g)  # recomputed: the forward's own operations, so the same bits
        p = a * u
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        dp, dWd, dbd = _linear_backward(flat(dy), flat(p), Wd, has_bd)
        dp = dp.view(p.shape)
        da, du = dp * u, dp * a
        dg = torch.ops.aten.silu_backward(da, g)
        dxg, dWg, dbg = _linear_backward(flat(dg), flat(x), Wg, has_bg)
        dxu, dWu, dbu = _linear_backward(flat(du), flat(x), Wu, has_bu)
        dx = (dxg + dxu).view(x.shape)
        return dx, dWg, dbg, dWu, dbu, dWd, dbd


class _RMSNorm(torch.autograd.Function):
    """w * (h * rsqrt(mean(h^2) + eps)) for float32 h [..., d], saving h and 1/rms only; w: [d]."""

    @staticmethod
    def forward(ctx, h, w, eps: float):
        var = h.pow(2).mean(-1, keepdim=True)
        r = torch.rsqrt(var + eps)
        y = w * (h * r)
        ctx.save_for_backward(h, r, w)
        return y

    @staticmethod
    def backward(ctx, dy):
        h, r, w = ctx.saved_tensors
        n = h * r  # recomputed
        dw = (dy * n).sum_to_size(w.shape)
        dn = dy * w
        dh = dn * r
        dr = (dn * h).sum_to_size(r.shape)
        dvar = -0.5 * dr * r.pow(3)
        dh2 = dvar.expand(h.shape) / h.shape[-1]
        dh = dh + dh2 * (2 * h)
        return dh, dw, None


def _mlp_forward(self, x):
    if torch.is_autocast_enabled(x.device.type) or not torch.is_grad_enabled():
        return self._stare_plain_forward(x)
    g, u, d = self.gate_proj, self.up_proj, self.down_proj
    return _SwiGLU.apply(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias)


def _norm_forward(self, hidden_states):
    if (hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32
            or torch.is_autocast_enabled(hidden_states.device.type) or not torch.is_grad_enabled()):
        return self._stare_plain_forward(hidden_states)
    return _RMSNorm.apply(hidden_states, self.weight, float(self.variance_epsilon))


def supports(model) -> bool:
    """Whether `model` is a Llama-family decoder with SiLU-gated MLPs (what `apply` rewrites)."""
    cfg = getattr(model, "config", None)
    return (cfg is not None and getattr(cfg, "model_type", None) in SUPPORTED
            and getattr(cfg, "hidden_act", None) == "silu")


def _is_mlp(m) -> bool:
    return all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")) and \
        all(isinstance(getattr(m, k), torch.nn.Linear) for k in ("gate_proj", "up_proj", "down_proj"))


def _is_rmsnorm(m) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and \
        isinstance(getattr(m, "weight", None), torch.nn.Parameter)


def apply(model) -> int:
    """Swap the forward of every SwiGLU MLP and RMSNorm of a supported model (in place; idempotent);
    returns how many modules now run the lean functions (0 for an unsupported model)."""
    if not supports(model):
        return 0
    n = 0
    for m in model.modules():
        fwd = _mlp_forward if _is_mlp(m) else _norm_forward if _is_rmsnorm(m) else None
        if fwd is None:
            continue
        if not hasattr(m, "_stare_plain_forward"):
            m._stare_plain_forward = m.forward
        m.forward = types.MethodType(fwd, m)
        n += 1
    return n
