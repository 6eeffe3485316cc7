"""`stare eval`: generate, grade, score; resumable and traceable.

Per (model, benchmark) the output folder holds `samples.jsonl` (one row per sample: prompt,
response, extracted answer, verdict, reason) and `results.json` (config, engine, package versions,
metrics). Problems are processed in fixed chunks whose sampling seed depends only on the chunk, so
an interrupted evaluation resumes by redoing only chunks not fully on disk and ends with the same
results. A sample's key is (model, benchmark, template, sampling, seed, problem, sample index).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from benchmarks.engines import SamplingParams
from benchmarks.grading import Grader
from benchmarks.metrics import REFLECTION_WORDS, benchmark_metrics, reflection_rate
from benchmarks.registry import BENCHMARKS, load_benchmark
from benchmarks.templates import build_prompt
from stare_cli.runs import atomic_write_text, environment_summary, read_jsonl

CHUNK = 8  # problems per generation call; fixed so resumed runs sample identically


@dataclass(frozen=True)
class EvalSettings:
    model: str
    bench: str
    template: str
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    engine: str
    limit: Optional[int] = None

    def key(self) -> str:
        blob = json.dumps({k: v for k, v in asdict(self).items() if k not in ("engine", "limit")}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def evaluate_benchmark(engine, tokenizer, s: EvalSettings, out_dir: Path, grader: Grader,
                       data_file: Optional[str] = None, use_chat_template: bool = True, progress=None,
                       reflection_words: Optional[list[str]] = None, tools=None) -> dict:
    """Evaluate one benchmark into out_dir; returns the results dict (also written as results.json)."""
    words = reflection_words or REFLECTION_WORDS
    rows = load_benchmark(s.bench, limit=s.limit, data_file=data_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / "samples.jsonl"
    key = s.key()
    done: dict[tuple[int, int], dict] = {}
    others = []  # rows of other settings: kept as they are
    for r in read_jsonl(samples_path):
        if r.get("key") == key:
            done[(r["idx"], r["sample"])] = r
        else:
            others.append(r)
    # Keep only whole chunks (a crash may have left part of one); samples graded by another grader are
    # graded again below, not generated again.
    chunks = [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)]
    complete = {ci for ci, ch in enumerate(chunks) if all((r["idx"], j) in done for r in ch for j in range(s.n))}
    kept = _regrade([done[(r["idx"], j)] for ci in sorted(complete) for r in chunks[ci] for j in range(s.n)], grader)
    atomic_write_text(samples_path, "".join(json.dumps(r) + "\n" for r in [*others, *kept]))
    task = progress.add_task(f"{s.bench}", total=len(rows)) if progress else None
    if progress:
        progress.update(task, completed=sum(len(chunks[ci]) for ci in complete))
    t0 = time.time()
    for ci, chunk in enumerate(chunks):
        if ci in complete:
            continue
        prompts = [build_prompt(r["problem"], s.template, tokenizer, use_chat_template) for r in chunk]
        sp = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=-1, max_new_tokens=s.max_tokens,
                            seed=s.seed * 1_000_003 + ci)
        groups = engine.generate(prompts, sp, tools) if tools is not None else engine.generate(prompts, sp)
        flat = [(r, p, j, smp) for r, p, g in zip(chunk, prompts, groups) for j, smp in enumerate(g)]
        verdicts = grader.grade_many([x[3].text for x in flat], [x[0]["answer"] for x in flat])
        lines = []
        for (r, p, j, smp), v in zip(flat, verdicts):
            lines.append(json.dumps({
                "key": key, "idx": r["idx"], "sample": j, "prompt": p, "response": smp.text, "gold": r["answer"],
                "extracted": v.extracted, "method": v.method, "correct": bool(v.correct and smp.finished),
                "reason": v.reason if smp.finished else "truncated", "finished": smp.finished, "grader": v.grader,
                "length": len(smp.response_ids) if smp.response_ids else len(smp.text.split()),
                "tool_calls": smp.tool_calls, "tool_errors": smp.tool_errors,
            }) + "\n")
        with open(samples_path, "a") as f:  # one write per chunk; a torn chunk is redone on resume
            f.write("".join(lines))
            f.flush()
        if progress:
            progress.update(task, advance=len(chunk))
    by_problem: dict[int, list[dict]] = {}
    for r in read_jsonl(samples_path):
        if r.get("key") == key:
            by_problem.setdefault(r["idx"], []).append(r)
    per_problem = []
    for idx in sorted(by_problem):
        ss = sorted(by_problem[idx], key=lambda r: r["sample"])[: s.n]
        per_problem.append({
            "correct": [r["correct"] for r in ss], "answers": [r["extracted"] for r in ss],
            "lengths": [r["length"] for r in ss], "finished": [r["finished"] for r in ss],
            "reflection": sum(reflection_rate([r["response"]], words) for r in ss) / len(ss),
            "tool_calls": [r.get("tool_calls", 0) for r in ss],
        })
    spec = BENCHMARKS[s.bench]
    results = {
        "benchmark": s.bench, "benchmark_version": spec.version, "settings": asdict(s), "key": key, "grader": grader.tag,
        "protocol": {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "template": s.template,
                     "max_tokens": s.max_tokens, "paper_protocol": s.n == spec.n and s.temperature == spec.temperature
                     and s.top_p == spec.top_p and s.limit is None},
        "data": str(data_file) if data_file else "hub or STARE_DATA_DIR",
        "metrics": benchmark_metrics(per_problem), "elapsed_s": time.time() - t0,
        "environment": environment_summary(),
    }
    atomic_write_text(out_dir / "results.json", json.dumps(results, indent=2))
    return results


def _regrade(rows: list[dict], grader: Grader) -> list[dict]:
    """Rows whose verdict came from another grader (or none recorded), graded again by `grader`."""
    stale = [r for r in rows if r.get("grader") != grader.tag]
    if stale:
        for r, v in zip(stale, grader.grade_many([r["response"] for r in stale], [r["gold"] for r in stale])):
            r.update({"extracted": v.extracted, "method": v.method, "correct": bool(v.correct and r["finished"]),
                      "reason": v.reason if r["finished"] else "truncated", "grader": v.grader})
    return rows


def resolve_model(model: str) -> tuple[str, Optional[Path]]:
    """(path or hub id, run directory when the model is a training checkpoint)."""
    if model.startswith("toy:"):
        from stare_cli.toy import ensure_toy_model

        return str(ensure_toy_model(model.split(":", 1)[1])), None
    p = Path(model)
    if (p / "checkpoints" / "latest").exists():
        p = p / "checkpoints" / "latest"
    if p.exists():
        real = p.resolve()
        run = real.parent.parent if real.parent.name == "checkpoints" else None
        return str(real), run
    return model, None


def run_eval(model: str, benches: list[str], engine_name: str = "auto", n: Optional[int] = None,
             limit: Optional[int] = None, out: Optional[Path] = None, template: str = "paper",
             temperature: Optional[float] = None, top_p: Optional[float] = None, max_tokens: Optional[int] = None,
             seed: int = 0, data_file: Optional[str] = None, base_url: Optional[str] = None, workers: Optional[int] = None,
             device: str = "auto", batch_size: int = 64, dtype: str = "auto", tools: Optional[str] = None,
             vllm_kwargs: Optional[dict] = None, grader: str = "math-verify") -> dict[str, dict]:
    """Evaluate `model` on `benches`; returns {bench: results}. Prints progress on stderr."""
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from benchmarks.registry import check_benchmark, expand
    from stare_cli.errors import StareError

    benches = expand(benches)
    for b in benches:
        check_benchmark(b)
    if data_file and len(benches) > 1:
        raise StareError("--data-file names one benchmark's file", hint="use STARE_DATA_DIR for several")
    path, run_dir = resolve_model(model)
    if engine_name == "auto":
        engine_name = _auto_engine()
    engine, tok = _make_engine(engine_name, path, base_url, device, batch_size, dtype, vllm_kwargs or {})
    if out is None:
        out = (run_dir / "eval" / Path(path).name) if run_dir else Path("evals") / path.strip("/").replace("/", "__")
    results = {}
    tool_spec = None
    if tools:
        from benchmarks.tools import ToolSpec

        if tools != "python":
            raise StareError(f"unknown tool '{tools}'", hint="the available tool is 'python'")
        tool_spec = ToolSpec()
    grading = Grader(workers=workers, name=grader)
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=__import__("rich.console").console.Console(stderr=True), disable=not sys.stderr.isatty()) as prog:
            for b in benches:
                spec = BENCHMARKS[b]
                s = EvalSettings(model=path, bench=b, template=template, n=n or spec.n,
                                 temperature=spec.temperature if temperature is None else temperature,
                                 top_p=spec.top_p if top_p is None else top_p, max_tokens=max_tokens or spec.max_tokens,
                                 seed=seed, engine=engine_name, limit=limit)
                results[b] = evaluate_benchmark(engine, tok, s, out / b, grading, data_file=data_file, progress=prog,
                                                tools=tool_spec)
                if not sys.stderr.isatty():
                    m = results[b]["metrics"]
                    avg = m[f"avg@{m['n']}"]
                    print(f"{b}: avg@{m['n']} {avg:.1f}", file=sys.stderr, flush=True)
    finally:
        grading.close()
    summary = {"model": path, "out": str(out), "grader": grading.tag,
               "benchmarks": {b: r["metrics"] for b, r in results.items()}}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return results


def _auto_engine() -> str:
    try:
        import torch

        import vllm  # noqa: F401

        return "vllm" if torch.cuda.is_available() else "hf"
    except ImportError:
        return "hf"


def _make_engine(name: str, path: str, base_url: Optional[str], device: str, batch_size: int, dtype: str,
                 vllm_kwargs: dict):
    from benchmarks.engines import HFEngine, OpenAIEngine, VLLMEngine, load_tokenizer, use_gqa_sdpa_on_cpu
    from stare_cli.errors import StareError

    if name == "openai":
        if not base_url:
            raise StareError("--engine openai needs --base-url", hint="e.g. --base-url http://localhost:8000/v1")
        try:
            tok = load_tokenizer(path)
        except Exception:
            tok = None  # the server applies no template; prompts are built without a chat template
        return OpenAIEngine(base_url, path), tok
    if name == "vllm":
        e = VLLMEngine(path, **vllm_kwargs)
        return e, e.tok
    import torch
    from transformers import AutoModelForCausalLM

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tdtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        tok = load_tokenizer(path)
        m = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, use_safetensors=True).to(dev)
    except OSError as e:
        raise StareError(f"cannot load model '{path}': {str(e).splitlines()[0][:200]}",
                         hint="pass a local model directory or a run directory") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    use_gqa_sdpa_on_cpu(m)
    return HFEngine(m, tok, batch_size=batch_size), tok
