"""One-bin edits of a BudgetSchedule along a ladder of candidate budgets, keeping it monotone.

A schedule holds one budget (tokens) per bin of cached length and is flat after its last entry. The ladder
is a sorted list of budgets (tokens); callers end it with ``DENSE_BUDGET`` so that the step above the largest
candidate keeps every page in that bin. Editing
bin ``i`` first writes out the flat tail explicitly where needed, so that raising bin ``i`` lifts every later
bin to at least the new value (monotone non-decreasing), and lowering bin ``i`` leaves later bins unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from sparrow_nemo.sparse.schedule import BudgetSchedule

#: suffix added to the name of a schedule changed at run time
ADAPTED_SUFFIX = "+adapted"


def _budgets_through(schedule: BudgetSchedule, last_bin: int) -> list[int]:
    """The schedule's budgets as a list covering bins 0..last_bin at least (flat tail written out)."""
    budgets = list(schedule.budgets)
    budgets += [budgets[-1]] * max(0, last_bin + 1 - len(budgets))
    return budgets


def _rebuilt(schedule: BudgetSchedule, budgets: list[int]) -> BudgetSchedule:
    name = schedule.name if schedule.name.endswith(ADAPTED_SUFFIX) else schedule.name + ADAPTED_SUFFIX
    return BudgetSchedule(
        bin_tokens=schedule.bin_tokens, budgets=tuple(budgets), page_size=schedule.page_size, name=name
    )


def bin_budget(schedule: BudgetSchedule, bin_index: int) -> int:
    """Budget (tokens) of bin ``bin_index`` (the last entry for bins past the end)."""
    return schedule.budgets[min(bin_index, len(schedule.budgets) - 1)]


def raise_bin(schedule: BudgetSchedule, bin_index: int, ladder: Sequence[int]) -> BudgetSchedule | None:
    """Bin ``bin_index`` -> the smallest ladder budget above its own; later bins lifted to at least that.

    Returns None when no ladder budget is larger (the bin is already at the top of the ladder).
    """
    current = bin_budget(schedule, bin_index)
    larger = [c for c in ladder if c > current]
    if not larger:
        return None
    new = min(larger)
    budgets = _budgets_through(schedule, bin_index)
    budgets[bin_index:] = [max(b, new) for b in budgets[bin_index:]]
    return _rebuilt(schedule, budgets)


def lower_bin(schedule: BudgetSchedule, bin_index: int, ladder: Sequence[int]) -> BudgetSchedule | None:
    """Bin ``bin_index`` -> the largest ladder budget below its own, but not below the previous bin's budget.

    Later bins keep their budgets. Returns None when no lower budget is allowed.
    """
    current = bin_budget(schedule, bin_index)
    smaller = [c for c in ladder if c < current]
    floor = bin_budget(schedule, bin_index - 1) if bin_index > 0 else 0
    if not smaller or max(max(smaller), floor) >= current:
        return None
    budgets = _budgets_through(schedule, bin_index + 1)
    budgets[bin_index] = max(max(smaller), floor)
    return _rebuilt(schedule, budgets)


def pointwise_max(a: BudgetSchedule, b: BudgetSchedule) -> BudgetSchedule:
    """Per-bin maximum of two schedules with the same bins (monotone inputs give a monotone result)."""
    if (a.bin_tokens, a.page_size) != (b.bin_tokens, b.page_size):
        raise ValueError(
            f"pointwise_max: schedules differ in bin_tokens/page_size: {a.bin_tokens}/{a.page_size} "
            f"vs {b.bin_tokens}/{b.page_size}"
        )
    last = max(len(a.budgets), len(b.budgets)) - 1
    merged = [max(x, y) for x, y in zip(_budgets_through(a, last), _budgets_through(b, last))]
    return a if list(a.budgets) == merged else _rebuilt(a, merged)
