"""The scheduler's dry mode: the real engine's schedule replayed on page numbers, and the recipes' forecasts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from sparrow_nemo.commands._forecast import rollout_forecast
from sparrow_nemo.commands.plan import documented_cluster, plan_config
from sparrow_nemo.config import recipes_dir
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.rollout.torch.dry_run import (
    StepPricer,
    lengths_like_run,
    qwen3_lengths,
    simulate,
    simulate_static,
)
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule

from .test_continuous_batching import PROMPT, SAMPLES, SHAPE, SPARSE, pool, requests, spread_run


@pytest.fixture(scope="module")
def pricer() -> StepPricer:
    return StepPricer(
        DecodeCostModel.for_preset("qwen3-8b", "h100"), BudgetSchedule.from_preset("qwen3-8b-0.86")
    )


def test_the_dry_run_replays_the_engines_schedule() -> None:
    """The tiny CPU rollout of test_continuous_batching under a 2-row KV budget, replayed with its response
    lengths: the same decode steps, preemptions and peak pages as the real engine."""
    engine = TorchRolloutEngine.from_shape(SHAPE, seed=1, dense_layers=1, attention_backend="torch")
    sampling, _ = spread_run(engine, SPARSE)
    tight = TorchRolloutEngine(
        engine.model, dense_layers=1, attention_backend="torch", max_cache_tokens=pool(2.0)
    )
    real = tight.generate(requests(), sampling, SPARSE)
    lengths = [s.response_ids.numel() for s in real.samples]
    tiny = StepPricer(DecodeCostModel.for_preset("tiny-test", "h100"), SPARSE)
    dry = simulate(lengths, PROMPT, SAMPLES, tiny, 16, real.capacity_pages, len(lengths))
    assert (dry.decode_steps, dry.preemptions, dry.peak_pages) == (
        real.decode_steps,
        real.preemptions,
        real.peak_pages,
    )
    assert dry.tokens == sum(lengths) and dry.seconds > 0


def test_continuous_against_static_waves_and_no_memory_limit(pricer: StepPricer) -> None:
    """16 requests spread over 10x in a pool for 4.5 full-length rows: the static engine runs waves of 4 (halved
    from 16 until they fit) each as long as its longest; continuous batching decodes about as long as the
    longest response, the no-limit bound exactly that."""
    cap, prompt = 8192, 512
    lengths = [300, 8000, 1200, 5000, 800, 6500, 2500, 3000, 400, 7000, 900, 4500, 650, 3500, 2000, 5500]
    pages = int(4.5 * (prompt + cap)) // 16
    static = simulate_static(lengths, prompt, cap, pricer, 16, pages, 16)
    continuous = simulate(lengths, prompt, 8, pricer, 16, pages, 16)
    unlimited = simulate(lengths, prompt, 8, pricer, 16, None, 16)
    assert unlimited.decode_steps == max(lengths) - 1 and unlimited.preemptions == 0
    assert continuous.decode_steps <= 1.2 * max(lengths)
    assert static.decode_steps == sum(max(lengths[i : i + 4]) - 1 for i in range(0, 16, 4))
    assert static.decode_steps > 2.5 * continuous.decode_steps
    assert static.seconds > 2 * continuous.seconds >= 2 * unlimited.seconds


def test_a_tight_pool_preempts_and_recomputes(pricer: StepPricer) -> None:
    lengths = [3000] * 8
    dry = simulate(lengths, 512, 8, pricer, 16, 600, 8)  # 9,600 tokens for 8 x 3,500
    assert dry.preemptions > 0 and dry.recomputed_tokens > 0 and dry.peak_pages <= 600
    assert dry.prefill_s > simulate(lengths, 512, 8, pricer, 16, None, 8).prefill_s


def test_length_models(tmp_path: Path) -> None:
    lengths = qwen3_lengths(4000, 37_888, seed=1)
    assert 6_500 < statistics.median(lengths) < 7_500 and max(lengths) == 37_888 and min(lengths) >= 1
    assert 0.01 < sum(n == 37_888 for n in lengths) / 4000 < 0.06
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "response_length/median": 900.0, "response_length/mean": 1100.0} for i in range(12)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    like = lengths_like_run(metrics, 4000, 2048)
    assert 850 < statistics.median(like) < 950 and 1000 < statistics.mean(like) < 1150
    metrics.write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="no rows with response_length/median"):
        lengths_like_run(metrics, 10, 2048)


@pytest.mark.parametrize("recipe", ["qwen3_8b_math", "qwen3_14b_math"])
def test_recipe_forecasts_are_near_the_no_memory_limit_bound(recipe: str) -> None:
    """On each recipe's documented cluster, continuous batching in the engine's planned KV pool is within 1.3x
    of the same rollout with no memory limit, far ahead of static waves; sparse beats dense at that batch."""
    path = recipes_dir() / f"{recipe}.yaml"
    nodes, gpus, _ = documented_cluster(path)
    config = load_config(path)
    report = plan_config(config, nodes, gpus, 80.0)
    forecast = rollout_forecast(config, report.rollout.pool_tokens, nodes * gpus, HARDWARE["h100"])
    assert forecast.continuous.seconds <= 1.3 * forecast.unlimited.seconds
    assert forecast.static.seconds > 1.5 * forecast.continuous.seconds
    assert forecast.sparse_speedup > 1.0
    assert "sparse vs dense" in forecast.lines()[0]
