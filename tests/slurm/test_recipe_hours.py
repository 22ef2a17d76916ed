"""scripts/recipe_hours.py: the README's predicted hours per recipe behave as the forecast says they should."""

from __future__ import annotations

import math

import pytest

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.sparse.cost_model import HARDWARE

from .conftest import load_script

recipe_hours = load_script("recipe_hours")
H100 = HARDWARE["h100"]


@pytest.mark.parametrize("recipe", ["qwen3_1p7b_math", "qwen3_14b_math"])
def test_sparse_rollout_is_faster_than_dense_and_training_is_unchanged(recipe: str) -> None:
    step = recipe_hours.step_estimate(load_config(recipe), 4 if "14b" in recipe else 1, 8, "h100", 0.4)
    assert step.rollout_s < step.dense_rollout_s
    assert math.isclose(step.total_s - step.rollout_s, step.train_s) and math.isclose(
        step.dense_total_s - step.dense_rollout_s, step.train_s
    )
    assert step.rollout_s == step.forecast.continuous.seconds


def test_training_time_by_hand_for_two_sequences() -> None:
    # two responses of 1,024 tokens after a 512-token prompt (max_prompt_tokens / 4): S = 1,536 each
    config = load_config("qwen3_1p7b_math")
    shape = config.model.shape()
    train_s = recipe_hours.train_seconds(config, 8, H100.peak_flops, 0.5, [1024, 1024])
    s = 1536
    flops = 2 * shape.non_embedding_parameters() * s
    flops += 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * s**2
    flops *= 2  # sequences
    assert math.isclose(train_s, 5 * flops / (8 * H100.peak_flops * 0.5), rel_tol=1e-9)


def test_table_has_a_row_per_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    recipe_hours.main(["qwen3_1p7b_math", "qwen3_8b_math"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| qwen3_")]
    assert [r.split("|")[1].strip() for r in rows] == ["qwen3_1p7b_math", "qwen3_8b_math"]
    assert "| 2 x 8 H100 |" in rows[1]
