"""Training prompts: rows {'problem', 'answer'} from a toy task, a local file or a hub dataset, and
the seeded order in which a run takes them (epochs are seeded permutations; a resumed run takes the
same rows as an uninterrupted one). Both backends read prompts through `load_prompts`."""

from __future__ import annotations

import functools
import random
from pathlib import Path

from stare_cli.core.config import Recipe
from benchmarks.data.registry import GENERATED_PREFIXES, TRAIN_SETS
from stare_cli.core.errors import StareError, did_you_mean


def load_prompts(cfg: Recipe) -> list[dict]:
    """Training rows {'problem', 'answer'} from a toy task, a local file or a hub dataset."""
    src = cfg.data.train
    if src.startswith(GENERATED_PREFIXES):
        if src not in TRAIN_SETS:
            raise StareError(f"data.train: no generated training set '{src}'{did_you_mean(src, TRAIN_SETS)}",
                             hint="generated sets: " + ", ".join(TRAIN_SETS))
        return TRAIN_SETS[src](cfg.data.max_samples or 20000, 1000)
    path = Path(src)
    try:
        import datasets

        if path.suffix in (".jsonl", ".json", ".parquet"):
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
    rows = []
    for r in ds:
        if cfg.data.prompt_field not in r or cfg.data.answer_field not in r:
            raise StareError(
                f"data.train: rows of '{src}' lack '{cfg.data.prompt_field}' or '{cfg.data.answer_field}'",
                hint=f"set data.prompt_field / data.answer_field; fields here: {', '.join(r)}",
            )
        prompt = r[cfg.data.prompt_field]
        if isinstance(prompt, list):  # chat-format rows: take the user turn
            prompt = next((m["content"] for m in prompt if m.get("role") == "user"), str(prompt))
        rows.append({"problem": str(prompt), "answer": str(r[cfg.data.answer_field])})
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
