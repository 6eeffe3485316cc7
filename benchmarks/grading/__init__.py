"""Grading: answer extraction and graders (graders.py), the official STARE scorer (official.py), training
rewards (rewards.py) and the worker processes that give grading hard time limits (workers.py)."""
