"""stare: reproduction suite and benchmark harness for STARE (arXiv 2606.19236)."""

from importlib import metadata

try:
    __version__ = metadata.version("stare-rl")  # core/errors.py: DISTRIBUTION
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+src"
