"""Verdict forging: sys.exit(0) from inside the function under test, and at import."""

import sys


def add(a, b):
    sys.exit(0)


sys.exit(0)
