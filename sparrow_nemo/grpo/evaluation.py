"""Evaluate the current rollout policy on fixed held-out prompts: accuracy and rollout speed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sparrow_nemo.config.schema import AT_LEAST_ONE, Section, knob
from sparrow_nemo.grpo.prompt_source import PromptItem, PromptSource
from sparrow_nemo.rollout.engine import RolloutEngine, SamplingParams
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


@dataclass(frozen=True)
class EvalResult:
    """One sample per held-out prompt under one schedule.

    Attributes:
        accuracy: fraction of samples with reward 1. reward_mean: mean reward.
        response_length_mean: tokens. tokens_per_s: generated tokens per second of wall time.
        schedule: the schedule's name. prompts: how many prompts.
    """

    accuracy: float
    reward_mean: float
    response_length_mean: float
    tokens_per_s: float
    schedule: str
    prompts: int

    def to_dict(self) -> dict[str, float | str | int]:
        return asdict(self)


def evaluate(
    engine: RolloutEngine,
    source: PromptSource,
    items: Sequence[PromptItem],
    sampling: SamplingParams,
    schedule: BudgetSchedule,
) -> EvalResult:
    """Generate one response per item under ``schedule`` with ``sampling`` (fixed seed: paired comparisons)."""
    if not items:
        raise ValueError("evaluate: no prompts")
    batch = engine.generate([i.prompt_ids for i in items], sampling, schedule)
    rewards = [source.reward(s.response_ids.tolist(), i.answer) for s, i in zip(batch.samples, items)]
    return EvalResult(
        accuracy=sum(r >= 1.0 for r in rewards) / len(rewards),
        reward_mean=sum(rewards) / len(rewards),
        response_length_mean=batch.num_response_tokens / len(items),
        tokens_per_s=batch.tokens_per_second(),
        schedule=schedule.name,
        prompts=len(items),
    )
