"""Evaluate the current rollout policy on fixed held-out prompts: accuracy and rollout speed.

The n=1 case of :mod:`sparrow_nemo.evaluation.runner` (whose :func:`~sparrow_nemo.evaluation.runner.score_samples`
scores the samples), split over every engine of the run
(:meth:`~sparrow_nemo.grpo.process_model.RankPlan.eval_share`), which the runner (one engine) does not do: each
engine generates its contiguous part of the prompts, prompt ``i`` seeded ``sample_seed(sampling.seed, i)`` as on
one rank, and the counts of the ranks that lead an engine are summed (:meth:`EvalTally.reduce`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sparrow_nemo.config.schema import AT_LEAST_ONE, Section, knob
from sparrow_nemo.evaluation.runner import score_samples
from sparrow_nemo.grpo.process_model import reduce_max, reduce_sums
from sparrow_nemo.grpo.prompt_source import PromptItem, PromptSource
from sparrow_nemo.rollout.engine import RolloutEngine, SamplingParams
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.sparse.schedule import BudgetSchedule


@dataclass(frozen=True)
class EvaluationConfig(Section):
    """The held-out evaluation before and after training (the run summary's accuracy and speedup)."""

    num_prompts: int = knob(
        256,
        "held-out prompts, one sample each (data.val_path, or the synthetic task's held-out problems)",
        check=AT_LEAST_ONE,
        hashed=False,
    )
    speed_pairs: int = knob(
        1,
        "end of run: (sparse, dense) evaluation pairs whose pooled tokens/s give the measured speedup; pair 2 "
        "runs dense first (ABBA order), so a drift of the machine's speed falls on both schedules alike",
        check=AT_LEAST_ONE,
        hashed=False,
    )
    speculative: bool = knob(
        False,
        "end of run, rollout.mode=sparse with the torch engine (else ignored): the final schedule also decodes in the lossless "
        "speculative mode (sparse drafts, dense verifies) in every timing pair; the summary reports that speedup "
        "over dense beside the sparse one, on the same held-out prompts",
        hashed=False,
    )


def end_evaluation_order(pairs: int, speculative: bool = False) -> list[tuple[str, int]]:
    """The end-of-run evaluations as (``"end"`` sparse / ``"end_dense"`` / ``"end_speculative"`` with
    ``speculative``, pair) in the order they run: pair 0 sparse, dense (, speculative), pair 1 the reverse, and
    so on (ABBA)."""
    order = []
    for pair in range(pairs):
        arms = [("end", pair), ("end_dense", pair)] + ([("end_speculative", pair)] if speculative else [])
        order += arms if pair % 2 == 0 else arms[::-1]
    return order


@dataclass(frozen=True)
class EvalResult:
    """One sample per held-out prompt under one schedule.

    Attributes:
        accuracy: fraction of samples with reward 1. reward_mean: mean reward.
        response_length_mean: tokens. tokens_per_s: generated tokens per second of wall time (the slowest
            engine's). decode_tokens_per_s: the same over decode time only (the slowest engine's; prefill,
            dense under every schedule, left out). schedule: the schedule's name. prompts: how many prompts.
    """

    accuracy: float
    reward_mean: float
    response_length_mean: float
    tokens_per_s: float
    decode_tokens_per_s: float
    schedule: str
    prompts: int

    def to_dict(self) -> dict[str, float | str | int]:
        return asdict(self)


@dataclass(frozen=True)
class EvalTally:
    """One rank's part of an evaluation: sums over its prompts, its generation time and the decode part of
    it (seconds)."""

    prompts: int
    correct: int
    reward_sum: float
    tokens: int
    seconds: float
    decode_seconds: float
    schedule: str

    def reduce(self) -> EvalResult:
        """The :class:`EvalResult` over every rank's tally. Collective."""
        prompts, correct, reward_sum, tokens = reduce_sums(
            [self.prompts, self.correct, self.reward_sum, self.tokens]
        )
        seconds, decode_seconds = reduce_max([self.seconds, self.decode_seconds])
        if prompts == 0:
            raise ValueError("evaluate: no prompts")
        return EvalResult(
            accuracy=correct / prompts,
            reward_mean=reward_sum / prompts,
            response_length_mean=tokens / prompts,
            tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
            decode_tokens_per_s=tokens / decode_seconds if decode_seconds > 0 else float("nan"),
            schedule=self.schedule,
            prompts=int(prompts),
        )


def evaluate(
    engine: RolloutEngine,
    source: PromptSource,
    items: Sequence[PromptItem],
    indices: range,
    sampling: SamplingParams,
    schedule: BudgetSchedule,
    count: bool = True,
) -> EvalTally:
    """Generate one response for each of ``items[i]``, ``i`` in ``indices`` (this rank's engine's part), under
    ``schedule`` with ``sampling``; item ``i`` is seeded ``sample_seed(sampling.seed, i)`` (fixed: paired
    comparisons, the same samples on any layout). An empty part tallies nothing, and so does a rank that only
    takes part in a tensor-parallel engine's call (``count`` false: its leader counts)."""
    if not items:
        raise ValueError("evaluate: no prompts")
    if not indices:
        return EvalTally(0, 0, 0.0, 0, 0.0, 0.0, schedule.name)
    mine = [items[i] for i in indices]
    seeds = [sample_seed(sampling.seed, i) for i in indices]
    start = time.perf_counter()
    batch = engine.generate([i.prompt_ids for i in mine], sampling, schedule, sample_seeds=seeds)
    seconds = time.perf_counter() - start
    if not count:
        return EvalTally(0, 0, 0.0, 0, seconds, batch.decode_s, schedule.name)
    results = score_samples(batch, [i.answer for i in mine], source.reward, n=1, ks=[1])
    return EvalTally(
        prompts=len(mine),
        correct=sum(r.correct for r in results),
        reward_sum=float(sum(r.rewards[0] for r in results)),
        tokens=batch.num_response_tokens,
        seconds=seconds,
        decode_seconds=batch.decode_s,
        schedule=schedule.name,
    )
