"""Every shipped cluster recipe fits its documented cluster, and the sbatch wrapper asks for that cluster.

Each ``recipes/qwen3_*.yaml`` model recipe documents its cluster in one line,
``# cluster: <N> node(s) x <G> GPUs (80 GB H100) - <how to submit>``. Checked here:

- ``sparrow plan --nodes N --gpus-per-node G`` accepts the recipe on 80 GiB GPUs (DistillSparse's
  adapter phase counted for ``_distill``), with the busiest rank at most 64 GiB (the rest is headroom for
  the CUDA context and NCCL buffers), and the colocated engine's KV pool holds at least one full-length
  sequence next to the policy's state;
- the ``slurm/train_*.sh`` wrapper that runs the recipe (its default RECIPE, or the one the recipe names)
  requests N nodes with G tasks and G GPUs per node.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparrow_nemo.cli import main

from .conftest import REPO_ROOT, load_script

recipe_hours = load_script("recipe_hours")

RECIPES = REPO_ROOT / "recipes"
SLURM = REPO_ROOT / "slurm"
HEADROOM_GIB = 64.0
MODEL_RECIPES = sorted(p.stem for p in RECIPES.glob("qwen3_*.yaml") if p.stem != "qwen3_math_base")


def _cluster(recipe: str) -> tuple[int, int, str]:
    """(nodes, GPUs per node, wrapper script) documented in the recipe."""
    nodes, gpus, submit = recipe_hours.documented_cluster(RECIPES / f"{recipe}.yaml")
    wrapper = re.search(r"slurm/(train_\w+\.sh)", submit)
    assert wrapper, f"recipes/{recipe}.yaml: the cluster line names no slurm/train_*.sh wrapper"
    return nodes, gpus, wrapper.group(1)


def _sbatch_options(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))


def test_every_model_size_and_task_is_shipped() -> None:
    expected = {f"qwen3_{size}_math" for size in ("1p7b", "4b", "8b", "14b")} | {"qwen3_1p7b_code"}
    assert expected <= set(MODEL_RECIPES)
    assert any(name.endswith("_distill") for name in MODEL_RECIPES)


@pytest.mark.parametrize("recipe", MODEL_RECIPES)
def test_recipe_fits_its_documented_cluster(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, gpus, _ = _cluster(recipe)
    status = main(["plan", "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--config", recipe])
    out, err = capsys.readouterr()
    assert status == 0, err
    total = float(re.search(r"total\s+([\d.]+) GiB of 80 GiB", out).group(1))
    assert total <= HEADROOM_GIB, f"{recipe}: {total} GiB per GPU leaves too little headroom\n{out}"
    assert int(re.search(r"tokens, (\d+) sequences of \d+ tokens at once", out).group(1)) >= 1
    assert "rollout per step (predicted" in out
    assert ("  distill " in out) == recipe.endswith("_distill")


@pytest.mark.parametrize("recipe", MODEL_RECIPES)
def test_wrapper_requests_the_documented_cluster(recipe: str) -> None:
    nodes, gpus, wrapper = _cluster(recipe)
    script = SLURM / wrapper
    assert script.is_file(), f"recipes/{recipe}.yaml names slurm/{wrapper}, which does not exist"
    options = _sbatch_options(script)
    assert options["nodes"] == str(nodes)
    assert options["ntasks-per-node"] == str(gpus)  # one task per GPU
    assert options["gpus-per-node"] == str(gpus)
    assert options["signal"].startswith("B:USR1@")
    assert "requeue" in script.read_text()
    default = re.search(r"RECIPE=\$\{RECIPE:-(\w+)\}", script.read_text()).group(1)
    base = recipe.removesuffix("_distill")
    assert default == base, f"slurm/{wrapper} runs {default} by default, not {base}"


def test_a_layout_that_does_not_split_the_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "plan",
            "--nodes",
            "1",
            "--gpus-per-node",
            "8",
            "--config",
            "qwen3_4b_math",
            "policy.tensor_model_parallel_size=3",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "policy.tensor_model_parallel_size=3" in err and "divide" in err
