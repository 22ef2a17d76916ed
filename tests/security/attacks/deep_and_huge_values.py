"""Trainer harm: return values the trainer could choke on (100,000-deep nesting, a 100,000-digit int)."""

import sys

sys.setrecursionlimit(10**6)


def add(a, b):
    if a == 2:
        value = []
        for _ in range(100_000):
            value = [value]
        return value
    return 10**100_000
