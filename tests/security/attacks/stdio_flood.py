"""Exhaust (stdin/stdout problem): the right answer buried in endless output."""

import sys

print(sum(map(int, sys.stdin.read().split())))
while True:
    sys.stdout.write("5 " * 10_000)
