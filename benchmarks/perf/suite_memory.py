"""The peak resident memory of every test process (issue 68: none above 6 GB), measured on the suite itself.

    python -m benchmarks.perf.suite_memory [PYTEST ARGS...]      # default: the whole suite, as `make test` runs it

runs pytest with STARE_TEST_PEAKS set (tests/conftest.py records, after each test, its process's peak
resident set so far and the largest peak of the subprocesses it waited for), then prints the tests at
which a process's peak rose (the test that raised it), the largest peak of each process, and whether every
one stayed under the limit. Ray's actors and vLLM's engine core, when out of process, are not counted here
(they are not waited for); they run inside the test process in `make test-vllm` (colocated engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LIMIT_GIB = 6.0


def main() -> int:
    args = sys.argv[1:] or ["-q", "-n", "2", "--dist", "loadgroup"]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "STARE_TEST_PEAKS": tmp, "OMP_NUM_THREADS": "1"}
        rc = subprocess.run([sys.executable, "-m", "pytest", *args], env=env).returncode
        rows = [json.loads(line) for f in sorted(Path(tmp).glob("*.jsonl")) for line in f.read_text().splitlines()]
    if not rows:
        print("no test ran")
        return rc or 1
    print("\nthe tests at which a process's peak resident set rose (GiB; the process's own, its waited-for children's)")
    last: dict[int, float] = {}
    for r in rows:
        if r["self_peak_gib"] > last.get(r["pid"], 0.0) + 0.05:
            print(f"  {r['self_peak_gib']:6.2f}  {r['children_peak_gib']:6.2f}  {r['test']}")
        last[r["pid"]] = max(last.get(r["pid"], 0.0), r["self_peak_gib"])
    worst_self = max(rows, key=lambda r: r["self_peak_gib"])
    worst_child = max(rows, key=lambda r: r["children_peak_gib"])
    print(f"\nlargest test process: {worst_self['self_peak_gib']:.2f} GiB (reached by {worst_self['test']})")
    print(f"largest subprocess:   {worst_child['children_peak_gib']:.2f} GiB (by {worst_child['test']})")
    ok = max(worst_self["self_peak_gib"], worst_child["children_peak_gib"]) <= LIMIT_GIB
    print(f"every test process under {LIMIT_GIB:.0f} GiB: {'yes' if ok else 'NO'}")
    return rc or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
