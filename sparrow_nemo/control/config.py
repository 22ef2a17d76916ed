"""The recipe's ``control`` section: the Sparrow controller's knobs, one nested part per module that reads it.

- ``control.calibrate``: run the calibration pass before training (:mod:`.calibration`, read by
  :class:`~sparrow_nemo.control.scheduler.TailScheduler`);
- ``control.calibration``: the pass's prompts and the budget ladder (:class:`.calibration.CalibrationConfig`);
- ``control.scheduler``: online adaptation and the collapse guard (:class:`.scheduler.SchedulerConfig`);
- ``control.speculative``: the draft plan of ``rollout.mode=speculative``
  (:class:`.speculative.SpeculativePlannerConfig`).

What the tail must meet (``sparsity.threshold``, ``quantile``, ``noise_z``, ``noise_unit``, ``min_bin_tokens``)
stays in the ``sparsity`` section beside the schedule's bins: every step measures it, with or without a
controller.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparrow_nemo.config.schema import Section, knob
from sparrow_nemo.control.calibration import CalibrationConfig
from sparrow_nemo.control.scheduler import SchedulerConfig
from sparrow_nemo.control.speculative import SpeculativePlannerConfig


@dataclass(frozen=True)
class ControlConfig(Section):
    """The Sparrow controller: calibration, the online tail scheduler and the speculative planner."""

    calibrate: bool = knob(False, "run the calibration pass before training and use its schedule")
    calibration: CalibrationConfig = knob(
        doc="the calibration pass and the budget ladder", factory=CalibrationConfig
    )
    scheduler: SchedulerConfig = knob(
        doc="online schedule adaptation from each step's per-bin tail, and the collapse guard",
        factory=SchedulerConfig,
    )
    speculative: SpeculativePlannerConfig = knob(
        doc="the draft plan of a speculative rollout (rollout.mode=speculative)",
        factory=SpeculativePlannerConfig,
    )


def needs_scheduler(control: ControlConfig, start_is_dense: bool) -> bool:
    """The trainer runs the tail scheduler when the schedule adapts, calibration runs or the start is sparse (the
    collapse guard and the tail history watch every sparse run)."""
    return control.calibrate or control.scheduler.adapt != "off" or not start_is_dense
