"""Grading: extract a final answer, verify it against the gold; several graders by name.

`GRADERS` maps a name to a grader (every verdict records `name@version`):
- `math-verify` (ours, the default for evaluation and the `math-verify` training reward): the
  extraction and normalisation below, then math-verify;
- `math-verify-plain`: math-verify's own defaults on the whole response (parse + verify);
- `stare-official`: the official STARE scorer's accuracy as its reward loop ran it (mathruler on the
  official answer extraction; see benchmarks/official_grader.py for why the math-verify checks never
  count there);
- `stare-official-3way`: the official scorer's three checks as written (math-verify twice, mathruler);
- `mathruler`: mathruler's grade_answer on the last \\boxed{} content.

Our grader (`math-verify`):

- Extraction: the last \\boxed{...} (or \\fbox{...}) with balanced braces; else "Answer: X" /
  "the answer is X"; else the last number. Each verdict records how the answer was found.
- Verification: exact string or integer equality first (no sympy needed), then math-verify on
  `\\boxed{answer}` vs `\\boxed{gold}`. Scientific notation `4.5e33` is rewritten to
  `4.5\\times10^{33}` on both sides (math-verify reads `e` as Euler's number).
- Time limits: math-verify's own timeouts use signal.alarm and only work on a process's main
  thread; `Grader` runs grading in worker processes (whose main thread does the work) and also
  enforces a hard wall-clock limit per batch item from the parent, killing a hung worker. A
  pathological answer grades as wrong with a reason; it never hangs or crashes a run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

MAX_RESPONSE_CHARS = 20_000  # the fallbacks (no \boxed{}) look only at the end of a response
MAX_ANSWER_CHARS = 1_000


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: Optional[str]
    method: str  # boxed | answer-phrase | last-number | none | official | whole-response
    reason: str  # exact | integer | math-verify | mathruler | mismatch | no-answer | timeout | error: ... | too-long
    grader: str = ""  # name@version of the grader that decided (GRADERS)

    def to_dict(self) -> dict:
        return asdict(self)


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*\$?([^\n$]+?)\$?\s*(?:\.|$)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_INT = re.compile(r"^[-+]?\d+$")
_SCI = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} with balanced braces (None if none closes)."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts[-50:]):  # bounded work on adversarial text
        depth, i = 1, start
        while i < len(text):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
            i += 1
    return None


def extract_answer(response: str, boxed_only: bool = False) -> tuple[Optional[str], str]:
    """(answer, method): the last boxed answer, else an answer phrase, else the last number.

    boxed_only: no fallbacks (training rewards grade the final \\boxed{} only).
    """
    boxed = last_boxed(response)
    text = response[-MAX_RESPONSE_CHARS:]  # fallbacks look at the end only
    if boxed is not None:
        return boxed, "boxed"
    if boxed_only:
        return None, "none"
    phrases = _ANSWER_PHRASE.findall(text)
    if phrases:
        return phrases[-1].strip(), "answer-phrase"
    nums = _NUMBER.findall(text)
    if nums:
        return nums[-1].replace(",", ""), "last-number"
    return None, "none"


def _normalise(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    # A trailing percent sign is dropped on both sides, as in the Qwen2.5-Math evaluation: "50\%" == "50".
    s = re.sub(r"\\?%\s*$", "", s).strip()
    return _SCI.sub(lambda m: f"{m.group(1)}\\times10^{{{m.group(2)}}}", s)


def _cheap(answer: str, gold: str) -> Optional[str]:
    """'exact' / 'integer' when equal without sympy; None when sympy must decide."""
    a, g = _normalise(answer), _normalise(gold)
    if a == g:
        return "exact"
    a2, g2 = a.replace(",", "").replace(" ", ""), g.replace(",", "").replace(" ", "")
    if _INT.match(a2) and _INT.match(g2):
        return "integer" if int(a2) == int(g2) else "mismatch"
    return None


def grade(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
    """Grade one response in this process (math-verify timeouts need the main thread)."""
    answer, method = extract_answer(response, boxed_only)
    if answer is None:
        return Verdict(False, None, method, "no-answer")
    if len(answer) > MAX_ANSWER_CHARS:
        return Verdict(False, answer[:100], method, "too-long")
    quick = _cheap(answer, gold)
    if quick is not None:
        return Verdict(quick != "mismatch", answer, method, quick)
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
        g = parse(f"\\boxed{{{_normalise(gold)}}}", extraction_config=cfg, parsing_timeout=timeout)
        p = parse(f"\\boxed{{{_normalise(answer)}}}", extraction_config=cfg, parsing_timeout=timeout)
        if not g:  # a gold that only parses as a string: only an identical string matches
            return Verdict(False, answer, method, "mismatch")
        ok = bool(verify(g, p, timeout_seconds=timeout))
        return Verdict(ok, answer, method, "math-verify" if ok else "mismatch")
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        kind = "timeout" if "Timeout" in type(e).__name__ else f"error: {type(e).__name__}"
        return Verdict(False, answer, method, kind)


def _plain_math_verify(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
    """math-verify's own defaults: parse the whole response and the gold (in `$...$` unless it is
    already delimited), then verify."""
    try:
        from math_verify import parse, verify

        # A bare gold ("\\frac12") is not LaTeX math to math-verify until delimited.
        g = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=timeout)
        p = parse(response[-MAX_RESPONSE_CHARS:], parsing_timeout=timeout)
        ok = bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=timeout))
        return Verdict(ok, str(p[1]) if len(p) > 1 else None, "whole-response", "math-verify" if ok else "mismatch")
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        kind = "timeout" if "Timeout" in type(e).__name__ else f"error: {type(e).__name__}"
        return Verdict(False, None, "whole-response", kind)


def _official(as_run: bool):
    def judge(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
        from benchmarks.official_grader import official_acc

        ok, _, boxed = official_acc(response, gold, as_run=as_run, timeout=timeout)
        return Verdict(ok, boxed, "official", "mathruler" if ok and as_run else ("official" if ok else "mismatch"))

    return judge


def _mathruler(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
    from benchmarks.official_grader import _mathruler_check, boxed_content

    boxed = boxed_content(response)
    if boxed == "None":
        return Verdict(False, None, "none", "no-answer")
    ok = _mathruler_check(boxed, gold)
    return Verdict(ok, boxed, "boxed", "mathruler" if ok else "mismatch")


def _official_key(response: str, boxed_only: bool) -> tuple[Optional[str], str]:
    from benchmarks.official_grader import answer_text

    return answer_text(response), "official"


def _boxed_key(response: str, boxed_only: bool) -> tuple[Optional[str], str]:
    from benchmarks.official_grader import boxed_content

    b = boxed_content(response)
    return (None, "none") if b == "None" else (b, "boxed")


@dataclass(frozen=True)
class GraderSpec:
    """A grader: `key` (in the calling process, cheap) gives what the verdict depends on besides
    the gold (None: no answer, graded wrong at once), used to deduplicate and cache; `judge` (in a
    worker process) decides. `version` changes whenever a verdict may change."""

    name: str
    version: int
    summary: str
    key: Callable[[str, bool], tuple[Optional[str], str]]
    judge: Callable[..., Verdict]
    quick: Optional[Callable[[str, str], Optional[str]]] = None  # a verdict without a worker (ours)

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"


GRADERS: dict[str, GraderSpec] = {g.name: g for g in [
    GraderSpec("math-verify", 2, "ours: last box / answer phrase / last number, normalised, then math-verify",
               key=extract_answer, judge=grade, quick=_cheap),
    GraderSpec("math-verify-plain", 1, "math-verify's defaults on the whole response",
               key=lambda r, b: (r[-MAX_RESPONSE_CHARS:], "whole-response"), judge=_plain_math_verify),
    GraderSpec("stare-official", 1, "the official STARE accuracy as its reward loop ran it (mathruler decides)",
               key=_official_key, judge=_official(as_run=True)),
    GraderSpec("stare-official-3way", 1, "the official STARE accuracy as written (math-verify x2 or mathruler)",
               key=_official_key, judge=_official(as_run=False)),
    GraderSpec("mathruler", 1, "mathruler's grade_answer on the last \\boxed{}", key=_boxed_key, judge=_mathruler),
]}


def check_grader(name: str) -> GraderSpec:
    """The grader called `name`, or a StareError listing the valid names."""
    if name not in GRADERS:
        from stare_cli.errors import StareError, did_you_mean

        raise StareError(f"unknown grader '{name}'{did_you_mean(name, GRADERS)}; valid: {', '.join(GRADERS)}")
    return GRADERS[name]


def _grade_task(args: tuple[str, str, str, int, bool]) -> dict:
    name, response, gold, timeout, boxed_only = args
    return GRADERS[name].judge(response, gold, timeout, boxed_only).to_dict()


class Grader:
    """Batch grading with a process pool, a hard per-item time limit and a verdict cache.

    name: a key of GRADERS. workers=0 grades in this process (no hard limit beyond math-verify's
    own, which needs the main thread; for tests and tiny batches). The cache is keyed by what the
    grader's verdict depends on (for ours: the extracted answer) and the gold. `start_method`: the
    pool's (default fork where available; "forkserver" from threaded hosts such as Ray actors).
    """

    def __init__(self, workers: Optional[int] = None, timeout: int = 5, hard_timeout: float = 30.0,
                 boxed_only: bool = False, name: str = "math-verify", start_method: Optional[str] = None):
        self.spec = check_grader(name)
        self.workers = (os.cpu_count() or 1) if workers is None else workers
        self.boxed_only = boxed_only
        self.timeout = timeout
        self.hard_timeout = hard_timeout
        self.start_method = start_method
        self.cache: dict[tuple[str, str], Verdict] = {}
        self._pool = None

    @property
    def tag(self) -> str:
        """name@version of this grader, recorded with every verdict."""
        return self.spec.tag

    def _get_pool(self):
        if self._pool is None:
            method = self.start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            self._pool = mp.get_context(method).Pool(self.workers, maxtasksperchild=2000)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _verdict(self, v: Verdict, extracted: Optional[str], method: str) -> Verdict:
        return Verdict(v.correct, extracted, method, v.reason, self.tag)

    def grade_many(self, responses: Iterable[str], golds: Iterable[str]) -> list[Verdict]:
        """Verdicts in input order."""
        items = list(zip(responses, golds))
        out: list[Optional[Verdict]] = [None] * len(items)
        todo: dict[tuple[str, str], list[int]] = {}
        methods: list[str] = [""] * len(items)
        for i, (resp, gold) in enumerate(items):
            key, method = self.spec.key(resp, self.boxed_only)
            methods[i] = method
            if key is None:
                out[i] = Verdict(False, None, method, "no-answer", self.tag)
                continue
            shown = key if self.spec.quick is not None else None
            if (key, gold) in self.cache:
                out[i] = self._verdict(self.cache[(key, gold)], shown or self.cache[(key, gold)].extracted, method)
                continue
            quick = self.spec.quick(key, gold) if self.spec.quick is not None and len(key) <= MAX_ANSWER_CHARS else None
            if quick is not None:
                out[i] = Verdict(quick != "mismatch", key, method, quick, self.tag)
                continue
            todo.setdefault((key, gold), []).append(i)
        if todo:
            keys = list(todo)
            firsts = [items[todo[k][0]] for k in keys]
            if self.workers == 0:
                results = [self.spec.judge(r, g, self.timeout, self.boxed_only) for r, g in firsts]
            else:
                results = self._run_pool(firsts)
            for k, v in zip(keys, results):
                self.cache[k] = v
                for i in todo[k]:
                    shown = k[0] if self.spec.quick is not None else v.extracted
                    out[i] = self._verdict(v, shown, methods[i] if self.spec.quick is not None else v.method)
        return [v for v in out if v is not None]

    def _run_pool(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        results: list[Optional[Verdict]] = [None] * len(pairs)
        pending = list(range(len(pairs)))
        name = self.spec.name
        while pending:
            pool = self._get_pool()
            asyncs = {i: pool.apply_async(_grade_task, ((name, pairs[i][0], pairs[i][1], self.timeout, self.boxed_only),))
                      for i in pending}
            hung = []
            for i, a in asyncs.items():
                try:
                    results[i] = Verdict(**a.get(timeout=self.hard_timeout))
                except mp.TimeoutError:
                    hung.append(i)
                except Exception as e:  # a worker died (e.g. out of memory)
                    results[i] = Verdict(False, self.spec.key(pairs[i][0], self.boxed_only)[0], "error", f"error: {type(e).__name__}")
            if not hung:
                break
            # A hung worker holds the GIL inside sympy: only killing the process stops it.
            self.close()
            first = hung[0]
            results[first] = Verdict(False, self.spec.key(pairs[first][0], self.boxed_only)[0], "timeout", "timeout")
            pending = [i for i in hung[1:] if results[i] is None]
        return [r for r in results if r is not None]
