"""Rollout generation: the :class:`RolloutEngine` interface and the plain-torch rollout engine
(Qwen3 with a paged KV cache and Sparrow sparse decode attention)."""

from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    ScoredSequence,
)
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder

__all__ = [
    "Qwen3Decoder",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "SamplingParams",
    "ScoredSequence",
    "TorchRolloutEngine",
]
