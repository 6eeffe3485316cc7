"""`stare train --resume RUN [--restart] [-o key=value ...]`: what a resumed run continues with.

Overrides on resume are applied and recorded (config.yaml holds the recipe in effect,
config-history.jsonl each resume with the keys it changed), or refused by name, never ignored.
Refused on every backend: the keys that make the run what it is (its model, data, method, seed,
backend); the run's name and its data order depend on them. The verl backend also refuses `optim.*`
except `optim.total_steps`: verl restores the optimizer's and scheduler's state (lr included) from
its checkpoint, so a new lr would not take effect.

A run directory without a usable checkpoint is refused (exit 1) unless `--restart` is given: then its
earlier outputs are moved to `restarts/<time>/` and the run starts again from step 1.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stare_cli.core.config import Recipe
from stare_kernel.ledger import dotted_items
from stare_kernel.errors import StareError
from stare_cli.core.runs import make_unique_dir

FIXED_ON_RESUME = ("name", "model.", "data.", "method.name", "optim.seed", "backend.name")
VERL_FIXED_ON_RESUME = ("optim.",)
VERL_ALLOWED_ON_RESUME = ("optim.total_steps",)


@dataclass(frozen=True)
class ResumePlan:
    """A resume request, checked: the run directory, the recipe it continues with (overrides applied),
    the overrides as given, the keys they change ([old, new]) and whether to restart from step 1."""

    run_dir: Path
    recipe: Recipe
    overrides: tuple[str, ...]
    changed: dict[str, list]
    restart: bool = False


def changed_keys(old: Recipe, new: Recipe) -> dict[str, list]:
    """Every leaf key whose value differs: {dotted key: [old, new]}."""
    a, b = dotted_items(old.model_dump(mode="json")), dotted_items(new.model_dump(mode="json"))
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def plan_resume(run_dir: Path, overrides: list[str], restart: bool = False) -> ResumePlan:
    """Check that `run_dir` is a run stare created and that the overrides may change it."""
    from stare_cli.core.resolve import load_recipe

    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise StareError(f"--resume: '{run_dir}' is not a run directory (no config.yaml)")
    if not (run_dir / "meta.json").exists():
        raise StareError(f"--resume: '{run_dir}' is not a run directory stare created (no meta.json)",
                         hint="resume only run directories you trust (verl's checkpoint loading runs pickle)")
    old = load_recipe(str(cfg_file), None, [], resolved=True)  # config.yaml keeps the run's recipe name
    new = load_recipe(str(cfg_file), None, overrides, resolved=True)
    changed = changed_keys(old, new)
    fixed = FIXED_ON_RESUME + (VERL_FIXED_ON_RESUME if new.backend.name == "verl" else ())
    for key in changed:
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in fixed) and key not in VERL_ALLOWED_ON_RESUME:
            why = ("verl restores the optimizer and scheduler (lr included) from its checkpoint"
                   if key.startswith("optim.") and new.backend.name == "verl" else "it is part of what the run is")
            raise StareError(f"--resume: {key} cannot change on resume ({changed[key][0]!r} -> {changed[key][1]!r}): {why}",
                             hint="start a new run with --recipe and the new value")
    return ResumePlan(run_dir, new, tuple(overrides), changed, restart)


def set_aside(run_dir: Path, names: tuple[str, ...] = ("metrics.jsonl", "train.log", "verl.log", "checkpoints",
                                                     "samples", "eval")) -> Path:
    """--restart: move a run's earlier outputs to restarts/<time>/ (renames; nothing is deleted)."""
    dest = make_unique_dir(run_dir / "restarts" / time.strftime("%Y%m%d-%H%M%S"))
    for name in names:
        if (run_dir / name).exists() or (run_dir / name).is_symlink():
            shutil.move(str(run_dir / name), dest / name)
    for sub in ("checkpoints", "samples", "eval"):
        (run_dir / sub).mkdir(exist_ok=True)
    print(f"--restart: the earlier outputs of {run_dir} are in {dest}", file=sys.stderr)
    return dest


def finished_note(run_dir: Path, total_steps: int, at_step: int) -> str:
    """What `--resume` of a run whose checkpoint (at `at_step`) is at or past optim.total_steps says (both
    backends): nothing to train."""
    where = (f"its checkpoint is at optim.total_steps ({total_steps})" if at_step == total_steps else
             f"its checkpoint is at step {at_step}, past optim.total_steps ({total_steps})")
    return (f"note: {run_dir} is finished: {where}; nothing to train (to go on: --resume it with "
            f"-o optim.total_steps=N, N > {at_step}; to start over: --restart)")


def no_checkpoint_error(run_dir: Path, skipped: list[str]) -> StareError:
    why = "; ".join(skipped) if skipped else "it stopped before its first checkpoint"
    return StareError(f"--resume: {run_dir} has no usable checkpoint ({why})",
                      hint=f"`stare train --resume {run_dir} --restart` starts it again from step 1 "
                           "(earlier outputs moved to restarts/), or start a new run with --recipe")
