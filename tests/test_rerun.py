"""`stare compare RUN RERUN --same` (stare_cli/analysis/rerun.py): does a rerun reproduce a run? Issue 48
asks that a sweep cell rerun from its card give the same metrics; this is the check, on hand-made run
directories whose every difference is known, and through the CLI on two toy runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


def _run(root: Path, rows: list[dict], evals: dict[int, tuple[dict, list[dict]]] = (), samples: dict[int, list[dict]] = ()) -> Path:
    """A run directory: metrics.jsonl, samples/step-N.jsonl, eval/step-N/words-two-step/ (results.json,
    results/<key>-math-verify.json, samples.jsonl), as `stare train` writes them."""
    root.mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "samples").mkdir()
    for step, lines in dict(samples).items():
        (root / "samples" / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for step, (metrics, lines) in dict(evals).items():
        d = root / "eval" / f"step-{step:06d}" / "words-two-step"
        (d / "results").mkdir(parents=True)
        res = {"benchmark": "words:two-step", "grader": "math-verify@7", "metrics": metrics,
               "settings": {"model": f"{root}@step-{step}", "n": metrics["n"], "temperature": 0.6},
               "protocol": {"n": metrics["n"], "temperature": 0.6, "top_p": 1.0, "template": "short", "max_tokens": 64}}
        (d / "results.json").write_text(json.dumps(res))
        (d / "results" / f"{hash(str(root)) & 0xffff:04x}-math-verify.json").write_text(json.dumps(res))
        (d / "samples.jsonl").write_text("".join(json.dumps({**x, "key": str(root)}) + "\n" for x in lines))
    return root


ROWS = [{"step": 1, "loss": 0.06716475635766983, "entropy": 0.514, "time/step": 101.7, "memory/peak_rss_gib": 6.1},
        {"step": 2, "loss": 0.0612, "entropy": 0.51, "grad_norm": float("nan"), "time/step": 99.0}]
EVALS = {0: ({"n": 2, "pass@1": 50.0, "pass@2": 100.0}, [{"idx": 0, "response": "4", "correct": True},
                                                         {"idx": 0, "response": "5", "correct": False}])}
SAMPLES = {2: [{"group": 0, "response": "Ben has 4 books.", "reward": 1.0}]}


def test_a_rerun_that_repeats_every_record_is_the_same_run(tmp_path):
    from stare_cli.analysis.rerun import agreement_text, compare_runs

    a = _run(tmp_path / "a", ROWS, EVALS, SAMPLES)
    # the rerun's wall times, memory, the model path in its evaluation settings and the samples' key differ:
    # none of them is the run's outcome
    b = _run(tmp_path / "b", [{**r, "time/step": 7.0, "memory/peak_rss_gib": 1.0} for r in ROWS], EVALS, SAMPLES)
    ag = compare_runs(a, b)
    assert ag.same and ag.steps == [1, 2] and ag.differences == []
    # values: step 1 loss, entropy; step 2 loss, entropy, grad_norm (NaN equals NaN) = 5
    assert (ag.values, ag.evaluations, ag.eval_samples, ag.train_samples) == (5, ["step 0 words:two-step n=2 math-verify@7"], 2, 1)
    assert agreement_text(ag, a, b).startswith(
        "same: over steps 1-2 (2 of 2 logged by a, 2 by b), 5 metric values, 1 evaluation (2 samples) and "
        "1 training sample are equal to the bit")


def test_a_rerun_differs_at_the_last_bit_and_the_answer_names_where(tmp_path):
    from stare_cli.analysis.rerun import agreement_text, compare_runs

    a = _run(tmp_path / "a", ROWS, EVALS, SAMPLES)
    rows = [dict(r) for r in ROWS]
    rows[0]["loss"] = math.nextafter(rows[0]["loss"], 1.0)  # one ulp: 0.06716475635766984
    evals = {0: ({"n": 2, "pass@1": 50.0, "pass@2": 100.0}, [{"idx": 0, "response": "4", "correct": True},
                                                            {"idx": 0, "response": "6", "correct": False}])}
    b = _run(tmp_path / "b", rows, evals, {2: [{"group": 0, "response": "Ben has 4 books!", "reward": 1.0}]})
    ag = compare_runs(a, b)
    assert not ag.same
    assert [d.text() for d in ag.differences] == [
        "step 1: loss 0.06716475635766983 vs 0.06716475635766984",
        'samples/step-000002.jsonl line 1: response "Ben has 4 books." vs "Ben has 4 books!"',
        'step 0 words:two-step n=2 math-verify@7 samples line 2: response "5" vs "6"']
    text = agreement_text(ag, a, b)
    assert text.startswith("differ: 3 differences over steps 1-2") and "metrics differ at 1 step, first step 1" in text


def test_a_partial_rerun_is_compared_over_its_prefix_and_extra_keys_are_named(tmp_path):
    from stare_cli.analysis.rerun import agreement_text, compare_runs

    a = _run(tmp_path / "a", ROWS, {**EVALS, 2: EVALS[0]}, SAMPLES)
    b = _run(tmp_path / "b", [{**ROWS[0], "stare/gate": 0.0}], EVALS)  # stopped after step 1; a newer key
    ag = compare_runs(a, b)
    assert ag.same and ag.steps == [1] and ag.evaluations == ["step 0 words:two-step n=2 math-verify@7"]
    assert ag.train_samples == 0  # step 2's samples are past the rerun's last step
    text = agreement_text(ag, a, b)
    assert "over step 1 (1 of 2 logged by a, 1 by b)" in text
    # a logs grad_norm at step 2 only, past the rerun's last step: not yet logged, not "only in a" (it
    # named the evaluations' keys of steps a stopped rerun had not reached)
    assert "grad_norm" not in text and "only in a" not in text
    assert "only in b (not compared): metrics stare/gate" in text
    assert compare_runs(a, _run(tmp_path / "c", [])).same is False  # no step in common: not the same
    assert agreement_text(compare_runs(a, tmp_path / "c"), a, tmp_path / "c").startswith("no step in common")


def test_compare_same_through_the_cli(cli, tmp_path):
    a = _run(tmp_path / "a", ROWS, EVALS, SAMPLES)
    b = _run(tmp_path / "b", ROWS, EVALS, SAMPLES)
    code, out, err = cli("compare", str(a), str(b), "--same")
    assert code == 0 and out.startswith("same: over steps 1-2"), err
    c = _run(tmp_path / "c", [{**ROWS[0], "entropy": 0.5}], EVALS, SAMPLES)
    code, out, err = cli("compare", str(a), str(c), "--same")
    assert code == 1 and "  step 1: entropy 0.514 vs 0.5" in out and f"{c} does not reproduce {a}" in err
    code, _, err = cli("compare", str(a), "--same")
    assert code == 2 and "--same takes two run directories" in err
    code, _, err = cli("compare", str(a), str(tmp_path), "--same")
    assert code == 1 and "not a training run directory" in err


def test_a_runs_resolved_recipe_is_read_as_it_is(tmp_path):
    """The card's "From the resolved recipe" command (`stare train --recipe RUN/config.yaml --method M`)
    applied the method's keys again over the run's config.yaml, undoing the -o values it ran with: a
    stare-o1 run with `-o method.dynamic_sampling=false` was rerun with dynamic sampling on, and
    `stare compare RUN RERUN --same` found 67 differences from step 2 (tests/test_embedded.py,
    test_run_directory_is_complete, which now reruns it to the bit)."""
    import yaml

    from stare_kernel.errors import StareError
    from stare_cli.core.resolve import load_recipe, run_recipe

    cfg = load_recipe("tiny/arith", "stare-o1", ["method.dynamic_sampling=false"])
    assert cfg.method.dynamic_sampling is False
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    assert run_recipe(str(run / "config.yaml")) is None  # no meta.json beside it: a recipe file like any other
    assert load_recipe(str(run / "config.yaml"), "stare-o1").method.dynamic_sampling is True  # the method's key wins
    (run / "meta.json").write_text("{}")
    assert run_recipe(str(run / "config.yaml")) == run / "config.yaml"
    again = load_recipe(str(run / "config.yaml"), "stare-o1")
    assert again.method.dynamic_sampling is False and again == cfg  # every value as the run had it
    assert load_recipe(str(run / "config.yaml"), None, ["optim.total_steps=3"]).optim.total_steps == 3
    with pytest.raises(StareError, match="holds method 'stare-o1' with its keys; --method grpo-ds would train a mix"):
        load_recipe(str(run / "config.yaml"), "grpo-ds")
