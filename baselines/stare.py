"""STARE: surprisal-guided token-level advantage reweighting (arXiv 2606.19236).

Given GRPO advantages A and the rollout policy's log-probs, STARE selects
  L+ = the top-P fraction of T+ = {valid tokens with A > 0} by surprisal s = -log pi_old(o_t),
  L- = the same fraction of T- = {valid tokens with A < 0} (variant C2 only),
and weights them W (L+) and M (L-), 1 elsewhere, while a closed-loop gate is on (batch-mean token
entropy H < H_tgt). Since w > 0, w * clip-loss(A) == clip-loss(w * A): the weights are a token-level
advantage transform A_eff = w * A that composes with any loss of the PPO-clip family.

Counting as the official code: |L+| = min(n, max(1, int(n P + 0.999999))) for n = |T+| > 0 (the
paper's ceil(P n), at least one token), and none for P = 0. A == 0 tokens are never weighted.
Deviation from the official code, stated: ties in surprisal at the threshold are broken by position
(earlier flat index first), so selection is deterministic on every device; the official code takes
whatever `torch.topk` returns among tied tokens. Weights are float32 (the official code stores them in
the advantages' dtype; under bf16 advantages W = 1.1 would become 1.1015625). The selection scope
(the whole batch, or each loss call on the current log-probs as the official code) is the caller's
choice: call this function on what it should see (stare_cli/method/layer.py does both).

Three implementations of one selection: on CPU tensors outside autograd (the embedded backend's loss
calls) it runs on the host, in C (`_stare_select.c`, one pass over the call and two small
quickselects, built at install where a C compiler is there) or else in NumPy, whose per-call cost on
a micro-batch is its ~40 calls' overhead where torch's is 5-30 us per operation; elsewhere
(accelerators, bf16 advantages, advantages that need gradients) in torch with one host read. All give
the same sets and the same bits (tests run every STARE selection test on all three).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import Literal, Union

import numpy as np
import torch
from torch import Tensor

Variant = Literal["o1", "c2"]


_HOST_DTYPES = (torch.float32, torch.float64)

try:  # the host path in C, built from _stare_select.c at install where a C compiler was there. By
    # name: the import graph (grimp) cannot see a compiled module and would read `from baselines import
    # _stare_select` as an import of the package itself, a cycle; the C module imports nothing.
    _kernel = importlib.import_module("baselines._stare_select")
except ImportError:  # pragma: no cover - no C compiler at install: the NumPy functions below
    _kernel = None


@dataclass(frozen=True)
class _Selection:
    """L+ and L- as flat positions into adv.reshape(-1) (int64; L- empty for O1), and the valid tokens."""

    pos: Tensor
    neg: Tensor
    n_valid: int


def _on_host(adv: Tensor, log_prob: Tensor, mask: Tensor) -> bool:
    """Whether the selection runs in NumPy (module docstring): CPU tensors, advantages float32/float64
    outside autograd."""
    return adv.is_cpu and log_prob.is_cpu and mask.is_cpu and adv.dtype in _HOST_DTYPES and not adv.requires_grad


def _check_size(n: int) -> None:
    if n >= 2**31:
        raise ValueError(f"STARE selection supports fewer than 2**31 tokens per call, got {n}")


def _top_k_positions(log_prob: Tensor, members: Tensor, n: int, k: int) -> Tensor:
    """Flat positions of the k members with the largest surprisal; ties go to the earlier position.

    log_prob: flat [N]; members: flat bool [N]; n = members.sum(), known on the host; 0 < k <= n.
    Each member gets a unique int64 key (the surprisal's float bits, which order like the floats for
    s >= 0, then the position), so a plain top-k is exact and deterministic with no further host sync.
    """
    if members.device.type == "cpu":  # a host sync is free on the CPU, and nonzero is 2x faster there
        pos = torch.nonzero(members).squeeze(1)
    else:  # no sync: the size is known
        pos = torch.nonzero_static(members, size=n).squeeze(1)
    if k == n:
        return pos
    # Surprisal of the members only: |min(log pi, 0)| (a log-prob rounded above 0 counts as surprisal 0,
    # and abs turns -0.0 into +0.0). Non-negative float32 bits then order like the floats themselves.
    s = log_prob[pos].to(torch.float32).clamp_(max=0.0).abs_()
    key = s.view(torch.int32).to(torch.int64).bitwise_left_shift_(31).sub_(pos)  # unique; earlier first on ties
    return pos[torch.topk(key, k, sorted=False).indices]


_INT32_MIN = np.int32(-(2**31))


def _surprisal_keys_host(log_prob: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """int32 keys at `pos` that order like the device path's float32 surprisal |min(log pi, 0)| (NaN
    above infinity), each the surprisal's float bits minus 2**31 (a fresh array).

    A log-prob at or below -0.0 is its own key: the int32 view of a float whose sign bit is set is
    (magnitude bits) - 2**31, and the magnitude bits of log pi are those of |log pi|. So the usual case
    costs one gather and one max; only a log-prob with the sign bit clear (+0.0, rounded above 0, +inf:
    surprisal 0; a NaN without the sign bit: NaN) needs its key rewritten.
    """
    key = log_prob.take(pos).astype(np.float32, copy=False).view(np.int32)
    if key.size and key.max() >= 0:  # rare: a log-prob with the sign bit clear
        mag = key & np.int32(0x7FFFFFFF)
        is_nan = mag > 0x7F800000
        key = np.where((key < 0) | is_nan, mag + _INT32_MIN, _INT32_MIN).astype(np.int32, copy=False)
    return key


def _top_k_positions_host(log_prob: np.ndarray, pos: np.ndarray, P: float) -> np.ndarray:
    """_top_k_positions in NumPy for the members at flat positions `pos` (ascending), k = _k(P, pos.size):
    the same selection, ranked by the same float bits less 2**31 (_surprisal_keys_host: non-negative
    float32 bits order like the floats, and NaN above infinity, as the device path's keys), ties to the
    earlier position.

    On more than 1024 members a threshold t from every 8th member first narrows the candidates to
    those at or above it; if at least k remain, the k largest are among them, since every member left
    out ranks below every candidate. Then the k-th largest value, found by a partition, is the cut:
    all above it, and of those equal to it the earliest, up to k.
    """
    n = pos.size
    k = _k(P, n)
    if k == n:
        return pos
    if k == 0:
        return pos[:0]
    bits = _surprisal_keys_host(log_prob, pos)
    if n > 1024:
        sample = bits[::8]
        q = min(sample.size, int(sample.size * k / n * 1.5) + 4)  # ~1.5x the expected share, a margin
        cand = (bits >= np.partition(sample, sample.size - q)[sample.size - q]).nonzero()[0]
        if cand.size >= k:
            pos, bits = pos.take(cand), bits.take(cand)
    cut = np.partition(bits, bits.size - k)[bits.size - k]
    chosen = bits >= cut
    extra = int(np.count_nonzero(chosen)) - k
    if extra:  # ties at the cut: drop the latest of them (pos is ascending)
        chosen[(bits == cut).nonzero()[0][-extra:]] = False
    return pos.compress(chosen)  # compress: 3x faster than pos[chosen] on a few thousand members


def _k(P: float, n: int) -> int:
    """Tokens selected among n candidates: the official count, min(n, max(1, int(n P + 0.999999))).

    The official code's "+ 0.999999" is a ceiling that forgives float error: 0.1 * 30 is
    3.0000000000000004 in floating point, and int(3.0000000000000004 + 0.999999) is 3.
    """
    if n == 0 or P <= 0:
        return 0
    return min(n, max(1, int(n * P + 0.999999)))


def check_stare_args(P: float, variant: str) -> str:
    """Validate P (in [0, 1], as the official code) and the variant (case-insensitive, like the
    official code's upper-casing); returns the variant in lower case."""
    P = float(P)
    if not 0.0 <= P <= 1.0:  # also rejects NaN
        raise ValueError(f"STARE P must be in [0, 1], got {P}")
    v = str(variant).strip().lower()
    if v not in ("o1", "c2"):
        raise ValueError(f"unknown STARE variant '{variant}'; valid: o1, c2 (any case)")
    return v


def _host_arrays(adv: Tensor, log_prob: Tensor, mask: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat NumPy views (copies only where a cast is needed) of A, log pi and the mask in A's dtype."""
    a = adv.numpy().reshape(-1)
    lp = log_prob.detach()
    lp = (lp if lp.dtype in _HOST_DTYPES else lp.to(torch.float32)).numpy().reshape(-1)  # exact, as the device path
    m = mask.detach()
    m = (m if m.dtype != torch.bfloat16 else m.to(adv.dtype)).numpy().reshape(-1).astype(a.dtype, copy=False)
    return a, lp, m


def _select_host(a: np.ndarray, lp: np.ndarray, m: np.ndarray, P: float, variant: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(L+ positions, L- positions, valid tokens) on the host; arguments from _host_arrays."""
    if _kernel is not None:  # one call; the NumPy lines below are its reference and its fallback
        cap = _k(P, a.size)  # no set selects more
        pos, neg = np.empty(cap, np.int64), np.empty(cap, np.int64)
        k_pos, k_neg, n_valid = _kernel.select(a, lp, m, P, variant == "c2", pos, neg)
        return pos[:k_pos], neg[:k_neg], n_valid
    am = a * m  # mask is 0/1: sign(A * mask) is sign(A) on valid tokens and 0 elsewhere
    n_valid = int(np.count_nonzero(m))  # m != 0, counted without the compare
    pos = _top_k_positions_host(lp, (am > 0).nonzero()[0], P)
    neg = _top_k_positions_host(lp, (am < 0).nonzero()[0], P) if variant == "c2" else pos[:0]
    return pos, neg, n_valid


def _select(adv: Tensor, log_prob: Tensor, mask: Tensor, P: float, variant: str) -> _Selection:
    """L+ and L- (see stare_positions) and the valid tokens; in NumPy on the host, else one host read."""
    variant = check_stare_args(P, variant)
    _check_size(adv.numel())
    if _on_host(adv, log_prob, mask):
        pos, neg, n_valid = _select_host(*_host_arrays(adv, log_prob, mask), P, variant)
        return _Selection(torch.from_numpy(pos), torch.from_numpy(neg), n_valid)
    flat_mask = mask.detach().reshape(-1).to(adv.dtype)
    olp = log_prob.detach().reshape(-1)
    am = adv.detach().reshape(-1) * flat_mask
    cands = [am > 0] + ([am < 0] if variant == "c2" else [])
    *counts, n_valid = torch.stack([torch.count_nonzero(m) for m in (*cands, flat_mask)]).tolist()  # the one host read
    out = []
    for members, n in zip(cands, counts):
        k = _k(P, int(n))
        out.append(_top_k_positions(olp, members, int(n), k) if k else torch.empty(0, dtype=torch.int64, device=adv.device))
    if variant == "o1":
        out.append(torch.empty(0, dtype=torch.int64, device=adv.device))
    return _Selection(out[0], out[1], int(n_valid))


def stare_positions(adv: Tensor, log_prob: Tensor, mask: Tensor, *, P: float, variant: str) -> tuple[Tensor, Tensor]:
    """Flat positions (into adv.reshape(-1)) of L+ and of L- (empty for O1), ignoring the gate.

    Args:
        adv: [B, T] token advantages; log_prob: [B, T] log pi of the sampled tokens (surprisal is
            -log_prob); mask: [B, T] valid response tokens.
        P: fraction selected, in [0, 1]; variant: 'o1' or 'c2' (any case).
    Returns:
        (L+ positions, L- positions), int64 [k+] and [k-], in no particular order. At most one host
        synchronisation (the set sizes).
    """
    sel = _select(adv, log_prob, mask, P, variant)
    return sel.pos, sel.neg


def stare_sets(adv: Tensor, log_prob: Tensor, mask: Tensor, *, P: float, variant: str) -> tuple[Tensor, Tensor]:
    """L+ and L- as bool masks [B, T] (L- all False for O1), ignoring the gate; see stare_positions."""
    sets = []
    for idx in stare_positions(adv, log_prob, mask, P=P, variant=variant):
        m = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
        m[idx] = True
        sets.append(m.view(adv.shape))
    return sets[0], sets[1]


def stare_scale(
    adv: Tensor,
    log_prob: Tensor,
    mask: Tensor,
    *,
    P: float = 0.1,
    W: float = 1.1,
    M: float = 0.9,
    variant: Variant = "o1",
    gate: bool = True,
) -> tuple[Tensor, int, int, int]:
    """The effective advantages w * A and the sizes of L+, L- and the valid tokens (the loss call's form).

    Only the selected tokens are touched: a copy of `adv` with the k+ (and k-) selected entries
    scaled by W (M) while the gate is on. The sets are selected whatever the gate (the official code
    logs their shares also while it is off). Arguments as `stare_token_weights`.
    Returns:
        (adv_eff [B, T] in adv's dtype, |L+|, |L-|, valid tokens), counted in one host read.
    """
    if _on_host(adv, log_prob, mask):  # the loss call's hot path on the CPU: NumPy only
        variant = check_stare_args(P, variant)
        _check_size(adv.numel())
        a, lp, m = _host_arrays(adv, log_prob, mask)
        if _kernel is not None:
            out_np = np.empty_like(a)
            k_pos, k_neg, n_valid = _kernel.scale(a, lp, m, P, W, M, variant == "c2", bool(gate), out_np)
            return torch.from_numpy(out_np.reshape(adv.shape)), k_pos, k_neg, n_valid
        pos, neg, n_valid = _select_host(a, lp, m, P, variant)
        out_np = a.copy()
        if bool(gate):
            out_np[pos] *= a.dtype.type(W)  # W in A's dtype, as torch multiplies
            if neg.size:
                out_np[neg] *= a.dtype.type(M)
        return torch.from_numpy(out_np.reshape(adv.shape)), int(pos.size), int(neg.size), n_valid
    sel = _select(adv, log_prob, mask, P, variant)
    out = adv.clone()
    if bool(gate):
        flat = out.view(-1)
        if sel.pos.numel():
            flat[sel.pos] *= W
        if sel.neg.numel():
            flat[sel.neg] *= M
    return out, int(sel.pos.numel()), int(sel.neg.numel()), sel.n_valid


def stare_token_weights(
    adv: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    *,
    P: float = 0.1,
    W: float = 1.1,
    M: float = 0.9,
    variant: Variant = "o1",
    gate: Union[bool, Tensor] = True,
) -> Tensor:
    """STARE token weights w: W on L+, M on L- (C2), 1 elsewhere; all 1 while the gate is off.

    Args:
        adv: [B, T] token advantages (any float dtype).
        old_log_prob: [B, T] log pi of the sampled tokens that the selection ranks by (the rollout's
            for batch scope, the current policy's for the official scope).
        mask: [B, T] 1 for valid response tokens.
        P: fraction of T+ (and T-) selected, in [0, 1] (ValueError otherwise).
        W: weight on L+; M: weight on L- (variant 'c2' only).
        variant: 'o1' (reweight L+ only) or 'c2' (L+ and L-), any case.
        gate: the controller's gate: anything `bool()` accepts (a Python or numpy bool, 0/1), or a
            0-dim bool tensor (no host sync).
    Returns:
        [B, T] float32 weights. At most one host synchronisation (the sizes of T+ and T-).
    """
    check_stare_args(P, variant)
    if not isinstance(gate, Tensor) and not bool(gate) or P <= 0:
        return torch.ones(adv.shape, dtype=torch.float32, device=adv.device)
    sel = _select(adv, old_log_prob, mask, P, variant)
    w = torch.ones(adv.numel(), dtype=torch.float32, device=adv.device)
    w[sel.pos] = float(W)
    w[sel.neg] = float(M)
    w = w.view(adv.shape)
    if isinstance(gate, Tensor):
        w = torch.where(gate.to(device=w.device, dtype=torch.bool), w, torch.ones_like(w))
    return w


@dataclass
class StareController:
    """Closed-loop gate and optional adaptive W/M, updated once per step from the batch entropy.

    gate = H < h_tgt. Adaptive: W += alpha * sgn(h_tgt - H) clipped to [1, w_max];
    M -= alpha * sgn(h_tgt - H) clipped to [m_min, 1]. A NaN or infinite H changes nothing.
    Defaults are the paper's (O1, P 0.1, W 1.1, M 0.9, H_tgt 0.3, adaptive off).
    """

    variant: Variant = "o1"
    P: float = 0.1
    W: float = 1.1
    M: float = 0.9
    h_tgt: float = 0.3
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    gate: bool = False
    steps: int = 0
    steps_on: int = 0

    def __post_init__(self) -> None:
        self.variant = check_stare_args(self.P, self.variant)  # type: ignore[assignment]

    def update(self, entropy: float) -> bool:
        """Take the batch-mean token entropy H (anything `float()` accepts: a Python, numpy or
        0-dim torch number); return the new gate (a Python bool)."""
        entropy = float(entropy)
        if not math.isfinite(entropy):
            return self.gate
        self.steps += 1
        self.gate = bool(entropy < self.h_tgt)
        self.steps_on += int(self.gate)
        if self.adaptive:
            sgn = (self.h_tgt > entropy) - (self.h_tgt < entropy)
            self.W = min(max(self.W + self.alpha * sgn, 1.0), self.w_max)
            self.M = min(max(self.M - self.alpha * sgn, self.m_min), 1.0)
        return self.gate

    def weights(self, adv: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
        """stare_token_weights with the current state. Shapes as there."""
        return stare_token_weights(
            adv, old_log_prob, mask, P=self.P, W=self.W, M=self.M, variant=self.variant, gate=self.gate
        )

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            if not hasattr(self, k):
                raise KeyError(f"unknown StareController state key '{k}'")
            setattr(self, k, v)
