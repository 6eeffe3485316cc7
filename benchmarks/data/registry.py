"""The six evaluation benchmarks of the paper, each a small declarative spec.

Sources (public Hugging Face hub copies; chosen because they hold exactly the sets the paper
reports, with one gold answer per problem and a test split):
- aime24: HuggingFaceH4/aime_2024 (30 problems, AIME 2024 I and II)
- aime25: math-ai/aime25 (30 problems, AIME 2025 I and II)
- amc23: math-ai/amc23 (40 problems, AMC 2023 as used by Qwen2.5-Math and SimpleRL)
- math500: HuggingFaceH4/MATH-500 (the 500-problem subset of Lightman et al.)
- minerva: math-ai/minervamath (the 272-problem Minerva/OCW set, not Hendrycks MATH)
- olympiadbench: math-ai/olympiadbench (674 English, text-only, math, open-ended problems)
Field names differ between copies; each spec lists the candidates it tries in order.

Local override (no network): `--data-file FILE` or `STARE_DATA_DIR` holding `<name>.jsonl` with
fields `problem` and `answer`. Problems that already end with the paper's instruction sentence
are left as they are (templates never add it twice).

Protocol (the paper): avg@32 for AIME24, AIME25 and AMC23, avg@4 for the others; temperature 1.0,
top_p 0.7. Bump `version` when a spec changes what a result means.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from stare_kernel.errors import StareError, did_you_mean

PAPER_ORDER = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    title: str
    hub_id: str
    split: str
    n: int  # samples per problem in the paper's protocol
    size: int  # problems in the reference copy
    problem_fields: tuple[str, ...] = ("problem", "question", "Problem", "Question")
    answer_fields: tuple[str, ...] = ("answer", "final_answer", "Answer", "gt_answer")
    temperature: float = 1.0
    top_p: float = 0.7
    max_tokens: int = 3072
    metrics: tuple[str, ...] = ("avg@n", "pass@k", "maj@k")
    version: int = 1
    template: str = "paper"  # the prompt template of its protocol (benchmarks/generation/templates.py)
    # Generated locally (no file, no hub): (number of problems) -> rows {'problem', 'answer'}.
    generate: Optional[Callable[[int], list[dict]]] = field(default=None, compare=False)


BENCHMARKS: dict[str, BenchmarkSpec] = {
    b.name: b
    for b in [
        BenchmarkSpec("aime24", "AIME24", "HuggingFaceH4/aime_2024", "train", n=32, size=30),
        BenchmarkSpec("aime25", "AIME25", "math-ai/aime25", "test", n=32, size=30),
        BenchmarkSpec("amc23", "AMC23", "math-ai/amc23", "test", n=32, size=40),
        BenchmarkSpec("math500", "MATH-500", "HuggingFaceH4/MATH-500", "test", n=4, size=500),
        BenchmarkSpec("minerva", "Minerva", "math-ai/minervamath", "test", n=4, size=272),
        BenchmarkSpec("olympiadbench", "OlympiadBench", "math-ai/olympiadbench", "test", n=4, size=674),
    ]
}


# Generated training sets (`data.train: toy:arith`, `words:add-sub`): name -> (rows, seed) -> [{'problem', 'answer'}]
TRAIN_SETS: dict[str, Callable[[int, int], list[dict]]] = {}
GENERATED_PREFIXES = ("toy:", "words:")  # a data.train with one of these must name a registered set


def register_train_set(name: str, generate: Callable[[int, int], list[dict]]) -> None:
    """Add a generated training set (the toy's tasks, the word problems)."""
    if not name.startswith(GENERATED_PREFIXES):
        raise ValueError(f"generated training sets are named {' or '.join(GENERATED_PREFIXES)}<name>, not {name}")
    TRAIN_SETS[name] = generate


def register(spec: BenchmarkSpec) -> None:
    """Add a generated benchmark (one with a `generate` function; the toy registers its held-out
    sets: benchmarks/data/toy.py). Registering a name twice with another spec is an error."""
    if spec.generate is None:
        raise ValueError(f"{spec.name}: only generated benchmarks are registered (the six are built in)")
    if BENCHMARKS.get(spec.name, spec) != spec:
        raise ValueError(f"benchmark {spec.name} is already registered with another spec")
    BENCHMARKS[spec.name] = spec


def dir_name(name: str) -> str:
    """A benchmark's folder under an evaluation directory: the name with ':' and '/' as '-' (portable)."""
    return name.replace(":", "-").replace("/", "-")


def check_benchmark(name: str) -> BenchmarkSpec:
    if name not in BENCHMARKS:
        raise StareError(f"unknown benchmark '{name}'{did_you_mean(name, BENCHMARKS)}; valid: {', '.join(BENCHMARKS)}, paper")
    return BENCHMARKS[name]


def expand(names: list[str]) -> list[str]:
    """'paper' stands for all six, in the paper's order."""
    out: list[str] = []
    for n in names:
        for x in (PAPER_ORDER if n == "paper" else [n]):
            if x not in out:
                out.append(x)
    return out


def _pick(row: dict, fields: tuple[str, ...], what: str, name: str) -> str:
    for f in fields:
        if f in row and row[f] is not None:
            v = row[f]
            if isinstance(v, list):  # OlympiadBench stores final answers as a list
                v = v[0] if len(v) == 1 else ", ".join(str(x) for x in v)
            return str(v)
    raise StareError(f"{name}: no {what} field (tried {', '.join(fields)}); fields: {', '.join(row)}")


def read_jsonl_rows(path: Path) -> list[dict]:
    """Rows of a JSONL data file; a bad line, a non-object, an empty file or undecodable bytes fail
    with the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise StareError(f"{path}: not UTF-8 text (byte {e.start})", hint="save the file as UTF-8 JSONL") from None
    except OSError as e:
        raise StareError(f"{path}: cannot read ({e.strerror})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise StareError(f"{path}:{n}: not valid JSON ({e.msg})", hint="one JSON object per line") from None
        if not isinstance(row, dict):
            raise StareError(f"{path}:{n}: a row must be a JSON object, not {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise StareError(f"{path}: no problems (the file is empty)", hint="rows need `problem` and `answer` fields")
    return rows


def _local_file(name: str, data_file: Optional[str]) -> Optional[Path]:
    """The local file a benchmark is read from (--data-file, else $STARE_DATA_DIR/<name>.jsonl), or None."""
    if data_file:
        return Path(data_file)
    if os.environ.get("STARE_DATA_DIR"):
        return Path(os.environ["STARE_DATA_DIR"]) / f"{name}.jsonl"
    return None


def benchmark_source(name: str, data_file: Optional[str] = None) -> str:
    """Where `load_benchmark` reads `name` from: 'file:<absolute path>', 'hub:<id>:<split>' or 'generated'."""
    spec = check_benchmark(name)
    if spec.generate is not None:
        return "generated"
    path = _local_file(name, data_file)
    return f"file:{path.resolve()}" if path is not None else f"hub:{spec.hub_id}:{spec.split}"


# A problem longer than this is refused by name before anything tokenizes it (issue 47: one 10 MB row grew
# `stare eval` to 23 GB, and 0.1 MB took minutes in the tokenizer, where SIGTERM waits). 32,768 characters
# is about 8,000 tokens of English, over six times the longest problem of the paper's benchmarks.
MAX_PROBLEM_CHARS = 32_768


def load_benchmark(name: str, limit: Optional[int] = None, data_file: Optional[str] = None) -> list[dict]:
    """Rows {'problem', 'answer', 'idx'}: from data_file, $STARE_DATA_DIR/<name>.jsonl, or the hub.

    With STARE_DATA_DIR set, a benchmark missing from it is an error (no silent hub download)."""
    spec = check_benchmark(name)
    if spec.generate is not None:
        if data_file:  # a generated benchmark reads no file: using it silently would mislabel the numbers
            raise StareError(f"--data-file: {name} is generated, not read from a file, so '{data_file}' would be ignored",
                             hint="drop --data-file, or name a file benchmark (e.g. math500) for the file's problems")
        return [{"idx": i, **r} for i, r in enumerate(spec.generate(limit or spec.size))]
    path = Path(data_file) if data_file else None
    if path is None and os.environ.get("STARE_DATA_DIR"):
        path = Path(os.environ["STARE_DATA_DIR"]) / f"{name}.jsonl"
        if not path.exists():
            raise StareError(f"{name}: STARE_DATA_DIR={os.environ['STARE_DATA_DIR']} has no {name}.jsonl",
                             hint=f"add {name}.jsonl (fields problem, answer) there, or unset STARE_DATA_DIR to use the hub")
    if path is not None:
        if not path.exists():
            raise StareError(f"{name}: data file '{path}' not found")
        raw = read_jsonl_rows(path)
        where = lambda i: f"{path}:{i + 1}"  # noqa: E731
    else:
        try:
            import datasets

            raw = list(datasets.load_dataset(spec.hub_id, split=spec.split))
        except Exception as e:
            raise StareError(
                f"{name}: cannot load {spec.hub_id} from the Hugging Face hub ({type(e).__name__})",
                hint=f"pass --data-file FILE.jsonl or set STARE_DATA_DIR to a folder with {name}.jsonl "
                "(fields: problem, answer)",
            ) from None
        where = lambda i: f"{spec.hub_id} row {i}"  # noqa: E731
    rows = [
        {"idx": i, "problem": _pick(r, spec.problem_fields, "problem", where(i)),
         "answer": _pick(r, spec.answer_fields, "answer", where(i))}
        for i, r in enumerate(raw)
    ]
    rows = rows[:limit] if limit else rows
    for r in rows:  # before any tokenizer sees it: a huge row took minutes and gigabytes, deaf to SIGTERM
        if len(str(r["problem"])) > MAX_PROBLEM_CHARS:
            raise StareError(f"{name}: {where(r['idx'])}: the problem is {len(str(r['problem'])):,} characters long, "
                             f"over the {MAX_PROBLEM_CHARS:,} an evaluation accepts",
                             hint="fix or remove that row (the longest problem of the six paper benchmarks is "
                                  "under 5,000 characters)")
    return rows
