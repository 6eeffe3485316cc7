"""`stare compare` on synthetic run and result directories: every format against golden files,
seed aggregation, missing benchmarks, mismatched protocols and the paper's rows.

Regenerate the golden files after an intended change with STARE_UPDATE_GOLDEN=1 and review them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO

GOLDEN = REPO / "tests" / "golden"
BENCHES = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")


def _results(folder: Path, bench: str, avg: float, n: int, temperature=1.0, top_p=0.7, limit=None, model="m", seed=0):
    d = folder / bench
    d.mkdir(parents=True, exist_ok=True)
    metrics = {"n": n, "problems": 10, f"avg@{n}": avg, "pass@1": avg, f"pass@{n}": min(100.0, avg + 20),
               "maj@1": avg - 1, f"maj@{n}": avg + 5, "len/mean": 100.0, "truncated": 0.0}
    res = {"benchmark": bench, "settings": {"model": model, "seed": seed, "limit": limit},
           "protocol": {"n": n, "temperature": temperature, "top_p": top_p, "template": "paper", "max_tokens": 3072},
           "metrics": metrics}
    (d / "results.json").write_text(json.dumps(res))


def _run(root: Path, method: str, seed: int, scores: dict, n_of=lambda b: 32 if b in BENCHES[:3] else 4, W=1.1,
         tag="", **kw):
    run = root / f"r__{method}__seed{seed}{tag}"
    (run / "eval" / "step-000100").mkdir(parents=True)
    (run / "config.yaml").write_text(
        f"name: short-cot/qwen2.5-math-7b\nmethod:\n  name: {method}\n  stare:\n    h_tgt: 0.3\n    W: {W}\n"
        f"optim:\n  seed: {seed}\n")
    rows = [{"step": s, "entropy": 0.5 - 0.001 * s * (1 if method == "grpo-ds" else 0.3), "reward": 0.3 + 0.001 * s,
             "full_solve": 0.1, "len/mean": 300 + s} for s in range(1, 101)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for b, v in scores.items():
        _results(run / "eval" / "step-000100", b, v, n_of(b), **{"model": f"{run}@step-100", **kw})
    return run


@pytest.fixture
def runs(tmp_path):
    base = {"aime24": 40.0, "aime25": 20.0, "amc23": 80.0, "math500": 85.0, "minerva": 44.0, "olympiadbench": 45.0}
    out = []
    # STARE-O1: two seeds (mean ± std); GRPO-ds: two seeds, minerva missing in one -> still averaged where present
    out.append(_run(tmp_path, "stare-o1", 1, {b: v + 2 for b, v in base.items()}))
    out.append(_run(tmp_path, "stare-o1", 2, {b: v + 4 for b, v in base.items()}))
    out.append(_run(tmp_path, "grpo-ds", 1, base))
    out.append(_run(tmp_path, "grpo-ds", 2, {b: v for b, v in base.items() if b != "olympiadbench"}))
    return out


@pytest.mark.parametrize("fmt,ext", [("md", "md"), ("latex", "tex"), ("csv", "csv"), ("json", "json")])
def test_formats_match_golden_files(cli, runs, fmt, ext, tmp_path):
    code, out, err = cli("compare", *map(str, runs), "--format", fmt, "--paper", "short-cot/qwen2.5-math-7b",
                         "--baseline", "grpo-ds")
    assert code == 0, err
    golden = GOLDEN / f"compare.{ext}"
    if os.environ.get("STARE_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out)
    assert out == golden.read_text()


def test_seed_aggregation_and_missing_benchmark(cli, runs):
    code, out, _ = cli("compare", *map(str, runs), "--format", "json")
    data = json.loads(out)
    stare = next(r for r in data["rows"] if r["label"] == "STARE-O1")
    # seeds give 42 and 44 on AIME24: mean 43, sample std sqrt(2) = 1.414...
    assert stare["cells"]["aime24"]["mean"] == pytest.approx(43.0)
    assert stare["cells"]["aime24"]["std"] == pytest.approx(2 ** 0.5)
    assert stare["cells"]["aime24"]["seeds"] == 2
    grpo = next(r for r in data["rows"] if r["label"] == "GRPO-ds")
    assert grpo["cells"]["olympiadbench"]["seeds"] == 1
    assert grpo["cells"]["avg"]["seeds"] == 1  # only the seed with all six benchmarks has an Avg
    code, md, _ = cli("compare", *map(str, runs), "--format", "md")
    assert "| GRPO-ds |" in md


def test_missing_benchmark_shows_dash(cli, tmp_path):
    run = _run(tmp_path, "grpo-ds", 1, {"aime24": 30.0})
    code, out, _ = cli("compare", str(run), "--format", "md")
    line = next(ln for ln in out.splitlines() if ln.startswith("| GRPO-ds"))
    assert line.count("–") == 6  # five benchmarks and Avg


def test_mismatched_protocols_are_flagged_not_averaged(cli, tmp_path):
    a = _run(tmp_path / "a", "grpo-ds", 1, {"aime24": 30.0})
    b = _run(tmp_path / "b", "grpo-ds", 2, {"aime24": 50.0}, top_p=1.0)
    code, out, _ = cli("compare", str(a), str(b), "--format", "json")
    data = json.loads(out)
    rows = [r for r in data["rows"] if r["label"].startswith("GRPO-ds")]
    assert len(rows) == 2  # two protocols, two rows, named by what differs
    assert sorted(r["label"] for r in rows) == ["GRPO-ds [top_p=0.7]", "GRPO-ds [top_p=1.0]"]
    assert all(r["flagged"] for r in rows) and data["mixed_protocols"] == ["aime24"]
    assert sorted(r["cells"]["aime24"]["mean"] for r in rows) == [30.0, 50.0]
    code, md, _ = cli("compare", str(a), str(b), "--format", "md")
    assert "* made under a different or reduced protocol" in md


def test_paper_rows_and_prior_work_marks(cli, runs):
    code, out, _ = cli("compare", *map(str, runs), "--paper", "short-cot/qwen2.5-math-7b", "--format", "json")
    rows = json.loads(out)["rows"]
    paper = {r["label"]: r for r in rows if r["paper"]}
    assert paper["STARE-O1 (paper)"]["cells"]["aime24"]["mean"] == pytest.approx(44.2)
    assert paper["STARE-O1 (paper)"]["from_prior_work"] is False
    assert paper["DAPO (paper)"]["from_prior_work"] is True
    code, _, err = cli("compare", *map(str, runs), "--paper", "short-cot/qwen2.5-math-8b")
    assert code == 1 and "did you mean 'short-cot/qwen2.5-math-7b'" in err


def test_eval_output_directories_and_plots(cli, tmp_path, runs):
    ev = tmp_path / "evals" / "some-model"
    for b in BENCHES:
        _results(ev, b, 50.0, 4, model="/models/some-model")
    code, out, err = cli("compare", str(ev), *map(str, runs), "--format", "csv", "--plot", str(tmp_path / "plots"))
    assert code == 0, err
    assert "some-model" in out
    for f in ("dynamics.png", "dynamics.svg", "passk.png", "passk.svg"):
        assert (tmp_path / "plots" / f).stat().st_size > 1000


def test_not_a_run_or_results_dir(cli, tmp_path):
    code, _, err = cli("compare", str(tmp_path))
    assert code == 1 and "neither a run directory" in err


def test_runs_that_differ_get_distinct_labels_and_are_not_averaged(cli, tmp_path):
    a = _run(tmp_path, "stare-o1", 1, {"aime24": 30.0}, W=1.1, tag="a")
    b = _run(tmp_path, "stare-o1", 1, {"aime24": 40.0}, W=2.0, tag="b")
    code, out, _ = cli("compare", str(a), str(b), "--format", "json")
    labels = sorted(r["label"] for r in json.loads(out)["rows"])
    assert labels == ["STARE-O1 [stare.W=1.1]", "STARE-O1 [stare.W=2.0]"]


def test_bold_only_where_a_column_has_several_values(cli, tmp_path):
    one = _run(tmp_path, "grpo-ds", 1, {b: 50.0 for b in BENCHES})
    code, md, _ = cli("compare", str(one), "--format", "md")
    assert "**" not in md  # one value per column: nothing is "best"
    two = _run(tmp_path, "stare-o1", 1, {b: 60.0 for b in BENCHES})
    code, md, _ = cli("compare", str(one), str(two), "--format", "md")
    assert "**60.0**" in md and "**50.0**" not in md


def test_csv_is_numeric_with_empty_cells_and_notes(cli, tmp_path):
    run = _run(tmp_path, "grpo-ds", 1, {"aime24": 30.0})
    code, out, _ = cli("compare", str(run), "--format", "csv", "--paper", "short-cot/qwen2.5-math-7b")
    import csv as _csv
    import io

    rows = list(_csv.DictReader(io.StringIO(out)))
    ours = next(r for r in rows if r["Method"] == "GRPO-ds")
    assert ours["AIME24"] == "30.0" and ours["AIME25"] == "" and ours["Avg"] == "" and ours["notes"] == ""
    for r in rows:
        for b in ("AIME24", "Avg"):
            assert r[b] == "" or float(r[b]) >= 0  # numbers only
    assert next(r for r in rows if r["Method"] == "DAPO (paper)")["notes"].startswith("from prior work")


def test_ci_over_seeds_and_over_problems(cli, tmp_path):
    s1 = _run(tmp_path, "grpo-ds", 1, {"aime24": 30.0})
    s2 = _run(tmp_path, "grpo-ds", 2, {"aime24": 40.0})
    code, out, _ = cli("compare", str(s1), str(s2), "--format", "json", "--ci")
    cell = json.loads(out)["rows"][0]["cells"]["aime24"]
    assert cell["seeds"] == 2 and 30.0 <= cell["ci95"][0] <= cell["ci95"][1] <= 40.0
    one = _run(tmp_path / "one", "grpo-ds", 1, {"aime24": 30.0})
    res = one / "eval" / "step-000100" / "aime24" / "results.json"
    data = json.loads(res.read_text())
    data["metrics"]["ci95/avg@32"] = [20.0, 41.0]
    res.write_text(json.dumps(data))
    code, md, _ = cli("compare", str(one), "--format", "md", "--ci")
    assert "30.0 [20.0, 41.0]" in md


def test_a_ci_over_seeds_stays_within_0_and_100(cli, tmp_path):
    """pass@32 of three seeds at 80, 100, 100 (each avg + 20, at most 100): mean 93.33, sd 11.547, half
    width t_{0.975,2} 4.303 x 11.547 / sqrt(3) = 28.69 -> [64.65, 122.0], cut at 100: no mean is above it.
    The pass@k plot's band is cut the same way."""
    from stare_cli.analysis.compare import load_inputs, passk_curves

    runs = [_run(tmp_path, "grpo-ds", s, {"aime24": v}) for s, v in ((1, 60.0), (2, 80.0), (3, 80.0))]
    code, out, _ = cli("compare", *map(str, runs), "--format", "json", "--ci", "--metric", "pass@32")
    cell = json.loads(out)["rows"][0]["cells"]["aime24"]
    assert code == 0 and cell["seeds"] == 3
    assert cell["ci95"][0] == pytest.approx(64.65, abs=0.01) and cell["ci95"][1] == 100.0
    (curve,) = passk_curves(load_inputs(runs), "aime24").values()
    assert curve.hi[-1] == 100.0 and curve.lo[-1] == pytest.approx(64.65, abs=0.01)


def test_pass_at_k_legend_labels_are_distinct(tmp_path):
    from stare_cli.analysis.compare import Result, legend_labels

    rs = [Result("stare-o1", 1, str(tmp_path / "a")), Result("stare-o1", 1, str(tmp_path / "b")),
          Result("grpo-ds", 1, str(tmp_path / "c"))]
    labels = legend_labels(rs)
    assert len(set(labels)) == 3 and labels[2] == "GRPO-ds (seed 1)" and labels[0].endswith(" a")


def test_pass_at_k_curves_average_a_labels_seeds_with_an_interval(tmp_path):
    from stare_cli.analysis.compare import Result, passk_curves

    def r(label, seed, p1, p4, src):
        return Result(label, seed, str(tmp_path / src), metrics={"aime24": {"pass@1": p1, "pass@2": p1 + 5, "pass@4": p4}})

    rs = [r("stare-o1", 1, 10.0, 30.0, "a"), r("stare-o1", 2, 20.0, 50.0, "b"), r("grpo-ds", 1, 5.0, 9.0, "c")]
    curves = passk_curves(rs, "aime24")
    mean = curves["STARE-O1 (2 seeds, mean, range)"]
    assert mean.ks == [1, 2, 4]
    assert mean.mean == [15.0, 20.0, 40.0]  # (10 + 20) / 2, (15 + 25) / 2, (30 + 50) / 2
    assert mean.lo == [10.0, 15.0, 30.0] and mean.hi == [20.0, 25.0, 50.0]  # two seeds: their range
    three = passk_curves([*rs, r("stare-o1", 3, 30.0, 70.0, "d")], "aime24")["STARE-O1 (3 seeds, mean, 95% t-interval)"]
    # pass@1 10, 20, 30: mean 20, sd 10, half width t_{0.975,2} 4.303 x 10 / sqrt(3) = 24.844
    # -> [-4.844, 44.844], its low end cut at 0: no pass@1 is below it
    assert three.mean[0] == 20.0 and three.lo[0] == 0.0
    assert three.hi[0] == pytest.approx(20.0 + 24.844, abs=1e-3)
    single = curves["GRPO-ds (seed 1)"]  # one run: its own curve, no interval
    assert single.mean == [5.0, 10.0, 9.0] and single.lo == []
    # two results of one label, identity and seed are one seed evaluated twice: the later counts, as in the
    # table (its "Seed repeated" note), never two seeds
    same = passk_curves([r("stare-o1", 1, 10.0, 30.0, "a"), r("stare-o1", 1, 20.0, 50.0, "b")], "aime24")
    assert list(same) == ["STARE-O1 (seed 1)"] and same["STARE-O1 (seed 1)"].mean == [20.0, 25.0, 50.0]


def test_rows_of_one_model_under_different_protocols_are_named_apart_and_never_bolded_against_each_other():
    """Issue 30, item 14: three evaluations of one model (N=1, N=2, N=1 at T=0.5) were three rows all
    labelled 'arith-v1 *', and one was bolded as best across protocols."""
    from stare_cli.analysis.compare import Result, build_rows, make_identity, render

    def res(n, t, acc):
        return Result("arith-v1", 0, f"src-{n}-{t}", metrics={"toy:arith": {"n": n, f"avg@{n}": acc, "problems": 8}},
                      protocol={"toy:arith": make_identity(n=n, temperature=t, top_p=1.0, template="raw", max_tokens=56, partial=True)}, config={"model": "arith-v1"})

    rows, info = build_rows([res(1, 1.0, 0.0), res(2, 1.0, 37.5), res(1, 0.5, 40.0)], "avg", ("toy:arith",))
    assert [r.label for r in rows] == ["arith-v1 [n=1, temperature=1.0]", "arith-v1 [n=2, temperature=1.0]", "arith-v1 [n=1, temperature=0.5]"]
    assert info["mixed"] == ["toy:arith"]
    md = render(rows, info, "md", {}, ("toy:arith",))
    assert "**" not in md  # 40.0 is not "best": its protocol differs from the others'
    # one protocol: a best exists, and the labels stay plain
    rows, info = build_rows([res(2, 1.0, 37.5), Result("other", 0, "o", metrics={"toy:arith": {"n": 2, "avg@2": 50.0}},
                                                            protocol={"toy:arith": make_identity(n=2, temperature=1.0, top_p=1.0, template="raw", max_tokens=56, partial=True)})],
                            "avg", ("toy:arith",))
    assert [r.label for r in rows] == ["arith-v1", "other"]
    assert "**50.0**" in render(rows, info, "md", {}, ("toy:arith",))


def test_a_maj_table_says_how_ties_are_voted():
    from stare_cli.analysis.compare import Result, build_rows, make_identity, render

    res = Result("arith-v1", 0, "s", metrics={"toy:arith": {"n": 2, "avg@2": 50.0, "maj@2": 0.0, "problems": 8}},
                 protocol={"toy:arith": make_identity(n=2, temperature=1.0, top_p=1.0, template="raw", max_tokens=56, partial=True)})
    rows, info = build_rows([res], "maj@2", ("toy:arith",))
    md = render(rows, info, "md", {}, ("toy:arith",))
    assert "maj@2: the expected majority vote over 2 of the samples; answers that tie for most votes go to the one seen first" in md
    rows, info = build_rows([res], "avg", ("toy:arith",))
    assert "tie for most votes" not in render(rows, info, "md", {}, ("toy:arith",))


def test_every_pass_at_k_panel_has_its_own_legend(tmp_path, monkeypatch):
    """Issue 30, item 14: the legend was drawn on the first panel only, so a method evaluated on the
    second benchmark only had no legend entry anywhere."""
    from stare_cli.analysis import compare

    figs = []
    monkeypatch.setattr(compare, "save_figure", lambda fig, base: figs.append(fig) or [])
    rs = [compare.Result("stare-o1", 1, "a", metrics={"aime24": {"pass@1": 10.0, "pass@2": 20.0}}),
          compare.Result("grpo-ds", 1, "b", metrics={"math500": {"pass@1": 30.0, "pass@2": 40.0}})]
    compare.passk_plot(rs, tmp_path)
    legends = [ax.get_legend() for ax in figs[0].axes]
    assert all(lg is not None for lg in legends)
    assert [[t.get_text() for t in lg.get_texts()] for lg in legends] == [["STARE-O1 (seed 1)"], ["GRPO-ds (seed 1)"]]


def test_every_evaluation_into_one_folder_is_a_row_of_its_own(cli, tmp_path, quick_toy):
    """Issue 30, item 14: two `stare eval` runs into one folder (N=1, then N=2) showed as one row,
    the latest; each evaluation now records an id, and compare shows each, named by what differs.
    A regrade keeps the ids; its records (another grader) are rows of their own beside the first grader's,
    each named by what differs, never pooled with them or put in their place."""
    out = tmp_path / "ev"
    base = ["eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "8", "--out", str(out),
            "--engine", "hf", "--workers", "0"]
    assert cli(*base, "-n", "1")[0] == 0
    assert cli(*base, "-n", "2")[0] == 0
    code, md, err = cli("compare", str(out), "--format", "md")
    assert code == 0, err
    rows = [ln for ln in md.splitlines() if ln.startswith("| arith")]
    assert len(rows) == 2 and "[n=1]" in rows[0] and "[n=2]" in rows[1], md
    assert cli("eval", "--regrade", str(out), "--grader", "stare-official", "--workers", "0")[0] == 0
    code, md, err = cli("compare", str(out), "--format", "md")
    rows = [ln for ln in md.splitlines() if ln.startswith("| arith")]
    assert len(rows) == 4, md
    assert sum("grader=stare-official@" in ln for ln in rows) == 2 and sum("grader=math-verify@" in ln for ln in rows) == 2


# ------------------------------------------------------------------ issue 43: what a row is
def _ev(folder: Path, avg: float, *, bench="math500", n=4, seed=0, grader="math-verify@7", sha="a" * 64,
        problems=500, engine="hf", limit=None, paper=True, model="m", temperature=1.0, max_tokens=3072):
    """One `stare eval` results.json with its full identity."""
    d = folder / bench
    d.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": bench, "grader": grader,
           "settings": {"model": model, "seed": seed, "limit": limit, "engine": engine, "data": sha},
           "protocol": {"n": n, "temperature": temperature, "top_p": 0.7, "template": "paper", "max_tokens": max_tokens,
                        "paper_protocol": paper},
           "data": {"sha256": sha, "problems": problems, "partial": problems < 500},
           "metrics": {"n": n, "problems": problems, f"avg@{n}": avg, "pass@1": avg}}
    (d / "results.json").write_text(json.dumps(res))
    return folder


def _json(cli, *paths, extra=()):
    code, out, err = cli("compare", *map(str, paths), "--format", "json", "--ci", *extra)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("field,kw", [
    ("grader", {"grader": "stare-official@2"}),      # a --regrade copy under another grader
    ("data", {"sha": "b" * 64}),                     # another data file, or corrected golds
    ("problems", {"problems": 40, "limit": 40}),     # another --limit subset
    ("engine", {"engine": "lm-eval-hf"}),            # the lm-eval bridge beside the native engine
])
def test_evaluations_that_differ_beyond_the_seed_never_pool(cli, tmp_path, field, kw):
    """Issue 43, case 1: two evaluations of one model with one protocol but another grader, data, problem
    set or engine were pooled as '2 seeds' (60.5 and 30.9 shown as 45.7 ± 21.0)."""
    a = _ev(tmp_path / "a", 60.5, seed=0)
    b = _ev(tmp_path / "b", 30.9, seed=1, **kw)
    js = _json(cli, a, b)
    assert [r["cells"]["math500"]["seeds"] for r in js["rows"]] == [1, 1]
    labels = [r["label"] for r in js["rows"]]
    assert len(set(labels)) == 2 and all(f"{field}=" in lab for lab in labels), labels
    assert js["mixed_protocols"] == ["math500"] and field in js["not_comparable"][0]
    md = cli("compare", str(a), str(b), "--format", "md")[1]
    assert "**" not in md and "No best is marked" in md


def test_same_identity_different_seeds_pool(cli, tmp_path):
    js = _json(cli, _ev(tmp_path / "a", 60.0, seed=0), _ev(tmp_path / "b", 62.0, seed=1))
    (row,) = js["rows"]
    assert row["cells"]["math500"]["seeds"] == 2 and row["cells"]["math500"]["mean"] == 61.0


def _run_at(root: Path, method: str, seed: int, steps_scores: dict[int, float]) -> Path:
    run = root / f"{method}-s{seed}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"method:\n  name: {method}\noptim:\n  seed: {seed}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "entropy": 0.5}) + "\n" for s in range(1, 4)))
    for st, v in steps_scores.items():
        _ev(run / "eval" / f"step-{st:06d}", v, bench="toy:arith", model=f"{run}@step-{st}", seed=seed, problems=64,
            limit=64, paper=False)
    return run


def test_runs_at_different_steps_are_not_ranked_and_show_their_step(cli, tmp_path):
    """Issue 43, case 2: runs at steps 2 and 3 were compared with no step column, 'best' bolded, delta -3.1."""
    a = _run_at(tmp_path, "stare-o1", 1, {2: 50.0})
    b = _run_at(tmp_path, "grpo-ds", 1, {3: 53.1})
    code, md, err = cli("compare", str(a), str(b), "--format", "md", "--baseline", "grpo-ds")
    assert code == 0, err
    assert "| step |" in md and "| 2 |" in md and "| 3 |" in md
    assert "**" not in md and "+" not in md.split("| STARE-O1")[1].split("\n")[0].replace("step", "")
    assert "No Δ for STARE-O1" in md and "step 3/2" in md
    # at one step (--step 2 where both evaluated) the two compare, with a delta
    _ev(b / "eval" / "step-000002", 50.0, bench="toy:arith", model=f"{b}@step-2", seed=1, problems=64, limit=64,
        paper=False)
    js = _json(cli, a, b, extra=("--step", "2", "--baseline", "grpo-ds"))
    assert [r["step"] for r in js["rows"]] == ["2", "2"] and js["no_delta"] == []
    assert [r["delta_avg"] for r in js["rows"]] == [0.0, 0.0]
    code, _, err = cli("compare", str(a), str(b), "--step", "7")
    assert code == 1 and "no evaluation at step 7" in err and "evaluated at steps 2" in err


def test_a_run_row_is_its_own_evaluation_not_an_ad_hoc_one(cli, tmp_path):
    """Issue 43, case 3: an ad-hoc `stare eval` of a checkpoint (16 problems, seed 0) written under the run's
    eval/ folder later replaced the run's own evaluation (64 problems, seed 1)."""
    run = _run_at(tmp_path, "grpo-ds", 1, {3: 41.0})
    _ev(run / "eval" / "step-3", 12.5, bench="toy:arith", model=str(run / "checkpoints" / "step-3"), seed=0,
        problems=16, limit=16)
    js = _json(cli, run)
    # the run's row is its own evaluation; the ad-hoc one (another model path, 16 problems) is a row of its own,
    # never pooled with it or put in its place
    (row,) = [r for r in js["rows"] if r["label"] == "GRPO-ds"]
    assert row["cells"]["toy:arith"]["mean"] == 41.0 and row["identity"]["toy:arith"]["problems"] == 64
    (adhoc,) = [r for r in js["rows"] if r["label"] != "GRPO-ds"]
    assert adhoc["cells"]["toy:arith"]["mean"] == 12.5 and adhoc["identity"]["toy:arith"]["problems"] == 16


def test_a_repeated_seed_replaces_never_adds(cli, tmp_path):
    """Issue 43, case 5: 2 seeds, then `--seed 1` again, showed '3 seeds'."""
    a = _ev(tmp_path / "first", 40.0, seed=1)
    _ev(tmp_path / "first2", 44.0, seed=2)
    again = _ev(tmp_path / "again", 42.0, seed=1)
    js = _json(cli, a, tmp_path / "first2", again)
    (row,) = js["rows"]
    assert row["cells"]["math500"]["seeds"] == 2 and row["cells"]["math500"]["mean"] == 43.0  # (44 + 42) / 2
    assert "seed 1 appears twice" in js["seeds_replaced"][0]


def test_intervals_over_seeds_are_a_range_for_two_and_a_t_interval_for_more(cli, tmp_path):
    """Issue 43, case 6: over 2 seeds the '95% interval' was a bootstrap of two values (their min and max)."""
    paths = [_ev(tmp_path / f"s{i}", v, seed=i) for i, v in enumerate((40.0, 44.0))]
    js = _json(cli, *paths)
    assert js["rows"][0]["cells"]["math500"]["ci95"] == [40.0, 44.0] and js["intervals"] == ["range"]
    paths.append(_ev(tmp_path / "s2", 48.0, seed=2))
    js = _json(cli, *paths)
    # mean 44, s = 4, t_{0.975, 2} = 4.303: 44 +- 4.303 * 4 / sqrt(3) = 44 +- 9.937
    lo, hi = js["rows"][0]["cells"]["math500"]["ci95"]
    assert lo == pytest.approx(44 - 9.9374, abs=1e-3) and hi == pytest.approx(44 + 9.9374, abs=1e-3)
    assert js["intervals"] == ["t95"]
    md = cli("compare", *map(str, paths), "--format", "md", "--ci")[1]
    assert "Intervals: 95% t-interval over 3+ seeds" in md


def test_a_non_paper_protocol_beside_the_paper_rows_is_marked(cli, tmp_path):
    """Issue 43, case 7: AIME24 at n=1 and 8 tokens (`paper_protocol: false`) sat beside the paper's rows."""
    a = _ev(tmp_path / "a", 10.0, bench="aime24", n=1, problems=30, max_tokens=8, paper=False)
    code, md, err = cli("compare", str(a), "--format", "md", "--paper", "short-cot/qwen2.5-math-7b")
    assert code == 0, err
    (row,) = [ln for ln in md.splitlines() if ln.startswith("| m ")]
    assert row.startswith("| m ") and "‡ |" in row.split("|")[1] + "|"
    assert "‡ not the paper's protocol" in md and "N=1" in md and "max=8" in md
    # without the paper's rows there is nothing to mark it against
    assert "‡" not in cli("compare", str(a), "--format", "md")[1]


def test_a_piped_table_does_not_cut_names(cli, tmp_path):
    """Issue 44, item 8: piped tables were cut at rich's assumed 80 columns ('words:add-…')."""
    name = "a-model-with-a-rather-long-name-that-needs-more-than-eighty-columns-in-total"
    js = _ev(tmp_path / "a", 50.0, model=name)
    code, out, err = cli("compare", str(js))  # the default table format; stdout is not a terminal here
    assert code == 0, err
    assert name in out and "…" not in out


def test_a_short_runs_plot_has_whole_step_ticks_and_says_it_is_unsmoothed(tmp_path, monkeypatch):
    """The walk-through of issue 44: a 2-step run's panels were ticked 1.0, 1.2, ..., 2.0."""
    from stare_cli.analysis import plots

    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, base: figs.append(fig) or [])
    rows = [{"step": 0, "eval/words:add-sub/acc": 0.21},
            {"step": 1, "entropy": 0.516, "reward": 0.281, "eval/words:add-sub/acc": None},
            {"step": 2, "entropy": 0.458, "reward": 0.25, "eval/words:add-sub/acc": 0.406}]
    plots.plot_dynamics({"stare-o1": [rows]}, tmp_path / "d", h_tgt=0.45)
    for ax in figs[0].axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    labels = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert labels == ["stare-o1 (each step, unsmoothed)", "H_tgt = 0.45"]


def test_stares_selected_share_and_gate_get_a_panel_when_a_run_logged_them(tmp_path, monkeypatch):
    """Issue 48 asks for the gate and the selected share over training: a panel of L+'s share with an x
    at each step the gate was on, only where a STARE run logged it."""
    from stare_cli.analysis import plots

    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, base: figs.append(fig) or [])
    stare = [{"step": s, "entropy": 0.5, "stare/sel_pos": 0.02 + 0.001 * s, "stare/gate": float(s in (2, 3))}
             for s in range(1, 5)]
    grpo = [{"step": s, "entropy": 0.5} for s in range(1, 5)]
    plots.plot_dynamics({"stare-o1": [stare], "grpo-ds": [grpo]}, tmp_path / "d")
    ax = next(a for a in figs[0].axes if a.get_title() == plots.STARE_PANEL[1])
    (gate,) = ax.collections  # one scatter: the gate-on steps of the one STARE run
    assert [tuple(p) for p in gate.get_offsets()] == [(2, 0.022), (3, 0.023)]
    assert [k for k, _ in plots.dynamics_panels({"grpo-ds": [grpo]})] == ["entropy", "reward", "full_solve", "len/mean"]


def test_a_difference_with_a_field_one_side_lacks_reads_as_a_dash():
    """The walk-through of issue 44: a run's step-2 evaluation beside the model's own evaluation was
    explained as 'step 2/None'."""
    from stare_cli.analysis.compare import _differences, make_identity

    run = make_identity(n=2, temperature=0.6, top_p=1.0, template="short", max_tokens=64, partial=True, step=2)
    model = make_identity(n=2, temperature=0.6, top_p=1.0, template="short", max_tokens=64, partial=True)
    assert _differences([run, model]) == ["step 2/-"]


def test_the_compare_dynamics_plot_starts_its_evaluation_panel_at_step_0(tmp_path, monkeypatch):
    """Issue 44, item 2, seen again in issue 48's interim plot: `stare compare --plot` drew a run's
    evaluations from its first training-step evaluation (15); the step-0 one lives only under eval/."""
    from stare_cli.analysis import compare, plots
    from stare_cli.core.runs import with_eval_points

    run = tmp_path / "run"
    for step, avg in ((0, 5.3), (15, 12.0)):
        d = run / "eval" / f"step-{step:06d}" / "words:two-step"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"benchmark": "words:two-step",
                                                    "settings": {"model": f"{run}@step-{step}"},
                                                    "metrics": {"n": 32, "avg@32": avg, "len/mean": 60.0}}))
    rows = [{"step": s, "entropy": 0.5} for s in range(1, 16)]
    rows[-1]["eval/words:two-step/acc"] = 0.12
    # step 0 comes from eval/ (no metrics row holds it); step 15's row already has its evaluation
    assert with_eval_points(run, rows)[0] == {"step": 0, "eval/words:two-step/acc": 0.053, "eval/words:two-step/len": 60.0}
    assert len(with_eval_points(run, rows)) == 16
    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, base: figs.append(fig) or [])
    monkeypatch.setattr(compare, "passk_plot", lambda results, d: [])
    compare.write_plots([compare.Result("grpo-ds", 1, str(run), metrics={}, metrics_rows=rows)], tmp_path / "p", h_tgt=0.45)
    panel = figs[0].axes[-1]
    assert panel.get_title() == "evaluation accuracy (words:two-step)"
    assert list(panel.lines[0].get_xdata()) == [0, 15] and list(panel.lines[0].get_ydata()) == [0.053, 0.12]


def test_delta_is_paired_by_seed_with_an_interval_where_both_rows_have_the_same_seeds(cli, tmp_path):
    """Issue 48 asks for end-of-training differences paired by seed, with intervals."""
    grpo = [_run_at(tmp_path, "grpo-ds", s, {3: v}) for s, v in ((1, 40.0), (2, 41.0), (3, 45.0))]
    stare = [_run_at(tmp_path, "stare-o1", s, {3: v}) for s, v in ((1, 42.0), (2, 44.0), (3, 46.0))]
    js = _json(cli, *grpo, *stare, extra=("--baseline", "grpo-ds"))
    row = next(r for r in js["rows"] if r["label"] == "STARE-O1")
    # per-seed differences 2, 3, 1: mean 2.0, sample std 1.0; t(0.975, 2 df) = 4.303, half-width
    # 4.303 * 1.0 / sqrt(3) = 2.484 -> [-0.48, 4.48]. The mean difference equals the difference of the
    # means (44.0 - 42.0).
    assert row["delta_avg"] == pytest.approx(2.0) and row["delta_paired_seeds"] == 3
    assert row["delta_avg_ci95"] == pytest.approx([2.0 - 4.303 / 3 ** 0.5, 2.0 + 4.303 / 3 ** 0.5], abs=1e-3)
    base = next(r for r in js["rows"] if r["label"] == "GRPO-ds")
    assert base["delta_avg"] == 0.0 and "delta_avg_ci95" not in base
    code, md, err = cli("compare", *map(str, grpo + stare), "--format", "md", "--ci", "--baseline", "grpo-ds")
    assert code == 0, err
    assert "| +2.0 [-0.5, +4.5] |" in md.split("| STARE-O1")[1].split("\n")[0]
    assert "Δ intervals: paired by seed (95% t-interval of the per-seed differences from the baseline): " \
           "STARE-O1: seeds 1, 2, 3" in md
    code, csv_text, _ = cli("compare", *map(str, grpo + stare), "--format", "csv", "--ci", "--baseline", "grpo-ds")
    head, *lines = csv_text.splitlines()
    stare_line = dict(zip(head.split(","), next(ln for ln in lines if ln.startswith("STARE-O1")).split(",")))
    assert (stare_line["Δ Avg"], stare_line["Δ Avg CI low"], stare_line["Δ Avg CI high"]) == ("2.0", "-0.5", "4.5")
    # seeds that differ (STARE-O1 without seed 3): a Δ of the means, no paired interval, and the note says why
    code, md, _ = cli("compare", *map(str, grpo + stare[:2]), "--format", "md", "--ci", "--baseline", "grpo-ds")
    line = md.split("| STARE-O1")[1].split("\n")[0]
    assert "| +1.0 |" in line  # (42 + 44) / 2 - (40 + 41 + 45) / 3 = 43.0 - 42.0
    assert "No Δ interval where the two rows have different seeds: STARE-O1 (seeds 1, 2; GRPO-ds: seeds 1, 2, 3)" in md
