"""What the lm-eval bridge runs instead of `python -m lm_eval`: lm-eval's own command line, with the
model's tokenizer loaded the way stare loads it (`benchmarks.generation.engines.load_tokenizer`).

lm-eval's hf model loads its tokenizer with `transformers.AutoTokenizer.from_pretrained`. For a tokenizer
saved as a plain `tokenizers` object (the CPU toys'), transformers 5 picks a tokenizer class from the
model type instead and drops the saved pre-tokenizer: "Compute 6+3-7." reached the toy as "6+3-7." and
the bridge scored 2.3 where the native path scored 60.5 (issue 43, case 10). Here that one call gives
such paths stare's loader; every other tokenizer is loaded by AutoTokenizer as lm-eval asked.

    python -m benchmarks.evaluation.lm_eval_main ARGS...   (the arguments of `python -m lm_eval`)
"""

from __future__ import annotations

import os


def use_stare_tokenizers() -> None:
    """Route AutoTokenizer.from_pretrained through stare's loader for plain `tokenizers` folders."""
    import transformers

    from benchmarks.generation.engines import is_plain_tokenizer, load_tokenizer

    original = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        if isinstance(name, (str, os.PathLike)) and os.path.isdir(name) and is_plain_tokenizer(str(name)):
            return load_tokenizer(str(name))
        return original(name, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = from_pretrained


def main() -> None:
    use_stare_tokenizers()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
