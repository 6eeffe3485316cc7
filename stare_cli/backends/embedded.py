"""The embedded backend: one process, PyTorch + transformers, CPU or one CUDA GPU.

`train()` is one flat loop that reads top to bottom; everything a method decides comes from the
method layer (stare_cli/method_layer.py), the same object verl's processes use. Each step:
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
  7. metrics, samples, evaluation (the training rollout path: same engine and tools) and checkpoints

Forwards: each row is prompt + response from position 0, right-padded, so causal attention needs
no padding mask, and rows go through the model in length-sorted buckets, each padded only to its
own longest row (`token_logprobs_entropy`; toy: 1.22x faster than one padded forward). On the CPU
the responses of a prompt also share one forward of that prompt (its key/value cache), the same
values up to float rounding (`backend.embedded.share_prompts`). The results are reassembled in
batch order before the loss, so batch-level selections (STARE sets, top-entropy masks,
Clip-Cov/KL-Cov) see the same tensors as with one forward.

Determinism: sampling is seeded per (seed, step, generation batch), data order by (seed, epoch),
so a resumed run repeats an uninterrupted one exactly on CPU. Checkpoints are written to a
temporary directory and renamed; `checkpoints/latest` is a symlink swapped atomically.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
import random
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from stare_cli.config import Recipe
from stare_cli.errors import StareError
from benchmarks.metrics import reflection_rate
from benchmarks.registry import dir_name
from stare_cli.resume import ResumePlan, no_checkpoint_error, set_aside
from stare_cli.signals import StopAtStepBoundary
from stare_cli.runs import (STATE as RUN_STATE, append_jsonl, atomic_write_text, checkpoint_steps, clean_stale_temporaries,
                            fsync_dir, fsync_tree, hold_run_lock, new_run_dir, read_jsonl, record_config, usable_checkpoint,
                            write_manifest, write_run_meta)



# ------------------------------------------------------------------------------------------ data
def load_prompts(cfg: Recipe) -> list[dict]:
    """Training rows {'problem', 'answer'} from a toy task, a local file or a hub dataset."""
    src = cfg.data.train
    if src.startswith("toy:"):
        from stare_cli.toy import train_problems

        try:
            return train_problems(src.split(":", 1)[1], cfg.data.max_samples or 20000)
        except StareError as e:
            raise StareError(f"data.train: {e}") from None
    path = Path(src)
    try:
        import datasets

        if path.suffix in (".jsonl", ".json", ".parquet"):
            if not path.exists():
                raise StareError(f"data.train: file '{src}' not found")
            ds = datasets.load_dataset("parquet" if path.suffix == ".parquet" else "json", data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(src, cfg.data.subset, split=cfg.data.split)
    except StareError:
        raise
    except Exception as e:
        raise StareError(
            f"data.train: cannot load '{src}' ({type(e).__name__}: {str(e)[:200]})",
            hint="point data.train at a local .jsonl/.parquet file when the hub cannot be reached",
        ) from None
    rows = []
    for r in ds:
        if cfg.data.prompt_field not in r or cfg.data.answer_field not in r:
            raise StareError(
                f"data.train: rows of '{src}' lack '{cfg.data.prompt_field}' or '{cfg.data.answer_field}'",
                hint=f"set data.prompt_field / data.answer_field; fields here: {', '.join(r)}",
            )
        prompt = r[cfg.data.prompt_field]
        if isinstance(prompt, list):  # chat-format rows: take the user turn
            prompt = next((m["content"] for m in prompt if m.get("role") == "user"), str(prompt))
        rows.append({"problem": str(prompt), "answer": str(r[cfg.data.answer_field])})
        if cfg.data.max_samples and len(rows) >= cfg.data.max_samples:
            break
    if not rows:
        raise StareError(f"data.train: '{src}' has no rows")
    return rows


@functools.lru_cache(maxsize=4)  # take_prompts asks once per prompt; shuffle once per epoch
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def take_prompts(rows: list[dict], cursor: int, k: int, seed: int, shuffle: bool) -> tuple[list[dict], int]:
    """k rows starting at global position `cursor` (epochs are seeded permutations)."""
    out = []
    for pos in range(cursor, cursor + k):
        epoch, i = divmod(pos, len(rows))
        out.append(rows[epoch_order(len(rows), seed, epoch, shuffle)[i]])
    return out, cursor + k


def resolve_model_path(path: str) -> str:
    if path.startswith("toy:"):
        from stare_cli.toy import ensure_toy_model

        return str(ensure_toy_model(path.split(":", 1)[1]))
    return path


# ------------------------------------------------------------------------------------ tensor ops
# The fixed cost of one more forward/backward in `length_buckets`, in padded-token equivalents.
# Measured on the CPU toy (one thread): see benchmarks/perf/length_buckets.py.
BUCKET_OVERHEAD_TOKENS = 128


def length_buckets(lengths: list[int], overhead_tokens: Optional[int] = None) -> list[list[int]]:
    """Split rows into buckets of similar length, each to be padded only to its own longest row.

    lengths: [B] tokens per row. Sorted by length, contiguous runs are chosen by dynamic programming
    to minimise padded tokens (rows x longest row, summed over buckets) plus `overhead_tokens` per
    bucket, the fixed cost of one more forward/backward. Returns row indices per bucket, shortest first.
    """
    if overhead_tokens is None:
        overhead_tokens = BUCKET_OVERHEAD_TOKENS
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    ls = [lengths[i] for i in order]
    n = len(ls)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: cheapest split of the j shortest rows
        for i in range(j):
            c = best[i] + (j - i) * ls[j - 1] + overhead_tokens
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j]:j])
        j = cut[j]
    return out[::-1]


def token_logprobs_entropy(model, batch: dict, rows, temperature: float, need_entropy: bool = True,
                           buckets: bool = True, share_prompts: bool = False):
    """log pi(o_t) and entropy H_t at the response positions of batch rows `rows`: [len(rows), T]
    each (T = the batch's longest response), 0 past a row's response.

    batch: from `pack` (each row prompt + response from position 0, right-padded). With `buckets`
    the rows go through the model in length-sorted buckets (`length_buckets`), each cut to its own
    longest row; otherwise in one forward. Either way no attention mask is needed: right padding only
    follows the real tokens, which causal attention never lets them see. Logits are divided by the
    sampling temperature, as the rollout distribution (verl does too).

    With `share_prompts`, rows whose prompt is the same (a GRPO group's n responses) share one
    forward of that prompt: `_shared_prompt_logprobs_entropy`. Same numbers up to float rounding,
    fewer tokens through the model.
    """
    rows = [int(r) for r in rows]
    if share_prompts and len(set(batch["prompt_group"][rows].tolist())) < len(rows):
        return _shared_prompt_logprobs_entropy(model, batch, rows, temperature, need_entropy, buckets)
    return _row_logprobs_entropy(model, batch, rows, temperature, need_entropy, buckets)


def _inverse(pos: list[int]) -> list[int]:
    """The inverse permutation: where each original index sits in `pos` (bucket order)."""
    inv = [0] * len(pos)
    for k, i in enumerate(pos):
        inv[i] = k
    return inv


def _row_logprobs_entropy(model, batch: dict, rows: list[int], temperature: float, need_entropy: bool,
                          buckets: bool):
    """`token_logprobs_entropy` with each row's prompt and response in one sequence."""
    import torch

    ids_all = batch["input_ids"]
    plens, slens = batch["prompt_len"].tolist(), batch["seq_len"].tolist()  # host tensors: no device sync
    T = batch["response_mask"].shape[1]
    lens = [slens[r] for r in rows]
    groups = length_buckets(lens) if buckets else [list(range(len(rows)))]
    pos = [i for g in groups for i in g]  # positions in `rows`, bucket by bucket
    order = [rows[i] for i in pos]
    inv = _inverse(pos)
    # One host-to-device copy: batch rows in bucket order, their prompt and response lengths, and
    # where each of `rows` lands in that order (every copy waits for the GPU's queue).
    idx_all, p_all, rlen_all, inv_t = torch.tensor(
        [order, [plens[r] for r in order], [slens[r] - plens[r] for r in order], inv], device=ids_all.device)
    j = torch.arange(T, device=ids_all.device)
    lps, ents = [], []
    start = 0
    for g in groups:
        sl = slice(start, start + len(g))
        start += len(g)
        L, p0 = max(slens[r] for r in order[sl]), min(plens[r] for r in order[sl])
        if L == p0:  # only empty responses: nothing to score
            lps.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            ents.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            continue
        ids, p = ids_all[idx_all[sl], :L], p_all[sl]
        # Logits only where they predict response tokens: positions p0-1 .. L-2 predict tokens p0 .. L-1.
        logits = model(input_ids=ids, logits_to_keep=L - p0 + 1).logits[:, :-1].float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        lp_pos = logp_all.gather(-1, ids[:, p0:].unsqueeze(-1)).squeeze(-1)  # [b, L - p0]
        col = ((p - p0)[:, None] + j[None]).clamp(max=L - p0 - 1)  # response token j of a row sits at p + j
        valid = (j[None] < rlen_all[sl, None]).float()
        lps.append(lp_pos.gather(1, col) * valid)
        if need_entropy:
            ent_pos = -(logp_all.exp() * logp_all).sum(-1)
            ents.append(ent_pos.gather(1, col) * valid)
    return torch.cat(lps)[inv_t], (torch.cat(ents)[inv_t] if need_entropy else None)


def _shared_prompt_logprobs_entropy(model, batch: dict, rows: list[int], temperature: float, need_entropy: bool,
                                    buckets: bool):
    """`token_logprobs_entropy` with each distinct prompt through the model once.

    1. The distinct prompts of `rows`, left-padded to the longest (P tokens, positions from 0 at each
       prompt's first token), in one forward that keeps its key/value cache and the logits of the last
       prompt token (they predict response token 0).
    2. The responses, in buckets by response length (`length_buckets`): each row's prompt cache is
       selected (autograd adds the gradients of a group's rows into its prompt), and response tokens
       0 .. R-2 run on top of it with their own positions; their logits predict tokens 1 .. R-1. A
       row's last token predicts nothing and is not run.
    On the toy (16 prompts x 8 responses, prompts a quarter of a row) a training step's forward and
    backward cost 18% less (benchmarks/perf/trainer_vs_trl.py). Needs a model whose cache is
    transformers' per-layer key/value `DynamicCache`; otherwise the row path runs.
    """
    import torch
    from transformers import DynamicCache

    ids_all = batch["input_ids"]
    dev = ids_all.device
    plens, slens = batch["prompt_len"].tolist(), batch["seq_len"].tolist()
    group_of = batch["prompt_group"].tolist()
    T = batch["response_mask"].shape[1]
    first_row: dict[int, int] = {}  # prompt group -> its first row among `rows`
    for r in rows:
        first_row.setdefault(group_of[r], r)
    prefix_of = {g: k for k, g in enumerate(first_row)}
    reps = list(first_row.values())
    P = max(plens[r] for r in reps)
    # [U, P] left-padded prompts; column c of prompt u holds its token c - (P - p_u) (pad before 0).
    src_col = torch.tensor([[c - (P - plens[r]) for c in range(P)] for r in reps], device=dev)
    pmask = (src_col >= 0).long()
    pids = ids_all[torch.tensor(reps, device=dev)].gather(1, src_col.clamp(min=0)) * pmask
    cache = DynamicCache()
    out = model(input_ids=pids, attention_mask=pmask, position_ids=src_col.clamp(min=0), past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    layers = getattr(out.past_key_values, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return _row_logprobs_entropy(model, batch, rows, temperature, need_entropy, buckets)
    prefix_kv = [(layer.keys, layer.values) for layer in layers]
    first_logits = out.logits[:, -1]  # [U, V]: predicts each prompt's response token 0

    rlens = [slens[r] - plens[r] for r in rows]
    groups = length_buckets(rlens) if buckets else [list(range(len(rows)))]
    j = torch.arange(T, device=dev)
    lps, ents, pos = [], [], []
    for g in groups:
        pos += g
        R = max(rlens[i] for i in g)
        if R == 0:  # only empty responses: nothing to score
            lps.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            ents.append(ids_all.new_zeros(len(g), T, dtype=torch.float32))
            continue
        brows = [rows[i] for i in g]
        src, row_t, p = torch.tensor([[prefix_of[group_of[r]] for r in brows], brows, [plens[r] for r in brows]],
                                     device=dev)
        # Response token k of a row sits at column p + k of its packed row (clamped: padding past the end).
        cols = (p[:, None] + j[None, :R]).clamp(max=ids_all.shape[1] - 1)
        resp = ids_all[row_t].gather(1, cols)  # [b, R]
        logits = first_logits[src][:, None]
        if R > 1:
            bucket_cache = DynamicCache()
            for li, (k, v) in enumerate(prefix_kv):
                bucket_cache.update(k[src], v[src], li)
            mask = torch.cat([pmask[src], pmask.new_ones(len(g), R - 1)], 1)
            more = model(input_ids=resp[:, :-1], attention_mask=mask, position_ids=p[:, None] + j[None, :R - 1],
                         past_key_values=bucket_cache, use_cache=True).logits
            logits = torch.cat([logits, more], 1)
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [b, R, V]
        valid = (j[None, :R] < torch.tensor([rlens[i] for i in g], device=dev)[:, None]).float()
        lps.append(torch.nn.functional.pad(logp_all.gather(-1, resp.unsqueeze(-1)).squeeze(-1) * valid, (0, T - R)))
        if need_entropy:
            ents.append(torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1) * valid, (0, T - R)))
    inv_t = torch.tensor(_inverse(pos), device=dev)
    return torch.cat(lps)[inv_t], (torch.cat(ents)[inv_t] if need_entropy else None)


def pack(samples: list, pad_id: int, device) -> dict:
    """Tensors for a list of rollout samples: each row is prompt + response from position 0, right-padded.

    input_ids [B, L]; prompt_len, seq_len, prompt_group [B] (host tensors; rows with the same prompt
    tokens share a prompt_group); response_mask [B, T] (T: the longest response; 0 on padding and on
    tool observations).
    """
    import torch

    plens = [len(s.prompt_ids) for s in samples]
    slens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    groups: dict[tuple, int] = {}
    if min(plens) < 1:
        raise StareError("a rollout sample has an empty prompt", hint="the first response token needs a prompt token before it")
    L, T = max(slens), max(1, max(len(s.response_ids) for s in samples))
    ids, rmask = [], []
    for s in samples:
        p, r = s.prompt_ids, s.response_ids
        ids.append(list(p) + list(r) + [pad_id] * (L - len(p) - len(r)))
        # Tool observations are context, not actions: mask 0 keeps them out of the loss, the
        # entropy and the STARE token sets.
        lm = s.loss_mask if s.loss_mask is not None else [1] * len(r)
        rmask.append(list(lm) + [0] * (T - len(r)))
    return {
        "input_ids": torch.tensor(ids, device=device),
        "prompt_len": torch.tensor(plens),  # on the host: bucketing reads them without a device sync
        "seq_len": torch.tensor(slens),
        "prompt_group": torch.tensor([groups.setdefault(tuple(s.prompt_ids), len(groups)) for s in samples]),
        "response_mask": torch.tensor(rmask, dtype=torch.float32, device=device),
    }


# ----------------------------------------------------------------------------------- checkpoints
def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, scheduler, state: dict, keep_last: int) -> Path:
    """Write checkpoints/step-N: files into a temporary directory, a manifest of their sizes last,
    everything fsynced, renamed into place, then `latest` swapped to it (runs.py: the guarantees)."""
    import torch

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
    (tmp / RUN_STATE).write_text(json.dumps(state, indent=2))
    write_manifest(tmp)
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    link_tmp = ckpt_root / ".latest.tmp"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(final.name)
    os.replace(link_tmp, ckpt_root / "latest")
    fsync_dir(ckpt_root)
    for old in checkpoint_steps(run_dir)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------- logger
class StepLog:
    """Progress of a training run: a rich bar on a terminal, else one line per step on stderr; the
    lines (step, key metrics, rate, ETA) always go to the run directory's train.log too."""

    KEYS = ("reward", "acc", "entropy", "len/mean", "stare/gate", "time/step")

    def __init__(self, total: int, start: int, log_file: Optional[Path] = None):
        self.total, self.start = total, start
        self.t0 = time.time()
        self.tty = sys.stderr.isatty()
        self.file = open(log_file, "a") if log_file is not None else None
        self.progress = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.description}"), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("", total=total, completed=start)

    def line(self, step: int, m: dict) -> str:
        desc = "  ".join(f"{k} {m[k]:.3g}" for k in self.KEYS if k in m)
        elapsed = time.time() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        eta_txt = f"{int(eta // 60)}m{int(eta % 60):02d}s" if eta != float("inf") else "?"
        return f"step {step}/{self.total}  {desc}  {60 * rate:.2f} steps/min  ETA {eta_txt}"

    def log(self, step: int, m: dict) -> None:
        text = self.line(step, m)
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()
        if self.progress:
            self.progress.update(self.task, completed=step, description="  ".join(text.split("  ")[1:]))
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
        if self.file is not None:
            self.file.close()


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

    sample: Any  # benchmarks.engines.Sample
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

    from benchmarks.engines import SamplingParams
    from benchmarks.templates import build_prompt

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
                             share: bool):
    """Step 4: log pi_old and the token entropy of every row, one no-grad forward per part [B, T]."""
    import torch

    model.eval()
    B, T = batch["response_mask"].shape
    old = torch.zeros(B, T, device=batch["response_mask"].device)
    ent = torch.zeros_like(old)
    with torch.no_grad():
        for idx in parts:
            with autocast():
                lp, en = token_logprobs_entropy(model, batch, idx, temperature, buckets=buckets, share_prompts=share)
            old[idx], ent[idx] = lp.float(), en.float()
    model.train()
    return old, ent


def restore_trainer_state(ckpt: Path, opt, sched, layer, cfg: Recipe) -> tuple[int, int]:
    """Load the optimizer, scheduler, RNG and controller state of `ckpt`; return (step, data cursor).
    Then apply the recipe in effect: a resume may change optim.lr, weight_decay, the schedule or
    total_steps (recorded in config-history.jsonl), and torch's load_state_dict would otherwise bring
    back the old lr and weight decay."""
    import torch

    try:
        blob = torch.load(ckpt / "trainer.pt", weights_only=True)  # our own file; tensors only
    except Exception as e:  # noqa: BLE001 - any unreadable file: name it
        raise StareError(f"{ckpt / 'trainer.pt'}: unreadable ({type(e).__name__}: {str(e)[:120]})",
                         hint="resume from an earlier checkpoint: point checkpoints/latest at it") from None
    opt.load_state_dict(blob["optimizer"])
    sched.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    st = json.loads((ckpt / RUN_STATE).read_text())
    if layer.controller is not None and st.get("controller"):
        layer.controller.load_state_dict(st["controller"])
    O = cfg.optim
    sched.base_lrs = [O.lr for _ in opt.param_groups]
    for g in opt.param_groups:
        g["initial_lr"], g["weight_decay"] = O.lr, O.weight_decay
        g["lr"] = O.lr * sched.lr_lambdas[0](sched.last_epoch)
    sched._last_lr = [g["lr"] for g in opt.param_groups]
    return st["step"], st["cursor"]


def train(cfg: Recipe, out_root: Path | str = "runs", resume: Optional["ResumePlan"] = None) -> Path:
    """Train `cfg.method` under `cfg` with the embedded backend (with `resume`, continue that run
    from its newest intact checkpoint, `resume.recipe` being `cfg`). Returns the run directory.
    SIGINT/SIGTERM: the step finishes, a checkpoint is written, and Interrupted is raised."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from baselines import Agg
    from benchmarks.engines import HFEngine, load_tokenizer, use_gqa_sdpa_on_cpu
    from benchmarks.grading import Grader
    from stare_cli.method_layer import BatchInputs, LossInputs, MethodLayer

    hf_logging.disable_progress_bar()  # our own progress display owns the terminal
    hf_logging.set_verbosity_error()
    layer = MethodLayer.from_recipe(cfg)
    R, O = cfg.rollout, cfg.optim
    torch.set_num_threads(cfg.backend.embedded.threads)
    dev_name = cfg.backend.embedded.device
    if dev_name == "auto":
        dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    if dev_name == "cuda" and not torch.cuda.is_available():
        raise StareError("backend.embedded.device is 'cuda' but no CUDA device is visible", hint="use device: cpu")
    device = torch.device(dev_name)
    if O.precision == "fp16" and device.type != "cuda":
        raise StareError("optim.precision fp16 needs a CUDA device", hint="-o optim.precision=fp32 (or bf16) on CPU")
    if R.tools.enable:  # fail closed, before anything loads: the sandbox must isolate every call
        from stare_cli.sandbox import require_isolation

        require_isolation(tool_limits(R.tools))
    use_vllm = R.engine == "vllm" or (R.engine == "auto" and device.type == "cuda"
                                      and importlib.util.find_spec("vllm") is not None)
    if use_vllm:
        try:  # before loading the model: fail fast
            import vllm  # noqa: F401
        except ImportError:
            raise StareError("vLLM is not installed", hint="pip install 'stare[vllm]' on a GPU machine, "
                             "or -o rollout.engine=hf") from None

    # ---- run directory (new, resumed or restarted), model, optimizer
    ckpt = None
    if resume is not None:
        run_dir = resume.run_dir
        run_lock = hold_run_lock(run_dir)  # held until this process ends
        clean_stale_temporaries(run_dir)
        if resume.restart:
            set_aside(run_dir)
        else:
            ckpt, skipped = usable_checkpoint(run_dir)
            for why in skipped:
                print(f"warning: skipping checkpoint: {why}", file=sys.stderr)
            if ckpt is None:
                raise no_checkpoint_error(run_dir, skipped)
            if skipped:
                print(f"warning: resuming from {ckpt.name}", file=sys.stderr)
    else:
        run_dir = new_run_dir(cfg, out_root)
        run_lock = hold_run_lock(run_dir)
    model_path = str(ckpt) if ckpt is not None else resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(O.seed)
    # fp32 master weights always (an lr of 1e-6 barely moves bf16 weights); optim.precision sets the
    # compute dtype (autocast) and model.dtype the colocated vLLM engine's copy.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 trust_remote_code=cfg.model.trust_remote_code,
                                                 use_safetensors=True).to(device)
    model.train()
    use_gqa_sdpa_on_cpu(model)
    buckets = cfg.backend.embedded.length_buckets
    share = cfg.backend.embedded.share_prompts
    share = device.type == "cpu" if share == "auto" else share
    opt = torch.optim.AdamW(model.parameters(), lr=O.lr, weight_decay=O.weight_decay, betas=(0.9, 0.999))

    def lr_factor(step: int) -> float:
        if step < O.warmup_steps:
            return (step + 1) / O.warmup_steps
        frac = (step - O.warmup_steps) / max(1, O.total_steps - O.warmup_steps)
        return {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * frac)), "linear": 1.0 - frac}[O.schedule]

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    step, cursor = 0, 0
    if ckpt is not None:
        step, cursor = restore_trainer_state(ckpt, opt, sched, layer, cfg)
        # Drop metrics written after the checkpoint (a crash mid-way): the resumed run redoes them.
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) <= step]
        atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        record_config(run_dir, cfg, "resume", step, list(resume.overrides), resume.changed)
    else:
        write_run_meta(run_dir, cfg, {"backend": "embedded", "device": str(device), "model_path": model_path,
                                      "reward_grader": layer.reward_function().grader.tag})
        record_config(run_dir, cfg, "restart" if resume is not None else "start", 0,
                      list(resume.overrides) if resume is not None else [], resume.changed if resume else {})
    resuming = ckpt is not None

    rows = load_prompts(cfg)
    use_chat = cfg.model.chat_template == "auto"
    if use_vllm:  # colocated: vLLM keeps its own copy of the weights, refreshed before each use
        from benchmarks.engines import VLLMEngine

        engine = VLLMEngine(model_path, gpu_memory_utilization=R.vllm_gpu_memory_utilization,
                            dtype=cfg.model.dtype.value,
                            max_model_len=R.max_prompt_tokens + R.max_response_tokens,
                            trust_remote_code=cfg.model.trust_remote_code, max_prompt_tokens=R.max_prompt_tokens,
                            colocate=True, seed=O.seed)
    else:
        engine = HFEngine(model, tok, batch_size=max(1, R.gen_batch_size * R.n), max_prompt_tokens=R.max_prompt_tokens)
    weights = {"version": 0, "synced": 0 if not resuming else -1}  # optimizer steps taken / pushed to vLLM

    def sync_rollout_weights() -> None:
        if use_vllm and weights["synced"] != weights["version"]:
            with torch.no_grad():
                engine.load_weights((k, v.detach()) for k, v in model.state_dict().items())
            weights["synced"] = weights["version"]

    tools = _tool_spec(cfg)
    eval_grader = Grader(workers=0)  # evaluation: `stare eval`'s grader, with the fallbacks users expect
    wb = _wandb_init(cfg, run_dir)
    log = StepLog(O.total_steps, step, run_dir / "train.log")

    def autocast():
        if O.precision == "fp32":
            return nullcontext()
        return torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[O.precision])

    scaler = torch.amp.GradScaler("cuda") if O.precision == "fp16" else None
    stop = StopAtStepBoundary(lambda: f"step {step + 1} of {O.total_steps}").install()

    try:
        while step < O.total_steps:
            t_step = time.perf_counter()
            metrics: dict[str, Any] = {}
            # ---- 1-3. rollout, reward (method layer), dynamic sampling until the train batch fills
            ro, cursor = collect_rollouts(layer, engine, rows, cursor, step, cfg, tok, use_chat, tools,
                                          sync_rollout_weights)
            metrics.update(ro.metrics)
            if (ro.n_groups < ro.groups_wanted and layer.cfg.dynamic_sampling and R.refill == "gen_batches"
                    and R.on_short_batch == "error"):
                raise StareError(
                    f"step {step + 1}: {R.max_gen_batches} generation batches kept {ro.n_groups} groups with varied "
                    f"accuracy, fewer than optim.train_batch_size ({O.train_batch_size})",
                    hint="raise rollout.max_gen_batches, or -o rollout.on_short_batch=train to train on what was kept "
                         "(the official trainer stops here too)")
            t_train = 0.0
            if not ro.kept:  # every group was all-equal: nothing to learn; samples/eval/checkpoint still run
                metrics.update({"lr": sched.get_last_lr()[0], "skipped": 1})
                step += 1
                with warnings.catch_warnings():  # the schedule counts steps, taken or skipped (torch warns
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
                    sched.step()  # when a skip comes before the first optimizer step)
            else:
                samples = [d.sample for d in ro.kept]
                batch = pack(samples, tok.pad_token_id, device)
                lengths = batch["seq_len"].tolist()
                t_train0 = time.perf_counter()
                # ---- 4. old log-probs and token entropies. On-policy with a single micro-batch the
                # training forward itself gives them (detached): one forward instead of two, same numbers.
                resp_per_mini = O.mini_batch_size * R.n
                minis = [list(range(m0, min(m0 + resp_per_mini, len(samples))))
                         for m0 in range(0, len(samples), resp_per_mini)]
                parts = {tuple(mini): [[mini[i] for i in mb] for mb in layer.micro_batches([lengths[i] for i in mini])]
                         for mini in minis}
                fused = O.ppo_epochs == 1 and len(minis) == 1 and len(parts[tuple(minis[0])]) == 1
                if fused:
                    with autocast():
                        lp_cur, en_cur = token_logprobs_entropy(model, batch, minis[0], R.temperature, buckets=buckets,
                                                                share_prompts=share)
                    old_logp, entropy = lp_cur.detach().float(), en_cur.detach().float()
                else:
                    old_logp, entropy = old_logprobs_and_entropy(
                        model, batch, [mb for mini in minis for mb in parts[tuple(mini)]], R.temperature, autocast, buckets,
                        share)
                resp_mask = batch["response_mask"]
                H = float((entropy * resp_mask).sum() / resp_mask.sum().clamp(min=1))
                metrics["entropy"] = H
                metrics.update(rollout_mismatch([s.logprobs for s in samples], old_logp, resp_mask))

                # ---- 5. controller (once per step) and the batch transform (method layer)
                stare_state, m = layer.begin_step(H)
                metrics.update(m)
                bt = layer.transform_batch(BatchInputs(
                    rewards=torch.tensor([d.reward for d in ro.kept]), group=torch.tensor([d.group for d in ro.kept]),
                    mask=resp_mask, old_log_prob=old_logp, entropy=entropy,
                    finished=torch.tensor([s.finished for s in samples])), stare_state)
                metrics.update(bt.metrics)

                # ---- 6. PPO updates: mini-batches of prompts, micro-batches (method layer), its loss
                need_ent = layer.needs_entropy_in_loss
                gen = torch.Generator().manual_seed(O.seed * 7919 + step)
                stats_acc: dict[str, list[float]] = {}
                grad_norms = []
                for _epoch in range(O.ppo_epochs):
                    for mini in minis:
                        agg = Agg(layer.cfg.loss_agg, num_tokens=max(float(bt.mask[mini].sum()), 1.0),
                                  num_seqs=max(float((bt.mask[mini].sum(-1) > 0).sum()), 1.0),
                                  scale=R.max_response_tokens)
                        opt.zero_grad(set_to_none=True)
                        for idx in parts[tuple(mini)]:
                            if fused:
                                lp, en = lp_cur, en_cur
                            else:
                                with autocast():
                                    lp, en = token_logprobs_entropy(model, batch, idx, R.temperature, need_entropy=need_ent,
                                                                    buckets=buckets, share_prompts=share)
                            loss, st = layer.loss(LossInputs(
                                log_prob=lp.float(), old_log_prob=old_logp[idx], advantages=bt.advantages[idx],
                                mask=bt.mask[idx], agg=agg, entropy=None if en is None else en.float(),
                                stare=stare_state, generator=gen))
                            (scaler.scale(loss) if scaler else loss).backward()
                            for k, v in st.items():
                                stats_acc.setdefault(k, []).append(float(v))
                            stats_acc.setdefault("loss", []).append(float(loss.detach()))
                        if scaler:
                            scaler.unscale_(opt)
                        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), O.grad_clip)
                        grad_norms.append(float(gn))
                        if scaler:
                            scaler.step(opt)
                            scaler.update()
                        else:
                            opt.step()
                        weights["version"] += 1
                metrics["lr"] = sched.get_last_lr()[0]
                sched.step()
                metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
                for k, v in stats_acc.items():
                    metrics[k if k == "loss" or k.startswith("stare/") else f"actor/{k}"] = sum(v) / len(v)
                metrics["micro_batches"] = sum(len(p) for p in parts.values())
                t_train = time.perf_counter() - t_train0
                step += 1

            # ---- 7. samples, metrics, evaluation, checkpoint
            if cfg.logging.samples_every and step % cfg.logging.samples_every == 0:
                with open(run_dir / "samples" / f"step-{step:06d}.jsonl", "w") as f:
                    for d in ro.kept[:64]:
                        f.write(json.dumps({"group": d.group, "reward": d.reward, "acc": d.acc,
                                            "finished": d.sample.finished, "response": d.sample.text}) + "\n")
            if cfg.eval.benchmarks and ((cfg.eval.every and step % cfg.eval.every == 0) or step == O.total_steps):
                sync_rollout_weights()
                metrics.update(_evaluate(engine, eval_grader, cfg, tok, use_chat, step, run_dir, tools))
            _finish_step(run_dir, step, metrics, t_step, ro.t_gen, ro.t_score, t_train, log, wb)
            stopping = stop.signum is not None  # SIGINT/SIGTERM during this step: checkpoint, then stop
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == O.total_steps or stopping:
                state = {"step": step, "cursor": cursor, "method": layer.spec.name,
                         "controller": layer.controller.state_dict() if layer.controller is not None else None}
                save_checkpoint(run_dir, step, model, tok, opt, sched, state, cfg.checkpoint.keep_last)
            stop.check(lambda: f"interrupted at step {step} (checkpoint written); "
                               f"resume with: stare train --resume {run_dir}")
    finally:
        stop.restore()
        log.close()
        run_lock.close()
        layer.close()
        eval_grader.close()
        if wb is not None:
            wb.finish()
    return run_dir


def _tool_spec(cfg: Recipe):
    """The multi-turn tool settings of the recipe (None when tools are off)."""
    t = cfg.rollout.tools
    if not t.enable:
        return None
    from benchmarks.tools import ToolSpec

    return ToolSpec(format=t.format, max_turns=t.max_turns, limits=tool_limits(t), system_prompt=t.system_prompt)


def tool_limits(t) -> "Limits":
    """The sandbox limits of a recipe's rollout.tools section."""
    from stare_cli.sandbox import Limits

    return Limits(cpu_s=t.cpu_s, wall_s=t.wall_s, memory_mb=t.memory_mb, output_bytes=t.output_bytes,
                  file_mb=t.file_mb, nproc=t.nproc, python=t.python, unsafe_no_isolation=t.unsafe_no_isolation)


def _finish_step(run_dir, step, metrics, t_step, t_gen, t_score, t_train, log, wb) -> None:
    metrics.update({"time/generate": t_gen, "time/score": t_score, "time/train": t_train,
                    "time/step": time.perf_counter() - t_step})
    row = {"step": step, **metrics}
    append_jsonl(run_dir / "metrics.jsonl", row)
    log.log(step, metrics)
    if wb is not None:
        wb.log(metrics, step=step)


def _evaluate(engine, eval_grader, cfg: Recipe, tok, use_chat, step: int, run_dir: Path, tools=None) -> dict:
    """Evaluate the live model on the recipe's benchmarks through the training rollout path (the same
    engine, tools and stop rules) and each benchmark's own protocol where the recipe leaves it open
    (n, temperature, top_p); results land in run_dir/eval/step-N/<bench>/ (results.json,
    samples.jsonl) and the metrics row gets eval/<bench>/acc (avg@n as a fraction) and eval/<bench>/len."""
    from benchmarks.evaluate import EvalSettings, evaluate_benchmark
    from benchmarks.registry import check_benchmark

    E = cfg.eval
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
                                 reflection_words=cfg.logging.reflection_words)
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
