"""The restricted format values cross the sandbox boundary in: tagged JSON, one message per line.

Standard library only: the same file is imported by the trainer and, bound read-only, by the harnesses
inside the sandbox (:mod:`sparrow_nemo.rewards._sandbox_program`, :mod:`~sparrow_nemo.rewards._sandbox_checker`).

A value is encoded as:

- ``None``, ``bool``, ``int``, finite ``float``, ``str``: the JSON scalar;
- ``list``: a JSON array;
- anything else: a one-key JSON object, ``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"fs": [...]}``
  frozenset, ``{"d": [[key, value], ...]}`` dict, ``{"b": "<hex>"}`` bytes, ``{"c": [re, im]}`` complex,
  ``{"f": "nan" | "inf" | "-inf"}`` a non-finite float, ``{"h": id}`` a handle: an object that stays in
  the process that made it (only a call or an attribute read can be asked of it, never a comparison).

:func:`decode` builds only those plain types (and :class:`Handle` for ``{"h": id}``), so nothing a
sandboxed program sends can carry its own ``__eq__``, ``__hash__`` or any other code. Its time is linear in
the message's size: a set or dict with more than :data:`MAX_SAME_HASH` elements sharing one hash value (ints
``k * (2**61 - 1) + c`` all hash alike, and a set of n of them costs n^2 / 2 comparisons) is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

#: nesting deeper than this is refused (by both sides) instead of recursing
MAX_DEPTH = 100
#: elements of one set (keys of one dict) that may share a hash value; honest values rarely have two
MAX_SAME_HASH = 8


class WireError(ValueError):
    """A value that cannot be encoded, or a message that is not in the format."""


class Handle:
    """An opaque reference to an object living in the other process (``id`` is its key there)."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id

    def __repr__(self) -> str:
        return f"<sandbox object #{self.id}>"


def encode(value: Any, to_handle: Callable[[Any], int] | None = None, depth: int = 0) -> Any:
    """JSON-able form of ``value``; objects of other types become handles via ``to_handle`` (else refused).

    Raises:
        WireError: a type with no encoding and no ``to_handle``, nesting deeper than :data:`MAX_DEPTH`,
            or an int too long to print.
    """
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if isinstance(value, Handle):
        return {"h": value.id}
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        try:
            str(value)  # refuses ints longer than sys.get_int_max_str_digits()
        except ValueError as exc:
            raise WireError(str(exc)) from None
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": repr(value)}
    d = depth + 1
    if kind is list:
        return [encode(v, to_handle, d) for v in value]
    if kind is tuple:
        return {"t": [encode(v, to_handle, d) for v in value]}
    if kind is set or kind is frozenset:
        return {"s" if kind is set else "fs": [encode(v, to_handle, d) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, to_handle, d), encode(v, to_handle, d)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [encode(value.real), encode(value.imag)]}
    if to_handle is not None:
        return {"h": to_handle(value)}
    raise WireError(f"a value of type {kind.__name__} cannot cross the sandbox boundary")


def decode(obj: Any, from_handle: Callable[[int], Any] = Handle, depth: int = 0) -> Any:
    """The plain value :func:`encode` made ``obj`` from; ``{"h": id}`` becomes ``from_handle(id)``.

    Raises:
        WireError: anything not in the format (unknown tag, wrong shape, unhashable key, too deep).
    """
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str):
        return obj
    d = depth + 1
    if kind is list:
        return [decode(v, from_handle, d) for v in obj]
    if kind is not dict or len(obj) != 1:
        raise WireError(f"not a wire value: a {kind.__name__}")
    ((tag, body),) = obj.items()
    try:
        if tag == "t":
            return tuple(decode(v, from_handle, d) for v in _list(body))
        if tag == "s":
            return set(_few_per_hash([decode(v, from_handle, d) for v in _list(body)]))
        if tag == "fs":
            return frozenset(_few_per_hash([decode(v, from_handle, d) for v in _list(body)]))
        if tag == "d":
            pairs = [
                (decode(k, from_handle, d), decode(v, from_handle, d)) for k, v in map(_pair, _list(body))
            ]
            _few_per_hash([k for k, _ in pairs])
            return dict(pairs)
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c":
            re, im = _pair(body)
            return complex(_float(re), _float(im))
        if tag == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "h" and type(body) is int:
            return from_handle(body)
    except (TypeError, ValueError) as exc:  # an unhashable set element or dict key, bad hex
        raise WireError(f"bad '{tag}' value: {exc}") from None
    raise WireError(f"not a wire value: tag {tag!r}")


def _few_per_hash(items: list) -> list:
    """``items`` once checked that at most :data:`MAX_SAME_HASH` of them share a hash value (linear: the
    hash values, ints below 2**61, are themselves keys of distinct hashes)."""
    count: dict[int, int] = {}
    for item in items:
        h = hash(item)  # TypeError for an unhashable element: the caller's WireError
        count[h] = count.get(h, 0) + 1
        if count[h] > MAX_SAME_HASH:
            raise WireError(f"more than {MAX_SAME_HASH} elements share one hash value (hash flooding)")
    return items


def _list(body: Any) -> list:
    if type(body) is not list:
        raise WireError("a tagged value must hold a list")
    return body


def _pair(body: Any) -> tuple[Any, Any]:
    if type(body) is not list or len(body) != 2:
        raise WireError("expected a [key, value] pair")
    return body[0], body[1]


def _float(x: Any) -> float:
    if type(x) in (int, float):
        return float(x)
    if type(x) is dict and x.get("f") in ("nan", "inf", "-inf"):
        return float(x["f"])
    raise WireError("a complex part must be a number")


def dumps(message: dict) -> bytes:
    """One message as a line of strict JSON (no NaN/Infinity: those are tagged)."""
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"


def loads(line: bytes) -> dict:
    """Parse one message line; refuses anything but a JSON object.

    Raises:
        WireError: not UTF-8, not JSON (also: nesting past the interpreter's recursion limit, which the
            JSON parser reports as RecursionError), or not an object.
    """
    try:
        message = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not a JSON message ({type(exc).__name__})") from None
    if type(message) is not dict:
        raise WireError("a message must be a JSON object")
    return message


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")
