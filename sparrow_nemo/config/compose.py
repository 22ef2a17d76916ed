"""Recipe composition: ``defaults:`` inheritance, command-line overrides, typed build of the root config.

A recipe is a YAML file whose top-level keys are the sections of a root config class (the recipe
module passes its own, ``SparrowConfig``). It may start with ``defaults: [base, other]``: those recipes
(names relative to the recipe's folder, ``.yaml`` optional) are loaded first, in order, and the
recipe's own keys are deep-merged on top. Command-line overrides follow the NeMo/Hydra convention:

- ``a.b=value``   sets a key that exists (a section field, or a key already in a free-form mapping);
- ``+a.b=value``  adds a key that does not exist yet (free-form mappings: reward options, callbacks);
- ``++a.b=value`` adds or sets.

Values parse as YAML scalars or flow collections (``[1, 2]``, ``null``, ``true``, ``{k: v}``), under
the limits of :mod:`sparrow_nemo.config.yaml_io`. Every value is then checked against the dataclass
type hints (numbers must be finite), the fields' checks and each section's cross-field rules. Any
problem raises :class:`ConfigError`, one line naming the key path, the value, where it came from (file
or command line) and what is allowed::

    config error: unknown key 'sparsity.treshold' (from command line) - did you mean 'sparsity.threshold'?
    config error: sparsity.threshold=1.5 (from recipes/x.yaml) - expected a number in (0, 1)

Everything here runs before a run folder exists: a recipe that loads is one the run can start with.
(Decision: no OmegaConf. Its structured configs have no Literal, no per-field checks and multi-line
errors; this module is ~500 lines and keeps one-line errors with suggestions.)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import sparrow_nemo
from sparrow_nemo.config.schema import ConfigError, Invalid, describe, field_hints, non_null, suggest
from sparrow_nemo.config.yaml_io import YamlProblem, load_yaml, read_recipe_file

__all__ = [
    "DEFAULT_RECIPE",
    "MAX_DEFAULTS_DEPTH",
    "Override",
    "build",
    "dotted_leaves",
    "from_dict",
    "hashed_view",
    "load",
    "plain",
    "recipes_dir",
    "resolve_recipe",
    "stable_hash",
]

#: The recipe ``load(None)`` and ``sparrow train`` (no --config) use.
DEFAULT_RECIPE = "tiny_cpu"
#: Longest ``defaults:`` chain (recipe -> parent -> ...); shipped recipes use 3.
MAX_DEFAULTS_DEPTH = 32
#: Recipe files merged for one config, counting repeats (a fan-out of defaults multiplies them).
MAX_RECIPE_MERGES = 256
_COMMAND_LINE = "command line"
_BUILT_IN = "built-in defaults"

Root = TypeVar("Root")


# =========================================================================================
# Provenance: which file (or the command line) set each key
# =========================================================================================
class Sources:
    """Key path -> origin; a path without its own entry inherits its nearest ancestor's."""

    def __init__(self) -> None:
        self._by_path: dict[tuple[str, ...], str] = {(): _BUILT_IN}

    def mark(self, path: tuple[str, ...], origin: str) -> None:
        """``path`` and everything below it now come from ``origin``."""
        n = len(path)
        for key in [p for p in self._by_path if len(p) > n and p[:n] == path]:
            del self._by_path[key]
        self._by_path[path] = origin

    def of(self, path: Sequence[str]) -> str:
        """Who set ``path``: the latest mark at or below it, else its nearest marked ancestor."""
        path = tuple(path)
        n = len(path)
        below = [origin for p, origin in self._by_path.items() if len(p) >= n and p[:n] == path]
        if below:
            return below[-1]
        for m in range(n - 1, -1, -1):
            if path[:m] in self._by_path:
                return self._by_path[path[:m]]
        return _BUILT_IN


def _dotted(path: Sequence[str]) -> str:
    return ".".join(path)


def plain(value: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, recursively (YAML/JSON friendly)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def dotted_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> ``{"a.b.c": value}``; lists and scalars are leaves, an empty mapping has none."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(dotted_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def hashed_view(obj: Any) -> Any:
    """The dataclass tree as plain data, without the fields declared ``knob(..., hashed=False)``."""
    if dataclasses.is_dataclass(obj):
        return {
            f.name: hashed_view(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.metadata.get("hashed", True)
        }
    return plain(obj)


def stable_hash(obj: Any) -> str:
    """16 hex digits of SHA-256 over :func:`hashed_view` (sorted keys): the config hash."""
    text = json.dumps(hashed_view(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fmt(value: Any) -> str:
    """A value as it would be typed on the command line."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # inf, -inf, nan (JSON would say Infinity)
    return json.dumps(plain(value), default=str)


def _value_error(path: Sequence[str], value: Any, expected: str, sources: Sources) -> ConfigError:
    return ConfigError(f"{_dotted(path)}={_fmt(value)} (from {sources.of(path)}) - expected {expected}")


def _unknown_key(
    path: Sequence[str], options: Iterable[str], rest: Sequence[str], origin: str, hint: str = ""
) -> ConfigError:
    """'unknown key a.b' with a full-path suggestion (the misspelled segment replaced) or the options."""
    options = [str(o) for o in options]
    match = difflib.get_close_matches(str(path[-1]), options, n=1, cutoff=0.7)
    where = f"unknown key '{_dotted([*path, *rest])}' (from {origin})"
    if match:
        return ConfigError(f"{where} - did you mean '{_dotted([*path[:-1], match[0], *rest])}'?")
    parent = f"under '{_dotted(path[:-1])}'" if len(path) > 1 else "at the top level"
    return ConfigError(f"{where} - allowed keys {parent}: {', '.join(options) or '(none)'}{hint}")


# =========================================================================================
# Typed conversion (dataclass type hints)
# =========================================================================================
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _convert(tp: Any, value: Any, path: tuple[str, ...], sources: Sources, words: str = "") -> Any:
    """``value`` checked and converted to ``tp``; ConfigError naming ``path`` otherwise.

    ``words`` replaces the type description in the error (an Optional field passes its own).
    """
    origin = get_origin(tp)
    words = words or describe(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, sources)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"config schema: unsupported union {tp} at {_dotted(path)}")
        if value is None:
            raise _value_error(path, value, words, sources)
        return _convert(inner[0], value, path, sources, words)
    if origin is Literal:
        if value not in get_args(tp):
            raise _value_error(path, value, words + suggest(value, get_args(tp)), sources)
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _value_error(path, value, words, sources)
        return tuple(_convert(get_args(tp)[0], v, (*path, str(i)), sources) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _value_error(path, value, "a mapping with string keys", sources)
        return {k: _convert(get_args(tp)[1], v, (*path, k), sources) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _value_error(path, value, words, sources)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _value_error(path, value, words, sources)
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads '1e-3' (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _value_error(path, value, words, sources)
        if not math.isfinite(value):
            raise _value_error(path, value, "a finite number", sources)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _value_error(path, value, words, sources)
        return value
    raise TypeError(f"config schema: unsupported type {tp} at {_dotted(path)}")


def build(cls: type, data: Any, path: tuple[str, ...], sources: Sources) -> Any:
    """Instance of config dataclass ``cls`` from mapping ``data``: unknown keys, types, checks, rules."""
    if not isinstance(data, Mapping):
        raise _value_error(path, data, f"a mapping of {cls.__name__} keys", sources)
    hints = field_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            where = (*path, str(key))
            raise _renamed(cls, str(key), where, sources.of(where)) or _unknown_key(
                where, fields, (), sources.of(where)
            )
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        value = _convert(hints[name], data[name], (*path, name), sources)
        rule = f.metadata.get("check")
        expected = rule(value, describe(non_null(hints[name]))) if rule and value is not None else None
        if expected is not None:
            raise _value_error((*path, name), data[name], expected, sources)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except Invalid as problem:
        shown = data.get(problem.key, problem.value)  # as the user wrote it
        raise _value_error((*path, *problem.key.split(".")), shown, problem.expected, sources) from None


# =========================================================================================
# Recipe files and defaults
# =========================================================================================
def recipes_dir() -> Path:
    """The folder of the shipped recipes (next to the package)."""
    folder = Path(sparrow_nemo.__file__).resolve().parents[1] / "recipes"
    if not folder.is_dir():
        raise ConfigError(
            f"the recipes folder {folder} is missing (sparrow_nemo was installed without its "
            "recipes); pass --config PATH to a recipe file"
        )
    return folder


def _display(path: Path) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _with_suffix(name: str) -> str:
    return name if name.endswith((".yaml", ".yml")) else name + ".yaml"


def resolve_recipe(config: str | os.PathLike[str] | None) -> Path:
    """A recipe file: ``None`` -> the default recipe; an existing path; else a name in :func:`recipes_dir`."""
    if config is None:
        return recipes_dir() / _with_suffix(DEFAULT_RECIPE)
    path = Path(config)
    if path.is_file():
        return path
    shipped = recipes_dir() / _with_suffix(str(config))
    if shipped.is_file() and path.parent == Path("."):
        return shipped
    names = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    raise ConfigError(
        f"recipe '{config}' not found (no such file, and not a shipped recipe)"
        f"{suggest(path.stem, names)} - shipped recipes: {', '.join(names)}"
    )


def _merge(
    base: dict[str, Any],
    layer: Mapping[str, Any],
    sources: Sources,
    origin: str,
    prefix: tuple[str, ...] = (),
) -> None:
    """Deep-merge ``layer`` into ``base`` in place: mappings merge, everything else replaces."""
    for key, value in layer.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, sources, origin, path)
        else:
            base[key] = copy.deepcopy(value)
            sources.mark(path, origin)


class _Composer:
    """Merges a recipe and its ``defaults`` chain into one tree; each file is read once."""

    def __init__(self, tree: dict[str, Any], sources: Sources) -> None:
        self.tree = tree
        self.sources = sources
        self.files: dict[Path, dict[str, Any]] = {}
        self.merges = 0

    def compose(self, path: Path, stack: tuple[Path, ...] = ()) -> None:
        resolved = path.resolve()
        if resolved in stack:
            cycle = " -> ".join(_display(p) for p in (*stack, resolved))
            raise ConfigError(f"defaults cycle: {cycle}")
        if len(stack) >= MAX_DEFAULTS_DEPTH:
            raise ConfigError(
                f"defaults chain of {_display(stack[0])} is deeper than {MAX_DEFAULTS_DEPTH} recipes "
                f"(at {_display(path)}) - expected a short chain of defaults"
            )
        self.merges += 1
        if self.merges > MAX_RECIPE_MERGES:
            raise ConfigError(
                f"defaults of {_display(stack[0] if stack else path)} merge more than {MAX_RECIPE_MERGES} "
                "recipe files - expected a small tree of defaults"
            )
        if resolved not in self.files:
            self.files[resolved] = read_recipe_file(path, _display(path))
        data = dict(self.files[resolved])
        defaults = data.pop("defaults", [])
        if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
            raise ConfigError(
                f"defaults={_fmt(defaults)} (from {_display(path)}) - expected a list of recipe names "
                "(e.g. defaults: [base])"
            )
        for name in defaults:
            parent = path.parent / _with_suffix(name)
            if not parent.is_file():
                names = sorted(p.stem for p in path.parent.glob("*.yaml"))
                raise ConfigError(
                    f"defaults entry '{name}' (from {_display(path)}) - no recipe {_display(parent)}"
                    f"{suggest(name, names)}"
                )
            self.compose(parent, (*stack, resolved))
        _merge(self.tree, data, self.sources, _display(path))


# =========================================================================================
# Overrides
# =========================================================================================
_OVERRIDE = re.compile(r"^(?P<mode>\+{0,2})(?P<key>[\w-]+(\.[\w-]+)*)=(?P<value>.*)$", re.DOTALL)


@dataclass(frozen=True)
class Override:
    """One command-line override: ``mode`` '' (set existing), '+' (add new) or '++' (add or set)."""

    mode: str
    path: tuple[str, ...]
    value: Any

    @classmethod
    def parse(cls, text: str) -> Override:
        match = _OVERRIDE.match(text)
        if not match:
            raise ConfigError(
                f"override '{text if len(text) <= 80 else text[:77] + '...'}' (from {_COMMAND_LINE}) - expected key=value, +key=value or "
                "++key=value with a dotted key (e.g. sparsity.threshold=0.9)"
            )
        raw = match.group("value")
        key = match.group("key")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except YamlProblem as problem:
            shown = text if len(text) <= 80 else text[:77] + "..."
            if problem.limit:
                raise ConfigError(
                    f"override '{shown}' (from {_COMMAND_LINE}) - the value of {key} is refused: {problem.problem}"
                ) from None
            raise ConfigError(
                f"override '{shown}' (from {_COMMAND_LINE}) - the value does not parse as YAML "
                "(quote it, e.g. key='a: b')"
            ) from None
        return cls(match.group("mode"), tuple(key.split(".")), value)


def _schema_at(root: type, path: Sequence[str]) -> Any:
    """The schema type at ``path`` (a config dataclass, dict[...], a leaf type, Any), or None off the schema."""
    tp: Any = root
    for key in path:
        if dataclasses.is_dataclass(tp):
            hints = field_hints(tp)
            if key not in hints:
                return None
            tp = hints[key]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) is tuple:
            tp = get_args(tp)[0]
        else:
            return Any if tp is Any else None
        if get_origin(tp) in (Union, types.UnionType):
            tp = next(a for a in get_args(tp) if a is not type(None))
    return tp


def _free_form(root: type, path: Sequence[str]) -> bool:
    """True when the schema allows new keys at ``path`` (a dict[...] field or anything below Any)."""
    tp = _schema_at(root, path)
    return get_origin(tp) is dict or tp is Any


def _renamed(cls: Any, key: str, path: Sequence[str], origin: str) -> ConfigError | None:
    """The error for a key that section ``cls`` lists in ``renamed_keys`` (``path`` ends with ``key``), else None."""
    moved = getattr(cls, "renamed_keys", {}).get(key) if dataclasses.is_dataclass(cls) else None
    return None if moved is None else ConfigError(f"unknown key '{_dotted(path)}' (from {origin}) - {moved}")


def _apply(root: type, tree: dict[str, Any], ov: Override, sources: Sources) -> None:
    """Apply one override to the merged tree (defaults + recipes), recording its source."""
    node: Any = tree
    for depth, key in enumerate(ov.path):
        here = ov.path[: depth + 1]
        last = depth == len(ov.path) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                items = f"a list of {len(node)} (indices 0..{len(node) - 1})" if node else "an empty list"
                raise ConfigError(
                    f"{_dotted(here)} (from {_COMMAND_LINE}) - '{_dotted(ov.path[:depth])}' is {items}; "
                    f"set the whole list instead ({_dotted(ov.path[:depth])}=[...])"
                )
            if last:
                node[int(key)] = ov.value
            node = node[int(key)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(
                f"{_dotted(here)} (from {_COMMAND_LINE}) - '{_dotted(ov.path[:depth])}' is "
                f"{_fmt(node)}, not a mapping"
            )
        exists = key in node
        free = _free_form(root, ov.path[:depth])
        if not exists and (ov.mode == "" or not free):
            renamed = _renamed(_schema_at(root, ov.path[:depth]), key, here, _COMMAND_LINE)
            if renamed is not None:
                raise renamed
            hint = f" (add a new key with ++{_dotted(ov.path)}=...)" if free else ""
            raise _unknown_key(here, node, ov.path[depth + 1 :], _COMMAND_LINE, hint)
        if last:
            if exists and ov.mode == "+":
                raise ConfigError(
                    f"{_dotted(here)} (from {_COMMAND_LINE}) - +key adds a new key but "
                    f"'{_dotted(here)}' exists; use {_dotted(here)}=... or ++{_dotted(here)}=..."
                )
            if isinstance(ov.value, dict) and isinstance(node.get(key), dict):
                _merge(node[key], ov.value, sources, _COMMAND_LINE, here)
                return
            node[key] = ov.value
        elif not exists:
            node[key] = {}
        node = node[key]
    sources.mark(ov.path, _COMMAND_LINE)


# =========================================================================================
# Entry points
# =========================================================================================
def _resolve(root: type[Root], layers: Iterable[Callable[[dict[str, Any], Sources], None]]) -> Root:
    """Start from the dataclass defaults, let each layer merge into the tree, then type and check it."""
    tree = plain(root())
    sources = Sources()
    for layer in layers:
        layer(tree, sources)
    return build(root, tree, (), sources)


def load(root: type[Root], config: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> Root:
    """Resolve a recipe (path, shipped name, or None = the default recipe) plus overrides into ``root``.

    Raises :class:`ConfigError` (one line) on any problem.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    path = resolve_recipe(config)
    parsed = [Override.parse(text) for text in overrides]

    def apply_overrides(tree: dict[str, Any], sources: Sources) -> None:
        for ov in parsed:
            _apply(root, tree, ov, sources)

    return _resolve(root, [lambda tree, sources: _Composer(tree, sources).compose(path), apply_overrides])


def from_dict(root: type[Root], data: Mapping[str, Any], origin: str = "<dict>") -> Root:
    """A ``root`` config from a plain mapping (e.g. a resolved ``config.yaml``) over the defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"a config must be a mapping of sections, got {type(data).__name__} (from {origin})"
        )
    return _resolve(root, [lambda tree, sources: _merge(tree, data, sources, origin)])
