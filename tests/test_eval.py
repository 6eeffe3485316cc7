"""Evaluation: grading of every gold, equivalent and wrong forms, pathological answers, metrics
against brute force, and `stare eval` end to end on a tiny local model (with a kill and resume)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.grading.graders import Grader, extract_answer, grade
from benchmarks.evaluation.metrics import benchmark_metrics, majority_correct, pass_at_k
from benchmarks.data.registry import BENCHMARKS, PAPER_ORDER, expand, load_benchmark
from benchmarks.generation.templates import INSTRUCTION, build_prompt
from conftest import FIXTURE_DATA, REPO, full_benchmarks


# --------------------------------------------------------------------------------------- grading
def _golds_grade_correct(data: Path, full: bool) -> None:
    golds = []
    for b in PAPER_ORDER:
        rows = load_benchmark(b, data_file=str(data / f"{b}.jsonl"))
        assert len(rows) == (BENCHMARKS[b].size if full else 6)
        golds += [r["answer"] for r in rows]
    assert len(golds) == (1546 if full else 36)
    with Grader(workers=2) as g:
        verdicts = g.grade_many([f"Let me think.\nSo the result is \\boxed{{{a.strip('$')}}}." for a in golds], golds)
    wrong = [(a, v.reason) for a, v in zip(golds, verdicts) if not v.correct]
    assert wrong == []


def test_every_gold_of_the_fixtures_grades_correct_as_a_response():
    _golds_grade_correct(FIXTURE_DATA, full=False)


def test_every_gold_of_the_full_benchmarks_grades_correct_as_a_response():
    _golds_grade_correct(full_benchmarks(), full=True)


@pytest.mark.parametrize(
    "answer,gold",
    [
        ("0.5", "\\frac12"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("x = 3", "3"), ("3", "x=3"),
        ("[1, 2)", "[1,2)"), ("(1, 2)", "(1,2)"), ("90^\\circ", "90"), ("50\\%", "50"),
        ("10 \\text{ cm}", "10"), ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}"), ("4.5\\times10^{33}", "4.5e33"),
        ("1,000", "1000"), ("$27$", "27"),
    ],
)
def test_equivalent_forms_grade_correct(answer, gold):
    v = grade(f"The answer is \\boxed{{{answer}}}", gold)
    assert v.correct, v


@pytest.mark.parametrize(
    "answer,gold", [("0.51", "\\frac12"), ("4", "3"), ("(1, 3)", "(1,2)"), ("x = 4", "3"), ("[1,2]", "(1,2)"), ("-3", "3")]
)
def test_wrong_answers_grade_wrong(answer, gold):
    assert not grade(f"\\boxed{{{answer}}}", gold).correct


def test_extraction_order_and_fallbacks():
    assert extract_answer("\\boxed{1} then \\boxed{\\frac{a}{b}}") == ("\\frac{a}{b}", "boxed")
    assert extract_answer("so the final answer is 42.") == ("42", "answer-phrase")
    assert extract_answer("we get 3 and then 17 apples") == ("17", "last-number")
    assert extract_answer("no digits here") == (None, "none")
    # a final box that never closes is no answer (a cut response), never a fallback
    assert extract_answer("\\boxed{7", boxed_only=True) == (None, "unclosed-box")
    assert extract_answer("the answer is 3, so \\boxed{204") == (None, "unclosed-box")


def test_pathological_answers_are_wrong_with_a_reason_and_never_hang():
    cases = [
        "\\boxed{9^{9^{9^{9}}}}", "x" * 100_000 + " \\boxed{3}" + "y" * 100_000, "\\boxed{{{{{{", "",
        "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}", "\\boxed{10000!}",
    ]
    t0 = time.time()
    with Grader(workers=2, timeout=2, hard_timeout=20) as g:
        vs = g.grade_many(cases, ["3"] * len(cases))
    assert time.time() - t0 < 120
    assert len(vs) == len(cases)
    assert not vs[0].correct and not vs[2].correct and not vs[3].correct and not vs[5].correct
    assert vs[1].correct  # the answer at the end of a 200k-character response is still found
    assert vs[3].reason == "no-answer"


# --------------------------------------------------------------------------------------- metrics
def test_pass_at_k_equals_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                outcomes = [True] * c + [False] * (n - c)
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_avg_and_maj_hand_made():
    # maj@k is the expected vote over the C(4, k) subsets of k samples (issue 30: maj@1 was the first sample).
    # Problem 1: 3/4 correct, answers 5,5,5,7 (7 wrong). maj@1 = 3/4 (a single sample is right 3 times
    #   in 4); maj@2: every pair has a 5 first or alone (7 ties lose to the earlier 5) -> 6/6; maj@4: 5 wins.
    # Problem 2: 1/4 correct, answers 2,3,3,None (2 right). maj@1 = 1/4; maj@2 over the 6 pairs:
    #   (0,1) 2-3 tie -> 2 right, (0,2) right, (0,3) only 2 -> right, (1,2) 3, (1,3) 3, (2,3) 3 -> 3/6;
    #   maj@4: 3 wins (2 votes) -> wrong.
    # So maj@1 = (3/4 + 1/4) / 2 = 50 = avg@4, maj@2 = (1 + 1/2) / 2 = 75, maj@4 = (1 + 0) / 2 = 50.
    p1 = {"correct": [True, True, True, False], "answers": ["5", "5", "5", "7"], "lengths": [10] * 4, "finished": [True] * 4}
    p2 = {"correct": [True, False, False, False], "answers": ["2", "3", "3", None], "lengths": [20] * 4,
          "finished": [True, True, True, False]}
    m = benchmark_metrics([p1, p2])
    assert m["avg@4"] == pytest.approx(100 * (0.75 + 0.25) / 2)
    assert m["maj@4"] == pytest.approx(50.0) and m["maj@2"] == pytest.approx(75.0)
    assert m["maj@1"] == pytest.approx(m["avg@4"]) == pytest.approx(50.0)
    assert m["pass@1"] == pytest.approx(m["avg@4"])
    assert m["pass@4"] == pytest.approx(100.0)
    assert m["len/mean"] == pytest.approx(15.0) and m["truncated"] == pytest.approx(12.5)
    assert majority_correct(["a", "b"], [False, True]) is False  # tie: the first answer seen wins


def test_the_eval_table_says_why_maj_is_below_avg(capsys):
    from stare_cli.cli import _print_eval

    # One problem, 2 samples: answers 3 (wrong) then 4 (right): avg@2 = 50, the 1-1 tie goes to the
    # first answer seen, so maj@2 = 0 (below avg@2, which the caption explains).
    m = benchmark_metrics([{"correct": [False, True], "answers": ["3", "4"], "lengths": [5, 5], "finished": [True, True]}])
    assert m["avg@2"] == pytest.approx(50.0) and m["maj@2"] == pytest.approx(0.0)
    _print_eval({"words:add-sub": {**m, "problems": 1}}, "t", as_json=False)
    text = " ".join(capsys.readouterr().out.split())
    assert "maj@N is below avg@N on words:add-sub: in a vote the answers that tie for most votes go to the one seen first" in text
    m2 = benchmark_metrics([{"correct": [True, True], "answers": ["4", "4"], "lengths": [5, 5], "finished": [True, True]}])
    _print_eval({"words:add-sub": {**m2, "problems": 1}}, "t", as_json=False)
    assert "maj@N is below" not in capsys.readouterr().out  # only where it is


# ------------------------------------------------------------------------------- data, templates
def test_instruction_is_not_doubled():
    row = load_benchmark("amc23", limit=1, data_file=str(FIXTURE_DATA / "amc23.jsonl"))[0]
    assert row["problem"].endswith(INSTRUCTION)
    prompt = build_prompt(row["problem"], "plain")
    assert prompt.count(INSTRUCTION) == 1
    assert build_prompt("What is 1+1?", "plain").count(INSTRUCTION) == 1


@pytest.mark.parametrize("problem", ["What is 1+1?", "What is 1+1?  ", "What is 1+1?\n", "What is 1+1?\n\n \t"])
def test_the_instruction_is_added_as_the_official_pipeline_adds_it(problem):
    """problem + "\n" + instruction with no stripping (issue 29, item 5: trailing whitespace was
    stripped before the instruction was added)."""
    from benchmarks.generation.templates import user_text, with_instruction

    assert with_instruction(problem) == problem + "\n" + INSTRUCTION
    assert user_text(problem, "paper") == problem + "\n" + INSTRUCTION
    assert build_prompt(problem, "plain") == problem + "\n" + INSTRUCTION + "\n"


def test_paper_expands_in_order_and_local_dir(monkeypatch):
    assert expand(["paper"]) == list(PAPER_ORDER)
    monkeypatch.setenv("STARE_DATA_DIR", str(FIXTURE_DATA))
    assert len(load_benchmark("minerva")) == 6


def test_hub_failure_says_how_to_use_a_local_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STARE_DATA_DIR"}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    p = subprocess.run([sys.executable, "-c", "from benchmarks.data.registry import load_benchmark; load_benchmark('aime24')"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode != 0
    assert "cannot load HuggingFaceH4/aime_2024" in p.stderr and "--data-file" in p.stderr and "STARE_DATA_DIR" in p.stderr


# ------------------------------------------------------------------------------ end to end (CLI)
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from benchmarks.data.toy import make_random_init

    return make_random_init(tmp_path_factory.mktemp("tiny_eval_model"))


def _eval_args(model, out, bench="math500", limit=3, n=2, data=None):
    data = data or FIXTURE_DATA / f"{bench}.jsonl"
    return ["eval", "--bench", bench, "--model", str(model), "--limit", str(limit), "-n", str(n), "--out", str(out),
            "--max-tokens", "12", "--data-file", str(data), "--engine", "hf", "--workers", "0"]


def _many_problems(path: Path, k: int) -> Path:
    """k arithmetic problems: enough for several generation chunks of 8."""
    path.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(k)))
    return path


def test_eval_end_to_end_writes_both_files(cli, tmp_path, tiny_model):
    code, out, err = cli(*_eval_args(tiny_model, tmp_path / "ev"), "--json")
    assert code == 0, err
    metrics = json.loads(out)["math500"]
    assert metrics["n"] == 2 and metrics["problems"] == 3
    res = json.loads((tmp_path / "ev" / "math500" / "results.json").read_text())
    assert res["protocol"]["n"] == 2 and res["protocol"]["paper_protocol"] is False
    assert "torch" in res["environment"]["packages"]
    samples = [json.loads(x) for x in (tmp_path / "ev" / "math500" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6
    assert {"prompt", "response", "extracted", "correct", "reason"} <= set(samples[0])


def test_eval_grader_is_recorded_and_a_new_grader_regrades_without_generating(cli, tmp_path, tiny_model):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}?", "answer": str(i)}) + "\n" for i in range(3)))
    args = ["eval", "--bench", "math500", "--model", str(tiny_model), "-n", "2", "--out", str(tmp_path / "ev"),
            "--max-tokens", "8", "--data-file", str(data), "--engine", "hf", "--workers", "0"]
    assert cli(*args)[0] == 0
    f = tmp_path / "ev" / "math500" / "samples.jsonl"
    first = [json.loads(x) for x in f.read_text().splitlines()]
    assert {r["grader"] for r in first} == {"math-verify@8"}
    code, out, err = cli(*args, "--grader", "stare-official")
    assert code == 0, err
    again = [json.loads(x) for x in f.read_text().splitlines()]
    assert [r["response"] for r in again] == [r["response"] for r in first]  # the same samples, not new ones
    assert {r["grader"] for r in again} == {"stare-official@1"}
    res = json.loads((tmp_path / "ev" / "math500" / "results.json").read_text())
    assert res["grader"] == "stare-official@1"
    code, _, err = cli(*args, "--grader", "nope")
    assert code == 1 and "unknown grader 'nope'" in err


def test_eval_killed_midway_resumes_to_the_same_results(cli, tmp_path, tiny_model):
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    data = _many_problems(tmp_path / "p.jsonl", 24)
    args = _eval_args(tiny_model, ref_out, limit=24, n=2, data=data)
    code, _, err = cli(*args)
    assert code == 0, err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "stare_cli", *_eval_args(tiny_model, out, limit=24, n=2, data=data)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    samples = out / "math500" / "samples.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (samples.exists() and samples.read_text().count("\n") >= 16):
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert samples.exists() and not (out / "math500" / "results.json").exists() or p.returncode != 0
    code, _, err = cli(*_eval_args(tiny_model, out, limit=24, n=2, data=data))
    assert code == 0, err
    a = json.loads((ref_out / "math500" / "results.json").read_text())
    b = json.loads((out / "math500" / "results.json").read_text())
    assert a["metrics"] == b["metrics"]
    strip = lambda p: sorted((r["idx"], r["sample"], r["response"]) for r in map(json.loads, p.read_text().splitlines()))  # noqa: E731
    assert strip(ref_out / "math500" / "samples.jsonl") == strip(samples)


def test_lm_eval_task_files_point_at_the_same_data_and_grader(tmp_path):
    import yaml

    from benchmarks.evaluation.lm_eval_bridge import UTILS, write_tasks

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")
    import os

    os.environ["STARE_DATA_DIR"] = str(FIXTURE_DATA)
    try:
        names = write_tasks(["aime24", "math500"], tmp_path, None, None, None, None)
    finally:
        del os.environ["STARE_DATA_DIR"]
    assert names == ["stare_aime24", "stare_math500"]
    t = yaml.load((tmp_path / "stare_aime24.yaml").read_text(), Loader=_Loader)
    assert t["repeats"] == 32 and t["generation_kwargs"]["temperature"] == 1.0 and t["generation_kwargs"]["top_p"] == 0.7
    assert t["dataset_kwargs"]["data_files"]["test"] == str((FIXTURE_DATA / "aime24.jsonl").resolve())
    assert t["filter_list"][0]["filter"][0] == {"function": "take_first_k", "k": 32}
    assert yaml.load((tmp_path / "stare_math500.yaml").read_text(), Loader=_Loader)["repeats"] == 4
    # The generated utils grade with our grader: run its process_results on a hand-made doc.
    ns: dict = {}
    exec(UTILS, ns)
    doc = {"problem": "What is 1/2?", "answer": "\\frac12"}
    assert ns["process_results"](doc, [["\\boxed{0.5}", "\\boxed{3}"]]) == {"avg_at_n": 50.0, "pass_at_n": 100.0}
    assert ns["doc_to_text_paper"](doc).endswith(INSTRUCTION) and ns["doc_to_text_plain"](doc).endswith(INSTRUCTION + "\n")
    assert ns["doc_to_text_short"](doc).endswith("Answer with a single number.") and ns["doc_to_text_raw"](doc) == "What is 1/2?\n"
    assert t["doc_to_text"] == "!function utils.doc_to_text_paper"  # each benchmark's own template by default


def test_openai_engine_against_a_local_stub_server():
    """The OpenAI-compatible engine speaks the completions protocol (stub server on loopback)."""
    import http.server
    import threading

    from benchmarks.generation.engines import OpenAIEngine, SamplingParams

    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            choices = [{"text": f" so \\boxed{{{i}}}", "finish_reason": "stop" if i else "length"} for i in range(body["n"])]
            data = json.dumps({"choices": choices}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        eng = OpenAIEngine(f"http://127.0.0.1:{srv.server_port}/v1", "m", timeout=10)
        out = eng.generate(["p1", "p2"], SamplingParams(n=2, temperature=1.0, top_p=0.7, max_new_tokens=8, seed=3))
    finally:
        srv.shutdown()
    assert [[s.text for s in g] for g in out] == [[" so \\boxed{0}", " so \\boxed{1}"]] * 2
    assert [s.finished for s in out[0]] == [False, True]
    assert seen[0]["top_p"] == 0.7 and seen[0]["n"] == 2 and seen[0]["max_tokens"] == 8 and seen[1]["seed"] == 4


def test_hf_engine_stops_at_every_eos_the_model_declares(tiny_model):
    """Chat models end turns with a token that is not the tokenizer's eos (e.g. <|im_end|>)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.generation.engines import HFEngine, SamplingParams, load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    eng = HFEngine(model, tok)
    base = eng.generate(["Compute 1+2-3.\n"], SamplingParams(n=4, max_new_tokens=20, seed=0))[0]
    # Declare the first sampled token of each response as an extra EOS: every response then stops there.
    firsts = sorted({s.response_ids[0] for s in base})
    model.generation_config.eos_token_id = firsts
    assert set(firsts) <= set(eng.eos_ids()) and tok.eos_token_id in eng.eos_ids()
    again = eng.generate(["Compute 1+2-3.\n"], SamplingParams(n=4, max_new_tokens=20, seed=0))[0]
    assert all(len(s.response_ids) == 1 and s.finished for s in again)


def test_pruning_decode_loop_matches_transformers_generate_greedily(quick_toy):
    """top_k = 1 makes sampling greedy: our loop (rows leave the batch at EOS) and transformers'
    generate must then produce the same tokens, for prompts of different lengths (left padding)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from benchmarks.generation.engines import SamplingParams, load_tokenizer, sample_decode

    tok = load_tokenizer(str(quick_toy))
    model = AutoModelForCausalLM.from_pretrained(quick_toy, dtype=torch.float32).eval()
    prompts = ["Compute 1+2-3.\n", "Compute 13+14-26.\n", "Compute 9+9-9.\n", "Compute 20+7-11.\n"]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    L = max(map(len, ids))
    inp = torch.tensor([[0] * (L - len(x)) + x for x in ids])
    attn = (torch.arange(L)[None] >= torch.tensor([L - len(x) for x in ids])[:, None]).long()
    with torch.no_grad():
        ours = sample_decode(model, inp, attn, SamplingParams(top_k=1, max_new_tokens=40), [tok.eos_token_id])
        ref = model.generate(input_ids=inp, attention_mask=attn, generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=40, eos_token_id=[tok.eos_token_id], pad_token_id=0))[:, L:].tolist()
    for o, r in zip(ours, ref):
        stop = r.index(tok.eos_token_id) + 1 if tok.eos_token_id in r else len(r)
        assert o == r[:stop]
    assert any(o[-1] == tok.eos_token_id for o in ours) and len({len(o) for o in ours}) > 1  # rows left at different steps


def test_shared_prefill_samples_what_separate_prefills_sample(quick_toy):
    """The n samples of a prompt are prefilled once and their cache copied: with the same seed the
    sampled tokens equal those of prefilling every row, also with left padding between the groups."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.generation.engines import SamplingParams, load_tokenizer, sample_decode

    tok = load_tokenizer(str(quick_toy))
    model = AutoModelForCausalLM.from_pretrained(quick_toy, dtype=torch.float32).eval()
    prompts = ["Compute 1+2-3.\n"] * 3 + ["Compute 13+14-26.\n"] * 4 + ["Compute 9+9-9.\n"]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    L = max(map(len, ids))
    assert len({len(x) for x in ids}) > 1  # some rows are left-padded
    inp = torch.tensor([[0] * (L - len(x)) + x for x in ids])
    attn = (torch.arange(L)[None] >= torch.tensor([L - len(x) for x in ids])[:, None]).long()
    sp = SamplingParams(temperature=1.0, max_new_tokens=30)
    runs = []
    with torch.no_grad():
        for share in (True, False):
            torch.manual_seed(5)
            runs.append(sample_decode(model, inp, attn, sp, [tok.eos_token_id], share_prefill=share))
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0][:3]}) > 1  # the copies of one prompt still sample apart


def test_sampling_filters_follow_transformers_order():
    import torch

    from benchmarks.generation.engines import _filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top-k 2 keeps the two largest
    assert torch.isinf(_filter_logits(logits, 1.0, 2, 1.0)[0, 2:]).all()
    # top-p 0.7: 0.5 + 0.3 reach 0.7, the tail (0.15 + 0.05 = 0.2 <= 0.3) goes
    kept = torch.isfinite(_filter_logits(logits, 1.0, -1, 0.7)[0]).tolist()
    assert kept == [True, True, False, False]
    # temperature 0.5 squares the probabilities before renormalising: 0.25/0.09/... proportions
    p = _filter_logits(logits, 0.5, -1, 1.0).softmax(-1)[0]
    assert p[0] / p[1] == pytest.approx((0.5 / 0.3) ** 2)


# --------------------------------------------------------------------- nothing lost, re-gradable
def test_other_settings_never_delete_samples_and_write_results_beside(cli, tmp_path, tiny_model):
    data = _many_problems(tmp_path / "p.jsonl", 10)
    out = tmp_path / "ev"
    assert cli(*_eval_args(tiny_model, out, limit=10, n=2, data=data))[0] == 0
    assert cli(*_eval_args(tiny_model, out, limit=4, n=2, data=data))[0] == 0  # the limit is part of the key
    assert cli(*_eval_args(tiny_model, out, limit=10, n=1, data=data))[0] == 0
    rows = [json.loads(x) for x in (out / "math500" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 10 * 2 + 4 * 2 + 10 * 1 and len({r["key"] for r in rows}) == 3
    results = sorted((out / "math500" / "results").glob("*.json"))
    assert len(results) == 3 and json.loads((out / "math500" / "results.json").read_text())["settings"]["n"] == 1
    assert cli(*_eval_args(tiny_model, out, limit=10, n=2, data=data))[0] == 0  # again: nothing new, nothing lost
    assert len((out / "math500" / "samples.jsonl").read_text().splitlines()) == len(rows)


def test_samples_on_disk_are_reused_across_limits_where_the_chunk_is_the_same(cli, tmp_path, tiny_model):
    """Chunk ci (problems 8ci..8ci+7) is sampled with a seed of ci alone, so an evaluation with another
    --limit that holds the same whole chunk gives the same samples: they are copied, not generated.
    A partial last chunk is another batch (4 problems, not 8) and is generated."""
    data = _many_problems(tmp_path / "p.jsonl", 24)
    out, fresh = tmp_path / "ev", tmp_path / "fresh"
    samples = lambda d: [json.loads(x) for x in (d / "math500" / "samples.jsonl").read_text().splitlines()]  # noqa: E731
    assert cli(*_eval_args(tiny_model, out, limit=16, n=2, data=data))[0] == 0
    code, _, err = cli(*_eval_args(tiny_model, out, limit=8, n=2, data=data))
    assert code == 0, err
    assert "8 problems' samples reused from an evaluation of the same settings with another --limit" in err
    code, _, err = cli(*_eval_args(tiny_model, out, limit=24, n=2, data=data))
    assert code == 0 and "16 problems' samples reused" in err, err
    code, _, err = cli(*_eval_args(tiny_model, out, limit=12, n=2, data=data))
    assert code == 0 and "8 problems' samples reused" in err, err  # chunk 0 only: 8-11 are a batch of 4 here
    rows = samples(out)
    by_key: dict = {}
    for r in rows:
        by_key.setdefault(r["key"], []).append(r)
    assert sorted(len(v) for v in by_key.values()) == [16, 24, 32, 48]
    reused = [r for r in rows if r.get("reused_from")]
    assert len(reused) == 16 + 32 + 16
    # what each reused evaluation would have generated: the same responses and results from scratch
    for limit in (8, 24, 12):
        assert cli(*_eval_args(tiny_model, fresh / str(limit), limit=limit, n=2, data=data))[0] == 0
        mine = {json.loads((out / "math500" / "results" / f).read_text())["settings"]["limit"]: f
                for f in os.listdir(out / "math500" / "results")}
        a = json.loads((out / "math500" / "results" / mine[limit]).read_text())
        b = json.loads((fresh / str(limit) / "math500" / "results.json").read_text())
        assert a["metrics"] == b["metrics"] and a["key"] == b["key"]
        strip = lambda rs, key: sorted((r["idx"], r["sample"], r["response"]) for r in rs if r["key"] == key)  # noqa: E731
        assert strip(rows, a["key"]) == strip(samples(fresh / str(limit)), a["key"])


def test_every_generation_setting_enters_the_key_and_tool_less_keys_stay_stable():
    from dataclasses import replace

    from benchmarks.evaluation.evaluate import EvalSettings

    base = EvalSettings(model="m", bench="aime24", template="paper", n=4, temperature=1.0, top_p=0.7,
                        max_tokens=100, seed=0, engine="hf")
    changed = [replace(base, **{f: v}) for f, v in [("model", "m2"), ("bench", "amc23"), ("template", "plain"),
               ("n", 8), ("temperature", 0.6), ("top_p", 1.0), ("max_tokens", 50), ("seed", 1),
               ("engine", "vllm"), ("limit", 3), ("tools", "python"), ("data", "0" * 64),
               ("dtype", "float32"), ("weights", "sha256:" + "1" * 64), ("prompt", "sha256:" + "2" * 64),
               ("chat", True)]]
    assert len({base.key(), *(c.key() for c in changed)}) == 1 + len(changed)
    # the key of a setting without tools or a data digest is the hash of the fields that existed before them
    import hashlib
    import json as _json
    old = {k: v for k, v in base.__dict__.items() if k not in ("tools", "data", "dtype", "weights", "prompt", "chat")}
    assert base.key() == hashlib.sha256(_json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]


def test_regrade_grades_saved_samples_without_generating(cli, tmp_path, tiny_model):
    data = _many_problems(tmp_path / "p.jsonl", 4)
    out = tmp_path / "ev"
    assert cli(*_eval_args(tiny_model, out, limit=4, n=2, data=data))[0] == 0
    before = (out / "math500" / "samples.jsonl").read_text().splitlines()
    code, text, err = cli("eval", "--regrade", str(out), "--grader", "stare-official-3way", "--workers", "0", "--json")
    assert code == 0, err
    assert json.loads(text)["math500"]["n"] == 2
    after = [json.loads(x) for x in (out / "math500" / "samples.jsonl").read_text().splitlines()]
    assert [r["response"] for r in after] == [json.loads(x)["response"] for x in before]
    assert all(set(r["verdicts"]) == {"math-verify@8", "stare-official-3way@1"} for r in after)  # both kept
    names = sorted(p.name.split("-", 1)[1] for p in (out / "math500" / "results").glob("*.json"))
    assert names == ["math-verify.json", "stare-official-3way.json"]
    code, _, err = cli("eval", "--regrade", str(tmp_path / "nothing"), "--grader", "math-verify")
    assert code == 1 and "no samples.jsonl" in err


@pytest.mark.parametrize("content,message", [
    ('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer":\n', "p.jsonl:2: not valid JSON"),
    ("", "p.jsonl: no problems (the file is empty)"),
    ('["a", "1"]\n', "p.jsonl:1: a row must be a JSON object"),
    ('{"question_text": "a", "answer": "1"}\n', "p.jsonl:1: no problem field"),
])
def test_bad_data_is_found_before_the_model_loads(cli, tmp_path, content, message):
    data = tmp_path / "p.jsonl"
    data.write_text(content)
    # the model does not exist: the data error comes first
    code, _, err = cli("eval", "--bench", "math500", "--model", str(tmp_path / "no-model"), "--data-file", str(data),
                       "--out", str(tmp_path / "ev"), "--engine", "hf")
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ev" / "math500" / "results.json").exists()


def test_unwritable_out_and_missing_data_dir_files_say_what_to_do(cli, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # a model folder by name: --out is checked after it
    code, _, err = cli("eval", "--bench", "math500", "--model", str(tmp_path / "m"), "--out", str(blocker / "sub"),
                       "--data-file", str(FIXTURE_DATA / "math500.jsonl"), "--engine", "hf")
    assert code == 1 and "cannot write there" in err and "hint" in err
    monkeypatch.setenv("STARE_DATA_DIR", str(tmp_path))
    code, _, err = cli("eval", "--bench", "aime24", "--model", str(tmp_path / "m"), "--engine", "hf")
    assert code == 1 and f"STARE_DATA_DIR={tmp_path} has no aime24.jsonl" in err


def test_majority_votes_on_answers_the_grader_calls_equal():
    from benchmarks.grading.graders import judge

    same = lambda a, b: judge(a, b)[0]  # noqa: E731
    answers = ["\\frac{1}{2}", "0.5", "3", "1/2", "3"]
    correct = [True, True, False, True, False]
    assert majority_correct(answers, correct) is False  # as strings "3" wins (2 votes)
    assert majority_correct(answers, correct, same) is True  # 1/2 in three forms wins (3 votes)


def test_bootstrap_interval_brackets_the_mean():
    from benchmarks.evaluation.metrics import bootstrap_ci

    vals = [1.0] * 30 + [0.0] * 70
    lo, hi = bootstrap_ci(vals)
    assert lo < 0.3 < hi and hi - lo < 0.25
    assert bootstrap_ci([1.0, 1.0]) == (1.0, 1.0)
    m = benchmark_metrics([{"correct": [True, False], "answers": ["1", "2"], "lengths": [3, 4], "finished": [True, True]}])
    assert m["ci95/avg@2"] == [50.0, 50.0]


def test_progress_lines_without_a_terminal(cli, tmp_path, tiny_model):
    data = _many_problems(tmp_path / "p.jsonl", 16)
    code, _, err = cli(*_eval_args(tiny_model, tmp_path / "ev", limit=16, n=1, data=data))
    assert code == 0
    lines = [x for x in err.splitlines() if x.startswith("math500: ") and "problems" in x]
    assert lines and lines[-1].startswith("math500: 16/16 problems") and "/s, ETA" in lines[-1]


def test_eval_results_go_to_wandb_offline(cli, tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    code, _, err = cli(*_eval_args(tiny_model, tmp_path / "ev", limit=2, n=1), "--wandb", "offline")
    assert code == 0, err
    runs = list((tmp_path / "ev" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    code, _, err = cli(*_eval_args(tiny_model, tmp_path / "ev", limit=2, n=1), "--wandb", "sometimes")
    assert code == 2


def _bridge(model, out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stare_cli", "eval", "--harness", "lm-eval", "--bench", "math500",
         "--model", str(model), "--data-file", str(FIXTURE_DATA / "math500.jsonl"), "--limit", "2", "-n", "2",
         "--max-tokens", "8", "--out", str(out), "--template", "plain", "--json", "--workers", "0", *extra],
        capture_output=True, text=True, cwd=REPO, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_lm_eval_bridge_writes_our_format_and_honours_seed_and_grader(cli, tmp_path, tiny_model):
    """lm-eval (installed by the test extras: `pip install -e '.[lm-eval]'`) runs our task files; its
    logged samples come back as our samples.jsonl and results.json, so compare, --regrade and
    grade audit read them. Before (issue 30, item 9) it wrote only lm-eval's files and ignored
    --grader (even an unknown one exited 0) and --seed. With --json, stdout holds only our JSON."""
    out = tmp_path / "lm"
    first = _bridge(tiny_model, out)
    assert first.returncode == 0, first.stderr[-3000:]
    res = json.loads(first.stdout)  # nothing but JSON on stdout: lm-eval's table went to stderr
    assert set(res) == {"math500"} and res["math500"]["n"] == 2 and res["math500"]["problems"] == 2
    results = json.loads((out / "math500" / "results.json").read_text())
    assert results["grader"].startswith("math-verify@") and results["settings"]["engine"] == "lm-eval-hf"
    assert results["harness"]["name"] == "lm-eval" and "avg_at_n,all_samples" in results["harness"]["metrics"]
    assert results["data"]["problems"] == 2 and results["data"]["partial"] is True
    rows = [json.loads(x) for x in (out / "math500" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {(r["idx"], r["sample"]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(r["gold"] in ("\\frac{3}{4}", "3") and "math-verify" in r["grader"] for r in rows)
    # another seed and another grader: honoured (new samples under their own key, graded by that grader)
    second = _bridge(tiny_model, out, "--seed", "7", "--grader", "stare-official")
    assert second.returncode == 0, second.stderr[-3000:]
    results = json.loads((out / "math500" / "results.json").read_text())
    assert results["grader"].startswith("stare-official@") and results["settings"]["seed"] == 7
    rows = [json.loads(x) for x in (out / "math500" / "samples.jsonl").read_text().splitlines()]
    by_key: dict[str, list[str]] = {}
    for r in rows:
        by_key.setdefault(r["key"], []).append(r["response"])
    assert len(by_key) == 2 and len(set(map(tuple, by_key.values()))) == 2  # seed 7 sampled other responses
    # every reader of our format reads it
    assert cli("compare", str(out), "--format", "csv")[0] == 0
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "mathruler", "--workers", "0")
    assert code == 0, err
    assert cli("grade", "audit", str(out), "--workers", "0")[0] == 0


def _bridge_prompt_ids(model_dir: str, prompts: list[str]) -> tuple[list, list]:
    """Token ids of `prompts` under stare's loader and under the tokenizer lm-eval's hf model gets when the
    bridge runs it (lm_eval_main.py routes AutoTokenizer); lm-eval encodes a context without special tokens."""
    code = ("import json, sys\n"
            "from benchmarks.evaluation.lm_eval_main import use_stare_tokenizers\n"
            "use_stare_tokenizers()\n"
            "import transformers\n"
            "tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "print(json.dumps([tok(p, add_special_tokens=False)['input_ids'] for p in json.loads(sys.argv[2])]))\n")
    r = subprocess.run([sys.executable, "-c", code, model_dir, json.dumps(prompts)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from benchmarks.generation.engines import load_tokenizer

    ours = load_tokenizer(model_dir)
    return [ours(p, add_special_tokens=False)["input_ids"] for p in prompts], json.loads(r.stdout)


def test_the_bridge_gives_the_toy_the_prompt_tokens_the_native_path_gives(tmp_path, quick_toy):
    """Issue 43, case 10: the bridge loaded the toy tokenizer with AutoTokenizer, which under transformers 5
    drops its word tokens ("Compute 6+3-7." reached the model as "6+3-7."): avg@4 2.3 against the native
    60.5, 0% identical responses. Now: the same prompt token ids, and at temperature 0 the same responses."""
    from benchmarks.data.toy import problems
    from benchmarks.generation.templates import build_prompt
    from benchmarks.generation.engines import load_tokenizer

    rows = problems(4, seed=4242)
    tok = load_tokenizer(str(quick_toy))
    prompts = [build_prompt(r["problem"], "raw", tok, False) for r in rows]
    ours, bridge = _bridge_prompt_ids(str(quick_toy), prompts)
    assert ours == bridge and all(len(x) > 6 for x in ours)  # "Compute", the numbers and signs all survive
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n" for r in rows))
    common = ["--bench", "math500", "--template", "raw", "--model", str(quick_toy), "--data-file", str(data), "-n", "1",
              "--temperature", "0", "--max-tokens", "16", "--workers", "0", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for extra, out in (([], "nat"), (["--harness", "lm-eval"], "lm")):
        r = subprocess.run([sys.executable, "-m", "stare_cli", "eval", *common, *extra, "--out", str(tmp_path / out)],
                           capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    read = lambda d: {x["idx"]: x for x in map(json.loads, (tmp_path / d / "math500" / "samples.jsonl").read_text().splitlines())}  # noqa: E731
    nat, lm = read("nat"), read("lm")
    assert [nat[i]["prompt"] for i in range(4)] == [lm[i]["prompt"] for i in range(4)]
    assert [nat[i]["response"] for i in range(4)] == [lm[i]["response"] for i in range(4)]  # greedy: identical


@pytest.mark.parametrize("extra, named", [
    (["--engine", "vllm"], "--engine vllm"), (["--tools", "python"], "--tools"), (["--wandb", "offline"], "--wandb"),
    (["--base-url", "http://127.0.0.1:1"], "--base-url"), (["--tensor-parallel", "2"], "--tensor-parallel"),
    (["--seed", "1", "--seed", "2"], "several --seed values"),
])
def test_lm_eval_bridge_refuses_what_it_cannot_honour(cli, tmp_path, tiny_model, extra, named):
    code, _, err = cli("eval", "--harness", "lm-eval", "--bench", "math500", "--model", str(tiny_model),
                       "--data-file", str(FIXTURE_DATA / "math500.jsonl"), "--out", str(tmp_path / "lm"), *extra)
    assert code == 2 and f"cannot honour {named}" in err, err
    assert not (tmp_path / "lm").exists()


def test_lm_eval_bridge_checks_grader_and_template_before_lm_eval_starts(cli, tmp_path, tiny_model):
    base = ["eval", "--harness", "lm-eval", "--bench", "math500", "--model", str(tiny_model),
            "--data-file", str(FIXTURE_DATA / "math500.jsonl"), "--out", str(tmp_path / "lm")]
    code, _, err = cli(*base, "--grader", "nope")
    assert code == 1 and "unknown grader 'nope'" in err
    code, _, err = cli(*base, "--template", "r1")
    assert code == 1 and "template 'r1'" in err
    assert not (tmp_path / "lm" / "lm_eval").exists()


def test_grade_audit_puts_graders_side_by_side(cli, tmp_path, tiny_model):
    out = tmp_path / "ev"
    assert cli(*_eval_args(tiny_model, out, limit=3, n=2))[0] == 0
    samples = out / "math500" / "samples.jsonl"
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    # two hand-made answers the graders judge differently: 2^{10} for 1024 (math-verify evaluates the
    # power, mathruler does not) and a plain match every grader accepts
    rows[0].update(response="so \\boxed{2^{10}}", gold="1024", finished=True)
    rows[1].update(response="so \\boxed{7}", gold="7", finished=True)
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text, err = cli("grade", "audit", str(out), "--workers", "0", "--json")
    assert code == 0, err
    res = json.loads(text)
    assert res["graders"] == ["math-verify@8", "math-verify-plain@1", "stare-official-3way@1", "mathruler@1"]
    (m,) = [v for v in res["benchmarks"].values() if v["benchmark"] == "math500"]
    assert m["samples"] == len(rows) and 0 < m["disagree"] < 1
    assert m["pairwise_agreement"]["math-verify@8 vs mathruler@1"] < 1
    dis = [json.loads(x) for x in (out / "audit" / "disagreements.jsonl").read_text().splitlines()]
    first = next(d for d in dis if d["gold"] == "1024")
    assert first["verdicts"]["math-verify@8"]["correct"] and not first["verdicts"]["mathruler@1"]["correct"]
    assert not any(d["gold"] == "7" for d in dis)
    with open(samples, "a") as f:  # a last line cut mid-write is named, never skipped silently (issue 47)
        f.write('{"key": "abc", "idx": 3, "sam')
    code, _, err = cli("grade", "audit", str(out), "--workers", "0")
    assert code == 1 and f"samples.jsonl:{len(rows) + 1}: not a JSON object" in err, err


def test_grade_audit_works_per_setting_and_takes_the_folder_lock(cli, tmp_path, tiny_model):
    """Issue 43, case 8: audit pooled every setting of a folder into one accuracy (384 samples for two
    evaluations of 128 and 64 problems, 128 of them duplicates) and took no lock (it graded most of a
    running evaluation)."""
    from stare_cli.core.runs import hold_run_lock

    out = tmp_path / "ev"
    assert cli(*_eval_args(tiny_model, out, limit=3, n=2))[0] == 0
    assert cli(*_eval_args(tiny_model, out, limit=2, n=2))[0] == 0  # a second setting: 2 problems, own samples
    code, text, err = cli("grade", "audit", str(out), "--workers", "0", "--json")
    assert code == 0, err
    entries = json.loads(text)["benchmarks"]
    assert sorted((v["problems"], v["samples"]) for v in entries.values()) == [(2, 4), (3, 6)]
    # each named by the identity fields that tell the settings apart (the problems evaluated): never one row
    assert all("problems=" in name for name in entries), list(entries)
    lock = hold_run_lock(out / "math500", "evaluated")  # a running evaluation of that folder
    try:
        code, _, err = cli("grade", "audit", str(out), "--workers", "0")
        assert code == 1 and "math500 is being" in err and str(os.getpid()) in err
    finally:
        lock.close()


def test_maj_at_k_equals_brute_force_and_maj_at_1_is_the_average():
    import itertools
    import random as _random
    from math import comb

    from benchmarks.evaluation.metrics import answer_classes, majority_at_k

    rng = _random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 8)
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(n)]
        correct = [a == "2" for a in answers]
        classes = answer_classes(answers)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(majority_correct([answers[i] for i in s], [correct[i] for i in s]) for s in subsets) / len(subsets)
            assert majority_at_k(classes, correct, k) == pytest.approx(brute)
        assert majority_at_k(classes, correct, 1) == pytest.approx(sum(correct) / n)
    # past 2,000 subsets: a seeded estimate over 1,000, within its sampling error of the exact value
    answers = ["1"] * 10 + ["2"] * 9 + ["3"] * 13
    correct = [a == "1" for a in answers]
    est = majority_at_k(answer_classes(answers), correct, 16)
    exact = sum(majority_correct([answers[i] for i in s], [correct[i] for i in s])
                for s in itertools.islice(itertools.combinations(range(32), 16), 0, None, 9973)) / len(
                    range(0, comb(32, 16), 9973))
    assert abs(est - exact) < 0.06  # 1,000 draws: standard error <= 0.016; the reference is a 1-in-9973 stride


def test_several_seeds_give_mean_and_std_over_seeds_and_compare_shows_them(cli, tmp_path, quick_toy):
    """Issue 30, item 17: `--seed 1 --seed 2 --seed 3` evaluates each seed as a setting of its own;
    results carry avg@N per seed, their mean and sample std (n - 1), and compare averages over them."""
    import statistics

    out = tmp_path / "ev"
    code, stdout, err = cli("eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "16", "-n", "2",
                            "--out", str(out), "--engine", "hf", "--workers", "0", "--seed", "1", "--seed", "2",
                            "--seed", "3", "--json")
    assert code == 0, err
    sp = json.loads(stdout)["toy:arith"]["over_seeds"]
    bench_dir = next(out.glob("*/results.json")).parent
    per_seed = [json.loads((bench_dir / f).read_text()) for f in sp["results"]]
    assert [r["settings"]["seed"] for r in per_seed] == sp["seeds"] == [1, 2, 3]
    assert sp["values"] == [r["metrics"]["avg@2"] for r in per_seed]
    assert len({r["key"] for r in per_seed}) == 3  # three settings, three sets of samples
    samples = [json.loads(x) for x in (bench_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 16 * 2
    assert sp["mean"] == pytest.approx(statistics.fmean(sp["values"]), abs=1e-12)
    assert sp["std"] == pytest.approx(statistics.stdev(sp["values"]), abs=1e-12)
    assert len(set(sp["values"])) > 1  # the toy at T=1 answers differently per seed: the spread is real
    code, table, err = cli("compare", str(out), "--format", "md")
    assert code == 0, err
    row = next(line for line in table.splitlines() if line.startswith("| arith"))
    assert f"| {sp['mean']:.1f} ± {sp['std']:.1f} |" in row and row.rstrip().endswith("| 3 |"), table


def test_a_regrade_keeps_the_per_seed_record(cli, tmp_path, quick_toy):
    """Issue 43, case 4: `--regrade` of a multi-seed evaluation dropped `over_seeds`, so compare then showed
    one seed fewer (41.4 ± 6.1 over 2 became 45.7 over 1), even with the same grader."""
    out = tmp_path / "ev"
    code, stdout, err = cli("eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "8", "-n", "2",
                            "--out", str(out), "--engine", "hf", "--workers", "0", "--seed", "1", "--seed", "2", "--json")
    assert code == 0, err
    before = json.loads(stdout)["toy:arith"]["over_seeds"]
    for grader in ("math-verify", "stare-official-3way"):  # the same grader, then another
        code, text, err = cli("eval", "--regrade", str(out), "--grader", grader, "--workers", "0", "--json")
        assert code == 0, err
        bench_dir = next(out.glob("*/results.json")).parent
        res = json.loads((bench_dir / "results.json").read_text())
        sp = res["over_seeds"]
        assert sp["seeds"] == [1, 2] and res["grader"].startswith(grader + "@")
        assert all(f.endswith(f"-{grader}.json") for f in sp["results"])
        if grader == "math-verify":
            assert sp["values"] == before["values"]
        js = json.loads(cli("compare", str(out), "--format", "json")[1])
        # one row per grader (the ledger keeps both graders' records), each over both seeds
        (row,) = [r for r in js["rows"] if r["identity"]["toy:arith"]["grader"].startswith(grader + "@")]
        assert row["cells"]["toy:arith"]["seeds"] == 2
        assert len(js["rows"]) == (1 if grader == "math-verify" else 2)


def test_results_of_incomplete_samples_are_refused_not_computed_on_fewer(cli, tmp_path, quick_toy):
    """Issue 43, case 9: a samples file missing one row made `--regrade` report avg@3 for an n=4 setting."""
    out = tmp_path / "ev"
    assert cli("eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "4", "-n", "4", "--out", str(out),
               "--engine", "hf", "--workers", "0")[0] == 0
    samples = next(out.glob("*/samples.jsonl"))
    lines = samples.read_text().splitlines()
    samples.write_text("\n".join(lines[:-1]) + "\n")  # the last problem's fourth sample is gone
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "math-verify", "--workers", "0")
    assert code == 1 and "incomplete" in err and "has 3 of its 4 samples" in err
    # one whole problem gone: named as well
    samples.write_text("\n".join(ln for ln in lines if json.loads(ln)["idx"] != 2) + "\n")
    code, _, err = cli("eval", "--regrade", str(out), "--grader", "math-verify", "--workers", "0")
    assert code == 1 and "3 of the 4 problems have samples" in err


def test_a_seed_given_twice_is_refused(cli, tmp_path, quick_toy):
    code, _, err = cli("eval", "--bench", "toy:arith", "--model", str(quick_toy), "--limit", "2", "--out",
                       str(tmp_path / "ev"), "--seed", "1", "--seed", "1")
    assert code == 1 and "each seed once" in err


def test_an_overlong_problem_is_refused_before_any_tokenizer(cli, tmp_path, tiny_model):
    """Issue 47, item 2: one 10 MB problem row grew `stare eval` to 23 GB (0.1 MB: minutes, deaf to SIGTERM).
    A row over 32,768 characters is refused by name, within a second, before the model loads."""
    import time

    data = tmp_path / "big.jsonl"
    rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "x" * 100_000 + " What is 2+2?", "answer": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = time.time()
    code, _, err = cli(*_eval_args(tiny_model, tmp_path / "ev", data=data))
    assert code == 1 and f"{data}:2" in err and "100,013 characters" in err and "32,768" in err, err
    assert time.time() - t < 10 and not (tmp_path / "ev").exists()


def test_eval_says_where_its_results_went_and_names_the_folder_after_a_short_name(cli, tmp_path, monkeypatch):
    """Issue 44, item 5: `stare eval` never printed its output folder (nor in --json), and the folder was
    named after the model's absolute cache path."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("eval", "--bench", "toy:arith", "--model", "toy:arith", "--limit", "2", "-n", "1",
                         "--workers", "0", "--engine", "hf", "--json")
    assert code == 0, err
    where = json.loads(out)["toy:arith"]["out"]
    assert Path(where).parts[:2] == ("evals", "toy-arith"), where  # not evals/work__main__benchmarks__...
    assert (tmp_path / where / "results.json").exists() and f"toy:arith: results and samples in {where}" in err
