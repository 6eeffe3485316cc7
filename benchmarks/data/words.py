"""Short word problems for small real models: one-digit addition and subtraction in a sentence.

The SmolLM2-135M recipe (recipes/small/smollm2-135m-words.yaml) trains on them: SmolLM2-135M-Instruct
solves about a quarter at temperature 0.6 under the `short` template (docs/real-model.md), which
leaves room to learn, where the six math benchmarks give it nothing to learn from (it solves none).

- `words:add-sub` as training data (`data.train`): an endless stream, seeded;
- `words:add-sub` as a benchmark (`stare eval --bench words:add-sub`): 128 held-out problems from
  another seed, `short` template, 4 samples at temperature 0.6.
Each problem: a name, an item, a in 2..9, b in 1..9 and one of three forms (gets more; two places;
gives away, with b <= a). The answer is a number.

- `words:multi-step`: two or three operations on numbers up to 20 (buys then gives; gives then
  finds; boxes of equal size plus a few; three changes in a row; equal shares plus more), for the
  exploration experiment (docs/real-model-exploration.md), where one-digit single steps are too
  easy. 128 held-out problems from their own seed; the training stream never yields a held-out
  problem's text.
- `words:two-step`: two operations on one-digit numbers (buys then gives; gives then finds; 2-3
  boxes plus a few), between the two in difficulty; same rules.
"""

from __future__ import annotations

import random

from benchmarks.data.registry import BenchmarkSpec, register, register_train_set

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Leo", "Zoe")
ITEMS = ("apples", "books", "coins", "pencils", "marbles", "stickers", "cookies", "cards")
NAME = "words:add-sub"
MULTI = "words:multi-step"
MULTI_HELD_OUT_SEED = 424_242
TWO = "words:two-step"
TWO_HELD_OUT_SEED = 515_151


def problem(rng: random.Random) -> dict:
    """One problem {'problem', 'answer'} (answer as text, like the benchmark files)."""
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(1, 9)
    form = rng.choice(("gets", "places", "gives"))
    if form == "gets":
        text, answer = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b
    elif form == "places":
        text, answer = (f"There are {a} {item} on the table and {b} {item} in the bag. How many {item} are there in "
                        f"all?", a + b)
    else:
        a, b = max(a, b), min(a, b)
        text, answer = f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?", a - b
    return {"problem": text, "answer": str(answer)}


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(n)]


def _buys_gives(name: str, friend: str, item: str, a: int, b: int, c: int) -> tuple[str, int]:
    return (f"{name} has {a} {item}. {name} buys {b} more {item} and then gives {c} {item} to {friend}. "
            f"How many {item} does {name} have now?"), a + b - c


def _gives_finds(name: str, friend: str, item: str, a: int, b: int, c: int) -> tuple[str, int]:
    return (f"{name} had {a} {item}. {name} gave {b} {item} to {friend} and then found {c} more. "
            f"How many {item} does {name} have now?"), a - b + c


def _boxes(name: str, item: str, a: int, b: int, c: int) -> tuple[str, int]:
    return (f"{name} has {a} boxes with {b} {item} in each box and {c} more {item} on the table. "
            f"How many {item} does {name} have in all?"), a * b + c


def multi_step_problem(rng: random.Random) -> dict:
    """One problem of two or three operations {'problem', 'answer'}; every answer is a whole number >= 0."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    form = rng.choice(("buys-gives", "gives-finds", "boxes", "three", "shares"))
    if form == "buys-gives":
        a, b = rng.randint(5, 20), rng.randint(2, 12)
        c = rng.randint(2, min(12, a + b))
        text, answer = _buys_gives(name, friend, item, a, b, c)
    elif form == "gives-finds":
        a = rng.randint(6, 20)
        b, c = rng.randint(2, a - 1), rng.randint(2, 12)
        text, answer = _gives_finds(name, friend, item, a, b, c)
    elif form == "boxes":
        a, b, c = rng.randint(2, 5), rng.randint(2, 9), rng.randint(1, 9)
        text, answer = _boxes(name, item, a, b, c)
    elif form == "three":
        a, b, c = rng.randint(3, 15), rng.randint(2, 9), rng.randint(2, 9)
        d = rng.randint(1, min(9, a + b + c - 1))
        text = (f"{name} has {a} {item}. {friend} gives {name} {b} {item}, then {name} wins {c} more and "
                f"loses {d}. How many {item} does {name} have now?")
        answer = a + b + c - d
    else:
        b, q = rng.randint(2, 4), rng.randint(2, 6)
        c = rng.randint(1, 9)
        text = (f"{b * q} {item} are shared equally among {b} children. Then each child gets {c} more {item}. "
                f"How many {item} does each child have?")
        answer = q + c
    return {"problem": text, "answer": str(answer)}


def two_step_problem(rng: random.Random) -> dict:
    """One problem of two operations on one-digit numbers {'problem', 'answer'} (answer >= 0)."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    form = rng.choice(("buys-gives", "gives-finds", "boxes"))
    if form == "buys-gives":
        a, b = rng.randint(2, 9), rng.randint(1, 5)
        c = rng.randint(1, min(5, a + b))
        text, answer = _buys_gives(name, friend, item, a, b, c)
    elif form == "gives-finds":
        a = rng.randint(3, 9)
        b, c = rng.randint(1, a - 1), rng.randint(1, 5)
        text, answer = _gives_finds(name, friend, item, a, b, c)
    else:
        a, b, c = rng.randint(2, 3), rng.randint(2, 5), rng.randint(1, 5)
        text, answer = _boxes(name, item, a, b, c)
    return {"problem": text, "answer": str(answer)}


HELD_OUT_SEEDS = {MULTI: MULTI_HELD_OUT_SEED, TWO: TWO_HELD_OUT_SEED}
DRAW = {MULTI: multi_step_problem, TWO: two_step_problem}


def held_out(name: str, n: int) -> list[dict]:
    """The held-out problems of a family (`words:multi-step`, `words:two-step`), from their own seed."""
    rng = random.Random(HELD_OUT_SEEDS[name])
    return [DRAW[name](rng) for _ in range(n)]


def training_stream(name: str, n: int, seed: int) -> list[dict]:
    """A family's training stream: seeded, never a held-out problem's text (the first 128 held-out ones)."""
    excluded = {p["problem"] for p in held_out(name, 128)}
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        row = DRAW[name](rng)
        if row["problem"] not in excluded:
            rows.append(row)
    return rows


def multi_step_held_out(n: int) -> list[dict]:
    return held_out(MULTI, n)


def multi_step_problems(n: int, seed: int) -> list[dict]:
    return training_stream(MULTI, n, seed)


register_train_set(NAME, problems)
register_train_set(MULTI, multi_step_problems)
register_train_set(TWO, lambda n, seed: training_stream(TWO, n, seed))
register(BenchmarkSpec(NAME, "Word problems (add/sub)", "", "", n=4, size=128, temperature=0.6, top_p=1.0,
                       max_tokens=64, template="short", generate=lambda n: problems(n, 777_777)))
register(BenchmarkSpec(MULTI, "Word problems (two or three steps)", "", "", n=4, size=128, temperature=0.6,
                       top_p=1.0, max_tokens=96, template="short", generate=multi_step_held_out))
register(BenchmarkSpec(TWO, "Word problems (two steps, one-digit)", "", "", n=4, size=128, temperature=0.6,
                       top_p=1.0, max_tokens=96, template="short", generate=lambda n: held_out(TWO, n)))
