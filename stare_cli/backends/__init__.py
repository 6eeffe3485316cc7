"""Training backends: embedded (default) and verl."""
