"""Where the RL prompts, the held-out prompts and the reward come from, chosen by the recipe.

- ``reward.type: chain``: the embedded synthetic chain task (:mod:`sparrow_nemo.tasks.chain`, sized by the
  ``task`` section) with the character tokenizer; problems are drawn by index, so the stream never ends
  and never repeats within a run. Held-out problems are the indices from
  :data:`~sparrow_nemo.grpo.prompt_source.EVAL_OFFSET` on, which the training stream never reaches. It
  also supplies (prompt, solution) pairs for the warm-start.
- any other registered reward (``math``, ``code``, ...): rows of ``data.train_path``
  (:func:`sparrow_nemo.grpo.data.load_prompts`) with the tokenizer of ``model.hf_checkpoint``; epochs are
  reshuffled with ``trainer.seed``. The held-out prompts are the rows of ``data.val_path`` (read the same
  way, in file order); without it the run has none and skips the evaluation. Math answers are strings;
  code answers are test specs (:func:`sparrow_nemo.rewards.code.parse_test_spec`), checked when the file
  is read so that a bad spec is a bad row, not a crash mid-run.

``reward.by_data_source`` routes rows by their ``data_source`` (verl's): each answer is parsed for, and scored
by, its source's reward (:class:`RoutedAnswer`).

Either way the tokenizer must fit the model: a tokenizer with more ids than ``model``'s vocabulary is
refused up front (:func:`~sparrow_nemo.grpo.prompt_source.check_vocab`), naming both sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sparrow_nemo.grpo.prompt_source import (
    EVAL_OFFSET,
    WARMSTART_OFFSET,
    HeldOut,
    PromptItem,
    PromptSource,
    check_vocab,
)
from sparrow_nemo.grpo.recipe import SYNTHETIC_REWARD, SparrowConfig
from sparrow_nemo.grpo.shaping import overlong_penalty
from sparrow_nemo.rewards.registry import bind_reward

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutedAnswer:
    """A row's ground truth and the reward that scores it (``reward.by_data_source``)."""

    reward: str
    value: Any


def _answer_parser(reward: str) -> Callable[[Any], Any]:
    """What a reward's ground truth must be: code test specs, else text (math and registered rewards)."""
    if reward == "code":
        from sparrow_nemo.rewards.code import parse_test_spec

        return parse_test_spec
    from sparrow_nemo.grpo.data import text_answer

    return text_answer


def answer_route(config: SparrowConfig) -> Callable[[str | None], Callable[[Any], Any]]:
    """``data_source -> answer parser`` of the recipe: the parser of the row's reward; with
    ``reward.by_data_source`` it wraps each answer in a :class:`RoutedAnswer`."""
    r = config.reward
    if not r.by_data_source:
        return lambda _source: _answer_parser(r.type)

    def route(source: str | None) -> Callable[[Any], RoutedAnswer]:
        name = r.by_data_source.get(source, r.type) if source is not None else r.type
        parse = _answer_parser(name)
        return lambda value: RoutedAnswer(name, parse(value))

    return route


def _reward_fn(config: SparrowConfig) -> Callable[[str, Any], float]:
    """The recipe's reward, bound to its options; with ``reward.by_data_source`` each :class:`RoutedAnswer`'s."""
    r = config.reward
    if not r.by_data_source:
        return bind_reward(r.type, r.options)
    bound = {
        name: bind_reward(name, r.options if name == r.type else {})
        for name in {r.type, *r.by_data_source.values()}
    }

    def reward_fn(completion: str, answer: RoutedAnswer) -> float:
        return bound[answer.reward](completion, answer.value)

    return reward_fn


def file_tokenizer(config: SparrowConfig) -> Any:
    """The tokenizer of ``model.hf_checkpoint`` (file data needs one), checked against the model's vocabulary."""
    if config.model.hf_checkpoint is None:
        raise ValueError(
            f"reward.type={config.reward.type} reads data.train_path, whose prompts need the tokenizer of "
            "model.hf_checkpoint; set model.hf_checkpoint"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    check_vocab(tokenizer, config.model.shape().vocab_size, config.model.hf_checkpoint)
    return tokenizer


def _synthetic_source(config: SparrowConfig) -> PromptSource:
    from sparrow_nemo.tasks.chain import build_tasks
    from sparrow_nemo.tasks.tokenizer import CharTokenizer

    task, warm_task = build_tasks(config.task, config.warmstart)
    # one tokenizer for both (a letter's id depends on how many letters it holds): the labels of the most queries
    tokenizer = CharTokenizer(max(task.config.tokenizer_letters, warm_task.config.tokenizer_letters))
    check_vocab(tokenizer, config.model.shape().vocab_size, "the synthetic task's characters")

    def problem_item(index: int) -> PromptItem:
        problem = task.problem(index)
        return PromptItem(tokenizer.encode(problem.prompt, add_special_tokens=True), problem.answer)

    def training_item(index: int) -> PromptItem:
        if index >= EVAL_OFFSET:
            raise ValueError(
                f"the training stream reached problem {index:,}, where the held-out problems start; "
                "the synthetic task serves at most that many training prompts per run"
            )
        return problem_item(index)

    def pairs(start: int) -> Iterator[tuple[str, str]]:
        return warm_task.warm_start_pairs(WARMSTART_OFFSET + start)

    held_out = HeldOut(
        lambda i: problem_item(EVAL_OFFSET + i), None, "the synthetic task's held-out problems"
    )
    return PromptSource(
        training_item,
        None,
        task.reward,
        tokenizer,
        config.trainer.seed,
        warm_start_pairs=pairs,
        held_out=held_out,
    )


def _file_source(config: SparrowConfig) -> PromptSource:
    from sparrow_nemo.grpo.data import load_prompts

    tokenizer = file_tokenizer(config)
    reward_fn, route = _reward_fn(config), answer_route(config)
    data = config.data
    train = load_prompts(data.train_path, tokenizer, data, route=route)
    held_out = None
    if data.val_path is not None:
        val = load_prompts(data.val_path, tokenizer, data, route=route)
        held_out = HeldOut(
            lambda i: PromptItem(val[i].prompt_ids, val[i].answer), len(val), f"data.val_path={data.val_path}"
        )
    else:
        logger.warning(
            "data.val_path is null: no held-out prompts, so the run skips the evaluation before and after "
            "training (its prompts would otherwise be training prompts)"
        )

    def item(index: int) -> PromptItem:
        example = train[index]
        return PromptItem(example.prompt_ids, example.answer)

    return PromptSource(
        item, len(train), reward_fn, tokenizer, config.trainer.seed, data.shuffle, held_out=held_out
    )


def build_prompt_source(config: SparrowConfig) -> PromptSource:
    """The :class:`PromptSource` the recipe names (see the module docstring), with ``grpo.overlong``'s length
    penalty on its training reward."""
    if config.reward.type == SYNTHETIC_REWARD:
        if config.reward.options:
            raise ValueError(
                f"reward.options {sorted(config.reward.options)}: the synthetic task's reward takes no options"
            )
        source = _synthetic_source(config)
    else:
        source = _file_source(config)
    overlong, cap = config.grpo.overlong, config.rollout.max_new_tokens
    if overlong.enabled:
        source.length_penalty = lambda length: overlong_penalty(length, cap, overlong)
    return source
