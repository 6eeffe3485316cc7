"""Recipe files: find, include, override, validate, with errors that name file, line and key.

Resolution order (later wins): included files (depth first) < the recipe file < the method's own
defaults (what makes `grpo` differ from `grpo-ds`) < `-o key.path=value`. A key's origin is
remembered so an error can point at the file and line that set it.

This module knows the schema, not the methods: `compose_recipe` takes the method's defaults through
a callable. `stare_cli.core.resolve.load_recipe` passes the registry's; use that one.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ValidationError

from stare_cli.core.config import Recipe
from stare_kernel.errors import StareError, UsageError, did_you_mean

RECIPE_SUFFIX = ".yaml"


def recipes_root() -> Path:
    """The directory of shipped recipes (works for editable and plain installs)."""
    return Path(str(resources.files("recipes")))


def list_recipes() -> list[str]:
    """Names like 'short-cot/qwen2.5-math-7b' of every shipped recipe, bases (`_*.yaml`) excluded."""
    root = recipes_root()
    out = []
    for p in sorted(root.rglob(f"*{RECIPE_SUFFIX}")):
        rel = p.relative_to(root)
        if any(part.startswith("_") for part in rel.parts):
            continue
        out.append(str(rel.with_suffix("")).replace("\\", "/"))
    return out


def find_recipe(name_or_path: str) -> Path:
    """A recipe name ('tiny/arith') or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    shipped = recipes_root() / f"{name_or_path}{RECIPE_SUFFIX}"
    if shipped.exists():
        return shipped
    names = list_recipes()
    raise StareError(
        f"unknown recipe '{name_or_path}'{did_you_mean(name_or_path, names)}",
        hint="`stare recipes list` shows them; a path to a .yaml file also works",
    )


@dataclass
class Origin:
    """Where a value came from: a file and line, or a command-line override."""

    where: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.where}:{self.line}" if self.line else self.where


@dataclass
class Layered:
    """A merged mapping plus the origin of every key path set along the way."""

    data: dict = field(default_factory=dict)
    origins: dict[tuple, Origin] = field(default_factory=dict)


class RecipeLoader(yaml.SafeLoader):
    """YAML 1.1 safe loading with two fixes for recipes: a repeated key is an error (PyYAML keeps the
    last silently), and exponent floats without a dot (`1e-6`) are floats, as in YAML 1.2."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


MAX_YAML_VALUES = 100_000  # a recipe holds a few hundred; aliases past this are a "billion laughs" file


def _check_alias_expansion(text: str, where: str) -> None:
    """Refuse YAML whose aliases expand past MAX_YAML_VALUES values (8 levels of 8 aliases: 8^9),
    naming the line of the first top-level key that does, before anything expands it."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return  # the loader names the syntax error
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(c) for c in node.value)
        else:
            n = 1
        sizes[id(node)] = n
        return n

    if root is None or size(root) <= MAX_YAML_VALUES:
        return
    line = root.start_mark.line + 1
    if isinstance(root, yaml.MappingNode):
        line = next((k.start_mark.line + 1 for k, v in root.value if size(v) > MAX_YAML_VALUES // 10), line)
    raise StareError(f"{where}:{line}: YAML aliases expand to {size(root):,} values (at most {MAX_YAML_VALUES:,})",
                     hint="write the values out, or nest fewer aliases")


def _compose_lines(text: str) -> dict[tuple, int]:
    """Line (1-based) of every key path in a YAML document."""
    lines: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = (*path, k.value)
                lines[key] = k.start_mark.line + 1
                walk(v, key)

    try:
        walk(yaml.compose(text, Loader=yaml.SafeLoader), ())
    except yaml.YAMLError:
        pass
    return lines


def _merge(dst: Layered, src: dict, origin_of: Any, path: tuple = ()) -> None:
    for k, v in src.items():
        key = (*path, k)
        if isinstance(v, dict) and isinstance(dst_get(dst.data, key), dict):
            _merge(dst, v, origin_of, key)
            dst.origins[key] = origin_of(key)
            continue
        dst_set(dst.data, key, copy.deepcopy(v))
        dst.origins[key] = origin_of(key)
        if isinstance(v, dict):
            for sub in _paths(v, key):
                dst.origins[sub] = origin_of(sub)


def _paths(d: dict, prefix: tuple):
    for k, v in d.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _paths(v, (*prefix, k))


def dst_get(d: dict, key: tuple) -> Any:
    for k in key:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def dst_set(d: dict, key: tuple, value: Any) -> None:
    for k in key[:-1]:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    d[key[-1]] = value


def _load_file(path: Path, layered: Layered, stack: tuple[Path, ...]) -> None:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(p.name for p in (*stack, path))
        raise StareError(f"{_display(path)}: include cycle: {chain}")
    if path.exists() and not path.is_file():  # a folder, a FIFO (reading one blocks for ever), a device
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise StareError(f"{_display(path)}: cannot read recipe: {kind}", hint="name a .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise StareError(f"{_display(path)}: cannot read recipe: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise StareError(f"{_display(path)}:{line}: not UTF-8 text", hint="save the recipe as UTF-8") from None
    try:
        _check_alias_expansion(text, _display(path))
        try:
            data = yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{_display(path)}:{mark.line + 1}" if mark else _display(path)
            raise StareError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise StareError(f"{_display(path)}: a recipe must be a mapping of keys, not {type(data).__name__}")
        lines = _compose_lines(text)
    except RecursionError:  # the YAML reader recurses once per level of nesting
        raise StareError(f"{_display(path)}: nested too deeply to read (hundreds of levels; a recipe has a few)",
                         hint="check the indentation, or remove the generated nesting") from None
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise StareError(f"{_display(path)}:{lines.get(('include',), '?')}: include must be a path or a list of paths")
    for inc in includes:
        inc_path = (path.parent / inc) if not Path(inc).is_absolute() else Path(inc)
        if not inc_path.exists():
            raise StareError(
                f"{_display(path)}:{lines.get(('include',), '?')}: included file '{inc}' not found",
                hint=f"paths are relative to {_display(path.parent)}",
            )
        if not inc_path.is_file():
            raise StareError(f"{_display(path)}:{lines.get(('include',), '?')}: included path '{inc}' is a folder, "
                             "not a recipe file", hint=f"name a .yaml file in it, e.g. {inc.rstrip('/')}/base.yaml")
        _load_file(inc_path, layered, (*stack, path))
    shown = _display(path)
    _merge(layered, data, lambda key: Origin(shown, lines.get(key)))


def _display(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def parse_override(text: str) -> tuple[tuple, Any]:
    """'optim.lr=2e-6' -> (('optim', 'lr'), 2e-06); the value is read as YAML (safe)."""
    if "=" not in text:
        raise UsageError(f"override '{text}' is not key.path=value", hint="e.g. -o optim.lr=2e-6")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UsageError(f"override '{text}' has an empty key", hint="e.g. -o optim.lr=2e-6")
    try:
        _check_alias_expansion(raw, f"override '{key}'")
    except StareError as e:
        raise UsageError(e.args[0].replace(":1:", ":", 1), hint=e.hint) from None
    try:
        value = yaml.load(raw, Loader=RecipeLoader) if raw.strip() else ""  # noqa: S506 - safe subclass
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads '2e-6' as a string; numbers are what users mean there.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return tuple(key.split(".")), value


def _valid_keys(model: type[BaseModel], prefix: tuple = ()) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        key = (*prefix, name)
        out.append(".".join(key))
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_valid_keys(ann, key))
    return out


def _format_error(err: dict, layered: Layered, source: str) -> str:
    loc = tuple(str(p) for p in err["loc"])
    dotted = ".".join(loc)
    origin = None
    for i in range(len(loc), 0, -1):  # the deepest prefix of the key that some file set
        origin = layered.origins.get(tuple(err["loc"][:i]))
        if origin:
            break
    where = str(origin) if origin else source
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key '{dotted}'{did_you_mean(dotted, _valid_keys(Recipe))}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and (not loc or loc[0] in msg):
        # Cross-field errors quote both keys and values; point at the line of the first key named.
        for key in re.findall(r"([a-z_]+(?:\.[a-zA-Z_]+)+) \(", msg):
            o = layered.origins.get(tuple(key.split(".")))
            if o is not None:
                where = str(o)
                break
        return f"{where}: {msg}"
    got = err.get("input")
    got_txt = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{where}: {dotted}: {msg}{got_txt}"


def compose_recipe(
    name_or_path: str | None,
    method: str | None,
    overrides: list[str] | None,
    method_defaults: Callable[[str], dict[str, Any]],
) -> Recipe:
    """Resolve a recipe (name or path), apply `method_defaults(method name)` (dotted keys; raises
    StareError for an unknown method) and `-o` overrides, validate.

    Raises StareError with a one-line located message on any problem.
    """
    layered = Layered()
    source = "<defaults>"
    name = "custom"
    if name_or_path:
        path = find_recipe(name_or_path)
        source = str(path)
        _load_file(path, layered, ())
        try:
            name = str(path.resolve().relative_to(recipes_root().resolve()).with_suffix(""))
        except ValueError:
            name = path.stem
    layered.data.setdefault("name", name)
    if method is not None:
        method_defaults(method)  # an unknown --method fails before anything else
        _merge(layered, {"method": {"name": method}}, lambda key: Origin(f"--method {method}"))
    chosen = (layered.data.get("method") or {}).get("name", Recipe.model_fields["method"].default_factory().name)
    if isinstance(chosen, str):
        try:
            defaults = method_defaults(chosen)
        except StareError as e:
            where = layered.origins.get(("method", "name"), Origin(source))
            raise StareError(f"{where}: method.name: {e}") from None
        _merge(layered, _nest(defaults), lambda key: Origin(f"method '{chosen}' default"))
    for text in overrides or []:
        key, value = parse_override(text)
        _merge(layered, _nest({".".join(key): value}), lambda k, t=text: Origin(f"-o {t}"))
    if name_or_path:  # a recipe names what it trains and on what; no silent toy defaults
        for key, what in ((("model", "path"), "model"), (("data", "train"), "training data")):
            if key not in layered.origins:
                raise StareError(f"{_display(Path(source))}: the recipe names no {what} ({'.'.join(key)})",
                                 hint=f"set {'.'.join(key)} in the recipe or an included base, or -o {'.'.join(key)}=...")
    try:
        return Recipe.model_validate(layered.data)
    except ValidationError as e:
        first = e.errors()[0]
        raise StareError(_format_error(first, layered, source)) from None


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for k, v in flat.items():
        dst_set(out, tuple(k.split(".")), v)
    return out


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (round-trips through load_recipe)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=100)
