"""Our methods inside verl 0.9.x: imported in every verl process (VERL_USE_EXTERNAL_MODULES and
actor_rollout_ref.model.external_lib name this module); it acts only where STARE_VERL_METHOD is set.

In verl's driver (the process that runs verl's V1 PPOTrainer.fit, main_ppo's default):
- after verl's `_compute_advantage` (GRPO advantages, one per response, in TransferQueue), the
  token entropies and log-probs of the old-log-prob pass are read back, the STARE controller is
  updated once per step with their token-mean over the response mask (the number verl logs as
  actor/entropy under token-mean aggregation), and `transform_advantages` applies the method's
  token-level transform (STARE weights, the 80/20 mask, EntroAdv, W-REINFORCE); the result replaces
  the advantages in TransferQueue before the actor update;
- the controller state is saved beside verl's checkpoints and restored with them;
- every metrics row verl logs is mirrored into $STARE_RUN_DIR/metrics.jsonl (with the controller's
  gate, W and M), so `stare compare` reads verl runs like embedded ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch


def transform_advantages(payload: dict, controller, adv: torch.Tensor, mask: torch.Tensor, old_log_prob: torch.Tensor,
                         entropy: Optional[torch.Tensor], token_rewards: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The method's advantage transform on [B, T] tensors; returns (advantages, metrics)."""
    from baselines import entro_adv, top_entropy_mask, w_reinforce_advantage

    metrics: dict[str, float] = {}
    m = mask.to(adv.dtype)
    if payload.get("w_reinforce"):
        adv = w_reinforce_advantage(token_rewards.sum(-1), payload["w_reinforce_lambda"]).to(adv.dtype)[:, None] * m
    if payload.get("entro_adv"):
        c = payload["entro_adv_cfg"]
        adv = entro_adv(adv, entropy, c["alpha"], c["kappa"]) * m
    if payload.get("top_entropy"):
        adv = adv * top_entropy_mask(entropy, mask, payload["top_entropy_frac"]).to(adv.dtype)
    if payload.get("stare"):
        w = controller.weights(adv, old_log_prob, mask)
        adv = adv * w.to(adv.dtype)
        n = m.sum().clamp(min=1)
        metrics.update({"stare/gate": float(controller.gate), "stare/W": controller.W, "stare/M": controller.M,
                        "stare/sel_pos": float(((w > 1) & (mask > 0)).sum() / n),
                        "stare/sel_neg": float(((w < 1) & (mask > 0)).sum() / n)})
    return adv, metrics


def make_controller(payload: dict):
    from baselines import StareController

    c = payload["stare_cfg"]
    return StareController(variant=payload.get("stare") or "o1", P=c["P"], W=c["W"], M=c["M"], h_tgt=c["h_tgt"],
                           adaptive=c["adaptive"], alpha=c["alpha"], w_max=c["w_max"], m_min=c["m_min"])


def install(payload: dict, run_dir: Optional[Path]) -> None:  # pragma: no cover - runs inside verl's driver
    """Patch verl's V1 trainer (main_ppo's default, `trainer.use_v1=True`) in this process."""
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils import tracking

    if getattr(trainer_base, "_stare_installed", False):
        return
    trainer_base._stare_installed = True
    controller = make_controller(payload)
    state: dict[str, Any] = {"metrics": {}}
    Trainer = trainer_base.PPOTrainer

    orig_adv = Trainer._compute_advantage

    def _compute_advantage(self, batch, metrics):
        # verl's GRPO path broadcasts one advantage per response; the token-level transform comes
        # after it, on the same padded layout verl uses, and is written back in verl's format.
        import transfer_queue as tq
        from tensordict import TensorDict
        from verl.workers.utils.padding import response_to_nested

        batch = orig_adv(self, batch, metrics)
        fields = ["advantages", "response_mask", "old_log_probs", "entropy", "rm_scores"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()
        adv, mask, ent = padded["advantages"], padded["response_mask"], padded["entropy"].float()
        m = mask.float()
        controller.update(float((ent * m).sum() / m.sum().clamp(min=1)))  # token-mean H of the old-log-prob pass
        adv, step_metrics = transform_advantages(payload, controller, adv, mask, padded["old_log_probs"], ent,
                                                 padded["rm_scores"])
        out = TensorDict({"advantages": response_to_nested(adv, nested_mask)}, batch_size=len(batch))
        batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)
        metrics.update(step_metrics)
        state["metrics"] = step_metrics
        return batch

    orig_save = Trainer._save_checkpoint

    def _save_checkpoint(self, *a, **k):
        r = orig_save(self, *a, **k)
        folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "stare_controller.json").write_text(json.dumps(controller.state_dict()))
        return r

    orig_load = Trainer._load_checkpoint

    def _load_checkpoint(self, *a, **k):
        r = orig_load(self, *a, **k)
        f = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}" / "stare_controller.json"
        if self.global_steps and f.exists():
            controller.load_state_dict(json.loads(f.read_text()))
        return r

    orig_log = tracking.Tracking.log

    def log(self, data, step, backend=None):
        if run_dir is not None:
            row = {"step": step, **mirror_keys(data)}
            with open(run_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(row, default=float) + "\n")
        return orig_log(self, data, step, backend) if backend is not None else orig_log(self, data, step)

    Trainer._compute_advantage = _compute_advantage
    Trainer._save_checkpoint = _save_checkpoint
    Trainer._load_checkpoint = _load_checkpoint
    tracking.Tracking.log = log


MIRROR = {"critic/rewards/mean": "reward", "actor/entropy": "entropy", "response_length/mean": "len/mean",
          "response_length/max": "len/max", "actor/pg_clipfrac": "actor/clip_frac", "actor/ppo_kl": "actor/ppo_kl",
          "actor/grad_norm": "grad_norm", "actor/lr": "lr"}


def mirror_keys(data: dict) -> dict:
    """verl's metric names plus ours (reward, entropy, len/mean, ...) for the same numbers."""
    out = {k: (float(v) if hasattr(v, "__float__") else v) for k, v in data.items()}
    for src, dst in MIRROR.items():
        if src in data:
            out[dst] = float(data[src])
    return out


def _plain_tokenizer_support() -> None:
    """Models whose tokenizer is a plain `tokenizers` object (the CPU toy's; see
    benchmarks.engines.load_tokenizer): transformers 5's AutoTokenizer picks a class from the model
    type (Qwen2Tokenizer) and drops their pre-tokenizer, and verl's agent loop picks the ChatML
    boundary handling from the model type, which needs <|im_end|>. Both are steered to the generic
    path for such tokenizers only; every other model loads exactly as verl does it."""
    import verl.utils
    import verl.utils.tokenizer
    from verl.utils.tokenizer import continuous_token_wiring
    from verl.utils.tokenizer import tokenizer as verl_tok

    from benchmarks.engines import is_plain_tokenizer, load_tokenizer

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


try:  # our losses under our method names, in every process that has verl (actor workers look them up)
    from baselines.verl_adapter import register_all

    register_all()
except ImportError:
    pass

if os.environ.get("VERL_PLATFORM") == "stare_cpu":  # the CPU platform must exist before verl's trainer imports
    from stare_cli.backends import verl_cpu

    verl_cpu.install()

_payload = os.environ.get("STARE_VERL_METHOD")
if _payload:  # only in runs we launched; importing this module elsewhere changes nothing
    _plain_tokenizer_support()
    try:
        install(json.loads(_payload), Path(os.environ["STARE_RUN_DIR"]) if os.environ.get("STARE_RUN_DIR") else None)
    except ImportError:  # a process without verl's trainer (e.g. a rollout worker): nothing to patch
        pass
