"""Schedule calibration: per bin of cached length, the smallest KV budget whose alpha tail passes.

Input: for each candidate budget (tokens), the per-token acceptance rates alpha of rollouts
generated sparse with that fixed budget and scored dense, with each token's cached length. The
tail of a (budget, bin) cell is the ``quantile`` (default 5th percentile) of alpha over that bin's
tokens (:func:`sparrow_nemo.sparse.mismatch.tail_by_bin`). In every bin the chosen budget is the
smallest candidate with tail >= threshold; budgets are then made non-decreasing across bins (a
bin never gets less than the bin before it). Bins where no candidate has data inherit the
previous bin's budget (leading ones take the first calibrated bin's budget). A bin with data that
no candidate satisfies is reported in ``unsatisfied_bins`` and falls back to dense there (and, by
monotonicity, in every later bin).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sparrow_nemo.sparse.mismatch import tail_by_bin, tail_name
from sparrow_nemo.sparse.pattern import PAGE_SIZE
from sparrow_nemo.sparse.schedule import (
    DENSE_BUDGET,
    PAPER_BIN_TOKENS,
    RESERVED_PAGES,
    BudgetSchedule,
)

__all__ = ["PAPER_CANDIDATE_BUDGETS", "CalibrationResult", "calibrate_schedule"]

#: The paper's 18 calibration candidates in top-k pages; with the 3 reserved pages of 16 tokens they are
#: the candidate budgets 512 ... 16,384 tokens (docs/METHOD.md).
PAPER_CANDIDATE_PAGES = (29, 45, 61, 77, 93, 125, 157, 189, 221, 253, 317, 381, 445, 509, 637, 765, 893, 1021)
PAPER_CANDIDATE_BUDGETS: tuple[int, ...] = tuple(
    (k + RESERVED_PAGES) * PAGE_SIZE for k in PAPER_CANDIDATE_PAGES
)


@dataclass(frozen=True)
class CalibrationResult:
    """What calibration decided and the evidence for it.

    Attributes:
        schedule: the calibrated schedule (one budget per bin up to the last bin with data).
        threshold: minimum tail alpha required per bin; quantile: the tail level (0.05 = p5).
        tails: {budget_tokens: {bin: tail alpha}} for cells holding >= min_tokens tokens.
        counts: {budget_tokens: {bin: tokens}} for every cell with data.
        unsatisfied_bins: bins with data where no candidate reached the threshold (dense there).
        empty_bins: bins without enough data for any candidate (budget inherited).
    """

    schedule: BudgetSchedule
    threshold: float
    quantile: float
    tails: dict[int, dict[int, float]]
    counts: dict[int, dict[int, int]]
    unsatisfied_bins: tuple[int, ...]
    empty_bins: tuple[int, ...]

    def table(self) -> str:
        """Per-bin tail table as aligned text: one row per bin, one column per candidate budget.

        The chosen budget's cell is marked with '*'; '-' means no data; 'dense' marks a fallback.
        """
        budgets = sorted(self.tails)
        header = ["bin", "cached_len", *(_fmt_budget(b) for b in budgets), "chosen"]
        rows = [header]
        bin_tokens = self.schedule.bin_tokens
        for i, chosen in enumerate(self.schedule.budgets):
            cells = [str(i), f"{i * bin_tokens}-{(i + 1) * bin_tokens - 1}"]
            for b in budgets:
                tail = self.tails[b].get(i)
                cells.append("-" if tail is None else f"{tail:.3f}{'*' if b == chosen else ''}")
            cells.append(_fmt_budget(chosen))
            rows.append(cells)
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        title = f"{tail_name(self.quantile)} of alpha per bin (threshold {self.threshold})"
        return "\n".join([title, *lines])

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-friendly dict (string keys for the budget and bin levels)."""
        return {
            "threshold": self.threshold,
            "quantile": self.quantile,
            "schedule": self.schedule.to_dict(),
            "tails": {_fmt_budget(b): {str(i): v for i, v in t.items()} for b, t in self.tails.items()},
            "counts": {_fmt_budget(b): {str(i): v for i, v in c.items()} for b, c in self.counts.items()},
            "unsatisfied_bins": list(self.unsatisfied_bins),
            "empty_bins": list(self.empty_bins),
        }


def _fmt_budget(budget: int) -> str:
    return "dense" if budget == DENSE_BUDGET else str(budget)


def calibrate_schedule(
    samples: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    threshold: float = 0.86,
    bin_tokens: int = PAPER_BIN_TOKENS,
    quantile: float = 0.05,
    page_size: int = PAGE_SIZE,
    min_tokens: int = 1,
    name: str = "calibrated",
) -> CalibrationResult:
    """Build the per-bin tail table and the schedule using the smallest passing budget per bin.

    Args:
        samples: {candidate budget in tokens: (alpha [N] float, cached_len [N] integer tokens)},
            one entry per fixed-budget calibration run. Budgets must be positive multiples of
            page_size (or DENSE_BUDGET).
        threshold: required tail alpha, e.g. 0.86. quantile: tail level (0.05 = 5th percentile).
        bin_tokens: bin width in tokens of cached length. page_size: tokens per KV page.
        min_tokens: a (budget, bin) cell with fewer tokens counts as having no data.
        name: the calibrated schedule's name.

    Returns:
        :class:`CalibrationResult` with the schedule, the tail table and the reported bins.
    """
    if not samples:
        raise ValueError("calibrate_schedule needs at least one candidate budget in samples")
    if not 0.0 <= threshold <= 1.0 or not 0.0 <= quantile <= 1.0:
        raise ValueError(f"threshold and quantile must lie in [0, 1], got {threshold} and {quantile}")
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    for budget in samples:
        if budget <= 0 or (budget != DENSE_BUDGET and budget % page_size):
            raise ValueError(
                f"candidate budget {budget} must be a positive multiple of page_size={page_size} tokens"
            )

    tails: dict[int, dict[int, float]] = {}
    counts: dict[int, dict[int, int]] = {}
    for budget in sorted(samples):
        alpha, cached_len = samples[budget]
        tail = tail_by_bin(alpha, cached_len, bin_tokens, quantile)
        per_bin = torch.bincount(cached_len.to(torch.int64) // bin_tokens) if cached_len.numel() else None
        counts[budget] = {i: int(per_bin[i]) for i in tail} if per_bin is not None else {}
        tails[budget] = {i: v for i, v in tail.items() if counts[budget][i] >= min_tokens}

    num_bins = 1 + max((i for t in tails.values() for i in t), default=-1)
    if num_bins == 0:
        raise ValueError(f"no candidate has a bin with >= {min_tokens} tokens; nothing to calibrate")

    chosen: list[int | None] = []
    unsatisfied, empty = [], []
    for i in range(num_bins):
        eligible = [b for b in sorted(tails) if i in tails[b]]
        if not eligible:
            empty.append(i)
            chosen.append(None)
            continue
        passing = [b for b in eligible if tails[b][i] >= threshold]
        if not passing:
            unsatisfied.append(i)
        chosen.append(passing[0] if passing else DENSE_BUDGET)

    first = next(b for b in chosen if b is not None)
    budgets: list[int] = []
    for b in chosen:
        previous = budgets[-1] if budgets else first
        budgets.append(previous if b is None else max(b, previous))

    schedule = BudgetSchedule(bin_tokens=bin_tokens, budgets=tuple(budgets), page_size=page_size, name=name)
    return CalibrationResult(
        schedule=schedule,
        threshold=threshold,
        quantile=quantile,
        tails=tails,
        counts=counts,
        unsatisfied_bins=tuple(unsatisfied),
        empty_bins=tuple(empty),
    )
