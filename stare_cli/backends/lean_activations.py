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

A third saving keeps no RMSNorm output at all: the projections after a norm (q, k, v after the input norm;
the MLP after the post-attention norm) save the normalised input for their weight gradients, although the
norm already keeps h and 1/rms. `_NormRecompute`, saved-tensor hooks active during the decoder's forward,
stores such a tensor as (h, 1/rms, w) and recomputes w * (h * r) when backward first asks for it, the
forward's own operations, so the same bits (one elementwise product per norm and backward; the value is
shared by the projections that saved it and dropped after the last). SmolLM2: 2 x 576 x 4 = 4,608 bytes
per token and layer fewer (the memory plan's trace: 34.1 -> 29.5 KB).

`apply(model)` swaps the forward of every MLP and RMSNorm module of a supported architecture (model_type in
`SUPPORTED`, activation `silu`, no autocast: fp32 compute) in place; `backend.embedded.lean_activations`
('auto': with a real vocabulary, as the chunked head; true; false) decides where the trainer and its memory
plan apply it. Under autocast (bf16/fp16 on CUDA) the modules keep their own forward.
"""

from __future__ import annotations

import types
import weakref

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
        ctx.rms_inv = r  # for `_NormRecompute.register` (the same tensor as saved: no extra memory)
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


class _Cell:
    """One RMSNorm output kept as its recipe: y = w * (h * r), recomputed once for all who saved it."""

    __slots__ = ("h", "r", "w", "pending", "value")

    def __init__(self, h: Tensor, r: Tensor, w: Tensor) -> None:
        self.h, self.r, self.w, self.pending, self.value = h, r, w, 0, None

    def get(self) -> Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.w * (self.h * self.r)  # _RMSNorm.forward's operations: the same bits
        v = self.value
        self.pending -= 1
        if self.pending <= 0:  # the last projection that saved it has it now
            self.value = None
        return v


class _Saved:
    """What a pack hook stores for a view of a recomputable norm output: its cell and the view's geometry."""

    __slots__ = ("cell", "size", "stride", "offset")

    def __init__(self, cell: _Cell, x: Tensor) -> None:
        self.cell, self.size, self.stride, self.offset = cell, tuple(x.size()), tuple(x.stride()), x.storage_offset()


class _NormRecompute:
    """Saved-tensor hooks, entered around a decoder's forward, under which a saved tensor that is (a view
    of) a registered RMSNorm output is stored as a `_Saved` and recomputed in backward; every other tensor
    goes to the hooks that were active before (a memory trace's, say) or is kept as a detached alias (no
    reference cycle through an output's own grad_fn). Inside activation checkpointing its hooks are on top
    and this one is not: nothing is registered there, the layers are recomputed anyway."""

    _stack: list["_NormRecompute"] = []

    def __init__(self) -> None:
        self.cells: dict[int, tuple[weakref.ref, _Cell]] = {}
        self.outer = None

    def __enter__(self) -> "_NormRecompute":
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        _NormRecompute._stack.append(self)
        return self

    def __exit__(self, *exc) -> bool:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        _NormRecompute._stack.pop()
        self.cells.clear()
        return False

    @classmethod
    def active(cls) -> "_NormRecompute | None":
        """The innermost context if its hooks are the ones autograd applies now (not checkpointing's)."""
        if not cls._stack:
            return None
        top, cur = cls._stack[-1], torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top if cur is not None and cur[0] == top.pack else None

    def register(self, y: Tensor, h: Tensor, r: Tensor, w: Tensor) -> None:
        ptr = y.untyped_storage().data_ptr()
        cells = self.cells
        # the entry lives as long as y: a freed address reused by another tensor is never taken for y
        self.cells[ptr] = (weakref.ref(y, lambda _, p=ptr: cells.pop(p, None)), _Cell(h, r, w))

    def pack(self, x: Tensor):
        e = self.cells.get(x.untyped_storage().data_ptr())
        if e is not None and e[0]() is not None and x.dtype == e[1].h.dtype and x.device == e[1].h.device:
            e[1].pending += 1
            return _Saved(e[1], x)
        return self.outer[0](x) if self.outer is not None else x.detach()

    def unpack(self, packed):
        if isinstance(packed, _Saved):
            return packed.cell.get().as_strided(packed.size, packed.stride, packed.offset)
        return self.outer[1](packed) if self.outer is not None else packed


def _decoder_forward(self, *args, **kwargs):
    if not torch.is_grad_enabled():
        return self._stare_plain_forward(*args, **kwargs)
    with _NormRecompute():
        return self._stare_plain_forward(*args, **kwargs)


def _mlp_forward(self, x):
    if torch.is_autocast_enabled(x.device.type) or not torch.is_grad_enabled():
        return self._stare_plain_forward(x)
    g, u, d = self.gate_proj, self.up_proj, self.down_proj
    return _SwiGLU.apply(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias)


def _norm_forward(self, hidden_states):
    if (hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32
            or torch.is_autocast_enabled(hidden_states.device.type) or not torch.is_grad_enabled()):
        return self._stare_plain_forward(hidden_states)
    y = _RMSNorm.apply(hidden_states, self.weight, float(self.variance_epsilon))
    ctx = _NormRecompute.active()
    if ctx is not None:  # the projections that save y keep (h, 1/rms) instead: the norm's own saved tensors
        r = getattr(y.grad_fn, "rms_inv", None)
        if r is not None:
            ctx.register(y, hidden_states, r, self.weight)
    return y


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
    decoder = getattr(model, "model", None)
    if isinstance(decoder, torch.nn.Module) and not hasattr(decoder, "_stare_plain_forward"):
        decoder._stare_plain_forward = decoder.forward  # norm outputs recomputed in backward (_NormRecompute)
        decoder.forward = types.MethodType(_decoder_forward, decoder)
    for m in model.modules():
        fwd = _mlp_forward if _is_mlp(m) else _norm_forward if _is_rmsnorm(m) else None
        if fwd is None:
            continue
        if not hasattr(m, "_stare_plain_forward"):
            m._stare_plain_forward = m.forward
        m.forward = types.MethodType(fwd, m)
        n += 1
    return n
