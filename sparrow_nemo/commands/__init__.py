"""Subcommands of the ``sparrow`` CLI, one module each, found by :func:`discover`.

A command module defines:

- ``NAME``: the subcommand (``sparrow NAME ...``); ``HELP``: one line for ``sparrow --help``;
- ``add_arguments(parser: argparse.ArgumentParser) -> None``;
- ``run(args: argparse.Namespace) -> int``: the exit status.

Adding a subcommand = adding a module here; nothing else changes. Modules import heavy packages
(torch, megatron-core) inside ``run`` so that ``sparrow --help`` stays fast.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def discover() -> list[ModuleType]:
    """Every command module of this package (names not starting with '_'), sorted by NAME."""
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]
    for module in modules:
        missing = [attr for attr in ("NAME", "HELP", "add_arguments", "run") if not hasattr(module, attr)]
        if missing:
            raise AttributeError(f"command module {module.__name__} lacks {', '.join(missing)}")
    return sorted(modules, key=lambda m: m.NAME)
