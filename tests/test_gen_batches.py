"""The official generation batches on both backends, on the same outcomes (issue 29).

The embedded backend draws them in `collect_rollouts`; verl through our custom sampler
(stare_cli/backends/verl_sampler.py) inside verl's replay buffer. Both are fed the same prompts in
the same order, and every prompt's responses the same correctness, so the official rule (generation
batches of G prompts, groups whose `acc` is the same for every response dropped, the first T kept
groups in generation order trained on, at most max_gen_batches batches, then an error) must pick the
same groups on both. The rollout engine and TransferQueue are stand-ins; the rule's code is the
backends' own."""

from __future__ import annotations

import types

import pytest

from benchmarks.generation.engines import Sample

pytest.importorskip("verl.trainer.ppo.v1.replay_buffer")

T, G, N, MAX_GEN = 3, 4, 2, 3
# Per prompt in data order, the correctness of its N responses. Batch 1 (p0-p3) keeps p1 and p3;
# batch 2 (p4-p7) keeps p6 and p7: 4 kept >= T = 3, so the groups trained on are p1, p3, p6 (p7 is surplus).
OUTCOMES = [(1, 1), (0, 1), (0, 0), (1, 0), (1, 1), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (1, 1), (0, 0)]
# Too few: batches of all-equal groups only (3 batches of 4 keep 1 group)
SHORT = [(1, 1), (0, 0), (1, 1), (0, 1)] + [(0, 0)] * 8


def _embedded(outcomes):
    from stare_cli.backends.embedded import check_batch_filled, collect_rollouts
    from stare_cli.core.resolve import load_recipe
    from stare_cli.method.layer import MethodLayer

    cfg = load_recipe("tiny/arith", "grpo-ds", [
        f"rollout.n={N}", f"rollout.gen_batch_size={G}", f"rollout.max_gen_batches={MAX_GEN}",
        f"optim.train_batch_size={T}", f"optim.mini_batch_size={T}", f"optim.micro_batch_size={T * N}",
        "rollout.refill=gen_batches", "rollout.on_short_batch=error", "data.shuffle=false",
        "reward.fn=math-verify", "method.overlong.enable=false", "rollout.truncated=grade"])
    layer = MethodLayer.from_recipe(cfg)
    rows = [{"problem": f"p{i}", "answer": "1"} for i in range(len(outcomes))]

    class Engine:
        def generate(self, prompts, sp, tools):
            return [[Sample(text=f"so \\boxed{{{c}}}", response_ids=[1, 2, 3]) for c in outcomes[int(p.strip()[1:])]]
                    for p in prompts]

    try:
        ro, _ = collect_rollouts(layer, Engine(), rows, 0, 0, cfg, None, False, None, lambda: None)
        check_batch_filled(ro, layer, cfg, 0)
    finally:
        layer.close()
    picked = sorted({(d.group // 100_000) * G + d.group % 100_000 for d in ro.kept})
    return picked, ro.metrics["gen_batches"], ro.metrics["groups_dropped"]


class FakeTQ:
    """TransferQueue's key-value calls the replay buffer makes, in memory: prompts finish at once."""

    def __init__(self, outcomes):
        self.outcomes = outcomes
        self.store: dict[str, dict] = {}  # key -> tag, in insertion order
        self.acc: dict[str, float] = {}
        self.next = 0

    def add(self, k):
        for _ in range(k):
            i = self.next
            self.next += 1
            uid = f"p{i}"
            self.store[uid] = {"is_prompt": True, "status": "finished", "global_steps": 1}
            for j, c in enumerate(self.outcomes[i]):
                self.store[f"{uid}_{j}"] = {"seq_len": 10}
                self.acc[f"{uid}_{j}"] = float(c)
        return k

    def kv_list(self):
        return {"train": dict(self.store)}

    def kv_batch_get(self, keys, partition_id, select_fields):
        return {"extra_fields": [{"reward_extra_info": {"acc": self.acc[k]}} for k in keys]}

    def kv_clear(self, partition_id, keys):
        for k in keys:
            self.store.pop(k, None)


def _verl(outcomes, monkeypatch):
    from verl.trainer.ppo.v1 import replay_buffer

    from stare_cli.backends import verl_sampler

    fake = FakeTQ(outcomes)
    mod = types.SimpleNamespace(kv_list=fake.kv_list, kv_batch_get=fake.kv_batch_get, kv_clear=fake.kv_clear)
    monkeypatch.setattr(replay_buffer, "tq", mod)
    monkeypatch.setattr(verl_sampler, "tq", mod)
    sampler = verl_sampler.OfficialGenBatches(
        trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop",
        sampler_kwargs={"gen_batch_size": G, "max_gen_batches": MAX_GEN, "metric": "acc"}, poll_interval=0.0,
        refill_fn=fake.add)
    fake.add(T)  # verl's sync trainer dispatches train_batch_size prompts before it samples (prepare_step)
    batch, metrics = sampler.sample(global_steps=1, partition_id="train", batch_size=T)
    picked = sorted({int(k.split("_")[0][1:]) for k in batch.keys})
    return picked, metrics["gen_batches"], metrics["groups_dropped"]


def test_both_backends_train_on_the_same_groups(monkeypatch):
    emb = _embedded(OUTCOMES)
    ver = _verl(OUTCOMES, monkeypatch)
    assert emb == ver == ([1, 3, 6], 2, 4)  # p1, p3, p6; two generation batches; four groups dropped


def test_both_backends_stop_after_max_gen_batches(monkeypatch):
    from stare_cli.backends.verl_sampler import ShortBatchError
    from stare_kernel.errors import StareError

    with pytest.raises(StareError, match="3 generation batches kept 1 groups"):
        _embedded(SHORT)
    with pytest.raises(ShortBatchError, match="3 generation batches of 4 prompts kept 1 groups"):
        _verl(SHORT, monkeypatch)
