"""One-bin schedule edits: exact results on small cases and monotonicity invariants (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.control.schedule_edit import (
    ADAPTED_SUFFIX,
    bin_budget,
    lower_bin,
    pointwise_max,
    raise_bin,
)
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

LADDER = [512, 768, 1024, 1536, DENSE_BUDGET]


def _sched(*budgets: int) -> BudgetSchedule:
    return BudgetSchedule(bin_tokens=100, budgets=budgets, name="s")


def _budgets_over(schedule: BudgetSchedule, n: int) -> list[int]:
    """Budget of bins 0..n-1 read through BudgetSchedule.budget (an independent path to the values)."""
    return [schedule.budget(b * schedule.bin_tokens) for b in range(n)]


def test_raise_lifts_later_bins_and_keeps_earlier() -> None:
    s = _sched(512, 768, 1024)
    assert raise_bin(s, 0, LADDER).budgets == (768, 768, 1024)
    assert raise_bin(s, 1, LADDER).budgets == (512, 1024, 1024)
    assert raise_bin(s, 2, LADDER).budgets == (512, 768, 1536)
    assert _budgets_over(raise_bin(s, 5, LADDER), 8) == [512, 768, 1024, 1024, 1024, 1536, 1536, 1536]


def test_raise_from_off_ladder_budget_and_at_the_top() -> None:
    assert raise_bin(_sched(640), 0, LADDER).budgets == (768,)
    assert raise_bin(_sched(512, 1536), 1, LADDER).budgets == (512, DENSE_BUDGET)
    assert raise_bin(_sched(512, DENSE_BUDGET), 1, LADDER) is None
    assert raise_bin(BudgetSchedule.dense(), 3, LADDER) is None


def test_lower_respects_previous_bin_and_keeps_later_bins() -> None:
    s = _sched(512, 768, 1024)
    assert _budgets_over(lower_bin(s, 2, LADDER), 5) == [512, 768, 768, 1024, 1024]
    assert lower_bin(s, 1, LADDER).budgets == (512, 512, 1024)
    assert lower_bin(s, 0, LADDER) is None  # nothing below 512
    assert lower_bin(_sched(768, 768), 1, LADDER) is None  # previous bin is the floor
    assert lower_bin(_sched(512, 1536), 1, LADDER).budgets == (512, 1024, 1536)
    assert lower_bin(_sched(512, DENSE_BUDGET), 1, LADDER).budgets == (512, 1536, DENSE_BUDGET)


def test_edited_schedule_keeps_bin_width_page_size_and_marks_name_once() -> None:
    s = BudgetSchedule(bin_tokens=128, budgets=(64, 96), page_size=32, name="tiny")
    once = raise_bin(s, 0, [64, 96, 128])
    twice = raise_bin(once, 1, [64, 96, 128])
    assert (once.bin_tokens, once.page_size, once.name) == (128, 32, "tiny" + ADAPTED_SUFFIX)
    assert twice.name == "tiny" + ADAPTED_SUFFIX


ladders = st.lists(st.integers(1, 64), min_size=1, max_size=8, unique=True).map(
    lambda v: sorted(x * 16 for x in v)
)


@st.composite
def schedule_and_ladder(draw):
    ladder = [*draw(ladders), DENSE_BUDGET]
    budgets = sorted(draw(st.lists(st.sampled_from(ladder), min_size=1, max_size=6)))
    return _sched(*budgets), ladder, draw(st.integers(0, 8))


@settings(max_examples=150, deadline=None)
@given(schedule_and_ladder())
def test_raise_and_lower_invariants(case) -> None:
    schedule, ladder, b = case
    n = 10
    before = _budgets_over(schedule, n)
    raised = raise_bin(schedule, b, ladder)
    if raised is None:
        assert before[b] == ladder[-1]
    else:
        after = _budgets_over(raised, n)
        assert after == sorted(after)
        assert after[b] == min(c for c in ladder if c > before[b])
        assert after[:b] == before[:b]
        assert all(a == max(x, after[b]) for a, x in zip(after[b:], before[b:]))
    lowered = lower_bin(schedule, b, ladder)
    floor = before[b - 1] if b else 0
    smaller = [c for c in ladder if c < before[b]]
    if lowered is None:
        assert not smaller or max(max(smaller), floor) == before[b]
    else:
        after = _budgets_over(lowered, n)
        assert after == sorted(after)
        assert after[b] == max(max(smaller), floor) < before[b]
        assert after[:b] + after[b + 1 :] == before[:b] + before[b + 1 :]
        assert bin_budget(lowered, b) == after[b]


def test_pointwise_max() -> None:
    a, b = _sched(512, 1024), _sched(768, 768, 1536)
    assert pointwise_max(a, b).budgets == (768, 1024, 1536)
    assert pointwise_max(a, _sched(512)) is a
    with pytest.raises(ValueError, match="bin_tokens"):
        pointwise_max(a, BudgetSchedule(bin_tokens=7, budgets=(512,)))
