"""Where the RL prompts, their answers and the reward come from, chosen by the recipe.

- ``reward.type: synthetic``: the embedded chain task (:mod:`sparrow_nemo.tasks.chain`, sized by the
  ``task`` section) with the character tokenizer; problems are drawn by index, so the stream never ends
  and never repeats within a run. It also supplies (prompt, solution) pairs for the warm-start.
- ``math`` / ``code``: rows of ``data.train_path`` (:func:`sparrow_nemo.grpo.data.load_prompts`) with the
  tokenizer of ``model.hf_checkpoint``; epochs are reshuffled with ``trainer.seed``. Math answers are
  strings; code answers are test specs (:func:`sparrow_nemo.rewards.code.parse_test_spec`: dicts, assert
  lists or JSON strings), checked when the file is read so that a bad spec is a bad row, not a crash mid-run.

Either way the tokenizer must fit the model: a tokenizer with more ids than ``model``'s vocabulary is
refused up front (:func:`check_vocab`), naming both sizes.

The trainer sees only :class:`PromptSource`: ``next_batch(n)``, ``reward(completion, answer)`` and a
cursor that checkpoints can store.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sparrow_nemo.config import SparrowConfig
from sparrow_nemo.rewards.registry import bind_reward

#: warm-start problems are drawn from this index on, RL prompts from 0: the sets do not overlap.
WARMSTART_OFFSET = 10_000_000
#: evaluation problems of the synthetic task start here (disjoint from RL and warm-start problems).
EVAL_OFFSET = 5_000_000


@dataclass(frozen=True)
class PromptItem:
    """One prompt: ``prompt_ids`` (list of int, special tokens included) and the reward's ground truth."""

    prompt_ids: list[int]
    answer: Any


class PromptSource:
    """A cursor over the run's prompts plus the reward function.

    Args:
        items: indexable prompts (``index -> PromptItem``); ``size`` None = endless (synthetic task).
        reward_fn: ``(completion text, answer) -> float`` in [0, 1].
        tokenizer: decodes responses (``decode(ids) -> str``).
        seed: shuffles the order of each epoch of a finite set (when ``shuffle``).
        warm_start_pairs: ``start -> iterator of (prompt, solution)`` texts, when the task has them.
        eval_start: stream position of the evaluation prompts (:meth:`eval_batch`).
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
        eval_start: int = 0,
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
        self.eval_start = eval_start
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
        """Items at stream positions ``start .. start + count - 1`` without moving the cursor."""
        return [self._items(self._index(p)) for p in range(start, start + count)]

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next ``count`` prompts; advances the cursor."""
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
        """The fixed evaluation prompts (synthetic task: held-out problems; a file: its first rows)."""
        return self.peek(count, self.eval_start)

    def reward(self, response_ids: list[int], answer: Any) -> float:
        """Reward of a response (token ids, decoded without special tokens)."""
        return float(self.reward_fn(self.tokenizer.decode(response_ids), answer))


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


def _synthetic_source(config: SparrowConfig) -> PromptSource:
    from sparrow_nemo.tasks.chain import build_tasks
    from sparrow_nemo.tasks.tokenizer import CharTokenizer

    task, warm_task = build_tasks(config.task, config.warmstart)
    tokenizer = CharTokenizer(config.task.letters)
    check_vocab(tokenizer, config.model.shape().vocab_size, "the synthetic task's characters")

    def item(index: int) -> PromptItem:
        problem = task.problem(index)
        return PromptItem(tokenizer.encode(problem.prompt, add_special_tokens=True), problem.answer)

    def pairs(start: int) -> Iterator[tuple[str, str]]:
        return warm_task.warm_start_pairs(WARMSTART_OFFSET + start)

    return PromptSource(
        item,
        None,
        task.reward,
        tokenizer,
        config.trainer.seed,
        warm_start_pairs=pairs,
        eval_start=EVAL_OFFSET,
    )


def _file_source(config: SparrowConfig) -> PromptSource:
    from sparrow_nemo.grpo.data import PromptDataConfig, load_prompts, text_answer

    if config.model.hf_checkpoint is None:
        raise ValueError(
            f"reward.type={config.reward.type} reads data.train_path, whose prompts need the tokenizer of "
            "model.hf_checkpoint; set model.hf_checkpoint"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    check_vocab(tokenizer, config.model.shape().vocab_size, config.model.hf_checkpoint)
    if config.reward.type == "code":
        from sparrow_nemo.rewards.code import parse_test_spec as parse_answer
    else:
        parse_answer = text_answer
    data = config.data
    dataset = load_prompts(
        data.train_path,
        tokenizer,
        PromptDataConfig(
            prompt_key=data.prompt_key,
            answer_key=data.answer_key,
            max_prompt_tokens=data.max_prompt_tokens,
            max_bad_fraction=data.max_bad_fraction,
        ),
        parse_answer,
    )

    def item(index: int) -> PromptItem:
        example = dataset[index]
        return PromptItem(example.prompt_ids, example.answer)

    reward_fn = bind_reward(config.reward.type, config.reward.options)
    return PromptSource(item, len(dataset), reward_fn, tokenizer, config.trainer.seed, data.shuffle)


def build_prompt_source(config: SparrowConfig) -> PromptSource:
    """The :class:`PromptSource` the recipe names (see the module docstring)."""
    if config.reward.type == "synthetic":
        if config.reward.options:
            raise ValueError(
                f"reward.options {sorted(config.reward.options)}: the synthetic task's reward takes no options"
            )
        return _synthetic_source(config)
    return _file_source(config)
