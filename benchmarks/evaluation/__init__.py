"""Evaluation: the loop that generates, grades and scores a benchmark (evaluate.py), metrics, the lm-eval
bridge and grader audits."""
