"""Group-relative advantage estimators, in a small registry (verl style).

Rewards arrive flat, ``[num_prompts * group_size]`` float, grouped by prompt: rows ``i * group_size ..
(i + 1) * group_size - 1`` are the samples of prompt ``i``. Every estimator returns one advantage per
sample, the same shape and dtype as the rewards; the policy loss broadcasts it over that sample's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AdvantageFn = Callable[..., Tensor]

_ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn(rewards, group_size, **options) -> advantages`` under ``name``."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator '{name}' is already registered")
        _ADVANTAGES[name] = fn
        return fn

    return decorator


def advantage_names() -> list[str]:
    """Names of the registered advantage estimators, sorted."""
    return sorted(_ADVANTAGES)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; a clear error lists the known names."""
    if name not in _ADVANTAGES:
        raise KeyError(f"unknown advantage estimator '{name}'; known: {', '.join(sorted(_ADVANTAGES))}")
    return _ADVANTAGES[name]


def compute_advantages(name: str, rewards: Tensor, group_size: int, **options: object) -> Tensor:
    """Run the estimator ``name`` on ``rewards`` [num_prompts * group_size]; returns the same shape."""
    return get_advantage(name)(rewards, group_size, **options)


def _grouped(rewards: Tensor, group_size: int, min_group: int = 1) -> Tensor:
    """``rewards`` [N] viewed as [N // group_size, group_size] (float), after checking the shapes."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < min_group:
        raise ValueError(f"group_size must be >= {min_group}, got {group_size}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a positive multiple of group_size={group_size}"
        )
    if not torch.is_floating_point(rewards):
        rewards = rewards.float()
    return rewards.view(-1, group_size)


@register_advantage("grpo")
def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; without ``normalize_std`` just ``r - mean_group``.

    ``std`` is the unbiased (n - 1) sample standard deviation of the group, as in verl; a group of one
    sample has advantage 0. A group whose rewards are all equal gets advantage 0 (its std is 0).
    """
    g = _grouped(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = g.std(dim=1, keepdim=True)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1)


@register_advantage("rloo")
def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out (RLOO): ``r_i - mean_{j != i} r_j``, which equals ``n / (n - 1) * (r_i - mean)``."""
    g = _grouped(rewards, group_size, min_group=2)
    others_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others_mean).reshape(-1)
