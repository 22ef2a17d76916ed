"""A bad schedule file or recipe key: one line naming the file (or key), the bin and the values.

(The schedule's own rules and the config's override errors are tested in tests/sparse and tests/config;
these cover what a user hits from a file and through a recipe, plus the new trainer key.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.sparse.schedule import BudgetSchedule


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "schedule.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "name: mine\nbin_tokens: 128\npage_size: 16\nbudgets: [64, 128, 96]\n",
            "schedule 'mine': budgets must be non-decreasing, but bin 2 has 96 tokens after bin 1 with 128",
        ),
        (
            "bin_tokens: 128\npage_size: 16\nbudgets: [64, -16]\n",
            "schedule: budget of bin 1 must be a positive multiple of page_size=16 tokens (or 'dense'), got -16",
        ),
        ("bin_tokens: abc\nbudgets: [64]\n", "schedule: bin_tokens must be an int > 0 (tokens), got 'abc'"),
    ],
)
def test_bad_schedule_file_names_file_bin_and_values(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=f"^{re.escape(f'schedule file {path}: {message}')}$"):
        BudgetSchedule.from_yaml(path)


def test_unparsable_schedule_file_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "bin_tokens: 128\nbudgets: [64, 96\n")
    where = f"schedule file {re.escape(str(path))} does not parse line 3, column 1: "
    with pytest.raises(ValueError, match=f"^{where}expected ',' or ']'") as info:
        BudgetSchedule.from_yaml(path)
    assert "\n" not in str(info.value)


def test_recipe_pointing_at_a_bad_schedule_file_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "bin_tokens: 128\nbudgets: [64, 128, 96]\n")
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", [f"sparsity.schedule={path}"])
    assert str(info.value) == (
        f"config error: sparsity.schedule={path} (from command line) - expected a valid schedule (schedule file "
        f"{path}: schedule: budgets must be non-decreasing, but bin 2 has 96 tokens after bin 1 with 128)"
    )


def test_negative_recipe_budget_names_key_bin_and_value() -> None:
    with pytest.raises(
        ConfigError, match=r"sparsity\.budgets=.*budget of bin 1 must be a positive .*got -16"
    ):
        load_config("tiny_cpu", ["sparsity.budgets=[64, -16]"])


@pytest.mark.parametrize(
    "value, expected", [("abc", "expected an integer"), ("0", "expected an integer >= 1")]
)
def test_max_consecutive_nonfinite_is_validated(value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"trainer.max_consecutive_nonfinite={value} .*{expected}"):
        load_config("tiny_cpu", [f"trainer.max_consecutive_nonfinite={value}"])
    assert load_config("tiny_cpu", []).trainer.max_consecutive_nonfinite == 3
