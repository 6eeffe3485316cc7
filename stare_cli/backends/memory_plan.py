"""The embedded trainer's memory plan (`stare train --dry-run`): what a recipe's training step holds, by
part, before anything is trained.

Parts (bytes):
- weights, gradients: fp32 master weights and their gradients, 4 bytes per parameter each;
- optimizer: AdamW's two fp32 moments, 8 bytes per parameter (from the first optimizer step on);
- compute copy: under bf16/fp16 autocast on CUDA, the half-precision copies of the weights the forward
  caches, 2 bytes per parameter;
- activations: what autograd keeps for the backward pass of the largest micro-batch, per token per layer,
  measured by tracing the trainer's own forward (`token_logprobs_entropy`, with the recipe's activation
  checkpointing, LM head, bucketing and prompt sharing) on a one- and a two-layer copy of the
  architecture at the recipe's widths (the difference is one layer), in the compute dtype; plus one
  layer's worth again for the backward's transient (the recomputed layer under checkpointing);
- logits: the LM head's [positions x vocabulary] float32 tensors at their peak (the chunked head: four
  chunks; the full head: four copies over the micro-batch's response positions);
- rollout: the HF engine's key/value cache for one generation batch (prompts x n rows at full length) and
  a decode step's logits; with vLLM its own share of the GPU instead (rollout.vllm_gpu_memory_utilization);
- runtime: on the CPU, the resident memory of this process once torch and transformers are imported
  (the interpreter, libraries, kernels); on CUDA, the CUDA context is outside torch's allocator and is
  not counted (the plan compares with torch.cuda.max_memory_allocated).

Peak = runtime + weights + gradients + optimizer + compute copy + max(rollout, activations + logits).
The plan counts live tensors. On the CPU the process's resident set also holds freed blocks that glibc's
heap has not returned (the trainer trims it between phases, `release_freed_memory`); docs/guide/memory.md's
measured table says how far the two are apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from stare_cli.core.config import Recipe

GiB = 2**30


@dataclass
class MemoryPlan:
    """A recipe's training step, by part (bytes); `peak` is their combination (module docstring)."""

    device: str
    parameters: int
    micro_batch_tokens: int  # tokens of the largest training micro-batch (prompts and responses)
    response_positions: int  # of which predict response tokens (the LM head's positions)
    weights: int
    gradients: int
    optimizer: int
    compute_copy: int
    activations: int
    logits: int
    rollout: int
    runtime: int
    per_token_layer: int  # activation bytes kept per token per decoder layer
    notes: list[str] = field(default_factory=list)

    @property
    def training(self) -> int:
        return self.activations + self.logits

    @property
    def peak(self) -> int:
        return (self.runtime + self.weights + self.gradients + self.optimizer + self.compute_copy
                + max(self.rollout, self.training))

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GiB:6.2f} GiB"  # noqa: E731
        out = [f"memory plan ({self.device}): {self.parameters / 1e6:.1f}M parameters, largest micro-batch "
               f"{self.micro_batch_tokens:,} tokens ({self.response_positions:,} response positions)",
               f"  runtime (interpreter, libraries)   {g(self.runtime)}",
               f"  weights (fp32 master)              {g(self.weights)}",
               f"  gradients (fp32)                   {g(self.gradients)}",
               f"  optimizer (AdamW moments, fp32)    {g(self.optimizer)}"]
        if self.compute_copy:
            out.append(f"  compute copy (autocast)            {g(self.compute_copy)}")
        out += [f"  activations per micro-batch        {g(self.activations)}  "
                f"({self.per_token_layer:,} bytes per token per layer)",
                f"  logits per micro-batch             {g(self.logits)}",
                f"  rollout (KV cache, decode logits)  {g(self.rollout)}",
                f"  peak                               {g(self.peak)}"]
        return out + [f"  note: {n}" for n in self.notes]


def plan(cfg: Recipe, model_path: str, device: Optional[str] = None, prompt_tokens: Optional[int] = None,
         response_tokens: Optional[int] = None) -> MemoryPlan:
    """The memory plan of `cfg`'s training step for the model at `model_path` (a local folder), with every
    prompt and response at its recipe maximum (rollout.max_prompt_tokens, max_response_tokens: a bound),
    or at the given typical lengths (what a measured run had, to check the plan against it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stare_cli.backends import lm_head

    R, O, E = cfg.rollout, cfg.optim, cfg.backend.embedded
    runtime = _runtime_bytes()  # before the traces below allocate anything
    dev = device or ("cuda" if E.device == "cuda" or (E.device == "auto" and torch.cuda.is_available()) else "cpu")
    mcfg = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(mcfg, trust_remote_code=cfg.model.trust_remote_code)
    n_params = sum(p.numel() for p in meta.parameters())
    vocab = int(meta.get_output_embeddings().weight.shape[0])
    from stare_cli.backends.embedded import AUTO_CHUNK_VOCAB

    chunked = (E.lm_head == "chunked" or (E.lm_head == "auto" and vocab >= AUTO_CHUNK_VOCAB)) and lm_head.supports(meta)
    layers = int(getattr(mcfg, "num_hidden_layers", 1))
    half = O.precision in ("bf16", "fp16") and dev == "cuda"
    from stare_cli.backends.embedded import lean_activations as lean_for

    lean = lean_for(E, meta) and not half  # under autocast the modules keep their own forward
    del meta
    notes = []

    # the largest micro-batch: a token budget, or micro_batch_size rows
    P = prompt_tokens or R.max_prompt_tokens
    T = response_tokens or R.max_response_tokens
    rows_per_mb = min(O.micro_batch_size, O.mini_batch_size * R.n) if O.micro_batch_tokens is None else max(
        1, O.micro_batch_tokens // (P + T))
    mb_tokens = rows_per_mb * (P + T)
    resp_positions = rows_per_mb * T
    # prompt sharing (the CPU's default) runs a group's prompt once: the forward holds U x P + rows x T tokens
    share = ((dev == "cpu") if E.share_prompts == "auto" else E.share_prompts) and not E.activation_checkpointing
    # row-count micro-batches take rows in order, so a group's responses stay together; a token budget's
    # workload-balanced partition (verl's) mixes the groups, so a micro-batch holds up to one response per group
    groups_in = math.ceil(rows_per_mb / R.n) if O.micro_batch_tokens is None else min(rows_per_mb, O.mini_batch_size)
    groups = groups_in if share else rows_per_mb
    kept_tokens = groups * P + rows_per_mb * T

    per_layer, per_layer_full = _activation_bytes_per_token_layer(cfg, model_path, share, half, R.n, lean)
    # what the layers keep, plus the backward's transient: one layer's full activations (the recomputed one
    # under checkpointing) and the gradient of the hidden states
    activations = per_layer * layers * kept_tokens + per_layer_full * kept_tokens
    chunk = lm_head.chunk_positions(vocab)
    logits = 4 * 4 * vocab * (min(chunk, resp_positions) if chunked else resp_positions)
    if not chunked and E.lm_head == "chunked":
        notes.append(f"{mcfg.model_type}: its logits are not plainly lm_head(hidden); the full head runs")

    if prompt_tokens is None and response_tokens is None:
        notes.append(f"lengths: every row planned at its maximum (rollout.max_prompt_tokens {R.max_prompt_tokens} + "
                     f"max_response_tokens {R.max_response_tokens}); a run's rows are shorter, so its peak is lower "
                     "(the real-model recipe's mean lengths, 59 + 42 tokens, gave 5.41 GiB planned for 5.95 measured by default)")
    calls = -(-O.mini_batch_size * R.n // rows_per_mb)
    if calls > 1 or E.activation_checkpointing:
        what = " and ".join(x for x in (f"{calls} micro-batches per mini-batch" if calls > 1 else "",
                                         "activation checkpointing" if E.activation_checkpointing else "") if x)
        notes.append(f"not a bound with {what}: on glibc's heap (backend.embedded.heap: auto) the measured peak of the "
                     "real-model recipe was 26-33% above this plan with several micro-batches and 50-53% above with "
                     "checkpointing; 3-26% with heap: mapped (what glibc's heap keeps of the freed blocks of each "
                     "forward and backward, and the backward's transients beyond the LM head's chunks, are not "
                     "modelled; benchmarks/perf/memory.py and memory_phases.py)")
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    kv_heads = getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads
    gen_rows = max(1, R.gen_batch_size * R.n)
    kv_bytes = 2 if half else 4
    if R.engine == "vllm" or (R.engine == "auto" and dev == "cuda"):  # as choose_hardware picks it (with vLLM installed)
        rollout = 0
        notes.append(f"rollout: vLLM (rollout.engine {R.engine} on CUDA) holds rollout.vllm_gpu_memory_utilization = "
                     f"{R.vllm_gpu_memory_utilization} of the GPU besides this plan")
    else:
        rollout = (gen_rows * (P + T) * layers * 2 * kv_heads * head_dim * kv_bytes
                   + 3 * gen_rows * vocab * 4)
    return MemoryPlan(
        device=dev, parameters=n_params, micro_batch_tokens=mb_tokens, response_positions=resp_positions,
        weights=4 * n_params, gradients=4 * n_params, optimizer=8 * n_params,
        compute_copy=2 * n_params if half else 0, activations=activations, logits=logits, rollout=rollout,
        runtime=runtime if dev == "cpu" else 0, per_token_layer=per_layer, notes=notes)


def _runtime_bytes() -> int:
    """This process's resident memory now (torch and transformers imported): what any trainer holds before
    its first tensor."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _activation_bytes_per_token_layer(cfg: Recipe, model_path: str, share: bool, half: bool,
                                     n: int, lean: bool = False) -> tuple[int, int]:
    """(bytes autograd keeps per token per decoder layer under the recipe's settings, the same without
    activation checkpointing), traced: the trainer's forward on a one- and a two-layer copy of the
    architecture (random weights, a 64-token vocabulary: the LM head is planned apart) on the CPU, in the
    compute dtype; the difference of what the two keep is one layer, and its growth from 16 to 32 tokens
    per prompt and response is the per-token part. Tokens are counted as the forward runs them: with
    prompt sharing, each group's prompt once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.generation.engines import Sample
    from stare_cli.backends import lean_activations
    from stare_cli.backends.forward import pack, token_logprobs_entropy

    E = cfg.backend.embedded
    rows = 4
    per_group = min(rows, n) if share else 1

    def kept(n_layers: int, ckpt: bool, prompt: int, resp: int) -> int:
        c = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
        c.num_hidden_layers = n_layers
        c.vocab_size = 64
        if hasattr(c, "layer_types") and c.layer_types:
            c.layer_types = list(c.layer_types)[:n_layers]
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(c, trust_remote_code=cfg.model.trust_remote_code).float()
        m.train()
        if lean:  # as the trainer applies it (the 64-token copy's vocabulary would say 'off' under 'auto')
            lean_activations.apply(m)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        samples = [Sample(text="", prompt_ids=[3 + ((i + r // per_group) % 50) for i in range(prompt)],
                          response_ids=[5 + ((i * 7 + r) % 50) for i in range(resp)]) for r in range(rows)]
        batch = pack(samples, 0, "cpu")
        seen: dict[int, int] = {}

        def pack_hook(x):
            st = x.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            return x

        auto = torch.autocast("cpu", dtype=torch.bfloat16) if half else _null()
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda x: x), auto:
            token_logprobs_entropy(m, batch, list(range(rows)), 1.0, buckets=E.length_buckets,
                                   share_prompts=share and not ckpt, chunked_head=None if E.lm_head != "full" else False)
        return sum(seen.values())

    def tokens(shared: bool, prompt: int, resp: int) -> int:
        return (math.ceil(rows / per_group) if shared else rows) * prompt + rows * resp

    def slope(ckpt: bool) -> int:
        """One layer's bytes per token: (two layers - one) at 32 and at 16 tokens per part, differenced, so
        that what does not grow with tokens (autocast's weight copies) cancels."""
        shared = share and not ckpt
        big = kept(2, ckpt, 32, 32) - kept(1, ckpt, 32, 32)
        small = kept(2, ckpt, 16, 16) - kept(1, ckpt, 16, 16)
        return max(0, big - small) // (tokens(shared, 32, 32) - tokens(shared, 16, 16))

    full = slope(False)
    return (slope(True) if E.activation_checkpointing else full), full


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def check_fits(p: MemoryPlan) -> Optional[str]:
    """A warning when the plan's peak exceeds what this machine has (CPU: MemAvailable; CUDA: the device's
    free memory), else None."""
    try:
        if p.device == "cpu":
            with open("/proc/meminfo") as f:
                avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        else:
            import torch

            avail = torch.cuda.mem_get_info()[0]
    except Exception:  # no /proc/meminfo, or no CUDA in this torch: nothing to compare with
        return None
    if p.peak > avail:
        return (f"the planned peak ({p.peak / GiB:.1f} GiB) exceeds the memory available here "
                f"({avail / GiB:.1f} GiB): set optim.micro_batch_tokens, backend.embedded.activation_checkpointing")
    return None


@dataclass
class TypicalLengths:
    """The lengths a recipe's rows have in practice: the mean prompt (tokens, as the trainer builds it) of
    its first training prompts, and the mean response of its newest run where one exists."""

    prompt_tokens: Optional[float]  # None: the training prompts or the tokenizer cannot be read here (`why`)
    prompts: int  # how many prompts the mean is over
    response_tokens: Optional[float]  # None: no run of the recipe with a response length logged
    run_dir: Optional[str] = None
    steps: int = 0  # metrics rows the response mean is over
    why: str = ""


def mean_prompt_tokens(cfg: Recipe, model_path: str, k: int = 64) -> tuple[float, int]:
    """(mean tokens, count) of the recipe's first k training prompts as the trainer builds them (template,
    chat template, capped at rollout.max_prompt_tokens)."""
    from benchmarks.data.prompts import load_prompts
    from benchmarks.generation.engines import load_tokenizer
    from benchmarks.generation.templates import build_prompt

    tok = load_tokenizer(model_path)
    rows = load_prompts(cfg)[:k]
    use_chat = cfg.model.chat_template == "auto"
    lens = [min(len(tok(build_prompt(r["problem"], cfg.data.template.value, tok, use_chat, None),
                        add_special_tokens=False)["input_ids"]), cfg.rollout.max_prompt_tokens) for r in rows]
    return (sum(lens) / len(lens), len(lens)) if lens else (float(cfg.rollout.max_prompt_tokens), 0)


def typical_lengths(cfg: Recipe, model_path: str, runs_root) -> TypicalLengths:
    """The recipe's mean prompt length, and the mean response length (`len/mean` over its metrics rows) of
    the newest run of the same recipe and model under `runs_root` (a folder of run directories), if any."""
    from pathlib import Path

    import yaml

    from stare_cli.core.runs import read_jsonl, run_name
    from stare_kernel.errors import StareError

    try:
        P, n = mean_prompt_tokens(cfg, model_path)
    except (StareError, OSError, ValueError) as e:  # a hub dataset offline, a folder with only config.json
        return TypicalLengths(None, 0, None, why=str(e).splitlines()[0][:200])
    root = Path(runs_root)
    if not cfg.name or not root.is_dir():  # no runs, or a recipe without a name (its runs are not told apart)
        return TypicalLengths(P, n, None)
    prefix = run_name(cfg).split("__")[0] + "__"  # the recipe's part of a run directory's name
    found = []
    for d in root.glob(prefix + "*"):
        metrics = d / "metrics.jsonl"
        if not metrics.is_file():
            continue
        try:
            if (yaml.safe_load((d / "config.yaml").read_text()) or {}).get("model", {}).get("path") != cfg.model.path:
                continue
            rows = read_jsonl(metrics)  # the runs' own reader: a torn last line is skipped
        except (OSError, ValueError, AttributeError, yaml.YAMLError, StareError):
            continue  # a damaged or foreign folder: not a run to read lengths from
        lens = [float(r["len/mean"]) for r in rows if "len/mean" in r]
        if lens:
            found.append((metrics.stat().st_mtime, str(d), sum(lens) / len(lens), len(lens)))
    if not found:
        return TypicalLengths(P, n, None)
    _, d, T, steps = max(found)
    return TypicalLengths(P, n, T, d, steps)


def typical_line(cfg: Recipe, model_path: str, runs_root, at_maxima: MemoryPlan) -> str:
    """`--dry-run`'s line for the plan at the recipe's typical lengths (typical_lengths): where a run exists,
    the peak at its mean lengths; otherwise what is known (the prompts') and that no run was found.
    `at_maxima` is the plan just printed: its runtime is this process's before any trace ran, which a
    second plan in the same process would measure after the first one's traces."""
    from dataclasses import replace

    t = typical_lengths(cfg, model_path, runs_root)
    if t.prompt_tokens is None:  # the plan above stands; --dry-run never fails for want of the data
        return (f"  at measured lengths: not planned, the training prompts cannot be measured here ({t.why}); "
                "the peak above is at the maxima")
    if t.response_tokens is None:
        return (f"  at measured lengths: no run of {cfg.name or 'this recipe'} under {runs_root} to read response "
                f"lengths from (prompts: {t.prompt_tokens:.1f} tokens, the mean of the first {t.prompts}); the "
                "peak above is at the maxima")
    p = replace(plan(cfg, model_path, device=at_maxima.device, prompt_tokens=max(1, round(t.prompt_tokens)),
                     response_tokens=max(1, round(t.response_tokens))), runtime=at_maxima.runtime)
    return (f"  at measured lengths: peak {p.peak / GiB:.2f} GiB (prompts {t.prompt_tokens:.1f} tokens, the mean "
            f"of the first {t.prompts}; responses {t.response_tokens:.1f}, the mean over {t.steps} steps of "
            f"{t.run_dir})")
