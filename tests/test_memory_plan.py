"""The embedded trainer's memory plan (`stare train --dry-run`, stare_cli/backends/memory_plan.py, issue 45):
its arithmetic on a hand-computed case, and its peak against a measured run of the toy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from stare_cli.backends.memory_plan import MemoryPlan, plan
from stare_cli.core.resolve import load_recipe


def test_peak_combines_the_parts_as_documented():
    # runtime 100 + weights 40 + gradients 40 + optimizer 80 + compute copy 20 + max(rollout 30, 50 + 25) = 355
    p = MemoryPlan(device="cpu", parameters=10, micro_batch_tokens=1, response_positions=1, weights=40, gradients=40,
                   optimizer=80, compute_copy=20, activations=50, logits=25, rollout=30, runtime=100, per_token_layer=1)
    assert p.training == 75 and p.peak == 355
    p.rollout = 90  # a rollout bigger than the training micro-batch sets the peak instead: 280 + 90
    assert p.peak == 370


def test_the_toy_plan_by_hand(quick_toy):
    """tiny/arith on the toy (Qwen2: 4 layers, width 128, 2 KV heads of 32, vocabulary 35, tied head)."""
    cfg = load_recipe("tiny/arith", None, [f"model.path={quick_toy}"])
    p = plan(cfg, str(quick_toy), device="cpu")
    assert p.weights == p.gradients == 4 * p.parameters and p.optimizer == 8 * p.parameters and p.compute_copy == 0
    # micro-batch: micro_batch_size 128 responses (= mini-batch 16 prompts x n 8) of 32 + 56 tokens
    assert p.micro_batch_tokens == 128 * 88 and p.response_positions == 128 * 56
    # rollout: 16 prompts x 8 = 128 rows x 88 tokens x 4 layers x 2 (K, V) x 2 heads x 32 x 4 bytes
    #          + 3 decode-step copies of 128 x 35 float32 logits
    assert p.rollout == 128 * 88 * 4 * 2 * 2 * 32 * 4 + 3 * 128 * 35 * 4
    # logits: lm_head 'auto' keeps the full head below a 4,096-token vocabulary: four float32 copies of
    # 7,168 response positions x 35; forced chunked (Qwen2 qualifies): four chunks of min(chunk, 7,168) positions
    assert p.logits == 4 * 4 * 35 * 128 * 56
    from stare_cli.backends.lm_head import chunk_positions

    cfg = load_recipe("tiny/arith", None, [f"model.path={quick_toy}", "backend.embedded.lm_head=chunked"])
    assert plan(cfg, str(quick_toy), device="cpu").logits == 4 * 4 * 35 * min(chunk_positions(35), 128 * 56)
    assert p.per_token_layer > 0 and p.activations > 0


def test_a_token_budget_plans_its_micro_batches_with_mixed_groups(quick_toy):
    """Prompt sharing runs each group's prompt once per micro-batch. Row-count micro-batches take rows in
    order: 16 rows of groups of 8 span 16 / 8 = 2 prompts, 2 x 32 + 16 x 56 = 960 tokens kept. verl's
    workload-balanced token budget mixes the groups: 1,420 // 88 = 16 rows from up to min(16, 16 prompts of the
    mini-batch) = 16 groups, 16 x 32 + 16 x 56 = 1,408 tokens. Activations are linear in the tokens kept."""
    base = [f"model.path={quick_toy}", "backend.embedded.share_prompts=true"]
    rows = plan(load_recipe("tiny/arith", None, [*base, "optim.micro_batch_size=16"]), str(quick_toy), device="cpu")
    budget = plan(load_recipe("tiny/arith", None, [*base, "optim.micro_batch_tokens=1420"]), str(quick_toy),
                  device="cpu")
    assert rows.micro_batch_tokens == budget.micro_batch_tokens == 16 * 88
    assert budget.activations * 960 == pytest.approx(rows.activations * 1408, rel=1e-12)


def test_the_plan_says_what_it_planned_for_and_where_it_is_no_bound(quick_toy):
    """Issue 69: a plan at the recipe's maxima says so; a split into several micro-batches, or activation
    checkpointing, makes it say it is not a bound (measured 26-53% above it on the real model, glibc's heap)."""
    base = [f"model.path={quick_toy}"]
    p = plan(load_recipe("tiny/arith", None, base), str(quick_toy), device="cpu")
    assert any(n.startswith("lengths: every row planned at its maximum (rollout.max_prompt_tokens 32 + "
                            "max_response_tokens 56)") for n in p.notes)
    assert not any("not a bound" in n for n in p.notes)  # one micro-batch of 128 responses, no checkpointing
    p = plan(load_recipe("tiny/arith", None, base), str(quick_toy), device="cpu", prompt_tokens=20, response_tokens=30)
    assert not any(n.startswith("lengths:") for n in p.notes)
    # 128 responses of 32 + 56 = 88 tokens under a 2,000-token budget: 22 rows a call, ceil(128 / 22) = 6 calls
    p = plan(load_recipe("tiny/arith", None, [*base, "optim.micro_batch_tokens=2000"]), str(quick_toy), device="cpu")
    assert any(n.startswith("not a bound with 6 micro-batches per mini-batch") for n in p.notes)
    p = plan(load_recipe("tiny/arith", None, [*base, "backend.embedded.activation_checkpointing=true"]), str(quick_toy),
             device="cpu")
    assert any(n.startswith("not a bound with activation checkpointing") for n in p.notes)


@pytest.mark.timeout(600)
def test_the_plan_is_within_15_percent_of_a_measured_toy_run(tmp_path, quick_toy):
    """Two training steps of tiny/arith in a child process (its own peak resident set, os.wait4), against the
    plan at the lengths the run had (its prompts, and its longest mean response)."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "stare_cli", "train", "--recipe", "tiny/arith", "--out", str(out),
           "-o", f"model.path={quick_toy}", "-o", "optim.total_steps=2", "-o", "eval.benchmarks=[]"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak resident set (ru_maxrss, KiB)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, output[-2000:]
    run = next(out.iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the peak over the training steps (the trainer's own record, VmHWM), not the process's whole life:
    # after training, `stare train` draws the run's plot (matplotlib), which the plan does not cover
    peak = max(r["memory/peak_rss_gib"] for r in rows) * 2**30
    assert peak <= usage.ru_maxrss * 1024
    from benchmarks.data.prompts import load_prompts
    from benchmarks.generation.engines import load_tokenizer
    from benchmarks.generation.templates import build_prompt

    cfg = load_recipe("tiny/arith", None, [f"model.path={quick_toy}"])
    tok = load_tokenizer(str(quick_toy))
    prompts = [len(tok(build_prompt(r["problem"], cfg.data.template.value, tok, False, None))["input_ids"])
               for r in load_prompts(cfg)[:32]]
    # the plan in a fresh process, as `stare train --dry-run` makes it (its runtime part is that process's
    # own resident memory, which a test worker that has run other tests would overstate)
    code = ("import sys\n"
            "from stare_cli.backends.memory_plan import plan\n"
            "from stare_cli.core.resolve import load_recipe\n"
            "cfg = load_recipe('tiny/arith', None, [f'model.path={sys.argv[1]}'])\n"
            "p = plan(cfg, sys.argv[1], device='cpu', prompt_tokens=int(sys.argv[2]), response_tokens=int(sys.argv[3]))\n"
            "print(p.peak)\n")
    r = subprocess.run([sys.executable, "-c", code, str(quick_toy), str(round(sum(prompts) / len(prompts))),
                        str(round(max(r["len/mean"] for r in rows)))], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    planned = int(r.stdout.strip().splitlines()[-1])
    assert abs(planned / peak - 1) <= 0.15, (planned / 2**30, peak / 2**30)



@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's peak reset (clear_refs) only")
def test_each_phase_of_memory_phases_gets_its_own_peak():
    """benchmarks/perf/memory_phases.py's clock: a phase that allocates and frees 256 MiB has a peak at least
    that far above the phase after it, which allocates nothing (its peak was reset at the boundary); the
    rows are in the order the phases ran. In a child process: resetting the peak here would hide this test
    process's own from benchmarks/perf/suite_memory.py."""
    code = """
import json, torch
from benchmarks.perf.memory_phases import PhaseClock
clock = PhaseClock()
clock.enter("big")
x = torch.ones(64 * 2**20)  # 256 MiB, every page written; above glibc's largest threshold, so mapped
del x
clock.enter("small")
clock.enter("end")
print(json.dumps([[r.phase, r.peak, r.end] for r in clock.rows]))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [name for name, _, _ in rows] == ["set-up", "big", "small"]
    (_, big_peak, big_end), (_, small_peak, _) = rows[1], rows[2]
    assert big_peak - small_peak >= 0.25 * 0.99  # GiB: 'small' did not inherit 'big''s peak
    assert small_peak <= big_end + 0.01  # nothing in 'small' rose above where 'big' ended


def test_dry_run_plans_at_the_newest_runs_mean_lengths(tmp_path, quick_toy, cli):
    """Issue 69: where a run of the recipe exists, `--dry-run` also plans at the measured lengths: the mean
    prompt of the first 64 training prompts and the newest run's mean `len/mean`; another recipe's run, another
    model's, or a folder without metrics is not read; with none it says so."""
    from dataclasses import replace

    from stare_cli.backends.memory_plan import mean_prompt_tokens, typical_line, typical_lengths

    cfg = load_recipe("tiny/arith", None, [f"model.path={quick_toy}"])
    runs = tmp_path / "runs"
    P, n = mean_prompt_tokens(cfg, str(quick_toy))
    assert n == 64 and 1 <= P <= cfg.rollout.max_prompt_tokens

    def run(name: str, lens: list[float], model: str = str(quick_toy), when: int = 0):
        d = runs / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(f"model:\n  path: {model}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "len/mean": v}) + "\n"
                                                 for i, v in enumerate(lens)))
        os.utime(d / "metrics.jsonl", (1_700_000_000 + when, 1_700_000_000 + when))
        return d

    assert typical_lengths(cfg, str(quick_toy), runs).response_tokens is None  # no folder at all
    run("tiny-arith__grpo-ds__seed1__20260101-000000", [30.0, 34.0], when=1)  # mean 32
    newest = run("tiny-arith__stare-o1__seed1__20260102-000000", [20.0, 21.0, 25.0], when=2)  # mean 22
    run("tiny-arith__grpo-ds__seed2__20260103-000000", [50.0], model="elsewhere", when=3)  # another model
    run("tiny-explore__grpo-ds__seed1__20260104-000000", [60.0], when=4)  # another recipe
    (runs / "tiny-arith__grpo-ds__seed3__20260105-000000").mkdir()  # no metrics: not a run to read
    t = typical_lengths(cfg, str(quick_toy), runs)
    assert t.run_dir == str(newest) and t.steps == 3 and t.response_tokens == pytest.approx(22.0)
    assert t.prompt_tokens == pytest.approx(P)

    at_maxima = plan(cfg, str(quick_toy), device="cpu")
    line = typical_line(cfg, str(quick_toy), runs, at_maxima)
    expected = replace(plan(cfg, str(quick_toy), device="cpu", prompt_tokens=round(P), response_tokens=22),
                       runtime=at_maxima.runtime)
    assert line.startswith(f"  at measured lengths: peak {expected.peak / 2**30:.2f} GiB")
    assert f"responses 22.0, the mean over 3 steps of {newest}" in line
    none = typical_line(cfg, str(quick_toy), tmp_path / "empty", at_maxima)
    assert "no run of tiny/arith under" in none and "the peak above is at the maxima" in none

    code, out, err = cli("train", "-r", "tiny/arith", "--dry-run", "--out", str(runs), "-o", f"model.path={quick_toy}")
    assert code == 0, err
    assert f"responses 22.0, the mean over 3 steps of {newest}" in out
    # training data that cannot be read here (a hub dataset offline, a file not there): the plan at the maxima
    # still prints, and the last line says why it has no second one
    code, out, err = cli("train", "-r", "tiny/arith", "--dry-run", "--out", str(runs), "-o", f"model.path={quick_toy}",
                         "-o", f"data.train={tmp_path / 'absent.jsonl'}")
    assert code == 0, err
    assert "  peak " in out and "at measured lengths: not planned, the training prompts cannot be measured here" in out
    assert "absent.jsonl' not found" in out
