"""Measure what a DistillSparse adapter does to the sparse rollout: the same fresh rollouts with and without it.

:func:`distill_rounds` trains the adapter as the trainer's steps would, with the policy held fixed: per
round, sparse rollouts of the next training prompts (with the adapter), their rewards and group advantages
(the trainer's own rollout and reward phases), then :meth:`DistillSparse.train_adapter` (sparse PG + k3 KL).
It isolates the adapter's effect from the policy's own RL updates.

:func:`adapter_effect` generates the same prompts with the same per-sample seeds twice under one schedule,
once with the adapter in the engine and once without (the base weights), scores both densely (no LoRA)
and reports per setting the tail of the acceptance rate per bin of cached length, its mean and the mean
k3 KL(sparse || dense) on the sampled tokens (:class:`SparseTail`). The engine keeps the adapter afterwards.

:func:`calibrated_speedups` calibrates a schedule with and without the adapter (the smallest candidate
budget per bin whose tail meets the threshold) and prices both with the decode cost model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from sparrow_nemo.control.calibration import run_calibration
from sparrow_nemo.grpo.distill import DistillData, DistillSparse
from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.rollout.engine import RolloutEngine, SamplingParams
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.scoring import measure_mismatch
from sparrow_nemo.sparse.calibration import CalibrationResult
from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.mismatch import tail_by_bin
from sparrow_nemo.sparse.schedule import BudgetSchedule


def distill_rounds(trainer: Any, phase: DistillSparse, schedule: BudgetSchedule, rounds: int) -> list[float]:
    """``rounds`` adapter rounds on fresh training rollouts under ``schedule``; returns each round's last loss.

    ``trainer`` is a one-rank :class:`~sparrow_nemo.grpo.trainer.GrpoTrainer`: each round draws the next
    ``grpo.prompts_per_step`` prompts and generates and scores them as its step does
    (:func:`~sparrow_nemo.grpo.step_batch.generate`, :func:`~sparrow_nemo.grpo.step_batch.score`), seeds from
    ``rollout.seed`` and the round; ``phase`` must have been started (``phase.start``).
    """
    from sparrow_nemo.grpo.step_batch import generate

    losses = []
    for r in range(rounds):
        items = trainer.prompts.next_batch(trainer.config.grpo.prompts_per_step)
        sampling = replace(trainer.sampling, seed=sample_seed(trainer.config.rollout.seed, 1_000_000 + r))
        local = generate(
            trainer.rollout_engine,
            trainer.plan,
            [i.prompt_ids for i in items],
            trainer.config.grpo.samples_per_prompt,
            sampling,
            schedule,
        )
        trainer.score_rollout(local, items)
        data = DistillData.from_samples(local.samples, local.advantages)
        losses.append(phase.train_adapter(trainer.policy, trainer.rollout_engine, data)[-1].loss)
    return losses


@dataclass(frozen=True)
class SparseTail:
    """Acceptance-rate statistics of one batch of sparse rollouts scored dense.

    Attributes:
        tail: {bin: quantile of alpha} for bins with >= ``min_tokens`` response tokens.
        tokens: {bin: response tokens} for every bin with data.
        mean_alpha: mean acceptance rate over all response tokens.
        mean_k3: mean k3 estimate of KL(sparse || dense) over the sampled tokens (nats/token).
        mean_length: mean response length, tokens.
        response_lengths, prompt_lengths: per sample, tokens (for the cost model).
    """

    tail: dict[int, float]
    tokens: dict[int, int]
    mean_alpha: float
    mean_k3: float
    mean_length: float
    response_lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "tail": {str(b): v for b, v in self.tail.items()},
            "tokens": {str(b): n for b, n in self.tokens.items()},
            "mean_alpha": self.mean_alpha,
            "mean_k3": self.mean_k3,
            "mean_length": self.mean_length,
        }


def sparse_tail(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    schedule: BudgetSchedule,
    seed: int,
    quantile: float = 0.05,
    min_tokens: int = 1,
) -> SparseTail:
    """Generate ``prompts`` (sample i seeded by ``sample_seed(seed, i)``) under ``schedule``; score dense."""
    if not prompts:
        raise ValueError("sparse_tail: no prompts")
    seeds = [sample_seed(seed, i) for i in range(len(prompts))]
    batch = engine.generate([list(p) for p in prompts], sampling, schedule, sample_seeds=seeds)
    m = measure_mismatch(engine, batch)
    bins = m.cached_len // schedule.bin_tokens
    counts = {int(b): int(n) for b, n in enumerate(torch.bincount(bins).tolist()) if n}
    tails = tail_by_bin(m.alpha, m.cached_len, schedule.bin_tokens, quantile)
    log_r = m.train_logprobs.float() - m.gen_logprobs.float()
    k3 = torch.exp(log_r) - 1.0 - log_r
    empty = m.alpha.numel() == 0
    return SparseTail(
        tail={b: v for b, v in tails.items() if counts.get(b, 0) >= min_tokens},
        tokens=counts,
        mean_alpha=math.nan if empty else float(m.alpha.mean()),
        mean_k3=math.nan if empty else float(k3.mean()),
        mean_length=sum(s.response_ids.numel() for s in batch.samples) / len(batch.samples),
        response_lengths=tuple(s.response_ids.numel() for s in batch.samples),
        prompt_lengths=tuple(s.prompt_ids.numel() for s in batch.samples),
    )


def adapter_effect(
    engine: RolloutEngine,
    adapter: LoraAdapter,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    schedule: BudgetSchedule,
    seed: int,
    quantile: float = 0.05,
    min_tokens: int = 1,
) -> dict[str, SparseTail]:
    """``{"without": ..., "with": ...}``: :func:`sparse_tail` of the same prompts and seeds without and with
    ``adapter``; the engine holds ``adapter`` afterwards."""
    engine.set_lora(None)
    try:
        without = sparse_tail(engine, prompts, sampling, schedule, seed, quantile, min_tokens)
    finally:
        engine.set_lora(adapter)
    return {
        "without": without,
        "with": sparse_tail(engine, prompts, sampling, schedule, seed, quantile, min_tokens),
    }


@dataclass(frozen=True)
class CalibratedSpeedup:
    """A calibrated schedule and the decode cost model's predicted rollout speedup over dense.

    Attributes:
        result: the calibration (schedule, tails per budget and bin).
        speedup: dense / sparse predicted rollout time at the given response lengths.
    """

    result: CalibrationResult
    speedup: float


def calibrated_speedups(
    engine: RolloutEngine,
    adapter: LoraAdapter,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    candidates: Sequence[int],
    bin_tokens: int,
    page_size: int,
    cost_model: DecodeCostModel,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    threshold: float = 0.86,
    quantile: float = 0.05,
    min_tokens: int = 1,
) -> dict[str, CalibratedSpeedup]:
    """``{"without": ..., "with": ...}``: the schedule calibrated on ``prompts`` without and with ``adapter``
    and its predicted speedup on ``lengths`` / ``prompt_lens`` (the same for both); the engine holds
    ``adapter`` afterwards."""
    out = {}
    for tag, lora in (("without", None), ("with", adapter)):
        engine.set_lora(lora)
        result = run_calibration(
            engine,
            prompts,
            candidates,
            sampling,
            bin_tokens,
            threshold=threshold,
            quantile=quantile,
            page_size=page_size,
            min_tokens=min_tokens,
        )
        speedup = cost_model.predicted_speedup(result.schedule, list(lengths), list(prompt_lens))
        out[tag] = CalibratedSpeedup(result, speedup)
    engine.set_lora(adapter)
    return out


def measure_adapter(
    trainer: Any,
    adapter: LoraAdapter,
    prompts: Sequence[Sequence[int]],
    schedule: BudgetSchedule,
    seed: int,
    min_tokens: int = 1,
) -> tuple[dict[str, SparseTail], dict[str, CalibratedSpeedup]]:
    """:func:`adapter_effect` and :func:`calibrated_speedups` on ``prompts`` with the trainer's engine and recipe.

    ``min_tokens`` applies to the tails under ``schedule``; the calibration uses ``sparsity.min_bin_tokens``.
    The calibrated schedules are priced on the undistilled rollouts' lengths (the same for both), so only the
    budgets differ. Returns ``(effect, calibrated)``, each keyed ``"without"`` / ``"with"``.
    """
    s = trainer.config.sparsity
    engine = trainer.rollout_engine
    effect = adapter_effect(
        engine, adapter, prompts, trainer.sampling, schedule, seed, s.quantile, min_tokens
    )
    undistilled = effect["without"]
    calibrated = calibrated_speedups(
        engine,
        adapter,
        prompts,
        trainer.sampling,
        trainer.config.control.calibration.candidate_budgets,
        s.bin_tokens,
        s.page_size,
        trainer.cost_model,
        undistilled.response_lengths,
        undistilled.prompt_lengths,
        threshold=s.threshold,
        quantile=s.quantile,
        min_tokens=s.min_bin_tokens,
    )
    return effect, calibrated
