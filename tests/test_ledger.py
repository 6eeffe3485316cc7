"""The ledger (issue 67): one immutable record per evaluation with its full identity, one reader, one grouping.

The property tests build pairs of records that differ in exactly one identity field, for every field, and
check that no output pools them: every table format of `stare compare`, the pass@k curves behind its plot,
the sweep's evaluation summary, grade audit's entries and `--baseline`; and that records differing only in
the seed do pool. The hand-made cases below them each reproduce one of the issue's eleven findings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stare_kernel.errors import StareError
from stare_kernel.ledger import IDENTITY_FIELDS, LEDGER, ROW_FIELDS, Record, group, pool_key, write_record
from stare_kernel.reader import find_records

BASE = {
    "ledger": LEDGER, "benchmark": "math500", "benchmark_version": "1", "weights": "sha256:" + "a" * 64,
    "method": None, "method_params": None, "recipe": None, "step": None, "lr": None, "data": "d" * 64,
    "problems": 500, "partial": False, "n": 4, "temperature": 0.6, "top_p": 1.0, "max_tokens": 3072,
    "template": "paper", "chat": True, "prompt": "sha256:" + "p" * 64, "tools": None, "grader": "math-verify@7",
    "engine": "hf@transformers 5.10", "dtype": None,
}


def _metrics(avg: float, n: int = 4) -> dict:
    return {"n": n, "problems": 500, f"avg@{n}": avg, "pass@1": avg, "pass@2": min(100.0, avg + 5),
            f"pass@{n}": min(100.0, avg + 10), f"maj@{n}": avg, "len/mean": 100.0, "truncated": 0.0}


def _record(folder: Path, identity: dict, avg: float, seed: int = 0, written: str = "2026-12-06T00:00:00") -> Record:
    rec = Record(identity=identity, metrics=_metrics(avg, identity.get("n") if isinstance(identity.get("n"), int)
                                                      and identity.get("n") > 0 else 4),
                 seed=seed, samples_key=f"k{seed}", written=written, model_path="m")
    write_record(folder / identity["benchmark"].replace(":", "-"), rec)
    return rec


# A second value for each identity field (the first is BASE's): hypothesis draws among several per field.
OTHER = {
    "ledger": st.just(0), "benchmark": st.sampled_from(["aime24", "toy:arith"]),
    "benchmark_version": st.sampled_from(["2", "unknown"]),
    "weights": st.sampled_from(["sha256:" + "b" * 64, "trained", "hub:Qwen/Qwen2.5-Math-7B"]),
    "method": st.sampled_from(["grpo-ds", "stare-o1"]), "method_params": st.sampled_from(["0123456789ab", "unknown"]),
    "recipe": st.sampled_from(["ba9876543210", "unknown"]), "step": st.integers(0, 500),
    "lr": st.floats(1e-7, 1e-3), "data": st.sampled_from(["e" * 64, "unknown"]), "problems": st.integers(1, 499),
    "partial": st.just(True), "n": st.sampled_from([1, 2, 8, 32]), "temperature": st.sampled_from([0.0, 1.0]),
    "top_p": st.sampled_from([0.7, 0.95]), "max_tokens": st.integers(1, 3071),
    "template": st.sampled_from(["raw", "short", "r1"]), "chat": st.sampled_from([False, "unknown"]),
    "prompt": st.sampled_from(["sha256:" + "q" * 64, "unknown"]), "tools": st.just("python"),
    "grader": st.sampled_from(["math-verify@8", "stare-official@1", "mathruler@1"]),
    "engine": st.sampled_from(["vllm@vllm 0.27.1", "lm-eval-hf@lm-eval 0.4.9", "hf@transformers 5.9"]),
    "dtype": st.sampled_from(["bfloat16", "float32"]),
}
assert set(OTHER) == set(IDENTITY_FIELDS)  # a field added to the identity must be added here too


def _pair(tmp: Path, field: str, value) -> tuple[dict, dict]:
    a = dict(BASE)
    b = {**BASE, field: value}
    _record(tmp / "one", a, 40.0, seed=1)
    _record(tmp / "two", b, 60.0, seed=2)
    return a, b


def _outputs(paths: list[Path]) -> dict:
    """What every output makes of `paths`: rows of each table format, the curves of each benchmark, the sweep's
    evaluation keys per cell, and grade audit's entry names."""
    from stare_cli.analysis import compare as C
    from stare_cli.analysis.sweep import _keyed

    results = C.load_inputs(paths)
    cols = C.columns(results, with_paper=False)
    rows, info = C.build_rows(results, "avg", cols)
    out = {"rows": rows, "info": info, "results": results}
    for fmt in ("md", "latex", "csv", "json"):
        out[fmt] = C.render(rows, info, fmt, {}, cols)
    out["curves"] = {b: C.passk_curves(results, b) for b in cols}
    found = find_records(paths).records
    out["sweep"] = _keyed({"cell-a": [r for r in found if r.seed == 1], "cell-b": [r for r in found if r.seed == 2]})
    return out


def _table_rows(text: str, fmt: str) -> int:
    if fmt == "json":
        return len(json.loads(text)["rows"])
    if fmt == "csv":
        return sum(1 for ln in text.splitlines()[1:] if ln and not ln.startswith("#"))
    if fmt == "md":
        return sum(1 for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| Method"))
    return sum(1 for ln in text.splitlines() if ln.endswith("\\\\") and not ln.startswith("Method"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_output_pools_two_records_that_differ_in_one_identity_field(tmp_path_factory, data):
    field = data.draw(st.sampled_from(IDENTITY_FIELDS), label="field")
    value = data.draw(OTHER[field], label="value")
    tmp = tmp_path_factory.mktemp("pair")
    a, b = _pair(tmp, field, value)
    assert pool_key(a) != pool_key(b)
    assert len(group(find_records([tmp]).records)) == 2  # the one grouping
    out = _outputs([tmp])
    # tables: two rows (or, for another benchmark, two columns of one row each holding one result), one seed each
    cells = [(r.label, b, c) for r in out["rows"] for b, c in r.cells.items() if c is not None]
    assert len(cells) == 2 and all(c[2] == 1 for _, _, c in cells), (field, value, cells)
    if field != "benchmark":
        for fmt in ("md", "latex", "csv", "json"):
            assert _table_rows(out[fmt], fmt) == 2, (fmt, out[fmt])
        assert len(out["rows"]) == 2 and out["rows"][0].label != out["rows"][1].label  # named apart
    # curves: one per record, no interval (one seed each)
    curves = [c for per in out["curves"].values() for c in per.values()]
    assert len(curves) == 2 and all(not c.lo for c in curves)
    # the sweep's evaluation keys: two cells of one method pair only under one key; these never share one
    if field not in ("method",):  # cells of two methods are two methods' rows in a sweep, by construction
        assert set(out["sweep"]["cell-a"]).isdisjoint(out["sweep"]["cell-b"]), out["sweep"]
    # grade audit: one entry per setting, never two settings under one name
    from benchmarks.evaluation.audit import setting_names

    recs = sorted(find_records([tmp]).records, key=lambda r: r.seed)
    assert len(set(setting_names([(Path(r.folder.name), r.samples_key, r) for r in recs]))) == 2
    # --baseline: a method whose two records differ gets no single baseline row (never their mean)
    from stare_cli.analysis import compare as C

    if field not in ROW_FIELDS and field != "benchmark":
        rows = out["rows"]
        for r in rows:
            r.label = "grpo-ds" + r.label[1:] if r.label.startswith("m") else r.label
        with pytest.raises(StareError, match="differ in more than the seed|no row for baseline"):
            C.add_delta(rows, "grpo-ds", {})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seeds=st.lists(st.integers(0, 1000), min_size=2, max_size=4, unique=True),
       values=st.lists(st.floats(0, 100), min_size=4, max_size=4))
def test_records_that_differ_only_in_the_seed_pool(tmp_path_factory, seeds, values):
    tmp = tmp_path_factory.mktemp("seeds")
    for i, sd in enumerate(seeds):
        _record(tmp / f"s{i}", dict(BASE), values[i], seed=sd)
    (g,) = group(find_records([tmp]).records)
    assert sorted(g.seeds) == sorted(map(str, seeds))
    from stare_cli.analysis import compare as C

    results = C.load_inputs([tmp])
    rows, info = C.build_rows(results, "avg", ("math500",))
    (row,) = rows
    mean = sum(values[: len(seeds)]) / len(seeds)
    # fmean over the seeds: the same float sum in another order at most; 1e-9 of a value below 100
    assert row.cells["math500"][2] == len(seeds) and abs(row.cells["math500"][0] - mean) <= 1e-9
    (curve,) = C.passk_curves(results, "math500").values()
    assert curve.lo  # pooled: a mean with an interval


# ------------------------------------------------------------------------------------- the record itself
def test_a_record_is_written_once_and_never_replaced(tmp_path):
    rec = _record(tmp_path, dict(BASE), 40.0, seed=3)
    path = tmp_path / "math500" / "records" / f"{rec.id}.json"
    before = path.read_text()
    write_record(tmp_path / "math500", rec)  # the same identity and seed again: the same result, nothing written
    assert path.read_text() == before
    other = Record(identity=dict(BASE), metrics=_metrics(41.0), seed=3, samples_key="k3", written="later")
    with pytest.raises(StareError, match="exists with other metrics"):
        write_record(tmp_path / "math500", other)
    assert path.read_text() == before
    # another identity gets a file of its own beside it
    _record(tmp_path, {**BASE, "n": 8}, 41.0, seed=3)
    assert len(list((tmp_path / "math500" / "records").glob("*.json"))) == 2


def test_the_reader_finds_every_record_under_any_mix_of_paths_and_names_what_it_leaves_out(tmp_path):
    """Issue 67, item 2: `stare compare SWEEP_DIR` printed one row of twelve."""
    for i in range(12):
        _record(tmp_path / "sweep" / "cells" / f"c{i}" / "run" / "eval" / "step-000004", dict(BASE), float(i), seed=i)
    for p in ([tmp_path / "sweep"], [tmp_path / "sweep" / "cells"], [tmp_path],
              [tmp_path / "sweep", tmp_path / "sweep" / "cells" / "c0"]):  # overlapping paths: each record once
        assert len(find_records(p).records) == 12, p
    # a legacy results.json beside a record of the same setting is a copy: named in a note, not a second row
    folder = tmp_path / "sweep" / "cells" / "c0" / "run" / "eval" / "step-000004" / "math500"
    (folder / "results.json").write_text(json.dumps({
        "benchmark": "math500", "key": "k0", "grader": BASE["grader"], "metrics": _metrics(0.0),
        "settings": {"model": "m", "seed": 0}, "protocol": {"n": 4, "temperature": 0.6, "top_p": 1.0,
                                                            "template": "paper", "max_tokens": 3072}}))
    found = find_records([tmp_path])
    assert len(found.records) == 12 and any("results.json" in n for n in found.notes)


def test_an_older_results_file_reads_its_missing_fields_as_unknown_and_never_pools_with_a_record(tmp_path):
    _record(tmp_path / "new", dict(BASE), 40.0, seed=1)
    d = tmp_path / "old" / "math500"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({
        "benchmark": "math500", "grader": BASE["grader"], "metrics": _metrics(50.0),
        "settings": {"model": "m", "seed": 2, "engine": "hf"},
        "protocol": {"n": 4, "temperature": 0.6, "top_p": 1.0, "template": "paper", "max_tokens": 3072}}))
    recs = find_records([tmp_path]).records
    old = next(r for r in recs if r.legacy)
    assert old.identity["ledger"] == 0 and old.identity["weights"] == "unknown" and old.identity["prompt"] == "unknown"
    assert len(group(recs)) == 2


def test_a_superseded_record_is_named_not_shown(tmp_path):
    a = _record(tmp_path, dict(BASE), 40.0, seed=1)
    b = Record(identity={**BASE, "data": "f" * 64}, metrics=_metrics(45.0), seed=1, samples_key="k9",
               written="2026-12-07T00:00:00", supersedes=(a.id,), model_path="m")
    write_record(tmp_path / "math500", b)
    found = find_records([tmp_path])
    assert [r.id for r in found.records] == [b.id]
    assert any(n.startswith("superseded: ") and a.id in n for n in found.notes)


def test_a_weights_digest_changes_when_weights_change_in_place(tmp_path):
    """Issue 67, item 4: samples were keyed by the model's path, so new weights copied into the folder were
    reported as the old weights' number ("64 already on disk")."""
    import os

    from benchmarks.evaluation.evaluate import EvalSettings, weights_digest

    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    (tmp_path / "config.json").write_text("{}")
    first = weights_digest(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 64)  # the same size: only the bytes differ
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    second = weights_digest(str(tmp_path))
    assert first != second and first.startswith("sha256:")
    s = EvalSettings(model=str(tmp_path), bench="math500", template="paper", n=4, temperature=0.6, top_p=1.0,
                     max_tokens=64, seed=0, engine="hf")
    from dataclasses import replace

    assert replace(s, weights=first).key() != replace(s, weights=second).key()
    assert weights_digest("Qwen/Qwen2.5-Math-7B") == "hub:Qwen/Qwen2.5-Math-7B"


def test_a_verl_runs_validations_are_records_of_each_step_and_compare_picks_the_step(cli, tmp_path):
    """A verl run's evaluations are its validation metrics (metrics.jsonl's val-core/<bench>/acc/mean@N): one
    record per benchmark and step; a row is the run's last validated step, or --step."""
    import yaml

    run = tmp_path / "verl-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "x", "method": {"name": "grpo-ds"}, "optim": {"seed": 3},
                                                     "backend": {"name": "verl"}, "eval": {"temperature": 1.0,
                                                     "top_p": 0.7}, "rollout": {"max_response_tokens": 64}}))
    (run / "meta.json").write_text("{}")
    rows = [{"step": 1, "lr": 1e-6}, {"step": 2, "lr": 1e-6, "val-core/aime24/acc/mean@4": 0.25},
            {"step": 4, "lr": 1e-6, "val-core/aime24/acc/mean@4": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = find_records([run]).records
    assert sorted((r.identity["step"], r.metrics["avg@4"]) for r in recs) == [(2, 25.0), (4, 50.0)]
    assert all(r.identity["ledger"] == 0 and r.seed_name == "3" for r in recs)
    js = json.loads(cli("compare", str(run), "--format", "json")[1])
    (row,) = js["rows"]
    assert row["cells"]["aime24"]["mean"] == 50.0 and row["step"] == "4"
    js = json.loads(cli("compare", str(run), "--step", "2", "--format", "json")[1])
    assert js["rows"][0]["cells"]["aime24"]["mean"] == 25.0
    code, _, err = cli("compare", str(run), "--step", "3")
    assert code == 1 and "no evaluation at step 3 (evaluated at steps 2, 4)" in err
