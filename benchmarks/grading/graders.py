"""Grading: extract a final answer, verify it against the gold; several graders by name.

`GRADERS` maps a name to a grader (every verdict records `name@version`):
- `math-verify` (ours, the default for evaluation and the `math-verify` training reward): the
  extraction and normalisation below, then math-verify;
- `math-verify-plain`: math-verify's own defaults on the whole response (parse + verify);
- `stare-official`: the official STARE scorer's accuracy as its reward loop ran it (mathruler on the
  official answer extraction; see benchmarks/grading/official.py for why the math-verify checks never
  count there);
- `stare-official-3way`: the official scorer's three checks as written (math-verify twice, mathruler);
- `mathruler`: mathruler's grade_answer on the last \\boxed{} content.

Our grader (`math-verify`):
- Extraction gives answer candidates, tried in order: the final answer, and, when the final paragraph
  has two or more boxes, all of them joined by ", " (`\\boxed{2} and \\boxed{3}` for the gold `2, 3`).
  The final answer is the last closed \\boxed{...} (or \\fbox{...}), unless a stated answer ("the
  answer is X", "Final Answer: X") comes after it; without a box, that stated answer; else the last
  inline math of the final paragraph (`$...$`, `\\(...\\)`, `\\[...\\]`); else the last number. A final
  box that never closes is no answer (the response was cut), never a fallback. A stated answer ends
  at the end of its line or at a full stop followed by a space (decimal points stay); when nothing
  follows the phrase on its line, it is the next non-empty line (often display math); a sentence
  ("The largest $n$ is 34") is reduced to what it states, and a statement with nothing answer-like
  ("I hope this answer is helpful!") is none. A boxed AMC choice with its value
  (`\\textbf{(C)}\\ 12`) also offers the value. An escaped dollar (`\\$5`) is currency, not math.
  A remark after the final box ("this answer is right", "the answer is larger than ...") does not replace
  it, and a clause after a stated answer (", which ...", " since ...") is cut off. Boxes of the final
  paragraph offered as alternatives ("\\boxed{2} or \\boxed{5}") count only together, as a list (the
  strict reading of a hedge). An inline `$...$` span that is prose without LaTeX (unescaped dollar
  amounts: "$3 and she pays with $") is not math. "negative 4" is -4. Without a number in the final
  paragraph, "infinitely many" or "no (real) solution(s)" there is the answer (`answer-words`), and so it is
  when the final sentence says it after its numbers, unless it is a quantifier ("for infinitely many n ...").
  Version 8: a count in words in the final sentence with no digit ("There are twelve eggs left", not "one
  more case") is the answer (`number-words`), and a stated answer in words ("the answer is three",
  "negative four") is its number; the Unicode minus (U+2212) is a minus; a mixed number in prose ("2 3/4
  cups") is 11/4, not its fraction; "6.4 million" is 6400000; "the correct option/choice is **B**" states
  B; a degree sign (`\\degree`, `^\\circ`, `°`) after a number is dropped on both sides; a response that
  opens `<think>` and never closes it (cut inside its reasoning) is no answer (`unclosed-think`).
  Each verdict records how the answer was found. `boxed_only` (training rewards): the box candidates only.
- Verification: thousands separators inside numbers are removed (`3\\,159`, `1{,}000`, `1,000`; not
  `0,111`); other commas make a list (`1,3`), which math-verify compares as a set (so `13` is not
  `1,3`, and `3, 1` is, and the decimal `1.3` is not), except an answer's decimal comma beside a gold's
  decimal point (`1000,99` = `1000.99`) and a gold that can only be a decimal comma (`0,111`, `1,22`); two plain
  numbers are compared with a relative tolerance of 1e-6 and nothing else (math-verify rounds to 6
  decimal places, which makes 0.0000005 equal 0.000000389); otherwise math-verify on
  `\\boxed{answer}` vs `\\boxed{gold}`, then the same with a trailing percent sign dropped on both
  sides (the Qwen2.5-Math convention, 50\\% = 50). Scientific notation `4.5e33` is rewritten to
  `4.5\\times10^{33}` on both sides (math-verify reads `e` as Euler's number); "pct"/"percent" as `\\%`.
  Words and sets of one value are one form: "infinitely many" is `\\infty`; `\\varnothing`, `\\{\\}`,
  "no solution" are `\\emptyset`. When math-verify says no, one or two inequalities on a single-letter
  variable are compared again as the interval they describe (`-2 < x \\le 3` and `(-2, 3]`: "interval").
- Time limits: math-verify's own timeouts use signal.alarm and only work on a process's main
  thread; `Grader` runs grading in worker processes (whose main thread does the work) and also
  enforces a hard wall-clock limit per item from the parent, killing the hung worker alone. A
  pathological answer grades as wrong with a reason; it never hangs or crashes a run.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

from benchmarks.grading.workers import WorkerPool

MAX_RESPONSE_CHARS = 20_000  # the fallbacks (no \boxed{}) look only at the end of a response
MAX_ANSWER_CHARS = 1_000


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: Optional[str]
    method: str  # boxed | answer-phrase | last-number | none | official | whole-response
    reason: str  # exact | integer | math-verify | mathruler | mismatch | no-answer | timeout | error: ... | too-long
    grader: str = ""  # name@version of the grader that decided (GRADERS)

    def to_dict(self) -> dict:
        return asdict(self)


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PHRASE = re.compile(r"(?:final answer|the answer|answer|(?:correct|right)\s+(?:option|choice))\s*(?:is|:)", re.IGNORECASE)
# A phrase about an answer already given, not stating one: "this answer is right", "that answer is ..."
_REMARK_SUBJECT = re.compile(r"\b(?:this|that|our|my|your|which|the above|each|every)\s+(?:final\s+)?$", re.IGNORECASE)
# What follows "answer is" when it judges the answer instead of stating it
_EVALUATIVE = re.compile(r"\s*(?:indeed\s+|also\s+|clearly\s+|not\s+)?(?:right|correct|wrong|incorrect|valid|invalid|"
                         r"reasonable|consistent|plausible|larger|smaller|greater|less|bigger|positive|negative\b(?!\s*\d)|"
                         r"an? (?:integer|whole|prime|even|odd|positive|negative)|confirmed|verified|"
                         r"checked|as expected|the same)\b", re.IGNORECASE)
# A clause after a stated answer that explains it ("8, which is 2 more than 6"): not part of the answer
_CLAUSE = re.compile(r",?\s+(?:which|since|because|as this|so that|where|this is|that is)\b", re.IGNORECASE)
# Boxes offered as alternatives: "\boxed{2} or \boxed{5}"
_HEDGE = re.compile(r"\bor\b|\beither\b", re.IGNORECASE)
_NEGATIVE_WORD = re.compile(r"^(?:negative|minus)\s+(?=\d)", re.IGNORECASE)
# Inline or display math; an escaped dollar (`\\$`, currency) is text, never a delimiter.
_INLINE = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$(.+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# A number in prose: thousands groups (1,000.5), a decimal comma (2,74; 0,111), a fraction (3/4)
# (not inside a word: "AZYUK2A" holds no number), a leading decimal point (.4)
_NUMBER = re.compile(r"(?<![A-Za-z\d.])-?(?:\d+(?:(?:,\d{3})+(?![\d,])(?:\.\d+)?|,\d+(?![\d,])|\.\d+)?|\.\d+)(?:/\d+)?")
_INT = re.compile(r"^[-+]?\d+$")
_CHOICE = re.compile(r"^(?:\\textbf\{\s*\(?([A-E])\)?\s*\}|\\text\{\s*\(?([A-E])\)?\s*\}|\(([A-E])\))\s*(?:\\[ ,;:!]|~|\\quad)?\s*(\S.*)$")
# Thousands separators: 1,000 or 12,345.5 (the first group does not start with 0: 0,111 is a decimal comma)
_THOUSANDS = re.compile(r"^[-+]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL_COMMA = re.compile(r"^[-+]?\d+,\d+$")
# A gold with a comma is a list ("1,3": OlympiadBench writes lists so) unless it can only be a decimal comma:
# 0,111 (no list or thousands group starts with 0), or two digits after the comma (1,22: Math-Verify's
# tests read it as 1.22; lists of such golds have one-digit items). The ambiguous one-digit case reads as a list.
_GOLD_DECIMAL_COMMA = re.compile(r"^[-+]?(?:0,\d+|\d+,\d\d)$")
_NO_SPACE = re.compile(r"(?<!,)\s+(?!,)")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_SCI = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_TIMES10 = re.compile(r"^([-+]?\d+(?:\.\d+)?)\s*\\(?:times|cdot)\s*10\^\{?([-+]?\d+)\}?$")
# Separators inside a number: LaTeX thin spaces, {,}, unicode thin spaces, before a group of three digits.
_GROUP_SEP = re.compile(r"(?<=\d)(?:\\[,!;:]|\{,\}|\\ |~|\u2009|\u202f)(?=\d{3}(?!\d))")
_PERCENT_WORD = re.compile(r"\s*(?:pct|percent)\.?$", re.IGNORECASE)
SEP = "\x1f"  # joins answer candidates in one cache key

# Numbers in words (version 8): "three", "twenty-one", "one hundred five", "negative four".
_UNITS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                     "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if w != "_"}
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_NUM_WORD = r"(?:" + "|".join(sorted([*_UNITS, *_TENS, *_SCALES], key=len, reverse=True)) + r")"
_NUM_WORDS = re.compile(rf"(?:(?:negative|minus)\s+)?{_NUM_WORD}(?:(?:\s+(?:and\s+)?|-){_NUM_WORD})*", re.IGNORECASE)
# A count stated in the final sentence: "There are twelve eggs left", "So she has three apples", "is five".
_STATED_COUNT = re.compile(rf"\b(?:is|are|was|were|be|equals?|has|have|had|gets?|got|makes?|made|totals?|total of|"
                           rf"remains?|left with|needs?|needed|takes?|took|costs?)\s+({_NUM_WORDS.pattern})\b", re.IGNORECASE)
# A number word that is not a count: "one more thing", "one of them", "one way", "two steps further on".
_NOT_A_COUNT = re.compile(r"\s*(?:more|other|another|of|way|ways|thing|step|steps|last|final|moment|second|third|"
                          r"side|sides|hand|case|cases|time|times|again|half|halves|quarter|quarters)\b", re.IGNORECASE)
# A scale word after a number: "6.4 million" is 6400000.
_SCALED = re.compile(r"^(-?\d+(?:\.\d+)?)\s*(thousand|million|billion|trillion)$", re.IGNORECASE)
_SCALED_IN_TEXT = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?\s+(?:thousand|million|billion|trillion)\b", re.IGNORECASE)
# A mixed number in prose: "2 3/4" is 11/4 (a proper fraction after a whole number and one space).
_MIXED = re.compile(r"^(-?)(\d+)\s(\d+)/(\d+)$")
_MIXED_IN_TEXT = re.compile(r"(?<![\w.,/])-?\d+ \d+/\d+(?![\w./])")
# A degree sign after a value: 30\degree, 30^\circ, 30^{\circ}, 30°, 30\textdegree.
_DEGREE = re.compile(r"\s*(?:\^\s*\{?\s*\\circ\s*\}?|\\degree|\\textdegree|°)\s*$")
# An R1-style response cut inside its reasoning: a <think> that never closes.
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Box:
    content: str
    start: int  # where "\boxed{" starts
    end: int  # after the closing brace


def boxes(text: str) -> tuple[list[Box], bool]:
    """Every closed \\boxed{...} (balanced braces) in order, and whether a box opened after the last
    closed one never closes (a response cut inside its final box). Bounded work on adversarial text."""
    out: list[Box] = []
    unclosed = False
    pos = 0
    for m in list(_BOX.finditer(text))[-50:]:
        if m.start() < pos:  # nested inside the previous box
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "{}":  # \{ \}: literal braces
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            unclosed = True
            break
        out.append(Box(text[m.end():i - 1].strip(), m.start(), i))
        pos = i
    return out, unclosed


def last_boxed(text: str) -> Optional[str]:
    """Content of the last closed \\boxed{...} (None if none closes)."""
    found, _ = boxes(text)
    return found[-1].content if found else None


def _answer_like(s: str) -> bool:
    """Whether a stated answer looks like one: a digit, math (`$`, `\\`, an operator or bracket), a
    short token (a choice letter, a variable) or a number in words. "helpful!" in "I hope this answer is
    helpful!" does not."""
    return (bool(re.search(r"[\d$\\^_=+\-*/()\[\]{}<>]", s)) or len(s) <= 3 or _word_value(s) != s
            or words_number(s) is not None)


def words_number(s: str) -> Optional[str]:
    """A number written in words as digits ("twenty-one" -> "21", "negative four" -> "-4", "one hundred
    five" -> "105"), when `s` is nothing else (a final full stop aside); else None."""
    t = s.strip().rstrip(".").strip()
    if not t or not _NUM_WORDS.fullmatch(t):
        return None
    words = re.split(r"[\s-]+", t.lower())
    sign = -1 if words[0] in ("negative", "minus") else 1
    words = [w for w in words if w not in ("negative", "minus", "and")]
    total, current = 0, 0
    for w in words:
        if w in _UNITS:
            current += _UNITS[w]
        elif w in _TENS:
            current += _TENS[w]
        elif w == "hundred":
            current = max(current, 1) * 100
        else:  # thousand, million, ...
            total += max(current, 1) * _SCALES[w]
            current = 0
    return str(sign * (total + current))


def _prose(s: str) -> bool:
    """Whether `s` reads as a sentence: two or more words of letters that are not LaTeX commands
    ("The largest $n$ is 34"; not "\\left( \\frac{1}{5}, \\frac{1}{6} \\right)")."""
    return len(s.split()) >= 3 and len(re.findall(r"(?<![\\A-Za-z])[A-Za-z]{2,}", _INLINE.sub(" ", s))) >= 2


def _reduce_sentence(s: str) -> str:
    """A stated answer written as a sentence ("The largest $n$ is 34") reduced to what it states:
    the part after its last " is " / " = " / " equals ", then its last inline math or last number.
    Math with spaces in it is not a sentence and stays whole."""
    if not _prose(s):
        return s
    tail = re.split(r"\s(?:is|=|equals|are)\s", s)[-1].strip()
    maths = [next(g for g in m.groups() if g is not None) for m in _INLINE.finditer(tail)]
    if maths:
        return maths[-1].strip()
    if len(tail.split()) < 3:
        return tail
    nums = _NUMBER.findall(tail)
    return nums[-1] if nums else s


def _stated_answer(text: str) -> tuple[Optional[str], int]:
    """The answer after the last "answer is" / "answer:" and where that phrase starts (-1: none): the
    rest of its line, up to a full stop followed by a space or the end (so 7.78 stays whole); when
    the line holds nothing after the phrase ("The final answer is:" and the answer on a later line,
    often display math), the next non-empty line. A sentence is reduced to what it states; a
    statement with no answer-like content ("this answer is helpful!") is no answer."""
    last = None
    for m in _PHRASE.finditer(text):
        if not _REMARK_SUBJECT.search(text[max(0, m.start() - 12):m.start()]):  # "this answer is right": a remark
            last = m
    if last is None:
        return None, -1
    rest = text[last.end():]
    if _EVALUATIVE.match(rest):  # "the answer is correct / larger than ...": a judgement, not the answer
        return None, -1
    lines = rest.split("\n")
    line = lines[0]
    if not line.strip(" :*.\t"):
        line = next((ln for ln in lines[1:] if ln.strip()), "")
    line = re.split(r"\.(?:\s|$)", line, maxsplit=1)[0] if not line.lstrip().startswith(("\\[", "$$")) else line
    line = line.strip().strip("*").strip().lstrip(":").strip()
    m = _INLINE.fullmatch(line)
    if m:
        line = next(g for g in m.groups() if g is not None)
    line = line.strip()
    if m or line.count("$") < 2:  # a lone dollar is a currency sign; a pair is math kept for below
        line = line.strip("$").strip()
    line = line.rstrip(".").strip()
    if not m:  # a math span is the answer as written, never a sentence to reduce
        line = _CLAUSE.split(line, maxsplit=1)[0].strip().rstrip(",").strip()  # "8, which is 2 more than 6": 8
        line = _reduce_sentence(line)
    if not line or not _answer_like(line):
        return None, -1
    return line, last.start()


def extract_candidates(response: str, boxed_only: bool = False) -> tuple[list[str], str]:
    """(answer candidates in order, how the first was found); see the module docstring."""
    response = response.replace("\u2212", "-")  # the Unicode minus sign is a minus
    if _THINK_OPEN in response and _THINK_CLOSE not in response[response.rfind(_THINK_OPEN):]:
        return [], "unclosed-think"  # cut inside its reasoning: whatever it was weighing is no answer
    found, unclosed = boxes(response)  # boxes anywhere; the fallbacks read the end only
    if unclosed:
        return [], "unclosed-box"
    text = response[-MAX_RESPONSE_CHARS:]
    offset = len(response) - len(text)
    stated, at = (None, -1) if boxed_only else _stated_answer(text)
    if found and not (stated is not None and offset + at > found[-1].end):
        cands = [found[-1].content]
        choice = _CHOICE.match(found[-1].content)
        if choice:  # \\textbf{(C)}\\ 12: the choice letter with its value; the value and the letter are graded too
            cands.append(choice.group(4).strip())
            cands.append(next(g for g in choice.groups()[:3] if g))
        para_start = response.rfind("\n\n", 0, found[-1].start) + 1
        final_boxes = [b for b in found if b.start >= para_start]
        between = [response[a.end:b.start] for a, b in zip(final_boxes, final_boxes[1:])]
        together = [b.content for b in final_boxes]
        if any(_HEDGE.search(t) for t in between) and len(set(together)) > 1:
            # "x = \boxed{2} or x = \boxed{5}": the boxes count only together, as a list (right for the gold
            # "2, 5", the solutions of an equation); never one of them alone (a hedge; the strict reading)
            return [", ".join(together)], "boxed-alternatives"
        if len(together) >= 2:
            cands.append(", ".join(together))
        return cands, "boxed"
    if boxed_only:
        return [], "none"
    if stated is not None:
        return [stated], "answer-phrase"
    final = text[text.rstrip().rfind("\n\n") + 1:] if "\n\n" in text.rstrip() else text
    # "$3 and she pays with $5": unescaped dollar amounts in prose pair up as a span of words, which is not math
    maths = [g for g in (next(x for x in m.groups() if x is not None) for m in _INLINE.finditer(final))
             if "\\" in g or not _prose(g)]
    if maths and maths[-1].strip():
        return [maths[-1].strip()], "inline-math"
    if not _NUMBER.search(final):  # "There are infinitely many solutions." with no number: the words' value
        said = _PROSE_VALUE.findall(final)
        if said:
            return [_word_value(said[-1])], "answer-words"
    sentence = _final_sentence(final)
    said_last = [m for m in _PROSE_VALUE.finditer(sentence) if not _QUANTIFIED.search(sentence[:m.start()])]
    in_sentence = list(_NUMBER.finditer(sentence))
    if said_last and (not in_sentence or said_last[-1].start() > in_sentence[-1].end()):
        # version 8: a final sentence that says it after its numbers ("for every n > 2 there are infinitely many
        # solutions"); "for infinitely many n the value is 5" is a quantifier, and states 5
        return [_word_value(said_last[-1].group())], "answer-words"
    if not in_sentence:  # "There are twelve eggs left.": a count in words in the final sentence
        counts = [m for m in _STATED_COUNT.finditer(sentence) if not _NOT_A_COUNT.match(sentence[m.end():])]
        value = words_number(counts[-1].group(1)) if counts else None
        if value is not None:
            return [value], "number-words"
    found_nums = list(_NUMBER.finditer(text))
    if found_nums:
        last = found_nums[-1]
        mixed = list(_MIXED_IN_TEXT.finditer(text))
        if mixed and mixed[-1].end() == last.end() and _mixed(mixed[-1].group()) != mixed[-1].group():
            return [mixed[-1].group()], "last-number"  # "2 3/4 cups": the mixed number, not its fraction
        scaled = list(_SCALED_IN_TEXT.finditer(text))
        if scaled and scaled[-1].start() == last.start():
            return [scaled[-1].group()], "last-number"  # "6.4 million"
        value = last.group()
        return [value.replace(",", "") if _THOUSANDS.match(value) else value], "last-number"
    return [], "none"


# "for infinitely many n ...", "of infinitely many": a quantifier, not the answer
_QUANTIFIED = re.compile(r"\b(?:for|of|among|in|over)\s+$", re.IGNORECASE)


def _final_sentence(final: str) -> str:
    """The last sentence of the final paragraph (split at a full stop, question or exclamation mark followed by
    a space; decimal points stay)."""
    parts = [p for p in re.split(r"(?<=[.!?])\s+", final.strip()) if p.strip()]
    return parts[-1] if parts else ""


def _mixed(s: str) -> str:
    """A mixed number "2 3/4" as the fraction it is ("11/4"); an improper or other form unchanged."""
    m = _MIXED.match(s.strip())
    if not m or int(m.group(3)) >= int(m.group(4)) or int(m.group(4)) == 0:
        return s
    whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
    return f"{m.group(1)}{whole * den + num}/{den}"


def _scaled(s: str) -> str:
    """"6.4 million" as the number it is ("6400000"), exactly (decimal arithmetic); else unchanged."""
    m = _SCALED.match(s.strip())
    if not m:
        return s
    from decimal import Decimal

    v = Decimal(m.group(1)) * _SCALES[m.group(2).lower()]
    return format(v.normalize(), "f")


def extract_answer(response: str, boxed_only: bool = False) -> tuple[Optional[str], str]:
    """(the first answer candidate or None, how it was found)."""
    cands, method = extract_candidates(response, boxed_only)
    return (cands[0] if cands else None), method


def _normalise(s: str) -> str:
    s = s.strip().replace("\u2212", "-")
    s = _DEGREE.sub("", s) if re.search(r"\d", s) else s  # 30\degree, 30^\circ: the number of degrees
    s = _mixed(_scaled(s))
    s = words_number(s) or s  # "twenty-one": 21
    s = _NEGATIVE_WORD.sub("-", s)  # "negative 4": -4
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    s = _GROUP_SEP.sub("", s)
    s = _PERCENT_WORD.sub(r"\\%", s)
    s = _word_value(s)
    return _SCI.sub(lambda m: f"{m.group(1)}\\times10^{{{m.group(2)}}}", s)


# Words and sets that name one value: "infinitely many" is \infty, every way of writing the empty set
# (and "no solution") is \emptyset. Matched on a whole candidate, \text{...} unwrapped, case and a
# final full stop ignored.
_TEXT_WRAP = re.compile(r"^\\(?:text|textrm|mathrm|textnormal|mbox)\s*\{(.*)\}$", re.DOTALL)
_INFINITELY_MANY = re.compile(r"^(?:there\s+are\s+)?(?:infinitely\s+many|an?\s+infinite\s+number)(?:\s+\w+)?$"
                              r"|^infinit[ey]$", re.IGNORECASE)
_EMPTY_SET = re.compile(r"^(?:\\emptyset|\\varnothing|\\o|∅|\\\{\s*\\\}|\{\s*\}|\\left\\\{\s*\\right\\\}"
                        r"|(?:there\s+(?:is|are)\s+)?no\s+(?:real\s+|such\s+)?(?:solutions?|roots?|values?))$", re.IGNORECASE)


_PROSE_VALUE = re.compile(r"infinitely\s+many|no\s+(?:real\s+)?(?:solutions?|roots?)(?=\W|$)", re.IGNORECASE)


def _word_value(s: str) -> str:
    """`s` as \\infty or \\emptyset when it is one of their word or set forms, else unchanged."""
    t = s.strip().rstrip(".").strip()
    m = _TEXT_WRAP.match(t)
    if m:
        t = m.group(1).strip().rstrip(".").strip()
    if _INFINITELY_MANY.match(t):
        return "\\infty"
    if _EMPTY_SET.match(t):
        return "\\emptyset"
    return s


# An interval written as inequalities on one variable: "-2 < x \\le 3" is (-2, 3]; "x \\ge 5" is
# [5, \\infty); "3 > x > -2" is (-2, 3). Bounds are whatever stands between the relations.
_LESS = {"<": False, "\\lt": False, "<=": True, "\\le": True, "\\leq": True, "\\leqslant": True, "≤": True}
_GREATER = {">": False, "\\gt": False, ">=": True, "\\ge": True, "\\geq": True, "\\geqslant": True, "≥": True}
_REL = re.compile(r"(\\leqslant|\\geqslant|\\leq|\\geq|\\le|\\ge|\\lt|\\gt|<=|>=|<|>|≤|≥)(?![A-Za-z])")
_VARIABLE = re.compile(r"^[A-Za-z]$")


def _interval(s: str) -> str:
    """`s` in interval notation when it is one or two inequalities on a single-letter variable, else unchanged."""
    parts = _REL.split(s.strip())
    if len(parts) not in (3, 5) or "=" in _REL.sub("", s):
        return s
    terms, rels = [p.strip() for p in parts[0::2]], parts[1::2]
    if any(not t for t in terms):
        return s
    if len(rels) == 1:
        (a, b), r = terms, rels[0]
        if _VARIABLE.match(a) and not _VARIABLE.match(b):  # x < b, x > a
            lo, hi = (("-\\infty", False), (b, _LESS[r])) if r in _LESS else ((b, _GREATER[r]), ("\\infty", False))
        elif _VARIABLE.match(b) and not _VARIABLE.match(a):  # a < x, b > x
            lo, hi = ((a, _LESS[r]), ("\\infty", False)) if r in _LESS else (("-\\infty", False), (a, _GREATER[r]))
        else:
            return s
    else:
        a, x, b = terms
        if not _VARIABLE.match(x) or _VARIABLE.match(a) or _VARIABLE.match(b):
            return s
        if all(r in _LESS for r in rels):
            lo, hi = (a, _LESS[rels[0]]), (b, _LESS[rels[1]])
        elif all(r in _GREATER for r in rels):
            lo, hi = (b, _GREATER[rels[1]]), (a, _GREATER[rels[0]])
        else:
            return s
    return f"{'[' if lo[1] else '('}{lo[0]}, {hi[0]}{']' if hi[1] else ')'}"


def _number(s: str) -> Optional[float]:
    """A plain number (digits, a decimal point, an exponent; 1,000 and 4.5\\times10^{3} too), else None."""
    t = _NO_SPACE.sub("", s)
    if _THOUSANDS.match(t):
        t = t.replace(",", "")
    m = _TIMES10.match(t)
    if m:
        return float(m.group(1)) * 10.0 ** int(m.group(2))
    return float(t) if _PLAIN_NUMBER.match(t) else None


def _cheap(answer: str, gold: str) -> Optional[str]:
    """'exact' / 'integer' / 'numeric' when decided without sympy ('mismatch' when decidedly not
    equal); None when math-verify must decide."""
    a, g = _normalise(answer), _normalise(gold)
    if a == g:
        return "exact"
    # Spaces go, except beside a comma: "32, 349" is a list of two numbers, "32,349" one number.
    a2, g2 = _NO_SPACE.sub("", a), _NO_SPACE.sub("", g)
    a2 = a2.replace(",", "") if _THOUSANDS.match(a2) else a2
    g2 = g2.replace(",", "") if _THOUSANDS.match(g2) else g2
    if _INT.match(a2) and _INT.match(g2):
        return "integer" if int(a2) == int(g2) else "mismatch"
    # A decimal comma (1000,99) beside a decimal point (1000.99): the same number. Only then: "1,3"
    # beside "13" or "3, 1" is a list, which math-verify compares as a set.
    # The gold's "1,3" is a list (OlympiadBench writes lists so): a decimal 1.3 never matches it; a gold that
    # can only be a decimal comma (_GOLD_DECIMAL_COMMA) matches the decimal. An answer's comma may be a
    # decimal comma beside a gold with a decimal point.
    if _DECIMAL_COMMA.match(a2) and not _THOUSANDS.match(a2) and "." in g2 and _number(g2) is not None:
        return "numeric" if math.isclose(float(a2.replace(",", ".")), _number(g2), rel_tol=1e-6) else "mismatch"
    if _GOLD_DECIMAL_COMMA.match(g2) and "." in a2 and _number(a2) is not None:  # 0,111 and 1,22: decimals
        return "numeric" if math.isclose(float(g2.replace(",", ".")), _number(a2), rel_tol=1e-6) else "mismatch"
    if _DECIMAL_COMMA.match(g2) and "." in a2 and _number(a2) is not None:
        return "mismatch"
    x, y = _number(a), _number(g)
    if x is not None and y is not None:  # relative tolerance, not math-verify's 6 decimal places
        return "numeric" if math.isclose(x, y, rel_tol=1e-6, abs_tol=0.0) else "mismatch"
    return None


def _strip_percent(s: str) -> str:
    return re.sub(r"\\?%\s*$", "", s).strip()


def _math_verify(answer: str, gold: str, timeout: int) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    g = parse(f"\\boxed{{{gold}}}", extraction_config=cfg, parsing_timeout=timeout)
    p = parse(f"\\boxed{{{answer}}}", extraction_config=cfg, parsing_timeout=timeout)
    return bool(g) and bool(verify(g, p, timeout_seconds=timeout))


def gold_answer(gold: str) -> str:
    """The gold answer: as given, or the last closed box of a gold that is a worked solution
    (a gold with a \\boxed{}, as Math-Verify's tests and some datasets give it): the boxes' contents."""
    if "\\boxed" in gold or "\\fbox" in gold:
        found, _ = boxes(gold)
        if found:  # several boxes are one answer together (\\boxed{1}\\boxed{2}: "1, 2")
            return ", ".join(b.content for b in found)
    return gold


def judge(answer: str, gold: str, timeout: int = 5) -> tuple[bool, str]:
    """(correct, reason) for one extracted answer against the gold."""
    gold = gold_answer(gold)
    if len(answer) > MAX_ANSWER_CHARS:
        return False, "too-long"
    quick = _cheap(answer, gold)
    if quick is not None:
        return quick != "mismatch", quick
    try:
        a, g = _normalise(answer), _normalise(gold)
        if _math_verify(a, g, timeout):
            return True, "math-verify"
        a2, g2 = _strip_percent(a), _strip_percent(g)
        if (a2, g2) != (a, g) and (a2 == g2 or _math_verify(a2, g2, timeout)):
            return True, "percent"
        a3, g3 = _interval(a), _interval(g)  # inequalities as intervals, when math-verify's relations differ
        if (a3, g3) != (a, g) and (a3 == g3 or _math_verify(a3, g3, timeout)):
            return True, "interval"
        return False, "mismatch"
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        return False, "timeout" if "Timeout" in type(e).__name__ else f"error: {type(e).__name__}"


def _quick(key: str, gold: str) -> Optional[str]:
    """A verdict for a cache key (the candidates) without a worker, or None."""
    gold = gold_answer(gold)
    reasons = []
    for c in key.split(SEP):
        if len(c) > MAX_ANSWER_CHARS:
            return None
        q = _cheap(c, gold)
        if q is None:
            return None
        if q != "mismatch":
            return q
        reasons.append(q)
    return "mismatch"


def grade(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
    """Grade one response in this process (math-verify timeouts need the main thread)."""
    cands, method = extract_candidates(response, boxed_only)
    if not cands:
        return Verdict(False, None, method, "no-answer")
    reason = "mismatch"
    for c in cands:
        ok, reason = judge(c, gold, timeout)
        if ok:
            return Verdict(True, c, method, reason)
    return Verdict(False, cands[0], method, reason)


def _plain_math_verify(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
    """math-verify's own defaults: parse the whole response and the gold (in `$...$` unless it is
    already delimited), then verify."""
    try:
        from math_verify import parse, verify

        # A bare gold ("\\frac12") is not LaTeX math to math-verify until delimited.
        g = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=timeout)
        p = parse(response[-MAX_RESPONSE_CHARS:], parsing_timeout=timeout)
        ok = bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=timeout))
        return Verdict(ok, str(p[1]) if len(p) > 1 else None, "whole-response", "math-verify" if ok else "mismatch")
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        kind = "timeout" if "Timeout" in type(e).__name__ else f"error: {type(e).__name__}"
        return Verdict(False, None, "whole-response", kind)


def _official(as_run: bool):
    def judge(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
        from benchmarks.grading.official import official_acc

        ok, _, boxed = official_acc(response, gold, as_run=as_run, timeout=timeout)
        return Verdict(ok, boxed, "official", "mathruler" if ok and as_run else ("official" if ok else "mismatch"))

    return judge


def _mathruler(response: str, gold: str, timeout: int = 5, boxed_only: bool = False) -> Verdict:
    from benchmarks.grading.official import _mathruler_check, boxed_content

    boxed = boxed_content(response)
    if boxed == "None":
        return Verdict(False, None, "none", "no-answer")
    ok = _mathruler_check(boxed, gold)
    return Verdict(ok, boxed, "boxed", "mathruler" if ok else "mismatch")


def _candidates_key(response: str, boxed_only: bool) -> tuple[Optional[str], str]:
    cands, method = extract_candidates(response, boxed_only)
    return (SEP.join(cands) if cands else None), method


def _official_key(response: str, boxed_only: bool) -> tuple[Optional[str], str]:
    from benchmarks.grading.official import answer_text

    return answer_text(response), "official"


def _boxed_key(response: str, boxed_only: bool) -> tuple[Optional[str], str]:
    from benchmarks.grading.official import boxed_content

    b = boxed_content(response)
    return (None, "none") if b == "None" else (b, "boxed")


@dataclass(frozen=True)
class GraderSpec:
    """A grader: `key` (in the calling process, cheap) gives what the verdict depends on besides
    the gold (None: no answer, graded wrong at once), used to deduplicate and cache; `judge` (in a
    worker process) decides. `version` changes whenever a verdict may change."""

    name: str
    version: int
    summary: str
    key: Callable[[str, bool], tuple[Optional[str], str]]
    judge: Callable[..., Verdict]
    quick: Optional[Callable[[str, str], Optional[str]]] = None  # a verdict without a worker (ours)

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.version}"


GRADERS: dict[str, GraderSpec] = {g.name: g for g in [
    GraderSpec("math-verify", 8, "ours: final box (or a later stated answer, or inline math, or the last number), "
               "normalised, then math-verify", key=_candidates_key, judge=grade, quick=_quick),
    GraderSpec("math-verify-plain", 1, "math-verify's defaults on the whole response",
               key=lambda r, b: (r[-MAX_RESPONSE_CHARS:], "whole-response"), judge=_plain_math_verify),
    GraderSpec("stare-official", 1, "the official STARE accuracy as its reward loop ran it (mathruler decides)",
               key=_official_key, judge=_official(as_run=True)),
    GraderSpec("stare-official-3way", 1, "the official STARE accuracy as written (math-verify x2 or mathruler)",
               key=_official_key, judge=_official(as_run=False)),
    GraderSpec("mathruler", 1, "mathruler's grade_answer on the last \\boxed{}", key=_boxed_key, judge=_mathruler),
]}


def check_grader(name: str) -> GraderSpec:
    """The grader called `name`, or a StareError listing the valid names."""
    if name not in GRADERS:
        from stare_kernel.errors import StareError, did_you_mean

        raise StareError(f"unknown grader '{name}'{did_you_mean(name, GRADERS)}; valid: {', '.join(GRADERS)}")
    return GRADERS[name]


def _grade_task(name: str, response: str, gold: str, timeout: int, boxed_only: bool) -> dict:
    """One verdict, in a worker (as a dict: plain data across the pipe)."""
    return GRADERS[name].judge(response, gold, timeout, boxed_only).to_dict()


class Grader:
    """Batch grading with a process pool, a hard per-item time limit and a verdict cache.

    name: a key of GRADERS. workers=0 grades in this process (no hard limit beyond math-verify's
    own, which needs the main thread; for tests and tiny batches). The cache is keyed by what the
    grader's verdict depends on (for ours: the extracted answer) and the gold.
    The workers (benchmarks/grading/workers.py) start once, on first need, from a fork server: never a
    fork of this possibly threaded process; `close` ends them for certain.
    """

    def __init__(self, workers: Optional[int] = None, timeout: int = 5, hard_timeout: float = 30.0,
                 boxed_only: bool = False, name: str = "math-verify"):
        self.spec = check_grader(name)
        self.workers = (os.cpu_count() or 1) if workers is None else workers
        self.boxed_only = boxed_only
        self.timeout = timeout
        self.hard_timeout = hard_timeout
        self.cache: dict[tuple[str, str], Verdict] = {}
        self._pool: Optional[WorkerPool] = None

    @property
    def tag(self) -> str:
        """name@version of this grader, recorded with every verdict."""
        return self.spec.tag

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _verdict(self, v: Verdict, extracted: Optional[str], method: str) -> Verdict:
        return Verdict(v.correct, extracted, method, v.reason, self.tag)

    def grade_many(self, responses: Iterable[str], golds: Iterable[str]) -> list[Verdict]:
        """Verdicts in input order."""
        items = list(zip(responses, golds))
        out: list[Optional[Verdict]] = [None] * len(items)
        todo: dict[tuple[str, str], list[int]] = {}
        methods: list[str] = [""] * len(items)
        for i, (resp, gold) in enumerate(items):
            key, method = self.spec.key(resp, self.boxed_only)
            methods[i] = method
            if key is None:
                out[i] = Verdict(False, None, method, "no-answer", self.tag)
                continue
            if (key, gold) in self.cache:
                v = self.cache[(key, gold)]
                out[i] = self._verdict(v, v.extracted, method)
                continue
            quick = self.spec.quick(key, gold) if self.spec.quick is not None else None
            if quick is not None:
                out[i] = Verdict(quick != "mismatch", key.split(SEP)[0], method, quick, self.tag)
                continue
            todo.setdefault((key, gold), []).append(i)
        if todo:
            keys = list(todo)
            firsts = [items[todo[k][0]] for k in keys]
            if self.workers == 0:
                results = [self.spec.judge(r, g, self.timeout, self.boxed_only) for r, g in firsts]
            else:
                results = self._run_pool(firsts)
            for k, v in zip(keys, results):
                self.cache[k] = v
                for i in todo[k]:
                    out[i] = self._verdict(v, v.extracted, methods[i])
        return [v for v in out if v is not None]

    def _run_pool(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        if self._pool is None:
            self._pool = WorkerPool(self.workers)
        name = self.spec.name
        outcomes = self._pool.run(_grade_task, [(name, r, g, self.timeout, self.boxed_only) for r, g in pairs],
                                  hard_timeout=self.hard_timeout)
        results = []
        for (response, _), o in zip(pairs, outcomes):
            if o.status == "ok":
                results.append(Verdict(**o.value))
            else:  # "timeout": a hung worker (killed); "error": the worker died (e.g. out of memory)
                extracted = self.spec.key(response, self.boxed_only)[0]
                reason = "timeout" if o.status == "timeout" else f"error: {o.detail.split(':')[0]}"
                results.append(Verdict(False, extracted, o.status, reason))
        return results
