"""Reward functions by name. Each is ``fn(completion: str, ground_truth) -> float`` in [0, 1].

Built-ins are imported lazily (the code sandbox and math_verify are only loaded when asked for):

- ``"math"``: :func:`sparrow_nemo.rewards.math.math_reward`, ground truth = the gold answer string;
- ``"code"``: :func:`sparrow_nemo.rewards.code.code_reward`, ground truth = a test spec dict;
- ``"chain"``: :func:`sparrow_nemo.tasks.chain.chain_reward`, ground truth = the answer string.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[str, Any], float]

_BUILTIN: dict[str, str] = {
    "math": "sparrow_nemo.rewards.math:math_reward",
    "code": "sparrow_nemo.rewards.code:code_reward",
    "chain": "sparrow_nemo.tasks.chain:chain_reward",
}
_REGISTERED: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under ``name`` (must not clash with a built-in)."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTERED or name in _BUILTIN:
            raise ValueError(f"reward '{name}' is already registered")
        _REGISTERED[name] = fn
        return fn

    return decorator


def reward_names() -> list[str]:
    """All known reward names, sorted."""
    return sorted({*_BUILTIN, *_REGISTERED})


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name``; a clear error lists the known names."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise KeyError(f"unknown reward '{name}'; known: {', '.join(reward_names())}")
    module, attr = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), attr)
