"""Our embedded step against TRL's GRPOTrainer on the same tiny model, data, group size, batch and
lengths, both on CPU with one torch thread, alternating runs in one invocation. Prints the ratio.

TRL lives in its own virtual environment, because verl 0.9.1 breaks when trl 1.x is importable
beside it (our test environment has verl). Create it once with:

    python benchmarks/perf/trainer_vs_trl.py --setup        # makes .venv-trl (torch CPU, trl, this package)
    python benchmarks/perf/trainer_vs_trl.py [--steps 10 --rounds 2]

Both sides: the warmed-up toy model, 16 prompts x 8 samples per step, at most 56 new tokens,
temperature 1, one optimizer step per batch, GRPO advantages, no dynamic sampling, lr 2e-4.
Goal (issues: embedded trainer 1.5x, toy 2x): ours >= 2x TRL's throughput (samples per second).
Also prints the work ratio: how many more token positions TRL's layout puts through the model than
ours on the same samples, i.e. the speed-up equal cost per position would give.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRL_VENV = REPO / ".venv-trl"
PROMPTS, N, MAX_NEW = 16, 8, 56

TRL_WORKER = r'''
import json, sys, time, torch
torch.set_num_threads(1)
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from transformers import Qwen2ForCausalLM, TrainerCallback
from benchmarks.generation.engines import load_tokenizer
from benchmarks.grading.graders import Grader
from benchmarks.data.toy import problems
model_dir, steps, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tok = load_tokenizer(model_dir)
rows = problems(4000, seed=1000)
ds = Dataset.from_list([{"prompt": r["problem"] + "\n", "answer": r["answer"]} for r in rows])
grader = Grader(workers=0, boxed_only=True)
work = []
def reward(prompts, completions, answer, completion_ids, **kw):
    # Work per step in token positions through the model (a backward counts as two forwards), on
    # TRL's own samples: TRL's layout (every row padded to the longest prompt and completion, in
    # generate and in training) and ours (each distinct prompt once, rows leave at EOS, a row's last
    # token is never fed back).
    P = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    C = [len(c) for c in completion_ids]
    rows, Pm, Cm = len(C), max(P), max(C)
    distinct = sum(P[i] for i in range(0, rows, %(n)d))
    work.append({"trl": rows * (Pm + Cm - 1) + 3 * rows * (Pm + Cm), "ours": 4 * (distinct + sum(c - 1 for c in C))})
    return [float(v.correct) for v in grader.grade_many(completions, answer)]
times = []
class T(TrainerCallback):
    def on_step_begin(self, a, s, c, **k): self.t = time.perf_counter()
    def on_step_end(self, a, s, c, **k): times.append(time.perf_counter() - self.t)
args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=%(bs)d, num_generations=%(n)d,
                  max_completion_length=%(max_new)d, learning_rate=2e-4, max_steps=steps, logging_steps=1000,
                  save_strategy="no", report_to=[], use_cpu=True, temperature=1.0, top_p=1.0, beta=0.0,
                  gradient_accumulation_steps=1, num_iterations=1, bf16=False, dataloader_num_workers=0,
                  seed=1)
trainer = GRPOTrainer(model=Qwen2ForCausalLM.from_pretrained(model_dir), reward_funcs=[reward], args=args,
                      train_dataset=ds, processing_class=tok, callbacks=[T()])
trainer.train()
print(json.dumps({"step_times": times, "work": work}))
''' % {"bs": PROMPTS * N, "n": N, "max_new": MAX_NEW}


def setup() -> None:
    py = TRL_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "trl>=0.20", "transformers>=5.5.3,<5.11"], check=True)
    subprocess.run([*pip, "-e", str(REPO)], check=True)


def ours(model_dir: str, steps: int, out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "stare_cli", "train", "--recipe", "tiny/arith", "--method", "grpo", "--out", str(out),
           "-o", f"model.path={model_dir}", "-o", f"optim.total_steps={steps}", "-o", f"optim.train_batch_size={PROMPTS}",
           "-o", f"rollout.gen_batch_size={PROMPTS}", "-o", f"rollout.n={N}", "-o", f"rollout.max_response_tokens={MAX_NEW}",
           "-o", "eval.benchmarks=[]", "-o", "checkpoint.every=0", "-o", "logging.samples_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if run.returncode:
        raise SystemExit(run.stderr[-2000:])
    run_dir = Path(run.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step"] for r in rows]


def trl(model_dir: str, steps: int, out: Path, python: Path) -> tuple[list[float], list[float]]:
    """TRL's step times, and per step the work ratio TRL's layout / ours on TRL's samples."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(python), "-c", TRL_WORKER, model_dir, str(steps), str(out)], capture_output=True,
                         text=True, env=env, cwd=REPO)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    res = json.loads(run.stdout.strip().splitlines()[-1])
    return res["step_times"], [w["trl"] / w["ours"] for w in res["work"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setup", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trl-python", type=Path, default=TRL_VENV / "bin" / "python")
    ap.add_argument("--out", type=Path, default=Path("/tmp/stare-perf-trl"))
    args = ap.parse_args()
    if args.setup:
        setup()
        return
    if not args.trl_python.exists():
        raise SystemExit(f"{args.trl_python} not found: run with --setup first")
    from benchmarks.data.toy import ensure_toy_model

    model_dir = str(ensure_toy_model("arith"))
    res = {"ours": [], "trl": []}
    work_ratios: list[float] = []
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    for r in range(args.rounds):  # alternate: drift on a shared machine hits both alike
        o = ours(model_dir, args.steps, args.out / f"ours{r}")[1:]  # first step warms up
        t, w = trl(model_dir, args.steps, args.out / f"trl{r}", args.trl_python)
        t = t[1:]
        work_ratios += w
        print(f"round {r + 1}: ours {median(o):.2f} s, TRL {median(t):.2f} s per step -> {median(t) / median(o):.2f}x",
              flush=True)
        res["ours"] += o
        res["trl"] += t
    med = {k: median(v) for k, v in res.items()}
    for k, v in med.items():
        print(f"{k:5s} median step {v:.2f} s  -> {PROMPTS * N / v:.1f} samples/s  ({len(res[k])} steps)")
    print(f"throughput ratio ours / TRL = {med['trl'] / med['ours']:.2f}x (goal >= 2)")
    print(f"work ratio TRL / ours on TRL's samples = {median(work_ratios):.2f}x (token positions through the model, "
          f"backward = 2 forwards; the speed-up at equal cost per position)")


if __name__ == "__main__":
    main()
