"""The documentation (issue 72): the site builds in strict mode, the generated reference matches the code,
and every `stare ...` command shown in the README and the docs parses against the real CLI, with its
recipes, methods and override keys existing."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _hooks():
    spec = importlib.util.spec_from_file_location("stare_docs_hooks", DOCS / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_site_builds_in_strict_mode(tmp_path):
    """A copy of docs/ and mkdocs.yml (the build's hook writes the reference pages: not into the checkout,
    so that the staleness test below sees the committed pages)."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for page in ("index.html", "guide/methods/index.html", "reference/cli/index.html", "reference/recipe-keys/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_the_generated_reference_matches_the_code():
    pages = _hooks().generate()
    assert set(pages) == {"cli.md", "recipe-keys.md", "methods.md", "benchmarks.md"}
    for name, text in pages.items():
        committed = (DOCS / "reference" / name).read_text()
        assert committed == text, f"docs/reference/{name} is stale: run `make docs` (python docs/hooks.py)"


def test_the_reference_names_every_command_method_and_recipe_key():
    from baselines.registry import METHODS
    from stare_cli.core.recipes import _valid_keys
    from stare_cli.core.config import Recipe

    pages = _hooks().generate()
    for m in METHODS:
        assert f"`{m}`" in pages["methods.md"]
    for key in _valid_keys(Recipe):
        assert f"`{key}`" in pages["recipe-keys.md"], key
    for cmd in ("train", "eval", "compare", "sweep", "recipes validate", "model get", "grade audit"):
        assert f"## `stare {cmd}`" in pages["cli.md"], cmd


# ------------------------------------------------------------------------------ documented commands
def documented_commands() -> list[tuple[str, str, bool]]:
    """(where, command line, complete) of every `stare ...` command in the README and the docs: lines of
    fenced code blocks (after an optional `$ `, environment assignments or `nice`; continued lines joined),
    which must be complete invocations, and inline code spans, which may name a command without the
    arguments it needs (`stare sweep` in a sentence)."""
    out = []
    files = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    for f in files:
        if f.parent.name == "reference":
            continue  # generated from the CLI itself
        fence, shell_vars = False, {}
        lines = f.read_text().splitlines()
        i = 0
        while i < len(lines):
            line, where = lines[i], f"{f.relative_to(REPO)}:{i + 1}"
            i += 1
            if line.lstrip().startswith("```"):
                fence, shell_vars = not fence, {}
                continue
            if fence:
                var = re.match(r'^([A-Z_][A-Z0-9_]*)="([^"]*)"\s*$', line)
                if var:  # R="--recipe ..." then `stare train $R`: the shell's expansion
                    shell_vars[var.group(1)] = var.group(2)
                    continue
                line = re.sub(r"\$([A-Z_][A-Z0-9_]*)", lambda m: shell_vars.get(m.group(1), m.group(0)), line)
                while line.rstrip().endswith("\\") and i < len(lines):
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                    i += 1
                m = re.match(r"^\s*(?:\$\s+)?(?:[A-Z_]+=\S+\s+)*(?:nice\s+(?:-n\s*\d+\s+)?)?(stare\s.*)$", line)
                if m:
                    out.append((where, m.group(1), True))
                continue
            for span in re.findall(r"`(stare [^`]+)`", line):
                if not span.startswith("stare ..."):  # prose about commands in general
                    out.append((where, span, False))
    return out


# A documented placeholder (`R`, `RUN`, `<run>`, `SWEEP/cells/...`) stands for a value the reader supplies.
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:[/.].*)?|.*<[^>]*>.*|\.\.\.)$")
# Where a placeholder is the value of a typed option, a value of its type stands in for it.
STAND_INS = {"--backend": "embedded", "--engine": "hf", "--seed": "1", "-s": "1", "--threads": "1", "--limit": "1",
             "-n": "1", "--step": "1", "--parallel": "1", "--device": "cpu", "--format": "md", "--metric": "avg",
             "--dtype": "float32", "--harness": "native", "--tools": "python", "--task": "arith", "--workers": "0",
             "--port": "8000", "--rounds": "1", "--max-tokens": "16"}


def normalise(command: str) -> list[str]:
    """The argument list a documented command stands for: the comment dropped, the line cut at a pipe or
    redirect, optional groups `[...]` opened, `a|b` choices taken at their first alternative, `...`
    dropped, `<a placeholder>` kept as one word, and a placeholder value of a typed option replaced by a
    value of its type."""
    command = command.split(" #")[0].strip()
    command = re.split(r"\s(?:\||>|2>|&&|;)\s", command)[0]
    command = re.sub(r"<[^>]*>", lambda m: m.group(0).replace(" ", "_"), command)
    command = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1), command)  # [--flag] -> --flag
    args = [a for a in shlex.split(command)[1:] if a != "..."]
    args = [a.split("|")[0] if "|" in a and "=" not in a else a for a in args]
    for k in range(1, len(args)):
        if args[k - 1] in STAND_INS and PLACEHOLDER.match(args[k]):
            args[k] = STAND_INS[args[k - 1]]
    return args


def _check(args: list[str]) -> None:
    """Parse `stare ARGS` with the real CLI (no command runs), then check what it names exists."""
    import typer

    from baselines.registry import lookup_method
    from stare_cli.cli import app
    from stare_cli.core.recipes import find_recipe, parse_override, _valid_keys
    from stare_cli.core.config import Recipe

    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("stare", list(args), resilient_parsing=False)
    while getattr(cmd, "commands", None):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args] if not hasattr(ctx, "protected_args") \
            else [*ctx.protected_args, *ctx.args]
        if not rest:
            return  # a group alone prints its help
        name, sub, rest = cmd.resolve_command(ctx, rest)
        ctx = sub.make_context(name, rest, parent=ctx)
        cmd = sub
    params = ctx.params
    recipe = params.get("recipe")
    if isinstance(recipe, str) and not PLACEHOLDER.match(recipe):
        find_recipe(recipe)
    for key in ("method", "methods"):
        vals = params.get(key)
        for v in ([vals] if isinstance(vals, str) else vals or []):
            if not PLACEHOLDER.match(v):
                lookup_method(v)
    valid = set(_valid_keys(Recipe))
    for o in params.get("overrides") or params.get("override") or []:
        path, _ = parse_override(o)
        key = ".".join(map(str, path))
        assert key in valid or any(k.startswith(key + ".") for k in valid), f"unknown recipe key {key}"


def test_documented_commands_are_found():
    cmds = documented_commands()
    assert len(cmds) > 60
    assert any("README.md" in w and c.startswith("stare eval --bench words:add-sub") and full for w, c, full in cmds)


def test_every_documented_command_parses_against_the_cli():
    failures = []
    for where, command, complete in documented_commands():
        try:
            _check(normalise(command))
        except SystemExit as e:  # typer's --help / --version exit
            if e.code not in (0, None):
                failures.append(f"{where}: {command}: exit {e.code}")
        except Exception as e:  # noqa: BLE001 - each failure named with its line
            incomplete = type(e).__name__ == "MissingParameter" or "requires an argument" in str(e)
            if incomplete and not complete:
                continue  # a command named in a sentence: its options exist, its arguments are elsewhere
            failures.append(f"{where}: {command}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("bad", [
    "stare train --recipe tiny/arith --metod stare-o1",        # an unknown option
    "stare train --recipe tiny/nonesuch --method stare-o1",    # an unknown recipe
    "stare train --recipe tiny/arith --method stare-o3",       # an unknown method
    "stare train --recipe tiny/arith -o optim.nonesuch=1",     # an unknown recipe key
    "stare trian --recipe tiny/arith",                         # an unknown command
])
def test_a_wrong_command_in_the_docs_would_fail(bad):
    with pytest.raises(Exception):
        _check(normalise(bad))
