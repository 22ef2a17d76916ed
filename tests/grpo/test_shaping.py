"""DAPO's overlong reward shaping against its formula (eq. 13), and where it applies (training only)."""

from __future__ import annotations

import pytest

from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.shaping import OverlongConfig, overlong_penalty

ON = OverlongConfig(enabled=True, buffer_tokens=100, penalty_factor=0.5)


@pytest.mark.parametrize(
    ("length", "penalty"),
    [(0, 0.0), (900, 0.0), (901, -0.5 * 1 / 100), (950, -0.5 * 50 / 100), (1000, -0.5), (1001, -0.5)],
)
def test_overlong_penalty_hand_computed(length: int, penalty: float) -> None:
    assert overlong_penalty(length, 1000, ON) == pytest.approx(penalty)
    assert overlong_penalty(length, 1000, OverlongConfig()) == 0.0  # off by default


def test_only_the_training_reward_is_shaped() -> None:
    config = load_config(
        "tiny_cpu_short_smoke", ["grpo.overlong.enabled=true", "grpo.overlong.buffer_tokens=16"]
    )
    assert config.rollout.max_new_tokens == 64
    source = build_prompt_source(config)
    item = source.peek(1)[0]
    ids = source.tokenizer.encode("x" * 60)
    assert source.train_reward(ids, item.answer) == pytest.approx(source.reward(ids, item.answer) - 12 / 16)
    short = source.tokenizer.encode("x" * 40)
    assert source.train_reward(short, item.answer) == source.reward(short, item.answer)
    assert not load_config("tiny_cpu_short_smoke").grpo.overlong.enabled
