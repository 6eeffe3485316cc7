"""Multi-turn tool rollouts: code blocks are run, observations appended with loss-mask 0, and masked
tokens never reach the loss, the entropy or the STARE token sets."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from baselines import stare_token_weights
from baselines.losses import ppo_clip_loss
from benchmarks.generation.engines import Sample
from benchmarks.generation.tools import ToolSpec, find_call, multiturn, observation_text
from stare_cli.backends.forward import pack
from benchmarks.generation.sandbox import Limits

enc = lambda s: [ord(c) for c in s]  # noqa: E731  a character-level "tokenizer" for the scripted model
dec = lambda ids: "".join(chr(i) for i in ids if i < 0x110000)  # noqa: E731
EOS = 0x110000


def test_find_call_formats():
    assert find_call("I will compute.\n```python\nprint(6*7)\n```", "markdown") == "print(6*7)"
    assert find_call("text ```python\nx=1\n``` more text", "markdown") is None  # not at the end
    assert find_call("<code>print(1)</code>", "xml") == "print(1)"
    assert find_call("no code here", "xml") is None


def _scripted(turns):
    """A fake model: each call continues every context with the next scripted turn."""
    calls = []

    def turn(contexts, budgets, stop, seed):
        k = len(calls)
        calls.append(contexts)
        text, eos = turns[k]
        return [(enc(text) + ([EOS] if eos else []), eos) for _ in contexts]

    return turn, calls


def test_multiturn_runs_code_and_masks_the_observation():
    turn, calls = _scripted([("Let me compute.\n```python\nprint(6*7)\n```", False), (" so \\boxed{42}", True)])
    spec = ToolSpec(limits=Limits(cpu_s=2, wall_s=5))
    (tr,) = multiturn([enc("Q: 6*7?\n")], 200, spec, turn, enc, dec, seed=0)
    obs = observation_text("42", "markdown")
    text = dec(tr.response_ids)
    assert text == "Let me compute.\n```python\nprint(6*7)\n```" + obs + " so \\boxed{42}"
    assert tr.finished and tr.calls == 1 and tr.errors == 0 and tr.turns == 2
    first = len(enc("Let me compute.\n```python\nprint(6*7)\n```"))
    assert tr.loss_mask == [1] * first + [0] * len(enc(obs)) + [1] * (len(enc(" so \\boxed{42}")) + 1)
    # The second turn saw the observation in its context.
    assert dec(calls[1][0]).endswith(obs)


def test_tool_errors_are_observations_and_turns_are_bounded():
    script = [("```python\n1/0\n```", False)] * 3
    turn, _ = _scripted(script)
    (tr,) = multiturn([enc("Q\n")], 10_000, ToolSpec(max_turns=2, limits=Limits(cpu_s=2, wall_s=5)), turn, enc, dec)
    assert tr.calls == 2 and tr.errors == 2 and not tr.finished
    assert "ZeroDivisionError" in dec(tr.response_ids)


def test_token_budget_cuts_the_observation():
    turn, _ = _scripted([("```python\nprint('x' * 500)\n```", False)])
    (tr,) = multiturn([enc("Q\n")], 60, ToolSpec(limits=Limits(cpu_s=2, wall_s=5)), turn, enc, dec)
    assert len(tr.response_ids) == 60 and not tr.finished


def test_masked_observation_tokens_stay_out_of_loss_entropy_and_stare():
    # Response: 3 model tokens, 3 observation tokens (mask 0), 2 model tokens.
    s = Sample(text="", response_ids=[5, 6, 7, 8, 9, 10, 11, 12], prompt_ids=[1, 2], loss_mask=[1, 1, 1, 0, 0, 0, 1, 1])
    batch = pack([s, Sample(text="", response_ids=[5, 6], prompt_ids=[3])], pad_id=0, device="cpu")
    mask = batch["response_mask"]
    assert mask[0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1] and mask[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    adv = torch.ones_like(mask)
    old = torch.full_like(mask, -0.1)
    old[0, 3:6] = -50.0  # the observation tokens are by far the most "surprising"
    w = stare_token_weights(adv, old, mask, P=0.2, W=3.0)
    assert (w[0, 3:6] == 1).all() and (w == 3.0).sum() == 2  # ceil(0.2 * 7 model tokens) = 2, none masked
    ent = torch.rand_like(mask)
    ent[0, 3:6] = 100.0
    H = float((ent * mask).sum() / mask.sum())
    assert H < 1.0  # the batch entropy ignores the observation tokens
    lp = old.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(lp, old.detach(), adv, mask)
    loss.backward()
    assert (lp.grad[0, 3:6] == 0).all() and (lp.grad[0, :3] != 0).all()


def test_eval_with_tools_flag_runs(cli, tmp_path):
    from conftest import FIXTURE_DATA
    from benchmarks.data.toy import make_random_init

    model = make_random_init(tmp_path / "m")
    code, out, err = cli("eval", "--bench", "amc23", "--model", str(model), "--limit", "2", "-n", "1",
                         "--max-tokens", "8", "--data-file", str(FIXTURE_DATA / "amc23.jsonl"), "--engine", "hf",
                         "--workers", "0", "--tools", "python", "--out", str(tmp_path / "ev"), "--json")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "ev" / "amc23" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("tool_calls" in r for r in rows)


def test_tiny_tool_recipe_trains_through_the_cli(cli, tmp_path):
    """The tool toy after a short warm-up already calls the tool sometimes; two RL steps run with
    real sandboxed calls, and the observation tokens are masked in the saved samples' accounting."""
    from benchmarks.data.toy import build_model, build_tokenizer, sft

    torch.set_num_threads(1)
    tok = build_tokenizer("tool")
    model = build_model(len(tok), seed=0)
    sft(model, tok, steps=200, batch=32, lr=3e-3, seed=0, log_every=0, task="tool")
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    tok.save_pretrained(tmp_path / "m")
    args = ["train", "--recipe", "tiny/tool", "--method", "stare-o1", "--out", str(tmp_path / "runs"),
            "-o", f"model.path={tmp_path / 'm'}", "-o", "optim.total_steps=2", "-o", "rollout.gen_batch_size=8",
            "-o", "optim.train_batch_size=8", "-o", "optim.mini_batch_size=8", "-o", "optim.micro_batch_size=64",
            "-o", "eval.limit=8", "-o", "eval.every=0", "-o", "method.dynamic_sampling=false"]
    code, out, err = cli(*args)
    assert code == 0, err
    run = Path(out.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["tools/calls_per_response"] for r in rows) > 0
    assert all(r["tools/error_rate"] < 0.5 for r in rows if r["tools/calls_per_response"] > 0)
    assert "eval/toy:tool/acc" in rows[-1]


# ---------------------------------------------------------------------------------------- hermes
# A Qwen2.5-style chat template (its tools section and tool turns, shortened): what a hermes model has.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}"
    "You are a helpful assistant.{% endif %}\n\n# Tools\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\n"
    "{%- else %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}"
    "You are a helpful assistant.{% endif %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_like_tokenizer():
    from benchmarks.data.toy import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = QWEN_LIKE
    tok.eos_token = "<eos>"
    return tok


def test_hermes_calls_are_parsed_and_malformed_ones_named():
    from benchmarks.generation.tools import InvalidCall

    call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    assert find_call("Let me compute.\n" + call, "hermes") == "print(6*7)"
    as_string = '<tool_call>{"name": "code_interpreter", "arguments": "{\\"code\\": \\"x=1\\"}"}</tool_call>'
    assert find_call(as_string, "hermes") == "x=1"  # arguments as a JSON string, as some models write them
    assert find_call('<tool_call>{"name": "code_interpreter"', "hermes") is None  # not closed yet
    for bad in ('<tool_call>print(1)</tool_call>', '<tool_call>{"name": "search", "arguments": {"q": 1}}</tool_call>'):
        try:
            find_call(bad, "hermes")
            raise AssertionError("not refused: " + bad)
        except InvalidCall as e:
            assert "code_interpreter" in str(e)


def test_a_hostile_call_nested_a_thousand_levels_deep_is_a_malformed_call_not_a_crash():
    """Issue 68, reliability 1: JSON nested ~1,000 levels raised RecursionError out of find_call (and so out of
    multiturn and the vLLM path's `closed()`), which catch InvalidCall: one response stopped a run."""
    from benchmarks.generation.tools import InvalidCall

    deep = '<tool_call>{"name": "code_interpreter", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}</tool_call>"
    try:
        find_call("Let me compute.\n" + deep, "hermes")
        raise AssertionError("not refused")
    except InvalidCall as e:
        assert "code_interpreter" in str(e)
    # a rollout answers it as a malformed call and goes on
    turn, _ = _scripted([(deep, False), ("The answer is 42.", True)])
    (tr,) = multiturn([enc("Q\n")], 200_000, ToolSpec(format="hermes", limits=Limits(cpu_s=2, wall_s=5)), turn, enc,
                      dec, seed=0, tokenizer=_qwen_like_tokenizer())
    assert (tr.calls, tr.errors, tr.finished) == (1, 1, True)


def test_hermes_rollout_appends_the_chat_templates_tool_turn_and_answers_bad_calls_without_running():
    tok = _qwen_like_tokenizer()
    ok = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call>'
    turn, _ = _scripted([(ok, False), ("<tool_call>not json</tool_call>", False), ("The answer is 42.", True)])
    spec = ToolSpec(format="hermes", limits=Limits(cpu_s=2, wall_s=5))
    (tr,) = multiturn([enc("Q\n")], 2000, spec, turn, enc, dec, seed=0, tokenizer=tok)
    text = dec(tr.response_ids)
    first_obs = "<eos>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ok + first_obs in text  # the assistant turn closed, the template's tool turn, the next header
    assert "<tool_response>\nerror: not a code_interpreter call" in text
    assert (tr.calls, tr.errors, tr.finished) == (2, 1, True)
    masked = dec([t for t, m in zip(tr.response_ids, tr.loss_mask) if m == 0])
    assert masked.startswith("<eos>\n<|im_start|>user\n<tool_response>\n42")  # observations: loss-mask 0


def test_hermes_prompt_is_the_chat_templates_tools_section_as_verl_renders_it():
    from benchmarks.generation.templates import build_prompt
    from benchmarks.generation.tools import SCHEMA

    tok = _qwen_like_tokenizer()
    spec = ToolSpec(format="hermes")
    ours = build_prompt("What is 6*7?", "paper", tok, True, spec)
    # verl's tool agent loop: apply_chat_template(messages, tools=[schema of our verl tool], add_generation_prompt)
    from stare_cli.backends import verl_tools  # noqa: F401 - verl is installed in the test environment

    theirs = tok.apply_chat_template([{"role": "user", "content": "What is 6*7?\nPlease reason step by step, and put "
                                       "your final answer within \\boxed{}."}], tools=[verl_tools.SCHEMA],
                                     tokenize=False, add_generation_prompt=True)
    assert ours == theirs and '"name": "code_interpreter"' in ours and verl_tools.SCHEMA is SCHEMA
    md = build_prompt("What is 6*7?", "paper", tok, True, ToolSpec(format="markdown"))
    assert "write it in a ```python ... ``` block" in md and "<tools>" not in md  # the other protocols: a system turn
