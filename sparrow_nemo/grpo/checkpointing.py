"""One atomic checkpoint per saved step: policy shards + optimizer + RNG (every rank) and the run's state.

Layout of ``<checkpoint root>/step_<8 digits>/`` (written as ``step_<n>.partial``, renamed when complete;
:mod:`sparrow_nemo.policy.checkpoint`):

- ``policy_tp*_pp*_dp*.pt``: each rank's model shard, optimizer state and RNG states (python, numpy,
  torch, CUDA) - :mod:`sparrow_nemo.policy.resume`;
- ``trainer_state.json``: ``{"trainer": TrainerState.to_dict(), "callbacks": {name: state}}``, the
  callbacks' JSON-able state entries;
- ``callback_tensors.pt``: the callbacks' state entries that hold torch tensors (a LoRA adapter, an
  optimizer state), ``{name: {key: value}}``; absent when there are none;
- ``manifest.json``: sha256 of every file above, written last.

Loading (:func:`load_run_checkpoint`) tries the candidates newest first; each rank verifies the hashes of
the files it reads, the ranks agree, and a checkpoint that fails on any rank is skipped with a warning
naming it and the reason (the previous good one is used).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, knob
from sparrow_nemo.grpo.process_model import distributed, object_group
from sparrow_nemo.policy.checkpoint import (
    MANIFEST,
    PARTIAL_SUFFIX,
    CheckpointError,
    atomic_torch_save,
    atomic_write_bytes,
    complete_checkpoints,
    sha256_file,
    verify_checkpoint,
)
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
CALLBACK_TENSORS = "callback_tensors.pt"


@dataclass
class TrainerState:
    """Everything a resume needs besides the policy checkpoint and the callbacks' states (plain data).

    Attributes:
        step: RL steps completed.
        schedule: the budget schedule the next rollout uses.
        prompt_cursor: position in the prompt stream.
        initial_schedule: the schedule the run started with (for the summary).
        warm_start_dir: the HF checkpoint the policy started from, if any.
        evals: evaluation results by tag ("start", "start_dense", "end", "end_dense").
        prompt_stream: :meth:`PromptSource.state_dict` (cursor, epoch, seed) as of the last checkpoint.
        metrics_rows: rows in ``metrics.jsonl`` as of the last checkpoint (a resumed run drops later ones).
    """

    step: int
    schedule: BudgetSchedule
    prompt_cursor: int = 0
    initial_schedule: BudgetSchedule | None = None
    warm_start_dir: str | None = None
    evals: dict[str, dict[str, float]] = field(default_factory=dict)
    prompt_stream: dict[str, Any] = field(default_factory=dict)
    metrics_rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "schedule": self.schedule.to_dict(),
            "prompt_cursor": self.prompt_cursor,
            "initial_schedule": None if self.initial_schedule is None else self.initial_schedule.to_dict(),
            "warm_start_dir": self.warm_start_dir,
            "evals": self.evals,
            "prompt_stream": self.prompt_stream,
            "metrics_rows": self.metrics_rows,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        """Inverse of :meth:`to_dict`."""
        initial = data["initial_schedule"]
        return cls(
            step=int(data["step"]),
            schedule=BudgetSchedule.from_dict(data["schedule"]),
            prompt_cursor=int(data["prompt_cursor"]),
            initial_schedule=None if initial is None else BudgetSchedule.from_dict(initial),
            warm_start_dir=data["warm_start_dir"],
            evals=dict(data["evals"]),
            prompt_stream=dict(data["prompt_stream"]),
            metrics_rows=int(data["metrics_rows"]),
        )


@dataclass
class RunCheckpoint:
    """A loaded checkpoint: its folder, the trainer state and (rank 0) the callbacks' merged states."""

    path: Path
    trainer: dict[str, Any]
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)


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
        CheckpointError: no manifest, a missing file, a hash mismatch or unreadable content (names which).
    """
    manifest = verify_checkpoint(folder, check_hashes=False)
    files = manifest["files"]
    if TRAINER_STATE not in files:
        raise CheckpointError(f"{folder}: no {TRAINER_STATE} in the manifest (a policy-only checkpoint)")
    names = [n for n in (TRAINER_STATE, CALLBACK_TENSORS) if n in files]
    for name in names:
        if sha256_file(folder / name) != files[name]:
            raise CheckpointError(f"{folder}: '{name}' does not match its sha256 in the manifest")
    payload = json.loads((folder / TRAINER_STATE).read_text())
    callbacks: dict[str, dict[str, Any]] = {k: dict(v) for k, v in payload["callbacks"].items()}
    if CALLBACK_TENSORS in names:
        loaded = torch.load(folder / CALLBACK_TENSORS, map_location="cpu", weights_only=True)
        for name, entries in loaded.items():
            callbacks.setdefault(name, {}).update(entries)
    return payload["trainer"], callbacks


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


def _gather(error: str | None) -> list[str | None]:
    """Every rank's ``error`` (identity list without a multi-rank process group; over gloo)."""
    if not distributed():
        return [error]
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=object_group())
    return errors


def load_run_checkpoint(candidates: list[Path], policy: Any, is_main: bool) -> RunCheckpoint | None:
    """Collective: restore the newest candidate that every rank can read; None when there are no candidates.

    Rank 0 reads and verifies the trainer and callback state; every rank restores its policy shard,
    optimizer and RNG (``policy.load``, which checks its files' sha256 before touching any state). A
    candidate failing on any rank is skipped on all, with a warning naming it and why.

    Raises:
        CheckpointError: candidates were given but none loads (each one's reason in the message).
    """
    reasons = []
    for path in candidates:
        error, trainer, callbacks = None, {}, {}
        try:
            if is_main:
                trainer, callbacks = read_run_state(path)
            policy.load(path)
        except (CheckpointError, OSError, ValueError, RuntimeError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        failed = [(rank, e) for rank, e in enumerate(_gather(error)) if e is not None]
        if not failed:
            if reasons:
                logger.warning("resuming from %s, the newest usable checkpoint", path)
            return RunCheckpoint(path, trainer, callbacks)
        why = "; ".join(f"rank {rank}: {e}" for rank, e in failed)
        reasons.append(f"{path.name} ({why})")
        logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, why)
    if reasons:
        raise CheckpointError(f"no usable checkpoint: {'; '.join(reasons)}")
    return None


# ----- the recipe's ``checkpoint`` section -------------------------------------------------------
@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Checkpoints (none of these fields enters the config hash)."""

    enabled: bool = knob(True, "save checkpoints at all", hashed=False)
    dir: str | None = knob(None, "folder of the step checkpoints; null = <run_dir>/checkpoints", hashed=False)
    every_n_steps: int = knob(10, "save every N steps (and at the end)", check=AT_LEAST_ONE, hashed=False)
    every_n_minutes: float = knob(
        0.0,
        "also save when this many minutes passed since the last save (rank 0's clock decides for all ranks), "
        "so a preempted multi-hour attempt always has a recent checkpoint; 0 = off",
        check=NON_NEGATIVE,
        hashed=False,
    )
    keep_last: int = knob(2, "checkpoints kept on disk", check=AT_LEAST_ONE, hashed=False)
    resume: str = knob(
        "auto",
        "auto (the newest good one in dir, else a fresh run), never, or a checkpoint path",
        hashed=False,
    )
    force_resume: bool = knob(
        False, "resume into a run folder whose config_hash.txt differs from this recipe's hash", hashed=False
    )
