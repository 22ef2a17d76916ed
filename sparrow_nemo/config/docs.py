"""The knobs of a config class tree: their dotted keys, owners and doc strings, and the documented YAML.

The doc string of a knob is the one given to :func:`sparrow_nemo.config.schema.knob` where the
component declares it; ``sparrow config show --doc`` prints :func:`documented_yaml`, which is that text
as a comment above each key of the resolved recipe (and still a valid recipe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from sparrow_nemo.config.compose import plain
from sparrow_nemo.config.schema import field_hints, non_null

__all__ = ["Knob", "documented_yaml", "knobs"]


@dataclass(frozen=True)
class Knob:
    """One recipe key: ``key`` (dotted), the config class that declares it, the field and its doc."""

    key: str
    owner: type
    field: dataclasses.Field
    doc: str
    is_section: bool


def knobs(root: type, prefix: str = "") -> Iterator[Knob]:
    """Every key of config class ``root`` depth first (a nested section, then its keys)."""
    hints = field_hints(root)
    for f in dataclasses.fields(root):
        tp = non_null(hints[f.name])
        nested = dataclasses.is_dataclass(tp)
        key = f"{prefix}{f.name}"
        yield Knob(key, root, f, f.metadata.get("doc", ""), nested)
        if nested:
            yield from knobs(tp, key + ".")


def _inline(value: Any) -> str:
    """A value as YAML on one line (flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def documented_yaml(config: Any, indent: str = "") -> str:
    """The resolved ``config`` as YAML with each knob's doc string as a comment above its key."""
    lines: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        doc = f.metadata.get("doc", "")
        if doc:
            lines.append(f"{indent}# {doc}")
        if dataclasses.is_dataclass(value):
            lines.append(f"{indent}{f.name}:")
            lines.append(documented_yaml(value, indent + "  ").rstrip("\n"))
        else:
            lines.append(f"{indent}{f.name}: {_inline(plain(value))}")
    return "\n".join(lines) + "\n"
