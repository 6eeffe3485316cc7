"""The one registry: method names -> advantage estimator, shaping, sampling, policy loss, defaults.

Every baseline is the GRPO-ds recipe (dynamic sampling, clip 0.2 / 0.28, dual-clip, token-mean)
plus its own change, so that the method is the only axis between rows of a comparison; the
exceptions are stated per method (`grpo` drops dynamic sampling and clip-higher, `w-reinforce`
uses its own advantages without dynamic sampling). A method's `defaults` are recipe keys that define
it; they are applied over the recipe file and under `-o` overrides (by the method layer,
stare_cli/method/layer.py, which joins this registry to the recipe schema and owns the loss dispatch).
Pure data: nothing here imports the CLI, the benchmarks or a backend.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


AdvName = Literal["grpo", "w_reinforce"]
LossName = Literal["ppo_clip", "gspo", "clip_cov", "kl_cov"]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    title: str  # the row name in the paper's Table 2 (or, for a method after the paper, the name it goes by)
    reference: str
    summary: str
    advantage: AdvName = "grpo"
    loss: LossName = "ppo_clip"
    stare: Optional[Literal["o1", "c2"]] = None
    entro_adv: bool = False
    top_entropy: bool = False
    stapo: bool = False  # STAPO's spurious-token mask (baselines/token_filters.py)
    cov_kernel: bool = False  # covariance-aware Gaussian-kernel token weights (baselines/token_filters.py)
    rsi: bool = False  # RSI-S's relative-surprisal interval filter (baselines/token_filters.py)
    in_table2: bool = True  # False: published after the paper, so no Table 2 row to compare with
    # recipe keys the method reads that have no default (None in the schema): a recipe or override must set
    # them; `required_why` says why there is no default and `required_example` gives overrides that set them
    # (both shown when they are missing)
    required: tuple[str, ...] = ()
    required_why: str = ""
    required_example: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)


_DS = {  # the GRPO-ds recipe every baseline shares
    "method.dynamic_sampling": True,
    "method.clip_low": 0.2,
    "method.clip_high": 0.28,
    "method.overlong.enable": False,
    "method.entropy_coef": 0.0,
    "method.adaptive_entropy.enable": False,
    "method.adv_estimator": "grpo",
}


def required_hint(spec: "MethodSpec") -> str:
    """Why `spec`'s required keys have no default, and overrides that set them (for an error or a note)."""
    return f"{spec.required_why}; for example {' '.join('-o ' + e for e in spec.required_example)}"


def _ds(**extra: Any) -> dict[str, Any]:
    return {**_DS, **{k.replace("__", "."): v for k, v in extra.items()}}


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in [
        MethodSpec(
            "grpo", "GRPO", "arXiv 2402.03300", "GRPO: group-normalised advantages, symmetric clip 0.2, no dynamic sampling",
            defaults=_ds(method__dynamic_sampling=False, method__clip_high=0.2),
        ),
        MethodSpec(
            "grpo-ds", "GRPO-ds", "arXiv 2503.14476 (DAPO), the paper's baseline",
            "GRPO + dynamic sampling + clip-higher 0.28 + token-mean; no overlong shaping",
            defaults=_ds(),
        ),
        MethodSpec(
            "dapo", "DAPO", "arXiv 2503.14476", "GRPO-ds + overlong reward shaping",
            defaults=_ds(method__overlong__enable=True),
        ),
        MethodSpec(
            "entropy-reg", "EntroReg", "entropy regularisation (e.g. arXiv 2505.22617, Sec. 2)",
            "GRPO-ds + entropy bonus: loss -= coef * H (coef 0.001)",
            defaults=_ds(method__entropy_coef=0.001),
        ),
        MethodSpec(
            "clip-cov", "Clip-Cov", "arXiv 2505.22617", "GRPO-ds, detaching random high-covariance tokens",
            loss="clip_cov", defaults=_ds(),
        ),
        MethodSpec(
            "kl-cov", "KL-Cov", "arXiv 2505.22617", "GRPO-ds, KL penalty on the top-covariance tokens",
            loss="kl_cov", defaults=_ds(),
        ),
        MethodSpec(
            "80-20", "80/20 Rule", "arXiv 2506.01939", "GRPO-ds, gradient only on the top-20% entropy tokens",
            top_entropy=True, defaults=_ds(),
        ),
        MethodSpec(
            "entro-adv", "EntroAdv", "arXiv 2506.14758", "GRPO-ds, A' = A + min(alpha H, |A| / kappa)",
            entro_adv=True, defaults=_ds(),
        ),
        MethodSpec(
            "gspo", "GSPO", "arXiv 2507.18071", "GRPO-ds with the sequence-level clipped ratio, seq-mean-token-mean",
            loss="gspo", defaults=_ds(method__loss_agg="seq-mean-token-mean"),
        ),
        MethodSpec(
            "w-reinforce", "W-REINF", "arXiv 2506.01347",
            "REINFORCE with A = lambda (correct) / -1 (wrong), lambda 0.1; no dynamic sampling",
            advantage="w_reinforce", defaults=_ds(method__dynamic_sampling=False),
        ),
        MethodSpec(
            "stapo", "STAPO", "arXiv 2602.15620",
            "GRPO-ds, silencing spurious tokens (A > 0, pi < tau_p 0.01, H < 5th-percentile entropy): masked out "
            "of the loss, which renormalises over the rest",
            stapo=True, in_table2=False, defaults=_ds(),  # tau_p 0.01, tau_h the 5th entropy percentile: the paper (method.stapo.*)
        ),
        MethodSpec(
            "rsi-s", "RSI-S", "arXiv 2606.31575",
            "GRPO-ds, training only on tokens whose relative surprisal index -log pi / H lies between "
            "method.rsi.low and method.rsi.high (no default: the paper's interval was not readable); the others "
            "leave the loss, which renormalises over the rest",
            rsi=True, in_table2=False, defaults=_ds(), required=("method.rsi.low", "method.rsi.high"),
            required_why="the paper's interval could not be read; RSI centres on 1, E[-log pi] = H under the "
                         "policy's own sampling",
            required_example=("method.rsi.low=0.5", "method.rsi.high=2.0"),
        ),
        MethodSpec(
            "cov-kernel", "CovKernel", "arXiv 2605.11538",
            "GRPO-ds, A' = w A with w = exp(-(c - mean c)^2 / (2 var c)) on the centred covariance "
            "c = (log pi - mean)(A - mean): hyperparameter-free",
            cov_kernel=True, in_table2=False, defaults=_ds(),
        ),
        MethodSpec(
            "adaptive-entropy", "AdaptiveEnt", "arXiv 2505.22312 (Skywork-OR1)",
            "GRPO-ds + an entropy bonus alpha H whose coefficient steps by delta toward a target entropy "
            "(on only while H < target; c in [0, 0.005], delta 1e-4, target 0.2)",
            in_table2=False, defaults=_ds(method__adaptive_entropy__enable=True),
        ),
        MethodSpec(
            "stare-o1", "STARE-O1", "arXiv 2606.19236", "GRPO-ds + W on the top-P surprisal tokens of T+ while H < H_tgt",
            stare="o1", defaults=_ds(),
        ),
        MethodSpec(
            "stare-c2", "STARE-C2", "arXiv 2606.19236", "STARE-O1 + M on the top-P surprisal tokens of T-",
            stare="c2", defaults=_ds(),
        ),
    ]
}


class UnknownMethodError(ValueError):
    """An unknown method name; the message lists the valid names with a 'did you mean'."""


def lookup_method(name: str) -> MethodSpec:
    """The spec of `name` (case-insensitive), or UnknownMethodError naming the closest method."""
    key = str(name).strip().lower()
    if key in METHODS:
        return METHODS[key]
    close = difflib.get_close_matches(key, list(METHODS), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise UnknownMethodError(f"unknown method '{name}'{hint}; valid: {', '.join(METHODS)}")
