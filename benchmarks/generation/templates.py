"""Prompt templates: how a problem becomes the text a model continues.

- paper: the problem plus "Please reason step by step, and put your final answer within \\boxed{}."
  as one user turn through the model's chat template (plain text when it has none).
- plain: the same text without a chat template, for base models.
- r1: DeepSeek-R1 style; the chat template's user turn, with the assistant turn opened by
  "<think>\\n" (R1-Zero's "User: ... Assistant: <think>" text when there is no chat template).
- raw: the problem and a newline (the CPU toy, whose tokenizer knows only its own words).
- short: the problem plus "Answer with a single number." as one user turn through the chat template
  (short word problems for small real models, which ramble under the paper's instruction).
The benchmark files already end with the instruction sentence: it is never added twice.
With a tool (`tools`, a benchmarks.generation.tools.ToolSpec), the prompt also tells the model how to call it:
hermes through the chat template's own tools section (`tools=[SCHEMA]`, as verl renders it), the
other protocols as a system message (or a first line without a chat template). `raw` adds nothing
(the toy's vocabulary cannot spell it; its warm-up taught it the protocol).
"""

from __future__ import annotations

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SHORT_INSTRUCTION = "Answer with a single number."
TEMPLATES = ("paper", "plain", "r1", "raw", "short")
R1_SYSTEM = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer."
)


def with_instruction(problem: str) -> str:
    """`problem + "\n" + INSTRUCTION`, exactly as the official data pipeline builds it (no stripping:
    trailing whitespace stays, ../shared/notes/official-semantics.md); a problem that already ends
    with the instruction (our benchmark files) is used as it is."""
    return problem if problem.rstrip().endswith(INSTRUCTION) else f"{problem}\n{INSTRUCTION}"


def user_text(problem: str, template: str) -> str:
    """The user turn's text for `problem` under `template` (the chat template, if any, goes around it)."""
    if template == "raw":
        return problem
    if template == "short":
        p = problem.rstrip()
        return p if p.endswith(SHORT_INSTRUCTION) else f"{p}\n{SHORT_INSTRUCTION}"
    return with_instruction(problem)


def has_chat_template(tokenizer, use_chat_template: bool = True) -> bool:
    return use_chat_template and bool(getattr(tokenizer, "chat_template", None))


def build_prompt(problem: str, template: str, tokenizer=None, use_chat_template: bool = True, tools=None) -> str:
    """The prompt text for one problem (special tokens of the chat template included)."""
    if template == "raw":
        return f"{problem}\n"
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template '{template}'; valid: {', '.join(TEMPLATES)}")
    text = user_text(problem, template)
    chat = tokenizer is not None and has_chat_template(tokenizer, use_chat_template)
    tool_text, schemas = _tool_parts(tools, chat)
    if template == "plain" or (template in ("paper", "short") and not chat):
        return f"{tool_text}\n{text}\n" if tool_text else f"{text}\n"
    system = [{"role": "system", "content": tool_text}] if tool_text else []
    kw = {"tools": schemas} if schemas else {}
    if template in ("paper", "short"):
        return tokenizer.apply_chat_template([*system, {"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, **kw)
    if template == "r1":
        if not chat:
            return f"{R1_SYSTEM}\n{tool_text + chr(10) if tool_text else ''}User: {text}\nAssistant: <think>\n"
        s = tokenizer.apply_chat_template([*system, {"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True, **kw)
        return s if s.rstrip().endswith("<think>") else s + "<think>\n"
    raise ValueError(f"unknown prompt template '{template}'; valid: {', '.join(TEMPLATES)}")


def _tool_parts(tools, chat: bool) -> tuple[str, list]:
    """(system text, tool schemas for the chat template) for a tool spec (or none)."""
    if tools is None:
        return "", []
    from benchmarks.generation.tools import SCHEMA, system_prompt

    if tools.format == "hermes":
        if not chat:
            raise ValueError("the hermes tool protocol needs a chat template (the tokenizer has none)")
        return (tools.system_prompt or ""), [SCHEMA]
    return system_prompt(tools) or "", []
