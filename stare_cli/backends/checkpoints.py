"""The embedded trainer's checkpoints: written atomically (stare_cli/core/runs.py states the
guarantees), restored with the recipe in effect on resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from stare_cli.core.config import Recipe
from stare_kernel.errors import StareError
from stare_kernel.io import disk_full, is_disk_full
from stare_cli.core.runs import (STATE as RUN_STATE, checkpoint_steps, fsync_dir, fsync_tree, save_pretrained_readable,
                                  write_manifest)

def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, scheduler, state: dict, keep_last: int) -> Path:
    """Write checkpoints/step-N: files into a temporary directory, a manifest of their sizes last,
    everything fsynced, renamed into place, then `latest` swapped to it (runs.py: the guarantees)."""
    import torch

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_pretrained_readable(model, tokenizer, tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
        (tmp / RUN_STATE).write_text(json.dumps(state, indent=2))
        write_manifest(tmp)
        fsync_tree(tmp)
    except Exception as e:  # a full disk names the checkpoint (safetensors and torch say only errno 28)
        if not is_disk_full(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full(final, "the half-written copy was removed; the run's earlier checkpoints are intact") from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    link_tmp = ckpt_root / ".latest.tmp"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(final.name)
    os.replace(link_tmp, ckpt_root / "latest")
    fsync_dir(ckpt_root)
    for old in checkpoint_steps(run_dir)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def restore_trainer_state(ckpt: Path, opt, sched, layer, cfg: Recipe) -> tuple[int, int]:
    """Load the optimizer, scheduler, RNG and controller state of `ckpt`; return (step, data cursor).
    Then apply the recipe in effect: a resume may change optim.lr, weight_decay, the schedule or
    total_steps (recorded in config-history.jsonl), and torch's load_state_dict would otherwise bring
    back the old lr and weight decay."""
    import torch

    try:
        blob = torch.load(ckpt / "trainer.pt", weights_only=True)  # our own file; tensors only
    except Exception as e:  # noqa: BLE001 - any unreadable file: name it
        raise StareError(f"{ckpt / 'trainer.pt'}: unreadable ({type(e).__name__}: {str(e)[:120]})",
                         hint="resume from an earlier checkpoint: point checkpoints/latest at it") from None
    opt.load_state_dict(blob["optimizer"])
    sched.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    st = json.loads((ckpt / RUN_STATE).read_text())
    if layer.controller is not None and st.get("controller"):
        layer.controller.load_state_dict(st["controller"])
    O = cfg.optim
    sched.base_lrs = [O.lr for _ in opt.param_groups]
    for g in opt.param_groups:
        g["initial_lr"], g["weight_decay"] = O.lr, O.weight_decay
        g["lr"] = O.lr * sched.lr_lambdas[0](sched.last_epoch)
    sched._last_lr = [g["lr"] for g in opt.param_groups]
    return st["step"], st["cursor"]
