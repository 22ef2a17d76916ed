"""Offline calibration pass: sparse rollouts at fixed budgets, scored dense, -> the calibrated schedule.

For each candidate budget the engine generates the calibration prompts with a fixed-budget schedule, the
same engine scores the full sequences densely (teacher-forced, no LoRA), and every response token's
acceptance rate is the union-of-top-K lower bound (``acceptance_rate_topk``) between the dense and the
sparse top-K at that position. ``sparrow_nemo.sparse.calibrate.calibrate_schedule`` then picks, per bin,
the smallest budget whose tail meets the threshold. Outputs go to ``run_dir`` (see
:mod:`sparrow_nemo.callbacks.calibration_report`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from sparrow_nemo.callbacks.calibration_report import write_calibration_outputs
from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    ScoredSequence,
)
from sparrow_nemo.sparse.calibrate import CalibrationResult, calibrate_schedule
from sparrow_nemo.sparse.mismatch import acceptance_rate_topk
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)


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


def run_calibration(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[int],
    sampling: SamplingParams,
    bin_tokens: int,
    threshold: float = 0.86,
    quantile: float = 0.05,
    page_size: int = 16,
    run_dir: str | Path | None = None,
    min_tokens: int = 1,
) -> CalibrationResult:
    """Calibrate a schedule on ``prompts`` (one sample each; repeat a prompt for several samples).

    Args:
        engine: the rollout engine (sparse generation and dense scoring).
        prompts: token ids per calibration sample.
        candidates: fixed budgets to try, tokens (multiples of ``page_size``).
        sampling: generation settings; its ``logprobs_topk`` (paper: 20) is K for both sides of alpha.
        bin_tokens: bin width of cached length, tokens. threshold, quantile: the tail requirement.
        page_size: tokens per KV page (must match the engine's).
        run_dir: where to write the table (JSON, CSV, text), the schedule YAML and the plot; None: nowhere.
        min_tokens: a (budget, bin) cell with fewer tokens counts as no data.

    Returns:
        The method layer's :class:`CalibrationResult` (schedule, per-budget per-bin tails and counts).
    """
    if not prompts:
        raise ValueError("run_calibration: no calibration prompts")
    budgets = sorted({int(c) for c in candidates})
    if not budgets:
        raise ValueError("run_calibration: no candidate budgets")
    samples: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for budget in budgets:
        schedule = BudgetSchedule(
            bin_tokens=bin_tokens, budgets=(budget,), page_size=page_size, name=f"fixed:{budget}"
        )
        batch = engine.generate(prompts, sampling, schedule)
        samples[budget] = rollout_alpha(engine, batch, sampling.logprobs_topk)
        logger.info(
            "calibration: budget %d tokens: %d response tokens, min alpha %.4f",
            budget,
            samples[budget][0].numel(),
            float(samples[budget][0].min()),
        )
    result = calibrate_schedule(
        samples,
        threshold=threshold,
        bin_tokens=bin_tokens,
        quantile=quantile,
        page_size=page_size,
        min_tokens=min_tokens,
        name=f"calibrated-{threshold:g}",
    )
    if result.unsatisfied_bins:
        logger.warning(
            "calibration: no candidate budget reaches %s >= %.3f in bins %s; those bins fall back to dense",
            f"p{100 * quantile:g}",
            threshold,
            list(result.unsatisfied_bins),
        )
    if run_dir is not None:
        write_calibration_outputs(result, Path(run_dir))
    return result
