"""Rollout modes for training (``rollout.mode``): sparse (the engine as it is), dense, or speculative.

:class:`RolloutModeEngine` wraps a rollout engine so that every ``generate`` follows the mode, whoever calls it
(the step's rollout, the evaluations, the OOM retry):

- ``dense``: every call decodes with the dense schedule (the given schedule's bins and pages);
- ``speculative``: a call with a sparse schedule decodes losslessly with sparse drafts and dense verifies, the
  draft's budget and k per bin taken from a :class:`DraftPlanner` (the controller's
  :class:`~sparrow_nemo.control.speculative.SpeculativePlanner`); a dense schedule (the dense evaluations)
  decodes densely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sparrow_nemo.rollout.engine import (
    EngineWrapper,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    TokenProgress,
)
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.sparse.schedule import BudgetSchedule

MODES = ("sparse", "speculative", "dense")


class DraftPlanner(Protocol):
    """What a speculative rollout asks of its planner: the draft (budget, k per bin) for a schedule."""

    def config_for(self, schedule: BudgetSchedule) -> SpeculativeConfig:
        """What ``generate`` gets when called with ``schedule`` (the run's current sparse schedule)."""
        ...


class RolloutModeEngine(EngineWrapper):
    """:class:`~sparrow_nemo.rollout.engine.RolloutEngine` around ``engine`` whose ``generate`` follows ``mode``
    (see the module docstring); every other attribute is the wrapped engine's.

    Args:
        engine: a rollout engine whose ``generate`` takes ``speculative=`` (the torch engine).
        mode: "dense" or "speculative". planner: required for "speculative".
    """

    def __init__(self, engine: RolloutEngine, mode: str, planner: DraftPlanner | None = None) -> None:
        if mode not in ("dense", "speculative"):
            raise ValueError(f"RolloutModeEngine: mode must be 'dense' or 'speculative', got '{mode}'")
        if mode == "speculative" and planner is None:
            raise ValueError("RolloutModeEngine: mode 'speculative' needs a draft planner")
        super().__init__(engine)
        self.mode = mode
        self.planner = planner

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        *,
        sample_seeds: Sequence[int] | None = None,
        on_tokens: TokenProgress | None = None,
    ) -> RolloutBatch:
        """The wrapped engine's ``generate`` in this mode (dense schedule, or speculative with the plan)."""
        kwargs: dict[str, Any] = {"sample_seeds": sample_seeds, "on_tokens": on_tokens}
        if self.mode == "dense" or schedule.is_dense:
            return self.engine.generate(prompts, sampling, _dense(schedule), **kwargs)
        return self.engine.generate(
            prompts, sampling, schedule, speculative=self.planner.config_for(schedule), **kwargs
        )


def _dense(schedule: BudgetSchedule) -> BudgetSchedule:
    return schedule if schedule.is_dense else BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)


def with_rollout_mode(mode: str, engine: RolloutEngine, planner: DraftPlanner | None = None) -> RolloutEngine:
    """``engine`` as ``rollout.mode`` wants it: itself for sparse, else a :class:`RolloutModeEngine` (speculative:
    drafting with ``planner``)."""
    if mode not in MODES:
        raise ValueError(f"rollout.mode: expected one of {', '.join(MODES)}, got '{mode}'")
    return engine if mode == "sparse" else RolloutModeEngine(engine, mode, planner)
