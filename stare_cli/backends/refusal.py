"""The one error a backend raises for a recipe value it cannot honour. A leaf module: the package's
`check` and each backend's own `check` both use it, and it imports no backend (no import cycle)."""

from __future__ import annotations

from collections.abc import Iterable

from stare_kernel.errors import StareError


def raise_first(name: str, refusals: Iterable[tuple[str, str]]) -> None:
    """StareError naming the first (key, reason) of `refusals` for backend `name`; nothing when empty."""
    for key, reason in refusals:
        raise StareError(f"{key}: the {name} backend cannot honour this recipe: {reason}",
                         hint=f"`stare recipes validate RECIPE --backend {name}` lists every refusal")
