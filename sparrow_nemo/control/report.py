"""What the controller (and user callbacks) see of one RL step: the :class:`StepReport`, and
:func:`build_step_report` from a step's rollouts held on one rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparrow_nemo.control.tail_stats import BinTail, bin_tails
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.sparse.schedule import BudgetSchedule


@dataclass(frozen=True)
class StepReport:
    """What one RL step's rollouts looked like, as the controller and the callbacks see it (the same on every rank).

    Attributes:
        step: the RL step (0-based) these rollouts belong to.
        schedule: the budget schedule the rollouts were generated with.
        tails: the per-token acceptance rate's tail per bin of cached length over all of the step's response
            tokens (every rank's; :func:`~sparrow_nemo.control.tail_stats.merged_bin_tails`), ascending by
            bin, bins of ``schedule.bin_tokens`` tokens; only bins that hold tokens.
        quantile: the tail level of ``tails`` (0.05 = p5). noise_z: standard errors of their bounds.
        reward_mean: mean sequence reward over the step's samples.
        response_length_mean: mean response length over the step's samples, tokens.
        accuracy: fraction of samples judged correct, when the reward has that notion.
    """

    step: int
    schedule: BudgetSchedule
    tails: tuple[BinTail, ...]
    quantile: float
    noise_z: float
    reward_mean: float
    response_length_mean: float
    accuracy: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tails", tuple(self.tails))
        bins = [t.bin for t in self.tails]
        if bins != sorted(set(bins)):
            raise ValueError(f"StepReport.tails: expected ascending distinct bins, got {bins}")
        for t in self.tails:
            if not all(math.isfinite(v) for v in (t.value, t.lcb, t.ucb)) or t.tokens <= 0:
                raise ValueError(f"StepReport.tails: bin {t.bin} has a non-finite value or no tokens ({t})")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"StepReport.quantile: expected a level in (0, 1), got {self.quantile}")
        for name in ("reward_mean", "response_length_mean"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"StepReport.{name}: expected a finite number, got {getattr(self, name)}")

    @classmethod
    def from_tokens(
        cls,
        step: int,
        alpha: torch.Tensor,
        cached_len: torch.Tensor,
        reward_mean: float,
        response_length_mean: float,
        schedule: BudgetSchedule,
        accuracy: float | None = None,
        quantile: float = 0.05,
        noise_z: float = 2.0,
    ) -> StepReport:
        """The report of per-token acceptance rates ``alpha`` [N] (floating) and their integer ``cached_len``
        [N] held in one place (one rank; tests, calibration tools)."""
        if alpha.ndim != 1 or not alpha.is_floating_point():
            raise ValueError(
                f"StepReport.from_tokens: alpha must be a 1-D floating tensor [N], got {tuple(alpha.shape)} "
                f"{alpha.dtype}"
            )
        if cached_len.shape != alpha.shape or cached_len.is_floating_point():
            raise ValueError(
                f"StepReport.from_tokens: cached_len must be an integer tensor shaped like alpha "
                f"{tuple(alpha.shape)}, got {tuple(cached_len.shape)} {cached_len.dtype}"
            )
        if alpha.numel() and not bool(torch.isfinite(alpha).all()):
            raise ValueError("StepReport.from_tokens: alpha contains NaN or inf")
        tails = bin_tails(alpha, cached_len, schedule.bin_tokens, quantile, noise_z) if alpha.numel() else []
        return cls(
            step, schedule, tuple(tails), quantile, noise_z, reward_mean, response_length_mean, accuracy
        )


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
