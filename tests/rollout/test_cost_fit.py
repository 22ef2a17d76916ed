"""The decode cost model's hardware constants: solved exactly from timings, fitted to this CPU, named by config."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.tools.cost_fit import (
    COST_HARDWARE_FILE,
    FitPoint,
    fit_cpu_hardware,
    rollout_cost_model,
    rollout_hardware,
    solve_hardware,
)
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import BudgetSchedule

TRUE = Hardware("truth", peak_flops=8e10, mem_bandwidth=2.2e10, step_overhead_s=3e-3, page_read_bandwidth=6e9)
MODEL = DecodeCostModel(PRESETS["tiny"], TRUE, dense_layers=1, weight_bytes=4, kv_bytes=4)
BATCH = 32


def _point(model: DecodeCostModel, cached: int, budget: int) -> FitPoint:
    """A step of ``model`` at ``cached`` tokens under a fixed ``budget`` (dense: DENSE), timed by the model."""
    schedule = BudgetSchedule.dense(8192, 16) if budget == 0 else BudgetSchedule(8192, (budget,), 16)
    read, scored = model.sparse_reads(torch.tensor([cached]), schedule)
    args = [torch.tensor([[float(v)]]) for v in (cached, read.item(), scored.item(), BATCH)]
    seconds = float(model.step_cost(*args).total_s[0])
    return FitPoint(cached, float(read), float(scored), BATCH, seconds)


def test_solve_recovers_the_constants_that_made_the_timings() -> None:
    points = [_point(MODEL, 64, 0), _point(MODEL, 2048, 0), _point(MODEL, 2048, 256)]
    got = solve_hardware(MODEL, *points, peak_flops=TRUE.peak_flops, fallback_bandwidth=1.0)
    assert got.mem_bandwidth == pytest.approx(TRUE.mem_bandwidth, rel=1e-9)
    assert got.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=1e-9)
    assert got.page_read_bandwidth == pytest.approx(TRUE.page_read_bandwidth, rel=1e-9)
    assert points[2].scored_pages > 0 and points[2].kv_tokens_read < 2048  # the sparse point selected pages


def test_solve_never_returns_impossible_constants_from_noisy_timings() -> None:
    short, long, sparse = _point(MODEL, 64, 0), _point(MODEL, 2048, 0), _point(MODEL, 2048, 256)
    flat = FitPoint(long.cached_len, long.kv_tokens_read, long.scored_pages, BATCH, short.seconds * 0.9)
    got = solve_hardware(MODEL, short, flat, sparse, peak_flops=TRUE.peak_flops, fallback_bandwidth=1.5e10)
    assert got.mem_bandwidth == 1.5e10 and got.step_overhead_s >= 0  # the long step was not slower: fallback
    quick = FitPoint(sparse.cached_len, sparse.kv_tokens_read, sparse.scored_pages, BATCH, 1e-6)
    got = solve_hardware(MODEL, short, long, quick, peak_flops=TRUE.peak_flops, fallback_bandwidth=1.0)
    assert got.page_read_bandwidth == got.mem_bandwidth  # faster than its in-order part: no page penalty


def test_slow_page_reads_make_a_sparse_step_dearer_and_leave_dense_alone() -> None:
    fast = DecodeCostModel(PRESETS["tiny"], Hardware("gpu-like", 8e10, 2.2e10), dense_layers=1)
    slow = DecodeCostModel(PRESETS["tiny"], Hardware("cpu-like", 8e10, 2.2e10, page_read_bandwidth=5e9), 1)
    assert _point(slow, 2048, 0).seconds == _point(fast, 2048, 0).seconds
    assert _point(slow, 2048, 256).seconds > _point(fast, 2048, 256).seconds


def test_hardware_json_round_trip_keeps_the_page_bandwidth(tmp_path) -> None:
    TRUE.to_json(tmp_path / "cpu.json")
    assert Hardware.from_json(tmp_path / "cpu.json") == TRUE


@pytest.fixture(scope="module")
def engine() -> TorchRolloutEngine:
    shape = PRESETS["tiny-test"]
    return TorchRolloutEngine.from_shape(shape, seed=0, dense_layers=1, page_size=16, max_batch_size=8)


def test_fit_on_this_cpu_gives_usable_constants_once_per_process(engine) -> None:
    hw = fit_cpu_hardware(engine)
    assert hw.name == "cpu (fitted)"
    for value in (hw.peak_flops, hw.mem_bandwidth, hw.page_bandwidth):
        assert math.isfinite(value) and 1e7 < value < 1e13  # any CPU: between 10 MB/s and 10 TB/s
    assert 0 <= hw.step_overhead_s < 1.0 and hw.page_bandwidth <= hw.mem_bandwidth
    assert fit_cpu_hardware(engine) is hw  # memoised: the same engine settings measure once


def test_cost_hardware_names_a_preset_a_file_or_auto(engine, tmp_path) -> None:
    assert rollout_hardware("h100", engine) == HARDWARE["h100"]
    TRUE.to_json(tmp_path / "m.json")
    assert rollout_hardware(str(tmp_path / "m.json"), engine) == TRUE
    with pytest.raises(FileNotFoundError, match=r"rollout.cost_hardware: .*nope\.json not found"):
        rollout_hardware(str(tmp_path / "nope.json"), engine)
    assert rollout_hardware("auto", engine).name == "cpu (fitted)"  # a CPU engine: fitted
    if not torch.cuda.is_available():  # TensorRT-LLM's engine has no device attribute (a bare object here)
        assert rollout_hardware("auto", object()) == HARDWARE["h200"]
    config = load_config("tiny_cpu_short_smoke", ["rollout.cost_hardware=h200", "model.preset=tiny-test"])
    model = rollout_cost_model(*_sections(config), engine)
    assert model.hardware == HARDWARE["h200"] and model.kv_bytes == 4  # the engine's float32 cache
    assert model.dense_layers == engine.dense_layers and model.page_score == "centroid"
    minmax = TorchRolloutEngine(engine.model, dense_layers=1, page_size=16, page_score="minmax")
    assert (
        rollout_cost_model(*_sections(config), minmax).page_score == "minmax"
    )  # the engine's page score is priced
    trtllm = load_config("tiny_cpu_short", ["rollout.cost_hardware=h200"])
    assert rollout_cost_model(*_sections(trtllm), object()).page_score == trtllm.sparsity.page_score


def _sections(config) -> tuple:
    """What ``rollout_cost_model`` reads of a recipe: its rollout and sparsity sections and the model's shape."""
    return config.rollout, config.sparsity, config.model.shape()


def test_bad_cost_hardware_is_a_one_line_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"rollout\.cost_hardware.*auto, h200, h100 or a path ending in \.json"
    ):
        load_config("tiny_cpu_short_smoke", ["rollout.cost_hardware=a100"])


def test_a_run_folder_keeps_its_fitted_constants_for_the_resume(engine, tmp_path) -> None:
    config = load_config("tiny_cpu_short_smoke", ["model.preset=tiny-test"])
    saved = tmp_path / COST_HARDWARE_FILE
    first = rollout_cost_model(*_sections(config), engine, saved)
    assert first.hardware.name == "cpu (fitted)" and Hardware.from_json(saved) == first.hardware
    TRUE.to_json(saved)  # what an earlier attempt of the run had fitted
    assert rollout_cost_model(*_sections(config), engine, saved).hardware == TRUE  # read, not fitted again
    named = load_config("tiny_cpu_short_smoke", ["model.preset=tiny-test", "rollout.cost_hardware=h100"])
    assert rollout_cost_model(*_sections(named), engine, tmp_path / "other.json").hardware == HARDWARE["h100"]
    assert not (tmp_path / "other.json").exists()  # named constants are not written
