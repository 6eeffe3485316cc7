"""Where a training step's peak lies: the embedded trainer's peak resident set in each phase of each step
(rollout, old pass, each loss call's forward and backward, optimizer step, the rest), for one recipe and its
overrides, in this process.

At every phase boundary it reads the kernel's peak resident set since the last boundary (`VmHWM` in
/proc/self/status) and resets it (writing 5 to /proc/self/clear_refs, Linux 4.0 on), so each phase's peak is
its own, exactly, with no sampling. The boundaries are the trainer's own functions (`collect_rollouts`,
`old_pass`, `loss_calls`, the forward `token_logprobs_entropy`, `Tensor.backward`, the optimizer's step
through torch's global step hooks, `save_checkpoint`), wrapped for this process only; nothing computed
changes. Printed per phase: its peak, its peak above the step's base (the resident set when the step's
training starts: runtime, weights, AdamW's moments), and the resident set at its end. docs/guide/memory.md
reads these tables for the real-model recipe (which part of a step the memory plan misses, and what glibc's
heap keeps).

    python benchmarks/perf/memory_phases.py [--recipe small/smollm2-135m-words] [--steps 2] [-o KEY=VALUE ...]

One torch thread (set OMP_NUM_THREADS=1 before starting it, as benchmarks/perf/memory.py's children do).
The real-model recipe needs `stare model get smollm2-135m`; about 4 minutes for 2 steps on one core.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

GiB_KB = 2**20  # /proc reports kB


@dataclass
class PhasePeak:
    """One phase of one step: its peak resident set and the resident set at its end (GiB)."""

    step: int
    phase: str
    peak: float
    end: float


class PhaseClock:
    """The current phase and step; `enter(name)` closes the current phase (its VmHWM, then a reset)."""

    def __init__(self) -> None:
        self.phase, self.step = "set-up", 0
        self.rows: list[PhasePeak] = []
        self.base: dict[int, float] = {}  # step -> resident set when its training started
        _reset_peak()

    def enter(self, name: str) -> None:
        peak, rss = _status("VmHWM"), _status("VmRSS")
        self.rows.append(PhasePeak(self.step, self.phase, peak, rss))
        _reset_peak()
        self.phase = name


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / GiB_KB
    raise SystemExit(f"/proc/self/status has no {key}: Linux only")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise SystemExit(f"cannot reset the peak resident set (/proc/self/clear_refs): {e}") from e


def instrument(clock: PhaseClock) -> None:
    """Wrap the trainer's phase functions so that each one opens a phase and closes it on return."""
    import torch
    from torch.optim import optimizer

    import stare_cli.backends.embedded as emb

    def around(owner, name: str, label: str, on_enter=None):
        inner = getattr(owner, name)

        def wrapped(*a, **k):
            clock.enter(label)  # closes the phase before, in its own step
            if on_enter is not None:
                on_enter()
            try:
                return inner(*a, **k)
            finally:
                clock.enter(f"after {label}")

        setattr(owner, name, wrapped)

    def next_step():
        clock.step += 1

    def training_starts():
        clock.base.setdefault(clock.step, _status("VmRSS"))

    around(emb, "collect_rollouts", "rollout", on_enter=next_step)
    around(emb, "old_pass", "old pass (separate or deferred)", on_enter=training_starts)
    around(emb, "loss_calls", "loss calls")
    around(emb, "token_logprobs_entropy", "forward")
    around(torch.Tensor, "backward", "backward")
    around(emb, "save_checkpoint", "checkpoint")

    optimizer.register_optimizer_step_pre_hook(lambda *_: clock.enter("optimizer step"))
    optimizer.register_optimizer_step_post_hook(lambda *_: clock.enter("after optimizer step"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="small/smollm2-135m-words")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("-o", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    from stare_cli.backends.embedded import train
    from stare_cli.core.resolve import load_recipe

    cfg = load_recipe(args.recipe, None, [f"optim.total_steps={args.steps}", "eval.benchmarks=[]", *args.overrides])
    clock = PhaseClock()
    instrument(clock)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp))
    clock.enter("end")
    print(f"\n{args.recipe} {' '.join(args.overrides)}: peak resident set per phase (GiB; 'above' is above the "
          "resident set when the step's training started)")
    print(f"{'step':>4s}  {'phase':34s} {'peak':>6s} {'above':>6s} {'end':>6s}")
    for r in clock.rows:
        if r.phase.startswith("after ") and r.peak <= r.end + 1e-3:
            continue  # nothing happened between two wrapped calls
        base = clock.base.get(r.step)
        above = f"{r.peak - base:+6.2f}" if base is not None and r.step else "      "
        print(f"{r.step:4d}  {r.phase:34s} {r.peak:6.2f} {above} {r.end:6.2f}")
    top = max(clock.rows, key=lambda r: r.peak)
    print(f"largest: {top.peak:.2f} GiB in step {top.step}, {top.phase}")


if __name__ == "__main__":
    main()
