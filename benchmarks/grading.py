"""Grading: extract a final answer, verify it against the gold with math-verify.

One grader for training rewards and evaluation, so verdicts agree everywhere.

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
from typing import Iterable, Optional

MAX_RESPONSE_CHARS = 20_000  # the fallbacks (no \boxed{}) look only at the end of a response
MAX_ANSWER_CHARS = 1_000


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: Optional[str]
    method: str  # boxed | answer-phrase | last-number | none
    reason: str  # exact | integer | math-verify | mismatch | no-answer | timeout | error: ... | too-long

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


def _grade_task(args: tuple[str, str, int, bool]) -> dict:
    return grade(*args).to_dict()


class Grader:
    """Batch grading with a process pool, a hard per-item time limit and a verdict cache.

    workers=0 grades in this process (no hard limit beyond math-verify's own; for tests and tiny
    batches). The cache is keyed by (extracted answer, gold): many samples share answers.
    """

    def __init__(self, workers: Optional[int] = None, timeout: int = 5, hard_timeout: float = 30.0,
                 boxed_only: bool = False):
        self.workers = (os.cpu_count() or 1) if workers is None else workers
        self.boxed_only = boxed_only
        self.timeout = timeout
        self.hard_timeout = hard_timeout
        self.cache: dict[tuple[str, str], Verdict] = {}
        self._pool = None

    def _get_pool(self):
        if self._pool is None:
            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
            self._pool = ctx.Pool(self.workers, maxtasksperchild=2000)
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

    def grade_many(self, responses: Iterable[str], golds: Iterable[str]) -> list[Verdict]:
        """Verdicts in input order."""
        items = list(zip(responses, golds))
        out: list[Optional[Verdict]] = [None] * len(items)
        todo: dict[tuple[str, str], list[int]] = {}
        for i, (resp, gold) in enumerate(items):
            answer, method = extract_answer(resp, self.boxed_only)
            if answer is None:
                out[i] = Verdict(False, None, method, "no-answer")
                continue
            key = (answer, gold)
            if key in self.cache:
                out[i] = Verdict(self.cache[key].correct, answer, method, self.cache[key].reason)
                continue
            quick = _cheap(answer, gold) if len(answer) <= MAX_ANSWER_CHARS else None
            if quick is not None:
                out[i] = Verdict(quick != "mismatch", answer, method, quick)
                continue
            todo.setdefault(key, []).append(i)
        if todo:
            keys = list(todo)
            firsts = [items[todo[k][0]] for k in keys]
            if self.workers == 0:
                results = [grade(r, g, self.timeout, self.boxed_only) for r, g in firsts]
            else:
                results = self._run_pool(firsts)
            for k, v in zip(keys, results):
                self.cache[k] = v
                for i in todo[k]:
                    m = extract_answer(items[i][0], self.boxed_only)[1]
                    out[i] = Verdict(v.correct, k[0], m, v.reason)
        return [v for v in out if v is not None]

    def _run_pool(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        results: list[Optional[Verdict]] = [None] * len(pairs)
        pending = list(range(len(pairs)))
        while pending:
            pool = self._get_pool()
            asyncs = {i: pool.apply_async(_grade_task, ((pairs[i][0], pairs[i][1], self.timeout, self.boxed_only),)) for i in pending}
            hung = []
            for i, a in asyncs.items():
                try:
                    results[i] = Verdict(**a.get(timeout=self.hard_timeout))
                except mp.TimeoutError:
                    hung.append(i)
                except Exception as e:  # a worker died (e.g. out of memory)
                    results[i] = Verdict(False, extract_answer(pairs[i][0])[0], "boxed", f"error: {type(e).__name__}")
            if not hung:
                break
            # A hung worker holds the GIL inside sympy: only killing the process stops it.
            self.close()
            first = hung[0]
            results[first] = Verdict(False, extract_answer(pairs[first][0])[0], "boxed", "timeout")
            pending = [i for i in hung[1:] if results[i] is None]
        return [r for r in results if r is not None]
