"""Exhaust: spin forever (the wall clock and the CPU limit must end it)."""


def add(a, b):
    while True:
        pass
