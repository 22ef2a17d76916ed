"""From a step's rollouts to what callbacks see: the :class:`StepReport`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparrow_nemo.callbacks.base import StepReport
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.sparse.schedule import BudgetSchedule


def build_step_report(
    step: int,
    samples: Sequence[RolloutSample],
    mismatch: TokenMismatch,
    rewards: Sequence[float] | torch.Tensor,
    schedule: BudgetSchedule,
    correct: Sequence[bool] | torch.Tensor | None = None,
    quantile: float = 0.05,
    noise_z: float = 2.0,
) -> StepReport:
    """The :class:`StepReport` of one RL step whose rollouts are all in one place (one rank).

    Args:
        step: RL step index.
        samples: the step's rollouts (all groups), generated under ``schedule``.
        mismatch: per-token alpha [N] and cached_len [N] of those samples' response tokens
            (``sparrow_nemo.rollout.scoring.measure_mismatch`` or the policy's dense top-K scores).
        rewards: [S] sequence rewards, one per sample. correct: optional [S] booleans (-> accuracy).
        schedule: the schedule the rollouts were generated with.
        quantile, noise_z: the tail level and its bounds' standard errors (the tail scheduler's).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.shape != (len(samples),):
        raise ValueError(f"build_step_report: rewards {tuple(rewards.shape)} for {len(samples)} samples")
    tokens = sum(s.response_ids.numel() for s in samples)
    if mismatch.alpha.shape != (tokens,):
        raise ValueError(
            f"build_step_report: mismatch.alpha {tuple(mismatch.alpha.shape)} for {tokens} response tokens"
        )
    accuracy = None
    if correct is not None:
        correct = torch.as_tensor(correct, dtype=torch.float64)
        if correct.shape != (len(samples),):
            raise ValueError(f"build_step_report: correct {tuple(correct.shape)} for {len(samples)} samples")
        accuracy = float(correct.mean())
    return StepReport.from_tokens(
        step,
        mismatch.alpha,
        mismatch.cached_len,
        reward_mean=float(rewards.mean()),
        response_length_mean=tokens / len(samples),
        schedule=schedule,
        accuracy=accuracy,
        quantile=quantile,
        noise_z=noise_z,
    )
