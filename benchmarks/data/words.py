"""Short word problems for small real models: one-digit addition and subtraction in a sentence.

The SmolLM2-135M recipe (recipes/small/smollm2-135m-words.yaml) trains on them: SmolLM2-135M-Instruct
solves about a quarter at temperature 0.6 under the `short` template (docs/real-model.md), which
leaves room to learn, where the six math benchmarks give it nothing to learn from (it solves none).

- `words:add-sub` as training data (`data.train`): an endless stream, seeded;
- `words:add-sub` as a benchmark (`stare eval --bench words:add-sub`): 128 held-out problems from
  another seed, `short` template, 4 samples at temperature 0.6.
Each problem: a name, an item, a in 2..9, b in 1..9 and one of three forms (gets more; two places;
gives away, with b <= a). The answer is a number.
"""

from __future__ import annotations

import random

from benchmarks.data.registry import BenchmarkSpec, register, register_train_set

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Leo", "Zoe")
ITEMS = ("apples", "books", "coins", "pencils", "marbles", "stickers", "cookies", "cards")
NAME = "words:add-sub"


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


register_train_set(NAME, problems)
register(BenchmarkSpec(NAME, "Word problems (add/sub)", "", "", n=4, size=128, temperature=0.6, top_p=1.0,
                       max_tokens=64, template="short", generate=lambda n: problems(n, 777_777)))
