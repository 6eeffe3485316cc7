"""Evaluation that never reports a wrong number (issue 30): each case failed on the code before it.

The shipped toy model (hash-checked: the same weights everywhere) answers toy arithmetic written as
a MATH-500 file, so our grader and the official one disagree on real samples."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks.data.toy import problems


def _data(path: Path, n: int = 16, seed: int = 5, wrong_gold: int = -1, fractions: bool = False) -> Path:
    """Toy problems as a MATH-500 file; `fractions`: golds written as \\frac{2a}{2}, which our grader
    equates with a boxed integer and the official one (mathruler) does not."""
    rows = problems(n, seed)
    if wrong_gold >= 0:
        rows[wrong_gold] = {**rows[wrong_gold], "answer": str(int(rows[wrong_gold]["answer"]) + 1)}
    if fractions:
        rows = [{**r, "answer": f"\\frac{{{2 * int(r['answer'])}}}{{2}}"} for r in rows]
    path.write_text("".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n" for r in rows))
    return path


def _eval(cli, data: Path, out: Path, *extra: str) -> dict:
    code, text, err = cli("eval", "--bench", "math500", "--data-file", str(data), "--model", "toy:arith",
                          "--template", "raw", "-n", "2", "--max-tokens", "56", "--out", str(out), "--workers", "0",
                          "--json", *extra)
    assert code == 0, err[-1500:]
    return json.loads(text)["math500"]


def _results(out: Path) -> dict:
    return json.loads((out / "math500" / "results.json").read_text())


def test_a_rerun_after_a_regrade_reports_its_own_graders_numbers(cli, tmp_path):
    data, out = _data(tmp_path / "d.jsonl", fractions=True), tmp_path / "r1"
    first = _eval(cli, data, out)
    per_grader = sorted((out / "math500" / "results").glob("*-math-verify.json"))
    saved = per_grader[0].read_text()
    code, text, err = cli("eval", "--regrade", str(out), "--grader", "stare-official", "--workers", "0", "--json")
    assert code == 0, err
    official = json.loads(text)["math500"]
    assert official["avg@2"] != first["avg@2"]  # the graders disagree on these samples: the case is real
    again = _eval(cli, data, out)
    assert again["avg@2"] == first["avg@2"] and _results(out)["grader"].startswith("math-verify@")
    assert json.loads(per_grader[0].read_text())["metrics"] == json.loads(saved)["metrics"]
    rows = [json.loads(x) for x in (out / "math500" / "samples.jsonl").read_text().splitlines()]
    assert all(r["grader"].startswith("math-verify@") for r in rows)  # top level refreshed to this grader


def test_another_data_file_or_a_corrected_gold_gets_its_own_samples(cli, tmp_path):
    out = tmp_path / "ev"
    a = _eval(cli, _data(tmp_path / "a.jsonl", seed=5), out)
    res_a = _results(out)
    b = _eval(cli, _data(tmp_path / "b.jsonl", seed=6), out)
    res_b = _results(out)
    assert res_a["data"]["sha256"] != res_b["data"]["sha256"] and res_a["key"] != res_b["key"]
    assert res_b["data"]["source"] == f"file:{(tmp_path / 'b.jsonl').resolve()}"
    rows = [json.loads(x) for x in (out / "math500" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 16 * 2 and {r["gold"] for r in rows if r["key"] == res_b["key"]} == {
        json.loads(x)["answer"] for x in (tmp_path / "b.jsonl").read_text().splitlines()}
    # a corrected gold (the same file name, one answer changed) is new data: graded against the new gold
    fixed = _eval(cli, _data(tmp_path / "a.jsonl", seed=5, wrong_gold=0), out)
    assert _results(out)["data"]["sha256"] not in (res_a["data"]["sha256"], res_b["data"]["sha256"])
    assert (a["problems"], b["problems"], fixed["problems"]) == (16, 16, 16)


def test_regrade_refuses_a_damaged_samples_file_and_changes_nothing(cli, tmp_path):
    out = tmp_path / "ev"
    _eval(cli, _data(tmp_path / "d.jsonl", n=8), out)
    f = out / "math500" / "samples.jsonl"
    lines = f.read_text().splitlines()
    lines[3] = lines[3][:40]  # a damaged line in the middle
    f.write_text("\n".join(lines) + "\n")
    before = f.read_bytes()
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "mathruler", "--workers", "0")
    assert code == 1 and f"{f}:4: not a JSON object" in err and len(err.strip().splitlines()) == 1
    assert f.read_bytes() == before
    f.write_text("garbage\n")
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "mathruler", "--workers", "0")
    assert code == 1 and f"{f}:1: not a JSON object" in err and f.read_text() == "garbage\n"


def test_a_subset_of_a_benchmark_is_recorded_and_never_the_papers_protocol(cli, tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    _data(folder / "math500.jsonl", n=6)
    monkeypatch.setenv("STARE_DATA_DIR", str(folder))
    code, text, err = cli("eval", "--bench", "math500", "--model", "toy:arith", "--template", "raw", "-n", "4",
                          "--temperature", "1.0", "--top-p", "0.7", "--max-tokens", "56", "--out", str(tmp_path / "ev"),
                          "--workers", "0", "--json")  # the paper's n, temperature and top_p: only the data differ
    assert code == 0, err
    res = _results(tmp_path / "ev")
    assert res["data"] == {"source": f"file:{(folder / 'math500.jsonl').resolve()}", "sha256": res["data"]["sha256"],
                           "problems": 6, "reference_problems": 500, "partial": True}
    assert res["protocol"]["paper_protocol"] is False
    from stare_cli.analysis.compare import build_rows, load_inputs

    rows, _ = build_rows(load_inputs([tmp_path / "ev"]), benches=("math500",))
    assert rows[0].flagged and "limited" in rows[0].note


def test_result_files_follow_the_umask(cli, tmp_path):
    old = os.umask(0o022)
    try:
        _eval(cli, _data(tmp_path / "d.jsonl", n=2), tmp_path / "ev")
    finally:
        os.umask(old)
    for name in ("results.json", "samples.jsonl"):
        mode = stat.S_IMODE((tmp_path / "ev" / "math500" / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))
    assert stat.S_IMODE((tmp_path / "ev" / "summary.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("mask", [0o077, 0o002])
def test_atomic_writes_take_the_umask_in_force(tmp_path, mask):
    import subprocess
    import sys

    code = ("import os, sys; os.umask(int(sys.argv[1], 8)); from pathlib import Path; "
            "from stare_cli.core.runs import atomic_write_text; atomic_write_text(Path(sys.argv[2]), 'x')")
    subprocess.run([sys.executable, "-c", code, oct(mask)[2:], str(tmp_path / "f")], check=True)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o666 & ~mask


def test_agreement_pairs_two_evaluations_of_the_same_problems(cli, tmp_path):
    data = _data(tmp_path / "d.jsonl", n=8)
    _eval(cli, data, tmp_path / "a", "--temperature", "0")
    _eval(cli, data, tmp_path / "b", "--temperature", "0")  # greedy twice: the same responses
    _eval(cli, data, tmp_path / "c", "--temperature", "1.0", "--seed", "3")
    code, text, err = cli("grade", "agreement", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert code == 0, err
    m = json.loads(text)["benchmarks"]["math500"]
    assert (m["pairs"], m["identical"]) == (16, 1.0) and m["first_divergence"] == []
    assert m["common_prefix_chars"] == m["mean_chars"][0] and m["accuracy"][0]["avg"] == m["accuracy"][1]["avg"]
    code, text, _ = cli("grade", "agreement", str(tmp_path / "a"), str(tmp_path / "c"), "--json")
    m = json.loads(text)["benchmarks"]["math500"]
    assert m["identical"] < 1 and m["first_divergence"] and m["common_prefix_chars"] < m["mean_chars"][0]
    code, _, err = cli("grade", "agreement", str(tmp_path / "a"), str(tmp_path / "nothing"))
    assert code == 1 and "share no benchmark folder" in err


def test_a_corrupt_results_file_or_a_row_without_its_key_is_named(cli, tmp_path):
    out = tmp_path / "ev"
    _eval(cli, _data(tmp_path / "d.jsonl", n=2), out)
    f = out / "math500" / "samples.jsonl"
    rows = f.read_text().splitlines()
    row = json.loads(rows[1])
    del row["key"]
    f.write_text("\n".join([rows[0], json.dumps(row), *rows[2:]]) + "\n")
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "mathruler", "--workers", "0")
    assert code == 1 and f"{f}:2: no 'key' field" in err and len(err.strip().splitlines()) == 1
    (out / "math500" / "results.json").write_text("{not json")
    code, _, err = cli("compare", str(out))
    assert code == 1 and f"{out / 'math500' / 'results.json'}: unreadable results file" in err
