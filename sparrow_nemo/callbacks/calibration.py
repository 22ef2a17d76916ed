"""Offline calibration pass: sparse rollouts at fixed budgets, scored dense, -> the calibrated schedule.

For each candidate budget the engine generates the calibration prompts with a fixed-budget schedule, the
same engine scores the full sequences densely (teacher-forced, no LoRA), and every response token's
acceptance rate is the union-of-top-K lower bound between the dense and the sparse top-K at that position
(``sparrow_nemo.rollout.scoring.measure_mismatch``). The method layer's ``calibrate_schedule``
then picks, per bin, the smallest budget whose tail meets the threshold. Outputs go to ``run_dir`` (see
:mod:`sparrow_nemo.callbacks.calibration_report`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from sparrow_nemo.callbacks.calibration_report import write_calibration_outputs
from sparrow_nemo.rollout.engine import RolloutEngine, SamplingParams
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.sparse.calibrate import CalibrationResult, calibrate_schedule
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)


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
        mismatch = measure_mismatch(engine, batch)
        samples[budget] = (mismatch.alpha, mismatch.cached_len)
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
