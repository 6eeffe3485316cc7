"""The official STARE code's accuracy and format checks, reimplemented (hp-luo/STARE,
`verl/utils/reward_score/math_stare.py`, read to verify; no code copied).

What the official scorer computes for a response and its gold answer:
- `answer_text`: the text the answer is read from: inside `<answer>...</answer>` if present, else after
  the last `</thinking>` or `</think>`; then, if one of the markers "Final Answer" / "**Answer**" /
  "Answer:" / "Conclusion" (and Chinese equivalents, in that priority) occurs, the text after its last
  occurrence with ":" (or "：") and "**" removed everywhere in it; otherwise the last 10 paragraphs,
  cut to the last 300 characters.
- `boxed_content`: the content of the last literal "\\boxed{" of that text with balanced braces, or
  the string "None" when there is none (mathruler's extract_boxed_content).
- acc = any of three checks:
  1. math-verify on the answer text (the part after its first `</think>` if any): parse with its
     default extractors; correct if the parsed string equals the gold, or verify(parse("\\boxed{gold}"),
     parsed) holds; any exception counts as wrong;
  2. the same on the boxed content;
  3. `mathruler.grader.grade_answer(boxed_content, gold)`.
- format: a response holding both `<think>` and `<answer>` passes only with a
  `<think>...</think>\\n<answer>...</answer>` block; any other passes if it contains `</think>` or the
  word "boxed".
- score (the "shaped" value the official code also returns): acc if the format passes, else -1.

Two facts about how the official runs used these values, read from the official reward managers
(`verl/workers/reward_manager/stare.py` and `verl/experimental/reward_loop/reward_manager/stare.py`):
- the training reward is `acc`, not `score` (both managers take `result["acc"]`); `score` and
  `format` are only recorded beside it;
- the reward-loop manager (the official runs' composed configuration has `reward_model.use_reward_loop: true`,
  verl's default there) calls the
  scorer through `run_in_executor`, i.e. in a worker thread, where math-verify's signal-based
  timeouts cannot run: `parse(..., parsing_timeout=5)` and `verify(..., timeout_seconds=5)` raise
  ValueError there (math-verify 0.9.0: "doesn't support threaded environment"), the official code
  catches it and scores the check 0. In those runs acc therefore came from check 3 alone.
`official_acc(..., as_run=True)` reproduces that; `as_run=False` runs all three checks as written
(in a process's main thread, where the timeouts work). tests/test_official_grader.py shows the thread
fact with the installed math-verify; tests/test_method_layer.py the reward.

mathruler's grade_answer has no time limit of its own (sympy can hang on hostile input): run these
functions through `benchmarks.grading.graders.Grader`, whose worker processes have hard limits.
"""

from __future__ import annotations

import re
from typing import Optional

# Markers after which the official extraction reads the answer, in its order of priority, with the
# colon it strips ("：" full-width for the Chinese ones).
_MARKERS = (("最终答案", "："), ("**答案**", "："), ("Final Answer", ":"), ("答案：", "："),
            ("**Answer**", ":"), ("Answer:", ":"), ("总结", "："), ("Conclusion", ":"))
_SPECIAL = ("<|end_of_solution|>", "<|begin_of_solution|>", "<|end_of_thought|>", "<|begin_of_thought|>")
_THINK_ANSWER = re.compile(r"<think>(.*?)</think>\n<answer>(.*?)</answer>", re.DOTALL)


def answer_text(response: str) -> str:
    """The part of a response the official scorer reads the answer from (see the module docstring)."""
    if "<answer>" in response:
        ans = response.split("<answer>")[-1].split("</answer>")[0]
    elif "</thinking>" in response:
        ans = response.split("</thinking>")[-1]
    elif "</think>" in response:
        ans = response.split("</think>")[-1]
    else:
        ans = response
    if "<!-- Final Answer -->" in ans:
        ans = ans.split("<!-- Final Answer -->")[1].strip().split("<!-- Finish Answer -->")[0].strip()
    elif "<!-- Summarize Answer -->" in ans:
        ans = ans.split("<!-- Summarize Answer -->")[-1].strip().split("<!-- Finish Response -->")[0].strip()
    else:
        for marker, colon in _MARKERS:
            if marker in ans:
                ans = ans.split(marker)[-1].replace(colon, "").replace("**", "").strip()
                break
        else:
            ans = "\n\n".join(ans.split("\n\n")[-10:])[-300:].strip()
    for s in _SPECIAL:
        ans = ans.replace(s, "")
    return ans


def boxed_content(text: str) -> str:
    """Content of the last literal "\\boxed{" with balanced braces; "None" when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    body = text[start + len("\\boxed{"):]
    depth = 0
    for i, c in enumerate(body):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                return body[:i].strip()
    return "None"


def format_ok(response: str) -> bool:
    """The official format check (see the module docstring)."""
    if "<think>" in response and "<answer>" in response:
        return _THINK_ANSWER.search(response) is not None
    # The official check also accepts a strict `<think>..</think>rest` layout, which contains "</think>".
    return "</think>" in response or "boxed" in response


def _math_verify_check(text: str, gold: str, timeout: Optional[int]) -> bool:
    """Checks 1 and 2: math-verify on `text` (after its first `</think>`), any exception = wrong."""
    from math_verify import parse, verify

    if "</think>" in text:
        text = text.split("</think>")[1]
    try:
        parsed = parse(text, parsing_timeout=timeout)
    except Exception:
        return False
    if len(parsed) < 2:
        return False
    if parsed[1] == gold:  # the official quick string match
        return True
    try:
        return bool(verify(parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout), parsed, timeout_seconds=timeout))
    except Exception:
        return False


def _mathruler_check(answer: str, gold: str) -> bool:
    from mathruler.grader import grade_answer

    try:
        return bool(grade_answer(answer, gold))
    except Exception:  # the official code would propagate this; we score it wrong (stated in docs/guide/fidelity.md)
        return False


def official_acc(response: str, gold: str, *, as_run: bool = True, timeout: int = 5) -> tuple[bool, str, str]:
    """(acc, answer text, boxed content) as the official scorer computes them.

    as_run: True reproduces the official reward loop, where the math-verify checks fail in a worker
    thread (module docstring) and only mathruler decides; False runs all three checks as written.
    """
    text = answer_text(response)
    boxed = boxed_content(text)
    if _mathruler_check(boxed, gold):
        return True, text, boxed
    if as_run:
        return False, text, boxed
    return (_math_verify_check(text, gold, timeout) or _math_verify_check(boxed, gold, timeout)), text, boxed


def shaped_score(acc: bool, fmt: bool) -> float:
    """The official `score` field: acc (1/0) when the format passes, else -1."""
    return float(acc) if fmt else -1.0
