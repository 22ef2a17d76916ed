"""``TailScheduler.decide`` as a pure function: constructed reports in, a :class:`Decision` out, nothing changed.

Each report's tails are given directly (``BinTail``), so the rule is tested apart from the statistics: a bin is
below when its upper bound is under the threshold, well above when its lower bound clears threshold +
lower_margin.
"""

from __future__ import annotations

import dataclasses

import pytest

from sparrow_nemo.control import Decision, SchedulerState, StepReport, TailScheduler
from sparrow_nemo.control.scheduler import SchedulerConfig
from sparrow_nemo.control.tail_stats import BinTail
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

BIN = 100
START = BudgetSchedule(bin_tokens=BIN, budgets=(512, 768, 1024), name="start")


def rule(**config) -> TailScheduler:
    return TailScheduler(
        threshold=0.86,
        quantile=0.05,
        noise_z=2.0,
        bin_tokens=BIN,
        min_bin_tokens=200,
        candidates=(1024, 512, 1536, 768),  # sorted by the rule
        config=SchedulerConfig(**config),
    )


def report(
    tails: dict[int, tuple[float, float, float]], step: int = 0, reward: float = 1.0, tokens: int = 400
):
    """{bin: (lcb, value, ucb)} -> a StepReport of those tails under START."""
    cells = tuple(BinTail(b, tokens, v, lo, hi) for b, (lo, v, hi) in sorted(tails.items()))
    return StepReport(step, START, cells, 0.05, 2.0, reward, 100.0)


PASS = (0.95, 0.97, 0.99)  # well above 0.86 + 0.04
FAIL = (0.60, 0.70, 0.80)  # ucb < 0.86
NOISY = (0.80, 0.85, 0.90)  # value below, but ucb above: not significant


def test_a_bin_under_the_threshold_grows_one_rung_and_later_bins_follow() -> None:
    r = report({0: PASS, 1: FAIL, 2: PASS})
    d = rule().decide(r, START)
    assert isinstance(d, Decision) and d.schedule is not None
    assert d.schedule.budgets == (512, 1024, 1024) and not d.calibrate and not d.guard_fired
    assert d.actions == ({"bin": 1, "action": "raise", "from": 768, "to": 1024},)
    assert "bin 1: raise 768 -> 1024" in d.reason
    assert d.state.started and d.state.recent == ((1.0, 100.0),)


def test_all_bins_passing_changes_nothing_under_raise() -> None:
    d = rule(adapt="raise").decide(report({0: PASS, 1: PASS, 2: NOISY}), START)
    assert d.schedule is None and d.actions == () and d.reason == ""


def test_all_bins_passing_shrinks_after_patience_under_raise_and_lower() -> None:
    r, state = rule(adapt="raise_and_lower", patience=2), SchedulerState()
    first = r.decide(report({1: PASS}), START, state)
    assert first.schedule is None and first.state.above_streak == {1: 1}
    second = r.decide(report({1: PASS}, step=1), START, first.state)
    assert second.schedule is not None and second.schedule.budgets == (512, 512, 1024)
    assert second.actions == ({"bin": 1, "action": "lower", "from": 768, "to": 512},)
    assert second.state.above_streak == {}


def test_off_decides_nothing_and_the_top_of_the_ladder_is_dense() -> None:
    assert rule(adapt="off").decide(report({1: FAIL}), START).schedule is None
    at_1536 = BudgetSchedule(bin_tokens=BIN, budgets=(512, 1536), name="x")
    d = rule().decide(dataclasses.replace(report({1: FAIL}), schedule=at_1536), at_1536)
    assert d.schedule.budgets == (512, DENSE_BUDGET)
    dense = d.schedule
    d = rule().decide(dataclasses.replace(report({1: FAIL}), schedule=dense), dense)
    assert d.actions == ({"bin": 1, "action": "at_top", "from": DENSE_BUDGET, "to": None},)


def test_small_bins_get_no_decision() -> None:
    assert rule().decide(report({1: FAIL}, tokens=199), START).schedule is None


def test_collapse_guard_decides_dense_with_its_reason() -> None:
    r = rule(
        collapse_window=5, collapse_min_steps=3, collapse_smooth=1, collapse_noise_z=0.0, collapse_drop=0.3
    )
    state = SchedulerState(started=True, recent=((1.0, 100.0),) * 3)
    d = r.decide(report({1: FAIL}, step=3, reward=0.5), START, state)
    assert d.guard_fired and d.schedule is not None and d.schedule.is_dense and d.state.collapsed
    assert d.reason.startswith("collapse guard: step 3: reward 0.5000") and "[1]" in d.reason
    after = r.decide(report({1: FAIL}, step=4), d.schedule, d.state)  # collapsed: no more decisions
    assert after.schedule is None and not after.guard_fired


def test_decide_is_pure() -> None:
    r, state = rule(adapt="raise_and_lower", patience=1), SchedulerState(above_streak={2: 3})
    before = (dataclasses.replace(state, above_streak=dict(state.above_streak)), START.to_dict())
    once = r.decide(report({1: FAIL, 2: PASS}), START, state)
    twice = r.decide(report({1: FAIL, 2: PASS}), START, state)
    assert once == twice
    assert (state, START.to_dict()) == before


def test_start_decision_calibrates_once_and_puts_a_dense_schedule_on_the_rules_bins() -> None:
    r = dataclasses.replace(rule(), calibrate=True)
    start = r.decide(None, BudgetSchedule.dense())  # 2000-token bins
    assert start.calibrate and start.schedule == BudgetSchedule.dense(bin_tokens=BIN) and start.state.started
    assert not r.decide(None, START, start.state).calibrate  # resumed: no second pass
    assert not rule().decide(None, START).calibrate


def test_mismatched_reports_are_refused() -> None:
    with pytest.raises(ValueError, match=r"quantile 0\.01"):
        rule().decide(dataclasses.replace(report({1: FAIL}), quantile=0.01), START)
    other = BudgetSchedule(bin_tokens=50, budgets=(512,), name="o")
    with pytest.raises(ValueError, match="bin_tokens=100 but schedule 'o' has bin_tokens=50"):
        rule().decide(report({1: FAIL}), other)
