"""Multi-turn tool use: the model writes code in a fenced block, generation stops there, the
sandbox's output is appended as an observation, and generation continues, up to max turns and
max tokens. Observation tokens carry loss-mask 0: they never enter the loss, the entropy or the
STARE token sets (all of which read the response mask).

Protocols (`rollout.tools.format`), each with the system prompt that tells the model about the tool:
- `hermes`: `<tool_call>{"name": "code_interpreter", "arguments": {"code": "..."}}</tool_call>`, the
  output as the chat template's tool turn (`<tool_response>` in Qwen's), the tool described by the
  chat template's own tool section (`apply_chat_template(..., tools=[SCHEMA])`): what verl's
  tool_agent loop does, so both backends run the same protocol. Needs a chat template with tools.
- `markdown` (```python ... ``` then ```output ... ```) and `xml` (<code>...</code> then
  <output>...</output>): the embedded backend only; the system prompt is TOOL_PROMPTS[format].
One difference from verl with hermes: generation stops at `</tool_call>` here, so the assistant
turn's end token (e.g. `<|im_end|>`) comes with the observation (loss-mask 0); verl lets the model
emit it (loss-mask 1).

`multiturn()` is independent of the generation engine: it takes a `turn` function that continues
a batch of token contexts until a stop string or EOS, so the HF engine and tests share it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from benchmarks.generation.sandbox import Limits, Observation, run_python

FORMATS = {"markdown": ("```python\n", "\n```"), "xml": ("<code>", "</code>"), "hermes": ("<tool_call>", "</tool_call>")}
TOOL_NAME = "code_interpreter"
SCHEMA = {  # the tool as an OpenAI function (hermes: rendered by the chat template; verl's tool schema)
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code in a sandbox and return what it prints (stdout and stderr).",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code"}},
                       "required": ["code"]},
    },
}
TOOL_PROMPTS = {
    "markdown": "You can run Python code: write it in a ```python ... ``` block and stop; what it prints is "
                "shown to you in a ```output ... ``` block. Use it for calculations you are unsure of.",
    "xml": "You can run Python code: write it between <code> and </code> and stop; what it prints is shown to "
           "you between <output> and </output>. Use it for calculations you are unsure of.",
}


@dataclass(frozen=True)
class ToolSpec:
    format: str = "markdown"
    max_turns: int = 4
    limits: Limits = Limits()
    parallel: int = 4  # tool processes at once
    system_prompt: Optional[str] = None  # None: the protocol's own (TOOL_PROMPTS, or the chat template's tools)


def tool_limits(t) -> Limits:
    """The sandbox limits of a recipe's rollout.tools section (stare_cli/core/config.py: ToolsConfig)."""
    return Limits(cpu_s=t.cpu_s, wall_s=t.wall_s, memory_mb=t.memory_mb, output_bytes=t.output_bytes,
                  file_mb=t.file_mb, nproc=t.nproc, python=t.python, unsafe_no_isolation=t.unsafe_no_isolation)


def tool_spec(t) -> Optional[ToolSpec]:
    """The multi-turn settings of a recipe's rollout.tools section (None when tools are off)."""
    if not t.enable:
        return None
    return ToolSpec(format=t.format, max_turns=t.max_turns, limits=tool_limits(t), system_prompt=t.system_prompt)


class InvalidCall(ValueError):
    """A closed tool call whose content is not a call of the tool (hermes: not JSON, no code)."""


def find_call(text: str, fmt: str) -> Optional[str]:
    """The code of a block that the text ends with (None when it does not end with a closed block).
    Raises InvalidCall for a closed hermes call that does not hold {"name", "arguments": {"code"}}."""
    opener, closer = FORMATS[fmt]
    stripped = text.rstrip()
    if not stripped.endswith(closer.strip()):
        return None
    start = stripped.rfind(opener.strip())
    if start < 0:
        return None
    code = stripped[start + len(opener.strip()) : len(stripped) - len(closer.strip())]
    if fmt != "hermes":
        return code.strip("\n")
    try:
        call = json.loads(code)
        args = call.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
        if call.get("name") != TOOL_NAME or not isinstance(args.get("code"), str):
            raise ValueError
        return args["code"]
    except (ValueError, AttributeError, TypeError, RecursionError):  # RecursionError: JSON nested ~1,000 deep
        raise InvalidCall(f'not a {TOOL_NAME} call: expected {{"name": "{TOOL_NAME}", "arguments": {{"code": ...}}}}') from None


def observation_text(output: str, fmt: str, tokenizer=None) -> str:
    """The text appended after a call: the output in the protocol's form (hermes: the end of the
    assistant turn, then the chat template's tool turn and the next assistant turn's header)."""
    if fmt == "markdown":
        return f"\n```output\n{output}\n```\n"
    if fmt == "xml":
        return f"\n<output>{output}</output>\n"
    return (tokenizer.eos_token or "") + tool_turn(tokenizer, output)


def tool_turn(tokenizer, output: str) -> str:
    """The chat template's rendering of a tool message with the generation prompt after it, without
    the default system prompt some templates put first (as verl's tool agent loop does)."""
    with_tool = tokenizer.apply_chat_template([{"role": "tool", "content": output}], tokenize=False,
                                              add_generation_prompt=True)
    empty = tokenizer.apply_chat_template([{"role": "tool", "content": ""}], tokenize=False, add_generation_prompt=True)
    marker = with_tool.find("<tool_response>")
    if marker < 0:  # a template without Qwen's markers: drop what an empty tool message adds before its content
        prefix = empty.split("\n\n", 1)[0] if "\n\n" in empty else ""
        return "\n" + with_tool[len(prefix):]
    start = with_tool.rfind("<|im_start|>", 0, marker)
    return "\n" + with_tool[start if start >= 0 else marker:]


def system_prompt(spec: ToolSpec) -> Optional[str]:
    """The text that tells the model about the tool (hermes: None, the chat template's tools section)."""
    if spec.system_prompt is not None:
        return spec.system_prompt or None
    return TOOL_PROMPTS.get(spec.format)


@dataclass
class ToolTrace:
    response_ids: list[int]
    loss_mask: list[int]
    calls: int = 0
    errors: int = 0
    turns: int = 1
    finished: bool = False


# turn(contexts, max_new_tokens, stop_string, seed) -> [(new_ids, ended_with_eos)]
TurnFn = Callable[[list[list[int]], list[int], str, int], list[tuple[list[int], bool]]]


def _run(code, limits: Limits) -> Observation:
    if isinstance(code, InvalidCall):
        return Observation(f"error: {code}", -1, "error", 0.0, "none")
    return run_python(code, limits)


def multiturn(prompt_ids: Sequence[list[int]], max_new_tokens: int, spec: ToolSpec, turn: TurnFn,
              encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], seed: int = 0,
              tokenizer=None) -> list[ToolTrace]:
    """Roll out every prompt with tool calls; returns one trace per prompt (in order)."""
    _, closer = FORMATS[spec.format]
    traces = [ToolTrace([], []) for _ in prompt_ids]
    active = list(range(len(prompt_ids)))
    for t in range(spec.max_turns + 1):
        if not active:
            break
        budgets = [max_new_tokens - len(traces[i].response_ids) for i in active]
        outs = turn([list(prompt_ids[i]) + traces[i].response_ids for i in active], budgets, closer, seed + t)
        calls: list[tuple[int, str]] = []
        for i, (new, eos) in zip(active, outs):
            tr = traces[i]
            tr.response_ids += new
            tr.loss_mask += [1] * len(new)
            tr.turns = t + 1
            if eos:
                tr.finished = True
                continue
            try:
                code = find_call(decode(new), spec.format)
            except InvalidCall as e:
                code = e  # answered with the error, without running anything
            if code is None or len(tr.response_ids) >= max_new_tokens or t == spec.max_turns:
                continue  # cut at the token budget, or no call: the response ends here (unfinished)
            calls.append((i, code))
        # Tool calls of one turn run side by side: each is a separate, limited process.
        with ThreadPoolExecutor(max_workers=max(1, min(spec.parallel, len(calls)))) as pool:
            observations = list(pool.map(lambda c: _run(c[1], spec.limits), calls))
        still = []
        for (i, _), obs in zip(calls, observations):
            tr = traces[i]
            tr.calls += 1
            tr.errors += int(obs.status not in ("ok", "output-truncated"))
            obs_ids = encode(observation_text(obs.text(), spec.format, tokenizer))[: max_new_tokens - len(tr.response_ids)]
            tr.response_ids += obs_ids
            tr.loss_mask += [0] * len(obs_ids)
            if len(tr.response_ids) < max_new_tokens:
                still.append(i)
        active = still
    return traces
