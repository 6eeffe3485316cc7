"""Speed on a real model (SmolLM2-135M-Instruct, `stare model get smollm2-135m`), measured side by side
in one run and printed as ratios. Run alone on a quiet machine, one torch thread (OMP_NUM_THREADS=1).

    python benchmarks/perf/real_model.py generate   # our HF engine vs transformers' generate, same batch
    python benchmarks/perf/real_model.py matmul     # the training step's matrix products vs MKL alone
    python benchmarks/perf/real_model.py train      # our training step vs TRL's GRPOTrainer (.venv-trl:
                                                    #   python benchmarks/perf/trainer_vs_trl.py --setup)
    .venv-vllm/bin/python benchmarks/perf/real_model.py vllm   # our vLLM path vs vLLM's own LLM.generate

Workload (the real-model recipe's, recipes/small/smollm2-135m-words.yaml): 16 word problems under
the `short` template through the model's chat template, n samples each, temperature 0.6, top_p 1,
at most 64 new tokens. Targets (issue 28): vLLM path >= 0.9x vLLM's own, HF engine >= 1.5x
transformers' generate, training step >= 1.5x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS, N, MAX_NEW, TEMPERATURE = 16, 4, 64, 0.6


def _prompts(tok) -> list[str]:
    from benchmarks.data.words import problems
    from benchmarks.generation.templates import build_prompt

    return [build_prompt(r["problem"], "short", tok, True) for r in problems(PROMPTS, seed=4242)]


def _load():
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.data.models import ensure_model
    from benchmarks.generation.attention import use_gqa_sdpa_on_cpu
    from benchmarks.generation.engines import load_tokenizer

    torch.set_num_threads(1)
    path = ensure_model("smollm2-135m")
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    use_gqa_sdpa_on_cpu(model)
    return path, tok, model


def generate(rounds: int) -> None:
    """Tokens per second (response tokens through the first EOS) of one call on the same 64 rows."""
    import torch

    from benchmarks.generation.engines import HFEngine, SamplingParams

    _, tok, model = _load()
    prompts = _prompts(tok)
    engine = HFEngine(model, tok, batch_size=PROMPTS * N)
    ids = engine.encode(prompts)
    eos = engine.eos_ids()
    rows = [x for x in ids for _ in range(N)]
    L = max(len(x) for x in rows)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in rows])
    attn = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in rows])
    res: dict[str, list[float]] = {"ours": [], "transformers": []}
    for r in range(rounds):  # alternate: drift on a shared machine hits both alike
        t = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=N, temperature=TEMPERATURE, top_p=1.0,
                                                         max_new_tokens=MAX_NEW, seed=r))
        dt = time.perf_counter() - t
        res["ours"].append(sum(len(s.response_ids) for g in groups for s in g) / dt)
        torch.manual_seed(r)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attn, do_sample=True, temperature=TEMPERATURE,
                                 top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=pad)
        dt = time.perf_counter() - t
        new = out[:, L:].tolist()
        useful = sum(next((j + 1 for j, x in enumerate(row) if x in eos), len(row)) for row in new)
        res["transformers"].append(useful / dt)
        print(f"round {r + 1}: ours {res['ours'][-1]:.1f} tok/s, transformers generate {res['transformers'][-1]:.1f} "
              f"tok/s -> {res['ours'][-1] / res['transformers'][-1]:.2f}x", flush=True)
    o, t = statistics.median(res["ours"]), statistics.median(res["transformers"])
    print(f"HF engine vs transformers' generate ({PROMPTS} prompts x {N}, {MAX_NEW} new tokens, T {TEMPERATURE}): "
          f"{o:.1f} vs {t:.1f} tok/s = {o / t:.2f}x (target >= 1.5x)")


def vllm(rounds: int) -> None:
    """Our VLLMEngine.generate against vLLM's own LLM.generate on the same engine instance, prompts
    (as token ids, as our engine passes them) and sampling settings: the cost of our wrapper."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams as VSP

    from benchmarks.data.models import ensure_model
    from benchmarks.generation.engines import SamplingParams, VLLMEngine

    engine = VLLMEngine(str(ensure_model("smollm2-135m")), dtype="float32", max_model_len=512, seed=0)
    prompts = _prompts(engine.tok)
    ids = engine.encode(prompts)
    res: dict[str, list[float]] = {"ours": [], "vllm": []}
    for r in range(rounds):
        sp = SamplingParams(n=N, temperature=TEMPERATURE, top_p=1.0, max_new_tokens=MAX_NEW, seed=r)
        t = time.perf_counter()
        groups = engine.generate(prompts, sp)
        dt = time.perf_counter() - t
        res["ours"].append(sum(len(s.response_ids) for g in groups for s in g) / dt)
        params = VSP(n=N, temperature=TEMPERATURE, top_p=1.0, max_tokens=MAX_NEW, seed=r)
        t = time.perf_counter()
        outs = engine.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        dt = time.perf_counter() - t
        res["vllm"].append(sum(len(o.token_ids) for r_ in outs for o in r_.outputs) / dt)
        print(f"round {r + 1}: ours {res['ours'][-1]:.1f} tok/s, LLM.generate {res['vllm'][-1]:.1f} tok/s -> "
              f"{res['ours'][-1] / res['vllm'][-1]:.2f}x", flush=True)
    o, v = statistics.median(res["ours"]), statistics.median(res["vllm"])
    print(f"our vLLM path vs vLLM's LLM.generate: {o:.1f} vs {v:.1f} tok/s = {o / v:.2f}x (target >= 0.9x)")


def matmul() -> None:
    """One training forward+backward of the recipe's batch under the profiler: the matrix products'
    FLOPs and time, then the same shapes alone (MKL through torch.mm), as GFLOP/s side by side."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.generation.engines import HFEngine, SamplingParams
    from stare_cli.backends.forward import pack, token_logprobs_entropy

    _, tok, model = _load()
    prompts = _prompts(tok)[:8]
    groups = HFEngine(model, tok, batch_size=64).generate(
        prompts, SamplingParams(n=8, temperature=TEMPERATURE, top_p=1.0, max_new_tokens=MAX_NEW, seed=0))
    samples = [s for g in groups for s in g]
    batch = pack(samples, tok.pad_token_id, "cpu")
    model.train()

    def step():
        lp, ent = token_logprobs_entropy(model, batch, range(len(samples)), TEMPERATURE, share_prompts=True)
        ((lp - 0.0 * ent) * batch["response_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm up
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        step()
    wall = time.perf_counter() - t
    mm_ops = ("aten::mm", "aten::addmm", "aten::bmm")
    flops, secs = 0.0, 0.0
    shapes: dict[tuple, int] = {}
    for e in prof.events():
        if e.name in mm_ops and e.flops:
            flops += e.flops
            secs += e.self_cpu_time_total / 1e6
            if e.name == "aten::mm" and len(e.input_shapes) >= 2 and e.input_shapes[0] and e.input_shapes[1]:
                shapes[(tuple(e.input_shapes[0]), tuple(e.input_shapes[1]))] = shapes.get(
                    (tuple(e.input_shapes[0]), tuple(e.input_shapes[1])), 0) + 1
    alone_flops, alone_secs = 0.0, 0.0
    for (a, b), count in shapes.items():
        x, y = torch.randn(*a), torch.randn(*b)
        torch.mm(x, y)
        reps = max(1, min(20, count))
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(x, y)
        dt = (time.perf_counter() - t) / reps
        alone_flops += 2 * a[0] * a[1] * b[1] * count
        alone_secs += dt * count
    print(f"training forward+backward: {len(samples)} responses, {int(batch['response_mask'].sum())} response tokens, "
          f"{wall:.2f} s under the profiler")
    print(f"matrix products in the step: {flops / 1e9:.1f} GFLOP in {secs:.2f} s = {flops / 1e9 / secs:.1f} GFLOP/s "
          f"({100 * secs / wall:.0f}% of the step)")
    print(f"the same aten::mm shapes alone (MKL): {alone_flops / 1e9 / alone_secs:.1f} GFLOP/s "
          f"-> the step reaches {flops / secs / (alone_flops / alone_secs):.2f}x of it")


TRL_WORKER = r'''
import json, sys, time, torch
torch.set_num_threads(1)
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from transformers import AutoModelForCausalLM, TrainerCallback
from benchmarks.data.words import problems
from benchmarks.generation.engines import load_tokenizer
from benchmarks.generation.templates import user_text
from benchmarks.grading.graders import Grader
model_dir, steps, out_dir, prompts, n, max_new = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
tok = load_tokenizer(model_dir)
rows = problems(4000, 1000)
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": user_text(r["problem"], "short")}], "answer": r["answer"]}
                        for r in rows])
grader = Grader(workers=0)  # math-verify-final: the recipe's reward
lengths = []
def reward(prompts, completions, answer, completion_ids, **kw):
    lengths.append(sum(len(c) for c in completion_ids) / len(completion_ids))
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(v.correct) for v in grader.grade_many(texts, answer)]
times = []
class T(TrainerCallback):
    def on_step_begin(self, a, s, c, **k): self.t = time.perf_counter()
    def on_step_end(self, a, s, c, **k): times.append(time.perf_counter() - self.t)
args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=prompts * n, num_generations=n,
                  max_completion_length=max_new, learning_rate=1e-5, max_steps=steps, logging_steps=1000,
                  save_strategy="no", report_to=[], use_cpu=True, temperature=0.6, top_p=1.0, beta=0.0,
                  gradient_accumulation_steps=1, num_iterations=1, bf16=False, dataloader_num_workers=0, seed=1)
trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=[reward], args=args,
                      train_dataset=ds, processing_class=tok, callbacks=[T()])
trainer.train()
print(json.dumps({"step_times": times, "lengths": lengths}))
'''


def train(steps: int, rounds: int, trl_python: Path, out: Path) -> None:
    """Our embedded step (the recipe, GRPO without dynamic sampling, 8 prompts x 8) against TRL's
    GRPOTrainer with the same model, prompts, group size, batch, lengths, temperature and lr."""
    from benchmarks.data.models import ensure_model

    if not trl_python.exists():
        raise SystemExit(f"{trl_python} not found: python benchmarks/perf/trainer_vs_trl.py --setup")
    model_dir = str(ensure_model("smollm2-135m"))
    prompts, n = 8, 8
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    med = statistics.median
    res: dict[str, list[float]] = {"ours": [], "trl": []}
    lens: dict[str, list[float]] = {"ours": [], "trl": []}
    for r in range(rounds):
        cmd = [sys.executable, "-m", "stare_cli", "train", "--recipe", "small/smollm2-135m-words", "--method", "grpo",
               "--out", str(out / f"ours{r}"), "-o", f"optim.total_steps={steps}", "-o", "eval.benchmarks=[]",
               "-o", "checkpoint.every=0", "-o", "logging.samples_every=0", "-o", f"optim.train_batch_size={prompts}",
               "-o", f"rollout.n={n}"]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if run.returncode:
            raise SystemExit(run.stderr[-2000:])
        rows = [json.loads(x) for x in (Path(run.stdout.strip().splitlines()[-1]) / "metrics.jsonl").read_text().splitlines()]
        o = [x["time/step"] for x in rows][1:]
        lens["ours"] += [x["len/mean"] for x in rows]
        run = subprocess.run([str(trl_python), "-c", TRL_WORKER, model_dir, str(steps), str(out / f"trl{r}"), str(prompts),
                              str(n), str(MAX_NEW)], capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)},
                             cwd=REPO)
        if run.returncode:
            raise SystemExit(run.stderr[-3000:])
        tr = json.loads(run.stdout.strip().splitlines()[-1])
        t = tr["step_times"][1:]
        lens["trl"] += tr["lengths"]
        res["ours"] += o
        res["trl"] += t
        print(f"round {r + 1}: ours {med(o):.1f} s, TRL {med(t):.1f} s per step -> {med(t) / med(o):.2f}x", flush=True)
    o, t = med(res["ours"]), med(res["trl"])
    print(f"mean response length: ours {statistics.fmean(lens['ours']):.1f}, TRL {statistics.fmean(lens['trl']):.1f} tokens")
    print(f"training step ({prompts} prompts x {n}): ours {o:.1f} s ({prompts * n / o:.2f} samples/s), TRL {t:.1f} s "
          f"({prompts * n / t:.2f} samples/s) -> {t / o:.2f}x (target >= 1.5x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["generate", "vllm", "matmul", "train"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="train: steps per round (the first is not timed)")
    ap.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl" / "bin" / "python")
    ap.add_argument("--out", type=Path, default=Path("/tmp/stare-perf-real"))
    args = ap.parse_args()
    if args.what == "generate":
        generate(args.rounds)
    elif args.what == "vllm":
        vllm(args.rounds)
    elif args.what == "matmul":
        matmul()
    else:
        train(args.steps, args.rounds, args.trl_python, args.out)


if __name__ == "__main__":
    main()
