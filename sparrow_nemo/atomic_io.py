"""Atomic file writes: a reader sees either the old file or the complete new one, never a torn one.

Used by the checkpoints (:mod:`sparrow_nemo.checkpoint.atomic`) and by the metrics file a resumed run
rewrites (:mod:`sparrow_nemo.run_io.metrics`); it knows neither.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "fsync_dir"]


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | Path,
    write: Callable[[BinaryIO], object],
    translate: Callable[[BaseException], BaseException | None] | None = None,
) -> None:
    """``write(f)`` into a temp file next to ``path`` (fsynced), then rename it over ``path``.

    On failure the temp file is removed and the error re-raised; ``translate(error)``, called while the
    temp file still exists, may return a clearer error to raise instead (e.g. "the disk is full").
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        clearer = translate(exc) if translate is not None else None
        Path(tmp).unlink(missing_ok=True)
        if clearer is not None:
            raise clearer from None
        raise
    fsync_dir(path.parent)
