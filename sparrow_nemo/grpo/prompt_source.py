"""The prompt stream the trainer reads: training prompts with a checkpointable cursor, a held-out set, the reward.

:class:`PromptSource` knows no recipe (:func:`sparrow_nemo.grpo.prompts.build_prompt_source` builds one
from a recipe). The held-out set (:meth:`PromptSource.eval_batch`: the evaluation before and after
training, the calibration prompts) never overlaps the training stream: the synthetic task draws it from
problem indices the stream never reaches (:data:`EVAL_OFFSET`), a prompt file from ``data.val_path``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["EVAL_OFFSET", "WARMSTART_OFFSET", "HeldOut", "PromptItem", "PromptSource", "check_vocab"]

#: synthetic task: evaluation problems are indices EVAL_OFFSET .. WARMSTART_OFFSET - 1; the training
#: stream uses 0 .. EVAL_OFFSET - 1 (and stops with an error before reaching them).
EVAL_OFFSET = 5_000_000
#: synthetic task: warm-start problems are drawn from this index on.
WARMSTART_OFFSET = 10_000_000


@dataclass(frozen=True)
class PromptItem:
    """One prompt: ``prompt_ids`` (list of int, special tokens included) and the reward's ground truth."""

    prompt_ids: list[int]
    answer: Any


@dataclass(frozen=True)
class HeldOut:
    """The held-out prompts: ``items(i)`` for i in ``0 .. size - 1`` (``size`` None = endless)."""

    items: Callable[[int], PromptItem]
    size: int | None
    name: str


class PromptSource:
    """A cursor over the run's training prompts, the held-out prompts and the reward function.

    Args:
        items: indexable training prompts (``index -> PromptItem``); ``size`` None = endless (synthetic task).
        reward_fn: ``(completion text, answer) -> float`` in [0, 1].
        tokenizer: decodes responses (``decode(ids) -> str``).
        seed: shuffles the order of each epoch of a finite set (when ``shuffle``).
        warm_start_pairs: ``start -> iterator of (prompt, solution)`` texts, when the task has them.
        held_out: the held-out prompts (:meth:`eval_batch`); None = this source has none.
        length_penalty: ``response tokens -> reward added`` in :meth:`train_reward` (DAPO's overlong shaping,
            :mod:`sparrow_nemo.grpo.shaping`); None = none.
    """

    def __init__(
        self,
        items: Callable[[int], PromptItem],
        size: int | None,
        reward_fn: Callable[[str, Any], float],
        tokenizer: Any,
        seed: int = 0,
        shuffle: bool = True,
        warm_start_pairs: Callable[[int], Iterator[tuple[str, str]]] | None = None,
        held_out: HeldOut | None = None,
        length_penalty: Callable[[int], float] | None = None,
    ) -> None:
        if size is not None and size <= 0:
            raise ValueError(f"PromptSource: the prompt set is empty (size={size})")
        self._items = items
        self.size = size
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.warm_start_pairs = warm_start_pairs
        self.held_out = held_out
        self.length_penalty = length_penalty
        self.cursor = 0

    def _index(self, position: int) -> int:
        """Item index of stream position ``position`` (a seeded permutation per epoch of a finite set)."""
        if self.size is None:
            return position
        epoch, offset = divmod(position, self.size)
        if not self.shuffle:
            return offset
        order = list(range(self.size))
        random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
        return order[offset]

    def peek(self, count: int, start: int = 0) -> list[PromptItem]:
        """Training items at stream positions ``start .. start + count - 1`` without moving the cursor."""
        return [self._items(self._index(p)) for p in range(start, start + count)]

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next ``count`` training prompts; advances the cursor."""
        batch = self.peek(count, self.cursor)
        self.cursor += count
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: ``cursor``, its ``epoch`` (0 for an endless source) and what fixes the
        order (``seed``, ``size``, ``shuffle``: each epoch's permutation is seeded by seed and epoch)."""
        epoch = 0 if self.size is None else self.cursor // self.size
        return {
            "cursor": self.cursor,
            "epoch": epoch,
            "seed": self.seed,
            "size": self.size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream at ``state["cursor"]``; refuses a state of a different prompt set or order."""
        for key in ("seed", "size", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"prompt stream state: {key}={state[key]!r} in the checkpoint but {getattr(self, key)!r} in "
                    "this run (the prompt set or its order changed); the run cannot continue the same stream"
                )
        self.cursor = int(state["cursor"])

    def eval_batch(self, count: int) -> list[PromptItem]:
        """The first ``count`` held-out prompts (all of them when the set is smaller); [] without a held-out set."""
        if self.held_out is None:
            return []
        n = count if self.held_out.size is None else min(count, self.held_out.size)
        return [self.held_out.items(i) for i in range(n)]

    def reward(self, response_ids: list[int], answer: Any) -> float:
        """Reward of a response (token ids, decoded without special tokens)."""
        return float(self.reward_fn(self.tokenizer.decode(response_ids), answer))

    def train_reward(self, response_ids: list[int], answer: Any) -> float:
        """:meth:`reward` plus the length penalty, if any: what the policy is trained on."""
        shaped = self.length_penalty(len(response_ids)) if self.length_penalty is not None else 0.0
        return self.reward(response_ids, answer) + shaped


def check_vocab(tokenizer: Any, vocab_size: int, what: str) -> None:
    """Refuse a tokenizer that can produce ids outside the model's ``vocab_size`` rows (no embedding for them).

    Args:
        tokenizer: anything with ``len()`` = number of token ids (Hugging Face tokenizers, CharTokenizer).
        what: names the tokenizer in the error, e.g. its checkpoint folder.
    """
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer ({what}) has {len(tokenizer)} token ids but the model's vocab_size is {vocab_size}: "
            "ids from the tokenizer would have no embedding"
        )
