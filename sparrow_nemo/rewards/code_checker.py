"""Run a problem's tests against a model's program: two sandboxes, and the trainer between them.

The tests run in a checker sandbox (:mod:`sparrow_nemo.rewards._sandbox_checker`) that never holds model
code; the program runs in a fresh sandbox per test case (:mod:`sparrow_nemo.rewards._sandbox_program`) that
never holds a test, an expected value or a token. Every request of the tests about the program (a name, a
call, an attribute) goes through :func:`run_tests`, and every answer of the program is decoded here from
the restricted format (:mod:`sparrow_nemo.rewards.sandbox_wire`) and re-encoded before the checker sees it:
what reaches the comparisons is plain data, so no object, frame, trace hook or stolen secret inside the
program's sandbox can make a wrong answer pass.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from sparrow_nemo.rewards import sandbox_wire as wire
from sparrow_nemo.rewards.code_sandbox import SandboxLimits, SandboxProcess, limits_json

logger = logging.getLogger(__name__)

#: what a request of the checker may hold
_REQUEST_KEYS = ("resolve", "call", "args", "kwargs", "getattr", "name")
#: cap on one message of the (trusted) checker: test inputs can be long
_CHECKER_LINE_CAP = 64 << 20


def run_tests(program: str, job: dict, limits: SandboxLimits, unsafe: bool = False) -> list[str | None]:
    """Per test case of ``job`` (see the checker's docstring): None when it passed, else why it failed.

    ``limits.wall_s`` bounds each case: loading the program in its sandbox plus running the case.
    Cases after a failure with ``job["stop_on_failure"]``, or after the checker itself failed, are failed
    as "not run".
    """
    verdicts: list[str | None] = ["not run"] * job["cases"]
    source = program.encode("utf-8", errors="surrogatepass")
    box: SandboxProcess | None = None
    case = -1
    with SandboxProcess("_sandbox_checker.py", [limits_json(limits)], limits, {}, unsafe=unsafe) as checker:
        checker.send(job)
        deadline = time.monotonic() + limits.wall_s
        try:
            while (message := checker.receive(deadline, _CHECKER_LINE_CAP)) is not None:
                if "case" in message:
                    case, deadline = int(message["case"]), time.monotonic() + limits.wall_s
                    box = _start_program(source, limits, unsafe)
                    checker.send(_ready(box, deadline, limits))
                elif "verdict" in message:
                    if message["verdict"] == case and 0 <= case < len(verdicts):
                        verdicts[case] = None if message["passed"] is True else str(message["error"])
                    if box is not None:
                        box.close()
                    deadline = time.monotonic() + limits.wall_s
                elif "done" in message:
                    break
                else:
                    checker.send(_forward(box, message, deadline, limits))
            else:
                if 0 <= case < len(verdicts) and verdicts[case] == "not run":
                    verdicts[case] = f"the test checker stopped: {checker.failure}"
        finally:
            if box is not None:
                box.close()
    return verdicts


def _start_program(source: bytes, limits: SandboxLimits, unsafe: bool) -> SandboxProcess:
    return SandboxProcess(
        "_sandbox_program.py", ["serve", limits_json(limits)], limits, {"program.py": source}, unsafe=unsafe
    )


def _ready(box: SandboxProcess, deadline: float, limits: SandboxLimits) -> dict:
    """The checker's go-ahead once the program has loaded (or why it did not)."""
    loaded = box.receive(deadline, limits.output_bytes)
    if loaded is not None and loaded.get("loaded") is True:
        return {"ready": True}
    why = box.failure or str(loaded.get("error", "no load message") if loaded else "")
    box.stop(why)
    return {"ready": False, "error": f"{why}; stderr: {box.stderr[-500:]}"}


_request_ids = itertools.count(1)  # next() is atomic under the GIL: safe across reward threads


def _forward(box: SandboxProcess | None, request: dict, deadline: float, limits: SandboxLimits) -> dict:
    """Ask the program ``request`` and return its answer checked and re-encoded, or ``{"lost": why}``.

    A reply that is not exactly an answer to ``request`` (another id, a missing or ill-typed key, a name that
    was not asked for, a value outside the format) stops the program's sandbox: the case fails, and the
    reason is logged. Decoding is linear in the reply's size and counts against the case's wall clock.
    """
    if box is None or box.failure is not None:
        return {"lost": box.failure if box is not None else "no program"}
    rid = next(_request_ids)
    box.send({**{k: v for k, v in request.items() if k in _REQUEST_KEYS}, "id": rid})
    reply = box.receive(deadline, limits.output_bytes)
    if reply is None:
        return {"lost": box.failure}
    try:
        answer = _clean(reply, rid, request)
    except Exception as exc:  # hostile bytes: whatever reading them raises is the program's failure
        box.stop(f"bad reply: {type(exc).__name__}: {str(exc)[:200]}")
        logger.warning("code reward: the program's sandbox sent a %s; the case fails", box.failure)
        return {"lost": box.failure}
    if time.monotonic() > deadline:
        box.stop("timed out")
        return {"lost": box.failure}
    return answer


def _clean(reply: dict, rid: int, request: dict) -> dict:
    """Rebuild a program's reply to ``request`` (request id ``rid``) from its checked parts only (values
    decoded and re-encoded).

    Raises:
        WireError: anything but the answer the harness gives (see :mod:`_sandbox_program`).
    """
    if reply.get("id") != rid:
        raise wire.WireError("a reply to another request")
    if "raised" in reply:
        return {"raised": _text(reply["raised"]), "message": _text(reply.get("message", ""))}
    if "resolve" in request:
        values = _field(reply, "values", dict)
        stray = [name for name in values if name not in request["resolve"]]
        if stray:
            raise wire.WireError(f"names that were not asked for: {[_text(n)[:40] for n in stray[:5]]}")
        return {"values": {name: _reencode(v) for name, v in values.items()}}
    mutated = _field(reply, "mutated", dict, {})
    args = len(request.get("args", []))
    for index in mutated:
        if type(index) is not str or not index.isdecimal() or int(index) >= args:
            raise wire.WireError(f"'mutated' names no argument: {_text(index)[:40]!r}")
    return {
        "value": _reencode(_field(reply, "value", object)),
        "mutated": {index: _reencode(v) for index, v in mutated.items()},
    }


_MISSING = object()


def _field(reply: dict, key: str, kind: type, default: Any = _MISSING) -> Any:
    """``reply[key]``, checked to be a ``kind`` (``object``: anything)."""
    value = reply.get(key, default)
    if value is _MISSING:
        raise wire.WireError(f"no '{key}' in the reply")
    if kind is not object and type(value) is not kind:
        raise wire.WireError(f"'{key}' must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _reencode(obj: Any) -> Any:
    return wire.encode(wire.decode(obj))


def _text(value: Any) -> str:
    if type(value) is not str:
        raise wire.WireError("expected a string")
    return value[:1000]
