"""User callbacks with NeMo/Lightning-style hooks, from the recipe's ``callbacks:`` list.

- :mod:`.base`: the hook protocol (:class:`Callback`, :class:`CallbackList`), what callbacks see
  (:class:`~sparrow_nemo.control.report.StepReport`, :class:`TrainerLike`) and :func:`instantiate_callbacks`.

The Sparrow controller (tail scheduler, calibration, speculative planner) is :mod:`sparrow_nemo.control`.
"""

from sparrow_nemo.callbacks.base import (
    HOOKS,
    Callback,
    CallbackConfigError,
    CallbackList,
    TrainerLike,
    instantiate_callbacks,
)
from sparrow_nemo.control.report import StepReport

__all__ = [
    "HOOKS",
    "Callback",
    "CallbackConfigError",
    "CallbackList",
    "StepReport",
    "TrainerLike",
    "instantiate_callbacks",
]
