"""Errors a user can act on. The CLI prints them as one line on stderr and exits 1 (2 for UsageError)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class StareError(Exception):
    """A domain error: bad recipe, missing file, unknown method. `hint` says what to do."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} (hint: {self.hint})" if self.hint else msg


class UsageError(StareError):
    """A malformed or conflicting command-line option (`-o` without `=`, `--resume` with `--recipe`):
    the CLI exits 2, as for its parser's own usage errors."""


class Interrupted(Exception):
    """A run stopped by SIGINT or SIGTERM: the message says where and how to resume; the CLI exits
    with `exit_code` (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


# The distribution's name. `stare` on PyPI is another project (a CERN ATLAS client that also installs a
# `stare` command), and this one is not published: extras install from the checkout.
DISTRIBUTION = "stare-rl"


def install_hint(extra: str) -> str:
    """How to install one of our extras, as a working command (not PyPI's unrelated `stare`)."""
    return f"pip install -e '.[{extra}]' in the stare checkout (distribution {DISTRIBUTION}; not on PyPI)"


def table_console():
    """A rich Console for tables: the terminal's width on a terminal; in a pipe or a file, wide enough that
    no benchmark or method name is cut to 'words:add-…' (rich assumes 80 columns there)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=240)
