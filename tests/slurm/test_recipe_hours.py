"""scripts/recipe_hours.py: the README's predicted hours per recipe behave as the cost model says they should."""

from __future__ import annotations

import math

import pytest

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.sparse.cost_model import HARDWARE
from sparrow_nemo.sparse.schedule import BudgetSchedule

from .conftest import load_script

recipe_hours = load_script("recipe_hours")
H100 = HARDWARE["h100"]


def _dense(config) -> BudgetSchedule:
    schedule = config.sparsity.build_schedule()
    return BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)


@pytest.mark.parametrize("recipe", ["qwen3_1p7b_math", "qwen3_14b_math"])
def test_sparse_rollout_is_faster_than_dense_and_training_is_unchanged(recipe: str) -> None:
    config = load_config(recipe)
    sparse = recipe_hours.step_estimate(config, 8, H100, 0.4, config.sparsity.build_schedule())
    dense = recipe_hours.step_estimate(config, 8, H100, 0.4, _dense(config))
    assert sparse.rollout_s < dense.rollout_s
    assert sparse.train_s == dense.train_s


def test_training_time_by_hand_for_two_sequences() -> None:
    # two responses of 1,024 tokens after a 512-token prompt (max_prompt_tokens / 4): S = 1,536 each
    config = load_config(
        "qwen3_1p7b_math",
        ["grpo.prompts_per_step=1", "grpo.samples_per_prompt=2", "rollout.max_new_tokens=1024"],
    )
    shape = config.model.shape()
    estimate = recipe_hours.step_estimate(config, 8, H100, 0.5, _dense(config))
    s = 1536
    flops = 2 * shape.non_embedding_parameters() * s
    flops += 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * s**2
    flops *= 2  # sequences
    assert math.isclose(estimate.train_s, 5 * flops / (8 * H100.peak_flops * 0.5), rel_tol=1e-9)


def test_more_gpus_shorten_training_in_proportion() -> None:
    config = load_config("qwen3_8b_math")
    schedule = config.sparsity.build_schedule()
    one = recipe_hours.step_estimate(config, 16, H100, 0.4, schedule)
    two = recipe_hours.step_estimate(config, 32, H100, 0.4, schedule)
    assert math.isclose(two.train_s, one.train_s / 2, rel_tol=1e-9)
    assert two.rollout_s < one.rollout_s  # twice the engines, half the batch each


def test_table_has_a_row_per_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    recipe_hours.main(["qwen3_1p7b_math", "qwen3_8b_math"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| qwen3_")]
    assert [r.split("|")[1].strip() for r in rows] == ["qwen3_1p7b_math", "qwen3_8b_math"]
    assert "| 2 x 8 H100 |" in rows[1]
