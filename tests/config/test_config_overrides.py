"""Command-line overrides: ``a.b=v`` (existing key), ``+a.b=v`` (new key), ``++a.b=v`` (either)."""

from __future__ import annotations

import pytest

from sparrow_nemo.config import ConfigError, Override
from sparrow_nemo.grpo.recipe import load_config


def test_set_existing_key_and_later_override_wins() -> None:
    config = load_config(
        "tiny_cpu_short", ["sparsity.threshold=0.9", "trainer.max_steps=3", "sparsity.threshold=0.8"]
    )
    assert config.sparsity.threshold == 0.8
    assert config.trainer.max_steps == 3


@pytest.mark.parametrize(
    ("text", "mode", "path", "value"),
    [
        ("a.b=1", "", ("a", "b"), 1),
        ("a.b=1.5", "", ("a", "b"), 1.5),
        ("+a.b=[1, 2]", "+", ("a", "b"), [1, 2]),
        ("++a.b={k: v}", "++", ("a", "b"), {"k": "v"}),
        ("a=null", "", ("a",), None),
        ("a=true", "", ("a",), True),
        ("a=False", "", ("a",), False),
        ("a=off", "", ("a",), "off"),  # YAML 1.2 booleans: off / on / yes / no are words
        ("a=[on, no]", "", ("a",), ["on", "no"]),
        ("a=x=y", "", ("a",), "x=y"),
        ("a=", "", ("a",), ""),
        ("a._target_=pkg.Mod", "", ("a", "_target_"), "pkg.Mod"),
    ],
)
def test_override_parsing_uses_yaml_values(
    text: str, mode: str, path: tuple[str, ...], value: object
) -> None:
    assert Override.parse(text) == Override(mode, path, value)


def test_a_mode_named_off_is_set_unquoted() -> None:
    assert load_config("tiny_cpu_short", ["control.scheduler.adapt=off"]).control.scheduler.adapt == "off"


def test_a_yaml_1_1_boolean_word_is_refused_by_a_boolean_knob() -> None:
    with pytest.raises(ConfigError, match=r"^config error: warmstart\.enabled=yes \(from command line\) - "):
        load_config("tiny_cpu_short", ["warmstart.enabled=yes"])


@pytest.mark.parametrize("text", ["noequals", "=1", "+++a=1", "a..b=1", "a.b =1", "a=[1, 2"])
def test_malformed_override_is_one_clear_line(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^config error: override .* \(from command line\) - ") as info:
        load_config("tiny_cpu_short", [text])
    assert "\n" not in str(info.value)


def test_set_on_unknown_key_fails_with_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu_short", ["sparsity.treshold=0.9"])
    assert str(info.value) == (
        "config error: unknown key 'sparsity.treshold' (from command line) - did you mean 'sparsity.threshold'?"
    )


def test_misspelled_section_suggests_the_full_path() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'sparity\.threshold' .* did you mean 'sparsity\.threshold'\?"
    ):
        load_config("tiny_cpu_short", ["sparity.threshold=0.9"])


def test_unknown_key_without_close_match_lists_the_allowed_keys() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'trainer\.zzz' .* allowed keys under 'trainer': max_steps, "
        r"seed, device, cpu_threads, max_consecutive_nonfinite, dist_timeout_minutes$",
    ):
        load_config("tiny_cpu_short", ["trainer.zzz=1"])


def test_plusplus_adds_into_a_free_form_mapping() -> None:
    config = load_config("tiny_cpu_short", ["++reward.options.num_vars=12", "++reward.options.names=[a, b]"])
    assert config.reward.options == {"num_vars": 12, "names": ["a", "b"]}
    # once present, plain = may change it; ++ may too
    again = load_config("tiny_cpu_short", ["++reward.options.num_vars=12", "reward.options.num_vars=3"])
    assert again.reward.options == {"num_vars": 3}


def test_plusplus_creates_nested_free_form_mappings() -> None:
    config = load_config("tiny_cpu_short", ["++reward.options.task.depth=4"])
    assert config.reward.options == {"task": {"depth": 4}}


def test_set_into_free_form_mapping_needs_plusplus() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'reward\.options\.num_vars' .*add a new key with "
        r"\+\+reward\.options\.num_vars=",
    ):
        load_config("tiny_cpu_short", ["reward.options.num_vars=12"])


def test_single_plus_adds_but_refuses_an_existing_key() -> None:
    assert load_config("tiny_cpu_short", ["+reward.options.k=1"]).reward.options == {"k": 1}
    with pytest.raises(ConfigError, match=r"\+key adds a new key but 'reward\.options\.k' exists"):
        load_config("tiny_cpu_short", ["+reward.options.k=1", "+reward.options.k=2"])


def test_plusplus_on_a_fixed_section_behaves_like_set() -> None:
    assert load_config("tiny_cpu_short", ["++sparsity.threshold=0.9"]).sparsity.threshold == 0.9
    with pytest.raises(
        ConfigError, match=r"unknown key 'sparsity\.treshold' .*did you mean 'sparsity\.threshold'"
    ):
        load_config("tiny_cpu_short", ["++sparsity.treshold=0.9"])
    with pytest.raises(ConfigError, match=r"unknown key 'sparsity\.treshold'"):
        load_config("tiny_cpu_short", ["+sparsity.treshold=0.9"])


def test_mapping_value_merges_into_a_section() -> None:
    config = load_config("tiny_cpu_short", ["sparsity={threshold: 0.9, quantile: 0.1}"])
    assert (config.sparsity.threshold, config.sparsity.quantile) == (0.9, 0.1)
    assert config.sparsity.bin_tokens == 16  # untouched keys stay
    with pytest.raises(ConfigError, match=r"unknown key 'sparsity\.treshold' \(from command line\)"):
        load_config("tiny_cpu_short", ["sparsity={treshold: 0.9}"])


def test_callbacks_list_and_their_free_form_kwargs() -> None:
    config = load_config(
        "tiny_cpu_short",
        [
            "callbacks=[{_target_: sparrow_nemo.callbacks.base.Callback, window: 4}]",
            "++callbacks.0.window=8",
            "++callbacks.0.patience=2",
        ],
    )
    assert config.callbacks == (
        {"_target_": "sparrow_nemo.callbacks.base.Callback", "window": 8, "patience": 2},
    )


def test_list_index_out_of_range_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"'callbacks' is an empty list"):
        load_config("tiny_cpu_short", ["callbacks.0.window=2"])
    with pytest.raises(ConfigError, match=r"'sparsity\.budgets' is a list of 4 \(indices 0\.\.3\)"):
        load_config("tiny_cpu_short", ["sparsity.budgets.9=64"])
    assert load_config("tiny_cpu_short", ["sparsity.budgets.3=512"]).sparsity.budgets[-1] == 512


def test_descending_into_a_scalar_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.seed\.x \(from command line\) - 'trainer\.seed' is 0, not a mapping"
    ):
        load_config("tiny_cpu_short", ["trainer.seed.x=1"])


def test_override_applies_on_top_of_a_named_recipe() -> None:
    config = load_config("qwen3_8b_math", ["policy.tensor_model_parallel_size=4", "sparsity.threshold=0.88"])
    assert config.policy.tensor_model_parallel_size == 4
    assert config.sparsity.threshold == 0.88
    assert config.model.preset == "qwen3-8b"
