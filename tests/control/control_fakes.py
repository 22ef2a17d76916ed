"""Test doubles for the controller tests: :func:`make_callback` from the config sections' knobs, and
:class:`FakeLoop`, the part of a training loop that drives a :class:`SparrowCallback`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from sparrow_nemo.control import STEP_REPORT, SparrowCallback, StepReport
from sparrow_nemo.sparse.pattern import PAGE_SIZE
from sparrow_nemo.sparse.schedule import BudgetSchedule


@dataclass
class FakeLoop:
    """Holds the schedule the next rollouts use and the metrics the callback logs; ``run_dir`` for its files."""

    schedule: BudgetSchedule
    run_dir: Path
    logged: list[dict[str, float]] = field(default_factory=list)

    def log(self, metrics: dict[str, float]) -> None:
        self.logged.append(dict(metrics))

    def start(self, callback: SparrowCallback) -> None:
        """``on_train_start``, then the loop takes the callback's schedule."""
        callback.on_train_start(None, None)
        self.schedule = callback.schedule

    def step(self, callback: SparrowCallback, report: StepReport) -> None:
        """One step generated under the loop's schedule: ``on_train_batch_end`` on its report, then the loop
        takes the decision's schedule."""
        report = replace(report, schedule=self.schedule)
        callback.on_train_batch_end(None, None, {STEP_REPORT: report}, None, report.step)
        self.schedule = callback.schedule


def make_callback(
    schedule: BudgetSchedule,
    run_dir: Path | None = None,
    *,
    candidates=None,
    bin_tokens: int = 100,
    page_size: int = PAGE_SIZE,
    calibrate_fn=None,
    log=None,
    **knobs,
) -> SparrowCallback:
    """A SparrowCallback from the ``sparsity`` and ``control`` sections, given their knobs by name (``mode`` =
    ``control.scheduler.adapt``).

    Sparsity knobs: threshold, quantile, noise_z, min_bin_tokens; ``calibrate`` is ``control.calibrate``;
    ``candidates`` is ``control.calibration.candidate_budgets``. The rest go to ``control.scheduler``.
    Files go to ``<run_dir>/sparsity`` (None: none written).
    """
    from sparrow_nemo.control.calibration import CalibrationConfig
    from sparrow_nemo.control.config import ControlConfig
    from sparrow_nemo.control.scheduler import SchedulerConfig
    from sparrow_nemo.sparse.config import SparsityConfig

    sparsity_keys = {"threshold", "quantile", "noise_z", "min_bin_tokens"}
    sparsity = {k: knobs.pop(k) for k in list(knobs) if k in sparsity_keys}
    calibrate = knobs.pop("calibrate", False)
    if "mode" in knobs:
        knobs["adapt"] = knobs.pop("mode")
    calibration = (
        CalibrationConfig() if candidates is None else CalibrationConfig(candidate_budgets=tuple(candidates))
    )
    control = ControlConfig(calibrate=calibrate, calibration=calibration, scheduler=SchedulerConfig(**knobs))
    config = SparsityConfig(page_size=page_size, bin_tokens=bin_tokens, **sparsity)
    out = None if run_dir is None else Path(run_dir) / "sparsity"
    return SparrowCallback.from_config(
        config, control, schedule, calibrate=calibrate_fn, out_dir=out, log_metrics=log
    )
