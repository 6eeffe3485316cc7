"""The CPU toy: arithmetic with many equally valid ways to write a correct solution.

Task "Compute a+b-c." (a, b in 1..15, c <= a+b). Demonstrations vary the order of steps (4 orders),
optional spaces around every operator and "=", 3 openings, 6 connectives and 6 closing phrases,
then \\boxed{R} and EOS. Each step is off by +-1 or +-2 with probability 0.12 (orders 1-2) or 0.35
(orders 3-4), so the warmed-up policy is both uncertain in style and imperfect in arithmetic. The
reward ignores style, so GRPO sharpens onto one way of writing and its token entropy collapses,
as in the paper's Fig. 3(a). Design and numbers follow ../shared/notes/toy-facts.md.

Everything is built locally: a 35-token word/character tokenizer made with `tokenizers`, a
Qwen2-style config (~0.8M parameters) and a supervised warm-up, cached under the toy cache dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

TOY_VERSION = 1
WORDS = ["Compute", "first", "we", "get", "so", "then", "and", "the", "answer", "is", "thus", "result", "\\boxed{"]
CHARS = list("0123456789+-=.,; }\n")
SPECIALS = ["<pad>", "<eos>", "<unk>"]
OPENINGS = ["", "first ", "we get "]
CONNECTIVES = [". ", ", ", ", so ", ", then ", "; ", " and "]
CLOSINGS = ["so the answer is ", "the answer is ", "thus the result is ", "we get ", "the result is ", "thus "]

TOY_MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, max_position_embeddings=128, tie_word_embeddings=True)
# Two threads: nothing else runs during the warm-up, and on 2 cores it takes 0.19 s/step instead
# of 0.32 s/step with one (measured here), which keeps a cold `stare demo` under 10 minutes.
SFT_THREADS = 2
TOY_SFT = dict(steps=700, batch=64, lr=3e-3, seed=0)


def cache_root() -> Path:
    return Path(os.environ.get("STARE_CACHE_DIR", Path.home() / ".cache" / "stare"))


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


def build_tokenizer(task: str = "arith"):
    """A word/character-level fast tokenizer, wrapped for transformers."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words, chars = (WORDS, CHARS) if task == "arith" else (TOOL_WORDS, TOOL_CHARS)
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
        tmp = f.with_name(f.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(conf, indent=2))
        os.replace(tmp, f)


def build_model(vocab_size: int, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=None, **TOY_MODEL)
    return Qwen2ForCausalLM(cfg)


def toy_key(task: str = "arith") -> str:
    if task == "arith":
        blob = json.dumps({"v": TOY_VERSION, "model": TOY_MODEL, "sft": TOY_SFT, "words": WORDS, "chars": CHARS,
                           "threads": SFT_THREADS})
    else:
        blob = json.dumps({"v": TOY_VERSION, "task": task, "model": TOY_MODEL, "sft": TOOL_SFT, "words": TOOL_WORDS,
                           "chars": TOOL_CHARS, "mix": TOOL_MIX, "threads": SFT_THREADS})
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def toy_dir(task: str = "arith") -> Path:
    return cache_root() / "toy" / f"{task}-{toy_key(task)}"


def make_random_init(path: Path, seed: int = 0) -> Path:
    """A toy model with random weights (for fast tests); saved like a warmed-up one."""
    tok = build_tokenizer()
    model = build_model(len(tok), seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
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
            p = problem(rng) if task == "arith" else tool_problem(rng)
            prompt = tok(p["problem"] + "\n", add_special_tokens=False)["input_ids"]
            if task == "arith":
                parts = [(demonstration(p, rng), True)]
            else:
                parts = tool_demonstration(p, rng)
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


def ensure_toy_model(task: str = "arith", force: bool = False) -> Path:
    """The warmed-up toy model directory, built on first use (atomic: a crash leaves no half model).

    The warm-up always runs with SFT_THREADS torch threads, whoever asks for the model first (the
    demo, `stare train`, `stare toy init`): the float summation order, and so the weights, depend
    on the thread count, and the cache key promises one model."""
    if task not in ("arith", "tool"):
        from stare_cli.errors import StareError

        raise StareError(f"unknown toy task '{task}'", hint="toy tasks: 'toy:arith', 'toy:tool'")
    path = toy_dir(task)
    if path.exists() and not force:
        add_chat_template(path)
        return path

    def build(tmp: Path) -> None:
        import torch

        prev_threads = torch.get_num_threads()
        torch.set_num_threads(SFT_THREADS)
        tok = build_tokenizer(task)
        conf = TOY_SFT if task == "arith" else TOOL_SFT
        model = build_model(len(tok), conf["seed"])
        n = sum(p.numel() for p in model.parameters())
        print(f"building the toy model ({n / 1e6:.2f}M parameters) and warming it up; cached in {path}", flush=True)
        try:
            sft(model, tok, conf["steps"], conf["batch"], conf["lr"], conf["seed"], task=task)
        finally:
            torch.set_num_threads(prev_threads)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "toy.json").write_text(json.dumps({"task": task, "version": TOY_VERSION, "key": toy_key(task),
                                                  "sft": conf, "threads": SFT_THREADS}))

    build_once(path, build, force)
    add_chat_template(path)
    return path


def build_once(path: Path, build: Callable[[Path], None], force: bool = False) -> bool:
    """Make the cache entry `path` with `build(tmp_dir)`, once, whoever asks at the same time.

    Holders of an exclusive lock on `<path>.lock` build; a process that waited finds the entry made
    and returns (False). The entry is built in a temporary sibling and renamed into place, so readers
    never see half of one; temporaries of killed builders are removed under the lock. Returns True
    when this call built it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also when the process dies)
        if path.exists() and not force:
            return False
        for stale in path.parent.glob(path.name + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir()
        try:
            build(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if path.exists():
            old = path.with_name(path.name + f".tmp{os.getpid()}-old")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        return True
