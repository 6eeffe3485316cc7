"""The lm-eval bridge: the same benchmarks, data and grading through lm-eval's machinery.

`write_tasks` writes one task YAML per benchmark (dataset_path json over the same local file as
`stare eval --data-file`/STARE_DATA_DIR, `repeats: N`, the paper's sampling, and a `take_first_k`
filter so all N samples reach `process_results`) plus a `utils.py` that grades with our grader.
`run` calls lm-eval's CLI (`--model hf --include_path`, `--seed`, `--log_samples`), then reads
lm-eval's logged samples back into our own format: `samples.jsonl` and `results.json` per benchmark,
graded by the grader asked for (`--grader`), so `stare compare`, `--regrade` and `stare grade audit`
read a bridge evaluation like a native one. lm-eval's own per-task metrics (graded in its process by
`utils.py` with our default grader) are kept beside ours in `results.json` under `harness`.

Options: honoured are --grader, --seed (lm-eval's python, numpy, torch and few-shot seeds), --workers
(our grading), --dtype (the hf model's), --template (paper, plain, short, raw; lm-eval applies the
chat template for paper and short, so one run cannot mix those with plain or raw), -n, --limit,
--temperature, --top-p, --max-tokens and --data-file. Refused by name (`refused_options`): any
engine but hf, --tools, --base-url and the vLLM settings, the r1 template, and --wandb. Whether a
response was cut at --max-tokens is not in lm-eval's log: a response counts as finished when its
re-tokenised length is under --max-tokens.

Differences from lm-eval's built-in tasks, documented: its aime24/aime25 tasks decode greedily
(temperature 0) and score by string match; its `minerva_math` is Hendrycks MATH with Minerva
prompts (and asserts antlr4 4.11, which cannot live beside verl's hydra), not the 272-problem
Minerva set the paper reports; it has no AMC23 or OlympiadBench task. These tasks avoid all three.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from benchmarks.data.registry import BENCHMARKS, dir_name
from benchmarks.evaluation.evaluate import (EvalSettings, _grade_rows, check_inputs, data_digest, data_record,
                                            new_evaluation_id, weights_digest, write_results)
from benchmarks.grading.graders import Grader
from stare_kernel.errors import StareError, install_hint
from stare_kernel.io import atomic_write_text, hold_run_lock, read_jsonl

TEMPLATES = {"paper": True, "short": True, "plain": False, "raw": False}  # template -> through the chat template
ENGINE = "lm-eval-hf"  # what the samples' key records as the engine

UTILS = '''"""Written by stare: prompts and grading for lm-eval tasks (the same as stare eval's)."""
from benchmarks.grading.graders import grade
from benchmarks.generation.templates import user_text


def doc_to_text_paper(doc):
    return user_text(doc["problem"], "paper")


def doc_to_text_plain(doc):
    return user_text(doc["problem"], "plain") + "\\n"


def doc_to_text_short(doc):
    return user_text(doc["problem"], "short")


def doc_to_text_raw(doc):
    return doc["problem"] + "\\n"


def process_results(doc, results):
    samples = results[0] if results and isinstance(results[0], list) else results
    verdicts = [grade(s, str(doc["answer"])).correct for s in samples]
    return {"avg_at_n": 100.0 * sum(verdicts) / max(len(verdicts), 1), "pass_at_n": 100.0 * any(verdicts)}
'''


def task_yaml(bench: str, data_file: Path, n: int, temperature: float, top_p: float, max_tokens: int,
              template: str = "paper") -> str:
    return f"""task: stare_{bench}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data_file.resolve()))}
test_split: test
output_type: generate_until
doc_to_text: !function utils.doc_to_text_{template}
doc_to_target: answer
generation_kwargs:
  until: []
  do_sample: {"true" if temperature > 0 else "false"}
  temperature: {temperature}
  top_p: {top_p}
  max_gen_toks: {max_tokens}
repeats: {n}
filter_list:
  - name: all_samples
    filter:
      - function: take_first_k
        k: {n}
process_results: !function utils.process_results
metric_list:
  - metric: avg_at_n
    aggregation: mean
    higher_is_better: true
  - metric: pass_at_n
    aggregation: mean
    higher_is_better: true
metadata:
  version: {BENCHMARKS[bench].version}
"""


def resolve_data_file(bench: str, data_file: Optional[str]) -> Path:
    if data_file:
        return Path(data_file)
    if os.environ.get("STARE_DATA_DIR"):
        p = Path(os.environ["STARE_DATA_DIR"]) / f"{bench}.jsonl"
        if p.exists():
            return p
    raise StareError(f"lm-eval bridge: no local file for {bench}",
                     hint=f"pass --data-file or set STARE_DATA_DIR to a folder with {bench}.jsonl")


def write_tasks(benches: list[str], task_dir: Path, n: Optional[int], temperature: Optional[float],
                top_p: Optional[float], max_tokens: Optional[int], data_file: Optional[str] = None,
                template: Optional[str] = None) -> list[str]:
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "utils.py").write_text(UTILS)
    names = []
    for b in benches:
        spec = BENCHMARKS[b]
        (task_dir / f"stare_{b}.yaml").write_text(task_yaml(
            b, resolve_data_file(b, data_file), n or spec.n, spec.temperature if temperature is None else temperature,
            spec.top_p if top_p is None else top_p, max_tokens or spec.max_tokens, template or spec.template))
        names.append(f"stare_{b}")
    return names


def refused_options(engine: str, tools: Optional[str], base_url: Optional[str], vllm_changed: bool,
                    wandb: Optional[str]) -> Optional[str]:
    """The first option the bridge cannot honour, named (None when all can be)."""
    if engine not in ("auto", "hf"):
        return f"--engine {engine} (lm-eval generates with its hf model here)"
    if tools:
        return "--tools (lm-eval's tasks have no tool calls)"
    if base_url:
        return "--base-url (lm-eval's hf model runs in its own process)"
    if vllm_changed:
        return "--tensor-parallel / --gpu-memory-utilization (vLLM settings; the bridge runs hf)"
    if wandb:
        return "--wandb (log a native `stare eval` instead)"
    return None


def run(model: str, benches: list[str], out: Path, n: Optional[int], limit: Optional[int], temperature: Optional[float],
        top_p: Optional[float], max_tokens: Optional[int], data_file: Optional[str], template: Optional[str] = None,
        seed: int = 0, grader: str = "math-verify", workers: Optional[int] = None, dtype: str = "auto") -> dict[str, dict]:
    """Evaluate `model` through lm-eval; returns {bench: results} as `stare eval` writes them."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise StareError("lm-eval is not installed", hint=install_hint("lm-eval")) from None
    if data_file and len(benches) > 1:
        raise StareError("--data-file names one benchmark's file", hint="use STARE_DATA_DIR for several")
    templates = {b: template or BENCHMARKS[b].template for b in benches}
    bad = sorted({t for t in templates.values() if t not in TEMPLATES})
    if bad:
        raise StareError(f"--harness lm-eval: template '{bad[0]}' cannot be built through lm-eval's tasks",
                         hint="paper, plain, short or raw; or the native harness")
    chat = {TEMPLATES[t] for t in templates.values()}
    if len(chat) > 1:
        raise StareError("--harness lm-eval: these benchmarks' templates mix the chat template (paper, short) with "
                         "plain text (plain, raw), and lm-eval applies it to a whole run",
                         hint="pass --template, or evaluate them in two runs")
    files = {b: resolve_data_file(b, data_file) for b in benches}  # lm-eval reads the file: it must be local
    data = {b: check_inputs([b], limit, str(files[b]), out)[b] for b in benches}
    task_dir = out / "lm_eval_tasks"
    tasks = write_tasks(benches, task_dir, n, temperature, top_p, max_tokens, data_file, template)
    model_args = f"pretrained={model}" + (f",dtype={dtype}" if dtype != "auto" else "")
    # lm-eval's command line, with the tokenizer loaded as stare loads it (lm_eval_main.py)
    cmd = [sys.executable, "-m", "benchmarks.evaluation.lm_eval_main", "--model", "hf", "--model_args", model_args,
           "--tasks", ",".join(tasks), "--include_path", str(task_dir), "--output_path", str(out / "lm_eval"),
           "--log_samples", "--seed", ",".join([str(seed)] * 4)]
    if chat.pop():
        cmd.append("--apply_chat_template")
    if limit:
        cmd += ["--limit", str(limit)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    started = time.time()
    # lm-eval prints its own table on stdout: it goes to stderr, so that stdout holds only our output
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
    if proc.returncode:
        raise StareError(f"lm-eval exited with code {proc.returncode}")
    found = [p for p in (out / "lm_eval").rglob("results_*.json") if p.stat().st_mtime >= started - 1]
    if not found:
        raise StareError("lm-eval wrote no results file")
    theirs = json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text())
    import lm_eval as _le

    from benchmarks.generation.engines import load_tokenizer

    tok = load_tokenizer(model)  # the tokenizer lm-eval's model used (lm_eval_main.py): lengths re-tokenised alike
    results = {}
    evaluation = new_evaluation_id()
    with Grader(workers=workers, name=grader) as grading:
        for b in benches:
            spec = BENCHMARKS[b]
            s = EvalSettings(model=model, bench=b, template=templates[b], n=n or spec.n,
                             temperature=spec.temperature if temperature is None else temperature,
                             top_p=spec.top_p if top_p is None else top_p, max_tokens=max_tokens or spec.max_tokens,
                             seed=seed, engine=ENGINE, limit=limit, data=data_digest(data[b]),
                             dtype=None if dtype == "auto" else dtype, weights=weights_digest(model))
            logged = _logged_samples(out / "lm_eval", f"stare_{b}", started)
            rows = _our_rows(logged, data[b], s, tok)
            harness = {"name": "lm-eval", "version": getattr(_le, "__version__", "?"), "command": cmd,
                       "metrics": theirs.get("results", {}).get(f"stare_{b}", {}),
                       "truncation": "estimated: a response whose re-tokenised length reaches max_tokens counts as cut "
                                     "(lm-eval does not log why generation stopped)"}
            results[b] = _write(out / dir_name(b), s, rows, grading, data_record(b, data[b], s.data, str(files[b])),
                                time.time() - started, harness, evaluation)
    summary = {"model": model, "out": str(out), "grader": grading.tag, "harness": "lm-eval",
               "benchmarks": {b: r["metrics"] for b, r in results.items()}}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return results


def _logged_samples(root: Path, task: str, since: float) -> list[dict]:
    """lm-eval's logged samples of `task` from this run (its newest file)."""
    files = [p for p in root.rglob(f"samples_{task}_*.jsonl") if p.stat().st_mtime >= since - 1]
    if not files:
        raise StareError(f"lm-eval logged no samples for {task}", hint="it runs with --log_samples; see its output")
    return read_jsonl(max(files, key=lambda p: p.stat().st_mtime), strict=True)


def _our_rows(logged: list[dict], problems: list[dict], s: EvalSettings, tok) -> list[dict]:
    """samples.jsonl rows (our format) from lm-eval's logged samples: doc_id i is our problem i (the
    same file in the same order; checked problem by problem)."""
    rows = []
    for rec in sorted(logged, key=lambda r: r["doc_id"]):
        i = rec["doc_id"]
        p = problems[i] if i < len(problems) else None
        if p is None or rec["doc"].get("problem") != p["problem"] or str(rec["doc"].get("answer")) != str(p["answer"]):
            raise StareError(f"lm-eval's document {i} of {s.bench} is not our problem {i}",
                             hint="the data file changed during the run; evaluate again")
        resps = rec["resps"][0] if rec["resps"] and isinstance(rec["resps"][0], list) else rec["resps"]
        prompt = (rec.get("arguments") or {}).get("gen_args_0", {}).get("arg_0")  # as lm-eval built it
        for j, text in enumerate(resps[: s.n]):
            length = len(tok(text, add_special_tokens=False)["input_ids"])
            rows.append({"key": s.key(), "idx": p["idx"], "sample": j, "prompt": prompt, "response": text,
                         "gold": str(p["answer"]), "finished": length < s.max_tokens, "length": length,
                         "tool_calls": 0, "tool_errors": 0})
    if len(rows) != len(problems) * s.n:
        raise StareError(f"lm-eval logged {len(rows)} samples of {s.bench}, not {len(problems)} x {s.n}")
    return rows


def _write(bench_dir: Path, s: EvalSettings, rows: list[dict], grading: Grader, data: dict, elapsed: float,
           harness: dict, evaluation: str) -> dict:
    """Grade and write one benchmark's samples beside those of other settings, then its results."""
    from benchmarks.evaluation.metrics import REFLECTION_WORDS

    bench_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_run_lock(bench_dir, "evaluated")  # a second writer of this folder is refused by name
    try:
        path = bench_dir / "samples.jsonl"
        others = [r for r in read_jsonl(path, strict=True) if r.get("key") != s.key()]
        _grade_rows(rows, grading)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in [*others, *rows]))
        return write_results(bench_dir, s, rows, grading, REFLECTION_WORDS, data, elapsed, extra={"harness": harness, "evaluation": evaluation})
    finally:
        lock.close()
