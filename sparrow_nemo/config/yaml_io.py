"""YAML in and out for recipes and overrides, with the limits that keep hostile input from hurting.

:func:`read_recipe_file` and :func:`parse_yaml` refuse, each with one :class:`ConfigError` line naming
the file (or the command line), the line and what was expected:

- text that is not UTF-8, or a file over :data:`MAX_RECIPE_BYTES`;
- nesting deeper than :data:`MAX_DEPTH` (PyYAML's composer recurses once per level: 20,000 levels
  would end in a RecursionError);
- more than :data:`MAX_NODES` values once aliases are expanded (an 11 KB "billion laughs" alias bomb
  expands to ~10^9 values; counting is linear in the distinct nodes) and recursive aliases;
- the same key twice in one mapping (YAML itself keeps the last one silently); ``<<`` merge keys
  may still be overridden, as YAML defines;
- an integer longer than Python converts (``sys.get_int_max_str_digits()``, 4,300 digits).

Booleans are YAML 1.2's: only ``true`` / ``false`` (any case as YAML writes them). PyYAML follows YAML 1.1,
where ``off``, ``on``, ``yes``, ``no`` are booleans too, so ``control.scheduler.adapt=off`` (a mode name) would
arrive as ``False`` and be refused; here it is the string ``"off"``, and ``enabled: yes`` is a string that a
boolean knob refuses with its one line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from sparrow_nemo.config.schema import ConfigError

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_RECIPE_BYTES",
    "YamlProblem",
    "dump_yaml",
    "load_yaml",
    "parse_yaml",
    "read_recipe_file",
]

#: deepest nesting of mappings / lists a recipe or override may have (shipped recipes: 3)
MAX_DEPTH = 64
#: values in a document after alias expansion (shipped recipes: < 200)
MAX_NODES = 100_000
#: bytes of one recipe file (shipped recipes: < 5 KB)
MAX_RECIPE_BYTES = 1_000_000


class YamlProblem(Exception):
    """Text that is not acceptable YAML: ``problem`` at ``mark`` (a yaml Mark or None); ``limit`` is True
    when the text parses but breaks one of the limits above (rather than YAML syntax)."""

    def __init__(self, problem: str, mark: Any = None, limit: bool = True) -> None:
        super().__init__(problem)
        self.problem = problem
        self.mark = mark
        self.limit = limit

    def where(self) -> str:
        """`` line L, column C`` of the problem, or ''."""
        return f" line {self.mark.line + 1}, column {self.mark.column + 1}" if self.mark is not None else ""


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader with a nesting limit while composing and duplicate-key detection while constructing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:  # type: ignore[override]
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlProblem(f"nesting deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeConstructor reports it
                continue
            if first is not None:
                raise YamlProblem(
                    f"duplicate key '{key}' (first at line {first.line + 1}) - expected each key once per mapping",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: Node) -> int:
        """An int that Python can also print: at most ``sys.get_int_max_str_digits()`` decimal digits (a
        longer one, decimal or hex, would fail later, in the config hash, naming no key)."""
        try:
            value = super().construct_yaml_int(node)
            str(value)
        except ValueError:  # over the limit (checked before any quadratic conversion)
            raise YamlProblem(
                f"an integer of {len(str(node.value)):,} characters, over the "
                f"{sys.get_int_max_str_digits():,} digits Python converts",
                node.start_mark,
            ) from None
        return value


_LimitedLoader.add_constructor("tag:yaml.org,2002:int", _LimitedLoader.construct_yaml_int)


_BOOL = "tag:yaml.org,2002:bool"
# SafeLoader's implicit resolvers without YAML 1.1's yes/no/on/off booleans, then YAML 1.2's true/false
_LimitedLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_LimitedLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _expanded_size(root: Node) -> int:
    """Values in the document with every alias expanded; YamlProblem past :data:`MAX_NODES` or on a cycle."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise YamlProblem("a recursive alias (a node that contains itself)", node.start_mark)
        open_nodes.add(key)
        total = 1
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_NODES:
                raise YamlProblem(
                    f"more than {MAX_NODES:,} values once aliases are expanded (an alias bomb?)",
                    node.start_mark,
                )
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml(text: str) -> Any:
    """The YAML value of ``text`` under the limits above; :class:`YamlProblem` otherwise."""
    loader = _LimitedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise YamlProblem(
            str(exc.problem or exc.context), exc.problem_mark or exc.context_mark, False
        ) from None
    except yaml.YAMLError as exc:
        raise YamlProblem(str(exc), None, False) from None
    finally:
        loader.dispose()


def parse_yaml(text: str, where: str) -> Any:
    """:func:`load_yaml` with a one-line :class:`ConfigError` naming ``where`` (a file) and the line."""
    try:
        return load_yaml(text)
    except YamlProblem as problem:
        raise ConfigError(f"invalid YAML in {where}{problem.where()}: {problem.problem}") from None


def read_recipe_file(path: Path, shown: str) -> dict[str, Any]:
    """A recipe file's top-level mapping (``{}`` for an empty file); ``shown`` is the name used in errors."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {shown}: {exc.strerror}") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise ConfigError(f"recipe {shown} is over {MAX_RECIPE_BYTES:,} bytes - expected a recipe file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"recipe {shown} line {line} is not UTF-8 text (byte {exc.start}: {raw[exc.start]:#04x}) - "
            "expected a UTF-8 YAML file"
        ) from None
    data = parse_yaml(text, shown)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"recipe {shown} must be a mapping of sections at the top level, got {type(data).__name__}"
        )
    return data


class _RecipeDumper(yaml.SafeDumper):
    """Block-style mappings; lists of scalars on one line (``[64, 96, 128]``)."""

    def represent_list(self, data: list[Any]) -> yaml.Node:
        flow = all(not isinstance(v, dict | list) for v in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_RecipeDumper.add_representer(list, _RecipeDumper.represent_list)


def dump_yaml(data: Any) -> str:
    """YAML text of plain data in insertion order (a valid recipe when ``data`` is a config dict)."""
    return yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False, width=110)
