"""``scripts/<name>.py`` as a module (scripts/ is not a package), for the tests of this folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py``, executed afresh."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
