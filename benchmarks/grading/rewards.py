"""Training reward functions by name (`reward.fn`): accuracy from a grader plus the official format check.

- `math-verify`: our grader on the final \\boxed{} only (no fallbacks: a reward must not be earned by
  a stray number); 1/0.
- `math-verify-final`: our grader on the final answer however it is written (the final box, else a
  stated answer, the last inline math or the last number: `stare eval`'s extraction); for small
  models that answer without a box (the SmolLM2 recipe). A stray last number can earn it.
- `stare-official`: the official STARE accuracy as its reward loop ran it (`stare-official` grader).
- `stare-official-3way`: the official accuracy as written (`stare-official-3way` grader).

Every function also reports the official format check and the official `score` field (accuracy if
the format passes, else -1) for every response, so runs under any reward show them side by side.
What the trainer optimises from these (truncation rule, format penalty, overlong shaping) is the
method layer's business (stare_cli/method/layer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from benchmarks.grading.graders import Grader, Verdict
from benchmarks.grading.official import format_ok, shaped_score


@dataclass(frozen=True)
class RewardFnSpec:
    name: str
    grader: str  # a key of benchmarks.grading.graders.GRADERS
    boxed_only: bool
    summary: str


REWARD_FNS: dict[str, RewardFnSpec] = {r.name: r for r in [
    RewardFnSpec("math-verify", "math-verify", True, "our grader on the final \\boxed{} (1/0)"),
    RewardFnSpec("math-verify-final", "math-verify", False,
                 "our grader on the final answer however written: box, stated answer, inline math, last number (1/0)"),
    RewardFnSpec("stare-official", "stare-official", False,
                 "the official STARE accuracy as its reward loop ran it (mathruler on the official extraction)"),
    RewardFnSpec("stare-official-3way", "stare-official-3way", False,
                 "the official STARE accuracy as written (math-verify twice or mathruler)"),
]}


@dataclass
class GradedBatch:
    """Per response: graded accuracy (0/1), the official format check (0/1) and the official
    `score` field (acc if the format passes, else -1), with the verdicts."""

    acc: list[float]
    format: list[float]
    official_score: list[float]
    verdicts: list[Verdict]


class RewardFunction:
    """A named reward function over a process pool of graders (`workers`, 0: this process)."""

    def __init__(self, name: str, timeout: int = 5, workers: int = 0):
        if name not in REWARD_FNS:
            raise ValueError(f"unknown reward function '{name}'; valid: {', '.join(REWARD_FNS)}")
        self.spec = REWARD_FNS[name]
        self.grader = Grader(workers=workers, timeout=timeout, boxed_only=self.spec.boxed_only,
                             name=self.spec.grader)

    def grade(self, texts: Sequence[str], golds: Sequence[str]) -> GradedBatch:
        verdicts = self.grader.grade_many(list(texts), [str(g) for g in golds])
        acc = [float(v.correct) for v in verdicts]
        fmt = [float(format_ok(t)) for t in texts]
        return GradedBatch(acc, fmt, [shaped_score(bool(a), bool(f)) for a, f in zip(acc, fmt)], verdicts)

    def close(self) -> None:
        self.grader.close()
