"""From a step's rollouts to what callbacks see: per-token acceptance rates and the :class:`StepReport`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparrow_nemo.callbacks.base import StepReport
from sparrow_nemo.rollout.engine import RolloutBatch, RolloutEngine, RolloutSample, ScoredSequence
from sparrow_nemo.sparse.mismatch import acceptance_rate_topk
from sparrow_nemo.sparse.schedule import BudgetSchedule


def alpha_from_scores(
    samples: Sequence[RolloutSample], scores: Sequence[ScoredSequence]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token acceptance rate of sparse rollouts against dense teacher-forced scores of the same sequences.

    Response token j of a sample with prompt length Lp sits at sequence position Lp + j, so its dense
    distribution is score entry Lp + j - 1 (entry t predicts token t + 1).

    Args:
        samples: the rollouts, each with its top-K (ids, logprobs) and cached length per response token.
        scores: dense scores of ``prompt + response`` of each sample, same order (any source: the rollout
            engine's ``score`` or the policy's top-K logprobs).

    Returns:
        (alpha [N] float32 in [0, 1], cached_len [N] int64) over all response tokens of all samples.
    """
    if len(samples) != len(scores):
        raise ValueError(f"alpha_from_scores: {len(samples)} samples but {len(scores)} scored sequences")
    if not samples:
        raise ValueError("alpha_from_scores: no samples")
    alphas, lens = [], []
    for index, (sample, scored) in enumerate(zip(samples, scores)):
        start, length = sample.prompt_ids.numel() - 1, sample.response_ids.numel()
        dense_ids = scored.top_ids[start : start + length]
        if dense_ids.shape[0] != length:
            raise ValueError(
                f"alpha_from_scores: sample {index}: dense scores cover {dense_ids.shape[0]} of {length} "
                "response tokens"
            )
        dense_lp = scored.top_logprobs[start : start + length]
        alphas.append(acceptance_rate_topk(dense_ids, dense_lp, sample.top_ids, sample.top_logprobs).float())
        lens.append(sample.cached_len.to(torch.int64))
    return torch.cat(alphas), torch.cat(lens)


def rollout_alpha(engine: RolloutEngine, batch: RolloutBatch, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alpha_from_scores` with the engine's own dense scores (``engine.score``, top-``topk``)."""
    sequences = [torch.cat([s.prompt_ids, s.response_ids]).tolist() for s in batch.samples]
    return alpha_from_scores(batch.samples, engine.score(sequences, topk=topk))


def build_step_report(
    step: int,
    samples: Sequence[RolloutSample],
    scores: Sequence[ScoredSequence],
    rewards: Sequence[float] | torch.Tensor,
    schedule: BudgetSchedule,
    correct: Sequence[bool] | torch.Tensor | None = None,
) -> StepReport:
    """The :class:`StepReport` of one RL step.

    Args:
        step: RL step index.
        samples: the step's rollouts (all groups, in any order), generated under ``schedule``.
        scores: dense teacher-forced scores of each sample's ``prompt + response``, same order.
        rewards: [S] sequence rewards, same order. correct: optional [S] booleans (accuracy).
        schedule: the schedule the rollouts were generated with.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.shape != (len(samples),):
        raise ValueError(f"build_step_report: rewards {tuple(rewards.shape)} for {len(samples)} samples")
    alpha, cached_len = alpha_from_scores(samples, scores)
    accuracy = None
    if correct is not None:
        correct = torch.as_tensor(correct, dtype=torch.float64)
        if correct.shape != (len(samples),):
            raise ValueError(f"build_step_report: correct {tuple(correct.shape)} for {len(samples)} samples")
        accuracy = float(correct.mean())
    return StepReport(
        step=step,
        alpha=alpha,
        cached_len=cached_len,
        reward_mean=float(rewards.mean()),
        response_length_mean=sum(s.response_ids.numel() for s in samples) / len(samples),
        schedule=schedule,
        accuracy=accuracy,
    )
