"""A recipe resolved with its method: the recipe schema (config.py, recipes.py) joined to the method
registry (baselines/registry.py), which defines each method by the recipe keys it sets.

`load_recipe` is what every command and backend calls; `compose_recipe` (recipes.py) stays ignorant
of methods and takes their defaults through a callable.
"""

from __future__ import annotations

from typing import Any, Optional

from baselines.registry import MethodSpec, UnknownMethodError, lookup_method
from stare_cli.core.config import Recipe
from stare_cli.core.errors import StareError
from stare_cli.core.recipes import compose_recipe


def check_method(name: str) -> MethodSpec:
    """The registered method `name` (any case), or a StareError with a 'did you mean'."""
    try:
        return lookup_method(name)
    except UnknownMethodError as e:
        raise StareError(str(e), hint="`stare methods` lists them") from None


def method_defaults(name: str) -> dict[str, Any]:
    """The recipe keys (dotted) that define method `name`, its canonical name included."""
    spec = check_method(name)
    return {"method.name": spec.name, **spec.defaults}


def load_recipe(name_or_path: Optional[str] = None, method: Optional[str] = None,
                overrides: Optional[list[str]] = None, resolved: bool = False) -> Recipe:
    """Resolve a recipe: files < the method's defining keys < `-o` overrides; validated. A `resolved`
    recipe (a run's config.yaml) already holds its method's keys and the overrides it ran with: it is
    read as it is, plus `overrides` (applying the method's defaults again would undo earlier -o's)."""
    defaults = (lambda name: {"method.name": check_method(name).name}) if resolved else method_defaults
    return compose_recipe(name_or_path, method, overrides, defaults)
