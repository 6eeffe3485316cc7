"""verl reward function using our grader, so verl verdicts equal `stare eval`'s and the embedded
trainer's. verl's default scorer routes aime*/math* data to a string matcher (`\\dfrac12` vs
`\\frac{1}{2}` scores wrong); recipes point `reward.custom_reward_function` here instead.

Returns {"score", "acc"}: `acc` is what `algorithm.filter_groups.metric=acc` filters on.
"""

from __future__ import annotations

from benchmarks.grading import grade


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    v = grade(solution_str, str(ground_truth), timeout=5, boxed_only=True)
    return {"score": 1.0 if v.correct else 0.0, "acc": bool(v.correct)}
