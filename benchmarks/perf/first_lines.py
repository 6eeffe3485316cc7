"""How soon a piped `stare train` says what it does (issue 44's target: the first lines within 10 seconds).

The test suite asserts only the order of the lines (tests/test_first_hour.py); their times depend on the
machine and its load, so they are measured here:

    python -m benchmarks.perf.first_lines [--rounds 3]

prints, per round, the seconds from the start of the process to the first line, to the line saying what
loads, to "model loaded" and to the first step's rollout, then the median of each and whether the first
lines came within the target. Run it alone: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 10.0
PHRASES = ("run directory", "loading", "model loaded in", "step 1/1: rollout")


def one_round(model: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "stare_cli", "train", "--recipe", "tiny/arith", "--method", "stare-o1",
                "--out", str(Path(tmp) / "runs"), "-o", f"model.path={model}", "-o", "optim.total_steps=1",
                "-o", "eval.benchmarks=[]"]
        t0 = time.monotonic()
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        seen: dict[str, float] = {}
        assert p.stdout is not None
        for line in p.stdout:
            for ph in PHRASES:
                if ph in line and ph not in seen:
                    seen[ph] = time.monotonic() - t0
            if "first line" not in seen:
                seen["first line"] = time.monotonic() - t0
        p.wait()
        return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from benchmarks.data.toy import ensure_toy_model

    model = str(ensure_toy_model("arith"))
    rounds = [one_round(model) for _ in range(a.rounds)]
    keys = ("first line", *PHRASES)
    print("round | " + " | ".join(keys))
    for i, r in enumerate(rounds, 1):
        print(f"{i} | " + " | ".join(f"{r.get(k, float('nan')):.1f} s" for k in keys))
    med = {k: statistics.median(r.get(k, float("inf")) for r in rounds) for k in keys}
    print("median | " + " | ".join(f"{med[k]:.1f} s" for k in keys))
    first = max(med["first line"], med["loading"])
    print(f"the first lines within {TARGET_S:.0f} s: {'yes' if first <= TARGET_S else 'NO'} ({first:.1f} s)")


if __name__ == "__main__":
    main()
