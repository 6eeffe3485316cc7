"""The lm-eval bridge: the same benchmarks, data and grading through lm-eval's machinery.

`write_tasks` writes one task YAML per benchmark (dataset_path json over the same local file as
`stare eval --data-file`/STARE_DATA_DIR, `repeats: N`, the paper's sampling, and a `take_first_k`
filter so all N samples reach `process_results`) plus a `utils.py` that grades with our grader.
`run` calls lm-eval's CLI (`--model hf --include_path`) and reads its results back.

Differences from lm-eval's built-in tasks, documented: its aime24/aime25 tasks decode greedily
(temperature 0) and score by string match; its `minerva_math` is Hendrycks MATH with Minerva
prompts (and asserts antlr4 4.11, which cannot live beside verl's hydra), not the 272-problem
Minerva set the paper reports; it has no AMC23 or OlympiadBench task. These tasks avoid all three.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.data.registry import BENCHMARKS
from stare_cli.core.errors import StareError, install_hint

UTILS = '''"""Written by stare: grading for lm-eval tasks with stare's grader (same verdicts as stare eval)."""
from benchmarks.grading.graders import grade
from benchmarks.generation.templates import with_instruction


def doc_to_text(doc):
    return with_instruction(doc["problem"])


def process_results(doc, results):
    samples = results[0] if results and isinstance(results[0], list) else results
    verdicts = [grade(s, str(doc["answer"])).correct for s in samples]
    return {"avg_at_n": 100.0 * sum(verdicts) / max(len(verdicts), 1), "pass_at_n": 100.0 * any(verdicts)}
'''


def task_yaml(bench: str, data_file: Path, n: int, temperature: float, top_p: float, max_tokens: int) -> str:
    return f"""task: stare_{bench}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data_file.resolve()))}
test_split: test
output_type: generate_until
doc_to_text: !function utils.doc_to_text
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
    import os

    if data_file:
        return Path(data_file)
    if os.environ.get("STARE_DATA_DIR"):
        p = Path(os.environ["STARE_DATA_DIR"]) / f"{bench}.jsonl"
        if p.exists():
            return p
    raise StareError(f"lm-eval bridge: no local file for {bench}",
                     hint=f"pass --data-file or set STARE_DATA_DIR to a folder with {bench}.jsonl")


def write_tasks(benches: list[str], task_dir: Path, n: Optional[int], temperature: Optional[float],
                top_p: Optional[float], max_tokens: Optional[int], data_file: Optional[str] = None) -> list[str]:
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "utils.py").write_text(UTILS)
    names = []
    for b in benches:
        spec = BENCHMARKS[b]
        (task_dir / f"stare_{b}.yaml").write_text(task_yaml(
            b, resolve_data_file(b, data_file), n or spec.n, spec.temperature if temperature is None else temperature,
            spec.top_p if top_p is None else top_p, max_tokens or spec.max_tokens))
        names.append(f"stare_{b}")
    return names


def run(model: str, benches: list[str], out: Path, n: Optional[int], limit: Optional[int], temperature: Optional[float],
        top_p: Optional[float], max_tokens: Optional[int], data_file: Optional[str], chat_template: bool = True) -> dict:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise StareError("lm-eval is not installed", hint=install_hint("lm-eval")) from None
    task_dir = out / "lm_eval_tasks"
    tasks = write_tasks(benches, task_dir, n, temperature, top_p, max_tokens, data_file)
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model}",
           "--tasks", ",".join(tasks), "--include_path", str(task_dir), "--output_path", str(out / "lm_eval"),
           "--log_samples"]
    if chat_template:
        cmd.append("--apply_chat_template")
    if limit:
        cmd += ["--limit", str(limit)]
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # lm-eval prints its own table on stdout: it goes to stderr, so that stdout holds only our output
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr)
    if proc.returncode:
        raise StareError(f"lm-eval exited with code {proc.returncode}")
    files = sorted((out / "lm_eval").rglob("results_*.json"))
    if not files:
        raise StareError("lm-eval wrote no results file")
    return json.loads(files[-1].read_text())["results"]
