"""Decode cost model vs a per-step Python reference, and the paper's speedup range (docs/METHOD.md)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparrow_nemo.model_shapes import get_shape
from sparrow_nemo.sparse.attention import select_pages
from sparrow_nemo.sparse.cost_model import (
    HARDWARE,
    DecodeCostModel,
    Hardware,
    predicted_speedup,
    rollout_cost,
)
from sparrow_nemo.sparse.schedule import PAPER_SCHEDULES, BudgetSchedule

PAPER_LENGTHS = [37_000] * 64  # batch 64, 37K-token generations (docs/METHOD.md)


def reference_rollout_seconds(
    shape, hw, schedule, lengths, prompts, dense_layers=2, centroid_bytes=4, landmarks=1
):
    """Loop over steps and sequences; kept pages counted with select_pages on random keys; ``landmarks``
    vectors read and dotted per scored page (1 centroid, or the 2 key bounds of the minmax score)."""
    ps = schedule.page_size
    params = shape.non_embedding_parameters()
    kvd, qd = shape.num_key_value_heads * shape.head_dim, shape.num_attention_heads * shape.head_dim
    sparse_layers = shape.num_layers - dense_layers
    total = 0.0
    for t in range(max(lengths)):
        live = [b for b in range(len(lengths)) if t < lengths[b]]
        if not live:
            continue
        flops, mem = 2.0 * params * len(live), 2.0 * params  # bf16 weights read once per step
        for b in live:
            cached = prompts[b] + t
            budget = schedule.budget(cached)
            k = torch.randn(1, 1, max(cached, 1), 4)
            pages = select_pages(torch.randn(1, 1, 4), k, torch.tensor([cached]), budget, ps)
            read = min(int((pages >= 0).sum()) * ps, cached)
            n_pages = math.ceil(cached / ps)
            scored = n_pages if n_pages > budget // ps else 0
            tokens = dense_layers * cached + sparse_layers * read
            flops += 4 * qd * tokens + 2 * kvd * sparse_layers * scored * landmarks
            mem += 2 * kvd * 2 * tokens + kvd * centroid_bytes * sparse_layers * scored * landmarks
        total += flops / hw.peak_flops + mem / hw.mem_bandwidth + hw.step_overhead_s
    return total


@pytest.mark.parametrize("page_score,landmarks", [("centroid", 1), ("minmax", 2)])
def test_matches_per_step_reference(page_score: str, landmarks: int):
    shape = get_shape("tiny-test")
    hw = Hardware("toy", peak_flops=1e9, mem_bandwidth=2e8, step_overhead_s=1e-4)
    schedule = BudgetSchedule(bin_tokens=32, budgets=(48, 64, 80), page_size=8)
    lengths, prompts = [5, 70, 41, 0], [3, 20, 3, 9]
    model = DecodeCostModel(shape, hw, dense_layers=1, page_score=page_score)
    got = model.rollout_cost(schedule, lengths, prompts, chunk_steps=16)
    want = reference_rollout_seconds(
        shape, hw, schedule, lengths, prompts, dense_layers=1, landmarks=landmarks
    )
    assert got.total_s == pytest.approx(want, rel=1e-12)
    assert got.total_s == pytest.approx(got.compute_s + got.memory_s + got.overhead_s)
    assert got.overhead_s == pytest.approx(70 * 1e-4) and got.decode_steps == 70 and got.tokens == 116
    assert got.tokens_per_s == pytest.approx(116 / got.total_s)


def test_minmax_scoring_costs_twice_the_landmark_bytes_and_nothing_else():
    """Same reads, same dense cost: the minmax score only doubles the scored landmarks' bytes and FLOPs."""
    centroid = DecodeCostModel.for_preset("qwen3-1.7b", "h200")
    minmax = DecodeCostModel.for_preset("qwen3-1.7b", "h200", page_score="minmax")
    cached, read, scored, live = (torch.tensor([[float(v)]]) for v in (8192, 2048, 512, 1))
    (order_c, scat_c), (order_m, scat_m) = (
        m.step_bytes(cached, read, scored, live) for m in (centroid, minmax)
    )
    shape = centroid.shape
    landmark_bytes = shape.num_key_value_heads * shape.head_dim * 4 * (shape.num_layers - 2) * 512
    assert float(order_m - order_c) == pytest.approx(landmark_bytes) and torch.equal(scat_m, scat_c)
    dense = BudgetSchedule.dense()
    assert minmax.rollout_cost(dense, [300], 100).total_s == centroid.rollout_cost(dense, [300], 100).total_s
    schedule = BudgetSchedule.from_preset("qwen3-1.7b-0.86")
    assert minmax.predicted_speedup(schedule, PAPER_LENGTHS[:4]) < centroid.predicted_speedup(
        schedule, PAPER_LENGTHS[:4]
    )
    with pytest.raises(ValueError, match="page_score must be one of"):
        DecodeCostModel(shape, HARDWARE["h200"], page_score="quest")


def test_paper_schedule_speedup_is_in_the_memory_bound_range():
    """docs/METHOD.md: 1.7B, 0.86 schedule, 37K generation, H200 -> memory-bound limit about 3.7x."""
    model = DecodeCostModel.for_preset("qwen3-1.7b", "h200")
    speedup = predicted_speedup(BudgetSchedule.from_preset("qwen3-1.7b-0.86"), PAPER_LENGTHS, model, 512)
    assert 3.0 <= speedup <= 4.0
    cost = rollout_cost(BudgetSchedule.dense(), PAPER_LENGTHS, model, 512)
    assert cost.memory_s > 10 * cost.compute_s  # long-context decode is memory bound


@pytest.mark.parametrize("name", ["dense", "fixed:40960", "fixed:1048576"])
def test_keeping_everything_is_no_speedup(name):
    model = DecodeCostModel.for_preset("qwen3-1.7b")
    assert model.predicted_speedup(BudgetSchedule.from_preset(name), PAPER_LENGTHS) == pytest.approx(
        1.0, abs=1e-12
    )


def test_larger_budgets_predict_lower_speedup():
    model = DecodeCostModel.for_preset("qwen3-1.7b")
    presets = sorted(n for n in PAPER_SCHEDULES if n.startswith("qwen3-1.7b-"))  # ascending threshold
    dense = model.rollout_cost(BudgetSchedule.dense(), PAPER_LENGTHS).total_s
    speedups = [
        dense / model.rollout_cost(BudgetSchedule.from_preset(n), PAPER_LENGTHS).total_s for n in presets
    ]
    assert speedups == sorted(speedups, reverse=True) and len(set(speedups)) == len(speedups)
    fixed = [
        model.predicted_speedup(BudgetSchedule.from_preset(f"fixed:{b}"), [8000] * 8)
        for b in (256, 1024, 4096)
    ]
    assert fixed[0] > fixed[1] > fixed[2] > 1.0


def test_batching_shares_the_weight_read():
    model = DecodeCostModel.for_preset("qwen3-1.7b")
    one = model.rollout_cost(BudgetSchedule.dense(), [100], 10)
    two = model.rollout_cost(BudgetSchedule.dense(), [100, 100], 10)
    assert one.total_s < two.total_s < 2 * one.total_s
    assert two.compute_s == pytest.approx(2 * one.compute_s)


def test_hardware_presets_and_json(tmp_path):
    assert HARDWARE["h200"].mem_bandwidth == 4.4e12 and HARDWARE["h200"].peak_flops == 989e12
    assert HARDWARE["h100"].mem_bandwidth < HARDWARE["h200"].mem_bandwidth
    measured = Hardware("bench", peak_flops=7e14, mem_bandwidth=4.1e12, step_overhead_s=2e-5)
    path = tmp_path / "hw.json"
    measured.to_json(path)
    assert Hardware.from_json(path) == measured
    path.write_text(json.dumps({"peak_flops": 1e12, "bandwidth": 1e12}))
    with pytest.raises(ValueError, match="mem_bandwidth"):
        Hardware.from_json(path)
    with pytest.raises(ValueError, match="peak_flops"):
        Hardware("bad", peak_flops=0, mem_bandwidth=1)


def test_bad_cost_inputs():
    model = DecodeCostModel.for_preset("tiny-test")
    with pytest.raises(ValueError, match="length_distribution"):
        model.rollout_cost(BudgetSchedule.dense(), [])
    with pytest.raises(ValueError, match="length_distribution"):
        model.rollout_cost(BudgetSchedule.dense(), [3, -1])
    with pytest.raises(ValueError, match="dense_layers"):
        DecodeCostModel(get_shape("tiny-test"), HARDWARE["h200"], dense_layers=5)
    with pytest.raises(ValueError, match="unknown hardware"):
        DecodeCostModel.for_preset("tiny-test", "tpu")
