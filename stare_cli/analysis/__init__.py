"""Analysis over runs: sweeps (sweep.py), `stare compare` (compare.py), plots, the demo, and the explore
toy's strategy tables (strategies.py)."""
