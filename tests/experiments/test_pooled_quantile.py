"""The per-bin p5 of an arm is the 5th percentile of its pooled tokens (read off the summed per-bin
histograms the runs log), not the mean of the per-step p5s; the two differ in both directions here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sparrow_nemo.experiments.analysis import (
    POOLED,
    STEP_MEAN,
    RunData,
    _pool_bins,
    _summed_bin_histograms,
    histogram_quantile,
)
from sparrow_nemo.experiments.arms import Arm
from sparrow_nemo.grpo.step_batch import BIN_HISTOGRAM_BINS, merged_histograms
from sparrow_nemo.run_io.metrics import HISTOGRAMS_FILE, MetricsWriter

ARM = Arm("a", "fixed", ())


def _step_alphas() -> list[torch.Tensor]:
    """Bin 1's tokens in two steps of 100: step 0 has 6 at 0.305 (its own p5 ~0.3), step 1 none below 1
    (p5 1.0). Pooled: 6 of 200 tokens (3 %) are low, so the pooled p5 is ~1.0; the mean of p5s ~0.65."""
    return [torch.cat([torch.full((6,), 0.305), torch.ones(94)]), torch.ones(100)]


def _run(tmp_path: Path, alphas: list[torch.Tensor], seed: int) -> RunData:
    (tmp_path / f"seed_{seed}").mkdir(exist_ok=True)
    writer = MetricsWriter(tmp_path / f"seed_{seed}", jsonl=True)
    rows = []
    for step, alpha in enumerate(alphas):
        (h,) = merged_histograms([(alpha, 0.0, 1.0)], BIN_HISTOGRAM_BINS)
        p5 = float(torch.quantile(alpha.double(), 0.05))
        row = {
            "step": step,
            "acceptance/p5/bin_1": p5,
            "acceptance/mean/bin_1": float(alpha.mean()),
            "acceptance/tokens/bin_1": float(alpha.numel()),
        }
        writer.write(step, {k: v for k, v in row.items() if k != "step"}, {"acceptance/histogram/bin_1": h})
        rows.append(row)
    writer.close()
    hists = _summed_bin_histograms(tmp_path / f"seed_{seed}" / HISTOGRAMS_FILE)
    return RunData(ARM, seed, {}, rows, {}, 8, hists)


def test_histogram_quantile_interpolates_inside_the_bin() -> None:
    (h,) = merged_histograms([(torch.linspace(0.0, 1.0, 10_001), 0.0, 1.0)], BIN_HISTOGRAM_BINS)
    for q in (0.01, 0.05, 0.5, 0.95):
        assert histogram_quantile(h, q) == pytest.approx(q, abs=0.01)
    (empty,) = merged_histograms([(torch.zeros(0), 0.0, 1.0)], BIN_HISTOGRAM_BINS)
    assert math.isnan(histogram_quantile(empty, 0.05))


def test_pooled_p5_is_the_quantile_of_the_pooled_tokens(tmp_path: Path) -> None:
    run = _run(tmp_path, _step_alphas(), seed=0)
    assert run.bin_histograms[1].total == 200
    bins, how = _pool_bins([run])
    assert how == POOLED
    pooled = float(torch.quantile(torch.cat(_step_alphas()).double(), 0.05))
    assert pooled == pytest.approx(1.0)
    assert bins[1]["p5"] == pytest.approx(pooled, abs=0.01)
    assert bins[1]["mean"] == pytest.approx(float(torch.cat(_step_alphas()).double().mean()), abs=1e-9)
    assert bins[1]["tokens"] == 200
    # the old rule (mean of the per-step p5s) reads ~0.65: far from the pooled tokens' p5
    stripped = RunData(ARM, 0, {}, run.rows, {}, 8)
    averaged, how = _pool_bins([stripped])
    assert how == STEP_MEAN and averaged[1]["p5"] < 0.7


def test_pooled_p5_across_seeds_can_be_lower_than_every_mean(tmp_path: Path) -> None:
    """Seed 0: 20 of 100 tokens at 0.505 (p5 0.505); seed 1: 100 at 1.0 (p5 1). Pooled 10 % low: p5 ~0.5."""
    low = torch.cat([torch.full((20,), 0.505), torch.ones(80)])
    runs = [_run(tmp_path, [low], 0), _run(tmp_path, [torch.ones(100)], 1)]
    bins, how = _pool_bins(runs)
    assert how == POOLED
    assert bins[1]["p5"] == pytest.approx(0.505, abs=0.01)
    averaged, _ = _pool_bins([RunData(ARM, r.seed, {}, r.rows, {}, 8) for r in runs])
    assert averaged[1]["p5"] == pytest.approx(0.75, abs=0.01)  # what the old rule reported


def test_a_run_without_per_bin_histograms_falls_back_for_the_whole_arm(tmp_path: Path) -> None:
    runs = [
        _run(tmp_path, _step_alphas(), 0),
        RunData(ARM, 1, {}, _run(tmp_path, _step_alphas(), 1).rows, {}, 8),
    ]
    assert _pool_bins(runs)[1] == STEP_MEAN
