"""benchmarks/rollout_speedup.py: its step-time integration and its CPU smoke mode (--tiny --device cpu).

On a GPU it runs standalone (the GPU window measures the engine through generate instead,
benchmarks/engine_rollout.py); here the script's logic is checked:
the regions it times cover every decode step with one budget each, the region sums are exact for step
times linear in the cached length, and the tiny run writes a complete, self-consistent JSON line.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from sparrow_nemo.model_shapes import get_shape
from sparrow_nemo.sparse.cost_model import DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("rollout_speedup")


@pytest.mark.parametrize("preset", ["qwen3-1.7b-0.86", "qwen3-8b-0.86", "qwen3-14b-0.86"])
def test_regions_cover_every_step_with_one_budget_each(bench: ModuleType, preset: str) -> None:
    schedule = BudgetSchedule.from_preset(preset)
    first, last = 512, 512 + 32768 - 1
    regions = bench.regions(first, last, schedule)
    assert regions[0].lo == first and regions[-1].hi == last
    assert all(a.hi + 1 == b.lo for a, b in itertools.pairwise(regions))
    assert sum(r.steps for r in regions) == 32768
    for r in regions:
        lo_b, hi_b = schedule.budget(r.lo), schedule.budget(r.hi)
        assert lo_b == hi_b, r  # one budget per region
        assert (r.lo > lo_b) == (r.hi > hi_b), r  # the budget binds throughout or nowhere
    assert len(regions) <= 2 * len(schedule.budgets)  # few windows to time: fits one device call


class _LinearDecoder:
    """Stands in for a StaticDecoder whose step at cached length L takes a + b * L ms (fake clock)."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b, self.clock_ms = a, b, 0.0
        self.engine = SimpleNamespace(device=torch.device("cpu"))
        self.seq_len = torch.zeros(1, dtype=torch.int64)
        self.step_idx = torch.ones(1, dtype=torch.int64)

    def run(self, n: int) -> None:
        for _ in range(n):
            self.seq_len += 1
            self.clock_ms += self.a + self.b * int(self.seq_len)


@pytest.mark.parametrize("lo,hi,steps", [(512, 2047, 4), (2000, 2003, 4), (7, 7, 4), (100, 109, 1)])
def test_region_sum_is_exact_for_linear_step_time(bench: ModuleType, lo: int, hi: int, steps: int) -> None:
    dec = _LinearDecoder(a=3.0, b=0.01)
    clock = bench.StepClock(dec, steps, now=lambda: dec.clock_ms / 1e3)
    total, points = clock.region_ms(bench.Region(lo, hi))
    exact = sum(3.0 + 0.01 * n for n in range(lo, hi + 1))
    assert total == pytest.approx(exact, rel=1e-9)
    assert all(lo - 1 <= x <= hi + 1 for x, _ in points)


def test_linear_at(bench: ModuleType) -> None:
    assert bench.linear_at(64, (16, 1.0), (32, 1.5)) == pytest.approx(2.5)
    assert bench.linear_at(16, (16, 1.0), (32, 1.5)) == pytest.approx(1.0)


def test_step_breakdown_adds_up(bench: ModuleType) -> None:
    stages = {
        f"{arm}_{s}_ms": v
        for arm in ("dense", "sparse")
        for s, v in (("select", 0.1), ("attend", 1.0), ("merge", 0.05))
    }
    stages.update(append_ms=0.01, sample_ms=0.2)
    shape = get_shape("qwen3-8b")
    out = bench.step_breakdown(stages, 50.0, shape, 2, "sparse")
    assert out["attend_ms"] == pytest.approx(36 * 1.0)
    parts = out["select_ms"] + out["attend_ms"] + out["merge_ms"] + out["append_ms"] + out["non_attention_ms"]
    assert parts == pytest.approx(50.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke mode; on a GPU the script is the check")
def test_tiny_cpu_run_writes_a_consistent_line(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "speedup.jsonl"
    # Batch 3 requested, 2 run (as when 64 does not fit a GPU): batch 3 is extrapolated from batches 1 and 2.
    rows = bench.main(["--tiny", "--device", "cpu", "--batches", "3", "--max-batch", "2", "--out", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == len(lines) == 1
    row = lines[0]
    assert row["model"] == "tiny-test" and row["batch"] == 2 and row["gen_len"] == 80
    ext = row["extrapolated"]
    assert ext["batch"] == 3 and ext["from_batches"] == [1, 2]
    for arm in ("dense", "sparse"):
        one, two = row[f"{arm}_decode_s_half_batch"], row[f"{arm}_decode_s"]
        assert ext[f"{arm}_decode_s"] == pytest.approx(2 * two - one)  # the line through (1, one), (2, two)
    assert ext["speedup"] == pytest.approx(ext["dense_decode_s"] / ext["sparse_decode_s"])
    for key in ("gpu", "driver", "torch", "triton", "date", "method", "copy_bandwidth_GBps"):
        assert key in row, key
    for arm in ("dense", "sparse"):
        assert row[f"{arm}_tok_s"] == pytest.approx(2 * 80 / row[f"{arm}_decode_s"])
        assert row[f"{arm}_decode_s"] > 0 and row[f"{arm}_points_ms"]
        br = row[f"{arm}_step_breakdown"]
        assert br["step_ms"] > 0 and br["attend_ms"] > 0
        e2e = row[f"{arm}_e2e"]
        assert e2e["e2e_gen"] == 4 and e2e["e2e_decode_s"] > 0 and e2e["model_decode_s"] > 0
    assert row["speedup"] == pytest.approx(row["dense_decode_s"] / row["sparse_decode_s"])
    minmax = row["minmax"]  # the key-bound score's select and append, timed beside the centroid's
    assert minmax["select_ms"] > 0 and minmax["append_ms"] > 0
    assert minmax["sparse_step_ms_estimate"] == pytest.approx(
        row["sparse_step_breakdown"]["step_ms"] + minmax["extra_ms_per_step"]
    )
    # The cost-model columns are the cost model's own numbers for this run.
    schedule = bench.TINY_SCHEDULE
    model = DecodeCostModel(
        get_shape("tiny-test"), Hardware("m", 989e12, row["copy_bandwidth_GBps"] * 1e9), dense_layers=1
    )
    dense = BudgetSchedule.dense(schedule.bin_tokens)
    mem = [model.rollout_cost(s, [80, 80], 16).memory_s for s in (dense, schedule)]
    assert row["memory_bound_speedup_limit"] == pytest.approx(mem[0] / mem[1])
    assert row["memory_bound_speedup_limit"] > 1.0
