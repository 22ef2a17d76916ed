"""The recipe's ``sparsity`` section: the sparse pattern, the budget schedule, the tail requirement.

Defaults are the paper's (16-token pages, 2,000-token bins, 2 dense layers, p5 >= 0.86; docs/METHOD.md);
``recipes/tiny_cpu.yaml`` states the tiny model's scaled geometry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, OPEN_UNIT, knob
from sparrow_nemo.sparse.mismatch import PAPER_QUANTILE
from sparrow_nemo.sparse.pattern import SparsePattern
from sparrow_nemo.sparse.schedule import PAPER_BIN_TOKENS, BudgetSchedule

__all__ = ["SparsityConfig"]


@dataclass(frozen=True)
class SparsityConfig(SparsePattern):
    """Sparse decode attention during rollout and its schedule (the pattern's keys come first)."""

    renamed_keys: ClassVar[dict[str, str]] = {
        "adapt": "it moved: control.scheduler.adapt",
        "collapse_guard": "it moved: control.scheduler.collapse_guard",
        "calibrate": "it moved: control.calibrate",
        "calibration": "it moved: control.calibration",
    }

    schedule: str = knob(
        "dense",
        "preset ('qwen3-1.7b-0.86', 'dense', 'fixed:<tokens>' in this section's pages and bins), a schedule "
        "YAML path (relative to the working directory), or 'explicit' (= budgets, bin_tokens, page_size)",
    )
    budgets: tuple[int, ...] | None = knob(
        None, "budgets per bin in tokens (reserved pages included); read only when schedule=explicit"
    )
    threshold: float = knob(0.86, "acceptance-rate tail to keep in every bin", check=OPEN_UNIT)
    quantile: float = knob(
        PAPER_QUANTILE, "quantile of the per-token acceptance rate that defines the tail", check=OPEN_UNIT
    )
    bin_tokens: int = knob(
        PAPER_BIN_TOKENS,
        "bin width in tokens of cached length (tail statistics; explicit schedules)",
        check=AT_LEAST_ONE,
    )
    noise_z: float = knob(
        2.0,
        "a bin fails only when its tail is below threshold by more than this many standard errors of the "
        "quantile estimate (binomial confidence bound)",
        check=NON_NEGATIVE,
    )
    noise_unit: Literal["token", "sequence"] = knob(
        "token",
        "what the bound counts as independent: tokens (binomial), or sequences (a sequence's tokens share its "
        "prompt and path, so its misses come together: the cluster-robust bound, never narrower; "
        "control/tail_stats.py)",
    )
    min_bin_tokens: int = knob(
        200,
        "bins with fewer tokens than this (in a step, or in calibration) get no decision",
        check=AT_LEAST_ONE,
    )

    def build_schedule(self) -> BudgetSchedule:
        """The :class:`BudgetSchedule` this section names.

        Raises ``ValueError``/``KeyError`` (from BudgetSchedule) on a bad spec, ``FileNotFoundError``
        for a missing schedule file.
        """
        spec = self.schedule.strip()
        if spec == "explicit":
            return BudgetSchedule(
                bin_tokens=self.bin_tokens,
                budgets=self.budgets or (),
                page_size=self.page_size,
                name="explicit",
            )
        if spec.endswith((".yaml", ".yml")):
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"schedule file {path} not found")
            return BudgetSchedule.from_yaml(path)
        if spec.lower().startswith("fixed:"):  # one constant budget, in this section's pages and bins
            return BudgetSchedule.from_preset(spec, self.bin_tokens, self.page_size)
        return BudgetSchedule.from_preset(spec)

    def check(self) -> None:
        if self.schedule.strip() == "explicit" and not self.budgets:
            raise self.invalid("budgets", "a non-empty list of budgets (tokens) when schedule=explicit")
        try:
            schedule = self.build_schedule()
        except (ValueError, KeyError, FileNotFoundError) as exc:
            key = "budgets" if self.schedule.strip() == "explicit" else "schedule"
            raise self.invalid(key, f"a valid schedule ({exc.args[0] if exc.args else exc})") from exc
        if not schedule.is_dense:
            if schedule.page_size != self.page_size:
                raise self.invalid(
                    "page_size", f"the page size of schedule '{self.schedule}' ({schedule.page_size} tokens)"
                )
            small = [b for b in schedule.budgets if b < self.min_budget]
            if small:
                raise self.invalid(
                    "schedule",
                    f"budgets >= {self.min_budget} tokens (the sink + local pages), "
                    f"but '{self.schedule}' has {small[0]}",
                )
