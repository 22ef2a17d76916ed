"""Hostile recipes and overrides end in one ConfigError line naming file/key/line and what was expected.

Alias bombs, deep nesting, long ``defaults:`` chains, non-UTF-8 text, duplicate keys, non-finite numbers and
file types the loader refuses; through ``sparrow train`` each exits 2 before any run folder exists.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sparrow_nemo.cli import main
from sparrow_nemo.config import ConfigError
from sparrow_nemo.config.compose import MAX_DEFAULTS_DEPTH
from sparrow_nemo.config.docs import knobs
from sparrow_nemo.config.schema import field_hints, non_null
from sparrow_nemo.config.yaml_io import MAX_DEPTH, MAX_NODES
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config

Writer = Callable[[str, str], Path]


def error_of(recipe: str | Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, list(overrides))
    message = str(info.value)
    assert message.startswith("config error: ") and "\n" not in message
    assert len(message) < 600, message  # one readable line, not the input echoed back
    return message


def alias_bomb(levels: int = 9, width: int = 9, flow: bool = False) -> str:
    """'Billion laughs': each level is a list of ``width`` aliases of the level below (width**levels values)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "{" + ", ".join(lines) + "}" if flow else "\n".join(lines) + "\n"


# ----- YAML ------------------------------------------------------------------------------------
def test_alias_bomb_recipe_is_refused_without_expanding_it(write_recipe: Writer) -> None:
    text = alias_bomb()
    text += "# " + "x" * (11_000 - len(text)) + "\n"  # the 11 KB of the attack
    message = error_of(write_recipe("bomb", text))
    assert "bomb.yaml" in message and f"more than {MAX_NODES:,} values once aliases are expanded" in message


def test_alias_bomb_as_an_override_is_refused() -> None:
    message = error_of(None, f"++reward.options.x={alias_bomb(flow=True)}")
    assert message.startswith("config error: override '++reward.options.x=")
    assert "(from command line) - the value of reward.options.x is refused" in message
    assert "aliases are expanded" in message


@pytest.mark.parametrize("digits", ["1" * 120_000, "0x" + "f" * 5_000])
def test_an_integer_python_cannot_print_names_its_key(digits: str, write_recipe: Writer) -> None:
    """A 120 KiB integer override once ended in Python's own ValueError, naming no key."""
    for override in (f"trainer.max_steps={digits}", f"++reward.options.x={digits}"):
        key = override.split("=")[0].lstrip("+")
        message = error_of(None, override)
        assert f"the value of {key} is refused: an integer of {len(digits):,} characters" in message
    message = error_of(write_recipe("long_int", f"trainer:\n  max_steps: {digits}\n"))
    assert "long_int.yaml line 2" in message and "Python converts" in message


def test_a_few_aliases_are_fine(write_recipe: Writer) -> None:
    recipe = write_recipe("anchors", "trainer: &t {seed: 3}\nwarmstart: {steps: 7}\n")
    assert load_config(recipe).trainer.seed == 3


def test_recursive_alias_is_refused() -> None:
    assert "recursive alias" in error_of(None, "++reward.options.x=&a [*a]")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("a: " + "[" * 20_000 + "]" * 20_000 + "\n", " line 1, column 67"),  # flow style, 20,000 deep
        ("".join(f"{' ' * i}a{i}:\n" for i in range(1_000)), " line 64,"),  # block style (O(depth^2) bytes)
    ],
)
def test_deep_nesting_is_one_line_not_a_recursion_error(write_recipe: Writer, text: str, where: str) -> None:
    message = error_of(write_recipe("deep", text))
    assert "deep.yaml" + where in message and f"nesting deeper than {MAX_DEPTH} levels" in message


def test_deep_override_is_one_line() -> None:
    message = error_of(None, "++reward.options.x=" + "[" * 20_000 + "]" * 20_000)
    assert f"nesting deeper than {MAX_DEPTH} levels" in message


def test_a_long_defaults_chain_is_one_line(write_recipe: Writer) -> None:
    for i in range(1500):
        write_recipe(f"r{i}", f"defaults: [r{i + 1}]\n" if i < 1499 else "trainer: {seed: 1}\n")
    message = error_of(write_recipe("r0", "defaults: [r1]\n"))
    assert f"defaults chain of r0.yaml is deeper than {MAX_DEFAULTS_DEPTH} recipes" in message.replace(
        str(Path(write_recipe("x", "").parent)) + "/", ""
    )


def test_a_defaults_fan_out_is_bounded(write_recipe: Writer) -> None:
    # every level lists the next one 4 times: 4**8 merges without a bound
    for i in range(8):
        write_recipe(f"f{i}", f"defaults: [{', '.join([f'f{i + 1}'] * 4)}]\n")
    write_recipe("f8", "trainer: {seed: 1}\n")
    assert "merge more than 256 recipe files" in error_of(write_recipe("top", "defaults: [f0]\n"))


def test_non_utf8_recipe_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("trainer:\n  seed: 1\nname: caf\xe9\n".encode("latin-1"))
    message = error_of(path)
    assert "latin1.yaml line 3 is not UTF-8 text (byte 28: 0xe9) - expected a UTF-8 YAML file" in message


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("trainer:\n  seed: 1\n  max_steps: 3\n  seed: 2\n", "line 4"),
        ("trainer: {seed: 1}\ntrainer: {seed: 2}\n", "line 2"),
        ("sparsity: {threshold: 0.8, threshold: 0.9}\n", "line 1"),
    ],
)
def test_duplicate_keys_are_refused_with_file_and_line(write_recipe: Writer, text: str, where: str) -> None:
    message = error_of(write_recipe("dup", text))
    assert "dup.yaml " + where in message and "duplicate key" in message
    assert "expected each key once per mapping" in message


def test_duplicate_key_in_an_override_value() -> None:
    assert "duplicate key 'threshold'" in error_of(None, "sparsity={threshold: 0.8, threshold: 0.9}")


def test_merge_keys_may_still_override(write_recipe: Writer) -> None:
    text = "trainer:\n  <<: {seed: 1, max_steps: 5}\n  seed: 4\n"
    assert (
        load_config(write_recipe("merge", text)).trainer
        == load_config("tiny_cpu_short", ["trainer.seed=4", "trainer.max_steps=5"]).trainer
    )


# ----- numbers ---------------------------------------------------------------------------------
def _float_knobs() -> list[str]:
    out = []
    for knob in knobs(SparrowConfig):
        if knob.is_section:
            continue
        tp = non_null(field_hints(knob.owner)[knob.field.name])
        args = getattr(tp, "__args__", ())
        if tp is float or (args and args[0] is float):
            out.append(knob.key)
    return out


def test_every_optimizer_and_schedule_number_is_a_float_knob() -> None:
    keys = set(_float_knobs())
    assert {"policy.optimizer.lr", "policy.optimizer.eps", "policy.optimizer.betas", "warmstart.lr"} <= keys
    assert {"sparsity.threshold", "grpo.loss.tis_cap", "distill.lr_multiplier"} <= keys


@pytest.mark.parametrize("key", _float_knobs())
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused_everywhere(key: str, value: str) -> None:
    is_list = key == "policy.optimizer.betas"  # the one list of numbers
    override = f"{key}=[{value}, 0.9]" if is_list else f"{key}={value}"
    message = error_of(None, override)
    shown = key + ".0" if is_list else key
    assert message.startswith(f"config error: {shown}=") and message.endswith("expected a finite number")


def test_learning_rate_inf_names_the_key() -> None:
    assert error_of(None, "policy.optimizer.lr=.inf") == (
        "config error: policy.optimizer.lr=inf (from command line) - expected a finite number"
    )


# ----- files the loader refuses ----------------------------------------------------------------
@pytest.mark.parametrize("key", ["data.train_path", "data.val_path"])
def test_a_prompt_file_type_the_loader_refuses_is_refused_at_config_time(key: str) -> None:
    message = error_of(
        None,
        "reward.type=math",
        f"{key}=d/train.json",
        "data.train_path=d/t.jsonl" if key != "data.train_path" else "data.val_path=null",
    )
    assert (
        f"{key}=d/train.json (from command line) - expected a file ending in .jsonl, .jsonl.gz, .parquet"
        in message
    )


# ----- through the CLI: exit 2, one line, nothing written -------------------------------------
@pytest.mark.parametrize(
    "override",
    [
        "policy.optimizer.lr=.inf",
        "++reward.options.x=" + "[" * 5000 + "]" * 5000,
        "data.train_path=x.json",
        "sparsity.threshold=.nan",
    ],
)
def test_train_exits_2_before_any_run_folder(
    override: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    assert (
        main(["train", override, "reward.type=math"] if "train_path" in override else ["train", override])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: ") and "\n" not in err
    assert list(tmp_path.iterdir()) == [], "nothing may be written before the config is valid"
    assert "Traceback" not in err and sys.getrecursionlimit() >= 1000
