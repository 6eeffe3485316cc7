"""Our methods inside verl 0.9.x, through the method layer (stare_cli/method/layer.py).

Imported in every verl process (VERL_USE_EXTERNAL_MODULES and actor_rollout_ref.model.external_lib name
this module). It registers our policy loss (`stare_layer`) in verl's loss registry and patches verl's
V1 trainer and actor loss; every patch acts only in runs whose verl config carries a `stare.recipe`
(written by verl_backend.py), so importing this module elsewhere changes nothing.

- Driver (the process running verl's V1 PPOTrainer): after verl's `_compute_advantage` the layer is
  rebuilt from `config.stare.recipe` with its one constructor; `driver_step` reads the batch's
  rewards, groups, response mask, old log-probs and entropies from TransferQueue, updates the STARE
  controller once per step with the token-mean entropy (verl's `actor/entropy`), runs the layer's
  advantages and batch transform, and the result replaces verl's advantages. The recipe and the
  controller's state (gate, W, M) go to the actor with the batch (`extra_info["stare_layer"]`), the
  way the official code passes its controller through `meta_info`. The controller's state is saved
  beside verl's checkpoints and restored with them; every metrics row verl logs is mirrored into the
  run directory's metrics.jsonl; rollout samples are written every `logging.samples_every` steps.
- Actor: verl's `ppo_loss` is wrapped so that our registered policy loss sees the current entropy and
  the step's controller state; that policy loss is the layer's `loss`, called once per micro-batch
  verl forms, so official-scope STARE selects exactly where the official code does.
- The official loss layout (`optim.loss_layout: official`): the driver's `_balance_batch` is replaced
  by `official_balance` (the official run's 16 ranks and their micro-batches, placed on verl's real
  ranks, each row's loss call and scale written beside it), verl's `prepare_micro_batches` forms one
  micro-batch per loss call, and the policy loss normalises each call by its own tokens times its
  scale (the legacy worker's per-micro-batch normalisation).
- Reward workers: verl_reward.py (a verl reward manager around the layer's `score`).
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

LAYER_KEY = "stare_layer"  # the batch's extra_info entry the actor reads


# ------------------------------------------------------------------------------- the layer, cached
_LAYERS: dict[str, Any] = {}


def layer_for(recipe: Any):
    """The method layer of a serialised recipe (a dict or OmegaConf node), one per process and recipe."""
    from omegaconf import DictConfig, OmegaConf

    from stare_cli.method.layer import MethodLayer

    if isinstance(recipe, DictConfig):
        recipe = OmegaConf.to_container(recipe, resolve=True)
    key = json.dumps(recipe, sort_keys=True)
    if key not in _LAYERS:
        _LAYERS[key] = MethodLayer.from_recipe(recipe)
    return _LAYERS[key]


def recipe_of(config: Any) -> Optional[dict]:
    """The recipe a verl config carries (None: not a stare run)."""
    from omegaconf import OmegaConf

    stare = config.get("stare", None) if config is not None else None
    if stare is None or stare.get("recipe", None) is None:
        return None
    return OmegaConf.to_container(stare.recipe, resolve=True)


# -------------------------------------------------------------------------------------- the driver
@dataclass
class DriverStep:
    """The driver's result for one batch: token advantages [B, T], metrics, the actor's payload, and the
    method layer's loss mask [B, T] where it differs from the rollout's (STAPO's silenced tokens; None
    otherwise): the driver writes it as verl's response_mask and loss_mask, the masks verl's policy
    loss and its global token count read."""

    advantages: torch.Tensor
    metrics: dict[str, float]
    payload: dict[str, Any]
    loss_mask: Optional[torch.Tensor] = None


def driver_step(layer, recipe: dict, uids: list, rm_scores: torch.Tensor, response_mask: torch.Tensor,
                old_log_probs: torch.Tensor, entropy: torch.Tensor, step: int) -> DriverStep:
    """Controller update and batch transform for one batch of padded [B, T] tensors (uids: [B] group
    ids as verl keeps them) at training step `step` (1-based, verl's global_steps). The controller sees
    the token-mean entropy over the response mask, the number verl logs as actor/entropy under
    token-mean aggregation."""
    from stare_cli.method.layer import BatchInputs

    index = {u: i for i, u in enumerate(dict.fromkeys(uids))}
    m = response_mask.float()
    H = float((entropy.float() * m).sum() / m.sum().clamp(min=1))
    state, metrics = layer.begin_step(H)
    bt = layer.transform_batch(BatchInputs(
        rewards=rm_scores.float().sum(-1), group=torch.tensor([index[u] for u in uids]), mask=m,
        old_log_prob=old_log_probs.float(), entropy=entropy.float(),
        finished=torch.ones(len(uids), dtype=torch.bool)), state)
    metrics.update(bt.metrics)
    payload = {"recipe": recipe, "state": None if state is None else state.to_dict(), "step": int(step)}
    return DriverStep(bt.advantages, metrics, payload, None if torch.equal(bt.mask, m) else bt.mask)


def _install_driver() -> None:  # pragma: no cover - runs inside verl's driver (tests/test_verl_cpu.py)
    """Patch verl's V1 trainer (main_ppo's default, `trainer.use_v1=True`)."""
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils import tracking

    if getattr(trainer_base, "_stare_installed", False):
        return
    trainer_base._stare_installed = True
    Trainer = trainer_base.PPOTrainer

    def layer_of(trainer):
        recipe = recipe_of(trainer.config)
        return (None, None) if recipe is None else (layer_for(recipe), recipe)

    orig_adv = Trainer._compute_advantage

    def _compute_advantage(self, batch, metrics):
        layer, recipe = layer_of(self)
        batch = orig_adv(self, batch, metrics)
        if layer is None:
            return batch
        _dump_effective_config(self.config)
        import numpy as np
        import transfer_queue as tq
        from tensordict import TensorDict
        from verl.workers.utils.padding import response_to_nested

        fields = ["uid", "response_mask", "old_log_probs", "entropy", "rm_scores", "responses", "extra_fields"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        nested_mask = data["response_mask"]
        uids = list(np.array(data.pop("uid").tolist(), dtype=object))
        responses = data.pop("responses")
        real = [not tag.get("is_padding", False) for tag in batch.tags]
        infos = [getattr(x, "data", x) for x in data.pop("extra_fields").tolist()]
        padded = data.to_padded_tensor()
        out = driver_step(layer, recipe, uids, padded["rm_scores"], padded["response_mask"], padded["old_log_probs"],
                          padded["entropy"], self.global_steps)
        put = {"advantages": response_to_nested(out.advantages, nested_mask)}
        if out.loss_mask is not None:  # STAPO: the silenced tokens leave verl's loss and its token count
            lm = response_to_nested(out.loss_mask.to(nested_mask.dtype), nested_mask)
            put.update(response_mask=lm, loss_mask=lm)
        batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                fields=TensorDict(put, batch_size=len(batch)))
        batch.extra_info[LAYER_KEY] = out.payload
        texts = self.tokenizer.batch_decode([r.tolist() for r in responses.unbind()], skip_special_tokens=True)
        out.metrics.update(_step_text_metrics(self, layer, texts, padded["rm_scores"].sum(-1).tolist(), uids))
        out.metrics.update(reward_info_means([i for i, r in zip(infos, real) if r]))
        metrics.update(out.metrics)
        return batch

    orig_balance = Trainer._balance_batch

    def _balance_batch(self, batch, metrics, *a, **k):
        layer, _ = layer_of(self)
        if layer is None or layer.recipe.optim.loss_layout != "official":
            return orig_balance(self, batch, metrics, *a, **k)
        return official_balance(self, layer, batch, metrics)

    orig_save = Trainer._save_checkpoint

    def _save_checkpoint(self, *a, **k):
        r = orig_save(self, *a, **k)
        layer, _ = layer_of(self)
        if layer is not None and layer.controller is not None:
            folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "stare_controller.json").write_text(json.dumps(layer.controller.state_dict()))
        return r

    orig_load = Trainer._load_checkpoint

    def _load_checkpoint(self, *a, **k):
        r = orig_load(self, *a, **k)
        layer, _ = layer_of(self)
        f = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}" / "stare_controller.json"
        if layer is not None and layer.controller is not None and self.global_steps and f.exists():
            layer.controller.load_state_dict(json.loads(f.read_text()))
        return r

    orig_init = tracking.Tracking.__init__
    orig_log = tracking.Tracking.log

    def __init__(self, *a, config=None, **k):
        orig_init(self, *a, config=config, **k)
        stare = (config or {}).get("stare") if isinstance(config, dict) else None
        self._stare_run_dir = Path(stare["run_dir"]) if stare and stare.get("run_dir") else None

    def log(self, data, step, backend=None):
        run_dir = getattr(self, "_stare_run_dir", None)
        if run_dir is not None:
            with open(run_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps({"step": step, **mirror_keys(data)}, default=float) + "\n")
        return orig_log(self, data, step, backend) if backend is not None else orig_log(self, data, step)

    Trainer._compute_advantage = _compute_advantage
    Trainer._balance_batch = _balance_batch
    Trainer._save_checkpoint = _save_checkpoint
    Trainer._load_checkpoint = _load_checkpoint
    tracking.Tracking.__init__ = __init__
    tracking.Tracking.log = log


CALL_FIELD, SCALE_FIELD = "stare_call", "stare_scale"  # per-row fields of the official loss layout


def official_balance(trainer, layer, batch, metrics: dict):  # pragma: no cover - inside verl's driver (test_verl_cpu)
    """`optim.loss_layout: official` in place of verl's `_balance_batch`: the official run's ranks and
    micro-batches (baselines.micro_batches.official_loss_calls) placed on verl's real data-parallel
    ranks (real_rank_order), the batch reordered so that each real rank's equal chunk holds whole
    emulated ranks, and every row's loss call and scale written to TransferQueue for the actor
    (`prepare_micro_batches` and the policy loss below read them)."""
    import transfer_queue as tq
    from tensordict import TensorDict

    from baselines.micro_batches import official_loss_calls, real_rank_order

    wg = trainer.actor_rollout_wg
    if "actor" not in wg._dispatch_info:
        wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
    dp = max(wg._dispatch_info["actor"]) + 1
    if any(tag.get("is_padding", False) for tag in batch.tags):
        raise RuntimeError("the official loss layout needs a batch without padding rows")
    O, R = layer.recipe.optim, layer.recipe.rollout
    lengths = [int(tag["seq_len"]) for tag in batch.tags]
    plan = official_loss_calls(lengths, O.mini_batch_size * R.n, O.official_ranks, O.micro_batch_tokens)
    placed = real_rank_order(plan, O.official_ranks, dp)
    batch.reorder([p.row for p in placed])
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict({
        CALL_FIELD: torch.tensor([p.call for p in placed], dtype=torch.int64),
        SCALE_FIELD: torch.tensor([p.scale for p in placed], dtype=torch.float64)}, batch_size=len(placed)))
    calls = [c for mini in plan for c in mini]
    metrics["layout/loss_calls"] = float(len(calls))
    metrics["layout/over_budget"] = sum(sum(lengths[i] for i in c.rows) > O.micro_batch_tokens for c in calls) / len(calls)
    return batch


def layout_micro_batches(call_ids: list[int]) -> list[list[int]]:
    """Row indices of each micro-batch under the official layout: the rows of each loss call, calls
    in increasing number (the order real_rank_order gave them)."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(call_ids):
        groups.setdefault(int(c), []).append(i)
    return [groups[c] for c in sorted(groups)]


def wrap_prepare_micro_batches(orig):
    """verl's micro-batching, except for data carrying the official layout's loss calls (written by
    official_balance): then one micro-batch per loss call, as the official run formed it."""
    if getattr(orig, "_stare", False):
        return orig

    def prepare_micro_batches(data, *args, **kwargs):
        if CALL_FIELD not in data.keys():
            return orig(data, *args, **kwargs)
        from verl.utils import tensordict_utils as tu

        idx = layout_micro_batches(data[CALL_FIELD].tolist())
        return [tu.index_select_tensor_dict(data, i) for i in idx], idx

    prepare_micro_batches._stare = True
    return prepare_micro_batches


def _step_text_metrics(trainer, layer, texts: list[str], rewards: list[float], uids: list) -> dict[str, float]:
    """The reflection-word rate of the batch and, every logging.samples_every steps, a samples file
    (the embedded backend's samples/step-N.jsonl), from the decoded responses."""
    from benchmarks.evaluation.metrics import reflection_rate

    L = layer.recipe.logging
    step = trainer.global_steps
    run_dir = recipe_run_dir(trainer.config)
    if L.samples_every and step % L.samples_every == 0 and run_dir is not None:
        (run_dir / "samples").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "samples" / f"step-{step:06d}.jsonl", "w") as f:
            for t, r, u in list(zip(texts, rewards, uids))[:64]:
                f.write(json.dumps({"group": str(u), "reward": r, "response": t}) + "\n")
    return {"reflection_rate": reflection_rate(texts, L.reflection_words)}


def _dump_effective_config(config: Any) -> None:
    """verl's configuration as the trainer runs with it (after verl's own adjustments at start-up),
    once, as run_dir/verl_effective_config.json: tests compare it with what we wrote."""
    from omegaconf import OmegaConf

    run_dir = recipe_run_dir(config)
    if run_dir is not None and not (run_dir / "verl_effective_config.json").exists():
        (run_dir / "verl_effective_config.json").write_text(
            json.dumps(OmegaConf.to_container(config, resolve=True), indent=1, default=str))


def reward_info_means(infos: list) -> dict[str, float]:
    """Means of what our reward manager recorded per response (acc, format, official_score) over the
    trained batch (verl drops filtered groups before this point; the embedded backend's means are
    over every response drawn)."""
    keys = ("acc", "format", "official_score")
    rows = [(i or {}).get("reward_extra_info", {}) if isinstance(i, dict) else {} for i in infos]
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in keys if rows and all(k in r for r in rows)}


def recipe_run_dir(config: Any) -> Optional[Path]:
    stare = config.get("stare", None)
    return Path(stare.run_dir) if stare is not None and stare.get("run_dir", None) else None


MIRROR = {"critic/rewards/mean": "reward", "actor/entropy": "entropy", "response_length/mean": "len/mean",
          "response_length/max": "len/max", "actor/pg_clipfrac": "actor/clip_frac", "actor/ppo_kl": "actor/ppo_kl",
          "actor/grad_norm": "grad_norm", "actor/lr": "lr"}


def mirror_keys(data: dict) -> dict:
    """verl's metric names plus ours (reward, entropy, len/mean, ...) for the same numbers; the
    method layer's loss statistics, which verl files under actor/, also under their own names."""
    out = {k: (float(v) if hasattr(v, "__float__") else v) for k, v in data.items()}
    for src, dst in MIRROR.items():
        if src in data:
            out[dst] = float(data[src])
    for k, v in data.items():
        if k.startswith("actor/stare/"):
            out[k.removeprefix("actor/")] = float(v)
    return out


# --------------------------------------------------------------------------------------- the actor
@dataclass
class _Call:
    """What one verl loss call hands our policy loss besides verl's arguments."""

    layer: Any
    entropy: Optional[torch.Tensor]
    state: Any  # StareState or None
    scale: Optional[float] = None  # the official layout's factor for this loss call (None: verl's global layout)
    step: Optional[int] = None  # the training step (1-based): an annealed Clip-Cov/KL-Cov reads it


_CALL: contextvars.ContextVar[Optional[_Call]] = contextvars.ContextVar("stare_loss_call", default=None)


def verl_agg(loss_agg_mode: str, config: Any):
    """Our Agg from verl's global batch info: verl divides by the global counts and multiplies by
    dp_size, which is dividing by the counts over dp_size."""
    from baselines import Agg

    info = dict(getattr(config, "global_batch_info", {}) or {})
    dp = info.get("dp_size", 1) or 1
    n_tok, n_seq = info.get("batch_num_tokens"), info.get("global_batch_size")
    return Agg(loss_agg_mode, num_tokens=None if n_tok is None else n_tok / dp,
               num_seqs=None if n_seq is None else n_seq / dp, scale=info.get("loss_scale_factor"),
               factor=float(dp) if loss_agg_mode == "token-sum" else 1.0)


def layer_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                      rollout_is_weights=None):
    """verl's policy-loss signature around the method layer's loss (registered as `stare_layer`)."""
    from baselines.aggregation import counted_agg
    from stare_cli.method.layer import LossInputs

    call = _CALL.get()
    if call is None:
        raise RuntimeError("the stare_layer policy loss runs inside stare's wrapped ppo_loss only "
                           "(the batch carries no method-layer payload)")
    if rollout_is_weights is not None:  # verl multiplies token losses by these; so does scaling A (w > 0)
        advantages = advantages * rollout_is_weights
    mask = response_mask.float()
    info = dict(getattr(config, "global_batch_info", {}) or {})
    # the official layout: the call's own counts (the legacy worker's agg_loss), then its scale
    agg = verl_agg(loss_agg_mode, config) if call.scale is None else \
        counted_agg(loss_agg_mode, mask, info.get("loss_scale_factor"))
    loss, stats = call.layer.loss(LossInputs(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, mask=mask,
        agg=agg, entropy=call.entropy, stare=call.state, step=call.step))
    if call.scale is not None:
        # x dp_size: the engine's gradient all-reduce averages over verl's real ranks, while the
        # emulated ranks' average is already in the scale
        loss = loss * (call.scale * float(info.get("dp_size", 1) or 1))
        stats["layout/scale"] = call.scale
    names = {"clip_frac": "actor/pg_clipfrac", "clip_frac_lower": "actor/pg_clipfrac_lower", "ppo_kl": "actor/ppo_kl"}
    return loss, {names.get(k, k if k.startswith("stare/") else f"actor/{k}"): float(v) for k, v in stats.items()}


def wrap_ppo_loss(orig):
    """verl's ppo_loss, with the current entropy and the step's controller state made available to
    our policy loss when the batch carries the method layer's payload."""
    if getattr(orig, "_stare", False):
        return orig

    def ppo_loss(config, model_output, data, dp_group=None):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        from stare_cli.method.layer import StareState

        payload = tu.get_non_tensor_data(data=data, key=LAYER_KEY, default=None)
        if payload is None:
            return orig(config, model_output, data, dp_group)
        entropy = model_output.get("entropy", None)
        state = payload.get("state")
        scale = float(data[SCALE_FIELD][0]) if SCALE_FIELD in data.keys() else None
        token = _CALL.set(_Call(layer_for(payload["recipe"]),
                                None if entropy is None else no_padding_2_padding(entropy, data).float(),
                                None if state is None else StareState.from_dict(state), scale, payload.get("step")))
        try:
            return orig(config, model_output, data, dp_group)
        finally:
            _CALL.reset(token)

    ppo_loss._stare = True
    return ppo_loss


def _install_actor() -> None:
    """Register our policy loss and wrap verl's ppo_loss wherever verl bound it."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss
    from verl.workers.utils import losses

    if "stare_layer" not in POLICY_LOSS_REGISTRY:
        register_policy_loss("stare_layer")(layer_policy_loss)
    orig = losses.ppo_loss
    new = wrap_ppo_loss(orig)
    if new is not orig:
        losses.ppo_loss = new
        _rebind_in_verl("ppo_loss", orig, new)
    from verl.workers.engine import utils as engine_utils

    orig_mb = engine_utils.prepare_micro_batches
    new_mb = wrap_prepare_micro_batches(orig_mb)
    if new_mb is not orig_mb:
        engine_utils.prepare_micro_batches = new_mb
        _rebind_in_verl("prepare_micro_batches", orig_mb, new_mb)


def _plain_tokenizer_support() -> None:
    """Models whose tokenizer is a plain `tokenizers` object (the CPU toy's; see
    benchmarks.generation.engines.load_tokenizer): transformers 5's AutoTokenizer picks a class from the model
    type (Qwen2Tokenizer) and drops their pre-tokenizer, and verl's agent loop picks the ChatML
    boundary handling from the model type, which needs <|im_end|>. Both are steered to the generic
    path for such tokenizers only; every other model loads exactly as verl does it."""
    import verl.utils
    import verl.utils.tokenizer
    from verl.utils.tokenizer import continuous_token_wiring
    from verl.utils.tokenizer import tokenizer as verl_tok

    from benchmarks.generation.engines import is_plain_tokenizer, load_tokenizer

    orig_tok = verl_tok.hf_tokenizer
    if not getattr(orig_tok, "_stare", False):
        def hf_tokenizer(name_or_path, correct_pad_token=True, correct_gemma2=True, **kwargs):
            if isinstance(name_or_path, (str, Path)) and is_plain_tokenizer(str(name_or_path)):
                tok = load_tokenizer(str(name_or_path))
                if correct_pad_token:
                    verl_tok.set_pad_token_id(tok)
                return tok
            return orig_tok(name_or_path, correct_pad_token=correct_pad_token, correct_gemma2=correct_gemma2, **kwargs)

        hf_tokenizer._stare = True
        _rebind_in_verl("hf_tokenizer", orig_tok, hf_tokenizer)
    orig = continuous_token_wiring.create_continuous_token_builder
    if getattr(orig, "_stare", False):
        return

    def create_continuous_token_builder(tokenizer, *, model_family="auto", **kwargs):
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        if model_family == "auto" and "<|im_end|>" not in vocab:
            model_family = "default"
        return orig(tokenizer, model_family=model_family, **kwargs)

    create_continuous_token_builder._stare = True
    _rebind_in_verl("create_continuous_token_builder", orig, create_continuous_token_builder)


def _rebind_in_verl(attr: str, old, new) -> None:
    """Replace `old` by `new` under `attr` in every loaded verl module: modules imported before the
    patch bound verl's function by name."""
    for name, mod in list(sys.modules.items()):
        if (name == "verl" or name.startswith("verl.")) and getattr(mod, attr, None) is old:
            setattr(mod, attr, new)


if os.environ.get("VERL_PLATFORM") == "stare_cpu":  # the CPU platform must exist before verl's engine and trainer import
    from stare_cli.backends import verl_cpu

    verl_cpu.install()

try:  # our policy loss and the ppo_loss / micro-batch wrappers, in every process that has verl (actor workers use them)
    _install_actor()
except ImportError:
    pass

try:  # the driver patches act only for trainers whose config carries stare.recipe
    _plain_tokenizer_support()
    _install_driver()
except ImportError:  # a process without verl's trainer (e.g. a rollout worker): nothing to patch
    pass
