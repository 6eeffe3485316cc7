"""A grader against another project's grading tests: how often it gives their expected verdict.

Math-Verify's own test suite (huggingface/Math-Verify, `tests/test_all.py` and friends) holds
several hundred (gold, prediction, expected) cases written from model outputs. This reads such a
file from the user's checkout (nothing of it ships here), collects every `pytest.mark.parametrize`
case of a test whose arguments include a gold, a prediction and an expected 0/1 verdict, and grades
each prediction against its gold with one of our graders:

    python -m benchmarks.evaluation.external_suite PATH/tests/test_all.py [--grader math-verify] [--json]

Some of those tests pass options our graders do not have (a rounding precision other than 6 decimal
places, `allow_set_relation_comp`, expression-only extraction); their cases are counted apart
(`with_options`), because the expected verdict depends on the option.

Importing the test file runs it as Python (its imports: pytest, math_verify, sympy): point this
only at a checkout you trust.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

GOLD_NAMES = ("gold",)
PRED_NAMES = ("pred", "prediction", "answer")
EXPECTED_NAMES = ("expected", "result")
OPTION_NAMES = ("precision", "allow_set_relation_comp", "strict")


@dataclass(frozen=True)
class Case:
    """One parametrized case: `options` names what the test passes besides the defaults."""

    test: str
    gold: str
    pred: str
    expected: bool
    options: str  # "" when the test uses the library's defaults


def _call_options(source: str) -> dict[str, str]:
    """Per test function, the non-default keyword options of its comparison call, read from the
    source (`match_types=["expr"]`, `precision=5`, ...): {function name: "k=v, ..."}."""
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        opts = []
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            for kw in call.keywords:
                text = ast.unparse(kw.value)
                if kw.arg not in ("match_types", *OPTION_NAMES) or text == kw.arg:
                    continue  # not an option, or a test parameter (judged per case in `collect`)
                if (kw.arg, text) == ("precision", "6") or (kw.arg == "match_types" and "latex" in text):
                    continue  # the default precision; latex (with or without expr) is what our graders extract
                opts.append(f"{kw.arg}={text}")
        out[node.name] = ", ".join(sorted(set(opts)))
    return out


def collect(path: Path) -> list[Case]:
    """Every (gold, prediction, expected) case of the parametrized tests in `path`."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_external_suite_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    call_opts = _call_options(path.read_text())
    cases: list[Case] = []
    for name, fn in sorted(vars(module).items()):
        if not name.startswith("test") or not callable(fn):
            continue
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize" or len(mark.args) < 2:
                continue
            argnames = mark.args[0]
            names = [a.strip() for a in (argnames.split(",") if isinstance(argnames, str) else argnames)]
            gi = _index(names, GOLD_NAMES)
            pi = _index(names, PRED_NAMES)
            ei = _index(names, EXPECTED_NAMES)
            if gi is None or pi is None or ei is None:
                continue
            for values in mark.args[1]:
                values = getattr(values, "values", values)  # pytest.param(...)
                opts = [call_opts.get(name, "")] if call_opts.get(name) else []
                for oi, oname in enumerate(names):
                    if oname in OPTION_NAMES:
                        v = values[oi]
                        if (oname, v) not in (("precision", 6), ("allow_set_relation_comp", False), ("strict", True)):
                            opts.append(f"{oname}={v!r}")
                cases.append(Case(name, str(values[gi]), str(values[pi]), bool(int(values[ei])), ", ".join(opts)))
    return cases


def _index(names: list[str], wanted: tuple[str, ...]) -> Optional[int]:
    return next((i for i, n in enumerate(names) if n in wanted), None)


def agreement(cases: list[Case], grader: str = "math-verify", workers: Optional[int] = 0) -> dict:
    """Our grader's verdict on every case: counts overall, without option cases, per test, and the
    disagreements (for a person to read)."""
    from benchmarks.grading.graders import Grader

    with Grader(workers=workers, name=grader) as g:
        verdicts = g.grade_many([c.pred for c in cases], [c.gold for c in cases])
    per_test: dict[str, list[int]] = {}
    plain = [0, 0]
    missed = []
    for c, v in zip(cases, verdicts):
        ok = v.correct == c.expected
        t = per_test.setdefault(c.test, [0, 0])
        t[0] += ok
        t[1] += 1
        if not c.options:
            plain[0] += ok
            plain[1] += 1
        if not ok:
            missed.append({**asdict(c), "ours": v.correct, "extracted": v.extracted, "reason": v.reason})
    agree = sum(t[0] for t in per_test.values())
    return {
        "grader": grader,
        "cases": len(cases),
        "agree": agree,
        "without_options": {"cases": plain[1], "agree": plain[0]},
        "with_options": {"cases": len(cases) - plain[1], "agree": agree - plain[0]},
        "per_test": {k: {"agree": a, "cases": n} for k, (a, n) in per_test.items()},
        "disagreements": missed,
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="test files of another grading library (e.g. Math-Verify's tests/test_all.py)")
    ap.add_argument("--grader", default="math-verify", help="one of our graders (default: math-verify)")
    ap.add_argument("--workers", type=int, default=0, help="grading worker processes (0: in this process)")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = ap.parse_args(argv)
    cases = [c for f in args.files for c in collect(f)]
    if not cases:
        print("no (gold, pred, expected) cases found", file=sys.stderr)
        return 1
    res = agreement(cases, args.grader, args.workers)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    w, o = res["without_options"], res["with_options"]
    print(f"{res['grader']}: {res['agree']}/{res['cases']} cases agree "
          f"({w['agree']}/{w['cases']} with the library's defaults, {o['agree']}/{o['cases']} with other options)")
    for test, t in res["per_test"].items():
        print(f"  {test}: {t['agree']}/{t['cases']}")
    for d in res["disagreements"]:
        opt = f"  [{d['options']}]" if d["options"] else ""
        print(f"  x {d['test']}: gold {d['gold']!r} pred {d['pred']!r} expected {int(d['expected'])} "
              f"ours {int(d['ours'])} ({d['reason']}; extracted {d['extracted']!r}){opt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
