"""Rollout generation: the :class:`RolloutEngine` interface and the plain-torch reference engine
(Qwen3 with a paged KV cache and Sparrow sparse decode attention)."""

from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    ScoredSequence,
)
from sparrow_nemo.rollout.qwen3_torch import Qwen3Decoder
from sparrow_nemo.rollout.reference import ReferenceRolloutEngine

__all__ = [
    "Qwen3Decoder",
    "ReferenceRolloutEngine",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "SamplingParams",
    "ScoredSequence",
]
