"""Multi-turn tool use: the model writes code in a fenced block, generation stops there, the
sandbox's output is appended as an observation, and generation continues, up to max turns and
max tokens. Observation tokens carry loss-mask 0: they never enter the loss, the entropy or the
STARE token sets (all of which read the response mask).

`multiturn()` is independent of the generation engine: it takes a `turn` function that continues
a batch of token contexts until a stop string or EOS, so the HF engine and tests share it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from stare_cli.sandbox import Limits, run_python

FORMATS = {"markdown": ("```python\n", "\n```"), "xml": ("<code>", "</code>")}


@dataclass(frozen=True)
class ToolSpec:
    format: str = "markdown"
    max_turns: int = 4
    limits: Limits = Limits()
    parallel: int = 4  # tool processes at once


def find_call(text: str, fmt: str) -> Optional[str]:
    """The code of a block that the text ends with (None when it does not end with a closed block)."""
    opener, closer = FORMATS[fmt]
    stripped = text.rstrip()
    if not stripped.endswith(closer.strip()):
        return None
    start = stripped.rfind(opener.strip())
    if start < 0:
        return None
    code = stripped[start + len(opener.strip()) : len(stripped) - len(closer.strip())]
    return code.strip("\n")


def observation_text(output: str, fmt: str) -> str:
    return f"\n```output\n{output}\n```\n" if fmt == "markdown" else f"\n<output>{output}</output>\n"


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


def multiturn(prompt_ids: Sequence[list[int]], max_new_tokens: int, spec: ToolSpec, turn: TurnFn,
              encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], seed: int = 0) -> list[ToolTrace]:
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
            code = find_call(decode(new), spec.format)
            if code is None or len(tr.response_ids) >= max_new_tokens or t == spec.max_turns:
                continue  # cut at the token budget, or no call: the response ends here (unfinished)
            calls.append((i, code))
        # Tool calls of one turn run side by side: each is a separate, limited process.
        with ThreadPoolExecutor(max_workers=max(1, min(spec.parallel, len(calls)))) as pool:
            observations = list(pool.map(lambda c: run_python(c[1], spec.limits), calls))
        still = []
        for (i, _), obs in zip(calls, observations):
            tr = traces[i]
            tr.calls += 1
            tr.errors += int(obs.status not in ("ok", "output-truncated"))
            obs_ids = encode(observation_text(obs.text(), spec.format))[: max_new_tokens - len(tr.response_ids)]
            tr.response_ids += obs_ids
            tr.loss_mask += [0] * len(obs_ids)
            if len(tr.response_ids) < max_new_tokens:
                still.append(i)
        active = still
    return traces
