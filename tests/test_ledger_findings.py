"""Issue 67's eleven findings, each tried as the issue wrote it, through the real CLI: every one printed a
wrong number or a silent merge with exit 0 before the ledger (tests/test_ledger.py holds the properties)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from stare_kernel.ledger import LEDGER, Record, write_record

from test_ledger import BASE, _metrics
from test_sweep import FAST


def _run(root: Path, method: str, seed: int, evals: dict[int, float], gate: float = 1.0, lr: float = 1e-6,
         bench: str = "math500", total_steps: int = 100, **ident) -> Path:
    """A run directory as `stare train` writes it, its own evaluations as the trainer's records:
    {step: avg}; `gate`: the stare/gate value logged at every step (0: STARE's gate never opened); `lr`: the
    learning rate logged at each step (the recipe's optim.lr is 1e-6 whatever it is: a schedule's doing)."""
    run = root / f"r__{method}__seed{seed}__{len(list(root.glob('r__*'))) if root.exists() else 0}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "x", "method": {"name": method, "stare": {"h_tgt": 0.3}},
                                                     "optim": {"seed": seed, "lr": 1e-6, "schedule": "cosine",
                                                               "total_steps": total_steps}}))
    (run / "meta.json").write_text("{}")
    last = max(evals)
    rows = [{"step": s, "lr": lr, "entropy": 0.4, "stare/gate": gate} for s in range(1, last + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, avg in evals.items():
        identity = {**BASE, "benchmark": bench, "weights": "trained", "method": method, "method_params": "mp",
                    "recipe": "rc", "step": step, "lr": lr if step else None, **ident}
        rec = Record(identity=identity, metrics=_metrics(avg, identity["n"]), seed=seed, train_seed=seed,
                     samples_key=f"k{step}", written=f"2026-12-06T00:00:{step:02d}", model_path=f"{run}@step-{step}",
                     run={"dir": str(run), "name": run.name})
        write_record(run / "eval" / f"step-{step:06d}" / bench.replace(":", "-"), rec)
    return run


def _model_record(folder: Path, avg: float, seed: int = 0, bench: str = "math500", **ident) -> None:
    identity = {**BASE, "benchmark": bench, **ident}
    write_record(folder / bench.replace(":", "-"), Record(identity=identity, metrics=_metrics(avg, identity["n"]),
                                                           seed=seed, samples_key=f"m{seed}", model_path="base-model"))


# ------------------------------------------------------------------------------- items 1 and 4 (real CLI)
def test_a_sweeps_extra_evaluation_lands_beside_the_runs_and_its_table_and_report_agree(cli, tmp_path, quick_toy,
                                                                                       monkeypatch):
    """Item 1: `stare sweep ... --eval` wrote into each run's eval/step-000004/ and overwrote the trainer's
    results, so table.md showed step 2 and ranked the methods against the runs' own step-4 evaluations and
    the report. Also `stare eval --model RUN` (no --out) wrote into the run; an --out inside it is refused."""
    out = tmp_path / "sw"
    args = ["sweep", "--recipe", "tiny/arith", "--method", "grpo-ds", "--method", "grpo", "--seed", "1",
            "--parallel", "2", "--out", str(out), "-o", f"model.path={quick_toy}", "--eval", "toy:arith",
            "--eval-n", "2", "--eval-limit", "8"]
    for o in [*FAST, "optim.total_steps=4", "eval.every=2", "checkpoint.every=4", "checkpoint.keep_last=1"]:
        args += ["-o", o]
    code, table, err = cli(*args)
    assert code == 0, err
    cells = {c["method"]: Path(c["run_dir"]) for c in json.loads((out / "sweep.json").read_text())["cells"]}
    for method, run in cells.items():
        # the run's step-4 folder holds the trainer's record alone; the sweep's evaluation is under the sweep
        recs = [json.loads(p.read_text()) for p in (run / "eval" / "step-000004").rglob("records/*.json")]
        assert len(recs) == 1 and recs[0]["model_path"].endswith("@step-4"), recs
        mine = list((out / "evals").glob(f"{method}-seed1/*/records/*.json"))
        assert len(mine) == 1 and json.loads(mine[0].read_text())["identity"]["step"] == 4
    # the table: each run's own evaluation at its last step (4), as the report's step-4 entry says
    summary = json.loads((out / "summary.json").read_text())
    rows = {ln.split(" | ")[0].strip("| *"): ln for ln in table.splitlines() if ln.startswith(("| GRPO-ds", "| GRPO "))}
    assert len(rows) == 2 and all("| 4 | 1 |" in ln for ln in rows.values()), table
    for method, title in (("grpo-ds", "GRPO-ds"), ("grpo", "GRPO")):
        evs = summary["methods"][method]["evaluations"]
        own = next(k for k in evs if k.startswith("toy:arith n=1 step=4"))  # the recipe's own protocol (n=1)
        extra = [k for k in evs if k.startswith("toy:arith n=2 step=4")]
        assert len(extra) == 1, list(evs)  # the --eval evaluation: its own entry, never pooled with the run's
        assert f"{evs[own]['avg@1']['mean']:.1f}" in rows[title], (rows[title], evs[own])
    code, _, err = cli("compare", str(cells["grpo"]), "--step", "4")
    assert code == 0, err
    # a plain `stare eval --model RUN` writes to evals/<run>/<checkpoint>, not into the run
    monkeypatch.chdir(tmp_path)
    run = cells["grpo"]
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", str(run), "-n", "1", "--limit", "8",
                       "--engine", "hf", "--workers", "0")
    assert code == 0, err
    (rec,) = [json.loads(p.read_text()) for p in (tmp_path / "evals" / run.name).rglob("records/*.json")]
    assert rec["identity"]["method"] == "grpo" and rec["identity"]["step"] == 4 and rec["train_seed"] == 1
    assert isinstance(rec["identity"]["lr"], float) and rec["weights_digest"].startswith("sha256:")
    assert len(list((run / "eval").rglob("records/*.json"))) == 3  # steps 0, 2 and 4: the trainer's alone
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", str(run), "-n", "1", "--limit", "8",
                       "--engine", "hf", "--workers", "0", "--out", str(run / "eval" / "mine"))
    assert code == 1 and "inside the run directory" in err and not (run / "eval" / "mine").exists()


def test_a_regrade_with_the_same_grader_grades_corrected_golds_again(cli, tmp_path, quick_toy):
    """Item 9: golds corrected in samples.jsonl were ignored by a regrade with the same grader."""
    out = tmp_path / "ev"
    assert cli("eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "8", "-n", "2", "--out",
               str(out), "--engine", "hf", "--workers", "0")[0] == 0
    bench = out / "toy-arith"
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "math-verify", "--workers", "0")
    assert code == 0 and "golds differ" not in err  # nothing changed: the same record, nothing new
    assert len(list((bench / "records").glob("*.json"))) == 1
    rows = [json.loads(ln) for ln in (bench / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        if r["idx"] == 0:
            r["gold"] = "-987654"  # a corrected gold no sample gives
    (bench / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "math-verify", "--workers", "0")
    assert code == 0 and "1 problems' golds differ" in err, err
    recs = {p.stem: json.loads(p.read_text()) for p in (bench / "records").glob("*.json")}
    assert len(recs) == 2
    new = next(r for r in recs.values() if r["supersedes"])
    old = next(r for r in recs.values() if not r["supersedes"])
    assert new["supersedes"] == [old["id"]] and new["identity"]["data"] != old["identity"]["data"]
    graded = [json.loads(ln) for ln in (bench / "samples.jsonl").read_text().splitlines()]
    assert all(not r["verdicts"][r["grader"]]["correct"] for r in graded if r["idx"] == 0)  # graded again
    js = json.loads(cli("compare", str(out), "--format", "json")[1])
    (row,) = js["rows"]  # the corrected record; the old one named in a note
    assert row["identity"]["toy:arith"]["data"] == new["identity"]["data"]
    assert any(n.startswith("superseded: ") for n in js["notes"])


# ------------------------------------------------------------------------------- items 5, 7, 8, 10, 11
def test_the_paper_protocol_check_covers_max_tokens_and_the_template_and_csv_keeps_the_marks(cli, tmp_path):
    """Items 5 and 7: an AIME24 evaluation at 8 tokens with the raw template stood beside --paper rows
    unmarked, with a Δ against the paper's; CSV dropped the marks and the notes."""
    from benchmarks.data.registry import BENCHMARKS, PAPER_ORDER

    for b in PAPER_ORDER:
        spec = BENCHMARKS[b]
        proto = {"n": spec.n, "temperature": spec.temperature, "top_p": spec.top_p, "max_tokens": spec.max_tokens,
                 "template": spec.template, "problems": spec.size}
        if b == "aime24":
            proto.update(max_tokens=8, template="raw")
        _run_dir = tmp_path / "runs"
        write_record(tmp_path / "ours" / b, Record(
            identity={**BASE, "benchmark": b, **proto, "weights": "trained", "method": "stare-o1", "method_params": "mp",
                      "recipe": "rc", "step": 100, "lr": 1e-6}, metrics=_metrics(50.0, spec.n), seed=1, train_seed=1,
            samples_key="k", model_path="x@step-100", run={"dir": str(_run_dir / "gone"), "name": "gone"}))
    code, md, err = cli("compare", str(tmp_path / "ours"), "--paper", "short-cot/qwen2.5-math-7b", "--baseline",
                        "grpo-ds", "--format", "md")
    assert code == 0, err
    ours = next(ln for ln in md.splitlines() if ln.startswith("| STARE-O1 ") and "(paper)" not in ln)
    assert "‡" in ours and ours.split(" | ")[8] == "–", ours  # marked, and no Δ against the paper's row
    assert "max=8" in md and "raw" in md  # the ‡ note says what differs from the paper's protocol
    assert "not the paper's protocol (aime24: " in md  # the Δ note says why
    code, csv_text, err = cli("compare", str(tmp_path / "ours"), "--paper", "short-cot/qwen2.5-math-7b", "--format", "csv")
    header, *lines = csv_text.splitlines()
    cols = header.split(",")
    row = next(ln for ln in lines if ln.startswith("STARE-O1,"))
    import csv as _csv

    vals = dict(zip(cols, next(_csv.reader([row]))))
    assert vals["marks"] == "‡" and "not the paper's protocol" in vals["notes"]
    assert vals["identity.max_tokens"].startswith("aime24=8;") and vals["identity.method"] == "stare-o1"


def test_learning_rate_schedules_and_seeds_are_never_pooled_or_left_out_of_the_footnote(cli, tmp_path):
    """Items 8 and 10: runs whose learning rates differ at the step pooled as seeds; a base model's seed-0
    evaluation beside a run's seed-1 one had every differing setting in the footnote but the seed."""
    # one recipe, a cosine schedule over 4 and over 8 steps (optim.total_steps is not part of a row's identity):
    # at step 2 the learning rates differ, so the weights are not seeds of one thing
    a = _run(tmp_path / "runs", "grpo-ds", 1, {2: 40.0}, lr=1e-6, total_steps=4)
    b = _run(tmp_path / "runs", "grpo-ds", 2, {2: 50.0}, lr=5e-7, total_steps=8)
    js = json.loads(cli("compare", str(a), str(b), "--format", "json")[1])
    assert sorted(r["label"] for r in js["rows"]) == ["GRPO-ds [lr=1e-06]", "GRPO-ds [lr=5e-07]"]
    _model_record(tmp_path / "base", 30.0, seed=0)
    code, md, err = cli("compare", str(a), str(tmp_path / "base"), "--format", "md")
    assert code == 0, err
    assert "; seeds 0 / 1" in md, md


def test_a_method_that_never_acted_is_marked_and_identical_rows_are_not_bold(cli, tmp_path):
    """Item 11: STARE's gate never opened: two identical rows, both bold, under a title that promised a best
    and a note that none was marked; --baseline failed without saying why when its rows were split by step."""
    g = _run(tmp_path / "runs", "grpo-ds", 1, {4: 40.0})
    s = _run(tmp_path / "runs", "stare-o1", 1, {4: 40.0}, gate=0.0)
    code, md, err = cli("compare", str(g), str(s), "--format", "md")
    assert code == 0, err
    assert "**" not in md  # equal rows: no best
    assert "| STARE-O1 § |" in md and "STARE's gate never opened (4 of 4 steps)" in md
    latex = cli("compare", str(g), str(s), "--format", "latex")[1]
    assert "Best per column in bold" not in latex
    g2 = _run(tmp_path / "runs", "grpo-ds", 2, {2: 38.0})  # its last evaluation at step 2: another row
    code, _, err = cli("compare", str(g), str(g2), str(s), "--baseline", "grpo-ds")
    assert code == 1 and "differ in more than the seed" in err and "step=2" in err and "step=4" in err, err
    js = json.loads(cli("compare", str(tmp_path / "runs"), "--format", "json")[1])
    assert len(js["rows"]) == 3  # the parent folder: every run, each its own (item 2)


def test_new_weights_copied_into_a_model_folder_are_evaluated_not_read_back(cli, tmp_path, quick_toy):
    """Item 4: samples were keyed by the model's path, so after new weights were copied into the folder, `stare eval`
    into the same --out reported the old weights' number ("8 already on disk")."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(quick_toy, model)
    out = tmp_path / "ev"
    args = ["eval", "--bench", "toy:arith", "--model", str(model), "--limit", "8", "-n", "2", "--out", str(out),
            "--engine", "hf", "--workers", "0"]
    code, _, err = cli(*args)
    assert code == 0, err
    weights = model / "model.safetensors"
    state = load_file(weights)
    save_file({k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}, weights,
              metadata={"format": "pt"})
    code, _, err = cli(*args)
    assert code == 0, err
    assert "(0 already on disk)" in err and "(8 already on disk)" not in err, err  # generated again
    recs = [json.loads(p.read_text()) for p in (out / "toy-arith" / "records").glob("*.json")]
    assert len(recs) == 2 and len({r["identity"]["weights"] for r in recs}) == 2
    js = json.loads(cli("compare", str(out), "--format", "json")[1])
    assert len(js["rows"]) == 2  # two models, never pooled as seeds of one
