"""Experiments built on the trainer (floor 5, beside cli.py: they compose trainer runs): the
small-scale reproduction of the paper's FP8 failure and its fix (docs/reproduction.md) —
survey the tasks, run the arms, report them."""
