"""Exhaust: flood stdout and stderr (the harness sends prints to stderr; the trainer keeps only a little)."""

import sys


def add(a, b):
    for _ in range(2000):
        sys.stdout.write("x" * 100_000)
        sys.stderr.write("y" * 100_000)
    return a - b - 1000
