"""Errors a user can act on. The CLI prints them as one line on stderr and exits 1."""

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


class NotImplementedYet(StareError):
    """A command or option that is planned but not built; never pretends to work."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""
