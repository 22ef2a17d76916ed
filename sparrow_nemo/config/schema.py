"""How a component declares its config: a frozen dataclass of :func:`knob` fields over :class:`Section`.

Every component owns its config class, next to the code that reads it (``PolicyLossConfig`` in
``grpo/losses.py``, ``SamplingParams`` in ``rollout/engine.py``, ...); the recipe composes them. A knob is
declared once, with its default, its doc string (what ``sparrow config show --doc`` prints), an optional
value check and whether it enters the config hash::

    @dataclass(frozen=True)
    class SamplingParams(Section):
        top_p: float = knob(1.0, "nucleus sampling mass", check=interval(0, 1, lo_open=True))

A :class:`Section` validates itself whenever it is constructed (from a recipe or directly): each
field's check, then the class's own cross-field :meth:`Section.check`. A failure raises
:class:`Invalid` (a ``ValueError``) naming the key and what was expected; the recipe loader turns it
into a one-line :class:`ConfigError` that also names the file or the command line.

This module knows no component: names a registry accepts are checked with :func:`one_of_names`, given
the registry's ``names()`` function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

__all__ = [
    "AT_LEAST_ONE",
    "NON_NEGATIVE",
    "OPEN_UNIT",
    "POSITIVE",
    "UNIT",
    "Check",
    "ConfigError",
    "Invalid",
    "Section",
    "choices",
    "describe",
    "interval",
    "knob",
    "matching",
    "one_of",
    "one_of_names",
    "suggest",
]


class ConfigError(ValueError):
    """A recipe, override or value is invalid. ``str(err)`` is one line starting with 'config error:'."""

    def __init__(self, message: str) -> None:
        super().__init__("config error: " + " ".join(message.split()))


class Invalid(ValueError):
    """A config value breaks a rule: ``key`` (dotted, relative to the section), ``value``, ``expected``."""

    def __init__(self, owner: str, key: str, value: Any, expected: str) -> None:
        super().__init__(f"{owner}.{key}={value!r} - expected {expected}")
        self.key = key
        self.value = value
        self.expected = expected


#: ``check(value, type_words)`` -> None when ``value`` passes, else the words after "expected"
#: (e.g. "a number in (0, 1)"); ``type_words`` describes the field's type ("a number").
Check = Callable[[Any, str], "str | None"]


def interval(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Check:
    """Numbers (or each number of a tuple) in an interval; ``None`` = unbounded on that side."""
    if lo is not None and hi is not None:
        allowed = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        allowed = f"{'>' if lo_open else '>='} {lo:g}"
    else:
        allowed = f"{'<' if hi_open else '<='} {hi:g}"

    def ok(x: float) -> bool:
        above = lo is None or (x > lo if lo_open else x >= lo)
        below = hi is None or (x < hi if hi_open else x <= hi)
        return above and below

    def check(value: Any, type_words: str) -> str | None:
        values = value if isinstance(value, tuple) else (value,)
        if all(ok(x) for x in values):
            return None
        return f"{type_words} {allowed}" if not isinstance(value, tuple) else f"{type_words}, each {allowed}"

    return check


def one_of_names(
    names: Callable[[], Iterable[str]], what: str = "a registered name", renamed: dict[str, str] | None = None
) -> Check:
    """Strings among ``names()`` (a registry's names, read when the value is checked); an old name in
    ``renamed`` (old -> new) gets an error naming its new name."""
    renamed = renamed or {}

    def check(value: Any, type_words: str) -> str | None:
        known = sorted(names())
        if value in known:
            return None
        hint = f" ('{value}' was renamed '{renamed[value]}')" if value in renamed else suggest(value, known)
        return f"{what} ({', '.join(known)}){hint}"

    return check


def one_of(options: tuple[str, ...], renamed: dict[str, str] | None = None) -> Check:
    """One of ``options``; an old name in ``renamed`` (old -> new) gets an error naming its new name."""
    renamed = renamed or {}

    def check(value: Any, type_words: str) -> str | None:
        if value in options:
            return None
        hint = f" ('{value}' was renamed '{renamed[value]}')" if value in renamed else suggest(value, options)
        return f"one of {choices(options)}{hint}"

    return check


def matching(pattern: str, allowed: str) -> Check:
    """Strings that match the regular expression ``pattern``; ``allowed`` words the rule."""
    regex = re.compile(pattern)

    def check(value: Any, type_words: str) -> str | None:
        return None if regex.match(value) else f"{type_words} {allowed}"

    return check


POSITIVE = interval(lo=0, lo_open=True)
NON_NEGATIVE = interval(lo=0)
AT_LEAST_ONE = interval(lo=1)
OPEN_UNIT = interval(0, 1, lo_open=True, hi_open=True)
UNIT = interval(0, 1)


def knob(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    check: Check | None = None,
    hashed: bool = True,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with its doc string, an optional value check and its hash membership.

    Args:
        default: the one default of this knob (or ``factory`` for a nested section / a mutable value).
        doc: one line for users: what the knob does, its unit, what 0 / null mean.
        check: see :data:`Check`; not applied to ``None``.
        hashed: False leaves the field out of the config hash (fields that do not change what a run
            computes: step limits, logging, checkpoint cadence).
    """
    if not doc:
        raise TypeError("knob(): every config field needs its doc string")
    metadata = {"doc": doc, "check": check, "hashed": hashed}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a config dataclass (cached)."""
    return get_type_hints(cls)


class Section:
    """Base of the config dataclasses: validates each field's check and then :meth:`check` on construction.

    Subclasses are ``@dataclass(frozen=True)``; a subclass that needs its own ``__post_init__`` calls
    ``super().__post_init__()`` last.
    """

    #: keys this section no longer has -> what became of them; a recipe that still sets one gets that line
    renamed_keys: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = field_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            rule: Check | None = f.metadata.get("check")
            if rule is None or value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue  # the loader refuses non-finite numbers; direct construction reports below
            expected = rule(value, describe(non_null(hints[f.name])))
            if expected is not None:
                raise Invalid(type(self).__name__, f.name, value, expected)
        non_finite = [
            f.name
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if _has_non_finite(getattr(self, f.name))
        ]
        if non_finite:
            raise Invalid(type(self).__name__, non_finite[0], getattr(self, non_finite[0]), "a finite number")
        self.check()

    def check(self) -> None:
        """Cross-field rules; raise ``self.invalid(key, expected)``. Default: none."""

    def invalid(self, key: str, expected: str) -> Invalid:
        """An :class:`Invalid` for the (dotted) ``key`` of this section, with its current value."""
        value: Any = self
        for part in key.split("."):
            if isinstance(value, tuple):
                value = value[int(part)]
            elif isinstance(value, dict):
                value = value.get(part)
            else:
                value = getattr(value, part)
        return Invalid(type(self).__name__, key, value, expected)


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, tuple):
        return any(isinstance(v, float) and not math.isfinite(v) for v in value)
    return False


# ----- words ---------------------------------------------------------------------------------
def choices(options: Iterable[Any]) -> str:
    """``'a', 'b', 'c'``."""
    return ", ".join(f"'{o}'" for o in options)


def suggest(word: Any, options: Iterable[Any]) -> str:
    """`` - did you mean 'x'?`` for the closest option, or ''."""
    import difflib

    match = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.7)
    return f" - did you mean '{match[0]}'?" if match else ""


def non_null(tp: Any) -> Any:
    """``X`` for ``X | None``; other types unchanged."""
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def describe(tp: Any) -> str:
    """Words for a type: 'an integer', 'a list of integers or null', ..."""
    origin = get_origin(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return f"one of {choices(get_args(tp))}"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) if a is not type(None) else "null" for a in get_args(tp))
    if origin is tuple:
        item = get_args(tp)[0]
        plural = {int: "integers", float: "numbers", str: "strings"}.get(item)
        return f"a list of {plural}" if plural else f"a list (each {describe(item)})"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)
