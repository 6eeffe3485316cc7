"""Data and models: benchmark definitions and files (registry.py), training prompts (prompts.py),
model resolution and real models (models.py), the CPU toy (toy.py: its task, tokenizer, model and
warm-up) and short word problems for small real models (words.py).

The toy and the word problems register their generated benchmarks and training sets with the
registry when this package is imported, so every reader of the registry sees them.
"""

from benchmarks.data import toy, words  # noqa: F401  (register their benchmarks and training sets)
