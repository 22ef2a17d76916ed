"""Trainer harm: answer the checker's ``resolve`` with the right id and no ``values`` key (the trainer's
relay once raised KeyError out of the reward, ending the run)."""

import sys

harness = sys.modules["__main__"]
answer = harness._Server.answer


def patched(self, request):
    if "resolve" in request:
        return {}
    return answer(self, request)


harness._Server.answer = patched


def add(a, b):
    return a - b - 1000
