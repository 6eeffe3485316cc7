"""`stare export`: a training checkpoint as a Hugging Face folder that `stare eval`, vLLM and lm-eval load.

- Embedded checkpoints (`checkpoints/step-N`) already hold the model in Hugging Face form
  (safetensors, config, tokenizer, chat template): the export copies those files and leaves the
  trainer's own (optimizer, scheduler, state, manifest) behind.
- verl checkpoints (`checkpoints/global_step_N/actor`) are FSDP shards. When verl also wrote its
  Hugging Face copy at save time (`actor/huggingface/` with weights: our verl runs ask for it,
  `checkpoint.save_contents` includes hf_model), that copy is the export: it holds the fp32 master
  weights. Otherwise verl's own merger turns the shards into one (`python -m verl.model_merger merge
  --backend fsdp`). Note that the merger writes the model config's dtype, often bf16.

Every export has an `export.json` beside the weights: the source checkpoint, the run's method and
step, how the weights were obtained, and their SHA-256.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from stare_kernel.errors import StareError
from stare_cli.core.runs import atomic_write_text, file_sha256, is_verl_checkpoint

TRAINER_FILES = {"trainer.pt", "state.json", "manifest.json"}
_STEP_DIR = re.compile(r"(?:step-|global_step_)(\d+)")  # embedded step-000002, verl global_step_2


def find_checkpoint(path: Path, step: Optional[int] = None) -> Path:
    """The checkpoint to export: `path` itself when it is one; in a run directory, step N or the newest."""
    path = Path(path)
    if is_verl_checkpoint(path) or (path / "model.safetensors").exists() and (path / "state.json").exists():
        return path
    ck = path / "checkpoints"
    if not ck.is_dir():
        raise StareError(f"{path}: neither a checkpoint nor a run directory with checkpoints/",
                         hint="point at runs/<run> or runs/<run>/checkpoints/step-N (verl: global_step_N)")
    found = {int(m.group(1)): p for p in ck.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))}
    if not found:
        raise StareError(f"{ck}: no checkpoints", hint="train first, or point at another run")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise StareError(f"{ck}: no checkpoint of step {step}", hint=f"steps saved: {', '.join(map(str, sorted(found)))}")
    return found[step]


def export(path: Path, out: Path, step: Optional[int] = None) -> Path:
    """Write the Hugging Face folder of a checkpoint to `out` (module docstring); returns `out`."""
    ckpt = find_checkpoint(path, step)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise StareError(f"{out}: exists and is not empty", hint="choose a new --out folder")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if is_verl_checkpoint(ckpt):
            hf = ckpt / "actor" / "huggingface"
            if (hf / "model.safetensors").exists() or any(hf.glob("model-*.safetensors")):
                for f in hf.iterdir():
                    if f.is_file():
                        shutil.copy2(f, tmp / f.name)
                how = "verl's Hugging Face copy written at save time (fp32 master weights)"
            else:
                p = subprocess.run([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                                    "--local_dir", str(ckpt / "actor"), "--target_dir", str(tmp)],
                                   capture_output=True, text=True)
                if p.returncode:
                    raise StareError(f"verl's model merger failed on {ckpt / 'actor'}",
                                     hint=(p.stderr or p.stdout).strip().splitlines()[-1][:200] if (p.stderr or p.stdout) else "")
                how = "verl's model merger (python -m verl.model_merger merge --backend fsdp)"
            step_n = int(ckpt.name.rsplit("_", 1)[-1])
        else:
            for f in ckpt.iterdir():
                if f.is_file() and f.name not in TRAINER_FILES:
                    shutil.copy2(f, tmp / f.name)
            how = "the embedded checkpoint's Hugging Face files"
            step_n = json.loads((ckpt / "state.json").read_text()).get("step")
        run_dir = ckpt.parent.parent
        method = None
        if (run_dir / "config.yaml").exists():
            import yaml

            method = ((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("method") or {}).get("name")
        weights = sorted(tmp.glob("*.safetensors"))
        if not weights:
            raise StareError(f"{ckpt}: no weights to export", hint="the checkpoint may be incomplete")
        atomic_write_text(tmp / "export.json", json.dumps({
            "source": str(ckpt.resolve()), "run": str(run_dir.resolve()), "method": method, "step": step_n, "how": how,
            "weights_sha256": {w.name: file_sha256(w) for w in weights}}, indent=1))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cached_export(ckpt: Path, cache_root: Path) -> Path:
    """A verl checkpoint exported once into the cache (keyed by its path and modification time; built
    once whoever asks at the same time, benchmarks.data.cache.build_once), for
    `stare eval --model RUN/checkpoints/global_step_N`."""
    import hashlib

    from benchmarks.data.cache import build_once

    ckpt = Path(ckpt).resolve()
    key = hashlib.sha256(f"{ckpt}:{(ckpt / 'actor').stat().st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(cache_root) / "exports" / f"{ckpt.parent.parent.name}-{ckpt.name}-{key}"
    build_once(out, lambda tmp: export(ckpt, tmp))
    return out
