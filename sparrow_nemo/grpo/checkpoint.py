"""One atomic checkpoint per saved step: the policy (every rank) and the run's state, and resuming from one.

``<checkpoint root>/step_<8 digits>/`` (written as ``step_<n>.partial``, renamed when complete;
:mod:`sparrow_nemo.checkpoint.atomic`) holds:

- ``policy_tp*_pp*_dp*.pt``: each rank's model shard, optimizer state and RNG states (torch CPU, CUDA,
  megatron's tracker) - :mod:`sparrow_nemo.policy.checkpoint`;
- ``trainer_state.json`` (:meth:`TrainerState.to_dict` and the callbacks' states) and ``callback_tensors.pt``
  - :mod:`sparrow_nemo.checkpoint.run_state`;
- ``manifest.json``: sha256 of every file above, written last.

Loading (:func:`load_run_checkpoint`) tries the candidates newest first; each rank verifies the hashes of
the files it reads, the ranks agree, and a checkpoint that fails on any rank is skipped with a warning
naming it and the reason (the previous good one is used).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sparrow_nemo.checkpoint.atomic import CheckpointError
from sparrow_nemo.checkpoint.run_state import read_run_state
from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, knob
from sparrow_nemo.grpo.process_model import distributed, object_group
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)


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
