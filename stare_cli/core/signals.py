"""Stopping a long run cleanly on SIGINT / SIGTERM.

The first signal asks the training loop to stop at the next step boundary: it finishes the step,
writes a checkpoint and raises `Interrupted` ("interrupted at step N; resume with: ..."), which the
CLI turns into exit 130 (SIGINT) or 143 (SIGTERM). During the step-0 evaluation the boundary is the
evaluation's end: nothing has been trained and no checkpoint is written (the run starts again with
`--resume --restart`). A second signal stops at once, without a checkpoint (the run resumes from the
previous one).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Optional

from stare_kernel.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class StopAtStepBoundary:
    """Within this context the first SIGINT/SIGTERM sets `signum` (checked by the loop through
    `check`); the second raises Interrupted immediately. Handlers are restored on exit. Outside the
    main thread (where Python cannot install handlers) this does nothing."""

    def __init__(self, describe_now: Callable[[], str],
                 leaves: Callable[[], str] = lambda: "a checkpoint is written"):
        self.describe_now = describe_now  # e.g. "step 12 of 200": where the loop is, for the message
        self.leaves = leaves  # what stopping at the coming boundary leaves behind, for the message
        self.signum: Optional[int] = None
        self._old: dict[int, object] = {}

    def install(self) -> "StopAtStepBoundary":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def __enter__(self) -> "StopAtStepBoundary":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            raise Interrupted(f"{name} again during {self.describe_now()}: stopped without a checkpoint",
                              exit_code(signum))
        self.signum = signum
        print(f"{name}: stopping after {self.describe_now()} ({self.leaves()}); "
              f"send it again to stop at once", file=sys.stderr, flush=True)

    def check(self, message: Callable[[], str]) -> None:
        """Raise Interrupted(message()) when a signal arrived; call after the step's checkpoint."""
        if self.signum is not None:
            raise Interrupted(message(), exit_code(self.signum))


def terminate_as_interrupt(signum: int, frame) -> None:
    """A SIGTERM handler for the CLI outside training loops: unwind (finally blocks run, worker pools
    close) and exit 143, as SIGINT unwinds through KeyboardInterrupt."""
    raise Interrupted("terminated", exit_code(signum))
