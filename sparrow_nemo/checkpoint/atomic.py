"""Atomic checkpoint directories: per-rank files + a JSON manifest written last, verified on load.

Protocol (any number of ranks, shared filesystem):

1. every rank writes its files into ``<root>/<name>.partial`` (each file: temp name, fsync,
   ``os.replace``), or into one level of subfolders (a sharded checkpoint's own folder);
2. after a barrier, rank 0 hashes the files (sha256), writes ``manifest.json`` (atomically), and
   renames the directory to ``<root>/<name>`` (``os.replace``; an older copy is moved aside first).

A crash at any point leaves either the previous complete checkpoint or a ``.partial`` directory
that :func:`verify_checkpoint` refuses (no manifest) and :func:`latest_checkpoint` ignores. A file
altered after the save fails its hash. Reading trusts nothing in the folder: a manifest or listed file
must be a regular file (not a symbolic link, a FIFO or ``/proc/self/pagemap``), a manifest is read up to
:data:`MAX_MANIFEST_BYTES`, and its ``step`` must be an integer >= 0; anything else is a
:class:`CheckpointError` naming the folder, and :func:`complete_checkpoints` passes over it with a warning.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.atomic_io import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
#: the largest manifest read (a real one lists a few files: < 10 KB)
MAX_MANIFEST_BYTES = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint directory that is incomplete, corrupted or for another layout."""


def disk_full_error(path: Path, exc: BaseException) -> CheckpointError | None:
    """A one-line CheckpointError when ``exc`` (raised writing ``path``) means the disk is full, else None.

    Python reports ENOSPC / EDQUOT as an OSError; ``torch.save`` as a RuntimeError of its zip writer whose
    context is that OSError (or, from C++, "file write failed" / a short write's "unexpected pos", told apart
    by the free space left; checked before the temp file goes); megatron's sharded-checkpoint writer, whose
    writes run in worker processes, as an exception whose text carries the worker's error.
    """
    free = shutil.disk_usage(path.parent).free
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    short_write = ("write failed", "unexpected pos")  # torch's zip writer, here or in a writer process
    full = full or any(any(t in str(e) for t in short_write) and free < 1 << 20 for e in chain)
    full = full or any(os.strerror(code) in str(e) for e in chain for code in (errno.ENOSPC, errno.EDQUOT))
    if not full:
        return None
    return CheckpointError(
        f"{path}: the disk is full ({free} bytes free in {path.parent}); checkpoint not written"
    )


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees either the old file or the complete new one.

    Raises:
        CheckpointError: the disk is full (the temp file is removed).
    """
    path = Path(path)
    atomic_write(path, lambda f: f.write(data), lambda exc: disk_full_error(path, exc))


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically (temp file in the same directory, then rename).

    Raises:
        CheckpointError: the disk is full (the temp file is removed).
    """
    path = Path(path)
    atomic_write(path, lambda f: torch.save(obj, f), lambda exc: disk_full_error(path, exc))


def open_regular(path: str | Path) -> int:
    """A read-only fd of ``path`` if it is a regular file reached without following a final symbolic link.

    Raises:
        CheckpointError: a symbolic link, a FIFO, a device, a folder (naming ``path``); OSError otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link, not a file a checkpoint writes") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file")
    return fd


def read_bounded(path: str | Path, cap: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), refused past ``cap`` bytes."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"{path} is over {cap:,} bytes")
    return data


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a regular file's bytes (:func:`open_regular`)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def partial_dir(root: str | Path, name: str) -> Path:
    """The staging directory every rank writes into (created if absent)."""
    path = Path(root) / f"{name}{PARTIAL_SUFFIX}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def finalize(root: str | Path, name: str, meta: dict[str, Any]) -> Path:
    """Rank 0, after all ranks wrote into :func:`partial_dir`: manifest (hashes + ``meta``), then rename.

    Returns:
        The final checkpoint directory ``<root>/<name>``.
    """
    staging = Path(root) / f"{name}{PARTIAL_SUFFIX}"
    files = sorted(p.name for p in staging.iterdir() if p.is_file() and not p.name.startswith("."))
    for folder in sorted(p for p in staging.iterdir() if p.is_dir()):  # a sharded checkpoint's own files
        files += sorted(f"{folder.name}/{f.name}" for f in folder.iterdir() if f.is_file())
    if not files:
        raise CheckpointError(f"{staging}: no files to finalize")
    manifest = {**meta, "files": {n: sha256_file(staging / n) for n in files}}
    atomic_write_bytes(staging / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    final = Path(root) / name
    if final.exists():
        old = Path(root) / f"{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_dir(Path(root))
    return final


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder whose save completed (its files are not checked).

    Raises:
        CheckpointError: no manifest, one that is not a regular file, too long, not JSON, not a mapping
            with a ``files`` mapping of names to hex digests, or a ``step`` that is not an integer >= 0.
    """
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(f"{path} is an unfinished save (no rename happened)")
    manifest_path = path / MANIFEST
    if not os.path.lexists(manifest_path):
        raise CheckpointError(f"{path} has no {MANIFEST}: the save did not complete")
    try:
        manifest = json.loads(read_bounded(manifest_path, MAX_MANIFEST_BYTES).decode("utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, an int too long
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(f"{path}: {MANIFEST} is not a mapping with a 'files' mapping of sha256 digests")
    if "step" in manifest and not is_count(manifest["step"]):
        raise CheckpointError(
            f"{path}: {MANIFEST} 'step' must be an integer >= 0, got {manifest['step']!r:.40}"
        )
    return manifest


def is_count(value: Any) -> bool:
    """An int >= 0 (not a bool, a float or a string)."""
    return type(value) is int and value >= 0


def is_member_name(name: str) -> bool:
    """A manifest entry: a file of the folder or of one of its subfolders (``policy/__0_0.distcp``), no other
    path (absolute, ``..``, deeper)."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(part not in ("", ".", "..") and os.sep not in part for part in parts)


def verify_checkpoint(path: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; :class:`CheckpointError` names what is missing or wrong."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, digest in manifest.get("files", {}).items():
        file = path / name
        if not is_member_name(name) or not os.path.lexists(file):
            raise CheckpointError(f"{path}: file '{name[:80]}' listed in the manifest is missing")
        if "/" in name and (path / name.split("/")[0]).is_symlink():
            raise CheckpointError(
                f"{path}: '{name.split('/')[0]}' is a symbolic link, not a checkpoint folder"
            )
        if check_hashes and sha256_file(file) != digest:
            raise CheckpointError(f"{path}: file '{name}' does not match its sha256 in the manifest")
    return manifest


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the checkpoints under ``root`` whose save completed (a readable manifest; the
    files are checked when loading), newest first.

    Ordered by the ``step`` in the manifest; for equal steps ``step_<n>`` comes before ``step_<n>.old``
    (a complete earlier save of the same step, kept only if a re-save of that step died between its two
    renames: still a valid fallback).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[tuple[int, bool, Path]] = []
    for child in root.iterdir():
        if not child.is_dir() or child.name.endswith(PARTIAL_SUFFIX):
            continue
        try:
            step = read_manifest(child).get("step", -1)
        except CheckpointError as exc:
            logger.warning("ignoring checkpoint folder %s: %s", child, exc)
            continue
        found.append((step, child.name.endswith(".old"), child))
    return [(step, path) for step, _, path in sorted(found, key=lambda t: (-t[0], t[1], t[2].name))]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` with the highest ``step`` in its manifest (or None)."""
    found = complete_checkpoints(root)
    return found[0][1] if found else None
