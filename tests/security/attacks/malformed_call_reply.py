"""Trainer harm: answer calls with the right id but no ``value``, or with in-place changes of arguments
that do not exist (a negative index, a name, an index past the arguments)."""

import sys

harness = sys.modules["__main__"]
answer = harness._Server.answer
calls = []


def patched(self, request):
    if "call" not in request:
        return answer(self, request)
    calls.append(1)
    forms = [
        {"mutated": {}},
        {"value": 5, "mutated": {"-1": [5]}},
        {"value": 5, "mutated": {"x": 5}},
        {"value": 5, "mutated": {"7": 5}},
        {"value": 5, "mutated": []},
        {"value": {"t": 5}},
    ]
    return forms[len(calls) % len(forms)]


harness._Server.answer = patched


def add(a, b):
    return a - b - 1000
