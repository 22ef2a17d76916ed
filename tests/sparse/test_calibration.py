"""Calibration picks, per bin, the smallest candidate budget whose alpha tail meets the threshold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.sparse.attention import sparse_decode_attention
from sparrow_nemo.sparse.calibration import calibrate_schedule
from sparrow_nemo.sparse.mismatch import acceptance_rate
from sparrow_nemo.sparse.schedule import DENSE_BUDGET

BIN = 100


def cell_samples(tails: dict[int, dict[int, float]], tokens_per_cell: int = 40):
    """alpha = a cell's target tail for 95% of its tokens and 1.0 for the rest, so p5 == tail."""
    samples = {}
    for budget, per_bin in tails.items():
        alphas, lens = [], []
        for b, tail in per_bin.items():
            low = tokens_per_cell * 19 // 20
            alphas += [tail] * low + [1.0] * (tokens_per_cell - low)
            lens += [b * BIN + (j % BIN) for j in range(tokens_per_cell)]
        samples[budget] = (torch.tensor(alphas, dtype=torch.float64), torch.tensor(lens, dtype=torch.int64))
    return samples


def test_hand_table():
    tails = {
        64: {0: 0.90, 1: 0.80, 2: 0.95, 4: 0.5, 5: 0.5},
        128: {0: 0.95, 1: 0.87, 2: 0.96, 4: 0.7, 5: 0.9},
        256: {0: 0.99, 1: 0.93, 2: 0.99, 4: 0.8, 5: 0.95},
    }
    res = calibrate_schedule(cell_samples(tails), threshold=0.86, bin_tokens=BIN)
    # bin 0 -> 64; bin 1 -> 128; bin 2: 64 passes but monotone keeps 128; bin 3 empty inherits;
    # bin 4: nothing passes -> dense, and bin 5 stays dense by monotonicity.
    assert res.schedule.budgets == (64, 128, 128, 128, DENSE_BUDGET, DENSE_BUDGET)
    assert res.unsatisfied_bins == (4,) and res.empty_bins == (3,)
    assert res.tails[128][1] == pytest.approx(0.87)
    assert res.counts[64][0] == 40
    text = res.table()
    assert "0.870*" in text and "dense" in text and "p5 of alpha" in text
    assert res.to_dict()["schedule"]["budgets"][-1] == "dense"


def test_leading_empty_bins_and_min_tokens():
    tails = {32: {2: 0.7, 3: 0.9}, 64: {2: 0.9, 3: 0.95}}
    res = calibrate_schedule(cell_samples(tails), threshold=0.86, bin_tokens=BIN)
    assert res.schedule.budgets == (64, 64, 64, 64) and res.empty_bins == (0, 1)
    samples = cell_samples(tails)
    samples[16] = (torch.tensor([0.99]), torch.tensor([2 * BIN]))  # one token: below min_tokens
    res = calibrate_schedule(samples, threshold=0.86, bin_tokens=BIN, min_tokens=5)
    assert res.schedule.budgets[2] == 64 and 2 not in res.tails[16]
    assert calibrate_schedule(samples, threshold=0.86, bin_tokens=BIN).schedule.budgets[2] == 16


@settings(max_examples=50, deadline=None)
@given(
    grid=st.lists(
        st.lists(
            st.one_of(st.none(), st.sampled_from([0.5, 0.8, 0.85, 0.86, 0.9, 0.99])), min_size=1, max_size=6
        ),
        min_size=1,
        max_size=4,
    ),
    threshold=st.sampled_from([0.8, 0.86, 0.9]),
)
def test_matches_brute_force(grid, threshold):
    budgets = [32 * (j + 1) for j in range(len(grid))]
    tails = {b: {i: t for i, t in enumerate(row) if t is not None} for b, row in zip(budgets, grid)}
    if not any(tails.values()):
        with pytest.raises(ValueError, match="nothing to calibrate"):
            calibrate_schedule(cell_samples(tails), threshold=threshold, bin_tokens=BIN)
        return
    res = calibrate_schedule(cell_samples(tails), threshold=threshold, bin_tokens=BIN)
    num_bins = 1 + max(i for t in tails.values() for i in t)
    own = []  # per bin: minimal passing budget with data, DENSE when none passes, None when no data
    for i in range(num_bins):
        with_data = [b for b in budgets if i in tails[b]]
        passing = [b for b in with_data if tails[b][i] >= threshold]
        own.append(None if not with_data else min(passing, default=DENSE_BUDGET))
    first = next(b for b in own if b is not None)
    expected = [max([first] + [b for b in own[: i + 1] if b is not None]) for i in range(num_bins)]
    assert list(res.schedule.budgets) == expected
    for i, b in enumerate(res.schedule.budgets):  # never below a bin's own minimal passing budget
        if own[i] is not None:
            assert b >= own[i]
            if own[i] != DENSE_BUDGET:
                assert tails[own[i]][i] >= threshold
    assert res.unsatisfied_bins == tuple(i for i, b in enumerate(own) if b == DENSE_BUDGET)


def test_with_real_sparse_attention_alpha():
    """End to end on a toy 'model' (one attention head + LM head): larger budgets raise the tail."""
    gen = torch.Generator().manual_seed(0)
    length, dim, vocab, n = 192, 16, 32, 24
    k = torch.randn(n, 1, length, dim, generator=gen)
    v = torch.randn(n, 1, length, dim, generator=gen)
    q = torch.randn(n, 2, dim, generator=gen) * 2
    head = torch.randn(2 * dim, vocab, generator=gen)
    cached = 17 + torch.arange(n) * (length - 18) // (n - 1)  # 17..191: three bins of 64 tokens

    def logprobs(budget):
        out = sparse_decode_attention(q, k, v, cached, budget, page_size=8)
        return torch.log_softmax(out.reshape(n, -1) @ head, dim=-1)

    dense = logprobs(DENSE_BUDGET)
    candidates = (24, 48, 96, 144, DENSE_BUDGET)
    samples = {b: (acceptance_rate(dense, logprobs(b)), cached) for b in candidates}
    assert torch.allclose(samples[DENSE_BUDGET][0], torch.ones(n))
    res = calibrate_schedule(samples, threshold=0.8, bin_tokens=64, page_size=8)
    assert res.schedule.budgets == (96, 96, 144) and not res.unsatisfied_bins
    for i, chosen in enumerate(res.schedule.budgets):
        assert res.tails[chosen][i] >= 0.8
        assert all(res.tails[b][i] < 0.8 for b in candidates if b < chosen)
    assert [res.tails[b][2] for b in candidates] == sorted(res.tails[b][2] for b in candidates)


def test_bad_calibration_input():
    good = (torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="at least one"):
        calibrate_schedule({})
    with pytest.raises(ValueError, match="candidate budget 40"):
        calibrate_schedule({40: good})
    with pytest.raises(ValueError, match="threshold"):
        calibrate_schedule({32: good}, threshold=86)
    with pytest.raises(ValueError, match="cached_len"):
        calibrate_schedule({32: (torch.ones(2), torch.ones(2))})
