"""Model resolution: what a `model.path` (or `--model`) names, as a folder or hub id transformers can
load. `toy:<task>` is the shipped toy model of that task."""

from __future__ import annotations


def resolve_model_path(path: str) -> str:
    """A loadable path for `path`: a toy name becomes its (hash-checked) folder; anything else as it is."""
    if path.startswith("toy:"):
        from benchmarks.data.toy import ensure_toy_model

        return str(ensure_toy_model(path.split(":", 1)[1]))
    return path
