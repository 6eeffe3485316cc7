"""Token-budget micro-batches: which responses share one loss call.

The official STARE runs select L+/L- inside the loss, so the rows that share a loss call decide what
is selected. Those runs use verl's dynamic batch size (`use_dynamic_bsz=True`,
`ppo_max_token_len_per_gpu=8192`): a mini-batch is split into as few micro-batches as fit the token
budget, with rows assigned to balance the attention workload. `token_budget_micro_batches` forms
exactly the micro-batches verl 0.9.1 forms for one data-parallel rank (`rearrange_micro_batches`
with its defaults: workload 24576 L + L^2 per row of L tokens, Karmarkar-Karp partition, more
micro-batches until every one fits, then ordered by workload with the lighter ones at both ends),
so the embedded backend and verl select from the same rows; tests compare the two on random lengths.

Pure functions of Python integers: no tensors, no I/O.
"""

from __future__ import annotations

import heapq


def _workload(length: int) -> int:
    """verl's relative cost of one row of `length` tokens (linear layers plus attention)."""
    return 24576 * length + length * length


class _Part:
    """One growing partition: its total and its (index, value) items, ordered like verl's sets
    (by total, then item count, then the items themselves)."""

    __slots__ = ("total", "items")

    def __init__(self) -> None:
        self.total = 0
        self.items: list[tuple[int, int]] = []

    def key(self) -> tuple:
        return (self.total, len(self.items), self.items)


class _Candidate:
    """A k-way partial partition in the differencing heap: the one with the largest spread (ties:
    the largest first part) is merged first."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = sorted(parts, key=_Part.key, reverse=True)

    def spread(self) -> int:
        return self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: "_Candidate") -> bool:
        if self.spread() != other.spread():
            return self.spread() > other.spread()
        return other.parts[0].key() < self.parts[0].key()

    def absorb(self, other: "_Candidate") -> None:
        """Pair this candidate's i-th largest part with the other's i-th smallest."""
        k = len(self.parts)
        for i in range(k):
            src = other.parts[k - 1 - i]
            self.parts[i].items.extend(src.items)
            self.parts[i].total += src.total
        self.parts = sorted(self.parts, key=_Part.key, reverse=True)


def balanced_partitions(values: list[int], k: int) -> list[list[int]]:
    """Split indices of `values` into k parts of similar sums (largest differencing method).

    Returns k lists of indices, each sorted; every part is non-empty when len(values) >= k.
    """
    if k < 1 or len(values) < k:
        raise ValueError(f"cannot split {len(values)} items into {k} non-empty parts")
    heap: list[_Candidate] = []
    for v, i in sorted((v, i) for i, v in enumerate(values)):
        first = _Part()
        first.items.append((i, v))
        first.total = v
        heapq.heappush(heap, _Candidate([first] + [_Part() for _ in range(k - 1)]))
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.absorb(b)
        heapq.heappush(heap, a)
    parts = [sorted(i for i, _ in p.items) for p in heap[0].parts]
    if any(not p for p in parts):
        raise ValueError(f"a part came out empty splitting {len(values)} items into {k}")
    return parts


def token_budget_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch, in the order the loss calls run.

    Args:
        lengths: [B] tokens per row (prompt + response, padding excluded).
        max_tokens: the token budget of one micro-batch; every row must fit on its own.
    Returns:
        lists of row indices (each sorted): as few micro-batches as keep every one within the budget
        under the workload-balanced assignment, heaviest in the middle.
    """
    lengths = [int(x) for x in lengths]
    if not lengths:
        return []
    if max(lengths) > max_tokens:
        raise ValueError(f"a row of {max(lengths)} tokens exceeds the micro-batch token budget {max_tokens}")
    n = min(len(lengths), -(-sum(lengths) // max_tokens))
    work = [_workload(x) for x in lengths]
    while True:
        parts = balanced_partitions(work, n)
        if all(sum(lengths[i] for i in p) <= max_tokens for p in parts):
            break
        n += 1  # n = len(lengths) always fits, since every row does
    parts.sort(key=lambda p: (sum(work[i] for i in p), p[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]
