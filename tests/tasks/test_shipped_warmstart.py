"""The shipped warm-starts: scripts/ship_warmstart.py writes a loadable, hash-listed folder, and the default's,
the long-CoT and the haystack recipes' checkpoints are shipped under the keys the current code and recipes give (else their first
runs train for 6-15 minutes instead of loading them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script

from sparrow_nemo.grpo import warmstart
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.world import one_rank_world


def _ship_script():
    return load_script("ship_warmstart")


def test_ship_script_writes_a_folder_that_a_fresh_run_loads_instead_of_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _ship_script()
    monkeypatch.setattr(script, "SHIPPED_ROOT", tmp_path / "shipped")
    small = ["model.preset=tiny-test", "warmstart.steps=2", "logging.progress_bar=false"]
    with one_rank_world():
        folder = script.main(["--config", "tiny_cpu_short_smoke", *small])
    manifest = json.loads((folder / warmstart.MANIFEST).read_text())
    assert manifest["key"] == folder.name and manifest["recipe"] == "tiny_cpu_short_smoke"
    assert set(manifest["sha256"]) == {"config.json", "model.safetensors", "warmstart.json"}
    assert all(warmstart.file_sha256(folder / f) == h for f, h in manifest["sha256"].items())

    monkeypatch.setattr(warmstart, "SHIPPED_ROOT", tmp_path / "shipped")

    def no_training(*args, **kwargs):
        raise AssertionError("trained although the shipped checkpoint has the key")

    monkeypatch.setattr(warmstart, "_train_and_cache", no_training)
    config = load_config("tiny_cpu_short_smoke", [*small, f"warmstart.cache_dir={tmp_path / 'cache'}"])
    with one_rank_world():
        got = warmstart.ensure_warm_start(config, build_prompt_source(config), show_progress=False)
    assert got.name == folder.name
    assert (got / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "recipe",
    [
        "tiny_cpu",
        "tiny_cpu_smoke",
        "tiny_cpu_long",
        "tiny_cpu_long_smoke",
        "tiny_cpu_haystack",
        "tiny_cpu_haystack_smoke",
    ],
)
def test_the_long_recipes_warm_starts_are_shipped_for_the_current_code(recipe: str) -> None:
    config = load_config(recipe, [])
    with one_rank_world():
        key = warmstart.cache_key(config, "CharTokenizer", warmstart.SINGLE_RANK)
    assert warmstart.shipped_checkpoint(key) is not None, (
        f"no shipped warm-start for {recipe} under key {key}: the recipe's warm-start settings or the code in "
        f"grpo.warmstart.WARMSTART_SOURCES changed; remake it with "
        f"`python scripts/ship_warmstart.py --config {recipe.removesuffix('_smoke')}` (6-15 min) and delete the "
        "old folder"
    )
