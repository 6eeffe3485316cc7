"""Training backends. Each declares what of a recipe it honours, through `refusals(cfg)`: the keys
it cannot honour, with the reason. `check(cfg, backend)` fails validation on the first one, so that
nothing is translated or dropped silently.

- embedded.py: one process (PyTorch + transformers); honours every key but the verl section.
- verl_backend.py: verl 0.9.x; one translation table covers every key (its TABLE).
"""

from __future__ import annotations

from stare_cli.backends.refusal import raise_first
from stare_cli.core.config import Recipe


def refusals(cfg: Recipe, backend: str | None = None) -> list[tuple[str, str]]:
    """(keys, reason) for every recipe value the backend (default: the recipe's) cannot honour."""
    name = backend or cfg.backend.name
    if name == "verl":
        from stare_cli.backends import verl_backend

        return verl_backend.refusals(cfg)
    from stare_cli.backends import embedded

    return embedded.refusals(cfg)


def check(cfg: Recipe, backend: str | None = None) -> None:
    """StareError naming the first key the backend cannot honour."""
    name = backend or cfg.backend.name
    raise_first(name, refusals(cfg, name))
