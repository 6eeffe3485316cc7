"""The fact behind `reward.fn: stare-official` (issue 29, item 5): in the official reward loop the
scorer runs in a worker thread (`run_in_executor`), where math-verify's signal-based time limits
raise, so of the official three-way accuracy only mathruler decides. Shown here with the installed
math-verify, in a thread as the reward loop runs it and in the main thread."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from benchmarks.grading.official import official_acc

# No \boxed{}: mathruler reads "None" and says wrong; math-verify parses 1/2 from the text and
# verifies it against the gold 0.5, so the three-way accuracy as written says right.
RESPONSE, GOLD = "So x equals $\\frac{1}{2}$.", "0.5"


def test_math_verify_raises_in_a_worker_thread():
    import math_verify

    with cf.ThreadPoolExecutor(1) as pool:  # what asyncio's run_in_executor uses
        with pytest.raises(ValueError, match="threaded environment"):
            pool.submit(math_verify.parse, "$\\frac{1}{2}$", parsing_timeout=5).result()
    assert math_verify.parse("$\\frac{1}{2}$", parsing_timeout=5)  # the main thread: it parses


def test_in_a_worker_thread_the_official_accuracy_is_mathrulers_alone():
    as_written_main = official_acc(RESPONSE, GOLD, as_run=False)[0]
    with cf.ThreadPoolExecutor(1) as pool:
        as_written_thread = pool.submit(official_acc, RESPONSE, GOLD, as_run=False).result()[0]
    as_run = official_acc(RESPONSE, GOLD, as_run=True)[0]
    assert as_written_main is True  # math-verify's checks decide in the main thread
    assert as_written_thread is False  # in the reward loop's thread they raise, are caught, score 0
    assert as_run is as_written_thread  # which is what stare-official (as_run=True) computes
