"""The CPU toy: arithmetic with many equally valid ways to write a correct solution.

Task "Compute a+b-c." (a, b in 1..15, c <= a+b). Demonstrations vary the order of steps (4 orders),
optional spaces around every operator and "=", 3 openings, 6 connectives and 6 closing phrases,
then \\boxed{R} and EOS. Each step is off by +-1 or +-2 with probability 0.12 (orders 1-2) or 0.35
(orders 3-4), so the warmed-up policy is both uncertain in style and imperfect in arithmetic. The
reward ignores style, so GRPO sharpens onto one way of writing and its token entropy collapses,
as in the paper's Fig. 3(a). Design and numbers follow ../shared/notes/toy-facts.md.

Task "explore" (same format) adds problems where exploration pays: "hard" ones (a+b >= 20) on which
the common add-first solutions forget the carry (systematically wrong) and only the subtract-first
orders, which the demonstrations use on easy problems with more noise, are right. Training draws 10%
hard problems; the held-out `toy:explore-hard` set is all hard. Sharpening onto add-first, which
easy problems reward, costs the hard ones.

The warmed-up weights of every task ship with the package (benchmarks/data/toy_assets/, checked against
the SHA-256 in SHIPPED): every machine starts from the same model and the demo needs no warm-up.
`stare toy init --rebuild [--seed N]` runs the warm-up again (with the current torch thread count;
float summation order makes the weights machine- and thread-dependent) into the cache directory.
Everything is built locally: a word/character tokenizer made with `tokenizers`, a Qwen2-style
config (~0.8M parameters) and a supervised warm-up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from benchmarks.data.cache import build_once, cache_root
from benchmarks.data.registry import BenchmarkSpec, register, register_train_set
from stare_kernel.io import atomic_write_text, file_sha256, save_pretrained_readable

TOY_VERSION = 1
WORDS = ["Compute", "first", "we", "get", "so", "then", "and", "the", "answer", "is", "thus", "result", "\\boxed{"]
CHARS = list("0123456789+-=.,; }\n")
SPECIALS = ["<pad>", "<eos>", "<unk>"]
OPENINGS = ["", "first ", "we get "]
CONNECTIVES = [". ", ", ", ", so ", ", then ", "; ", " and "]
CLOSINGS = ["so the answer is ", "the answer is ", "thus the result is ", "we get ", "the result is ", "thus "]

TOY_MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, max_position_embeddings=128, tie_word_embeddings=True)
TOY_SFT = dict(steps=700, batch=64, lr=3e-3, seed=0)
ASSETS = Path(__file__).with_name("toy_assets")
# The shipped warm-ups (made by `stare toy init --rebuild --seed 0 --ship`, two torch threads): the
# SHA-256 of model.safetensors. A changed file is refused; a new warm-up means a new TOY_VERSION.
SHIPPED: dict[str, str] = {
    "arith": "883ec986e9a36ad3b438194510a922fb09367d4874bd399d5306db4cd68470e7",
    "tool": "d8de5d56d34aecf1ca5fd7f2e98a2d2811c8fe87fa9b38b6e9dc9fab4ac6284f",
    "explore": "63d62f7ac00251db8574b187cd9fb6cc5525c28a4abae36b31ef37d82ed65527",
}


# ---- the tool task: "Compute a*b+c." Mental multiplication in the demonstrations is unreliable;
# a call to the Python tool is always right. The reward ignores how the answer was found, so RL
# should raise the share of responses that call the tool.
TOOL_WORDS = ["Compute", "the", "answer", "is", "\\boxed{", "```python", "```output", "```", "print(", "so", "we", "get"]
TOOL_CHARS = list("0123456789+*=., ()}\n")
TOOL_MIX = dict(tool_share=0.3, mental_error=0.6)
TOOL_SFT = dict(steps=500, batch=64, lr=3e-3, seed=0)


def tool_problem(rng: random.Random) -> dict:
    a, b, c = rng.randint(3, 30), rng.randint(3, 30), rng.randint(1, 50)
    return {"problem": f"Compute {a}*{b}+{c}.", "answer": str(a * b + c), "a": a, "b": b, "c": c}


def tool_problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [tool_problem(rng) for _ in range(n)]


def tool_demonstration(p: dict, rng: random.Random) -> list[tuple[str, bool]]:
    """(text, trained) parts: a tool call with its observation (not trained on), or mental math."""
    a, b, c = p["a"], p["b"], p["c"]
    if rng.random() < TOOL_MIX["tool_share"]:
        y = a * b + c
        return [(f"```python\nprint({a}*{b}+{c})\n```", True), (f"\n```output\n{y}\n```\n", False),
                (f"the answer is \\boxed{{{y}}}", True)]
    x = a * b
    if rng.random() < TOOL_MIX["mental_error"]:
        x += rng.choice([-10, -2, -1, 1, 2, 10])
    y = x + c
    return [(f"{a}*{b} = {x}, {x}+{c} = {y}. so the answer is \\boxed{{{y}}}", True)]


# ---- the exploration task: easy problems reward add-first solutions; hard ones (a+b >= 20) need
# the subtract-first orders, since add-first solutions of them forget the carry.
EXPLORE_MIX = dict(train_hard=0.1, sft_hard=0.3, easy_add_noise=0.05, easy_sub_noise=0.35, hard_carry_slip=0.9,
                   hard_sub_noise=0.05)
EXPLORE_SFT = dict(steps=700, batch=64, lr=3e-3, seed=0)


def explore_problem(rng: random.Random, hard: bool) -> dict:
    while True:
        a, b = rng.randint(1, 15), rng.randint(1, 15)
        if (a + b >= 20) == hard:
            break
    c = rng.randint(1, max(a, b)) if hard else rng.randint(1, a + b)
    return {"problem": f"Compute {a}+{b}-{c}.", "answer": str(a + b - c), "a": a, "b": b, "c": c, "hard": hard}


def explore_problems(n: int, seed: int, hard_share: float) -> list[dict]:
    rng = random.Random(seed)
    return [explore_problem(rng, rng.random() < hard_share) for _ in range(n)]


def explore_demonstration(p: dict, rng: random.Random) -> str:
    """Like `demonstration`, with the explore task's accuracy per order and problem kind."""
    a, b, c, hard = p["a"], p["b"], p["c"], p["hard"]
    m = EXPLORE_MIX
    orders = [("+", a, b, "-", c), ("+", b, a, "-", c)]
    if a >= c:
        orders.append(("-", a, c, "+", b))
    if b >= c:
        orders.append(("-", b, c, "+", a))
    op1, x, y, op2, z = rng.choice(orders)

    def noisy(v: int, p_noise: float) -> int:
        return v + rng.choice([-2, -1, 1, 2]) if rng.random() < p_noise else v

    if op1 == "+":
        r1 = x + y
        if hard and rng.random() < m["hard_carry_slip"]:
            r1 -= 10  # the forgotten carry
        elif not hard:
            r1 = noisy(r1, m["easy_add_noise"])
    else:
        r1 = noisy(x - y, m["hard_sub_noise"] if hard else m["easy_sub_noise"])
    r2 = r1 + z if op2 == "+" else r1 - z

    def sp() -> str:
        return " " if rng.random() < 0.5 else ""

    step1 = f"{x}{sp()}{op1}{sp()}{y}{sp()}={sp()}{r1}"
    step2 = f"{r1}{sp()}{op2}{sp()}{z}{sp()}={sp()}{r2}"
    return f"{rng.choice(OPENINGS)}{step1}{rng.choice(CONNECTIVES)}{step2}. {rng.choice(CLOSINGS)}\\boxed{{{r2}}}"


def problem(rng: random.Random) -> dict:
    a, b = rng.randint(1, 15), rng.randint(1, 15)
    c = rng.randint(1, a + b)
    return {"problem": f"Compute {a}+{b}-{c}.", "answer": str(a + b - c), "a": a, "b": b, "c": c}


def problems(n: int, seed: int) -> list[dict]:
    """n problems from a seeded generator (train: seed 0..; held-out eval: a disjoint seed)."""
    rng = random.Random(seed)
    return [problem(rng) for _ in range(n)]


def demonstration(p: dict, rng: random.Random) -> str:
    """One noisy solution in a random style (response only; the prompt is the problem)."""
    a, b, c = p["a"], p["b"], p["c"]
    orders = [("+", a, b, "-", c, 0.12), ("+", b, a, "-", c, 0.12)]
    if a >= c:
        orders.append(("-", a, c, "+", b, 0.35))
    if b >= c:
        orders.append(("-", b, c, "+", a, 0.35))
    op1, x, y, op2, z, noise = rng.choice(orders)

    def noisy(v: int) -> int:
        return v + rng.choice([-2, -1, 1, 2]) if rng.random() < noise else v

    def sp() -> str:
        return " " if rng.random() < 0.5 else ""

    r1 = noisy(x + y if op1 == "+" else x - y)
    r2 = noisy(r1 + z if op2 == "+" else r1 - z)
    step1 = f"{x}{sp()}{op1}{sp()}{y}{sp()}={sp()}{r1}"
    step2 = f"{r1}{sp()}{op2}{sp()}{z}{sp()}={sp()}{r2}"
    return f"{rng.choice(OPENINGS)}{step1}{rng.choice(CONNECTIVES)}{step2}. {rng.choice(CLOSINGS)}\\boxed{{{r2}}}"


def train_problems(task: str, n: int, seed: int = 1000) -> list[dict]:
    """The training prompts of a toy task ({'problem', 'answer'}; the explore task's mix of kinds)."""
    check_task(task)
    rows = {"arith": lambda: problems(n, seed), "tool": lambda: tool_problems(n, seed),
            "explore": lambda: explore_problems(n, seed, EXPLORE_MIX["train_hard"])}[task]()
    return [{"problem": r["problem"], "answer": r["answer"]} for r in rows]


EVAL_SETS = {"toy:arith": lambda n, seed: problems(n, seed), "toy:tool": lambda n, seed: tool_problems(n, seed),
             "toy:explore": lambda n, seed: explore_problems(n, seed, 0.0),
             "toy:explore-hard": lambda n, seed: explore_problems(n, seed, 1.0)}


def eval_problems(bench: str, n: int, seed: int = 999_999) -> list[dict]:
    """A toy benchmark's held-out problems (a seed disjoint from training)."""
    return [{"problem": r["problem"], "answer": r["answer"]} for r in EVAL_SETS[bench](n, seed)]




def build_tokenizer(task: str = "arith"):
    """A word/character-level fast tokenizer, wrapped for transformers."""

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words, chars = (TOOL_WORDS, TOOL_CHARS) if task == "tool" else (WORDS, CHARS)
    vocab = {t: i for i, t in enumerate(SPECIALS + words + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pattern = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + "|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = RAW_CHAT_TEMPLATE
    return fast


# The `raw` prompt (problem + newline) as a chat template: verl renders every prompt through one.
RAW_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def add_chat_template(path: Path) -> None:
    """Toy models cached before the tokenizer carried RAW_CHAT_TEMPLATE get it (same weights, same key)."""
    f = path / "tokenizer_config.json"
    conf = json.loads(f.read_text())
    if not conf.get("chat_template"):
        conf["chat_template"] = RAW_CHAT_TEMPLATE
        atomic_write_text(f, json.dumps(conf, indent=2))


def build_model(vocab_size: int, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=None, **TOY_MODEL)
    return Qwen2ForCausalLM(cfg)


TASKS = ("arith", "tool", "explore")


def task_sft(task: str) -> dict:
    return {"arith": TOY_SFT, "tool": TOOL_SFT, "explore": EXPLORE_SFT}[task]


def check_task(task: str) -> str:
    if task not in TASKS:
        from stare_kernel.errors import StareError, did_you_mean

        raise StareError(f"unknown toy task '{task}'{did_you_mean(task, TASKS)}", hint="toy tasks: " + ", ".join(TASKS))
    return task


def toy_key(task: str = "arith", seed: Optional[int] = None) -> str:
    """What a warm-up of `task` depends on (the thread count aside): data, model, schedule, seed."""
    blob = {"v": TOY_VERSION, "task": task, "model": TOY_MODEL, "sft": {**task_sft(task), **({"seed": seed} if seed is not None else {})}}
    blob.update({"words": TOOL_WORDS, "chars": TOOL_CHARS, "mix": TOOL_MIX} if task == "tool" else
                {"words": WORDS, "chars": CHARS, **({"mix": EXPLORE_MIX} if task == "explore" else {})})
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:10]


def toy_dir(task: str = "arith", seed: Optional[int] = None) -> Path:
    """Where a rebuilt warm-up of `task` (with warm-up `seed`) is cached."""
    return cache_root() / "toy" / f"{task}-{toy_key(task, seed)}"


def shipped_dir(task: str) -> Path:
    return ASSETS / f"{task}-v{TOY_VERSION}"


def make_random_init(path: Path, seed: int = 0) -> Path:
    """A toy model with random weights (for fast tests); saved like a warmed-up one."""
    tok = build_tokenizer()
    model = build_model(len(tok), seed)
    path.mkdir(parents=True, exist_ok=True)
    save_pretrained_readable(model, tok, path)
    return path


def sft(model, tok, steps: int, batch: int, lr: float, seed: int, log_every: int = 100, task: str = "arith") -> None:
    """Supervised warm-up on noisy demonstrations (loss on the response; never on tool output)."""
    import torch

    rng = random.Random(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + __import__("math").cos(__import__("math").pi * s / steps))
    )
    model.train()
    t0 = time.time()
    for step in range(steps):
        ids, labels = [], []
        for _ in range(batch):
            if task == "arith":
                p = problem(rng)
            elif task == "tool":
                p = tool_problem(rng)
            else:
                p = explore_problem(rng, rng.random() < EXPLORE_MIX["sft_hard"])
            prompt = tok(p["problem"] + "\n", add_special_tokens=False)["input_ids"]
            if task == "arith":
                parts = [(demonstration(p, rng), True)]
            elif task == "tool":
                parts = tool_demonstration(p, rng)
            else:
                parts = [(explore_demonstration(p, rng), True)]
            resp, lab = [], []
            for text, trained in parts:
                t = tok(text, add_special_tokens=False)["input_ids"]
                resp += t
                lab += t if trained else [-100] * len(t)
            resp.append(tok.eos_token_id)
            lab.append(tok.eos_token_id)
            ids.append(prompt + resp)
            labels.append([-100] * len(prompt) + lab)
        L = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [tok.pad_token_id] * (L - len(x)) for x in ids])
        lab = torch.tensor([y + [-100] * (L - len(y)) for y in labels])
        attn = (torch.arange(L)[None] < torch.tensor([len(x) for x in ids])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attn, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"toy warm-up step {step:4d}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()


_VERIFIED: set[str] = set()


def ensure_toy_model(task: str = "arith") -> Path:
    """The warmed-up toy model of `task`: the shipped one (its hash checked once per process), or,
    for a task that ships none, the warm-up built once on first use into the cache."""
    check_task(task)
    if task in SHIPPED:
        path = shipped_dir(task)
        if task not in _VERIFIED:
            got = file_sha256(path / "model.safetensors") if (path / "model.safetensors").exists() else "missing"
            if got != SHIPPED[task]:
                from stare_kernel.errors import StareError

                raise StareError(f"the shipped toy model {path / 'model.safetensors'} is {got[:12]}, not the "
                                 f"released {SHIPPED[task][:12]}", hint="reinstall stare, or `stare toy init --rebuild`")
            _VERIFIED.add(task)
        return path
    return build_toy(task)


def build_toy(task: str, seed: Optional[int] = None, force: bool = False, threads: Optional[int] = None,
              out: Optional[Path] = None, steps: Optional[int] = None) -> Path:
    """Run the supervised warm-up of `task` (warm-up seed `seed`, default the task's; `steps` only
    for tests) with `threads` torch threads (default: the current setting) into `out` (default: the
    cache), once."""
    check_task(task)
    path = out or toy_dir(task, seed)
    if path.exists() and not force:
        add_chat_template(path)
        return path
    conf = {**task_sft(task), **({"seed": seed} if seed is not None else {}), **({"steps": steps} if steps else {})}

    def build(tmp: Path) -> None:
        import torch

        prev = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        used = torch.get_num_threads()
        tok = build_tokenizer(task)
        model = build_model(len(tok), conf["seed"])
        n = sum(p.numel() for p in model.parameters())
        print(f"building the {task} toy ({n / 1e6:.2f}M parameters, warm-up seed {conf['seed']}, {used} threads) "
              f"into {path}", flush=True)
        try:
            sft(model, tok, conf["steps"], conf["batch"], conf["lr"], conf["seed"], task=task)
        finally:
            torch.set_num_threads(prev)
        save_pretrained_readable(model, tok, tmp)
        (tmp / "toy.json").write_text(json.dumps({"task": task, "version": TOY_VERSION, "key": toy_key(task, seed),
                                                  "sft": conf, "threads": used}))

    build_once(path, build, force)
    add_chat_template(path)
    return path


def ship(task: str, source: Path) -> tuple[Path, str]:
    """Copy a built warm-up into the package's assets (maintainers); returns its dir and hash, which
    go into SHIPPED."""
    dest = shipped_dir(task)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    return dest, file_sha256(dest / "model.safetensors")


# The toy's held-out sets as benchmarks (`stare eval --bench toy:arith`, `eval.benchmarks` in recipes).
for _name, _title, _size, _tokens in [("toy:arith", "Toy arith", 256, 56), ("toy:tool", "Toy tool", 128, 64),
                                      ("toy:explore", "Toy explore (easy)", 256, 56),
                                      ("toy:explore-hard", "Toy explore (hard)", 128, 56)]:
    register(BenchmarkSpec(_name, _title, "", "", n=1, size=_size, temperature=1.0, top_p=1.0, max_tokens=_tokens,
                           template="raw", generate=functools.partial(eval_problems, _name)))
for _task in TASKS:  # their training prompts (`data.train: toy:<task>`)
    register_train_set(f"toy:{_task}", functools.partial(train_problems, _task))
