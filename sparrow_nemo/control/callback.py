"""The Sparrow controller's callback face: :class:`SparrowCallback`, Lightning's hook names and signatures over
:mod:`sparrow_nemo.control`, so one object drives the schedule in our trainer and in a Lightning/NeMo loop.

The loop's ``training_step`` returns a mapping that holds the step's
:class:`~sparrow_nemo.control.report.StepReport` under :data:`STEP_REPORT`; Lightning hands it to
``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)`` as ``outputs``. The callback decides
(:meth:`~sparrow_nemo.control.scheduler.TailScheduler.decide`) and holds the result in :attr:`schedule`: the
schedule the next rollouts must use, whoever generates them. It never touches ``trainer`` or ``pl_module``
(the arguments are there for the signature): what it needs is given to its constructor (the scheduler's rule,
the starting schedule, the calibration pass, where to write, where to log).

Files (``out_dir``, when given): ``schedule.yaml`` (the schedule in force), ``tail_history.jsonl`` (one line per
step), at the end ``tail_history.png``; the calibration's files under ``calibration/``. Metrics per step:
``sparsity/next_budget/bin_<b>``, ``sparsity/raised_bins``, ``sparsity/lowered_bins``, ``sparsity/below_bins``,
``sparsity/next_dense``, ``sparsity/collapse_guard``; after a calibration ``calibration/budget/bin_<b>`` and
``calibration/unsatisfied_bins``. State (:meth:`state_dict`: the schedule, the rule's state, the history)
round-trips through checkpoints, ours and Lightning's.

With ``lightning`` installed (the ``dev`` extra; NeMo's images have it) the class derives from
``lightning.pytorch.Callback``, so a ``lightning.Trainer`` takes it; without it, from ``object``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparrow_nemo.control.config import ControlConfig
from sparrow_nemo.control.history_plot import plot_tail_history
from sparrow_nemo.control.report import StepReport
from sparrow_nemo.control.schedule_edit import bin_budget
from sparrow_nemo.control.scheduler import Decision, SchedulerState, TailScheduler
from sparrow_nemo.sparse.calibration import CalibrationResult
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.mismatch import tail_name
from sparrow_nemo.sparse.schedule import BudgetSchedule

try:  # the NeMo/Lightning base class when it is installed: then a lightning.Trainer accepts the callback
    from lightning.pytorch import Callback as _HookBase
except ImportError:  # pragma: no cover - exercised where lightning is absent
    _HookBase = object

logger = logging.getLogger(__name__)

#: key of the :class:`StepReport` in the ``outputs`` mapping ``on_train_batch_end`` receives
STEP_REPORT = "step_report"
#: subfolder of the run directory for the controller's files
OUTPUT_SUBDIR = "sparsity"
_STATE_VERSION = 2

#: the calibration pass as the callback runs it: (the schedule in force, the folder for its files or None)
Calibrate = Callable[[BudgetSchedule, Path | None], CalibrationResult]


class SparrowCallback(_HookBase):
    """Keeps every bin's acceptance-rate tail at the threshold by deciding the next schedule after each step.

    Args:
        scheduler: the rule (:class:`TailScheduler`; :meth:`from_config` builds it from the recipe's sections).
        schedule: the starting schedule.
        calibrate: the calibration pass, run at train start when the rule asks for it; None on ranks that must
            not calibrate (the schedule then comes from the rank that did).
        out_dir: where to write the files (None: nowhere, e.g. on ranks other than 0).
        log_metrics: receives each hook's metrics (our trainer's ``log``); None: kept in :attr:`metrics` only. (Not
            ``log``: Lightning sets a callback's ``log`` and ``log_dict`` to the module's.)
    """

    built_in = "control section (control.scheduler.adapt, control.calibrate, a sparse schedule)"

    def __init__(
        self,
        scheduler: TailScheduler,
        schedule: BudgetSchedule,
        calibrate: Calibrate | None = None,
        out_dir: Path | None = None,
        log_metrics: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.schedule = schedule
        self.calibrate = calibrate
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.log_metrics = log_metrics
        self.state = SchedulerState()
        self.history: list[dict[str, Any]] = []
        #: the last decision taken, and the metrics of the last hook
        self.decision: Decision | None = None
        self.metrics: dict[str, float] = {}

    @classmethod
    def from_config(
        cls, sparsity: SparsityConfig, control: ControlConfig, schedule: BudgetSchedule, **kwargs: Any
    ) -> SparrowCallback:
        """The callback of the recipe's ``sparsity`` (the tail requirement, the bins) and ``control`` sections."""
        scheduler = TailScheduler(
            threshold=sparsity.threshold,
            quantile=sparsity.quantile,
            noise_z=sparsity.noise_z,
            bin_tokens=sparsity.bin_tokens,
            min_bin_tokens=sparsity.min_bin_tokens,
            candidates=control.calibration.candidate_budgets,
            calibrate=control.calibrate,
            config=control.scheduler,
        )
        return cls(scheduler, schedule, **kwargs)

    # ----- Lightning hooks -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Before the first step: the start decision (the scheduler's bins; the calibration pass unless resumed)."""
        decision = self.scheduler.decide(None, self.schedule, self.state)
        self.decision, self.state, self.metrics = decision, decision.state, {}
        self.schedule = decision.schedule or self.schedule
        out = self._dir()
        if decision.calibrate and self.calibrate is not None:
            result = self.calibrate(self.schedule, None if out is None else out / "calibration")
            self.schedule = result.schedule
            self.metrics = {
                f"calibration/budget/bin_{b}": float(v) for b, v in enumerate(result.schedule.budgets)
            }
            self.metrics["calibration/unsatisfied_bins"] = float(len(result.unsatisfied_bins))
            logger.info("calibration installed schedule %s", result.schedule.to_dict()["budgets"])
        if out is not None:  # restart the file from the (restored) history: a resumed run redoes later steps
            (out / "tail_history.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.history))
            self.schedule.to_yaml(out / "schedule.yaml")
        self._log()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a step: decide on ``outputs[STEP_REPORT]`` and hold the next schedule in :attr:`schedule`."""
        report = outputs.get(STEP_REPORT) if isinstance(outputs, Mapping) else None
        if not isinstance(report, StepReport):
            raise TypeError(
                f"SparrowCallback.on_train_batch_end: outputs must be a mapping with a StepReport under "
                f"'{STEP_REPORT}' (training_step's return value), got {type(outputs).__name__}"
            )
        decision = self.scheduler.decide(report, report.schedule, self.state)
        if decision.guard_fired:
            logger.warning(decision.reason)
        self.decision, self.state = decision, decision.state
        self.schedule = decision.schedule or report.schedule
        self._record(report, decision)
        self._log()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """After the last step: the history plot."""
        out = self._dir()
        if out is not None and self.history:
            plot_tail_history(
                self.history,
                self.scheduler.threshold,
                tail_name(self.scheduler.quantile),
                out / "tail_history.png",
            )

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: the schedule in force, the rule's state and the history."""
        return {
            "version": _STATE_VERSION,
            "schedule": self.schedule.to_dict(),
            "started": self.state.started,
            "collapsed": self.state.collapsed,
            "above_streak": {str(b): n for b, n in self.state.above_streak.items()},
            "recent": [list(pair) for pair in self.state.recent],
            "history": self.history,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run does not calibrate again)."""
        version = state_dict.get("version")
        if version not in (1, _STATE_VERSION):  # 1: the tail scheduler's state before the control package
            raise ValueError(f"SparrowCallback state: version {version!r}, expected {_STATE_VERSION}")
        self.schedule = BudgetSchedule.from_dict(state_dict["schedule"])
        history = list(state_dict["history"])
        self.state = SchedulerState(
            started=bool(state_dict.get("started", True)),
            collapsed=bool(state_dict["collapsed"]),
            above_streak={int(b): int(n) for b, n in state_dict["above_streak"].items()},
            recent=tuple((float(r), float(n)) for r, n in state_dict["recent"]),
        )
        self.history = history

    # ----- outputs ---------------------------------------------------------------------------------
    def _record(self, report: StepReport, decision: Decision) -> None:
        """The step's history line and metrics; the files."""
        schedule, tails = self.schedule, report.tails
        entry = {
            "step": report.step,
            "bins": [t.to_dict() for t in tails],
            "actions": list(decision.actions),
            "reward_mean": report.reward_mean,
            "response_length_mean": report.response_length_mean,
            "schedule": schedule.to_dict()["budgets"],
        }
        self.history.append(entry)
        m: dict[str, float] = {}
        for b in range(max([len(schedule.budgets) - 1, *(t.bin for t in tails)]) + 1):
            m[f"sparsity/next_budget/bin_{b}"] = float(bin_budget(schedule, b))
        m["sparsity/raised_bins"] = float(sum(a["action"] == "raise" for a in decision.actions))
        m["sparsity/lowered_bins"] = float(sum(a["action"] == "lower" for a in decision.actions))
        s = self.scheduler
        m["sparsity/below_bins"] = float(
            sum(t.tokens >= s.min_bin_tokens and t.ucb < s.threshold for t in tails)
        )
        m["sparsity/next_dense"] = float(schedule.is_dense)
        m["sparsity/collapse_guard"] = float(decision.guard_fired)
        self.metrics = m
        out = self._dir()
        if out is not None:
            with (out / "tail_history.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")
            if decision.actions:
                schedule.to_yaml(out / "schedule.yaml")

    def _dir(self) -> Path | None:
        if self.out_dir is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir

    def _log(self) -> None:
        if self.log_metrics is not None and self.metrics:
            self.log_metrics(dict(self.metrics))
