"""Core: errors, the typed recipe schema (config.py), recipe files (recipes.py) and their resolution with a
method (resolve.py), run directories (runs.py), signals and resume plans. Imports only `baselines`."""
