"""`sparrow plan` on the shipped Qwen3 recipes: every one fits 4 nodes x 8 80-GiB GPUs and prints its memory
breakdown; bad layouts refused; docs/memory.md's table is ``sparrow plan --table``'s output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow_nemo.commands.plan import CLUSTER_LINE

MEMORY_DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


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
    for term in ("weights", "gradients", "optimizer", "activations", "recompute", "logits"):
        assert re.search(rf"^  {term} +[\d.]+ GiB", done.stdout, re.M), term
    assert re.search(r"KV cache [\d.]+ GiB per GPU = [\d,]+ tokens, \d+ sequences", done.stdout)
    # the recipes offload the optimizer during rollout: the engine runs next to the policy's weights only
    assert re.search(r"policy [\d.]+ GiB \(weights only: gradients freed, optimizer on host\)", done.stdout)
    assert re.search(r"host memory per node during rollout: 8 x [\d.]+ GiB", done.stdout)
    assert re.search(
        r"rollout per step \(predicted.*continuous [\d.]+ min.*sparse vs dense [\d.]+x", done.stdout
    )


def test_distill_recipe_counts_the_adapter_phase() -> None:
    done = _plan("--config", "qwen3_1p7b_math_distill")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^  distill +[\d.]+ GiB +\(DistillSparse step: adapter", done.stdout, re.M)


def test_documented_memory_table_is_the_plan_output() -> None:
    done = _plan("--table")
    assert done.returncode == 0, done.stderr
    table = done.stdout.strip().splitlines()
    lines = MEMORY_DOC.read_text().splitlines()
    start = lines.index(table[0])
    assert lines[start : start + len(table)] == table, (
        "regenerate the table in docs/memory.md with `sparrow plan --table`"
    )
    documented = [
        p
        for p in (MEMORY_DOC.parents[1] / "recipes").glob("qwen3_*.yaml")
        if CLUSTER_LINE.search(p.read_text())
    ]
    assert len(table) == 2 + len(documented) >= 2 + 5


def test_layout_that_does_not_fit_memory_is_refused() -> None:
    done = _plan(
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--config",
        "qwen3_14b_math",
        "policy.tensor_model_parallel_size=1",
        "rollout.tensor_parallel_size=1",  # the recipe's engines span its TP group
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
