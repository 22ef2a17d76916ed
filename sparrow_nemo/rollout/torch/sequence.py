"""One request of a generate call as the scheduler sees it: its prompt, its response so far, its KV pages.

Pure Python (no tensors): the engine's scheduler and its dry mode (:mod:`sparrow_nemo.rollout.torch.dry_run`)
share it. Token accounting, with ``P`` prompt tokens and ``n`` response tokens sampled so far:

- the cache holds ``P + n - 1`` tokens while the sequence decodes (the last sampled token is *pending*: it
  enters the cache at the next decode step, whose output is the next token); before the first token is
  sampled it holds the ``P`` prompt tokens (``n = 0``);
- response token ``i`` was sampled with ``P + i`` tokens cached (``RolloutSample.cached_len``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    """Where a sequence is: queued for admission, decoding, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's scheduling state.

    Attributes:
        index: the sample's index in its generate call (the order results come back in).
        prompt_id: which distinct prompt it repeats (GRPO groups share one; their prefix pages are shared).
        prompt_len: ``P`` prompt tokens.
        max_new: the response cap in tokens.
        seed: its sampling seed (:func:`sparrow_nemo.rollout.sampling.sample_seed`).
        response: token ids sampled so far (``n`` of them).
        pages: physical KV pages in logical order (shared prompt pages first).
        cached: tokens whose keys and values are in ``pages``.
        status: see :class:`Status`.
        admitted_at: admission counter of its last admission (the most recent one is preempted first).
        preemptions: times it lost its pages and went back to the queue.
        slot: its row of the engine's block table while running (-1 otherwise).
    """

    index: int
    prompt_id: int
    prompt_len: int
    max_new: int
    seed: int = 0
    response: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    status: Status = Status.WAITING
    admitted_at: int = -1
    preemptions: int = 0
    slot: int = -1

    @property
    def num_generated(self) -> int:
        """``n``: response tokens sampled so far."""
        return len(self.response)

    @property
    def target_cached(self) -> int:
        """Tokens the cache must hold before this sequence can take its next step: the prompt before its first
        token, then every sampled token but the pending one (``P + max(n - 1, 0)``)."""
        return self.prompt_len + max(self.num_generated - 1, 0)

    @property
    def remaining(self) -> int:
        """Response tokens it may still sample (its cap minus ``n``)."""
        return self.max_new - self.num_generated
