"""The shipped recipes, serialisation round trips and the config hash."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import sparrow_nemo
from sparrow_nemo.config import DEFAULT_RECIPE, ConfigError, recipes_dir, resolve_recipe
from sparrow_nemo.grpo.recipe import SparrowConfig, from_dict, load_config
from sparrow_nemo.grpo.update import mini_batch_order
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.sparse.schedule import BudgetSchedule

SHIPPED = sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def test_recipes_folder_is_next_to_the_package() -> None:
    assert recipes_dir() == Path(sparrow_nemo.__file__).resolve().parents[1] / "recipes"
    assert {"base", "tiny_cpu", "qwen3_1p7b_math", "qwen3_8b_math", "qwen3_14b_math"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_resolves(name: str) -> None:
    config = load_config(name)
    assert isinstance(config, SparrowConfig)
    # building the schedule and the shape must work for every shipped recipe
    config.sparsity.build_schedule()
    config.model.shape()


def test_default_recipe_is_tiny_cpu_by_name_and_by_path() -> None:
    by_default = load_config()
    assert DEFAULT_RECIPE == "tiny_cpu"
    assert by_default == load_config("tiny_cpu") == load_config(recipes_dir() / "tiny_cpu.yaml")
    assert by_default.model.shape() == PRESETS["tiny"]
    assert by_default.rollout.backend == "torch"


def test_tiny_short_schedule_is_the_explicit_scaled_one() -> None:
    config = load_config("tiny_cpu_short")
    schedule = config.sparsity.build_schedule()
    assert schedule == BudgetSchedule(16, (16, 24, 48, 64), page_size=4, name="explicit")
    # flat after the last bin, and every budget holds the 3 reserved pages plus at least one top-k page
    assert schedule.budget(10_000) == 64
    assert min(schedule.budgets) >= 4 * 4
    # the cluster recipes keep the paper's geometry from base.yaml
    assert (load_config("base").sparsity.page_size, load_config("base").sparsity.dense_layers) == (16, 2)


@pytest.mark.parametrize(
    ("recipe", "preset", "schedule"),
    [
        ("qwen3_1p7b_math", "qwen3-1.7b", "qwen3-1.7b-0.86"),
        ("qwen3_8b_math", "qwen3-8b", "qwen3-8b-0.86"),
        ("qwen3_14b_math", "qwen3-14b", "qwen3-14b-0.86"),
    ],
)
def test_qwen3_recipes_use_the_paper_schedule(recipe: str, preset: str, schedule: str) -> None:
    config = load_config(recipe)
    assert config.model.shape() == PRESETS[preset]
    assert config.sparsity.build_schedule() == BudgetSchedule.from_preset(schedule)
    assert config.sparsity.bin_tokens == 2000
    assert (config.grpo.samples_per_prompt, config.grpo.loss.clip_low, config.grpo.loss.clip_high) == (
        8,
        0.2,
        0.28,
    )


@pytest.mark.parametrize("name", [n for n in SHIPPED if n.startswith("qwen3_") and n != "qwen3_math_base"])
def test_qwen3_recipe_steps_split_into_whole_prompt_mini_batches_on_32_gpus(name: str) -> None:
    """At the recipe scale (32 GPUs) each replica's prompts split into grpo.mini_batches_per_step mini-batches
    of whole prompts and whole micro-batches (what the trainer checks at construction)."""
    config = load_config(name)
    g, p = config.grpo, config.policy
    dp = 32 // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    assert g.mini_batches_per_step > 1 and g.prompts_per_step % dp == 0
    rows = g.prompts_per_step // dp * g.samples_per_prompt
    mini_batch_order(rows, g.samples_per_prompt, g.mini_batches_per_step)  # raises when they do not split
    assert (rows // g.mini_batches_per_step) % p.micro_batch_size == 0


def test_base_calibration_grid_is_the_papers_18_budgets() -> None:
    pages = [29, 45, 61, 77, 93, 125, 157, 189, 221, 253, 317, 381, 445, 509, 637, 765, 893, 1021]
    config = load_config("base")
    assert config.control.calibration.candidate_budgets == tuple((k + 3) * 16 for k in pages)


@pytest.mark.parametrize("name", SHIPPED)
def test_to_yaml_is_a_recipe_that_resolves_to_the_same_config(name: str, tmp_path: Path) -> None:
    config = load_config(name)
    saved = tmp_path / "config.yaml"
    saved.write_text(config.to_yaml())
    again = load_config(saved)
    assert again == config
    assert again.hash() == config.hash()
    assert from_dict(config.to_dict()) == config
    assert yaml.safe_load(config.to_yaml()) == config.to_dict()


def test_hash_tracks_computation_fields_only() -> None:
    base = load_config()
    assert base.hash() == load_config().hash()
    assert len(base.hash()) == 16 and int(base.hash(), 16) >= 0
    for changed in (
        ["sparsity.threshold=0.9"],
        ["grpo.loss.clip_high=0.3"],
        ["model.dtype=bf16"],
        ["++reward.options.digits=5"],
    ):
        assert load_config(None, changed).hash() != base.hash(), changed
    for same in (
        ["trainer.max_steps=999"],
        ["logging.progress_bar=false"],
        ["checkpoint.resume=never"],
        ["logging.run_dir=/tmp/elsewhere"],
    ):
        assert load_config(None, same).hash() == base.hash(), same


def test_defaults_are_the_components_and_the_paper_settings() -> None:
    # each section's defaults are its component class's; where the paper gives a value, it is the default
    defaults = from_dict({})
    assert defaults == SparrowConfig()
    s = defaults.sparsity
    assert (s.page_size, s.sink_pages, s.local_pages, s.dense_layers) == (16, 1, 2, 2)
    c = defaults.control.calibration
    assert (s.bin_tokens, s.threshold, s.quantile, c.samples_per_prompt) == (2000, 0.86, 0.05, 8)
    assert len(c.candidate_budgets) == 18
    assert (defaults.grpo.samples_per_prompt, defaults.grpo.loss.clip_low, defaults.grpo.loss.clip_high) == (
        8,
        0.2,
        0.28,
    )
    assert defaults.distill.target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # the tiny CPU run states its own scale
    tiny = load_config("tiny_cpu_short").sparsity
    assert (tiny.page_size, tiny.bin_tokens, tiny.dense_layers) == (4, 16, 0)


def test_unknown_recipe_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ConfigError, match=r"recipe 'tiny_cpv' not found .*did you mean 'tiny_cpu'\?.*base"):
        resolve_recipe("tiny_cpv")


def test_missing_recipes_folder_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "site" / "sparrow_nemo" / "__init__.py"
    monkeypatch.setattr(sparrow_nemo, "__file__", str(fake))
    with pytest.raises(ConfigError, match=r"recipes folder .*site/recipes is missing.*--config PATH"):
        load_config()
