"""The method layer's reward as a verl reward manager (verl 0.9's reward loop), so a verl run scores
responses exactly as the embedded backend does: the recipe's reward function, truncation rule,
format penalty and overlong shaping (stare_cli/method/layer.py, `score`).

verl_backend.py points `reward.reward_manager` here by package (`pkg://stare_cli.backends.verl_reward`,
class StareRewardManager), so nothing refers to a path on the submitting machine. The recipe comes from
verl's config (`stare.recipe`). Each response's `acc` goes into reward_extra_info, where verl's group
filter (`algorithm.filter_groups.metric=acc`) reads it, beside the official format check and `score`.

verl calls `run_single` on an event loop and scoring runs in its thread pool; math-verify's time limits
need a process's main thread (in a thread they raise), so grading runs in a small process pool.
"""

from __future__ import annotations

import threading

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from stare_cli.backends.verl_ext import layer_for, recipe_of


class StareRewardManager(RewardManagerBase):
    """verl's reward-manager interface around the method layer's `score`."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        recipe = recipe_of(config)
        if recipe is None:
            raise ValueError("StareRewardManager needs the stare.recipe that `stare train --backend verl` writes")
        self.layer = layer_for(recipe)
        self.layer.reward_function(workers=1)
        self.max_response = int(config.data.max_response_length)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.eos = {t for t in [tokenizer.eos_token_id, vocab.get("<|im_end|>"), vocab.get("<|endoftext|>")] if t is not None}
        self.lock = threading.Lock()  # one grading pool per manager; calls arrive from several threads

    def _score(self, text: str, gold: str, finished: bool, length: int):
        with self.lock:
            return self.layer.score([text], [gold], [finished], [length])

    async def run_single(self, data) -> dict:
        item = data[-1:][0]  # multi-sequence outputs: the last sequence, as verl's managers
        response_ids = item.batch["responses"]
        length = int(item.batch["attention_mask"][-response_ids.shape[-1]:].sum())
        ids = response_ids[:length].tolist()
        # Ended by itself: shorter than the budget, or the last token is an end-of-sequence token.
        finished = length < self.max_response or (bool(ids) and ids[-1] in self.eos)
        text = await self.loop.run_in_executor(None, lambda: self.tokenizer.decode(ids, skip_special_tokens=True))
        gold = str(item.non_tensor_batch["reward_model"]["ground_truth"])
        s = await self.loop.run_in_executor(None, lambda: self._score(text, gold, finished, length))
        return {"reward_score": float(s.reward[0]),
                "reward_extra_info": {"acc": float(s.acc[0]), "format": float(s.format[0]),
                                      "official_score": float(s.official_score[0])}}
