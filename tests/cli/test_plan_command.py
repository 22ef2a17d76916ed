"""`sparrow plan` on the shipped Qwen3 recipes: every one fits 4 nodes x 8 80-GiB GPUs; bad layouts refused."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparrow_nemo.cli", "plan", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("recipe", ["qwen3_1p7b_math", "qwen3_8b_math", "qwen3_14b_math"])
def test_shipped_recipe_fits_four_nodes(recipe: str) -> None:
    done = _plan("--nodes", "4", "--gpus-per-node", "8", "--config", recipe)
    assert done.returncode == 0, done.stderr
    assert "of 80 GiB" in done.stdout
    assert "dp=" in done.stdout or "DP" in done.stdout


def test_layout_that_does_not_fit_memory_is_refused() -> None:
    done = _plan(
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--config",
        "qwen3_14b_math",
        "policy.tensor_model_parallel_size=1",
    )
    assert done.returncode == 2
    assert "GiB" in done.stderr and "raise tp or pp" in done.stderr


def test_layout_that_does_not_divide_the_world_is_refused() -> None:
    done = _plan(
        "--nodes",
        "1",
        "--gpus-per-node",
        "6",
        "--config",
        "qwen3_8b_math",
        "policy.tensor_model_parallel_size=4",
    )
    assert done.returncode == 2
    assert "6" in done.stderr and "tp" in done.stderr.lower()
