"""Progress bars of long work (rate and ETA): the RL steps, a rollout's tokens, the warm-start's steps."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def progress(iterable: Iterable | None = None, *, enabled: bool, **kwargs: Any):
    """A tqdm bar (rate and ETA) when ``enabled``, else a silent one with the same interface."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kwargs)


def rollout_progress(num_samples: int, max_new_tokens: int, enabled: bool):
    """A tokens bar for one rollout (``update`` is the engine's ``on_tokens``); closes with ``with``.

    Its total is the length cap (``num_samples x max_new_tokens``), so the ETA is an upper bound and
    the bar ends short of 100 % when responses stop early.
    """
    return progress(
        total=num_samples * max_new_tokens, enabled=enabled, desc="rollout", unit="tok", leave=False
    )
