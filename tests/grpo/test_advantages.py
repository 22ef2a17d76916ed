"""GRPO / RLOO advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow_nemo.grpo.advantages import compute_advantages, get_advantage, register_advantage


def test_grpo_hand_computed() -> None:
    # group 1: [1, 0, 0, 1] mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> 0.
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    adv = compute_advantages("grpo", r, group_size=4, eps=0.0)
    s = 0.5 / math.sqrt(1.0 / 3.0)
    torch.testing.assert_close(adv, torch.tensor([s, -s, -s, s, 0.0, 0.0, 0.0, 0.0]), rtol=0, atol=1e-6)


def test_grpo_without_std_is_mean_centred() -> None:
    r = torch.tensor([2.0, 0.0, 1.0, 5.0, 5.0, 8.0])
    adv = compute_advantages("grpo", r, group_size=3, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, -1.0, -1.0, 2.0]))


def test_grpo_eps_and_int_rewards() -> None:
    adv = compute_advantages("grpo", torch.tensor([1, 0]), group_size=2, eps=1.0)
    # mean 0.5, unbiased std sqrt(0.5); divided by (std + 1)
    d = 1.0 + math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5 / d, -0.5 / d]))


def test_rloo_hand_computed() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = compute_advantages("rloo", r, group_size=4)
    # r_0 - mean(0, 0, 1) = 1 - 1/3
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_rloo_equals_scaled_centred_reward() -> None:
    r = torch.rand(5 * 8, dtype=torch.float64)
    g = r.view(5, 8)
    expected = (8 / 7) * (g - g.mean(dim=1, keepdim=True))
    torch.testing.assert_close(compute_advantages("rloo", r, group_size=8), expected.reshape(-1))


@pytest.mark.parametrize(
    ("name", "rewards", "group_size", "match"),
    [
        ("grpo", torch.zeros(7), 4, "multiple of group_size"),
        ("grpo", torch.zeros(2, 4), 4, "1-D"),
        ("rloo", torch.zeros(4), 1, "group_size must be >= 2"),
        ("grpo", torch.zeros(0), 2, "multiple"),
    ],
)
def test_bad_inputs_raise(name: str, rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_advantages(name, rewards, group_size)


def test_registry_errors() -> None:
    with pytest.raises(KeyError, match="known: grpo, rloo"):
        get_advantage("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r, n: r)
