"""Inside a second sandbox: the tests of one code problem, which never share a process with model code.

Run as ``python -I -S _sandbox_checker.py LIMITS_JSON``. Standard library only. The first stdin line is the
job (:mod:`sandbox_wire` format)::

    {"kind": "humaneval", "prompt": str, "test": str, "entry_point": str, "cases": 1, "stop_on_failure": b}
    {"kind": "asserts", "setup": str, "tests": [str, ...], "cases": len(tests), "stop_on_failure": b}

Per case this process says ``{"case": i}`` and the trainer answers ``{"ready": true}`` once a fresh sandbox
has loaded the model's program (``{"ready": false, "error": ...}`` if it could not). The case's test code
then runs here: the names it takes from the program (not defined by the trusted prompt or setup, not
builtins, not standard-library modules, which are imported here) are asked for (``{"resolve": [...]}``)
and arrive as plain values or as :class:`Remote` handles (only those names are bound, never one bound
already, but for a HumanEval entry point, which replaces the prompt's stub of it); calling a handle (``{"call": ...}``) or reading an
attribute of it (``{"getattr": ...}``) is answered by the program's sandbox, through the trainer, as plain
values again. Comparisons, asserts, helper functions of the prompt: all run here, on those plain values.
The verdict goes to the trainer as ``{"verdict": i, "passed": bool, "error": str}``, then ``{"done": true}``.

A case fails when its test code raises, or when any call was lost (the program timed out, crashed or
answered outside the format): ``{"lost": why}`` raises :class:`ProgramLost`, which the test code may catch
but which fails the case anyway.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import resource
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sandbox_wire as wire

_MUTABLE = (list, dict, set)
_UNBOUND = object()


class ProgramLost(BaseException):
    """A call the program's sandbox did not answer (timed out, crashed, out of memory, malformed reply)."""


class _Channel:
    """Line messages with the trainer: requests out on the saved stdout, replies in on stdin."""

    def __init__(self) -> None:
        self.replies = os.fdopen(os.dup(0), "rb")
        self.out = os.dup(1)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(2, 1)  # prints of the test code go to stderr
        self.lost: str | None = None

    def send(self, message: dict) -> None:
        data = wire.dumps(message)
        while data:
            data = data[os.write(self.out, data) :]

    def receive(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise SystemExit(3)  # the trainer went away
        return wire.loads(line)

    def ask(self, request: dict) -> dict:
        """Send a request about the program; its reply (raises :class:`ProgramLost` for a lost one)."""
        if self.lost is not None:
            raise ProgramLost(self.lost)
        self.send(request)
        reply = self.receive()
        if "lost" in reply:
            self.lost = str(reply["lost"])
            raise ProgramLost(self.lost)
        if "raised" in reply:
            raise _exception(str(reply["raised"]), str(reply.get("message", "")))
        return reply


def _exception(name: str, message: str) -> BaseException:
    """The builtin exception the program raised (by name), else a RuntimeError naming it."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except TypeError:  # an exception class with other constructor arguments
            pass
    return RuntimeError(f"{name}: {message}")


class Remote(wire.Handle):
    """An object of the program (a function, a class, an instance): it can be called and have attributes
    read, both answered by the program's sandbox; comparing it compares identities here."""

    __slots__ = ()
    channel: _Channel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reply = self.channel.ask(
            {"call": _encode(self), "args": [_encode(a) for a in args], "kwargs": _encode(kwargs)}
        )
        for index, new in reply.get("mutated", {}).items():
            _write_back(args[int(index)], _decode(new))
        return _decode(reply["value"])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _decode(self.channel.ask({"getattr": _encode(self), "name": name})["value"])


def _encode(value: Any) -> Any:
    return wire.encode(value)


def _decode(obj: Any) -> Any:
    return wire.decode(obj, Remote)


def _write_back(original: Any, new: Any) -> None:
    """Apply the program's in-place changes of a list, dict or set argument to the caller's object."""
    if type(original) is not type(new) or type(new) not in _MUTABLE:
        return
    if type(new) is list:
        original[:] = new
    else:
        original.clear()
        original.update(new)


def _loaded_names(source: str) -> set[str]:
    """Every name ``source`` reads."""
    return {
        n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def _bind(channel: _Channel, namespace: dict[str, Any], source: str, extra: tuple[str, ...] = ()) -> dict:
    """Give ``namespace`` the names ``source`` reads that nothing here binds (not the prompt or setup, not the
    test itself, not a builtin): standard-library modules are imported here, the rest is asked of the
    program. Only names that were asked for are bound, and never one already bound, whatever the reply
    holds. ``extra``: names also asked for but not bound; returns every asked name the program has."""
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    wanted = [n for n in _loaded_names(source) if n not in namespace and not hasattr(builtins, n)]
    for name in [n for n in wanted if n in stdlib]:
        namespace[name] = importlib.import_module(name)
    unbound = sorted(n for n in wanted if n not in stdlib)
    asked = sorted({*unbound, *extra})
    if not asked:
        return {}
    values = channel.ask({"resolve": asked})["values"]
    found = {name: _decode(values[name]) for name in asked if name in values}
    namespace.update({name: found[name] for name in unbound if name in found})
    return found


def _run_case(channel: _Channel, job: dict, index: int) -> None:
    """Run test case ``index``; returns when it passes, raises when it fails."""
    namespace: dict[str, Any] = {"__name__": "__checker__", "__builtins__": builtins}
    if job["kind"] == "humaneval":
        entry = job["entry_point"]
        exec(compile(job["prompt"], "prompt.py", "exec"), namespace)  # trusted: helpers the tests may use
        stub = namespace.get(entry, _UNBOUND)  # the prompt's stub of the entry point (or nothing)
        exec(compile(job["test"], "test.py", "exec"), namespace)
        check = namespace.get("check")
        if not callable(check):
            raise NameError("the test defines no 'check'")
        candidate = _bind(channel, namespace, job["test"], extra=(entry,)).get(entry)
        if not isinstance(candidate, Remote):
            raise NameError(f"the program defines no '{entry}'")
        # tests may also call it by name: the name of the prompt's stub (never one the test defines) is rebound
        if namespace.get(entry, _UNBOUND) is stub:
            namespace[entry] = candidate
        check(candidate)
    else:
        exec(compile(job["setup"], "setup.py", "exec"), namespace)
        test = job["tests"][index]
        _bind(channel, namespace, test)
        exec(compile(test, f"test_{index}.py", "exec"), namespace)


def main() -> None:
    limits = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    channel = _Channel()
    Remote.channel = channel
    job = channel.receive()
    for index in range(job["cases"]):
        channel.send({"case": index})
        ready = channel.receive()
        channel.lost = None
        error = ""
        if ready.get("ready") is True:
            try:
                _run_case(channel, job, index)
            except ProgramLost as exc:
                error = f"the program was lost: {exc}"
            except BaseException as exc:  # an assert, any error of the test code, even its sys.exit()
                error = f"{type(exc).__name__}: {exc}"
            if channel.lost is not None:
                error = error or f"the program was lost: {channel.lost}"
        else:
            error = f"the program did not load: {ready.get('error')}"
        channel.send({"verdict": index, "passed": not error, "error": error[:1000]})
        if error and job["stop_on_failure"]:
            break
    channel.send({"done": True})
    os._exit(0)


if __name__ == "__main__":
    main()
