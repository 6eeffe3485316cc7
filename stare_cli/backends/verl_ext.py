"""Our methods inside verl 0.9.x: imported in every verl process (VERL_USE_EXTERNAL_MODULES and
actor_rollout_ref.model.external_lib name this module); it acts only where STARE_VERL_METHOD is set.

In verl's driver (the process that runs RayPPOTrainer.fit):
- after the old-log-prob pass, the token entropies are kept and the STARE controller is updated
  once per step with their token-mean over the response mask (the same number verl logs as
  actor/entropy);
- after verl's compute_advantage, `transform_advantages` applies the method's token-level
  transform (STARE weights, the 80/20 mask, EntroAdv, W-REINFORCE) before the actor update;
- the controller state is saved beside verl's checkpoints and restored with them;
- every metrics row verl logs is mirrored into $STARE_RUN_DIR/metrics.jsonl (with the controller's
  gate, W and M), so `stare compare` reads verl runs like embedded ones.
"""

from __future__ import annotations

import json
import os
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
    from verl.trainer.ppo import ray_trainer
    from verl.utils import tracking

    if getattr(ray_trainer, "_stare_installed", False):
        return
    ray_trainer._stare_installed = True
    controller = make_controller(payload)
    state: dict[str, Any] = {"entropy": None, "metrics": {}}

    orig_old = ray_trainer.RayPPOTrainer._compute_old_log_prob

    def _compute_old_log_prob(self, batch, *a, **k):
        out = orig_old(self, batch, *a, **k)
        old = out[0] if isinstance(out, tuple) else out
        ent = old.batch["entropys"].float()
        mask = batch.batch["response_mask"].float()
        state["entropy"] = ent.clone()
        controller.update(float((ent * mask).sum() / mask.sum().clamp(min=1)))
        return out

    orig_adv = ray_trainer.compute_advantage

    def compute_advantage(data, *a, **k):
        data = orig_adv(data, *a, **k)
        ent = state["entropy"]
        if ent is not None and ent.shape != data.batch["advantages"].shape:
            raise RuntimeError("stare: entropies of the old-log-prob pass do not match the batch")
        adv, metrics = transform_advantages(payload, controller, data.batch["advantages"], data.batch["response_mask"],
                                            data.batch["old_log_probs"], ent, data.batch["token_level_rewards"])
        data.batch["advantages"] = adv
        state["metrics"] = metrics
        return data

    orig_save = ray_trainer.RayPPOTrainer._save_checkpoint

    def _save_checkpoint(self, *a, **k):
        r = orig_save(self, *a, **k)
        folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "stare_controller.json").write_text(json.dumps(controller.state_dict()))
        return r

    orig_load = ray_trainer.RayPPOTrainer._load_checkpoint

    def _load_checkpoint(self, *a, **k):
        r = orig_load(self, *a, **k)
        f = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}" / "stare_controller.json"
        if f.exists():
            controller.load_state_dict(json.loads(f.read_text()))
        return r

    orig_log = tracking.Tracking.log

    def log(self, data, step, backend=None):
        data = {**data, **state["metrics"]}
        if run_dir is not None:
            row = {"step": step, **mirror_keys(data)}
            with open(run_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(row, default=float) + "\n")
        return orig_log(self, data, step, backend) if backend is not None else orig_log(self, data, step)

    ray_trainer.RayPPOTrainer._compute_old_log_prob = _compute_old_log_prob
    ray_trainer.compute_advantage = compute_advantage
    ray_trainer.RayPPOTrainer._save_checkpoint = _save_checkpoint
    ray_trainer.RayPPOTrainer._load_checkpoint = _load_checkpoint
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


try:  # our losses under our method names, in every process that has verl (actor workers look them up)
    from baselines.verl_adapter import register_all

    register_all()
except ImportError:
    pass

_payload = os.environ.get("STARE_VERL_METHOD")
if _payload:  # only in runs we launched; importing this module elsewhere changes nothing
    try:
        install(json.loads(_payload), Path(os.environ["STARE_RUN_DIR"]) if os.environ.get("STARE_RUN_DIR") else None)
    except ImportError:  # a process without verl's trainer (e.g. a rollout worker): nothing to patch
        pass
