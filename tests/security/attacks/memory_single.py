"""Exhaust: one process allocating far more than the memory cap."""


def add(a, b):
    block = bytearray(4 << 30)
    return a + b + len(block) * 0
