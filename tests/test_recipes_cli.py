"""The foundation: CLI surface, recipe schema, includes, overrides and located errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

BROKEN = REPO / "tests" / "fixtures" / "broken"
SCENARIOS = [
    "short-cot/qwen2.5-math-7b",
    "short-cot/qwen2.5-14b-instruct",
    "short-cot/qwen2.5-32b",
    "long-cot/r1-distill-qwen-1.5b",
    "long-cot/qwen3-8b",
    "tool-use/qwen2.5-7b",
]


def test_version_and_help(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.startswith("stare ")
    code, out, _ = cli("--help")
    assert code == 0
    for cmd in ("train", "eval", "compare", "methods", "recipes", "demo"):
        assert cmd in out


def test_no_args_shows_help_and_usage_error_exits_2(cli):
    code, out, err = cli()
    assert "Usage" in out + err
    code, _, err = cli("train", "--no-such-flag")
    assert code == 2


def test_recipes_list_shows_every_scenario(cli):
    code, out, _ = cli("recipes", "list", "--json")
    assert code == 0
    names = {r["name"] for r in json.loads(out)}
    assert set(SCENARIOS) <= names
    assert any(n.startswith("tiny/") for n in names)
    assert not any(n.startswith("_") for n in names)  # bases are not listed


def test_validate_passes_on_every_recipe_under_every_method(cli):
    """Every recipe under every method, except a method whose keys have no default where the recipe leaves
    them unset (rsi-s's interval: set in the toy recipes only): said in a note, not an error."""
    code, out, err = cli("recipes", "validate", "--all-methods")
    assert code == 0, err
    assert out.count("ok ") == len(out.strip().splitlines())
    for s in SCENARIOS:
        assert f"ok  {s}" in out
        assert f"note: {s} (rsi-s): not validated: method.rsi.low, method.rsi.high unset" in err
    assert "note: tiny/arith (rsi-s)" not in err  # the toys set the interval
    code, _, err = cli("recipes", "validate", SCENARIOS[0], "--method", "rsi-s")  # asked for: an error
    assert code == 1 and "rsi-s needs them and has no default" in err


def test_show_applies_method_and_override(cli):
    code, out, err = cli(
        "recipes", "show", "short-cot/qwen2.5-math-7b", "--method", "stare-o1", "-o", "optim.lr=2e-6"
    )
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["optim"]["lr"] == pytest.approx(2e-6)
    assert cfg["method"]["name"] == "stare-o1"
    # The published recipe, unchanged by the override.
    assert cfg["rollout"]["gen_batch_size"] == 192 and cfg["optim"]["train_batch_size"] == 64
    assert cfg["method"]["stare"]["W"] == pytest.approx(1.1)


def test_same_key_path_in_file_and_override(cli, tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("include: %s\nmethod:\n  stare:\n    W: 1.3\n" % (REPO / "recipes/tiny/arith.yaml"))
    code, out, _ = cli("recipes", "show", str(f), "--json")
    assert json.loads(out)["method"]["stare"]["W"] == pytest.approx(1.3)
    code, out, _ = cli("recipes", "show", "tiny/arith", "-o", "method.stare.W=1.3", "--json")
    assert json.loads(out)["method"]["stare"]["W"] == pytest.approx(1.3)


def test_shown_yaml_round_trips(cli, tmp_path):
    code, out, _ = cli("recipes", "show", "short-cot/qwen2.5-32b", "--method", "dapo")
    f = tmp_path / "resolved.yaml"
    f.write_text(out)
    code2, out2, err = cli("recipes", "show", str(f))
    assert code2 == 0, err
    a, b = yaml.safe_load(out), yaml.safe_load(out2)
    a.pop("name"), b.pop("name")
    assert a == b


def test_method_is_the_only_axis(cli):
    """Switching method changes only method.* keys (the recipe fixes everything else)."""
    shown = {}
    for m in ("grpo-ds", "stare-o1", "dapo", "gspo"):
        _, out, _ = cli("recipes", "show", "short-cot/qwen2.5-math-7b", "--method", m, "--json")
        shown[m] = json.loads(out)
    for m, cfg in shown.items():
        for section in ("model", "data", "rollout", "optim", "eval", "backend"):
            assert cfg[section] == shown["grpo-ds"][section], (m, section)
    assert shown["dapo"]["method"]["overlong"]["enable"] is True
    assert shown["grpo-ds"]["method"]["overlong"]["enable"] is False
    assert shown["gspo"]["method"]["loss_agg"] == "seq-mean-token-mean"


def test_override_of_unknown_key_is_located(cli):
    code, _, err = cli("recipes", "show", "tiny/arith", "-o", "optim.lrr=1")
    assert code == 1
    assert err.strip() == "error: -o optim.lrr=1: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"


BROKEN_CASES = {
    "misspelt_key.yaml": ("misspelt_key.yaml:3:", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    "unknown_section.yaml": ("unknown_section.yaml:2:", "unknown key 'optimizer' (did you mean 'optim'?)"),
    "wrong_type.yaml": ("wrong_type.yaml:3:", "rollout.n: Input should be a valid integer"),
    "negative_lr.yaml": ("negative_lr.yaml:3:", "optim.lr: Input should be greater than 0 (got -1e-06)"),
    "top_p_above_one.yaml": ("top_p_above_one.yaml:3:", "rollout.top_p: Input should be less than or equal to 1"),
    "unknown_method.yaml": ("unknown_method.yaml:3:", "unknown method 'stare-o3' (did you mean 'stare-o1'?)"),
    "missing_include.yaml": ("missing_include.yaml:1:", "included file 'nope.yaml' not found"),
    "include_folder.yaml": ("include_folder.yaml:1:", "included path '.' is a folder, not a recipe file"),  # issue 68
    "mini_above_train.yaml": ("mini_above_train.yaml:", "optim.mini_batch_size (32) must be <= optim.train_batch_size (16)"),
    "bad_yaml.yaml": ("bad_yaml.yaml:3:", "not valid YAML"),
    "not_a_mapping.yaml": ("not_a_mapping.yaml:", "a recipe must be a mapping of keys, not list"),
    "cycle_a.yaml": ("cycle_a.yaml:", "include cycle: cycle_a.yaml -> cycle_b.yaml -> cycle_a.yaml"),
    "bad_enum.yaml": ("bad_enum.yaml:3:", "data.template: Input should be 'paper', 'plain', 'r1', 'raw' or 'short'"),
    "stare_p_above_one.yaml": ("stare_p_above_one.yaml:4:", "method.stare.P: Input should be less than or equal to 1"),
    "micro_not_dividing.yaml": ("micro_not_dividing.yaml:3:", "optim.micro_batch_size (7) must divide"),
    "gen_below_train.yaml": ("gen_below_train.yaml:3:", "rollout.gen_batch_size (8) must be >= optim.train_batch_size (16)"),
    "duplicate_key.yaml": ("duplicate_key.yaml:5:", "duplicate key 'lr' (first at line 3)"),
    "bool_as_int.yaml": ("bool_as_int.yaml:3:", "optim.total_steps: Input should be a valid integer (got True)"),
    "quoted_float.yaml": ("quoted_float.yaml:3:", "optim.lr: Input should be a valid number (got '1e-6')"),
    "int_as_bool.yaml": ("int_as_bool.yaml:3:", "data.shuffle: Input should be a valid boolean (got 1)"),
    "empty.yaml": ("empty.yaml:", "the recipe names no model (model.path)"),
    "no_data.yaml": ("no_data.yaml:", "the recipe names no training data (data.train)"),
}


def test_exponent_floats_without_a_dot_are_floats_in_files_and_overrides(cli, tmp_path):
    # YAML 1.1 reads `1e-6` as a string; recipes read it as YAML 1.2 does (a float), so strict
    # float fields accept it while a quoted "1e-6" stays a string and fails (quoted_float.yaml).
    f = tmp_path / "r.yaml"
    f.write_text(f"include: {REPO / 'recipes/tiny/arith.yaml'}\noptim:\n  lr: 3e-5\n")
    code, out, err = cli("recipes", "show", str(f), "-o", "optim.weight_decay=1E-2")
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert shown["optim"]["lr"] == 3e-5 and shown["optim"]["weight_decay"] == 0.01


@pytest.mark.parametrize("name", sorted(BROKEN_CASES))
def test_broken_recipe_fails_with_one_located_line(cli, name):
    where, what = BROKEN_CASES[name]
    code, out, err = cli("recipes", "validate", str(BROKEN / name))
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and where in lines[0] and what in lines[0], lines[0]
    assert out == ""


def test_every_fixture_is_covered():
    assert {p.name for p in BROKEN.glob("*.yaml")} - {"cycle_b.yaml"} == set(BROKEN_CASES)


def test_unknown_recipe_and_method(cli):
    code, _, err = cli("recipes", "show", "tiny/arithh")
    assert code == 1 and "did you mean 'tiny/arith'" in err
    code, _, err = cli("recipes", "show", "tiny/arith", "--method", "grpo-dss")
    assert code == 1 and "did you mean 'grpo-ds'" in err


def test_methods_lists_registry(cli):
    code, out, _ = cli("methods", "--json")
    names = [m["name"] for m in json.loads(out)]
    assert names == [
        "grpo", "grpo-ds", "dapo", "entropy-reg", "clip-cov", "kl-cov", "80-20", "entro-adv", "gspo",
        "w-reinforce", "stapo", "rsi-s", "cov-kernel", "adaptive-entropy", "stare-o1", "stare-c2",
    ]
    after = {m["name"] for m in json.loads(out) if not m["in_table2"]}
    assert after == {"stapo", "rsi-s", "cov-kernel", "adaptive-entropy"}  # published after the paper: no Table 2 row


def test_vllm_rollout_without_vllm_says_how_to_get_it(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    code, _, err = cli("train", "--recipe", "tiny/arith", "-o", "rollout.engine=vllm", "-o", "model.path=/nonexistent")
    assert code == 1 and "vLLM is not installed" in err, err


def test_debug_env_shows_traceback():
    env = {"STARE_DEBUG": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [sys.executable, "-m", "stare_cli", "recipes", "show", "nope/nope"], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert p.returncode == 1 and "Traceback" in p.stderr and "unknown recipe" in p.stderr


def test_plain_install_ships_recipes(tmp_path):
    """A non-editable install (wheel contents) finds and validates its recipes away from the source tree."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(REPO)],
        check=True, capture_output=True, timeout=600,
    )
    code = (
        "import sys; from stare_cli.core.recipes import recipes_root; from stare_cli.cli import main;"
        "print(recipes_root()); sys.exit(main(['recipes', 'validate']))"
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=work,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith(str(target))
    assert "ok  short-cot/qwen2.5-math-7b" in p.stdout
    # the shipped toy weights travel as package data and pass their hash check from the install
    toy = subprocess.run([sys.executable, "-c", "from benchmarks.data.toy import ensure_toy_model as e; print(e('arith'))"],
                         capture_output=True, text=True, cwd=work, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert toy.returncode == 0 and toy.stdout.strip().startswith(str(target)), toy.stderr[-500:]


def test_the_readmes_install_lines_install_this_project():
    """`stare` on PyPI is another project: every install line names an extra of this checkout, and pip
    resolves it to this distribution (dry run, offline)."""
    import re

    readme = (REPO / "README.md").read_text()
    assert "pip install 'stare[" not in readme and "pip install stare" not in readme
    extras = set(re.findall(r"pip install -e '\.\[([\w-]+)\]'", readme))
    assert {"lm-eval", "verl"} <= extras
    import tomllib

    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras <= declared
    for extra in sorted(extras):
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation",
                            "--no-index", "-e", f".[{extra}]"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "Would install stare-rl-" in r.stdout, (extra, r.stdout[-500:], r.stderr[-500:])


@pytest.mark.parametrize("args,message", [
    (["eval", "--bench", "math500", "--model", "m", "-n", "0"], "Invalid value for '-n'"),
    (["eval", "--bench", "math500", "--model", "m", "--top-p", "2"], "Invalid value for '--top-p'"),
    (["compare", "runs", "--format", "xml"], "Invalid value for '--format'"),
    (["train", "--recipe", "tiny/arith", "--device", "tpu"], "Invalid value for '--device'"),
    (["sweep", "-r", "tiny/arith", "-m", "grpo", "-s", "1", "--threads", "0"], "Invalid value for '--threads'"),
    (["train", "--no-such-flag"], "No such option: --no-such-flag"),
])
def test_bad_option_values_are_one_line_with_exit_2(cli, args, message):
    code, out, err = cli(*args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0] and "--help" in lines[0], err


@pytest.mark.parametrize("model,message", [
    ("/nonexistent/model", "no such file or directory"),
    ("EMPTY", "no config.json in that folder"),
])
def test_a_model_that_is_not_there_is_one_line(cli, tmp_path, model, message):
    if model == "EMPTY":
        model = str(tmp_path)
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", model, "--limit", "1")
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
