"""The run's files in a step checkpoint, retention, and which checkpoints a resume tries.

A step checkpoint ``<checkpoint root>/step_<8 digits>/`` (:mod:`sparrow_nemo.checkpoint.atomic`) holds, besides
the policy's per-rank files (:mod:`sparrow_nemo.policy.checkpoint`):

- ``trainer_state.json``: ``{"trainer": <the trainer's state, plain JSON>, "callbacks": {name: state}}``, the
  callbacks' JSON-able state entries;
- ``callback_tensors.pt``: the callbacks' state entries that hold torch tensors (a LoRA adapter, an
  optimizer state), ``{name: {key: value}}``; absent when there are none.

What the trainer's state contains is :class:`sparrow_nemo.grpo.checkpoint.TrainerState`'s business; this module
stores and verifies it as plain data: both files hash-checked against the manifest, ``trainer_state.json``
a JSON object whose ``trainer`` is an object and whose ``callbacks`` map names to objects,
``callback_tensors.pt`` loadable with ``weights_only`` (no pickled code) and of the same shape.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.checkpoint.atomic import (
    MANIFEST,
    PARTIAL_SUFFIX,
    CheckpointError,
    atomic_torch_save,
    atomic_write_bytes,
    complete_checkpoints,
    read_bounded,
    sha256_file,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
CALLBACK_TENSORS = "callback_tensors.pt"
#: the largest ``trainer_state.json`` read (real ones: a few KB to a few MB of callback state)
MAX_STATE_BYTES = 256 << 20


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_tensor(v) for v in value)
    return False


def write_run_state(
    folder: Path, trainer: dict[str, Any], callbacks: Mapping[str, Mapping[str, Any]]
) -> None:
    """Write ``trainer_state.json`` (+ ``callback_tensors.pt``) into a staging checkpoint folder.

    Args:
        trainer: :meth:`TrainerState.to_dict` (plain JSON types).
        callbacks: ``{callback key: state}`` as :meth:`CallbackList.on_save_checkpoint` returns it; each
            top-level state entry holding a torch tensor goes to the torch file, the rest to JSON.
    """
    plain: dict[str, dict[str, Any]] = {}
    tensors: dict[str, dict[str, Any]] = {}
    for name, state in callbacks.items():
        for key, value in state.items():
            (tensors if _has_tensor(value) else plain).setdefault(name, {})[key] = value
    text = json.dumps({"trainer": trainer, "callbacks": plain}, indent=2) + "\n"
    atomic_write_bytes(folder / TRAINER_STATE, text.encode())
    if tensors:
        atomic_torch_save(tensors, folder / CALLBACK_TENSORS)


def read_run_state(folder: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(trainer state, callback states)`` of a complete checkpoint, after checking their sha256.

    Raises:
        CheckpointError: no manifest, a missing file, a hash mismatch or content of another shape than
            :func:`write_run_state` writes (names the folder, file and key).
    """
    manifest = verify_checkpoint(folder, check_hashes=False)
    files = manifest["files"]
    if TRAINER_STATE not in files:
        raise CheckpointError(f"{folder}: no {TRAINER_STATE} in the manifest (a policy-only checkpoint)")
    names = [n for n in (TRAINER_STATE, CALLBACK_TENSORS) if n in files]
    for name in names:
        if sha256_file(folder / name) != files[name]:
            raise CheckpointError(f"{folder}: '{name}' does not match its sha256 in the manifest")
    try:
        payload = json.loads(read_bounded(folder / TRAINER_STATE, MAX_STATE_BYTES).decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int too long
        raise CheckpointError(f"{folder / TRAINER_STATE}: not readable JSON ({exc})") from None
    where = folder / TRAINER_STATE
    if not isinstance(payload, dict) or not isinstance(payload.get("trainer"), dict):
        raise CheckpointError(f"{where}: expected an object with a 'trainer' object")
    callbacks = _states(payload.get("callbacks"), f"{where} 'callbacks'")
    if CALLBACK_TENSORS in names:
        try:
            loaded = torch.load(folder / CALLBACK_TENSORS, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise CheckpointError(
                f"{folder / CALLBACK_TENSORS}: refused, not tensors and plain data ({first})"
            ) from None
        for name, entries in _states(loaded, str(folder / CALLBACK_TENSORS)).items():
            callbacks.setdefault(name, {}).update(entries)
    return payload["trainer"], callbacks


def _states(value: Any, where: str) -> dict[str, dict[str, Any]]:
    """``value`` checked to be ``{callback name: {key: state}}``."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in value.items()
    ):
        raise CheckpointError(f"{where}: expected a mapping of callback names to mappings")
    return {k: dict(v) for k, v in value.items()}


def prune_checkpoints(root: Path, written: Path, keep_last: int) -> list[Path]:
    """After ``written`` is complete: drop the checkpoints of later steps (a timeline this run abandoned
    when it resumed from an earlier one) and all but the newest ``keep_last`` up to ``written``.

    Never removes ``written``. Returns the removed folders.
    """
    found = complete_checkpoints(root)
    step = next((s for s, p in found if p == written), None)
    if step is None:
        raise CheckpointError(f"{written}: not a complete checkpoint under {root}, nothing pruned")
    later = [p for s, p in found if s > step]
    older = [p for s, p in found if s <= step and p != written]  # newest first
    doomed = later + older[keep_last - 1 :]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        logger.info("checkpoint retention (keep_last=%d): removed %s", keep_last, [p.name for p in doomed])
    return doomed


def resume_candidates(resume: str, root: Path) -> list[Path]:
    """Checkpoints to try, in order, for ``checkpoint.resume``.

    ``never``: none. ``auto``: the complete checkpoints under ``root``, newest first (none: a fresh run).
    A path: that checkpoint folder, or, for a folder of checkpoints, its complete ones newest first.

    Raises:
        CheckpointError: a path that does not exist or holds no complete checkpoint.
    """
    if resume == "never":
        return []
    if resume == "auto":
        return [p for _, p in complete_checkpoints(root)]
    path = Path(resume)
    if path.name.endswith(PARTIAL_SUFFIX) or (path / MANIFEST).is_file():
        return [path]
    found = [p for _, p in complete_checkpoints(path)]
    if not found:
        what = "does not exist" if not path.exists() else "is not a checkpoint and holds no complete one"
        raise CheckpointError(f"checkpoint.resume={resume}: {what}")
    return found
