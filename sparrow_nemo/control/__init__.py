"""The Sparrow controller: keeps the per-bin tail of the acceptance rate at the threshold by choosing the sparse
schedule (the schedule object itself is the method's, :mod:`sparrow_nemo.sparse.schedule`). One job per module:

- :mod:`.report`: :class:`StepReport`, what the controller sees of a step (and :func:`build_step_report`);
- :mod:`.tail_stats`: the per-bin tail with confidence bounds, on one rank or merged exactly over ranks;
- :mod:`.schedule_edit`: one-bin edits of a schedule along the budget ladder;
- :mod:`.scheduler`: the rule, :meth:`TailScheduler.decide` (report, schedule) -> :class:`Decision`;
- :mod:`.calibration`: the calibration pass (:func:`run_calibration`, also ``sparrow calibrate``);
- :mod:`.speculative`: the speculative planner (draft budget and k per bin) and the ``spec/*`` metrics;
- :mod:`.callback`: :class:`SparrowCallback`, the Lightning-style face our trainer and a Lightning loop call;
- :mod:`.config`: :class:`ControlConfig`, the recipe's ``control`` section; :mod:`.history_plot`: the plot.
"""

from sparrow_nemo.control.calibration import run_calibration
from sparrow_nemo.control.callback import STEP_REPORT, SparrowCallback
from sparrow_nemo.control.config import ControlConfig
from sparrow_nemo.control.report import StepReport, build_step_report
from sparrow_nemo.control.scheduler import Decision, SchedulerState, TailScheduler

__all__ = [
    "STEP_REPORT",
    "ControlConfig",
    "Decision",
    "SchedulerState",
    "SparrowCallback",
    "StepReport",
    "TailScheduler",
    "build_step_report",
    "run_calibration",
]
