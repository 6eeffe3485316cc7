"""The layers as a contract (issue 33): import-linter's contracts in pyproject.toml ([tool.importlinter])
hold, and a deliberate upward import breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    # lint-imports reads pyproject.toml in the working directory and imports the root packages from it
    return subprocess.run([*LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_layer_contracts_hold():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "Layers follow the data KEPT" in r.stdout and "No import cycles between the modules of a package KEPT" in r.stdout
    assert "Library code never imports stare_cli KEPT" in r.stdout


def _copy_sources(dst: Path, packages=("stare_cli", "stare_kernel", "benchmarks", "baselines", "recipes")) -> None:
    """The Python files of `packages` (and pyproject.toml) under dst."""
    for pkg in packages:
        shutil.copytree(REPO / pkg, dst / pkg, ignore=lambda d, names: [n for n in names if not (
            n.endswith(".py") or (Path(d) / n).is_dir()) or n == "__pycache__"])
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")


def test_an_upward_import_or_a_cycle_breaks_the_contract(tmp_path):
    _copy_sources(tmp_path)
    grading = tmp_path / "benchmarks" / "grading" / "graders.py"
    grading.write_text(grading.read_text() + "\n\ndef _upward():\n    from stare_cli.backends import embedded  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode == 1 and "Layers follow the data BROKEN" in r.stdout, r.stdout[-2000:]
    assert "benchmarks.grading.graders -> stare_cli.backends.embedded" in r.stdout

    shutil.rmtree(tmp_path / "benchmarks")
    _copy_sources(tmp_path, ["benchmarks"])
    attention = tmp_path / "benchmarks" / "generation" / "attention.py"
    attention.write_text(attention.read_text() + "\n\ndef _cycle():\n    from benchmarks.generation import engines  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode == 1 and "No import cycles between the modules of a package BROKEN" in r.stdout, r.stdout[-2000:]


def test_library_code_reaching_up_into_stare_cli_breaks_the_contract(tmp_path):
    """Issue 67: benchmarks/ imported stare_cli.core (errors, run I/O), the one dependency in the layout that ran
    back up; the kernel (stare_kernel) now sits below both, and a forbidden contract says so."""
    _copy_sources(tmp_path)
    ev = tmp_path / "benchmarks" / "evaluation" / "metrics.py"
    ev.write_text(ev.read_text() + "\n\ndef _upward():\n    from stare_cli.core import runs  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode == 1 and "Library code never imports stare_cli BROKEN" in r.stdout, r.stdout[-2000:]
    assert "benchmarks.evaluation.metrics -> stare_cli.core.runs" in r.stdout



def _cycles(root: Path) -> list[tuple[str, ...]]:
    """Every import cycle of the project's module graph, as one chain per edge a -> b that b leads back
    from. Unlike import-linter's acyclic_siblings contract, this sees cycles through a package's own
    __init__ (a package importing its submodule, which imports the package back: issue 49, item 4)."""
    code = ("import grimp, json\n"
            "g = grimp.build_graph('stare_cli', 'stare_kernel', 'benchmarks', 'baselines', 'recipes', include_external_packages=False,"
            " cache_dir=None)\n"
            "out = []\n"
            "for a in sorted(g.modules):\n"
            "    for b in sorted(g.find_modules_directly_imported_by(a)):\n"
            "        back = g.find_shortest_chain(importer=b, imported=a)\n"
            "        if back: out.append([a, *back])\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    return [tuple(c) for c in json.loads(r.stdout)]


def test_no_import_cycle_anywhere_including_package_inits(tmp_path):
    assert _cycles(REPO) == []
    # the cycle issue 49 found: a package's function imports a submodule that imports the package back
    _copy_sources(tmp_path)
    vb = tmp_path / "stare_cli" / "backends" / "verl_backend.py"
    vb.write_text(vb.read_text() + "\n\ndef _back():\n    from stare_cli.backends import check  # noqa\n")
    found = _cycles(tmp_path)
    assert ("stare_cli.backends", "stare_cli.backends.verl_backend", "stare_cli.backends") in found, found
