"""A recipe resolved with its method: the recipe schema (config.py, recipes.py) joined to the method
registry (baselines/registry.py), which defines each method by the recipe keys it sets.

`load_recipe` is what every command and backend calls; `compose_recipe` (recipes.py) stays ignorant
of methods and takes their defaults through a callable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from baselines.registry import MethodSpec, UnknownMethodError, lookup_method
from stare_cli.core.config import Recipe
from stare_kernel.errors import StareError
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


def run_recipe(name_or_path: Optional[str]) -> Optional[Path]:
    """The file when `name_or_path` is a run's resolved recipe (a config.yaml beside its run's meta.json)."""
    if not name_or_path:
        return None
    p = Path(name_or_path)
    return p if p.name == "config.yaml" and p.is_file() and (p.parent / "meta.json").is_file() else None


def load_recipe(name_or_path: Optional[str] = None, method: Optional[str] = None,
                overrides: Optional[list[str]] = None, resolved: Optional[bool] = None) -> Recipe:
    """Resolve a recipe: files < the method's defining keys < `-o` overrides; validated. A `resolved`
    recipe (a run's config.yaml; by default, any file `run_recipe` finds) already holds its method's keys
    and the overrides it ran with: it is read as it is, plus `overrides` (applying the method's defaults
    again would undo earlier -o's, e.g. `method.dynamic_sampling=false`), and `method` must be its own."""
    if resolved is None:
        resolved = run_recipe(name_or_path) is not None
    if resolved and method is not None and name_or_path:
        import yaml

        try:
            own = ((yaml.safe_load(Path(name_or_path).read_text()) or {}).get("method") or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):
            own = None  # compose_recipe reports an unreadable file with its line
        if own is not None and check_method(method).name != own:
            raise StareError(f"{name_or_path}: a run's resolved recipe holds method '{own}' with its keys; "
                             f"--method {method} would train a mix of the two",
                             hint=f"drop --method, or train {method} from the recipe by name (its `name:` key)")
    defaults = (lambda name: {"method.name": check_method(name).name}) if resolved else method_defaults
    return compose_recipe(name_or_path, method, overrides, defaults)
