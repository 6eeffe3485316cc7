"""Training prompts: rows {'problem', 'answer'} from a toy task, a local file or a hub dataset, and
the seeded order in which a run takes them (epochs are seeded permutations; a resumed run takes the
same rows as an uninterrupted one). Both backends read prompts through `load_prompts`."""

from __future__ import annotations

import functools
import random
from pathlib import Path

from benchmarks.data.registry import GENERATED_PREFIXES, TRAIN_SETS, read_jsonl_rows
from stare_kernel.errors import StareError, did_you_mean


def load_prompts(cfg) -> list[dict]:
    """Training rows {'problem', 'answer'} from a toy task, a local file or a hub dataset. `cfg`: a recipe
    (stare_cli/core/config.py, a layer above this one: only its `data` section is read, by attribute)."""
    src = cfg.data.train
    if src.startswith(GENERATED_PREFIXES):
        if src not in TRAIN_SETS:
            raise StareError(f"data.train: no generated training set '{src}'{did_you_mean(src, TRAIN_SETS)}",
                             hint="generated sets: " + ", ".join(TRAIN_SETS))
        return TRAIN_SETS[src](cfg.data.max_samples or 20000, 1000)
    path = Path(src)
    if path.suffix == ".jsonl":  # our reader: a bad line or undecodable bytes are named with file and line
        if not path.exists():
            raise StareError(f"data.train: file '{src}' not found")
        return _checked_rows(cfg, src, read_jsonl_rows(path), lambda i: f"{src} row {i + 1}")
    try:
        import datasets

        if path.suffix in (".json", ".parquet"):
            if not path.exists():
                raise StareError(f"data.train: file '{src}' not found")
            ds = datasets.load_dataset("parquet" if path.suffix == ".parquet" else "json", data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(src, cfg.data.subset, split=cfg.data.split)
    except StareError:
        raise
    except Exception as e:
        raise StareError(
            f"data.train: cannot load '{src}' ({type(e).__name__}: {str(e)[:200]})",
            hint="point data.train at a local .jsonl/.parquet file when the hub cannot be reached",
        ) from None
    return _checked_rows(cfg, src, ds, lambda i: f"{src} row {i + 1}")


def _checked_rows(cfg, src: str, raw, where) -> list[dict]:
    """{'problem', 'answer'} of each row (up to data.max_samples); a row without either field, or
    with a null or empty answer (it would be trained on as reward 0 every time), fails naming it."""
    rows = []
    for i, r in enumerate(raw):
        if cfg.data.prompt_field not in r or cfg.data.answer_field not in r:
            raise StareError(
                f"data.train: {where(i)}: no '{cfg.data.prompt_field}' or '{cfg.data.answer_field}' field",
                hint=f"set data.prompt_field / data.answer_field; fields here: {', '.join(r)}",
            )
        answer = r[cfg.data.answer_field]
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise StareError(f"data.train: {where(i)}: '{cfg.data.answer_field}' is {'null' if answer is None else 'empty'}"
                             " (every response would get reward 0)", hint="give the row its answer, or remove it")
        prompt = r[cfg.data.prompt_field]
        if isinstance(prompt, list):  # chat-format rows: take the user turn
            prompt = next((m["content"] for m in prompt if m.get("role") == "user"), str(prompt))
        rows.append({"problem": str(prompt), "answer": str(answer)})
        if cfg.data.max_samples and len(rows) >= cfg.data.max_samples:
            break
    if not rows:
        raise StareError(f"data.train: '{src}' has no rows")
    return rows


@functools.lru_cache(maxsize=4)  # take_prompts asks once per prompt; shuffle once per epoch
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def take_prompts(rows: list[dict], cursor: int, k: int, seed: int, shuffle: bool) -> tuple[list[dict], int]:
    """k rows starting at global position `cursor` (epochs are seeded permutations)."""
    out = []
    for pos in range(cursor, cursor + k):
        epoch, i = divmod(pos, len(rows))
        out.append(rows[epoch_order(len(rows), seed, epoch, shuffle)[i]])
    return out, cursor + k
