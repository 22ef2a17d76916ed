"""The recipe's ``reward.options`` reach the reward function as keyword arguments, and bad ones are refused."""

from __future__ import annotations

import pytest

from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.rewards import bind_reward

HALF_RIGHT = "```python\ndef f(x):\n    return 1\n```"
SPEC = {"format": "asserts", "tests": ["assert f(1) == 1", "assert f(2) == 2"]}


def test_code_mode_option_overrides_the_spec(sandbox: None) -> None:
    assert bind_reward("code", {})(HALF_RIGHT, SPEC) == pytest.approx(0.5)
    assert bind_reward("code", {"mode": "all"})(HALF_RIGHT, SPEC) == 0.0


def test_an_option_the_reward_does_not_take_is_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"reward.options.mdoe: reward 'code' takes no option 'mdoe' \(accepted: mode, sandbox\)",
    ):
        bind_reward("code", {"mdoe": "all"})


def test_a_bad_option_value_is_refused_when_used(sandbox: None) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        bind_reward("code", {"mode": "most"})(HALF_RIGHT, SPEC)


def test_the_sandbox_option_is_checked_when_bound() -> None:
    with pytest.raises(ValueError, match=r"reward.options.sandbox must be one of \('os', 'unsafe_local'\)"):
        bind_reward("code", {"sandbox": "docker"})
    assert bind_reward("code", {"sandbox": "unsafe_local"})(HALF_RIGHT, SPEC) == pytest.approx(0.5)


def test_the_synthetic_task_refuses_options() -> None:
    config = load_config("tiny_cpu", ["++reward.options.mode=all"])
    with pytest.raises(ValueError, match="synthetic task's reward takes no options"):
        build_prompt_source(config)
