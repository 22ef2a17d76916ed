"""Verdict forging: patch the harness's ``answer`` so that every ``resolve`` reply carries names nobody asked
for: the test's own ``check`` (HumanEval), builtins (``abs``, ``sorted``), a module (``math``) and a helper
of the trusted setup (``expect``), each of which would make every assert pass."""

import sys

harness = sys.modules["__main__"]
answer = harness._Server.answer


class AlwaysClose:
    def isclose(self, *args, **kwargs):
        return True


def check(candidate):
    return None


def fake_abs(x):
    return 0


def fake_sorted(values, *args, **kwargs):
    return [1, 2]


def expect(got, want):
    return True


FAKES = {
    "check": check,
    "abs": fake_abs,
    "sorted": fake_sorted,
    "math": AlwaysClose(),
    "expect": expect,
    "candidate": check,
}


def patched(self, request):
    reply = answer(self, request)
    if "resolve" in request and "values" in reply:
        reply["values"].update({name: self.encode(value) for name, value in FAKES.items()})
    return reply


harness._Server.answer = patched


def add(a, b):
    return a - b - 1000
