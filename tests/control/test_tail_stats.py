"""Per-bin tail with confidence bounds: values against numpy, counts by brute force, interval coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparrow_nemo.control.tail_stats import bin_tails, confidence_levels, sequence_se
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


def test_sequence_se_matches_the_cluster_formula() -> None:
    """sequence_se against the ratio estimator's variance written out per bin with numpy."""
    g = torch.Generator().manual_seed(3)
    n = 2000
    alpha = torch.rand(n, generator=g) ** 0.3
    bins = torch.randint(0, 3, (n,), generator=g)
    sequence = torch.randint(0, 25, (n,), generator=g)
    sequence[bins == 2] = 7  # bin 2 holds one sequence: no spread to estimate
    values = torch.tensor([0.4, 0.5, 0.6], dtype=torch.float64)
    counts = torch.bincount(bins, minlength=4)  # bin 3 is empty
    got = sequence_se(alpha, bins, sequence, torch.cat([values, torch.zeros(1, dtype=torch.float64)]), counts)
    a, b, s = alpha.double().numpy(), bins.numpy(), sequence.numpy()
    for k in range(2):
        ids = np.unique(s[b == k])
        m = np.array([np.sum((b == k) & (s == i)) for i in ids], dtype=np.float64)
        c = np.array([np.sum((b == k) & (s == i) & (a <= values[k].item())) for i in ids], dtype=np.float64)
        frac = c.sum() / m.sum()
        want = math.sqrt(len(ids) / (len(ids) - 1) * np.sum((c - frac * m) ** 2)) / m.sum()
        assert float(got[k]) == pytest.approx(want, rel=1e-9)
    assert math.isinf(float(got[2])) and float(got[3]) == 0.0


def test_sequence_bounds_widen_only_where_misses_cluster() -> None:
    """40 sequences of 50 tokens in one bin, 2% of tokens low: spread over all sequences the bound is the
    binomial one (within noise); all in one sequence it widens to cover the sequences' spread."""
    n_seq, per = 40, 50
    sequence = torch.arange(n_seq).repeat_interleave(per)
    cached = torch.zeros(n_seq * per, dtype=torch.int64)
    spread = torch.ones(n_seq * per)
    spread[::per] = 0.5  # one low token in each sequence
    clustered = torch.ones(n_seq * per)
    clustered[:per] = 0.5  # one sequence's tokens all low
    for alpha in (spread, clustered):
        alpha += torch.linspace(0, 1e-3, alpha.numel())  # distinct values
    (token,) = bin_tails(clustered, cached, 10, quantile=0.01, z=2.0)
    (by_seq,) = bin_tails(clustered, cached, 10, quantile=0.01, z=2.0, sequence=sequence)
    assert by_seq.value == token.value and by_seq.ucb > token.ucb + 0.4  # the ucb moves past the low cluster
    (token,) = bin_tails(spread, cached, 10, quantile=0.01, z=2.0)
    (by_seq,) = bin_tails(spread, cached, 10, quantile=0.01, z=2.0, sequence=sequence)
    assert (by_seq.lcb, by_seq.ucb) == (token.lcb, token.ucb)  # never narrower, and no wider here
    with pytest.raises(ValueError, match="sequence"):
        bin_tails(spread, cached, 10, sequence=sequence[:-1])


def test_sequence_interval_covers_clustered_data() -> None:
    """Each sequence's alphas shift together (a hard prompt): the token-counting interval misses the true p5
    far more often than 5%, the sequence-counting one about as often as its 2 sigma say."""
    g = torch.Generator().manual_seed(4)
    n_seq, per, trials = 30, 60, 200

    def draw(k: int) -> torch.Tensor:
        shift = torch.randn(k, 1, generator=g, dtype=torch.float64)
        return torch.sigmoid(2.0 + shift + 0.3 * torch.randn(k, per, generator=g, dtype=torch.float64))

    truth = float(torch.quantile(draw(20000).flatten(), 0.05))
    sequence = torch.arange(n_seq).repeat_interleave(per)
    cached = torch.zeros(n_seq * per, dtype=torch.int64)
    covered = {"token": 0, "sequence": 0}
    for _ in range(trials):
        alpha = draw(n_seq).flatten()
        (t,) = bin_tails(alpha, cached, 10, quantile=0.05, z=2.0)
        (s,) = bin_tails(alpha, cached, 10, quantile=0.05, z=2.0, sequence=sequence)
        covered["token"] += t.lcb <= truth <= t.ucb
        covered["sequence"] += s.lcb <= truth <= s.ucb
    assert covered["token"] / trials < 0.5, covered  # ~0.25
    assert covered["sequence"] / trials >= 0.85, covered  # ~0.9
