"""Training callbacks with NeMo/Lightning-style hooks: user extras from the recipe's ``callbacks:`` list, and the
tail scheduler the trainer builds from ``sparsity.*``.

- :mod:`.base`: the hook protocol (:class:`Callback`, :class:`CallbackList`), what callbacks see
  (:class:`StepReport`, :class:`TrainerLike`) and :func:`instantiate_callbacks`.
- :mod:`.tail_scheduler`: :class:`TailMismatchScheduler`, which keeps the per-bin acceptance-rate tail at
  the threshold by moving the sparsity schedule's budgets, with a collapse guard (a built-in);
- :mod:`.tail_stats`: the per-bin tail with confidence bounds, on one rank or merged exactly over ranks.
- :mod:`.rollout_report`: :func:`build_step_report` (a step's rollouts and mismatch -> StepReport).
- :mod:`.calibration`: :func:`run_calibration`, the offline calibration pass (also used by ``sparrow calibrate``).
"""

from sparrow_nemo.callbacks.base import (
    HOOKS,
    CalibratingTrainer,
    Callback,
    CallbackConfigError,
    CallbackList,
    StepReport,
    TrainerLike,
    instantiate_callbacks,
)
from sparrow_nemo.callbacks.calibration import run_calibration
from sparrow_nemo.callbacks.rollout_report import build_step_report
from sparrow_nemo.callbacks.tail_scheduler import TailMismatchScheduler

__all__ = [
    "HOOKS",
    "CalibratingTrainer",
    "Callback",
    "CallbackConfigError",
    "CallbackList",
    "StepReport",
    "TailMismatchScheduler",
    "TrainerLike",
    "build_step_report",
    "instantiate_callbacks",
    "run_calibration",
]
