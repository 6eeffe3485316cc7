"""The official dynamic sampling inside verl 0.9's V1 trainer: whole generation batches with a cap.

The official trainer (hp-luo/STARE, recipe/STARE/stare_ray_trainer.py) draws generation batches of
`gen_batch_size` prompts (192), drops the groups whose `acc` is the same for every response (groups
of one response stay), concatenates what it keeps, and once it holds `train_batch_size` groups (64)
trains on the first 64 in generation order; after `max_num_gen_batches` (10) batches still short, it
stops with an error. verl 0.9's V1 replay buffer instead refills one prompt per dropped group, with no
cap. `OfficialGenBatches` is a verl custom sampler (`trainer.v1.sampler.custom_sampler`, written by
verl_backend.py for `rollout.refill: gen_batches`) that runs the official rule with verl's own
machinery: prompts go out through the trainer's refill function, groups are classified on the
recorded `acc` by verl's own DAPO classification, dropped and surplus groups are cleared from
TransferQueue as verl clears them.

How the batches are counted: at the start of a step verl's sync trainer has already dispatched
`train_batch_size` prompts; the first generation batch tops them up to `gen_batch_size`. A generation
batch is judged only when every prompt of it has finished (the official trainer also waits for a
whole batch). The first `train_batch_size` kept groups are taken in the order verl's TransferQueue
lists the prompts, which is the order they were dispatched (data order, batch after batch).

Validation batches go through verl's own sampling unchanged.
"""

from __future__ import annotations

from typing import Any

import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

SAMPLER = ("pkg://stare_cli.backends.verl_sampler", "OfficialGenBatches")


class ShortBatchError(RuntimeError):
    """max_gen_batches generation batches kept fewer groups than a train batch needs."""


class OfficialGenBatches(ReplayBuffer):
    """verl sampler for the official generation batches (module docstring). sampler_kwargs:
    gen_batch_size (prompts per generation batch), max_gen_batches, metric (the reward_extra_info
    entry groups are filtered on: `acc`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kw = dict(self.sampler_kwargs or {})
        self.gen_prompts = int(kw["gen_batch_size"])
        self.max_gen_batches = int(kw["max_gen_batches"])
        # verl's DAPO classification (`_dapo_filtered_keys`) reads the metric from here
        self.filter_groups_metric = str(kw.get("metric", "acc"))
        self._order: dict[str, None] = {}  # prompt uids of this step, in dispatch order

    def _note_order(self, partition_id: str) -> None:
        listing = tq.kv_list() or {}
        for key, tag in (listing.get(partition_id, {}) or {}).items():
            if tag.get("is_prompt", False) and key not in self._order:
                self._order[key] = None

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        if partition_id == "val":
            return super().sample(global_steps, partition_id, batch_size)
        gen_batches = 0
        last_debug = 0.0
        while True:
            self._sync_metadata_from_transfer_queue()
            self._note_order(partition_id)
            inflight = self.pending_keys[partition_id] | self.running_keys[partition_id]
            terminal = self.finished_keys[partition_id] | self.failure_keys[partition_id]
            if gen_batches == 0:  # the trainer dispatched train_batch_size prompts: top up to one generation batch
                missing = self.gen_prompts - len(inflight | terminal)
                if missing > 0:
                    self.refill_fn(missing)
                gen_batches = 1
                continue
            if inflight:
                last_debug = self._wait_for_next_poll(partition_id, last_debug)
                continue
            dropped, _ = self._dapo_filtered_keys(partition_id)
            kept = [u for u in self._order if u in terminal and u not in dropped]
            if len(kept) < batch_size and gen_batches < self.max_gen_batches:
                self.refill_fn(self.gen_prompts)
                gen_batches += 1
                continue
            if len(kept) < batch_size:
                raise ShortBatchError(
                    f"{gen_batches} generation batches of {self.gen_prompts} prompts kept {len(kept)} groups; a train "
                    f"batch needs {batch_size} (rollout.on_short_batch: error, as the official trainer; raise "
                    f"rollout.max_gen_batches, or use rollout.refill: per_group)")
            selected = kept[:batch_size]
            self._clear_groups(partition_id, terminal - set(selected))
            snapshot = dict(self.partitions[partition_id])
            self._order.clear()
            metrics = {"gen_batches": float(gen_batches), "groups_dropped": float(len(dropped)),
                       "train_groups": float(len(selected)), "groups_surplus": float(len(kept) - len(selected))}
            return self._materialize_batch(partition_id, selected, snapshot), metrics
