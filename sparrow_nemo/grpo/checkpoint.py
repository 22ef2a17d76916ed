"""One atomic checkpoint per saved step: the policy (every rank) and the run's state, and resuming from one.

``<checkpoint root>/step_<8 digits>/`` (written as ``step_<n>.partial``, renamed when complete;
:mod:`sparrow_nemo.checkpoint.atomic`) holds:

- ``policy/`` and ``rng_tp*_pp*_dp*.pt``: the sharded model and optimizer state (megatron ``dist_checkpointing``,
  each rank writing its own shard) and each rank's RNG states - :mod:`sparrow_nemo.policy.checkpoint`;
- ``trainer_state.json`` (:meth:`TrainerState.to_dict` and the callbacks' states) and ``callback_tensors.pt``
  - :mod:`sparrow_nemo.checkpoint.run_state`;
- ``manifest.json``: sha256 of every file above, written last.

Loading (:func:`load_run_checkpoint`) tries the candidates newest first; each rank verifies the hashes of
the files it reads, rank 0 validates the trainer state (:meth:`TrainerState.from_dict`: types and ranges,
the manifest's step) and that ``metrics.jsonl`` can continue from it
(:func:`~sparrow_nemo.run_io.metrics.check_resume_rows`), the ranks agree, and a checkpoint that fails on any
rank is skipped with a warning naming it and the reason (the previous good one is used). A tampered checkpoint whose manifest hashes were
recomputed is therefore never resumed from, and never allowed to cut ``metrics.jsonl``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sparrow_nemo.checkpoint.atomic import CheckpointError, is_count, read_manifest
from sparrow_nemo.checkpoint.run_state import read_run_state
from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, knob
from sparrow_nemo.grpo.process_model import distributed, object_group
from sparrow_nemo.run_io.metrics import check_resume_rows
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
        pending_row: the ``metrics.jsonl`` row of step ``step - 1`` (without its ``timing/checkpoint``) when
            the checkpoint was saved before that row was written: a resume writes it if the file lacks it.
    """

    step: int
    schedule: BudgetSchedule
    prompt_cursor: int = 0
    initial_schedule: BudgetSchedule | None = None
    warm_start_dir: str | None = None
    evals: dict[str, dict[str, float]] = field(default_factory=dict)
    prompt_stream: dict[str, Any] = field(default_factory=dict)
    metrics_rows: int = 0
    pending_row: dict[str, Any] | None = None

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
            "pending_row": self.pending_row,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        """Inverse of :meth:`to_dict`, checking every entry's type and range.

        Raises:
            CheckpointError: names the first entry that is not what :meth:`to_dict` writes.
        """
        counts = {key: data.get(key) for key in ("step", "prompt_cursor", "metrics_rows")}
        for key, value in counts.items():
            if not is_count(value):
                raise CheckpointError(f"trainer state '{key}' must be an integer >= 0, got {value!r:.40}")
        _expect(data, "evals", dict)
        for tag, results in data["evals"].items():
            if not isinstance(results, dict) or not all(_is_scalar(v) for v in results.values()):
                raise CheckpointError(f"trainer state 'evals.{tag:.40}' must map names to numbers or text")
        stream = _expect(data, "prompt_stream", dict)
        if "cursor" in stream and not is_count(stream["cursor"]):
            raise CheckpointError("trainer state 'prompt_stream.cursor' must be an integer >= 0")
        if not isinstance(data.get("warm_start_dir"), str | None):
            raise CheckpointError("trainer state 'warm_start_dir' must be a path or null")
        pending = data.get("pending_row")
        if pending is not None and not (
            isinstance(pending, dict) and pending.get("step") == counts["step"] - 1
        ):
            raise CheckpointError(
                f"trainer state 'pending_row' must be null or the row of step {counts['step'] - 1}"
            )
        schedules = {}
        for key in ("schedule", "initial_schedule"):
            try:
                raw = data.get(key)
                schedules[key] = (
                    None if raw is None and key == "initial_schedule" else BudgetSchedule.from_dict(raw)
                )
            except (ValueError, TypeError) as exc:
                raise CheckpointError(f"trainer state '{key}': {exc}") from None
        return cls(
            step=counts["step"],
            schedule=schedules["schedule"],
            prompt_cursor=counts["prompt_cursor"],
            initial_schedule=schedules["initial_schedule"],
            warm_start_dir=data["warm_start_dir"],
            evals={tag: dict(results) for tag, results in data["evals"].items()},
            prompt_stream=dict(stream),
            metrics_rows=counts["metrics_rows"],
            pending_row=pending,
        )


def _expect(data: dict[str, Any], key: str, kind: type) -> Any:
    if not isinstance(data.get(key), kind):
        raise CheckpointError(
            f"trainer state '{key}' must be a {kind.__name__}, got {type(data.get(key)).__name__}"
        )
    return data[key]


def _is_scalar(value: Any) -> bool:
    return value is None or type(value) in (int, float, str, bool)


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


def load_run_checkpoint(
    candidates: list[Path], policy: Any, is_main: bool, metrics_path: Path | None = None
) -> RunCheckpoint | None:
    """Collective: restore the newest candidate that every rank can read; None when there are no candidates.

    Rank 0 reads and verifies the trainer and callback state and, given ``metrics_path`` (the run's
    ``metrics.jsonl``), validates the trainer state as a trainer's (:func:`validated_trainer_state`); once the
    ranks agree on it, every rank restores its policy shard, optimizer and RNG (``policy.load``, collective,
    which checks the files' sha256 before touching any state). A candidate failing on any
    rank, for any reason (its files are not trusted), is skipped on all, with a warning naming it and why.

    Raises:
        CheckpointError: candidates were given but none loads (each one's reason in the message).
    """
    reasons = []
    for path in candidates:
        error, trainer, callbacks = None, {}, {}
        try:
            if is_main:
                trainer, callbacks = read_run_state(path)
                if metrics_path is not None:
                    validated_trainer_state(path, trainer, metrics_path)
        except Exception as exc:  # a tampered file may fail anywhere in loading: that candidate is unusable
            error = f"{type(exc).__name__}: {str(exc)[:500]}"
        failed = [(rank, e) for rank, e in enumerate(_gather(error)) if e is not None]
        if not failed:  # the policy's load is collective: every rank calls it, or none
            try:
                policy.load(path)
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc)[:500]}"
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


def validated_trainer_state(path: Path, trainer: dict[str, Any], metrics_path: Path) -> TrainerState:
    """The trainer state of checkpoint ``path`` once it validates: :meth:`TrainerState.from_dict`, the same
    ``step`` as the manifest's, and the metrics file ``metrics_path`` able to continue from it
    (:func:`~sparrow_nemo.run_io.metrics.check_resume_rows`).

    Raises:
        CheckpointError: naming the checkpoint and what does not validate.
    """
    try:
        state = TrainerState.from_dict(trainer)
        manifest_step = read_manifest(path).get("step")
        if manifest_step != state.step:
            raise CheckpointError(f"trainer state 'step' {state.step} but the manifest says {manifest_step}")
        check_resume_rows(metrics_path, state.metrics_rows, state.step, state.pending_row)
    except (CheckpointError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return state


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
    save_hf: bool = knob(
        False,
        "at the end of the run write the policy as a Hugging Face checkpoint in <run_dir>/hf, as `sparrow "
        "export` writes it (sparrow_nemo/grpo/export.py: save_run_hf)",
        hashed=False,
    )
