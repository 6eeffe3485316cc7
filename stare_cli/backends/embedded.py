"""The embedded backend: one process, PyTorch + transformers, CPU or one CUDA GPU.

`train()` reads as the paper's loop in numbered steps, each a function below with named records in
and out; everything a method decides comes from the method layer (stare_cli/method/layer.py), the
same object verl's processes use.
  0. set-up: hardware, run directory (new, resumed or restarted), policy (model, tokenizer, AdamW,
     LR schedule), trainer state, prompts (benchmarks/data/prompts.py), rollout engine
  1. draw a generation batch of prompts, roll out n responses each (HF generate, or a colocated
     vLLM engine that gets the current weights before each rollout: `rollout.engine`)
  2. reward: the method layer's `score` (the recipe's reward function, truncation rule, shaping)
  3. dynamic sampling on accuracy: more generation batches until the train batch fills
     (`collect_rollouts`; `rollout.on_short_batch` says what happens when it cannot)
  4. one no-grad forward: old log-probs and token entropies (on-policy with a single micro-batch,
     the training forward's own, detached)
  5. the STARE controller once per step from the batch's token-mean entropy, then the method
     layer's batch transform (advantages over tokens, masks, batch-scope STARE weights)
  6. PPO updates over mini-batches, micro-batches from the method layer (token budget or rows), the
     method layer's loss (official-scope STARE selects here, per loss call), grad clip, LR
  7. samples, evaluation (the training rollout path: same engine and tools), metrics, checkpoints

The training forward (stare_cli/backends/forward.py) lays rows out without padding masks, in
length-sorted buckets, and on the CPU lets a prompt's responses share one forward of it; results
are reassembled in batch order before the loss, so batch-level selections (STARE sets, top-entropy
masks, Clip-Cov/KL-Cov) see the same tensors as with one forward.

Determinism: sampling is seeded per (seed, step, generation batch), data order by (seed, epoch),
so a resumed run repeats an uninterrupted one exactly on CPU. Checkpoints are written to a
temporary directory and renamed; `checkpoints/latest` is a symlink swapped atomically
(stare_cli/backends/checkpoints.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks.data.models import check_model_name, resolve_model_path
from benchmarks.data.prompts import load_prompts, take_prompts
from benchmarks.data.registry import dir_name
from benchmarks.evaluation.metrics import reflection_rate
from benchmarks.generation.attention import use_gqa_sdpa_on_cpu
from benchmarks.generation.engines import HFEngine, load_tokenizer
from benchmarks.generation.sandbox import require_isolation
from benchmarks.generation.tools import tool_limits, tool_spec
from benchmarks.grading.graders import Grader
from stare_cli.backends.checkpoints import restore_trainer_state, save_checkpoint
from stare_cli.backends.forward import pack, token_logprobs_entropy
from stare_cli.core.config import Recipe
from stare_kernel.errors import StareError, install_hint
from stare_cli.core.card import write_card
from stare_cli.core.resume import ResumePlan, finished_note, no_checkpoint_error, set_aside
from stare_cli.core.runs import (append_jsonl, atomic_write_text, clean_stale_temporaries, hold_run_lock, new_run_dir,
                                 read_jsonl, record_config, run_eval_points, usable_checkpoint, write_run_meta)
from stare_cli.core.signals import StopAtStepBoundary


# ---------------------------------------------------------------------------------------- logger
class StepLog:
    """What a training run shows while it works, on a terminal and in a pipe alike, and in the run
    directory's train.log:
    - `note`: a timestamped line for each phase (run directory, model loading, each step's rollout,
      training and evaluation), so that the first line comes within seconds and no phase is silent;
    - `ticker`: while a step generates, a line every `every_s` seconds with the tokens generated so far
      and their rate (benchmarks.generation.engines.METER);
    - `log`: one line per step (step, key metrics, rate, ETA). The ETA counts the evaluations still to
      come at the mean time an evaluation took (or, before any, says that it leaves them out); a resumed
      run counts the steps and evaluations it made before it stopped (`resume_from`);
    - a rich bar on a terminal (its description short: the metrics go on their own line).
    """

    KEYS = ("reward", "acc", "entropy", "len/mean", "stare/gate", "time/step")

    def __init__(self, total: int, start: int, log_file: Optional[Path] = None, every_s: float = 15.0,
                 evals_left=None):
        self.total, self.start = total, start
        self.t0 = time.time()
        self.every_s = every_s
        self.evals_left = evals_left or (lambda step: 0)  # evaluations still to run after `step`
        self.step_times: list[float] = []
        self.eval_times: list[float] = []
        self.tty = sys.stderr.isatty()
        self.file = open(log_file, "a") if log_file is not None else None
        self.progress = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.description}"), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("", total=total, completed=start)

    def resume_from(self, rows: list[dict]) -> None:
        """Time the steps and evaluations ahead by those the run made before it was stopped too (its
        metrics rows up to the step it resumes at): a resumed run's ETA was one step's time with its
        evaluations left out ('ETA 20m17s + 1 evaluation')."""
        for r in rows:
            if r.get("step", 0) <= self.start and r.get("time/step") is not None:
                self.step_times.append(float(r["time/step"]))
                if r.get("time/eval") is not None:
                    self.eval_times.append(float(r["time/eval"]))

    def _emit(self, text: str) -> None:
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()
        if self.progress:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """One timestamped phase line."""
        self._emit(f"{time.strftime('%H:%M:%S')} {text}")

    def ticker(self, label: str):
        """A context manager printing, every `every_s` seconds while it is open, the tokens generated since
        it opened and their rate."""
        import contextlib
        import threading

        from benchmarks.generation.engines import METER

        @contextlib.contextmanager
        def run():
            t0, n0 = time.time(), METER.total
            done = threading.Event()

            def tick():
                while not done.wait(self.every_s):
                    dt, n = time.time() - t0, METER.total - n0
                    self.note(f"{label}: {n:,} tokens generated in {int(dt)}s ({n / dt:.1f} tokens/s)")

            th = threading.Thread(target=tick, daemon=True)
            th.start()
            try:
                yield
            finally:
                done.set()
                th.join()

        return run()

    def eta(self, step: int) -> str:
        """Time left: the remaining steps at the mean step time (evaluation excluded), plus the remaining
        evaluations at the mean evaluation time."""
        if not self.step_times:
            return "?"
        left = (self.total - step) * sum(self.step_times) / len(self.step_times)
        evals = self.evals_left(step)
        if evals and not self.eval_times:
            return _clock(left) + f" + {evals} evaluation{'s' if evals > 1 else ''}"
        if evals:
            left += evals * sum(self.eval_times) / len(self.eval_times)
        return _clock(left)

    def line(self, step: int, m: dict) -> str:
        desc = "  ".join(f"{k} {m[k]:.3g}" + ("s" if k.startswith("time/") else "") for k in self.KEYS if k in m)
        elapsed = time.time() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        return f"step {step}/{self.total}  {desc}  {60 * rate:.2f} steps/min  ETA {self.eta(step)}"

    def log(self, step: int, m: dict) -> None:
        self.step_times.append(float(m.get("time/step", 0.0)))
        if "time/eval" in m:
            self.eval_times.append(float(m["time/eval"]))
        text = self.line(step, m)
        self._emit(text)
        if self.progress:
            self.progress.update(self.task, completed=step, description=f"ETA {self.eta(step)}")

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
        if self.file is not None:
            self.file.close()


def _clock(seconds: float) -> str:
    seconds = max(0.0, seconds)
    h, rest = divmod(int(seconds), 3600)
    return (f"{h}h" if h else "") + f"{rest // 60}m{rest % 60:02d}s"


# ------------------------------------------------------------------------------------- contract
def refusals(cfg: Recipe) -> list[tuple[str, str]]:
    """What the embedded backend cannot honour (stare_cli/backends/__init__.py): it runs every key
    of the recipe except the verl section (backend.verl.*), which configures the other backend."""
    out = []
    if cfg.optim.precision == "fp16" and cfg.backend.embedded.device == "cpu":
        out.append(("optim.precision", "fp16 needs a CUDA device (backend.embedded.device is cpu)"))
    return out


# ----------------------------------------------------------------------------------------- train
@dataclass
class Drawn:
    """One response of a step's generation batches, as scored by the method layer."""

    sample: Any  # benchmarks.generation.engines.Sample
    reward: float
    acc: float
    group: int  # unique within the step (generation batch x prompt)


@dataclass
class StepRollouts:
    """Steps 1-3 of one training step: the responses kept for training, in draw order, and what was
    measured on all responses drawn."""

    kept: list[Drawn]
    metrics: dict[str, float]
    t_gen: float
    t_score: float
    groups_wanted: int

    @property
    def n_groups(self) -> int:
        return len({d.group for d in self.kept})


def collect_rollouts(layer, engine, rows: list[dict], cursor: int, step: int, cfg: Recipe, tok, use_chat: bool,
                     tools, before_generate) -> tuple[StepRollouts, int]:
    """Draw generation batches of prompts, roll out n responses each, score them with the method
    layer and keep the groups dynamic sampling keeps, until the train batch is full (at most
    rollout.max_gen_batches draws). Returns the rollouts and the new data cursor."""
    import torch

    from benchmarks.generation.engines import SamplingParams
    from benchmarks.generation.templates import build_prompt

    R, O = cfg.rollout, cfg.optim
    ds = layer.cfg.dynamic_sampling
    kept: list[Drawn] = []
    drawn: list[Drawn] = []
    groups_dropped, n_draws, t_gen, t_score = 0, 0, 0.0, 0.0
    metric_rows: list[dict[str, float]] = []
    full_solve: list[float] = []
    per_group = ds and R.refill == "per_group"
    while len({d.group for d in kept}) < O.train_batch_size:
        if ds and not per_group and n_draws >= R.max_gen_batches:
            break
        if per_group and len(drawn) >= 100 * O.train_batch_size * R.n:
            raise StareError(f"step {step + 1}: {len(drawn) // R.n} prompts drawn and {len({d.group for d in kept})} "
                             "groups with varied accuracy", hint="the model answers (almost) every prompt alike")
        # gen_batches: gen_batch_size prompts per draw (the official trainer); per_group: one fresh
        # prompt per group still missing (verl 0.9's replay buffer); no dynamic sampling: one train batch.
        k = (O.train_batch_size - len({d.group for d in kept}) if per_group
             else R.gen_batch_size if ds else O.train_batch_size)
        batch_rows, cursor = take_prompts(rows, cursor, k, O.seed, cfg.data.shuffle)
        prompts = [build_prompt(r["problem"], cfg.data.template.value, tok, use_chat, tools) for r in batch_rows]
        sp = SamplingParams(n=R.n, temperature=R.temperature, top_p=R.top_p, top_k=R.top_k,
                            max_new_tokens=R.max_response_tokens, seed=O.seed * 1_000_003 + step * 101 + n_draws)
        t0 = time.perf_counter()
        before_generate()
        groups = engine.generate(prompts, sp, tools)
        t_gen += time.perf_counter() - t0
        flat = [(gi, s) for gi, g in enumerate(groups) for s in g]
        t0 = time.perf_counter()
        scores = layer.score([s.text for _, s in flat], [batch_rows[gi]["answer"] for gi, _ in flat],
                             [s.finished for _, s in flat], [len(s.response_ids) for _, s in flat])
        t_score += time.perf_counter() - t0
        gid = torch.tensor([n_draws * 100_000 + gi for gi, _ in flat])
        batch = [Drawn(s, float(r), float(a), int(g)) for (_, s), r, a, g in zip(flat, scores.reward, scores.acc, gid)]
        drawn += batch
        metric_rows.append({**scores.metrics(), "n": len(flat)})
        full_solve += scores.acc.view(-1, R.n).min(-1).values.tolist()
        keep, dropped = layer.keep_groups(scores.acc, gid)
        groups_dropped += dropped
        kept += [d for d, k in zip(batch, keep.tolist()) if k]
        n_draws += 1
        if not ds:
            break
    # Trim to the train batch: whole groups, in draw order (as the official trainer's batch[:size]).
    first_groups = sorted({d.group for d in kept})[: O.train_batch_size]
    kept = [d for d in kept if d.group in set(first_groups)]
    n = sum(m["n"] for m in metric_rows)
    metrics = {k: sum(m[k] * m["n"] for m in metric_rows) / n for k in metric_rows[0] if k != "n"}
    samples = [d.sample for d in drawn]
    metrics.update({
        "full_solve": sum(full_solve) / len(full_solve), "groups_dropped": groups_dropped, "gen_batches": n_draws,
        "train_groups": len(first_groups), "len/mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "len/max": max(len(s.response_ids) for s in samples),
        "len/truncated": 1 - sum(s.finished for s in samples) / len(samples),
        "reflection_rate": reflection_rate([s.text for s in samples], cfg.logging.reflection_words),
    })
    if tools is not None:
        calls = sum(s.tool_calls for s in samples)
        metrics.update({"tools/calls_per_response": calls / len(samples),
                        "tools/error_rate": sum(s.tool_errors for s in samples) / max(calls, 1),
                        "tools/turns": sum(s.turns for s in samples) / len(samples)})
    return StepRollouts(kept, metrics, t_gen, t_score, O.train_batch_size), cursor


def rollout_mismatch(rollout_logprobs: list, trainer_logp, mask) -> dict:
    """How far the rollout engine's token log-probs are from the trainer's recomputation on the same
    tokens (same weights: numerics, kernels, dtype, top-p truncation). rollout_logprobs: per sample
    a list (or None); trainer_logp, mask: [B, T]. Tokens without a rollout log-prob (tool
    observations, engines that give none) are left out. Returns rollout/* metrics ({} when none):
    lp_abs_diff_mean / _max over tokens, kl_k3 (the k3 estimate of KL(rollout || trainer) on the
    sampled tokens: mean of exp(d) - 1 - d, d = trainer - rollout), and surprisal_gap (the
    rollout's mean surprisal minus the trainer's: the entropy estimate's mismatch)."""
    import torch

    B, T = trainer_logp.shape
    ro = torch.full((B, T), float("nan"))
    for i, lps in enumerate(rollout_logprobs):
        if lps:
            n = min(len(lps), T)
            ro[i, :n] = torch.tensor(lps[:n], dtype=torch.float32)
    ok = (mask.cpu() > 0) & torch.isfinite(ro)
    if not bool(ok.any()):
        return {}
    r, t = ro[ok], trainer_logp.detach().float().cpu()[ok]
    d = t - r
    return {"rollout/lp_abs_diff_mean": float(d.abs().mean()), "rollout/lp_abs_diff_max": float(d.abs().max()),
            "rollout/kl_k3": float((d.exp() - 1 - d).mean()), "rollout/surprisal_gap": float((-r).mean() - (-t).mean()),
            "rollout/tokens_compared": int(ok.sum())}


def old_logprobs_and_entropy(model, batch: dict, parts: list[list[int]], temperature: float, autocast, buckets: bool,
                             share: bool, chunked_head: Optional[bool] = None):
    """Step 4: log pi_old and the token entropy of every row, one no-grad forward per part [B, T]."""
    import torch

    model.eval()
    B, T = batch["response_mask"].shape
    old = torch.zeros(B, T, device=batch["response_mask"].device)
    ent = torch.zeros_like(old)
    with torch.no_grad():
        for idx in parts:
            with autocast():
                lp, en = token_logprobs_entropy(model, batch, idx, temperature, buckets=buckets, share_prompts=share,
                                                chunked_head=chunked_head)
            old[idx], ent[idx] = lp.float(), en.float()
    model.train()
    return old, ent


# ------------------------------------------------------------------------------------ set-up records
@dataclass
class Hardware:
    """Where training runs: the torch device and whether rollouts use a colocated vLLM engine."""

    device: Any  # torch.device
    use_vllm: bool


@dataclass
class RunHandle:
    """The run directory this process owns (locked until it exits) and the checkpoint it resumes from."""

    run_dir: Path
    lock: Any  # the open lock file (stare_cli/core/runs.py: hold_run_lock)
    ckpt: Optional[Path]  # None: a new run or a restart


@dataclass
class Policy:
    """The trained model and what updates it: tokenizer, AdamW, the LR schedule, fp16's grad scaler."""

    model: Any
    tok: Any
    model_path: str
    opt: Any
    sched: Any
    scaler: Any  # torch.amp.GradScaler under fp16, else None
    device: Any
    precision: str  # optim.precision: compute dtype under autocast (master weights stay fp32)

    def autocast(self):
        import torch

        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[self.precision])


@dataclass
class Position:
    """Where the loop stands: optimizer steps taken (skipped steps count) and the data cursor."""

    step: int
    cursor: int


@dataclass
class Rollout:
    """The rollout side: the engine, and for a colocated vLLM engine the weights version it holds
    (optimizer steps taken vs pushed), so that it samples from the current weights."""

    engine: Any
    use_vllm: bool
    version: int = 0
    synced: int = 0

    def sync(self, model) -> None:
        if self.use_vllm and self.synced != self.version:
            import torch

            with torch.no_grad():
                self.engine.load_weights((k, v.detach()) for k, v in model.state_dict().items())
            self.synced = self.version


# ------------------------------------------------------------------------------------- step records
@dataclass
class OldPass:
    """Step 4: the packed batch, its mini- and micro-batches, the old log-probs and token entropies
    [B, T]. Fused (one mini-batch, one epoch: the weights cannot change before the training forwards),
    they are the training forwards' own, detached: with one micro-batch its forward has run, kept with
    its graph in `current` for step 6; with several (`deferred`) step 6's forwards fill them in."""

    batch: dict
    plan: list[list[Any]]  # per mini-batch, its loss calls (baselines.micro_batches.LossCall)
    old_logp: Any
    entropy: Any
    current: Optional[tuple] = None  # (log-probs, entropies) with grad when fused
    t_start: float = 0.0  # when training work began (time/train)
    deferred: bool = False  # old_logp, entropy: zeros until step 6's first pass over the micro-batches

    @property
    def H(self) -> float:
        """The batch's token-mean entropy (the controller's input)."""
        return self.H_of(slice(None))

    def H_of(self, rows) -> float:
        """The token-mean entropy of some rows (an index list or a slice)."""
        mask = self.batch["response_mask"][rows]
        return float((self.entropy[rows] * mask).sum() / mask.sum().clamp(min=1))

    @property
    def fused(self) -> bool:
        return self.current is not None


@dataclass
class TrainBatch:
    """Step 5: the controller's state for the loss calls and the method layer's batch transform."""

    stare_state: Any  # StareState or None
    transformed: Any  # the method layer's BatchTransform: advantages, mask, weights, metrics


# --------------------------------------------------------------------------------------------- train
def train(cfg: Recipe, out_root: Path | str = "runs", resume: Optional[ResumePlan] = None,
          overrides: tuple[str, ...] = ()) -> Path:
    """Train `cfg.method` under `cfg` with the embedded backend (with `resume`, continue that run
    from its newest intact checkpoint, `resume.recipe` being `cfg`). Returns the run directory.
    SIGINT/SIGTERM: the step finishes, a checkpoint is written, and Interrupted is raised (during the
    step-0 evaluation: the evaluation finishes and Interrupted is raised, with no checkpoint)."""
    from stare_cli.method.layer import MethodLayer

    _quiet_transformers()
    layer = MethodLayer.from_recipe(cfg)
    O, E = cfg.optim, cfg.eval
    # 0. set-up: hardware, run directory, policy, trainer state, prompts, rollout engine
    hw = choose_hardware(cfg)
    rows = load_prompts(cfg)  # bad training data: one line naming file and row, before anything is created
    if resume is None:  # a model that names nothing: one line, before a run directory exists
        check_model_name("model.path", cfg.model.path, resolve_model_path(cfg.model.path))
    run = open_run(cfg, out_root, resume)
    if finished_already(run, O.total_steps):
        return run.run_dir
    start_step = int(run.ckpt.name[5:]) if run.ckpt is not None else 0
    log = StepLog(O.total_steps, start_step, run.run_dir / "train.log",
                  evals_left=lambda step: evaluations_left(cfg, step))
    log.resume_from(read_jsonl(run.run_dir / "metrics.jsonl") if start_step else [])
    log.note(f"{cfg.method.name} on {cfg.name or 'recipe'}: run directory {run.run_dir}")
    if run.ckpt is not None:  # train.log is appended to: say where the steps below start again
        log.note(f"resumed from {run.ckpt.name}: the lines below for steps after {start_step} replace any above "
                 "(metrics.jsonl holds each step once)")
    log.note(f"loading {cfg.model.path} ({hw.device.type}, fp32 master weights, {O.precision} compute)")
    t_load = time.perf_counter()
    policy = load_policy(cfg, hw, run)
    heap = Heap.choose(hw, cfg)
    if heap.libc is not None:
        log.note(f"heap: in training, blocks from {MAPPED_FROM_BYTES // 1024} KiB are mapped one by one "
                 "(backend.embedded.heap)")
    log.note(f"model loaded in {time.perf_counter() - t_load:.0f}s: "
             f"{sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M parameters")
    pos = start_or_restore(cfg, run, policy, layer, resume, overrides)
    log.start = pos.step
    use_chat = cfg.model.chat_template == "auto"
    rollout = start_rollout(cfg, hw, policy, resumed=run.ckpt is not None)
    tools = tool_spec(cfg.rollout.tools)
    eval_grader = Grader(workers=0)  # evaluation: `stare eval`'s grader, with the fallbacks users expect
    wb = _wandb_init(cfg, run.run_dir)
    at_step0 = False  # in the step-0 evaluation: a stop ends the run at its end, before step 1, with no checkpoint
    stop = StopAtStepBoundary(
        lambda: "the step-0 evaluation" if at_step0 else f"step {pos.step + 1} of {O.total_steps}",
        leaves=lambda: "no step trained: no checkpoint" if at_step0 else "a checkpoint is written").install()
    try:
        if E.benchmarks and E.at_start and pos.step == 0:  # step 0: where every evaluation curve starts
            at_step0 = True
            log.note(f"step 0: evaluating {', '.join(E.benchmarks)} before training")
            t_eval = time.perf_counter()
            m0 = _evaluate(rollout.engine, eval_grader, cfg, policy.tok, use_chat, 0, run.run_dir, tools)
            log.eval_times.append(time.perf_counter() - t_eval)  # results: eval/step-000000/ (metrics.jsonl: steps)
            log.note("step 0: " + _eval_summary(m0))
            stop.check(lambda: f"interrupted after the step-0 evaluation, before step 1 (no checkpoint); "
                               f"start it again with: stare train --resume {run.run_dir} --restart")
            at_step0 = False
        while pos.step < O.total_steps:
            t_step = time.perf_counter()
            k = pos.step + 1
            # 1-3. rollout, reward (method layer), dynamic sampling until the train batch fills
            log.note(f"step {k}/{O.total_steps}: rollout ({cfg.rollout.n} responses per prompt, "
                     f"up to {cfg.rollout.max_response_tokens} tokens)")
            with log.ticker(f"step {k}/{O.total_steps}: rollout"):
                ro, pos.cursor = collect_rollouts(layer, rollout.engine, rows, pos.cursor, pos.step, cfg, policy.tok,
                                                  use_chat, tools, lambda: rollout.sync(policy.model))
            check_batch_filled(ro, layer, cfg, pos.step)
            release_freed_memory(hw)
            metrics: dict[str, Any] = dict(ro.metrics)
            t_train = 0.0
            if not ro.kept:  # every group was all-equal: nothing to learn; samples/eval/checkpoint still run
                metrics.update(skip_step(policy))
            else:
                log.note(f"step {k}/{O.total_steps}: training on {len(ro.kept)} responses "
                         f"({ro.t_gen:.0f}s of generation)")
                with heap.training():
                    # 4. old log-probs and token entropies
                    old = old_pass(policy, layer, ro, cfg)
                    # 5. the controller (once per step) and the batch transform (method layer)
                    tb, m = controller_and_transform(layer, ro, old)
                    metrics.update(m)
                    # 6. PPO updates: mini-batches of prompts, micro-batches and the loss (method layer)
                    metrics.update(ppo_updates(policy, layer, old, tb, cfg, pos.step, rollout))
                    metrics.update(old_pass_metrics(old, ro))  # a deferred old pass is filled by step 6's forwards
                t_train = time.perf_counter() - old.t_start
                del old, tb
                release_freed_memory(hw)
            pos.step += 1
            # 7. samples, evaluation, metrics, checkpoint
            write_samples(cfg, run.run_dir, pos.step, ro)
            t_eval = 0.0
            if E.benchmarks and ((E.every and pos.step % E.every == 0) or pos.step == O.total_steps):
                log.note(f"step {pos.step}/{O.total_steps}: evaluating {', '.join(E.benchmarks)}")
                t0 = time.perf_counter()
                rollout.sync(policy.model)
                metrics.update(_evaluate(rollout.engine, eval_grader, cfg, policy.tok, use_chat, pos.step,
                                         run.run_dir, tools, lr=metrics.get("lr")))
                t_eval = time.perf_counter() - t0
                metrics["time/eval"] = t_eval
                log.note(f"step {pos.step}/{O.total_steps}: " + _eval_summary(metrics))
            _finish_step(run.run_dir, pos.step, metrics, t_step, ro.t_gen, ro.t_score, t_train, log, wb, t_eval)
            stopping = stop.signum is not None  # SIGINT/SIGTERM during this step: checkpoint, then stop
            if (cfg.checkpoint.every and pos.step % cfg.checkpoint.every == 0) or pos.step == O.total_steps or stopping:
                save_checkpoint(run.run_dir, pos.step, policy.model, policy.tok, policy.opt, policy.sched,
                                trainer_state(pos, layer), cfg.checkpoint.keep_last)
            stop.check(lambda: f"interrupted at step {pos.step} (checkpoint written); "
                               f"resume with: stare train --resume {run.run_dir}")
    finally:
        stop.restore()
        write_card(run.run_dir, "finished" if pos.step >= O.total_steps else "stopped")
        if pos.step >= O.total_steps:
            for line in finish_summary(run.run_dir, cfg):
                log.note(line)
        log.close()
        run.lock.close()
        layer.close()
        eval_grader.close()
        if callable(getattr(rollout.engine, "close", None)):  # a vLLM engine: freed now, not at interpreter exit
            rollout.engine.close()
        if wb is not None:
            wb.finish()
    return run.run_dir


# ------------------------------------------------------------------------------------- 0. set-up
def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display owns the terminal
    hf_logging.set_verbosity_error()


def choose_hardware(cfg: Recipe) -> Hardware:
    """The device (backend.embedded.device; auto: CUDA when visible) and the rollout engine; fails
    before anything loads when the recipe asks for what this machine cannot do."""
    import torch

    torch.set_num_threads(cfg.backend.embedded.threads)
    name = cfg.backend.embedded.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise StareError("backend.embedded.device is 'cuda' but no CUDA device is visible", hint="use device: cpu")
    device = torch.device(name)
    if cfg.optim.precision == "fp16" and device.type != "cuda":
        raise StareError("optim.precision fp16 needs a CUDA device", hint="-o optim.precision=fp32 (or bf16) on CPU")
    if cfg.rollout.tools.enable:  # fail closed, before anything loads: the sandbox must isolate every call
        require_isolation(tool_limits(cfg.rollout.tools))
    R = cfg.rollout
    use_vllm = R.engine == "vllm" or (R.engine == "auto" and device.type == "cuda"
                                      and importlib.util.find_spec("vllm") is not None)
    if use_vllm:
        try:  # before loading the model: fail fast
            import vllm  # noqa: F401
        except ImportError:
            raise StareError("vLLM is not installed", hint=install_hint("vllm") + " on a GPU machine, "
                             "or -o rollout.engine=hf") from None
    return Hardware(device, use_vllm)


# The heap is handed back only above this resident set: the trim pays on the real model (a step's resident
# set 4.45 -> 2.56 GiB) and costs on the toy, whose next phase faults its working set back in (issue 69:
# 0.80-0.87 s per toy step with it, 0.69-0.74 s without, alternated in one sitting).
TRIM_ABOVE_BYTES = int(1.5 * 2**30)


def resident_bytes() -> Optional[int]:
    """This process's resident set (Linux /proc/self/statm), None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_freed_memory(hw: Hardware) -> None:
    """On the CPU with glibc, where the resident set is above TRIM_ABOVE_BYTES: hand memory freed by the
    phase that just ended back to the system (`malloc_trim`). Without it the heap keeps the rollout's and
    the update's freed blocks, fragmented, and the next phase allocates beside them: measured on the
    real-model recipe, the resident set after a step fell from 4.45 to 2.56 GiB (the weights, gradients and
    Adam state). A few milliseconds, and on a small model more than it saves (TRIM_ABOVE_BYTES)."""
    if hw.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    rss = resident_bytes()
    if rss is not None and rss < TRIM_ABOVE_BYTES:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to do
        pass


MAPPED_FROM_BYTES = 128 * 1024
HEAP_FROM_BYTES = 32 * 2**20  # glibc's largest dynamic threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


@dataclass
class Heap:
    """backend.embedded.heap: on the CPU with glibc, under 'mapped', every block from MAPPED_FROM_BYTES on is
    mapped by itself during the training phase (`training()`: old pass and updates) and unmapped when freed, so
    a freed activation leaves the process at once. glibc's own threshold rises to the largest block freed (up to
    32 MiB) and then keeps such blocks in the heap: on the real-model recipe the blocks of 128 KiB to 1 MiB that
    a micro-batch's forward and backward free held 0.4-0.6 GiB beside the live ones (0.07-0.15 GiB came back by
    trimming between micro-batches). Outside training the threshold is HEAP_FROM_BYTES, where glibc's settles:
    the rollout's key/value cache grows by a block per token, and mapping each of them cost more time than it
    saved memory. 'auto' (the default) and 'glibc' leave glibc's heap as it is: mapping cost 25-45% more training
    time for its 0.4-0.6 GiB, where halving the micro-batch saves as much for less than half the extra time
    (docs/guide/memory.md)."""

    libc: Any = None  # glibc through ctypes, or None: nothing is changed

    @classmethod
    def choose(cls, hw: Hardware, cfg: Recipe) -> "Heap":
        """The recipe's heap on this hardware: mapped only under 'mapped', on the CPU, with glibc."""
        if cfg.backend.embedded.heap != "mapped" or hw.device.type != "cpu" or not sys.platform.startswith("linux"):
            return cls()
        try:
            import ctypes

            return cls(ctypes.CDLL("libc.so.6"))
        except OSError:  # not glibc (musl, ...): nothing to do
            return cls()

    @contextmanager
    def training(self):
        if self.libc is None:
            yield
            return
        self.libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM_BYTES)
        try:
            yield
        finally:
            self.libc.mallopt(M_MMAP_THRESHOLD, HEAP_FROM_BYTES)


def open_run(cfg: Recipe, out_root: Path | str, resume: Optional[ResumePlan]) -> RunHandle:
    """A new run directory, or the resumed one (locked; a restart sets the earlier outputs aside;
    otherwise the newest intact checkpoint, naming and skipping damaged ones)."""
    if resume is None:
        run_dir = new_run_dir(cfg, out_root)
        return RunHandle(run_dir, hold_run_lock(run_dir), None)
    run_dir = resume.run_dir
    lock = hold_run_lock(run_dir)  # held until this process ends
    clean_stale_temporaries(run_dir)
    if resume.restart:
        set_aside(run_dir)
        return RunHandle(run_dir, lock, None)
    ckpt, skipped = usable_checkpoint(run_dir)
    for why in skipped:
        print(f"warning: skipping checkpoint: {why}", file=sys.stderr)
    if ckpt is None:
        raise no_checkpoint_error(run_dir, skipped)
    if skipped:
        print(f"warning: resuming from {ckpt.name}", file=sys.stderr)
    latest = run_dir / "checkpoints" / "latest"
    if latest.exists() and latest.resolve() != ckpt.resolve():
        named = latest.resolve().name
        if named > ckpt.name:  # step-NNNNNN names sort as their steps: latest's own checkpoint was skipped above
            print(f"note: checkpoints/latest names {named}, which is damaged (skipped above): resuming from {ckpt.name}, "
                  "the newest intact checkpoint", file=sys.stderr)
        else:
            print(f"note: checkpoints/latest names {named}, but {ckpt.name} is newer and intact (a run stopped before "
                  f"moving latest): resuming from {ckpt.name}", file=sys.stderr)
    return RunHandle(run_dir, lock, ckpt)


def finished_already(run: RunHandle, total_steps: int) -> bool:
    """True (said on stderr, the run's lock released) when a resumed run's checkpoint is already at
    optim.total_steps: there is nothing to train, and exiting 0 without a word would look like work."""
    if run.ckpt is None or int(run.ckpt.name[5:]) < total_steps:
        return False
    print(finished_note(run.run_dir, total_steps, int(run.ckpt.name[5:])) + f" [{run.ckpt.name}]", file=sys.stderr)
    run.lock.close()
    return True


def load_policy(cfg: Recipe, hw: Hardware, run: RunHandle) -> Policy:
    """The model (fp32 master weights always: an lr of 1e-6 barely moves bf16 weights;
    optim.precision sets the compute dtype), its tokenizer, AdamW and the LR schedule."""
    import torch
    from transformers import AutoModelForCausalLM

    O = cfg.optim
    model_path = str(run.ckpt) if run.ckpt is not None else resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(O.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 trust_remote_code=cfg.model.trust_remote_code,
                                                 use_safetensors=True).to(hw.device)
    model.train()
    if lean_activations(cfg.backend.embedded, model):  # same forward, fewer saved tensors (module docstring there)
        from stare_cli.backends import lean_activations as lean

        lean.apply(model)
    if cfg.backend.embedded.activation_checkpointing:  # training forwards keep each layer's input only
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_gqa_sdpa_on_cpu(model)
    opt = torch.optim.AdamW(model.parameters(), lr=O.lr, weight_decay=O.weight_decay, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, O))
    scaler = torch.amp.GradScaler("cuda") if O.precision == "fp16" else None
    return Policy(model, tok, model_path, opt, sched, scaler, hw.device, O.precision)


def lr_factor(O, step: int) -> float:
    """The LR multiplier at `step`: linear warm-up, then constant, cosine or linear decay."""
    if step < O.warmup_steps:
        return (step + 1) / O.warmup_steps
    frac = (step - O.warmup_steps) / max(1, O.total_steps - O.warmup_steps)
    return {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * frac)), "linear": 1.0 - frac}[O.schedule]


def start_or_restore(cfg: Recipe, run: RunHandle, policy: Policy, layer, resume: Optional[ResumePlan],
                     overrides: tuple[str, ...] = ()) -> Position:
    """Step 0 of a new run (its meta and config recorded, with the -o overrides it was started with), or
    the resumed checkpoint's state (optimizer, schedule, RNG, controller, data cursor; metrics rows after
    it dropped)."""
    if run.ckpt is None:
        from stare_cli.method.layer import method_warnings

        write_run_meta(run.run_dir, cfg, {"backend": "embedded", "device": str(policy.device),
                                          "model_path": policy.model_path,
                                          "reward_grader": layer.reward_function().grader.tag,
                                          "method_notes": method_warnings(cfg)})
        record_config(run.run_dir, cfg, "restart" if resume is not None else "start", 0,
                      list(resume.overrides) if resume is not None else list(overrides), resume.changed if resume else {})
        write_card(run.run_dir, "started")
        return Position(0, 0)
    step, cursor = restore_trainer_state(run.ckpt, policy.opt, policy.sched, layer, cfg)
    # Drop metrics written after the checkpoint (a crash mid-way): the resumed run redoes them.
    rows = [r for r in read_jsonl(run.run_dir / "metrics.jsonl") if r.get("step", 0) <= step]
    lost = missing_steps({int(r.get("step", 0)) for r in rows}, step)
    if lost:  # a torn, cut or deleted metrics.jsonl: the checkpoint has trained these steps, their rows are gone
        print(f"warning: {run.run_dir / 'metrics.jsonl'} lacks the metrics of step{'s' if len(lost) > 1 else ''} "
              f"{_ranges(lost)} of the {step} the checkpoint holds (cut, damaged or deleted); they cannot be "
              "recovered, and plots and tables will show the gap", file=sys.stderr)
    atomic_write_text(run.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    record_config(run.run_dir, cfg, "resume", step, list(resume.overrides), resume.changed)
    write_card(run.run_dir, "resumed")
    return Position(step, cursor)


def missing_steps(present: set[int], step: int) -> list[int]:
    """Steps 1..step without a metrics row."""
    return [k for k in range(1, step + 1) if k not in present]


def _ranges(steps: list[int]) -> str:
    """'6-10, 12' for [6, 7, 8, 9, 10, 12]."""
    out, start = [], None
    for i, k in enumerate(steps):
        if start is None:
            start = k
        if i + 1 == len(steps) or steps[i + 1] != k + 1:
            out.append(f"{start}" if start == k else f"{start}-{k}")
            start = None
    return ", ".join(out)


def start_rollout(cfg: Recipe, hw: Hardware, policy: Policy, resumed: bool) -> Rollout:
    """HF generation on the trained model itself, or a colocated vLLM engine with its own copy of
    the weights, refreshed before each use."""
    R = cfg.rollout
    if hw.use_vllm:
        from benchmarks.generation.engines import VLLMEngine

        engine = VLLMEngine(policy.model_path, gpu_memory_utilization=R.vllm_gpu_memory_utilization,
                            dtype=cfg.model.dtype.value, max_model_len=R.max_prompt_tokens + R.max_response_tokens,
                            trust_remote_code=cfg.model.trust_remote_code, max_prompt_tokens=R.max_prompt_tokens,
                            colocate=True, seed=cfg.optim.seed)
    else:
        engine = HFEngine(policy.model, policy.tok, batch_size=max(1, R.gen_batch_size * R.n),
                          max_prompt_tokens=R.max_prompt_tokens)
    return Rollout(engine, hw.use_vllm, version=0, synced=-1 if resumed else 0)


# ------------------------------------------------------------------------------- 1-3. rollouts
def check_batch_filled(ro: StepRollouts, layer, cfg: Recipe, step: int) -> None:
    """The official trainer's rule when its generation batches keep too few groups: stop."""
    R, O = cfg.rollout, cfg.optim
    if (ro.n_groups < ro.groups_wanted and layer.cfg.dynamic_sampling and R.refill == "gen_batches"
            and R.on_short_batch == "error"):
        raise StareError(
            f"step {step + 1}: {R.max_gen_batches} generation batches kept {ro.n_groups} groups with varied "
            f"accuracy, fewer than optim.train_batch_size ({O.train_batch_size})",
            hint="raise rollout.max_gen_batches, or -o rollout.on_short_batch=train to train on what was kept "
                 "(the official trainer stops here too)")


def skip_step(policy: Policy) -> dict[str, float]:
    """A step with nothing to train on still counts for the LR schedule."""
    metrics = {"lr": policy.sched.get_last_lr()[0], "skipped": 1}
    with warnings.catch_warnings():  # torch warns when a schedule step comes before the first optimizer step
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        policy.sched.step()
    return metrics


# ------------------------------------------------------------------- 4. old log-probs, entropies
def chunked_head(E, model=None) -> Optional[bool]:
    """backend.embedded.lm_head as token_logprobs_entropy's switch: None (chunked where the architecture
    allows it) or False (the model's own logits); 'auto' chunks from a vocabulary of AUTO_CHUNK_VOCAB on."""
    if E.lm_head == "auto":
        return None if real_vocabulary(model) else False
    return None if E.lm_head == "chunked" else False


AUTO_CHUNK_VOCAB = 4096


def real_vocabulary(model) -> bool:
    """Whether `model`'s output embedding has AUTO_CHUNK_VOCAB tokens or more (every real model; not the toys):
    where the 'auto' settings (lm_head, lean_activations) turn on."""
    head = model.get_output_embeddings() if model is not None and hasattr(model, "get_output_embeddings") else None
    return head is not None and head.weight.shape[0] >= AUTO_CHUNK_VOCAB


def lean_activations(E, model) -> bool:
    """backend.embedded.lean_activations for `model`: 'auto' from a vocabulary of AUTO_CHUNK_VOCAB on (the
    toys keep autograd's own saved tensors), where the architecture is supported."""
    from stare_cli.backends import lean_activations as lean

    if E.lean_activations is False or not lean.supports(model):
        return False
    return E.lean_activations is True or real_vocabulary(model)


def old_pass(policy: Policy, layer, ro: StepRollouts, cfg: Recipe) -> OldPass:
    """Pack the kept responses, form mini-batches (of prompts) and their micro-batches (method
    layer), then one no-grad forward for the old log-probs and token entropies. With one mini-batch
    and one epoch (`fused_old_pass`) the training forwards give them (detached): with a single
    micro-batch its forward runs here; with several, step 6's do (`OldPass.deferred`), unless the
    method's batch transform must read them first."""
    import torch

    R, O, E = cfg.rollout, cfg.optim, cfg.backend.embedded
    samples = [d.sample for d in ro.kept]
    batch = pack(samples, policy.tok.pad_token_id, policy.device)
    lengths = batch["seq_len"].tolist()
    t_start = time.perf_counter()
    plan = layer.update_plan(lengths)
    share = (policy.device.type == "cpu") if E.share_prompts == "auto" else E.share_prompts
    one_update = E.fused_old_pass and O.ppo_epochs == 1 and len(plan) == 1
    if one_update and len(plan[0]) == 1:
        with policy.autocast():
            lp, en = token_logprobs_entropy(policy.model, batch, plan[0][0].rows, R.temperature,
                                            buckets=E.length_buckets, share_prompts=share,
                                            chunked_head=chunked_head(E, policy.model))
        return OldPass(batch, plan, lp.detach().float(), en.detach().float(), (lp, en), t_start)
    if one_update and not layer.transform_reads_policy:
        zeros = torch.zeros(batch["response_mask"].shape, device=policy.device)
        return OldPass(batch, plan, zeros, zeros.clone(), None, t_start, deferred=True)
    old_logp, entropy = old_logprobs_and_entropy(
        policy.model, batch, [c.rows for calls in plan for c in calls], R.temperature, policy.autocast,
        E.length_buckets, share, chunked_head(E, policy.model))
    return OldPass(batch, plan, old_logp, entropy, None, t_start)


def old_pass_metrics(old: OldPass, ro: StepRollouts) -> dict[str, float]:
    """The batch's token-mean entropy and the rollout-vs-trainer log-prob mismatch."""
    return {"entropy": old.H,
            **rollout_mismatch([d.sample.logprobs for d in ro.kept], old.old_logp, old.batch["response_mask"])}


# ------------------------------------------------------------------ 5. controller and transform
def controller_and_transform(layer, ro: StepRollouts, old: OldPass) -> tuple[TrainBatch, dict[str, float]]:
    """The STARE controller once per step from H, then the method layer's batch transform. A deferred old
    pass has no H yet: the controller runs in step 6, and the metrics that read pi_old come from there."""
    import torch

    from stare_cli.method.layer import BatchInputs

    stare_state, metrics = (None, {}) if old.deferred else layer.begin_step(old.H)
    bt = layer.transform_batch(BatchInputs(
        rewards=torch.tensor([d.reward for d in ro.kept]), group=torch.tensor([d.group for d in ro.kept]),
        mask=old.batch["response_mask"], old_log_prob=None if old.deferred else old.old_logp,
        entropy=None if old.deferred else old.entropy,
        finished=torch.tensor([d.sample.finished for d in ro.kept])), stare_state)
    return TrainBatch(stare_state, bt), {**metrics, **bt.metrics}


# ---------------------------------------------------------------------------------- 6. updates
def ppo_updates(policy: Policy, layer, old: OldPass, tb: TrainBatch, cfg: Recipe, step: int,
                rollout: Rollout) -> dict[str, float]:
    """ppo_epochs passes over the mini-batches: per mini-batch, the method layer's loss on each of
    its loss calls (`loss_calls`), grad clip, one optimizer step, the gradients freed; then one LR
    schedule step. A deferred old pass is complete after the first mini-batch's calls: then the
    controller reads H, and if its state is not the one the calls predicted they run again with it."""
    import torch

    O = cfg.optim
    bt, opt, scaler = tb.transformed, policy.opt, policy.scaler
    gen = torch.Generator().manual_seed(O.seed * 7919 + step)
    stats: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    grad_norms = []
    skipped = 0
    for _epoch in range(O.ppo_epochs):
        for calls in old.plan:
            g0 = gen.get_state()
            done = loss_calls(policy, layer, old, tb, calls, cfg, gen, step, record=old.deferred)
            if old.deferred:  # pi_old's log-probs and entropies are all in: the controller, once per step
                tb.stare_state, m = layer.begin_step(old.H)
                rerun = tb.stare_state != done.state
                metrics.update({**m, **layer.policy_metrics(bt.advantages, old.old_logp, old.entropy, bt.mask),
                                "fused/rerun": float(rerun)})
                old.deferred = False
                if rerun:  # the first micro-batch's entropy was on the other side of the batch's: its state
                    gen.set_state(g0)
                    done = loss_calls(policy, layer, old, tb, calls, cfg, gen, step, record=False)
            for k, v in done.stats.items():
                stats.setdefault(k, []).extend(v)
            stats.setdefault("loss", []).append(done.loss)
            if scaler:
                scaler.unscale_(opt)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), O.grad_clip)))
            if scaler:
                skipped += scaler_step(scaler, opt)
            else:
                opt.step()
            # freed now, not before the next backward: the next rollout and forward (whose saved activations
            # are the peak) run without the last update's gradients (0.5 GiB on the real model; issue 69)
            opt.zero_grad(set_to_none=True)
            rollout.version += 1
    metrics["lr"] = policy.sched.get_last_lr()[0]
    if scaler:  # fp16: optimizer steps the grad scaler skipped (an inf or NaN gradient), this training step
        metrics["actor/scaler_skipped"] = skipped
        metrics["actor/scaler_scale"] = float(scaler.get_scale())
    policy.sched.step()
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    for k, v in stats.items():
        metrics[k if k == "loss" or k.startswith("stare/") else f"actor/{k}"] = sum(v) / len(v)
    metrics["micro_batches"] = sum(len(calls) for calls in old.plan)
    return metrics


@dataclass
class CallsDone:
    """One mini-batch's loss calls done: its loss (the sum of the calls' scaled losses), each call's
    stats, and the controller state they used."""

    loss: float
    stats: dict[str, list[float]]
    state: Any  # StareState or None


def loss_calls(policy: Policy, layer, old: OldPass, tb: TrainBatch, calls: list, cfg: Recipe, gen, step: int,
               record: bool) -> CallsDone:
    """Forward, the method layer's loss (normalised and scaled as the plan says) and backward of each
    loss call of one mini-batch; gradients accumulate from zero. With `record` (a deferred old pass)
    each forward's log-probs and entropies are also pi_old's, recorded in `old`, and the calls use the
    controller state that the first call's token entropy predicts (`layer.peek_step`)."""
    from stare_cli.method.layer import LossInputs

    R, E = cfg.rollout, cfg.backend.embedded
    share = (policy.device.type == "cpu") if E.share_prompts == "auto" else E.share_prompts
    bt, scaler = tb.transformed, policy.scaler
    mini = [i for c in calls for i in c.rows]
    state = tb.stare_state
    policy.opt.zero_grad(set_to_none=True)
    total, stats = 0.0, {}
    for j, call in enumerate(calls):
        idx = call.rows
        if old.fused:
            lp, en = old.current
        else:
            with policy.autocast():
                lp, en = token_logprobs_entropy(policy.model, old.batch, idx, R.temperature,
                                                need_entropy=layer.needs_entropy_in_loss or record,
                                                buckets=E.length_buckets, share_prompts=share,
                                                chunked_head=chunked_head(E, policy.model))
        if record:
            old.old_logp[idx], old.entropy[idx] = lp.detach().float(), en.detach().float()
            if j == 0:
                state = layer.peek_step(old.H_of(idx))
        loss, st = layer.loss(LossInputs(
            log_prob=lp.float(), old_log_prob=old.old_logp[idx], advantages=bt.advantages[idx],
            mask=bt.mask[idx], agg=layer.call_agg(call, bt.mask, mini), entropy=None if en is None else en.float(),
            stare=state, generator=gen, step=step + 1))
        loss = loss * call.scale if call.scale != 1.0 else loss
        (scaler.scale(loss) if scaler else loss).backward()
        for k, v in st.items():
            stats.setdefault(k, []).append(float(v))
        total += float(loss.detach())
    return CallsDone(total, stats, state)


def scaler_step(scaler, opt) -> int:
    """fp16's optimizer step through its grad scaler; returns 1 where the scaler skipped it (the unscaled
    gradients held an inf or NaN, so it lowered its scale instead of stepping), else 0."""
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return int(scaler.get_scale() < before)


# ------------------------------------------------------------------------------------ 7. records
def write_samples(cfg: Recipe, run_dir: Path, step: int, ro: StepRollouts) -> None:
    """The first 64 kept responses of the step, every logging.samples_every steps."""
    if not (cfg.logging.samples_every and step % cfg.logging.samples_every == 0):
        return
    with open(run_dir / "samples" / f"step-{step:06d}.jsonl", "w") as f:
        for d in ro.kept[:64]:
            f.write(json.dumps({"group": d.group, "reward": d.reward, "acc": d.acc,
                                "finished": d.sample.finished, "response": d.sample.text}) + "\n")


def trainer_state(pos: Position, layer) -> dict:
    """What a checkpoint keeps besides weights and optimizer: where the loop stands, the controller."""
    return {"step": pos.step, "cursor": pos.cursor, "method": layer.spec.name,
            "controller": layer.controller.state_dict() if layer.controller is not None else None}


def _finish_step(run_dir, step, metrics, t_step, t_gen, t_score, t_train, log, wb, t_eval: float = 0.0) -> None:
    """The step's metrics row (time/step: rollout, scoring and training, without the evaluation, which
    `time/eval` gives), the progress line, wandb."""
    metrics.update({"time/generate": t_gen, "time/score": t_score, "time/train": t_train,
                    "time/step": time.perf_counter() - t_step - t_eval, **peak_memory()})
    row = {"step": step, **metrics}
    append_jsonl(run_dir / "metrics.jsonl", row)
    log.log(step, metrics)
    if wb is not None:
        wb.log(metrics, step=step)


def peak_memory() -> dict[str, float]:
    """The process's peak so far, for the metrics row: `memory/peak_rss_gib` (Linux: VmHWM) and, with CUDA,
    `memory/cuda_peak_gib` (torch.cuda.max_memory_allocated): what `stare train --dry-run` plans."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["memory/peak_rss_gib"] = int(line.split()[1]) / 2**20
    except OSError:
        pass
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def evaluations_left(cfg: Recipe, step: int) -> int:
    """Evaluations still to run after `step` (every eval.every steps, and at the last step)."""
    E, total = cfg.eval, cfg.optim.total_steps
    if not E.benchmarks or step >= total:
        return 0
    return len({s for s in range(step + 1, total + 1) if (E.every and s % E.every == 0) or s == total})


def _eval_summary(m: dict) -> str:
    """'words:add-sub avg 33.6% (len 24)' for the eval/<bench>/acc entries of a metrics row."""
    parts = []
    for k, v in m.items():
        if k.startswith("eval/") and k.endswith("/acc"):
            bench = k[5:-4]
            ln = m.get(f"eval/{bench}/len")
            parts.append(f"{bench} avg {100 * v:.1f}%" + (f" (mean length {ln:.0f})" if ln is not None else ""))
    return ", ".join(parts) or "no benchmark"


def finish_summary(run_dir: Path, cfg: Recipe) -> list[str]:
    """What a finished run prints last: its last metrics, held-out accuracy at the first and the last
    evaluation, and where its card is (`stare train` then writes and names the run's plot)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        return []
    last = rows[-1]
    keys = [k for k in ("reward", "acc", "entropy", "len/mean", "stare/gate") if k in last]
    out = [f"done: {last['step']} steps; last step: " + ", ".join(f"{k} {last[k]:.3g}" for k in keys)]
    evals = run_eval_points(run_dir)
    shown = evals[:1] + evals[-1:] if len(evals) > 1 else evals
    if shown:
        out.append("held-out: " + "; ".join(f"step {r['step']}: {_eval_summary(r)}" for r in shown))
    out.append(f"card: {run_dir / 'REPRODUCE.md'}")
    return out


def _evaluate(engine, eval_grader, cfg: Recipe, tok, use_chat, step: int, run_dir: Path, tools=None,
              lr: Optional[float] = None) -> dict:
    """Evaluate the live model on the recipe's benchmarks through the training rollout path (the same
    engine, tools and stop rules) and each benchmark's own protocol where the recipe leaves it open
    (n, temperature, top_p); results land in run_dir/eval/step-N/<bench>/ (the ledger's record,
    results.json, samples.jsonl; the identity names the run's method, recipe, step and `lr`, the learning
    rate of the step just trained) and the metrics row gets eval/<bench>/acc (avg@n as a fraction) and
    eval/<bench>/len."""
    import yaml

    from benchmarks.evaluation.evaluate import EvalSettings, evaluate_benchmark
    from benchmarks.data.registry import check_benchmark
    from stare_kernel.ledger import run_fields

    E = cfg.eval
    run = {"dir": str(run_dir), "train_seed": cfg.optim.seed, "step": step, "lr": lr,
           **run_fields(yaml.safe_load((run_dir / "config.yaml").read_text()))}
    out = {}
    for bench in E.benchmarks:
        spec = check_benchmark(bench)
        s = EvalSettings(model=f"{run_dir}@step-{step}", bench=bench, template=cfg.data.template.value,
                         n=E.n or spec.n, temperature=spec.temperature if E.temperature is None else E.temperature,
                         top_p=spec.top_p if E.top_p is None else E.top_p,
                         max_tokens=E.max_tokens or cfg.rollout.max_response_tokens, seed=cfg.optim.seed,
                         engine=engine.name, limit=E.limit)
        res = evaluate_benchmark(engine, tok, s, run_dir / "eval" / f"step-{step:06d}" / dir_name(bench),
                                 eval_grader, use_chat_template=use_chat, tools=tools,
                                 reflection_words=cfg.logging.reflection_words, run=run)
        m = res["metrics"]
        out[f"eval/{bench}/acc"] = m[f"avg@{m['n']}"] / 100
        out[f"eval/{bench}/len"] = m["len/mean"]
        if tools is not None:
            out[f"eval/{bench}/tool_calls"] = m.get("tool_calls", 0.0)
    return out


def _wandb_init(cfg: Recipe, run_dir: Path):
    if cfg.logging.wandb == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        print("wandb is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
        return None
    return wandb.init(project=cfg.logging.project, name=cfg.logging.run_name or run_dir.name, dir=str(run_dir),
                      mode=cfg.logging.wandb, config=cfg.model_dump(mode="json"), reinit=True)
