"""Token-budget micro-batches: which responses share one loss call.

The official STARE runs select L+/L- inside the loss, so the rows that share a loss call decide what
is selected. Those runs use verl's dynamic batch size (`use_dynamic_bsz=True`,
`ppo_max_token_len_per_gpu=8192`): a mini-batch is split into as few micro-batches as fit the token
budget, with rows assigned to balance the attention workload. `token_budget_micro_batches` forms
exactly the micro-batches verl 0.9.1 forms for one data-parallel rank (`rearrange_micro_batches`
with its defaults: workload 24576 L + L^2 per row of L tokens, Karmarkar-Karp partition, more
micro-batches until every one fits, then ordered by workload with the lighter ones at both ends),
so the embedded backend and verl select from the same rows; tests compare the two on random lengths.

`rank_split` and `legacy_micro_batches` form the official run's layout instead (verl 0.7, the
STARE fork, legacy worker): the training batch balanced over data-parallel ranks
(`trainer.balance_batch`), and on each rank `ceil(tokens / budget)` micro-batches (the count maxed
over ranks) without checking that each fits. `official_loss_calls` composes them into the loss calls
the official run makes, each with the factor its loss is multiplied by.

Pure functions of Python integers: no tensors, no I/O.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


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


def _single(i: int, v: int) -> _Part:
    p = _Part()
    p.items.append((i, v))
    p.total = v
    return p


def balanced_partitions(values: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices of `values` into k parts of similar sums (largest differencing method, verl's
    `karmarkar_karp`; identical in verl 0.7 and 0.9.1).

    equal_size: every part gets len(values) / k items (verl's data-parallel balancing): the sorted
        values start as k-item candidates, one item per part, instead of one item each.
    Returns k lists of indices, each sorted; every part is non-empty when len(values) >= k.
    """
    if k < 1 or len(values) < k:
        raise ValueError(f"cannot split {len(values)} items into {k} non-empty parts")
    if equal_size and len(values) % k:
        raise ValueError(f"cannot split {len(values)} items into {k} parts of equal size")
    heap: list[_Candidate] = []
    ordered = sorted((v, i) for i, v in enumerate(values))
    if equal_size:
        for at in range(0, len(ordered), k):
            heapq.heappush(heap, _Candidate([_single(i, v) for v, i in ordered[at:at + k]]))
    else:
        for v, i in ordered:
            heapq.heappush(heap, _Candidate([_single(i, v)] + [_Part() for _ in range(k - 1)]))
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
    return _order_light_ends(parts, work)


def _order_light_ends(parts: list[list[int]], work: list[int]) -> list[list[int]]:
    """verl's micro-batch order: by workload (ties: first index), heaviest in the middle."""
    parts = sorted(parts, key=lambda p: (sum(work[i] for i in p), p[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]


def rank_split(lengths: list[int], ranks: int) -> list[list[int]]:
    """Rows of each data-parallel rank, in the order the rank holds them: verl 0.7's
    `trainer.balance_batch` (as the official trainer calls it), then verl's equal split.

    Args:
        lengths: [B] tokens per row (prompt + response), B divisible by `ranks`.
        ranks: data-parallel ranks (the official run: 2 nodes x 8 GPUs = 16).
    Returns:
        `ranks` lists of B / ranks row indices: equal-size parts balanced by workload, each ordered
        by workload (ties: index) with the light rows at both ends (`p[::2] + p[1::2][::-1]`).
    """
    work = [_workload(int(x)) for x in lengths]
    out = []
    for part in balanced_partitions(work, ranks, equal_size=True):
        part = sorted(part, key=lambda i: (work[i], i))
        out.append(part[::2] + part[1::2][::-1])
    return out


def legacy_micro_batches(rank_lengths: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Micro-batches of one mini-batch on every rank, as verl 0.7's `rearrange_micro_batches` forms
    them under the legacy worker (`use_dynamic_bsz`, no dp_group: the count is agreed over all ranks).

    Args:
        rank_lengths: per rank, [b_r] tokens per row of its mini-batch.
        max_tokens: `ppo_max_token_len_per_gpu` (x the sequence-parallel size).
    Returns:
        per rank, lists of indices into that rank's rows: n = max over ranks of
        min(b_r, ceil(tokens_r / max_tokens)) workload-balanced partitions, ordered like verl's.
        Unlike `token_budget_micro_batches` (verl 0.9.1) a partition may exceed the budget.
    """
    counts = [min(len(ls), -(-sum(int(x) for x in ls) // max_tokens)) for ls in rank_lengths]
    n = max(counts) if counts else 0
    out = []
    for ls in rank_lengths:
        if n > len(ls):
            raise ValueError(f"{n} micro-batches agreed over ranks, but a rank holds only {len(ls)} rows")
        work = [_workload(int(x)) for x in ls]
        out.append(_order_light_ends(balanced_partitions(work, n), work))
    return out


@dataclass(frozen=True)
class LossCall:
    """One loss call (a micro-batch of one rank): its rows (indices into the training batch) and the
    factor its loss is multiplied by before backward. own_norm: the loss is normalised by the call's
    own token (or sequence) count (the legacy worker), not by the mini-batch's."""

    rows: list[int]
    scale: float
    own_norm: bool
    rank: int = 0


def official_loss_calls(lengths: list[int], rows_per_mini: int, ranks: int, max_tokens: int) -> list[list[LossCall]]:
    """The loss calls of each mini-batch of one training batch under the official layout.

    Args:
        lengths: [B] tokens per row of the training batch (prompt + response).
        rows_per_mini: rows per mini-batch (ppo_mini_batch_size x n), B a multiple of it.
        ranks: emulated data-parallel ranks; rows_per_mini divisible by it.
        max_tokens: the micro-batch token budget.
    Returns:
        per mini-batch, its loss calls: each rank holds B / ranks rows (rank_split) and splits them into
        mini-batches of rows_per_mini / ranks in order; each of its micro-batches' losses is the
        micro-batch's own token-mean times rows / (rows_per_mini / ranks) (verl 0.7's
        `loss_scale_factor`), and 1 / ranks for the gradient all-reduce's average over ranks.
    """
    B = len(lengths)
    if B % rows_per_mini:
        raise ValueError(f"{B} rows do not split into mini-batches of {rows_per_mini}")
    if rows_per_mini % ranks:
        raise ValueError(f"a mini-batch of {rows_per_mini} rows does not split over {ranks} ranks")
    per_rank = rows_per_mini // ranks
    split = rank_split(lengths, ranks)
    plan = []
    for j in range(B // rows_per_mini):
        chunks = [rows[j * per_rank:(j + 1) * per_rank] for rows in split]
        mbs = legacy_micro_batches([[lengths[i] for i in c] for c in chunks], max_tokens)
        plan.append([LossCall([chunks[r][i] for i in mb], len(mb) / per_rank / ranks, True, r)
                     for r in range(ranks) for mb in mbs[r]])
    return plan


@dataclass(frozen=True)
class PlacedRow:
    """A row of the training batch as a real data-parallel rank receives it: its loss call (a number
    unique in the batch, increasing in the order the rank runs its calls) and the call's scale."""

    row: int
    call: int
    scale: float


def real_rank_order(plan: list[list[LossCall]], ranks: int, real_ranks: int) -> list[PlacedRow]:
    """The official layout's loss calls (`official_loss_calls`) placed on `real_ranks` ranks that
    receive equal contiguous chunks of the batch, each holding ranks / real_ranks emulated ranks.

    Returns the rows in dispatch order: real rank by real rank; within one, mini-batch by mini-batch
    (so that the rank's own split into mini-batches, in order, gives the plan's); within a mini-batch,
    call by call of its emulated ranks.
    """
    if ranks % real_ranks:
        raise ValueError(f"{ranks} emulated ranks do not split over {real_ranks} data-parallel ranks")
    per_real = ranks // real_ranks
    out: list[PlacedRow] = []
    call = 0
    for q in range(real_ranks):
        for calls in plan:
            for c in calls:
                if q * per_real <= c.rank < (q + 1) * per_real:
                    out.extend(PlacedRow(i, call, c.scale) for i in c.rows)
                    call += 1
    return out
