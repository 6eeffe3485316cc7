"""Data and models: benchmark definitions and files (registry.py), training prompts (prompts.py),
model resolution (models.py) and the CPU toy (toy.py: its task, tokenizer, model and warm-up).

The toy registers its held-out sets with the registry when this package is imported, so every
reader of the registry sees them.
"""

from benchmarks.data import toy  # noqa: F401  (registers the toy benchmarks)
