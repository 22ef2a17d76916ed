"""Atomic file writes: a reader sees either the old file or the complete new one, never a torn one.

Used by the checkpoints (:mod:`sparrow_nemo.policy.checkpoint`) and by the metrics file a resumed run
rewrites (:mod:`sparrow_nemo.grpo.metrics`); it knows neither.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_bytes", "fsync_dir"]


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` into a temp file next to ``path`` (fsynced), then rename it over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))
