"""`stare eval`: generate, grade, score; resumable, re-gradable and traceable.

Per (model, benchmark) the output folder holds:
- `samples.jsonl`: one row per sample. Its `key` hashes every generation setting (model and the digest
  of its weights, benchmark, data, template and the rendered prompt format, n, temperature, top_p, max
  tokens, seed, engine, limit, tools, dtype), so runs with other settings add their own rows beside the
  old ones, and weights changed in place are never taken for the old ones; no run deletes rows. Each row
  keeps the verdict of every grader that graded it (`verdicts`, by `name@version`, with the gold it was
  graded against) and, at top level, the latest one.
- `records/<id>.json`: the ledger's record of each evaluation (stare_kernel/ledger.py): metrics with the
  full identity, written once, never overwritten; what `stare compare`, sweeps and audits read.
- `results/<key>-<grader>.json`: the metrics of one setting under one grader; `results.json` is the
  latest of them (a convenience copy; readers take records).
Problems are processed in fixed chunks whose sampling seed depends only on the chunk, so an
interrupted evaluation resumes by redoing only chunks not fully on disk and ends with the same
results. Samples graded by another grader are graded again, never generated again
(`stare eval --regrade DIR --grader NAME` does only that). Data problems are found before any model
loads (`check_inputs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from benchmarks.generation.engines import SamplingParams
from benchmarks.grading.graders import Grader, judge
from benchmarks.evaluation.metrics import REFLECTION_WORDS, benchmark_metrics, reflection_rate
from benchmarks.data.registry import BENCHMARKS, dir_name, load_benchmark
from benchmarks.generation.templates import build_prompt
from stare_kernel.errors import StareError
from stare_kernel.ledger import LEDGER, TRAINED, UNKNOWN, Record, digest, now_iso, write_record
from stare_kernel.io import (MANIFEST, atomic_write_text, checkpoint_problem, environment_summary, hold_run_lock,
                                 read_jsonl)

CHUNK = 8  # problems per generation call; fixed so resumed runs sample identically
SAMPLE_FIELDS = ("key", "idx", "sample", "response", "gold", "finished")  # what every samples.jsonl row holds


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
    tools: Optional[str] = None  # the tool the model may call ("python"), or None
    data: Optional[str] = None  # SHA-256 of the problems and golds evaluated (`data_digest`)
    dtype: Optional[str] = None  # the engine's dtype when chosen (--dtype); None: the engine's default
    weights: Optional[str] = None  # the weights' digest ('sha256:...', `weights_digest`); 'trained' for a run's live model
    prompt: Optional[str] = None  # digest of the rendered prompt format (`prompt_format`)
    chat: Optional[bool] = None  # the tokenizer's chat template wrapped the prompt

    def key(self) -> str:
        """A hash of every generation setting and of the data: samples of different settings or data
        never mix (another file, or a corrected gold, gets samples of its own; weights changed in place get
        samples of their own). (`tools`, `data`, `dtype`, `weights`, `prompt` and `chat` enter only when
        set, so that keys written before them still name their samples.)"""
        optional = ("tools", "data", "dtype", "weights", "prompt", "chat")
        fields = {k: v for k, v in asdict(self).items() if not (k in optional and v is None)}
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class ProgressLine:
    """Progress of one benchmark: problems done, generated tokens per second (the engines' METER,
    read while a chunk generates) and an ETA. A line at the start, then one every `every_s` seconds
    from a timer thread (so a slow model shows progress long before its first chunk ends), and at
    the end. Without `show` the lines go to `stream` (stderr: log files and pipes too); with it, each
    line replaces a terminal progress bar's description instead.

    ETA: from the problems' rate once a chunk is done; before that an upper bound ("<=") from the
    token rate, as if every sample ran to max_tokens."""

    def __init__(self, name: str, total: int, done: int = 0, every_s: float = 15.0, stream=None,
                 samples_per_problem: int = 1, max_tokens: int = 0, show=None):
        from benchmarks.generation.engines import METER

        self.name, self.total, self.done, self.every_s = name, total, done, every_s
        self.stream = stream or sys.stderr
        self.show = show
        self.meter, self.tokens0 = METER, METER.total
        self.per_problem_tokens = samples_per_problem * max_tokens
        self.t0 = time.time()
        self.start_done = done
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def text(self) -> str:
        elapsed = max(time.time() - self.t0, 1e-9)
        tokens = self.meter.total - self.tokens0
        tps = tokens / elapsed
        solved = self.done - self.start_done
        if solved > 0:
            eta = _clock((self.total - self.done) * elapsed / solved)
        elif tps > 0 and self.per_problem_tokens:
            eta = "<=" + _clock(max(0.0, (self.total - self.done) * self.per_problem_tokens - tokens) / tps)
        else:
            eta = "?"
        return (f"{self.name}: {self.done}/{self.total} problems in {_clock(elapsed)}, {tokens} tokens at "
                f"{tps:.1f} tok/s, ETA {eta}")

    def emit(self) -> None:
        with self._lock:
            if self.show is not None:
                self.show(self.text())
            else:
                print(self.text(), file=self.stream, flush=True)

    def start(self) -> "ProgressLine":
        if self.show is None:
            print(f"{self.name}: {self.total} problems ({self.done} already on disk)", file=self.stream, flush=True)

        def tick() -> None:
            while not self._stop.wait(self.every_s):
                self.emit()

        self._thread = threading.Thread(target=tick, name=f"progress-{self.name}", daemon=True)
        self._thread.start()
        return self

    def advance(self, k: int) -> None:
        self.done += k

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.emit()


def data_digest(rows: list[dict]) -> str:
    """SHA-256 of a benchmark's problems as evaluated: index, problem text and gold, in order."""
    blob = json.dumps([[r["idx"], r["problem"], str(r["answer"])] for r in rows], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _verdict_fields(v, finished: bool, gold) -> dict:
    return {"extracted": v.extracted, "method": v.method, "correct": bool(v.correct and finished),
            "reason": v.reason if finished else "truncated", "grader": v.grader, "gold": str(gold)}


def gold_changed(r: dict, tag: str) -> bool:
    """Whether row `r`'s gold differs from the one grader `tag` graded it against (a verdict written
    before verdicts kept their gold counts as changed: it is graded again once)."""
    v = r.get("verdicts", {}).get(tag)
    return v is not None and v.get("gold") != str(r["gold"])


def _grade_rows(rows: list[dict], grader: Grader) -> list[dict]:
    """Give every row this grader's verdict (kept beside other graders' in `verdicts`, and at top
    level); rows it already graded against the same gold are not graded again (a gold corrected in
    samples.jsonl is)."""
    stale = [r for r in rows if grader.tag not in r.get("verdicts", {}) or gold_changed(r, grader.tag)]
    if stale:
        for r, v in zip(stale, grader.grade_many([r["response"] for r in stale], [r["gold"] for r in stale])):
            r.setdefault("verdicts", {})[grader.tag] = _verdict_fields(v, r["finished"], r["gold"])
    for r in rows:
        r.update(r["verdicts"][grader.tag])
    return rows


def _same_answer(grader: Optional[Grader] = None, answer_lists: Optional[list[list]] = None):
    """Answer equivalence for maj@k: our grader's judgement of one answer against another.

    With `grader` and the problems' answers, every pair of distinct answers of a problem is judged up front
    through the grader's pool: the same time limits as grading (math-verify's own, and the pool's hard
    wall-clock limit per item, which kills a hung worker), and its verdict cache. A pair that times out
    counts as different. Without them (a caller with no pool), judged in this process, memoised."""
    memo: dict[tuple[str, str], bool] = {}
    if grader is not None and answer_lists is not None:
        import itertools

        pairs = sorted({(a, b) for answers in answer_lists
                        for a, b in itertools.combinations(sorted({x for x in answers if x is not None}), 2)})
        if pairs:
            verdicts = grader.grade_many([f"\\boxed{{{a}}}" for a, _ in pairs], [b for _, b in pairs])
            for (a, b), v in zip(pairs, verdicts):
                memo[(a, b)] = memo[(b, a)] = bool(v.correct)
        return lambda a, b: a == b or memo.get((a, b), False)

    def same(a: str, b: str) -> bool:
        if (a, b) not in memo:
            memo[(a, b)] = memo[(b, a)] = judge(a, b)[0]
        return memo[(a, b)]

    return same


def results_file(key: str, grader_name: str) -> str:
    """A setting's results file under one grader, relative to its benchmark folder."""
    return f"results/{key}-{grader_name}.json"


def write_results(out_dir: Path, s: EvalSettings, rows: list[dict], grader: Grader, words, data: dict,
                  elapsed: float = 0.0, extra: Optional[dict] = None, run: Optional[dict] = None,
                  supersedes: tuple[str, ...] = ()) -> dict:
    """Metrics of one setting's rows under one grader (from each row's verdict of this grader, never
    from the top-level fields, which hold the latest grader's): the ledger's record (`evaluation_record`),
    results/<key>-<grader>.json and results.json. `data`: where the problems came from (`data_record`);
    `run`: a training run's part of the identity (`run_identity`); `supersedes`: ids of records this one
    replaces (a regrade with corrected golds)."""
    by_problem: dict[int, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["idx"], []).append(r)
    short = {i: len({r["sample"] for r in rs}) for i, rs in by_problem.items() if len({r["sample"] for r in rs}) < s.n}
    expected = data.get("problems") if isinstance(data, dict) else None
    if short or (isinstance(expected, int) and len(by_problem) < expected):
        where = (f"problem {min(short)} has {short[min(short)]} of its {s.n} samples"
                 + (f" ({len(short)} problems short)" if len(short) > 1 else "")) if short else \
            f"{len(by_problem)} of the {expected} problems have samples"
        raise StareError(f"{out_dir}: samples of settings {s.key()} are incomplete: {where}; results for n={s.n} "
                         "would be computed on fewer samples", hint="run the same `stare eval` again: it generates "
                         "what is missing (a regrade never generates)")
    per_problem = []
    for idx in sorted(by_problem):
        ss = sorted(by_problem[idx], key=lambda r: r["sample"])[: s.n]
        vs = [r["verdicts"][grader.tag] for r in ss]
        per_problem.append({
            "correct": [v["correct"] for v in vs], "answers": [v["extracted"] for v in vs],
            "lengths": [r["length"] for r in ss], "finished": [r["finished"] for r in ss],
            "reflection": sum(reflection_rate([r["response"]], words) for r in ss) / len(ss),
            "tool_calls": [r.get("tool_calls", 0) for r in ss],
        })
    spec = BENCHMARKS[s.bench]
    results = {
        "benchmark": s.bench, "benchmark_version": spec.version, "settings": asdict(s), "key": s.key(),
        "grader": grader.tag,
        "protocol": {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "template": s.template,
                     "max_tokens": s.max_tokens, "paper_protocol": s.n == spec.n and s.temperature == spec.temperature
                     and s.top_p == spec.top_p and s.max_tokens == spec.max_tokens and s.template == spec.template
                     and s.tools is None and s.limit is None and not data.get("partial")},
        "data": data, "metrics": benchmark_metrics(per_problem, same=_same_answer(grader, [p["answers"] for p in per_problem])),
        "elapsed_s": elapsed,
        "environment": environment_summary(), **(extra or {}), **({"run": run} if run else {}),
    }
    rec = evaluation_record(s, results, run, supersedes)
    write_record(out_dir, rec)
    results["record"] = rec.id
    text = json.dumps(results, indent=2)
    atomic_write_text(out_dir / results_file(s.key(), grader.spec.name), text)
    atomic_write_text(out_dir / "results.json", text)
    return results


def engine_tag(name: str) -> str:
    """'name@version' of the package that generated: transformers for hf (and the trainer's rollout engines),
    vllm, lm-eval for the bridge; an OpenAI-compatible server does not say its version."""
    from importlib import metadata

    pkg = {"vllm": "vllm", "openai": None}.get(name, "lm-eval" if name.startswith("lm-eval") else "transformers")
    if pkg is None:
        return f"{name}@{UNKNOWN}"
    try:
        return f"{name}@{pkg} {metadata.version(pkg)}"
    except metadata.PackageNotFoundError:
        return f"{name}@{UNKNOWN}"


def evaluation_record(s: EvalSettings, results: dict, run: Optional[dict] = None,
                      supersedes: tuple[str, ...] = ()) -> Record:
    """The ledger's record of one results dict (`write_results`): identity from the settings, the data
    record, the grader and engine, and for a training run's model its method, recipe, step and lr."""
    data = results["data"] if isinstance(results.get("data"), dict) else {}
    run = run or {}
    ident = {
        "ledger": LEDGER, "benchmark": s.bench, "benchmark_version": results.get("benchmark_version"),
        "weights": TRAINED if run else (s.weights or UNKNOWN), "method": run.get("method"),
        "method_params": run.get("method_params"), "recipe": run.get("recipe"), "step": run.get("step"),
        "lr": run.get("lr"),
        "data": data.get("sha256") or s.data or UNKNOWN, "problems": results["metrics"].get("problems"),
        "partial": bool(data.get("partial", s.limit is not None)),
        "n": s.n, "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens,
        "template": s.template, "chat": s.chat if s.chat is not None else UNKNOWN,
        "prompt": s.prompt or UNKNOWN, "tools": s.tools, "grader": results["grader"],
        "engine": engine_tag(s.engine), "dtype": s.dtype,
    }
    run_block = {"dir": run["dir"], "name": Path(run["dir"]).name} if run.get("dir") else None
    return Record(identity=ident, metrics=results["metrics"], seed=s.seed, train_seed=run.get("train_seed"),
                  weights_digest=(s.weights if s.weights != TRAINED else None) if run else None,
                  samples_key=s.key(), written=now_iso(), evaluation=results.get("evaluation"),
                  supersedes=tuple(supersedes), run=run_block, model_path=s.model,
                  extra={"protocol": results["protocol"], "data": results["data"], "elapsed_s": results["elapsed_s"],
                         "environment": results["environment"],
                         **({"harness": results["harness"]} if "harness" in results else {})})


def prompt_format(template: str, tokenizer, use_chat_template: bool, tools=None) -> tuple[str, bool]:
    """(digest of the prompt a problem is rendered into, whether a chat template wrapped it): one value
    for the template, the tokenizer's chat template, the system prompt and the tool text together."""
    from benchmarks.generation.templates import has_chat_template

    marker = "\x00PROBLEM\x00"
    text = build_prompt(marker, template, tokenizer, use_chat_template, tools)
    chat = template not in ("raw", "plain") and tokenizer is not None and has_chat_template(tokenizer, use_chat_template)
    return "sha256:" + digest(text, 64), chat


_DIGESTS: dict[tuple, str] = {}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")


def weights_digest(path: str) -> str:
    """'sha256:<digest>' of a model folder's weight files (their names and SHA-256s; a training checkpoint's
    from its manifest, verified when it was loaded), 'hub:<id>' for a model that is not a local folder.
    Hashing reads the weights once per process and file state (size, mtime): ~1 s per GB here."""
    from stare_kernel.io import file_sha256

    p = Path(path)
    if not p.is_dir():
        return f"hub:{path}"
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES) and f.name != "trainer.pt")
    state = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if (p.resolve(), state) in _DIGESTS:
        return _DIGESTS[(p.resolve(), state)]
    manifest = {}
    try:
        manifest = json.loads((p / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sums = {f.name: (manifest.get(f.name) or {}).get("sha256") if isinstance(manifest.get(f.name), dict) else None
            for f in files}
    sums = {name: sha or file_sha256(p / name) for name, sha in sums.items()}
    out = "sha256:" + digest(sums, 64)
    _DIGESTS[(p.resolve(), state)] = out
    return out


def run_identity(run_dir: Path, ckpt: Path) -> dict:
    """A training run's part of an evaluation's identity for its checkpoint `ckpt`: method, recipe digest,
    training seed, step (the checkpoint's state.json) and the learning rate logged at that step."""
    import yaml

    from stare_kernel.ledger import run_fields
    from stare_kernel.reader import step_lr

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    try:
        step = int(json.loads((ckpt / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = int(ckpt.name.split("-")[1]) if ckpt.name.startswith("step-") and ckpt.name[5:].isdigit() else None
    return {"dir": str(run_dir), **run_fields(cfg), "train_seed": cfg["optim"]["seed"], "step": step,
            "lr": step_lr(run_dir, step) if step is not None else UNKNOWN}


def evaluate_benchmark(engine, tokenizer, s: EvalSettings, out_dir: Path, grader: Grader,
                       data_file: Optional[str] = None, use_chat_template: bool = True, progress=None,
                       reflection_words: Optional[list[str]] = None, tools=None, rows: Optional[list[dict]] = None,
                       evaluation: Optional[str] = None, run: Optional[dict] = None) -> dict:
    """Evaluate one benchmark into out_dir; returns the results dict (also written as results.json, and as
    the ledger's record). `rows`: the benchmark's problems when already loaded (check_inputs).
    `evaluation`: the id of the `stare eval` command this is part of (`new_evaluation_id`), recorded in
    the results. `run`: the training run's part of the identity (`run_identity`; the trainer's own)."""
    words = reflection_words or REFLECTION_WORDS
    if rows is None:
        rows = load_benchmark(s.bench, limit=s.limit, data_file=data_file)
    if s.data is None:
        s = replace(s, data=data_digest(rows))
    if s.prompt is None:
        fmt, chat = prompt_format(s.template, tokenizer, use_chat_template, tools)
        s = replace(s, prompt=fmt, chat=chat)
    data = data_record(s.bench, rows, s.data, data_file)
    lock = hold_run_lock(out_dir, "evaluated")  # a second writer of this folder is refused by name
    try:
        return _evaluate_locked(engine, tokenizer, s, out_dir, grader, rows, data, words, use_chat_template,
                                progress, tools, evaluation, run)
    finally:
        lock.close()


def _evaluate_locked(engine, tokenizer, s: EvalSettings, out_dir: Path, grader: Grader, rows: list[dict], data: dict,
                     words, use_chat_template: bool, progress, tools, evaluation: Optional[str] = None,
                     run: Optional[dict] = None) -> dict:
    samples_path = out_dir / "samples.jsonl"
    key = s.key()
    done: dict[tuple[int, int], dict] = {}
    others = []  # rows of other settings: kept as they are
    for r in read_jsonl(samples_path, strict=True, required=SAMPLE_FIELDS):  # a torn last line is redone
        if r.get("key") == key:
            done[(r["idx"], r["sample"])] = r
        else:
            others.append(r)
    # Keep only whole chunks (a crash may have left part of one).
    chunks = [rows[i: i + CHUNK] for i in range(0, len(rows), CHUNK)]
    complete = {ci for ci, ch in enumerate(chunks) if all((r["idx"], j) in done for r in ch for j in range(s.n))}
    reused = _chunks_of_other_limits(out_dir, s, chunks, complete, others, tokenizer, use_chat_template, tools)
    for ci, chunk_rows in reused.items():
        complete.add(ci)
        done.update({(r["idx"], r["sample"]): r for r in chunk_rows})
    kept = [done[(r["idx"], j)] for ci in sorted(complete) for r in chunks[ci] for j in range(s.n)]
    atomic_write_text(samples_path, "".join(json.dumps(r) + "\n" for r in [*others, *kept]))
    already = sum(len(chunks[ci]) for ci in complete)
    if reused:
        print(f"{s.bench}: {sum(len(chunks[ci]) for ci in reused)} problems' samples reused from an evaluation of "
              f"the same settings with another --limit", file=sys.stderr, flush=True)
    task = progress.add_task(f"{s.bench}", total=len(rows), completed=already) if progress else None
    show = None
    if progress is not None and progress.console.is_terminal:
        show = lambda text: progress.update(task, description=text.split(": ", 1)[1])  # noqa: E731
    line = ProgressLine(s.bench, len(rows), already, samples_per_problem=s.n, max_tokens=s.max_tokens,
                        show=show).start()
    t0 = time.time()
    try:
        _generate_chunks(engine, tokenizer, s, chunks, complete, key, samples_path, grader, use_chat_template, tools,
                         lambda k: (line.advance(k), progress.update(task, advance=k) if progress else None))
    finally:
        line.close()
    all_rows = read_jsonl(samples_path, strict=True)
    mine = [r for r in all_rows if r.get("key") == key]
    before = [(r.get("grader"), r.get("correct")) for r in mine]
    _grade_rows(mine, grader)  # saved samples of another grader: graded; every row's top level: this grader's
    if [(r.get("grader"), r.get("correct")) for r in mine] != before:
        atomic_write_text(samples_path, "".join(json.dumps(r) + "\n" for r in all_rows))
    return write_results(out_dir, s, mine, grader, words, data, time.time() - t0,
                         extra={"evaluation": evaluation} if evaluation else None, run=run)


def _chunks_of_other_limits(out_dir: Path, s: EvalSettings, chunks: list[list[dict]], complete: set[int],
                            others: list[dict], tokenizer, use_chat_template: bool, tools) -> dict[int, list[dict]]:
    """Whole chunks already generated under settings that differ from `s` only in `limit` (and so in the
    data digest of the problems evaluated): chunk ci's sampling seed depends on ci alone, so a chunk of
    the same problems (same index, prompt and gold, every sample) under those settings is what this
    evaluation would generate. Returns {chunk index: its rows under this key, marked `reused_from`}."""
    if not others:
        return {}
    try:
        settings = _settings_by_key(out_dir)
    except StareError:
        return {}
    mine = {**asdict(s), "limit": None, "data": None}
    keys = [k for k, (o, *_) in settings.items() if {**asdict(o), "limit": None, "data": None} == mine
            and k != s.key()]
    if not keys:
        return {}
    by_key: dict[str, dict[tuple[int, int], dict]] = {}
    for r in others:
        if r["key"] in keys:
            by_key.setdefault(r["key"], {})[(r["idx"], r["sample"])] = r
    out: dict[int, list[dict]] = {}
    for ci, chunk in enumerate(chunks):
        if ci in complete:
            continue
        prompts = [build_prompt(r["problem"], s.template, tokenizer, use_chat_template, tools) for r in chunk]
        for k, have in by_key.items():
            got = [have.get((r["idx"], j)) for r in chunk for j in range(s.n)]
            expected = [(p, r["answer"]) for r, p in zip(chunk, prompts) for _ in range(s.n)]
            same = all(g is not None and (g.get("prompt"), g["gold"]) == e for g, e in zip(got, expected))
            # the other evaluation's chunk ci (problems ci*CHUNK to (ci+1)*CHUNK - 1; idx is the position)
            # must hold exactly these problems: the same batch under the same seed
            theirs = {i for (i, _) in have if ci * CHUNK <= i < (ci + 1) * CHUNK}
            if same and theirs == {r["idx"] for r in chunk}:
                out[ci] = [{**g, "key": s.key(), "reused_from": k} for g in got]
                break
    return out


def _generate_chunks(engine, tokenizer, s: EvalSettings, chunks: list[list[dict]], complete: set[int], key: str,
                     samples_path: Path, grader: Grader, use_chat_template: bool, tools, advance) -> None:
    """Generate and grade every chunk not fully on disk, appending its rows (one write per chunk)."""
    for ci, chunk in enumerate(chunks):
        if ci in complete:
            continue
        prompts = [build_prompt(r["problem"], s.template, tokenizer, use_chat_template, tools) for r in chunk]
        sp = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=-1, max_new_tokens=s.max_tokens,
                            seed=s.seed * 1_000_003 + ci)
        groups = engine.generate(prompts, sp, tools) if tools is not None else engine.generate(prompts, sp)
        new = [{"key": key, "idx": r["idx"], "sample": j, "prompt": p, "response": smp.text, "gold": r["answer"],
                "finished": smp.finished, "length": len(smp.response_ids) if smp.response_ids else len(smp.text.split()),
                "tool_calls": smp.tool_calls, "tool_errors": smp.tool_errors}
               for r, p, g in zip(chunk, prompts, groups) for j, smp in enumerate(g)]
        _grade_rows(new, grader)
        with open(samples_path, "a") as f:  # one write per chunk; a torn chunk is redone on resume
            f.write("".join(json.dumps(r) + "\n" for r in new))
            f.flush()
        advance(len(chunk))


def regrade(folder: Path, grader_name: str = "math-verify", workers: Optional[int] = None) -> dict[str, dict]:
    """Grade the saved samples under `folder` (one benchmark folder, or a folder of them) with a
    grader, with no generation; new results are written beside the old. Returns {bench: results}."""
    folder = Path(folder)
    benches = [folder] if (folder / "samples.jsonl").exists() else sorted(p.parent for p in folder.glob("*/samples.jsonl"))
    if not benches:
        raise StareError(f"{folder}: no samples.jsonl here or in its subfolders", hint="point at a `stare eval` output")
    out: dict[str, dict] = {}
    with Grader(workers=workers, name=grader_name) as grader:
        for bench_dir in benches:
            with contextlib.closing(hold_run_lock(bench_dir, "evaluated")):
                out.update(_regrade_folder(bench_dir, grader))
    return out


def _regrade_folder(bench_dir: Path, grader: Grader) -> dict[str, dict]:
    """One benchmark folder's samples graded by `grader` (the caller holds its lock)."""
    out: dict[str, dict] = {}
    regraded: list[tuple[EvalSettings, Optional[str], dict]] = []
    rows = read_jsonl(bench_dir / "samples.jsonl", strict=True, torn_last_ok=False,  # rewritten below
                      required=SAMPLE_FIELDS)
    settings = _settings_by_key(bench_dir)
    for key in dict.fromkeys(r["key"] for r in rows):
        if key not in settings:
            raise StareError(f"{bench_dir}: no results file records the settings of samples {key}",
                             hint="re-run `stare eval` with the same settings once")
        s, data, evaluation, run = settings[key]
        mine = [r for r in rows if r["key"] == key]
        corrected = [r for r in mine if gold_changed(r, grader.tag)]
        supersedes: tuple[str, ...] = ()
        if corrected:  # golds corrected in samples.jsonl: other data; the record of the old golds is superseded
            old = _record_of(bench_dir, key, grader.tag)
            supersedes = (old,) if old else ()
            golds = sorted((r["idx"], str(r["gold"])) for r in mine if r["sample"] == 0)
            new = hashlib.sha256(json.dumps([data.get("sha256") or s.data, golds]).encode()).hexdigest()
            data = {**data, "sha256": new, "golds_corrected": len({r["idx"] for r in corrected}),
                    "corrected_from": data.get("sha256") or s.data}
            s = replace(s, data=new)
            for r in mine:
                r["key"] = s.key()  # the corrected rows are samples of the corrected data
            print(f"{bench_dir}: {len({r['idx'] for r in corrected})} problems' golds differ from those they were "
                  f"graded against: graded again, recorded as data {new[:12]}", file=sys.stderr)
        mine = _grade_rows(mine, grader)
        out[s.bench] = write_results(bench_dir, s, mine, grader, REFLECTION_WORDS, data,
                                     extra={"evaluation": evaluation} if evaluation else None, run=run,
                                     supersedes=supersedes)
        regraded.append((s, evaluation, out[s.bench]))
    # An evaluation of several seeds keeps its per-seed record under the new grader (what compare reads):
    # the seeds of one evaluation id whose settings differ in the seed alone, in the order they were run.
    by_eval: dict[tuple, list[dict]] = {}
    for s, evaluation, res in regraded:
        if evaluation:
            by_eval.setdefault((evaluation, json.dumps({**asdict(s), "seed": None}, sort_keys=True)), []).append(res)
    for per_seed in by_eval.values():
        if len(per_seed) > 1:
            order = _seed_order(bench_dir, per_seed)
            out[per_seed[0]["benchmark"]] = record_seed_spread(bench_dir, sorted(per_seed, key=order), grader)
    atomic_write_text(bench_dir / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return out


def _seed_order(bench_dir: Path, per_seed: list[dict]):
    """Sort key putting seeds in the order the evaluation recorded them (its earlier `over_seeds`), else by seed."""
    recorded: list = []
    for p in sorted((bench_dir / "results").glob("*.json")):
        try:
            sp = json.loads(p.read_text()).get("over_seeds")
        except (OSError, ValueError):
            continue
        if sp and set(sp.get("seeds", [])) >= {r["settings"]["seed"] for r in per_seed}:
            recorded = sp["seeds"]
            break
    return lambda r: (recorded.index(r["settings"]["seed"]) if r["settings"]["seed"] in recorded else len(recorded),
                      r["settings"]["seed"])


def latest_grader_results(bench_dir: Path) -> list[dict]:
    """Every setting evaluated into `bench_dir`, as its results/<key>-<grader>.json under the grader
    of the latest results.json, oldest first ([] when the folder holds no readable results)."""
    try:
        grader = json.loads((bench_dir / "results.json").read_text())["grader"].split("@")[0]
        files = [f for f in (bench_dir / "results").glob("*.json") if f.name.split("-", 1)[-1] == f"{grader}.json"]
        return [json.loads(f.read_text()) for f in sorted(files, key=lambda f: f.stat().st_mtime)]
    except (OSError, ValueError, KeyError):
        return []


def _record_of(bench_dir: Path, key: str, grader_tag: str) -> Optional[str]:
    """The id of the newest record of samples `key` under grader `grader_tag` in a benchmark folder."""
    from stare_kernel.reader import find_records

    mine = [r for r in find_records([bench_dir]).records if r.samples_key == key and r.identity["grader"] == grader_tag
            and not r.legacy]
    return max(mine, key=lambda r: r.written).id if mine else None


def _settings_by_key(bench_dir: Path) -> dict[str, tuple[EvalSettings, dict, Optional[str], Optional[dict]]]:
    """Each recorded setting of a benchmark folder, with the data record it was evaluated on, the
    evaluation it was part of and the training run's part of its identity (kept by a regrade)."""
    found = {}
    for p in [bench_dir / "results.json", *sorted((bench_dir / "results").glob("*.json"))]:
        if p.exists():
            try:
                res = json.loads(p.read_text())
                s = EvalSettings(**res["settings"])
            except (ValueError, KeyError, TypeError) as e:
                raise StareError(f"{p}: not a results file stare wrote ({type(e).__name__}: {str(e)[:80]})",
                                 hint="remove it, or re-run `stare eval` with the same settings") from None
            data = res.get("data") if isinstance(res.get("data"), dict) else {"source": str(res.get("data"))}
            found[res["key"]] = (s, data, res.get("evaluation"), res.get("run"))
    return found


def new_evaluation_id() -> str:
    """An id shared by every results file one `stare eval` command writes (time and a random part), so that
    `stare compare` shows each evaluation of a folder as its own row."""
    import uuid

    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def seed_spread(per_seed: list[dict]) -> dict:
    """avg@N of each seed's results, their mean and sample standard deviation (n - 1: the spread of
    a new seed, as RL papers report it), and the results files they come from."""
    import statistics

    n = per_seed[0]["metrics"]["n"]
    vals = [r["metrics"][f"avg@{n}"] for r in per_seed]
    return {"seeds": [r["settings"]["seed"] for r in per_seed], "metric": f"avg@{n}", "values": vals,
            "mean": statistics.fmean(vals), "std": statistics.stdev(vals),
            "results": [results_file(r["key"], r["grader"].split("@")[0]) for r in per_seed]}


def record_seed_spread(bench_dir: Path, per_seed: list[dict], grader: Grader) -> dict:
    """The last seed's results with `over_seeds` added, rewritten as results.json and its own file
    (what `stare compare` reads: one result per seed, mean ± std over them)."""
    res = {**per_seed[-1], "over_seeds": seed_spread(per_seed)}
    text = json.dumps(res, indent=2)
    atomic_write_text(bench_dir / results_file(res["key"], grader.spec.name), text)
    atomic_write_text(bench_dir / "results.json", text)
    return res


def data_record(bench: str, rows: list[dict], digest: str, data_file: Optional[str] = None) -> dict:
    """Where a benchmark's problems came from, their digest and count, and whether they are only part
    of the benchmark (a --limit, a smaller local file, or a generated set's subset): `partial` results
    never count as the paper's protocol, and `stare compare` marks them."""
    from benchmarks.data.registry import benchmark_source

    spec = BENCHMARKS[bench]
    return {"source": benchmark_source(bench, data_file), "sha256": digest, "problems": len(rows),
            "reference_problems": spec.size, "partial": len(rows) < spec.size}


def resolve_model(model: str) -> tuple[str, Optional[Path]]:
    """(path or hub id, run directory when the model is a training checkpoint). Toy and short model
    names (benchmarks/data/models.py) become their folders."""
    from benchmarks.data.models import MODELS, resolve_model_path

    if model.startswith("toy:") or model in MODELS:
        return resolve_model_path(model), None
    p = Path(model).expanduser()
    if (p / "checkpoints" / "latest").exists():
        p = p / "checkpoints" / "latest"
    if p.exists():
        real = p.resolve()
        run = real.parent.parent if real.parent.name == "checkpoints" else None
        return str(real), run
    return model, None


def eval_out_dir(model: str, path: str, run_dir: Optional[Path], out: Optional[Path]) -> Path:
    """Where `stare eval` writes: --out, or by default evals/<model> (a short or toy name keeps its own name,
    evals/smollm2-135m; a run's checkpoint goes to evals/<run>/<checkpoint>, never into the run, whose
    folders its trainer alone writes). An --out inside a run directory is refused by name."""
    from benchmarks.data.models import MODELS
    from stare_kernel.ledger import enclosing_run

    if out is None:
        named = model.startswith("toy:") or model in MODELS
        out = (Path("evals") / run_dir.name / Path(path).name) if run_dir else Path("evals") / (
            model.replace(":", "-") if named else path.strip("/").replace("/", "__"))
    inside = enclosing_run(out)
    if inside is not None:
        raise StareError(f"--out {out} is inside the run directory {inside}: a run's folders are written by its "
                         "trainer alone (its evaluations are the run's own rows)",
                         hint=f"leave --out out (evals/{inside.name}/...), or choose a folder outside the run")
    return out


def check_model_path(model: str, path: str) -> None:
    """One line for a --model that names no model (benchmarks/data/models.py: check_model_name)."""
    from benchmarks.data.models import check_model_name

    check_model_name("--model", model, path)


def check_inputs(benches: list[str], limit: Optional[int], data_file: Optional[str], out: Path,
                 before_out=None) -> dict[str, list[dict]]:
    """Everything that can fail before a model loads: every benchmark's data (file and line of a bad
    row, an empty file, a missing file in STARE_DATA_DIR), then `before_out()` (the model's name), then a
    writable output folder (created last: a failed check leaves no empty folder)."""
    rows = {b: load_benchmark(b, limit=limit, data_file=data_file) for b in benches}
    if before_out is not None:
        before_out()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{time.time_ns()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise StareError(f"--out {out}: cannot write there ({e.strerror})",
                         hint="choose a folder you can write, e.g. --out evals/my-model") from None
    return rows


def run_eval(model: str, benches: list[str], engine_name: str = "auto", n: Optional[int] = None,
             limit: Optional[int] = None, out: Optional[Path] = None, template: Optional[str] = None,
             temperature: Optional[float] = None, top_p: Optional[float] = None, max_tokens: Optional[int] = None,
             seed: int | list[int] = 0, data_file: Optional[str] = None, base_url: Optional[str] = None, workers: Optional[int] = None,
             device: str = "auto", batch_size: int = 64, dtype: str = "auto", tools: Optional[str] = None,
             vllm_kwargs: Optional[dict] = None, grader: str = "math-verify",
             wandb_mode: Optional[str] = None, unsafe_no_sandbox: bool = False) -> dict[str, dict]:
    """Evaluate `model` on `benches`; returns {bench: results}. Progress on stderr (a bar on a
    terminal, lines with rate and ETA otherwise). With several seeds, each seed is a setting of its
    own (its own samples and results file), and each benchmark's results (the last seed's) carry
    `over_seeds`: avg@N per seed, their mean and sample standard deviation (`seed_spread`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from benchmarks.data.registry import check_benchmark, expand

    benches = expand(benches)
    for b in benches:
        check_benchmark(b)
    seeds = [seed] if isinstance(seed, int) else list(seed)
    if len(set(seeds)) != len(seeds) or not seeds:
        raise StareError(f"--seed {', '.join(map(str, seeds))}: each seed once", hint="e.g. --seed 1 --seed 2 --seed 3")
    if data_file and len(benches) > 1:
        raise StareError("--data-file names one benchmark's file", hint="use STARE_DATA_DIR for several")
    tool_spec = None
    if tools:
        from benchmarks.generation.tools import ToolSpec
        from benchmarks.generation.sandbox import Limits, require_isolation

        if tools != "python":
            raise StareError(f"unknown tool '{tools}'", hint="the available tool is 'python'")
        tool_spec = ToolSpec(limits=Limits(unsafe_no_isolation=unsafe_no_sandbox))
        require_isolation(tool_spec.limits)  # fail closed before the model loads
    elif unsafe_no_sandbox:
        raise StareError("--unsafe-no-sandbox applies to --tools python", hint="drop it, or add --tools python")
    path, run_dir = resolve_model(model)
    out = eval_out_dir(model, path, run_dir, out)
    # before the model loads: the data (file and line of a bad row), then the model's name, then --out
    # (the last, so that no failed check leaves an empty folder behind)
    def check_model() -> None:
        check_model_path(model, path)
        if (Path(path) / MANIFEST).exists():  # a training checkpoint: verified by content before it loads
            problem = checkpoint_problem(Path(path))
            if problem:
                raise StareError(f"--model {model}: the checkpoint is damaged: {problem}",
                                 hint="evaluate an earlier checkpoint (checkpoints/step-N)")

    data = check_inputs(benches, limit, data_file, out, before_out=check_model)  # no folder is left by a failure
    if engine_name == "auto":
        engine_name = _auto_engine()
    print(f"stare eval: loading {path} ({engine_name} engine); results go to {out}", file=sys.stderr, flush=True)
    engine, tok = _make_engine(engine_name, path, base_url, device, batch_size, dtype, vllm_kwargs or {})
    weights = weights_digest(path)  # after loading: a damaged checkpoint was refused above
    run = run_identity(run_dir, Path(path)) if run_dir else None
    results = {}
    grading = Grader(workers=workers, name=grader)
    console = Console(stderr=True)
    evaluation = new_evaluation_id()
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=not console.is_terminal) as prog:
            for b in benches:
                spec = BENCHMARKS[b]
                per_seed = []
                for sd in seeds:
                    s = EvalSettings(model=path, bench=b, template=template or spec.template, n=n or spec.n,
                                     temperature=spec.temperature if temperature is None else temperature,
                                     top_p=spec.top_p if top_p is None else top_p, max_tokens=max_tokens or spec.max_tokens,
                                     seed=sd, engine=engine_name, limit=limit, tools=tools,
                                     dtype=None if dtype == "auto" else dtype, weights=weights)
                    per_seed.append(evaluate_benchmark(engine, tok, s, out / dir_name(b), grading, data_file=data_file,
                                                       progress=prog, tools=tool_spec, rows=data[b],
                                                       evaluation=evaluation, run=run))
                results[b] = per_seed[0] if len(seeds) == 1 else record_seed_spread(out / dir_name(b), per_seed, grading)
                if not console.is_terminal:
                    m = results[b]["metrics"]
                    avg = m[f"avg@{m['n']}"]
                    print(f"{b}: avg@{m['n']} {avg:.1f}", file=sys.stderr, flush=True)
    finally:
        grading.close()
    for b, r in results.items():  # where each benchmark went (the command prints it; not written into the files)
        results[b] = {**r, "out": str(out / dir_name(b))}
    summary = {"model": path, "out": str(out), "grader": grading.tag,
               "benchmarks": {b: r["metrics"] for b, r in results.items()},
               **({"over_seeds": {b: r["over_seeds"] for b, r in results.items()}} if len(seeds) > 1 else {})}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    if wandb_mode:
        log_to_wandb(summary, out, wandb_mode)
    return results


def log_to_wandb(summary: dict, out: Path, mode: str) -> None:
    """The evaluation's metrics as one wandb run (`mode`: offline or online), files under `out`."""
    import wandb

    run = wandb.init(project="stare-eval", name=f"{Path(summary['model']).name}", dir=str(out), mode=mode,
                     config={"model": summary["model"], "grader": summary["grader"]}, reinit=True)
    run.log({f"{b}/{k}": v for b, m in summary["benchmarks"].items() for k, v in m.items()
             if isinstance(v, (int, float))})
    run.finish()


def _auto_engine() -> str:
    try:
        import torch

        import vllm  # noqa: F401

        return "vllm" if torch.cuda.is_available() else "hf"
    except ImportError:
        return "hf"


def _make_engine(name: str, path: str, base_url: Optional[str], device: str, batch_size: int, dtype: str,
                 vllm_kwargs: dict):
    from benchmarks.generation.attention import use_gqa_sdpa_on_cpu
    from benchmarks.generation.engines import HFEngine, OpenAIEngine, VLLMEngine, load_tokenizer

    if name == "openai":
        if not base_url:
            raise StareError("--engine openai needs --base-url", hint="e.g. --base-url http://localhost:8000/v1")
        try:
            tok = load_tokenizer(path)
        except Exception:
            tok = None  # the server applies no template; prompts are built without a chat template
        return OpenAIEngine(base_url, path), tok
    if name == "vllm":
        e = VLLMEngine(path, **({"dtype": dtype} if dtype != "auto" else {}), **vllm_kwargs)
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
