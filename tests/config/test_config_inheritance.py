"""``defaults:`` inheritance, YAML errors and where an error says a value came from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config

Writer = Callable[[str, str], Path]


def test_child_overrides_parent_and_keeps_its_siblings(write_recipe: Writer) -> None:
    write_recipe(
        "parent",
        """
        sparsity: {threshold: 0.8, quantile: 0.1}
        grpo: {prompts_per_step: 3}
    """,
    )
    child = write_recipe(
        "child",
        """
        defaults: [parent]
        sparsity: {threshold: 0.9}
    """,
    )
    config = load_config(child)
    assert config.sparsity.threshold == 0.9  # child wins
    assert config.sparsity.quantile == 0.1  # deep merge keeps the parent's sibling
    assert config.grpo.prompts_per_step == 3  # untouched parent section


def test_multiple_defaults_merge_in_order_then_self(write_recipe: Writer) -> None:
    write_recipe("a", "trainer: {seed: 1, max_steps: 11}\nrollout: {seed: 5}\n")
    write_recipe("b", "trainer: {seed: 2}\n")
    child = write_recipe("c", "defaults: [a, b.yaml]\nrollout: {seed: 7}\n")
    config = load_config(child)
    assert config.trainer.seed == 2  # later default wins over an earlier one
    assert config.trainer.max_steps == 11  # earlier default's other keys survive
    assert config.rollout.seed == 7  # the recipe itself wins over all defaults


def test_defaults_chain_through_grandparents_and_lists_replace(write_recipe: Writer) -> None:
    write_recipe("g", "sparsity: {schedule: explicit, budgets: [64, 128, 256]}\n")
    write_recipe("p", "defaults: [g]\nsparsity: {bin_tokens: 256}\n")
    child = write_recipe("c", "defaults: [p]\nsparsity: {budgets: [96]}\n")
    config = load_config(child)
    assert config.sparsity.budgets == (96,)  # a list replaces, it is not merged element-wise
    assert config.sparsity.bin_tokens == 256


def test_shared_base_twice_is_not_a_cycle(write_recipe: Writer) -> None:
    write_recipe("base", "trainer: {seed: 3}\n")
    write_recipe("x", "defaults: [base]\n")
    write_recipe("y", "defaults: [base]\n")
    assert load_config(write_recipe("z", "defaults: [x, y]\n")).trainer.seed == 3


def test_cycle_is_an_error_naming_the_files(write_recipe: Writer) -> None:
    first = write_recipe("a", "defaults: [b]\n")
    write_recipe("b", "defaults: [a]\n")
    with pytest.raises(ConfigError, match=r"defaults cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(first)


def test_self_reference_is_a_cycle(write_recipe: Writer) -> None:
    with pytest.raises(ConfigError, match="defaults cycle"):
        load_config(write_recipe("me", "defaults: [me]\n"))


def test_missing_default_names_the_recipe_and_suggests(write_recipe: Writer) -> None:
    write_recipe("base", "trainer: {seed: 3}\n")
    child = write_recipe("child", "defaults: [bsae]\n")
    with pytest.raises(
        ConfigError, match=r"defaults entry 'bsae' \(from .*child\.yaml\).*did you mean 'base'\?"
    ):
        load_config(child)


def test_defaults_must_be_a_list_of_names(write_recipe: Writer) -> None:
    with pytest.raises(
        ConfigError, match=r"defaults=base \(from .*x\.yaml\) - expected a list of recipe names"
    ):
        load_config(write_recipe("x", "defaults: base\n"))


def test_yaml_syntax_error_names_file_and_line(write_recipe: Writer) -> None:
    bad = write_recipe("broken", "trainer:\n  seed: 1\n  max_steps: [1, 2\nmodel: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert message.startswith("config error: invalid YAML in ") and "broken.yaml" in message
    assert " line 4," in message  # the unclosed flow list is detected on line 4
    assert "\n" not in message


def test_yaml_error_in_a_parent_names_the_parent(write_recipe: Writer) -> None:
    write_recipe("parent", "a: b: c\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*parent\.yaml line 1, column"):
        load_config(write_recipe("child", "defaults: [parent]\n"))


def test_empty_recipe_is_the_defaults(write_recipe: Writer) -> None:
    assert load_config(write_recipe("empty", "")) == SparrowConfig()


def test_top_level_must_be_a_mapping(write_recipe: Writer) -> None:
    with pytest.raises(ConfigError, match=r"must be a mapping of sections at the top level, got list"):
        load_config(write_recipe("lst", "- a\n- b\n"))


def test_error_names_the_file_that_set_the_value(write_recipe: Writer) -> None:
    write_recipe("parent", "sparsity: {threshold: 1.5}\n")
    child = write_recipe("child", "defaults: [parent]\ntrainer: {seed: 1}\n")
    with pytest.raises(ConfigError, match=r"sparsity\.threshold=1\.5 \(from .*parent\.yaml\)"):
        load_config(child)
    fixed = write_recipe("fixed", "defaults: [parent]\nsparsity: {threshold: 0.9}\n")
    assert load_config(fixed).sparsity.threshold == 0.9
    with pytest.raises(ConfigError, match=r"sparsity\.threshold=2 \(from command line\)"):
        load_config(fixed, ["sparsity.threshold=2"])


def test_unknown_key_in_a_recipe_names_the_file_and_suggests(write_recipe: Writer) -> None:
    recipe = write_recipe("typo", "sparsity:\n  treshold: 0.9\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe)
    assert str(info.value).startswith("config error: unknown key 'sparsity.treshold' (from ")
    assert "typo.yaml) - did you mean 'sparsity.threshold'?" in str(info.value)
