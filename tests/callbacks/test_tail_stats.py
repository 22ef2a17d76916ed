"""Per-bin tail with confidence bounds: values against numpy, counts by brute force, interval coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparrow_nemo.callbacks.tail_stats import bin_tails, confidence_levels
from sparrow_nemo.sparse.mismatch import tail_by_bin


def test_confidence_levels_formula() -> None:
    low, high = confidence_levels(400, 0.05, 2.0)
    se = math.sqrt(0.05 * 0.95 / 400)
    assert low == pytest.approx(0.05 - 2 * se) and high == pytest.approx(0.05 + 2 * se)
    assert confidence_levels(3, 0.05, 2.0) == (0.0, pytest.approx(0.05 + 2 * math.sqrt(0.0475 / 3)))
    with pytest.raises(ValueError, match="tokens"):
        confidence_levels(0, 0.05, 2.0)


def test_bin_tails_match_numpy_and_tail_by_bin() -> None:
    g = torch.Generator().manual_seed(1)
    alpha = torch.rand(3000, generator=g) ** 0.2
    cached_len = torch.randint(0, 1000, (3000,), generator=g)
    tails = bin_tails(alpha, cached_len, bin_tokens=300, quantile=0.05, z=2.0)
    reference = tail_by_bin(alpha, cached_len, 300, 0.05)
    assert [t.bin for t in tails] == sorted(reference) == [0, 1, 2, 3]
    a, c = alpha.numpy().astype(np.float64), cached_len.numpy()
    for t in tails:
        values = a[c // 300 == t.bin]
        low, high = confidence_levels(len(values), 0.05, 2.0)
        assert t.tokens == len(values)
        assert t.value == pytest.approx(np.quantile(values, 0.05), abs=1e-12)
        assert t.value == pytest.approx(reference[t.bin], abs=1e-12)
        assert t.lcb == pytest.approx(np.quantile(values, low), abs=1e-12)
        assert t.ucb == pytest.approx(np.quantile(values, high), abs=1e-12)
        assert t.lcb <= t.value <= t.ucb


def test_interval_covers_the_true_quantile_about_95_percent() -> None:
    """Uniform(0, 1) alpha: the true p5 is 0.05; a 2-sigma interval should cover it ~95% of the time."""
    g = torch.Generator().manual_seed(2)
    trials, n = 300, 400
    alpha = torch.rand(trials, n, generator=g, dtype=torch.float64)
    covered = 0
    for row in alpha:
        (t,) = bin_tails(row, torch.zeros(n, dtype=torch.int64), bin_tokens=10, quantile=0.05, z=2.0)
        covered += t.lcb <= 0.05 <= t.ucb
    assert 0.90 <= covered / trials <= 0.995


def test_bin_tails_edge_cases() -> None:
    assert bin_tails(torch.zeros(0), torch.zeros(0, dtype=torch.int64), 10) == []
    (t,) = bin_tails(torch.tensor([0.3]), torch.tensor([5]), 10)
    assert (t.tokens, t.value, t.lcb, t.ucb) == (
        1,
        pytest.approx(0.3),
        pytest.approx(0.3),
        pytest.approx(0.3),
    )
    with pytest.raises(ValueError, match="bin_tokens"):
        bin_tails(torch.ones(2), torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="cached_len"):
        bin_tails(torch.ones(2), torch.zeros(2), 10)
    with pytest.raises(ValueError, match="quantile"):
        bin_tails(torch.ones(2), torch.zeros(2, dtype=torch.int64), 10, quantile=1.0)
