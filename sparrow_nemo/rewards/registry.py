"""Reward functions by name. Each is ``fn(completion: str, ground_truth, **options) -> float`` in [0, 1].

``reward.options`` from the recipe are bound as keyword arguments by :func:`bind_reward`, which refuses an
option the function does not take (e.g. ``++reward.options.mode=all`` for code, ``timeout_s`` for math).

This package's rewards are imported lazily (the code sandbox and math_verify are only loaded when asked
for); other packages register theirs when imported (``register_reward``), so this registry imports none:

- ``"math"``: :func:`sparrow_nemo.rewards.math.math_reward`, ground truth = the gold answer string;
- ``"code"``: :func:`sparrow_nemo.rewards.code.code_reward`, ground truth = a test spec dict;
- ``"chain"``: :func:`sparrow_nemo.tasks.chain.chain_reward` (registered by :mod:`sparrow_nemo.tasks.chain`),
  ground truth = the answer string. The recipe's ``reward.type: chain`` is the embedded synthetic task: its
  prompts come from the task, not from ``data.train_path``.

The recipe's ``reward`` section is :class:`RewardConfig`; ``reward.type`` is any of :func:`reward_names`.
The trainer and the evaluation call a reward through :func:`guarded_reward`: a completion that makes it raise
is that sample's 0, never the end of the run.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparrow_nemo.config.schema import Section, knob, one_of_names

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Any], float]

_BUILTIN: dict[str, str] = {
    "math": "sparrow_nemo.rewards.math:math_reward",
    "code": "sparrow_nemo.rewards.code:code_reward",
}
#: start-up checks of built-ins, ``fn(options)``: they raise before a run starts, not at its first reward
_PREFLIGHT: dict[str, str] = {"code": "sparrow_nemo.rewards.code:check_sandbox"}
_REGISTERED: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under ``name`` (must not clash with a built-in)."""

    def decorator(fn: RewardFn) -> RewardFn:
        if _REGISTERED.get(name) is fn:  # the same function again (a module imported twice)
            return fn
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


def guarded_reward(reward: Callable[[Any, Any], float], response: Any, answer: Any) -> float | None:
    """``reward(response, answer)`` as a float; None (logged) when it raised or is not finite. Any completion
    reaches a reward: its failure on one is that sample's alone."""
    try:
        value = float(reward(response, answer))
    except Exception as exc:
        logger.warning("reward raised %s: %s; the sample scores 0", type(exc).__name__, str(exc)[:300])
        return None
    if not math.isfinite(value):
        logger.warning("reward returned %s; the sample scores 0", value)
        return None
    return value


def bind_reward(name: str, options: dict[str, Any]) -> RewardFn:
    """:func:`get_reward` with ``options`` bound as keyword arguments (the recipe's ``reward.options``).

    Raises:
        ValueError: an option the reward function does not accept (names it and the accepted ones), or a
            failed start-up check of the reward (e.g. the code reward's sandbox cannot be had here).
    """
    fn = get_reward(name)
    if name in _PREFLIGHT and name not in _REGISTERED:
        module, attr = _PREFLIGHT[name].split(":")
        getattr(importlib.import_module(module), attr)(options)
    if not options:
        return fn
    params = list(inspect.signature(fn).parameters.values())[2:]  # after (completion, ground_truth)
    accepted = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for key in options:
        if key not in accepted:
            raise ValueError(
                f"reward.options.{key}: reward '{name}' takes no option '{key}' "
                f"(accepted: {', '.join(accepted) or 'none'})"
            )
    return functools.partial(fn, **options)


@dataclass(frozen=True)
class RewardConfig(Section):
    """The verifiable reward: the recipe's ``reward`` section."""

    type: str = knob(
        "chain",
        "registered reward (reward_names()): chain (the embedded synthetic task, which makes its own prompts), "
        "math (answer verification), code (sandboxed tests), or a register_reward name",
        check=one_of_names(reward_names, renamed={"synthetic": "chain"}),
    )
    options: dict[str, Any] = knob(
        doc="keyword options bound to the reward function (free-form; add keys with ++reward.options.key=value)",
        factory=dict,
    )
    by_data_source: dict[str, str] = knob(
        doc="data_source value (data.data_source_key, verl's) -> registered reward name for its rows; rows of "
        "other sources use reward.type. reward.options go to reward.type's function only",
        factory=dict,
    )

    def check(self) -> None:
        known = reward_names()
        for source, name in self.by_data_source.items():
            if name not in known or name == "chain":
                raise self.invalid(
                    f"by_data_source.{source}",
                    f"a file-data reward name ({', '.join(n for n in known if n != 'chain')})",
                )
