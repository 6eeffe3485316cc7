"""Gather the wheels the GPU machine lacks for the device check (issue 70), into .gpu-wheels/ (git-ignored).

    python -m benchmarks.gpu.wheels            # writes .gpu-wheels/, prints its size and the install line

The lent GPU machine (its own description) has Python 3.12 with torch, transformers, numpy, safetensors,
tokenizers, typer, rich, pyyaml, matplotlib, pytest and sympy, and no network. What the check needs beyond
that is found, not listed by hand: a subprocess runs the check's `--device cpu --quick` form (about a
minute), and the distributions behind the
imported top-level modules that this project declares as dependencies, less the machine's, are downloaded
with their own dependencies as wheels for CPython 3.12 on manylinux x86_64 (`pip download --only-binary`).
It refuses to write more than 40 MiB (the working tree travels in 64 MiB).

Not gathered: vLLM and verl (the check does not use them), math-verify and datasets (not imported by the
check), and the C selection kernel (built on the machine when it has a compiler: benchmarks/gpu/run.sh;
otherwise the NumPy host path runs, and the report says which).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_HAS = ("torch", "transformers", "numpy", "safetensors", "tokenizers", "typer", "rich", "pyyaml",
               "matplotlib", "pytest", "sympy")
LIMIT_BYTES = 40 * 2**20
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "linux_x86_64")

_PROBE = r"""
import json, sys, tempfile, importlib.metadata as md
from benchmarks.gpu import check
with tempfile.TemporaryDirectory() as out:  # every part, so that lazy imports are seen too
    check.main(["--device", "cpu", "--quick", "--out", out])
dist = md.packages_distributions()
print(json.dumps(sorted({d for t in {m.split('.')[0] for m in sys.modules} for d in dist.get(t, [])})))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, str]:
    """The project's core dependencies, {normalised name: requirement string}, from pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_norm(re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0]): d for d in deps}


def needed(python: str = sys.executable) -> list[str]:
    """Requirement strings of the declared dependencies the check imports and the machine lacks."""
    out = subprocess.run([python, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    imported = {_norm(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}
    decl = declared()
    have = {_norm(x) for x in MACHINE_HAS}
    return sorted(decl[d] for d in imported if d in decl and d not in have)


def download(reqs: list[str], dest: Path, python_version: str = "3.12") -> int:
    """pip download the wheels (and their dependencies') for CPython `python_version` on manylinux x86_64;
    their total bytes."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    abi = "cp" + python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + reqs, check=True)
    have = {_norm(x) for x in MACHINE_HAS}
    for w in dest.glob("*.whl"):  # a dependency the machine has already (e.g. through pip's resolution)
        if _norm(w.name.split("-")[0]) in have:
            w.unlink()
    return sum(w.stat().st_size for w in dest.glob("*.whl"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.wheels", description=__doc__.split("\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    ap.add_argument("--list", action="store_true", help="print the requirements and exit (no download)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12)")
    a = ap.parse_args(argv)
    reqs = needed()
    print("needed beyond the GPU machine's packages: " + (", ".join(reqs) or "nothing"))
    if a.list or not reqs:
        return 0
    size = download(reqs, a.dest, a.python_version)
    names = sorted(w.name for w in a.dest.glob("*.whl"))
    print(f"{a.dest}: {len(names)} wheels, {size / 2**20:.1f} MiB")
    for n in names:
        print(f"  {n}")
    if size > LIMIT_BYTES:
        print(f"error: {size / 2**20:.1f} MiB is over the {LIMIT_BYTES / 2**20:.0f} MiB limit", file=sys.stderr)
        return 1
    print("on the GPU machine (benchmarks/gpu/run.sh does it): python -m pip install --no-index --no-deps "
          "--target .gpu-site .gpu-wheels/*.whl && PYTHONPATH=.gpu-site:. python -m benchmarks.gpu.check "
          "--device cuda --out $OUT/gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
