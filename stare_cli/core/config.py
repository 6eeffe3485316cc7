"""The recipe schema: one typed, documented, constrained and defaulted field for every knob.

A recipe fixes model, data, lengths, batch and sampling; `method` is the axis that changes between
the rows of a comparison. Loading (includes, overrides, located errors) lives in `recipes.py`.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator


class _Strict(BaseModel):
    # Unknown keys are errors (reported with file and closest key by recipes.py). Scalars are strict:
    # `total_steps: true` or `lr: "1e-6"` is an error, not 1 or a parsed string (floats accept ints).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class PromptTemplate(str, Enum):
    paper = "paper"  # problem + instruction as one user turn through the chat template
    plain = "plain"  # plain completion, for base models without a chat template
    r1 = "r1"  # DeepSeek-R1 style: think in <think> ... </think>, then answer
    raw = "raw"  # the problem text and a newline, nothing added (the CPU toy)
    short = "short"  # problem + "Answer with a single number." as one user turn (small real models)


class ModelConfig(_Strict):
    path: str = Field(
        "toy:arith",
        description="Hugging Face hub id, local directory, or 'toy:<task>' for the built-in CPU toy "
        "(made and cached on first use).",
        min_length=1,
    )
    dtype: Dtype = Field(Dtype.float32, description="Weights dtype of the rollout engine (vLLM); training keeps fp32 "
                         "master weights and computes in optim.precision.")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="'auto' uses the tokenizer's chat template when it has one; 'none' never."
    )
    trust_remote_code: StrictBool = Field(False, description="Allow model code from the hub. Off for safety.")


class DataConfig(_Strict):
    train: str = Field(
        "toy:arith",
        description="Training prompts: hub dataset id, local .jsonl/.parquet file, or 'toy:<task>'.",
        min_length=1,
    )
    split: str = Field("train", description="Split, for hub datasets.")
    subset: Optional[str] = Field(None, description="Configuration (subset) name, for hub datasets that have several.")
    prompt_field: str = Field("problem", description="Field holding the problem text.")
    answer_field: str = Field("answer", description="Field holding the ground-truth answer.")
    template: PromptTemplate = Field(PromptTemplate.paper, description="How a problem becomes a prompt.")
    max_samples: Optional[StrictInt] = Field(None, ge=1, description="Use only the first N rows (None: all).")
    shuffle: StrictBool = Field(True, description="Shuffle prompts each epoch (seeded).")


class ToolsConfig(_Strict):
    enable: StrictBool = Field(False, description="Multi-turn rollouts with a Python code-interpreter tool.")
    format: Literal["markdown", "xml", "hermes"] = Field(
        "markdown", description="Tool-call protocol: ```python ...``` blocks, <code>...</code>, or hermes "
        "<tool_call>{json}</tool_call> with the chat template's tool turns (the one verl runs; needs a chat template).")
    system_prompt: Optional[str] = Field(None, description="What tells the model about the tool; None: the protocol's "
                                         "own (hermes: the chat template's tools section); '': nothing.")
    max_turns: StrictInt = Field(4, ge=1, le=64, description="Tool calls per response at most.")
    cpu_s: StrictInt = Field(5, ge=1, description="CPU seconds per tool call.")
    wall_s: StrictFloat = Field(10.0, gt=0, description="Wall-clock seconds per tool call.")
    memory_mb: StrictInt = Field(512, ge=32, description="Memory limit of one tool call in MB: the call as a whole (a memory cgroup, swap "
                                   "included) where one can be made, as root typically; else each process's address "
                                   "space (docs/guide/reliability.md, sandbox).")
    output_bytes: StrictInt = Field(1024, ge=64, description="Observation size limit (truncated beyond).")
    file_mb: StrictInt = Field(16, ge=1, le=1024, description="Largest file a call may write, and the size of each of "
                               "its private tmpfs (/tmp, HOME, /dev/shm).")
    nproc: StrictInt = Field(32, ge=1, le=4096, description="Processes and threads per call (counted in its namespace).")
    python: Optional[str] = Field(None, description="Interpreter the code runs with (its installation is mounted "
                                  "read-only); None: the one running stare, which has numpy and sympy.")
    unsafe_no_isolation: StrictBool = Field(False, description="Run tool code WITHOUT the namespace sandbox (resource "
                                            "limits only; warned on every start). Only for code you trust, on machines "
                                            "without user namespaces.")


# Ceilings no real run approaches, so that a typo (10**12) fails at once instead of hanging: no model's
# context holds a million tokens of one row, no group or batch needs a million rows on one trainer.
MAX_TOKENS = 1_048_576
MAX_GROUP = 4096
MAX_BATCH = 1_000_000


class RolloutConfig(_Strict):
    n: StrictInt = Field(8, ge=1, le=MAX_GROUP, description="Responses sampled per prompt (the GRPO group size; at "
                         "least 2, since every method's advantage is relative to its group).")
    temperature: StrictFloat = Field(1.0, gt=0, le=10, description="Sampling temperature.")

    @field_validator("n")
    @classmethod
    def _a_group(cls, n: int) -> int:
        if n < 2:  # (r - mean r) over a group of one is 0: every advantage, hence every update, would be zero
            raise ValueError(f"{n} response per prompt: every method here normalises rewards within the prompt's "
                             "group (GRPO / Dr.GRPO), so a group of 1 has advantage 0 everywhere; use at least 2")
        return n
    top_p: StrictFloat = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: StrictInt = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_prompt_tokens: StrictInt = Field(1024, ge=1, le=MAX_TOKENS, description="Prompts longer than this are left-truncated.")
    max_response_tokens: StrictInt = Field(3072, ge=1, le=MAX_TOKENS, description="Generation stops here (then 'truncated').")
    gen_batch_size: StrictInt = Field(
        64, ge=1, le=MAX_BATCH, description="Prompts drawn per generation batch with dynamic sampling (several may be drawn); "
        "without it a step draws optim.train_batch_size prompts."
    )
    refill: Literal["gen_batches", "per_group"] = Field(
        "gen_batches", description="How dynamic sampling fills the train batch: 'gen_batches' draws gen_batch_size "
        "prompts at a time, at most max_gen_batches times, and trains on the first train_batch_size kept groups (the "
        "official trainer); 'per_group' draws one fresh prompt per dropped group until the batch is full, with no cap "
        "(verl 0.9's V1 replay buffer; gen_batch_size, max_gen_batches and on_short_batch unused)."
    )
    max_gen_batches: StrictInt = Field(
        10, ge=1, le=10_000, description="At most this many generation batches per step when dynamic sampling."
    )
    on_short_batch: Literal["error", "train"] = Field(
        "error", description="When max_gen_batches generation batches still leave the train batch short of kept "
        "groups: stop with an error ('error', as the official trainer) or train on the groups kept ('train')."
    )
    truncated: Literal["grade", "zero", "mask"] = Field(
        "grade", description="A response cut at max_response_tokens: graded like any other ('grade', as the official "
        "code), rewarded 0 ('zero'), or left out of the loss ('mask')."
    )
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="Rollout engine: vLLM when installed and a GPU is present, else HF generate."
    )
    vllm_gpu_memory_utilization: StrictFloat = Field(
        0.3, gt=0, le=1, description="Embedded trainer: GPU memory share of the colocated vLLM rollout engine."
    )
    tools: ToolsConfig = Field(default_factory=ToolsConfig)


class OptimConfig(_Strict):
    lr: StrictFloat = Field(1e-6, gt=0, le=1, description="Peak learning rate (AdamW).")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: StrictInt = Field(0, ge=0, description="Linear warmup steps.")
    weight_decay: StrictFloat = Field(0.01, ge=0, allow_inf_nan=False, description="AdamW weight decay.")
    grad_clip: StrictFloat = Field(1.0, gt=0, allow_inf_nan=False, description="Max global gradient norm.")
    train_batch_size: StrictInt = Field(64, ge=1, le=MAX_BATCH, description="Prompts per training step (after dynamic sampling).")
    mini_batch_size: StrictInt = Field(64, ge=1, le=MAX_BATCH, description="Prompts per optimizer update (PPO mini-batch).")
    micro_batch_size: StrictInt = Field(
        8, ge=1, description="Responses per forward/backward (accumulation) when micro_batch_tokens is not set.")
    micro_batch_tokens: Optional[StrictInt] = Field(
        None, ge=1, description="Token budget of one forward/backward (prompt + response tokens), as verl's dynamic "
        "batch size (official runs: 8192): as few micro-batches as fit, rows balanced by workload. STARE's official "
        "scope selects per such micro-batch. None: micro_batch_size responses per micro-batch.")
    loss_layout: Literal["global", "official"] = Field(
        "global", description="How a mini-batch's loss is split and normalised. 'global': micro-batches as verl 0.9.1 "
        "forms them on one rank (as few as fit micro_batch_tokens), every token weighted by 1 / the mini-batch's valid "
        "tokens. 'official': the official run's layout (verl 0.7 legacy worker), emulated on any hardware: the batch "
        "balanced over optim.official_ranks ranks (trainer.balance_batch), per rank ceil(tokens / micro_batch_tokens) "
        "micro-batches (the count maxed over ranks; a micro-batch may exceed the budget), each micro-batch's loss "
        "normalised by its own tokens and scaled by its share of the rank's rows, averaged over ranks. STARE's "
        "official scope selects per such micro-batch.")
    official_ranks: StrictInt = Field(
        16, ge=1, le=4096, description="Data-parallel ranks emulated under loss_layout 'official' (the official runs: "
        "2 nodes x 8 GPUs = 16); a mini-batch's responses must divide by it.")
    ppo_epochs: StrictInt = Field(1, ge=1, description="Passes over each training batch.")
    total_steps: StrictInt = Field(500, ge=1, le=10_000_000, description="Training steps.")
    seed: StrictInt = Field(1, ge=0, description="Seed for data order, sampling and init.")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Autocast precision for training.")

    @model_validator(mode="after")
    def _batches(self) -> "OptimConfig":
        if self.mini_batch_size > self.train_batch_size:
            raise ValueError(
                f"optim.mini_batch_size ({self.mini_batch_size}) must be <= optim.train_batch_size "
                f"({self.train_batch_size})"
            )
        if self.train_batch_size % self.mini_batch_size:
            raise ValueError(
                f"optim.train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"optim.mini_batch_size ({self.mini_batch_size})"
            )
        return self


class StareConfig(_Strict):
    P: StrictFloat = Field(0.1, ge=0, le=1, description="Fraction of T+ (and T-) selected by surprisal.")
    W: StrictFloat = Field(1.1, gt=0, description="Weight on L+ (high-surprisal positive-advantage tokens).")
    M: StrictFloat = Field(0.9, gt=0, description="Weight on L- (variant C2 only).")
    h_tgt: StrictFloat = Field(0.3, ge=0, description="Entropy target: the gate is on while batch entropy < h_tgt.")
    adaptive: StrictBool = Field(False, description="Adapt W and M by alpha * sgn(h_tgt - H) each step.")
    alpha: StrictFloat = Field(0.01, ge=0, description="Adaptive step size.")
    w_max: StrictFloat = Field(1.5, ge=1, description="Upper bound for adaptive W.")
    m_min: StrictFloat = Field(0.5, gt=0, le=1, description="Lower bound for adaptive M.")
    scope: Literal["official", "batch"] = Field(
        "official",
        description="'official': select L+/L- inside each loss call (one micro-batch, see optim.micro_batch_tokens) on "
        "the current policy's log-probs, as the official code; 'batch': once over the whole training batch on the "
        "rollout's log-probs.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> "StareConfig":
        if self.adaptive and self.W > self.w_max:
            raise ValueError(f"method.stare.W ({self.W}) exceeds method.stare.w_max ({self.w_max})")
        if self.adaptive and self.M < self.m_min:
            raise ValueError(f"method.stare.M ({self.M}) is below method.stare.m_min ({self.m_min})")
        return self


class OverlongConfig(_Strict):
    enable: StrictBool = Field(False, description="DAPO overlong reward shaping.")
    buffer: StrictInt = Field(512, ge=1, description="L_buf: the penalty ramps over the last buffer tokens.")
    factor: StrictFloat = Field(1.0, ge=0, description="Penalty at the maximum length.")


class ClipCovConfig(_Strict):
    ratio: StrictFloat = Field(0.0002, gt=0, le=1, description="Share of tokens whose gradient is detached (verl default).")
    cov_lb: StrictFloat = Field(1.0, description="Lower covariance bound (verl default).")
    cov_ub: StrictFloat = Field(5.0, description="Upper covariance bound (verl default).")


class KLCovConfig(_Strict):
    ratio: StrictFloat = Field(0.002, gt=0, le=1, description="Share of tokens with the KL penalty (published 7B value).")
    coef: StrictFloat = Field(1.0, ge=0, description="KL penalty coefficient (published 7B value).")


class StapoConfig(_Strict):
    tau_p: StrictFloat = Field(0.01, gt=0, le=1, description="STAPO: a positive-advantage token is spurious when its "
                               "probability under the rollout policy is below tau_p (paper: 0.01) and ...")
    tau_h_quantile: StrictFloat = Field(
        0.05, ge=0, le=1, description="... its entropy is below this quantile of the batch's valid-token entropies "
        "(paper: the 5th percentile, 0.05). Spurious tokens leave the loss mask.")


class RsiConfig(_Strict):
    low: Optional[StrictFloat] = Field(
        None, ge=0, description="RSI-S (arXiv 2606.31575): the lower end of the kept interval of the relative surprisal "
        "index -log pi(o_t) / H_t (tokens below it are redundant). No default: the paper's value could not be read; "
        "the rsi-s method needs both ends set. Under the policy's own sampling RSI centres on 1.")
    high: Optional[StrictFloat] = Field(
        None, gt=0, description="... the upper end (tokens above it are the unstable high-surprisal tail); > low.")


class CovAnnealConfig(_Strict):
    schedule: Literal["none", "linear", "cosine"] = Field(
        "none", description="Anneal Clip-Cov's detached share (clip_cov.ratio) and KL-Cov's coefficient (kl_cov.coef) "
        "by a factor from 1 at step 1 to `end` at step `steps` (arXiv 2604.09676: unbiased only when annealed). "
        "Only clip-cov and kl-cov take it.")
    end: StrictFloat = Field(0.0, ge=0, le=1, description="The factor at the end of the annealing (0: off; Clip-Cov "
                             "then detaches no token).")
    steps: Optional[StrictInt] = Field(None, ge=1, description="Steps to anneal over (None: optim.total_steps); the "
                                       "factor stays at `end` after them.")


class AdaptiveEntropyConfig(_Strict):
    enable: StrictBool = Field(False, description="An entropy bonus whose coefficient steers toward `target` "
                               "(Skywork-OR1, arXiv 2505.22312; baselines/entropy_control.py); the adaptive-entropy "
                               "method sets it. Not with STARE, whose gate is the other controller.")
    target: StrictFloat = Field(0.2, gt=0, description="Target token entropy (Skywork-OR1's 7b_8k.sh: 0.2).")
    coef_init: StrictFloat = Field(0.0, ge=0, description="The coefficient at step 1 (the released scripts' "
                                   "actor.entropy_coeff: 0.0).")
    coef_min: StrictFloat = Field(0.0, ge=0, description="Lower clip of the coefficient (7b_8k.sh: 0).")
    coef_max: StrictFloat = Field(0.005, ge=0, description="Upper clip of the coefficient (7b_8k.sh: 0.005).")
    delta: StrictFloat = Field(1e-4, gt=0, description="Step of the coefficient per training step, up while the "
                               "entropy is below the target, down otherwise (7b_8k.sh: 0.0001).")

    @model_validator(mode="after")
    def _ordered(self) -> "AdaptiveEntropyConfig":
        if not self.coef_min <= self.coef_init <= self.coef_max:
            raise ValueError(f"method.adaptive_entropy: coef_min <= coef_init <= coef_max must hold "
                             f"({self.coef_min}, {self.coef_init}, {self.coef_max})")
        return self


class GSPOConfig(_Strict):
    clip_low: StrictFloat = Field(3e-4, gt=0, description="Sequence-ratio clip below 1 (GSPO paper).")
    clip_high: StrictFloat = Field(4e-4, gt=0, description="Sequence-ratio clip above 1 (GSPO paper).")


class EntroAdvConfig(_Strict):
    alpha: StrictFloat = Field(0.4, ge=0, description="Entropy bonus scale (arXiv 2506.14758).")
    kappa: StrictFloat = Field(2.0, gt=0, description="The bonus is at most |A| / kappa.")


def key_value(config: BaseModel, key: str, prefix: str = ""):
    """The value of the dotted recipe key `key` in `config`, the recipe or (with `prefix` 'method.') its method
    section: key_value(recipe, 'method.rsi.low') is recipe.method.rsi.low."""
    obj = config
    for part in key.removeprefix(prefix).split("."):
        obj = getattr(obj, part)
    return obj


class MethodConfig(_Strict):
    name: str = Field("grpo-ds", min_length=1, description="Registered method; see `stare methods` (checked by the "
                      "method layer, which owns the registry).")
    adv_estimator: Literal["grpo", "drgrpo"] = Field("grpo", description="GRPO (std-normalised) or Dr.GRPO (no std).")
    adv_eps: StrictFloat = Field(1e-6, gt=0, description="eps in (r - mean) / (std + eps).")
    clip_low: StrictFloat = Field(0.2, gt=0, lt=1, description="PPO clip below 1 (epsilon_low).")
    clip_high: StrictFloat = Field(0.28, gt=0, description="PPO clip above 1 (epsilon_high, clip-higher).")
    dual_clip: Optional[StrictFloat] = Field(10.0, gt=1, description="Dual-clip c for negative advantages; None: off.")
    loss_agg: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How token losses become one number (verl 0.9.1's agg_loss modes; token-sum: the "
        "plain sum over the batch's valid tokens, whose gradient grows with the batch: scale optim.lr down with it)."
    )
    dynamic_sampling: StrictBool = Field(True, description="Drop groups whose rewards are all equal (DAPO).")
    entropy_coef: StrictFloat = Field(0.0, ge=0, description="Entropy bonus coefficient (entropy regularisation).")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    stare: StareConfig = Field(default_factory=StareConfig)
    clip_cov: ClipCovConfig = Field(default_factory=ClipCovConfig)
    kl_cov: KLCovConfig = Field(default_factory=KLCovConfig)
    cov_anneal: CovAnnealConfig = Field(default_factory=CovAnnealConfig)
    stapo: StapoConfig = Field(default_factory=StapoConfig)
    rsi: RsiConfig = Field(default_factory=RsiConfig)
    gspo: GSPOConfig = Field(default_factory=GSPOConfig)
    entro_adv: EntroAdvConfig = Field(default_factory=EntroAdvConfig)
    adaptive_entropy: AdaptiveEntropyConfig = Field(default_factory=AdaptiveEntropyConfig)
    top_entropy_frac: StrictFloat = Field(0.2, gt=0, le=1, description="80/20: share of highest-entropy tokens trained.")
    w_reinforce_lambda: StrictFloat = Field(0.1, ge=0, description="W-REINFORCE weight of positive samples.")

    @model_validator(mode="after")
    def _anneal_only_for_covariance(self) -> "MethodConfig":
        from baselines.registry import METHODS

        spec = METHODS.get(self.name.strip().lower())
        if self.cov_anneal.schedule != "none" and spec is not None and spec.loss not in ("clip_cov", "kl_cov"):
            raise ValueError(f"method.cov_anneal.schedule ({self.cov_anneal.schedule!r}) anneals Clip-Cov and KL-Cov "
                             f"only; method {spec.name} does not read it (set it to 'none')")
        missing = [k for k in (spec.required if spec is not None else ()) if key_value(self, k, 'method.') is None]
        if missing:
            from baselines.registry import required_hint

            raise ValueError(f"{' / '.join(missing)}: {spec.name} needs {'them' if len(missing) > 1 else 'it'} and has "
                             f"no default ({required_hint(spec)})")
        lo, hi = self.rsi.low, self.rsi.high
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"method.rsi: low < high must hold ({lo}, {hi})")
        if self.adaptive_entropy.enable and spec is not None and spec.stare:
            raise ValueError(f"method.adaptive_entropy.enable: {spec.name} has its own entropy controller (STARE's "
                             "gate at method.stare.h_tgt); use the adaptive-entropy method, or set it to false")
        return self


class RewardConfig(_Strict):
    fn: Literal["math-verify", "math-verify-final", "stare-official", "stare-official-3way"] = Field(
        "math-verify", description="Training reward: 'math-verify' (our grader on the final \\boxed{}, 1/0); "
        "'math-verify-final' (our grader on the final answer however written: the final box, else a stated answer, "
        "inline math or the last number; for small models that do not box); "
        "'stare-official' (the official STARE accuracy as its reward loop ran it: mathruler on the official answer "
        "extraction); 'stare-official-3way' (the official accuracy as written: math-verify twice or mathruler). "
        "Dynamic sampling filters on this accuracy.")
    format_penalty: StrictBool = Field(
        False, description="Reward -1 when the official format check fails (the official code's `score` field; its "
        "reward managers train on the accuracy instead, so the paper recipes leave this off).")
    timeout_s: StrictInt = Field(5, ge=1, le=60, description="Time limit of each math-verify parse/verify call, in seconds.")


class EvalConfig(_Strict):
    benchmarks: list[str] = Field(default_factory=list, description="Benchmarks evaluated during training.")
    n: Optional[StrictInt] = Field(None, ge=1, le=MAX_GROUP, description="Samples per problem (None: each benchmark's paper protocol).")
    temperature: Optional[StrictFloat] = Field(None, gt=0, description="Sampling temperature (None: each benchmark's protocol; paper 1.0).")
    top_p: Optional[StrictFloat] = Field(None, gt=0, le=1, description="Nucleus mass (None: each benchmark's protocol; paper 0.7).")
    max_tokens: Optional[StrictInt] = Field(None, ge=1, le=MAX_TOKENS, description="Max new tokens (None: rollout.max_response_tokens).")
    every: StrictInt = Field(0, ge=0, description="Evaluate every k steps (0: only at the end).")
    at_start: StrictBool = Field(True, description="Also evaluate before the first step (step 0: the starting point "
                                 "of every evaluation curve; verl: trainer.val_before_train).")
    limit: Optional[StrictInt] = Field(None, ge=1, description="Evaluate only the first K problems of each benchmark.")


class EmbeddedBackend(_Strict):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available.")
    threads: StrictInt = Field(1, ge=1, description="torch threads; one is steadiest on a busy 2-core machine.")
    length_buckets: StrictBool = Field(
        True, description="Run each training forward in length-sorted buckets, each padded only to its own "
        "longest row (the same numbers with less padding; false: one forward per micro-batch).")
    share_prompts: Union[Literal["auto"], StrictBool] = Field(
        "auto", description="Training forwards run each distinct prompt once for all its responses (the same "
        "values up to float rounding; toy: 18% less forward/backward time). auto: true on the CPU, false on CUDA, where "
        "the responses' forward would need an explicit attention mask (no flash kernel) and it is unmeasured.")
    lm_head: Literal["auto", "chunked", "full"] = Field(
        "auto", description="Training forwards: 'chunked' computes log-probs and entropies from the last hidden "
        "state on response positions only, a chunk of positions at a time, forward and backward (no [positions x "
        "vocabulary] tensor for the whole micro-batch; the same values up to float32 rounding) where the "
        "architecture's logits are plainly lm_head(hidden) (stare_cli/backends/lm_head.py), else 'full'; 'full': "
        "the model's own logits; 'auto': chunked from a vocabulary of 4,096 tokens on (every real model), full "
        "below (the toys, whose numbers in docs/ were made with it).")
    lean_activations: Union[Literal["auto"], StrictBool] = Field(
        "auto", description="Llama-family models (llama, qwen2, qwen3, mistral; SiLU MLP), fp32 compute: the MLP "
        "keeps gate(x) and up(x) and recomputes SiLU and the product in backward, each RMSNorm keeps its input and "
        "1/rms (stare_cli/backends/lean_activations.py): the same forward bits, the MLP's gradients bit for bit, "
        "the norms' gradients up to the order of one three-term sum; SmolLM2: 38% fewer activation bytes per "
        "token. 'auto': on from a vocabulary of 4,096 tokens (every real model), off for the toys (whose numbers "
        "in docs/ were made without it); true / false: on / off; ignored under autocast (bf16/fp16).")
    fused_old_pass: StrictBool = Field(
        True, description="Where the weights cannot change between pi_old's pass and the training forwards (one "
        "mini-batch, one PPO epoch), take pi_old's log-probs and token entropies from the training forwards "
        "themselves (detached) instead of a separate no-grad forward: the same numbers, one forward per micro-batch "
        "fewer. With several micro-batches it needs a method whose batch transform does not read them (not "
        "top-entropy, STAPO, RSI-S or batch-scope STARE); the step's controller state (STARE's gate, adaptive W/M) "
        "is then predicted from the first micro-batch's entropy and, where the batch's H decides otherwise, the "
        "micro-batches run again with the right one (metric fused/rerun). false: always the separate pass.")
    heap: Literal["auto", "mapped", "glibc"] = Field(
        "auto", description="On the CPU with glibc: 'mapped' maps every block from 128 KiB on by itself during "
        "the training phase (old pass and updates; mallopt M_MMAP_THRESHOLD), so a freed activation leaves the "
        "process at once, and keeps blocks under 32 MiB in the heap during the rollout: on the real-model recipe "
        "1.2 GiB lower with one micro-batch, 0.4-0.6 GiB with several, at 25-45% more training time (page faults); "
        "'glibc': glibc's default, whose threshold rises with the blocks freed (up to 32 MiB) and keeps them in the "
        "heap; 'auto': glibc's, because halving optim.micro_batch_size saves as much memory for less than half "
        "the extra time (measured). The numbers computed are the same (docs/guide/memory.md).")
    activation_checkpointing: StrictBool = Field(
        False, description="Keep only each decoder layer's input for the backward pass and recompute the rest "
        "(transformers' gradient checkpointing): activation memory per micro-batch drops by about the layer's "
        "width factor, at the cost of one more forward (about a third more compute per training step).")


class VerlBackend(_Strict):
    nnodes: StrictInt = Field(1, ge=1, description="Nodes in the Ray cluster.")
    n_gpus_per_node: StrictInt = Field(8, ge=1, description="GPUs per node.")
    tensor_parallel_size: StrictInt = Field(1, ge=1, description="vLLM rollout tensor parallel size.")
    gpu_memory_utilization: StrictFloat = Field(0.6, gt=0, le=1, description="vLLM share of GPU memory.")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cpu: the debug path (docs/guide/backends.md).")
    shared_dir: Optional[str] = Field(
        None, description="Absolute directory every node of the cluster sees (NFS, ...): `--emit-script` puts the run "
        "directory, data, checkpoints and tools file under it.")
    extra_overrides: list[str] = Field(
        default_factory=list,
        description="Hydra overrides of verl's ppo_trainer appended verbatim (KEY=VALUE, `+KEY=VALUE` to add "
        "a key); they win over the generated ones except the CPU path's.",
    )

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"must be an absolute path, got {v!r}")
        return v

    @field_validator("extra_overrides")
    @classmethod
    def _key_value(cls, v: list[str]) -> list[str]:
        bad = [o for o in v if "=" not in o or o.startswith("=")]
        if bad:
            raise ValueError(f"not KEY=VALUE: {bad[0]!r}")
        return v


class BackendConfig(_Strict):
    name: Literal["embedded", "verl"] = Field("embedded", description="Training backend.")
    embedded: EmbeddedBackend = Field(default_factory=EmbeddedBackend)
    verl: VerlBackend = Field(default_factory=VerlBackend)


class LoggingConfig(_Strict):
    wandb: Literal["offline", "online", "disabled"] = Field("offline", description="wandb mode.")
    project: str = Field("stare", min_length=1, max_length=200, description="wandb project (verl: also a part of its "
                         "checkpoint path, so checked like run_name).")
    run_name: Optional[str] = Field(None, min_length=1, max_length=200,
                                    description="Run name (default: the run directory name). verl puts it into its "
                                    "checkpoint path, so it is one path part: no '/' or '\\', not '.' or '..'.")

    @field_validator("project", "run_name")
    @classmethod
    def _one_path_part(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and (name in (".", "..") or any(c in name for c in "/\\") or not name.isprintable()):
            raise ValueError(f"{name!r} is not one plain path part (verl writes checkpoints under it): "
                             "no '/', '\\' or control characters, not '.' or '..'")
        return name

    reflection_words: list[str] = Field(
        default_factory=lambda: ["wait", "verify", "check", "recheck", "however", "alternatively"],
        description="Words counted for the reflection-word rate.",
    )
    samples_every: StrictInt = Field(10, ge=0, description="Save rollout samples every k steps (0: never).")


class CheckpointConfig(_Strict):
    every: StrictInt = Field(50, ge=0, description="Save every k steps (0: only at the end).")
    keep_last: StrictInt = Field(2, ge=1, description="Checkpoints kept.")


class Recipe(_Strict):
    name: str = Field("custom", description="Recipe name (set from the file path when loaded).")
    description: str = Field("", description="One line on what this recipe is.")
    paper: Optional[str] = Field(None, description="Paper scenario for `stare compare --paper`, e.g. short-cot/qwen2.5-math-7b.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _cross(self) -> "Recipe":
        if (self.method.dynamic_sampling and self.rollout.refill == "gen_batches"
                and self.rollout.gen_batch_size < self.optim.train_batch_size):
            # Dynamic sampling can only fill a train batch from draws at least as large.
            raise ValueError(
                f"rollout.gen_batch_size ({self.rollout.gen_batch_size}) must be >= "
                f"optim.train_batch_size ({self.optim.train_batch_size}) when method.dynamic_sampling is on"
            )
        n_resp = self.optim.mini_batch_size * self.rollout.n
        if n_resp % self.optim.micro_batch_size:
            raise ValueError(
                f"optim.micro_batch_size ({self.optim.micro_batch_size}) must divide the responses of a "
                f"mini-batch (optim.mini_batch_size x rollout.n = {n_resp})"
            )
        row_max = self.rollout.max_prompt_tokens + self.rollout.max_response_tokens
        if self.optim.micro_batch_tokens is not None and self.optim.micro_batch_tokens < row_max:
            raise ValueError(
                f"optim.micro_batch_tokens ({self.optim.micro_batch_tokens}) must hold the longest row: "
                f"rollout.max_prompt_tokens + rollout.max_response_tokens = {row_max}"
            )
        if self.optim.loss_layout == "official":
            if self.optim.micro_batch_tokens is None:
                raise ValueError("optim.loss_layout 'official' emulates the official dynamic micro-batches: set "
                                 "optim.micro_batch_tokens (the official runs: 8192)")
            if n_resp % self.optim.official_ranks:
                raise ValueError(
                    f"optim.official_ranks ({self.optim.official_ranks}) must divide the responses of a mini-batch "
                    f"(optim.mini_batch_size x rollout.n = {n_resp}) under optim.loss_layout 'official'")
            if self.rollout.on_short_batch == "train" and self.method.dynamic_sampling:
                raise ValueError(
                    "rollout.on_short_batch 'train' can leave a batch that does not split over optim.official_ranks "
                    "under optim.loss_layout 'official' (the official trainer stops instead: 'error')")
        if self.method.overlong.enable and self.method.overlong.buffer > self.rollout.max_response_tokens:
            raise ValueError(
                f"method.overlong.buffer ({self.method.overlong.buffer}) exceeds "
                f"rollout.max_response_tokens ({self.rollout.max_response_tokens})"
            )
        return self
