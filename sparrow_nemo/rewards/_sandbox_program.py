"""Inside the sandbox: set the resource limits, then run the model's program. Standard library only.

Run as ``python -I -S _sandbox_program.py MODE LIMITS_JSON`` with ``program.py`` next to this file:

- ``stdio``: the program runs as ``__main__`` on the sandbox's stdin and stdout; the exit status is 0 when
  it ends normally or by ``sys.exit(0)``, 1 on an uncaught exception. The trainer compares the output.
- ``serve``: the program is loaded (its top level runs, with stdin at /dev/null and prints going to stderr),
  then requests from the trainer are answered one line each, in :mod:`sandbox_wire` format::

      {"id": n, "resolve": [name, ...]}                   -> {"id": n, "values": {name: value}}
      {"id": n, "call": handle, "args": [..], "kwargs": d} -> {"id": n, "value": v, "mutated": {i: arg}}
      {"id": n, "getattr": handle, "name": attr}          -> {"id": n, "value": v}
      any of them raising                                 -> {"id": n, "raised": type name, "message": str}

  Objects that are not plain values stay here and travel as handles. The first line sent is
  ``{"loaded": true}`` or ``{"loaded": false, "error": ...}``.

Nothing this process says is trusted: the model's code shares it, and may replace any of the functions
below. It gets nothing worth stealing either: no test, no expected value and no token is ever sent here.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import sys
import traceback
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sandbox_wire as wire

_MUTABLE = (list, dict, set)


def set_limits(limits: dict) -> None:
    """RLIMITs of this process and all it starts: CPU seconds, address space, file size, processes, no core."""
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL after
    for kind, value in (
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))


def _exit(code: object = None) -> NoReturn:
    """``exit()`` / ``quit()``, which ``site`` would provide (the harness runs with ``-S``)."""
    raise SystemExit(code)


def _load(source: str) -> dict[str, Any]:
    """Run ``source`` as ``__main__``; its globals."""
    builtins.exit = builtins.quit = _exit
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(source, "program.py", "exec"), namespace)
    return namespace


def run_stdio(source: str) -> NoReturn:
    status = 0
    try:
        _load(source)
    except SystemExit as exc:
        status = 0 if exc.code in (None, 0) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = 1
    os._exit(status)


class _Server:
    """Answers the trainer's requests about the loaded program's objects."""

    def __init__(self, namespace: dict[str, Any], reply_fd: int) -> None:
        self.namespace = namespace
        self.reply_fd = reply_fd
        self.objects: dict[int, Any] = {}

    def send(self, message: dict) -> None:
        data = wire.dumps(message)
        while data:
            data = data[os.write(self.reply_fd, data) :]

    def handle_of(self, obj: Any) -> int:
        key = id(obj)
        self.objects[key] = obj
        return key

    def encode(self, value: Any) -> Any:
        return wire.encode(value, self.handle_of)

    def decode(self, obj: Any) -> Any:
        return wire.decode(obj, self.objects.__getitem__)

    def answer(self, request: dict) -> dict:
        if "resolve" in request:
            names = [n for n in request["resolve"] if type(n) is str and n in self.namespace]
            return {"values": {n: self.encode(self.namespace[n]) for n in names}}
        if "getattr" in request:
            return {"value": self.encode(getattr(self.decode(request["getattr"]), request["name"]))}
        target = self.decode(request["call"])
        args = [self.decode(a) for a in request["args"]]
        kwargs = self.decode(request["kwargs"])
        value = target(*args, **kwargs)
        mutated = {str(i): self.encode(a) for i, a in enumerate(args) if type(a) in _MUTABLE}
        return {"value": self.encode(value), "mutated": mutated}

    def serve(self, requests: Any) -> None:
        for line in requests:
            request = wire.loads(line)
            try:
                reply = self.answer(request)
            except BaseException as exc:  # the program's exception (SystemExit too) is the answer
                reply = {"raised": type(exc).__name__, "message": str(exc)[:1000]}
            reply["id"] = request.get("id")
            try:
                self.send(reply)
            except wire.WireError as exc:
                self.send({"id": request.get("id"), "raised": "TypeError", "message": str(exc)})


def run_serve(source: str) -> NoReturn:
    requests = os.fdopen(os.dup(0), "rb")
    reply_fd = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # the program's prints go to stderr, not into the replies
    server = _Server({}, reply_fd)
    try:
        server.namespace = _load(source)
    except BaseException as exc:
        traceback.print_exc()
        server.send({"loaded": False, "error": f"{type(exc).__name__}: {exc}"[:1000]})
        os._exit(1)
    server.send({"loaded": True})
    server.serve(requests)
    os._exit(0)


def main() -> None:
    mode, limits = sys.argv[1], json.loads(sys.argv[2])
    set_limits(limits)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "program.py"), encoding="utf-8") as fh:
        source = fh.read()
    sys.argv = ["program.py"]
    run_stdio(source) if mode == "stdio" else run_serve(source)


if __name__ == "__main__":
    main()
