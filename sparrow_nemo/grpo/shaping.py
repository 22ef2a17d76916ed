"""DAPO's overlong reward shaping: a soft penalty for responses that run into the length cap.

DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13, "overlong
reward shaping") adds to the reward of a response of ``L`` tokens, with cap ``L_max`` (``rollout.max_new_tokens``)
and buffer ``L_buf`` (``grpo.overlong.buffer_tokens``)::

    0                                  if L <= L_max - L_buf
    (L_max - L_buf - L) / L_buf        if L_max - L_buf < L <= L_max   (from 0 down to -1)
    -1                                 if L > L_max

times ``penalty_factor`` (verl's ``overlong_buffer.penalty_factor``). Only the training reward is shaped; the
held-out evaluation scores answers alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, knob


@dataclass(frozen=True)
class OverlongConfig(Section):
    """The recipe's ``grpo.overlong`` section (off in every shipped recipe; the Qwen3 ones document it)."""

    enabled: bool = knob(False, "add DAPO's overlong penalty to the training reward (grpo/shaping.py)")
    buffer_tokens: int = knob(
        4096,
        "L_buf: the penalty ramps from 0 to -penalty_factor over the last this many tokens",
        check=AT_LEAST_ONE,
    )
    penalty_factor: float = knob(1.0, "the penalty at the length cap", check=NON_NEGATIVE)


def overlong_penalty(length: int, max_tokens: int, config: OverlongConfig) -> float:
    """The (<= 0) reward added to a response of ``length`` tokens under the cap ``max_tokens`` (module docstring)."""
    if not config.enabled:
        return 0.0
    start = max_tokens - config.buffer_tokens
    if length <= start:
        return 0.0
    if length > max_tokens:
        return -config.penalty_factor
    return (start - length) / config.buffer_tokens * config.penalty_factor
