"""Fixtures for the config tests: small recipe files in a temporary folder."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[[str, str], Path]:
    """``write_recipe(name, text)`` -> ``tmp_path/name.yaml`` holding the dedented ``text``."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / (name if name.endswith(".yaml") else name + ".yaml")
        path.write_text(textwrap.dedent(text))
        return path

    return write
