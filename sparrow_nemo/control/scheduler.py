"""The tail scheduler's rule: :meth:`TailScheduler.decide` (a step's :class:`StepReport` and the schedule in force
-> a :class:`Decision`), a pure function of its inputs and the :class:`SchedulerState` it is given.

Per step, for every bin of cached length with at least ``sparsity.min_bin_tokens`` tokens, the tail statistic
(p5) and its confidence bounds come from the report (computed once per step over all ranks,
:mod:`sparrow_nemo.control.tail_stats`). Then, in this order:

1. collapse guard: when the mean response length or the mean reward of the last ``collapse_smooth`` steps fell
   below the best mean of as many consecutive earlier steps of the ``collapse_window`` by more than
   ``collapse_drop`` (a fraction of that best) and by more than ``collapse_noise_z`` standard errors of the
   difference (the step-to-step noise, from successive differences: with a few prompts per step the step reward
   is noisy) AND some bin is below the threshold, the dense schedule for the rest of the run
   (``collapse guard: ...``);
2. ``adapt`` ``raise`` / ``raise_and_lower``: each bin below the threshold (``ucb < threshold``) moves one
   rung of the budget ladder above the budget it was measured at (later bins are lifted to stay monotone;
   several raised bins combine by per-bin maximum, so a bin is never moved two rungs in one step);
3. ``adapt`` ``raise_and_lower``: a bin whose lower bound stayed above ``threshold + lower_margin`` for
   ``patience`` consecutive steps moves down one rung (never below the previous bin's budget).

The ladder is the sorted ``control.calibration.candidate_budgets`` (tokens) followed by "dense" for that bin.
Before the first step (``report=None``) the decision says whether to run the calibration pass
(``control.calibrate``, not on a resumed run) and puts a dense schedule on the scheduler's bins. The decision
names no trainer: who runs the loop applies it (:class:`~sparrow_nemo.control.callback.SparrowCallback`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, OPEN_UNIT, Section, knob
from sparrow_nemo.control.report import StepReport
from sparrow_nemo.control.schedule_edit import bin_budget, lower_bin, pointwise_max, raise_bin
from sparrow_nemo.control.tail_stats import BinTail
from sparrow_nemo.sparse.mismatch import tail_name
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

Mode = Literal["off", "raise", "raise_and_lower"]


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """``control.scheduler``: how the schedule adapts online, and the collapse guard.

    What the tail must meet (``sparsity.threshold``, ``quantile``, ``bin_tokens``, ``noise_z``,
    ``min_bin_tokens``) is the ``sparsity`` section's; the budget ladder is ``control.calibration
    .candidate_budgets``. The trainer runs the controller whenever the schedule is sparse, ``control.calibrate``
    is set or ``adapt`` is not off.
    """

    adapt: Mode = knob(
        "raise", "off (monitor and guard only), raise a bin's budget when its tail dips, or raise and lower"
    )
    lower_margin: float = knob(
        0.04,
        "raise_and_lower: a bin lowers only when its lower bound exceeds threshold + this ...",
        check=NON_NEGATIVE,
    )
    patience: int = knob(3, "... for this many steps in a row", check=AT_LEAST_ONE)
    collapse_guard: bool = knob(
        True,
        "switch to the dense schedule when reward or response length collapses with bins below threshold "
        "(experiments turn it off to watch a collapse happen)",
    )
    collapse_window: int = knob(
        20, "steps (this one included) whose reward / response length the guard compares", check=AT_LEAST_ONE
    )
    collapse_drop: float = knob(
        0.5,
        "relative fall of the last collapse_smooth steps' mean below the best earlier such mean that counts as "
        "collapsing (a collapse takes reward or length most of the way to 0)",
        check=OPEN_UNIT,
    )
    collapse_min_steps: int = knob(
        3,
        "earlier steps (before the last collapse_smooth) needed before the guard can fire",
        check=AT_LEAST_ONE,
    )
    collapse_smooth: int = knob(
        5, "steps (this one included) averaged as the current value; 1 = this step alone", check=AT_LEAST_ONE
    )
    collapse_noise_z: float = knob(
        3.0,
        "the fall must also exceed this many standard errors of the difference of two collapse_smooth-step means "
        "(step noise from successive differences); 0 = the relative drop alone",
        check=NON_NEGATIVE,
    )

    def check(self) -> None:
        if self.collapse_min_steps + self.collapse_smooth > self.collapse_window:
            raise self.invalid(
                "collapse_min_steps",
                f"<= collapse_window - collapse_smooth ({self.collapse_window} - {self.collapse_smooth})",
            )


@dataclass(frozen=True)
class SchedulerState:
    """What the rule remembers between steps (plain data; it round-trips through checkpoints).

    Attributes:
        started: the run has started (the start decision was taken: a resumed run does not calibrate again).
        collapsed: the collapse guard fired; the schedule stays dense.
        above_streak: {bin: consecutive steps its lower bound was above threshold + lower_margin}.
        recent: (reward mean, response length mean) of the previous steps, oldest first, at most
            ``collapse_window - 1`` of them.
    """

    started: bool = False
    collapsed: bool = False
    above_streak: dict[int, int] = field(default_factory=dict)
    recent: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Decision:
    """What to do after a step (or before the first): the schedule to install, calibrate or not, and why.

    Attributes:
        schedule: the schedule for the next rollouts; None = keep the one in force.
        calibrate: run the calibration pass now (before the first step only) and install its schedule.
        reason: why, in words ("" when nothing changes).
        actions: per-bin actions (``{"bin", "action": raise | lower | at_top | dense, "from", "to"}``).
        guard_fired: the collapse guard switched to the dense schedule in this decision.
        state: the scheduler's state after this decision (pass it to the next :meth:`TailScheduler.decide`).
    """

    schedule: BudgetSchedule | None
    calibrate: bool = False
    reason: str = ""
    actions: tuple[dict[str, Any], ...] = ()
    guard_fired: bool = False
    state: SchedulerState = field(default_factory=SchedulerState)


@dataclass(frozen=True)
class TailScheduler:
    """The rule's settings: the tail requirement, the budget ladder, the adaptation and the guard.

    Attributes:
        threshold, quantile, noise_z: the tail requirement (``sparsity.*``); a report's tails must be at this
            quantile and noise_z.
        bin_tokens: the bins of the tails and of every schedule decided on (``sparsity.bin_tokens``).
        min_bin_tokens: bins with fewer tokens in a step get no decision.
        candidates: the budget ladder below dense, tokens, ascending.
        calibrate: ``control.calibrate``. config: ``control.scheduler``.
    """

    threshold: float
    quantile: float
    noise_z: float
    bin_tokens: int
    min_bin_tokens: int
    candidates: tuple[int, ...]
    calibrate: bool = False
    config: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(sorted(self.candidates)))

    @property
    def ladder(self) -> list[int]:
        """Candidate budgets (tokens), ascending, then dense."""
        return [*self.candidates, DENSE_BUDGET]

    def decide(
        self, report: StepReport | None, schedule: BudgetSchedule, state: SchedulerState | None = None
    ) -> Decision:
        """The decision after the step ``report`` describes (None: before the first step), ``schedule`` in force
        (the one the report's rollouts used), from ``state`` (None: a fresh run). Changes nothing it is given.

        Raises:
            ValueError: the schedule's or the report's bins are not the scheduler's, the report's tails are at
                another quantile or noise_z, or a candidate is not a multiple of the schedule's page size.
        """
        state = state or SchedulerState()
        if report is None:
            return self._start(schedule, state)
        self._check_bins(schedule)
        if (report.quantile, report.noise_z) != (self.quantile, self.noise_z):
            raise ValueError(
                f"TailScheduler: the step report's tails are at quantile {report.quantile}, noise_z "
                f"{report.noise_z}; the scheduler needs quantile {self.quantile}, noise_z {self.noise_z}"
            )
        if report.schedule.bin_tokens != self.bin_tokens:
            raise ValueError(
                f"TailScheduler: the step report's tails use {report.schedule.bin_tokens}-token bins, "
                f"the scheduler {self.bin_tokens}"
            )
        c = self.config
        decided = [t for t in report.tails if t.tokens >= self.min_bin_tokens]
        below = [t.bin for t in decided if t.ucb < self.threshold]
        actions: list[dict[str, Any]] = []
        new, reason, streak, guard_fired = schedule, "", dict(state.above_streak), False
        collapsed = state.collapsed
        if c.collapse_guard and not collapsed and below:
            fall = self._collapse_reason(report, state.recent)
            if fall:
                guard_fired = collapsed = True
                new = BudgetSchedule.dense(bin_tokens=schedule.bin_tokens, page_size=schedule.page_size)
                actions.append(
                    {"bin": None, "action": "dense", "from": schedule.to_dict()["budgets"], "to": "dense"}
                )
                reason = (
                    f"collapse guard: step {report.step}: {fall}, with the {tail_name(self.quantile)} of bins "
                    f"{below} below threshold {self.threshold:.3f}; switching to the dense schedule for the rest of "
                    "the run"
                )
        if not collapsed and c.adapt != "off":
            new, streak = self._adapt(schedule, decided, below, streak, actions)
            if actions:
                reason = "; ".join(f"bin {a['bin']}: {a['action']} {a['from']} -> {a['to']}" for a in actions)
        recent = (*state.recent, (report.reward_mean, report.response_length_mean))[
            -(c.collapse_window - 1) :
        ]
        after = SchedulerState(True, collapsed, streak, recent if c.collapse_window > 1 else ())
        return Decision(new if actions else None, False, reason, tuple(actions), guard_fired, after)

    # ----- before the first step -----------------------------------------------------------------
    def _start(self, schedule: BudgetSchedule, state: SchedulerState) -> Decision:
        new = None
        if schedule.is_dense and schedule.bin_tokens != self.bin_tokens:  # same behaviour, our bins
            new = BudgetSchedule.dense(bin_tokens=self.bin_tokens, page_size=schedule.page_size)
        self._check_bins(new or schedule)
        bad = [c for c in self.candidates if c % schedule.page_size]
        if bad:
            raise ValueError(
                f"TailScheduler: candidates {bad} are not multiples of the schedule's page_size {schedule.page_size}"
            )
        calibrate = self.calibrate and not state.started
        reason = "control.calibrate: the calibration pass picks the starting schedule" if calibrate else ""
        return Decision(new, calibrate, reason, (), False, replace(state, started=True))

    def _check_bins(self, schedule: BudgetSchedule) -> None:
        """The tail bins must be the schedule's bins, or a raised bin would move the wrong budget."""
        if schedule.bin_tokens != self.bin_tokens:
            raise ValueError(
                f"TailScheduler: bin_tokens={self.bin_tokens} but schedule '{schedule.name}' has "
                f"bin_tokens={schedule.bin_tokens}; set the scheduler's bin_tokens to the schedule's"
            )

    # ----- the rule ------------------------------------------------------------------------------
    def _collapse_reason(self, report: StepReport, recent: tuple[tuple[float, float], ...]) -> str:
        """Why the run looks collapsing (empty when it does not), from the window of previous steps."""
        c = self.config
        if len(recent) < c.collapse_min_steps + c.collapse_smooth - 1:
            return ""
        reasons = [
            self._fall(name, [step[i] for step in recent] + [now], digits)
            for i, name, now, digits in (
                (1, "response length", report.response_length_mean, 1),
                (0, "reward", report.reward_mean, 4),
            )
        ]
        return "; ".join(r for r in reasons if r)

    def _fall(self, name: str, window: list[float], digits: int) -> str:
        """``name`` collapsing, said in words (empty when not): the mean of the last ``collapse_smooth`` values of
        ``window`` (oldest first, this step last) against the best mean of as many consecutive earlier values."""
        n = self.config.collapse_smooth
        earlier = window[:-n]
        current = sum(window[-n:]) / n
        k = min(n, len(earlier))
        best = max(sum(earlier[i : i + k]) / k for i in range(len(earlier) - k + 1))
        # step noise from successive differences: neither a slow trend nor the fall itself widens it much
        steps = [b - a for a, b in itertools.pairwise(window)]
        mean_step = sum(steps) / len(steps)
        noise = (sum((d - mean_step) ** 2 for d in steps) / len(steps) / 2) ** 0.5
        margin = max(self.config.collapse_drop * best, self.config.collapse_noise_z * noise * (2 / n) ** 0.5)
        if best <= 0 or best - current <= margin:
            return ""
        what = f"{name} {current:.{digits}f}" + (f" (mean of the last {n} steps)" if n > 1 else "")
        return f"{what} < best {best:.{digits}f} - {margin:.{digits}f}"

    def _adapt(
        self,
        measured: BudgetSchedule,
        decided: list[BinTail],
        below: list[int],
        streak: dict[int, int],
        actions: list[dict[str, Any]],
    ) -> tuple[BudgetSchedule, dict[int, int]]:
        """Raise the failing bins (one rung above the budget measured), then (raise_and_lower) lower the bins
        above the margin for ``patience`` steps; returns the schedule and the new streaks."""
        schedule = measured  # the budgets this step's rollouts were generated with
        for b in below:  # each bin one rung above what it was measured at; combined by per-bin max
            streak[b] = 0
            raised = raise_bin(measured, b, self.ladder)
            if raised is None:
                actions.append({"bin": b, "action": "at_top", "from": bin_budget(measured, b), "to": None})
                continue
            schedule = pointwise_max(schedule, raised)
            actions.append(
                {"bin": b, "action": "raise", "from": bin_budget(measured, b), "to": bin_budget(schedule, b)}
            )
        if self.config.adapt == "raise_and_lower":
            well_above = {t.bin for t in decided if t.lcb > self.threshold + self.config.lower_margin}
            for b in sorted(set(streak) | well_above):
                streak[b] = streak.get(b, 0) + 1 if b in well_above else 0
                if streak[b] >= self.config.patience:
                    lowered = lower_bin(schedule, b, self.ladder)
                    if lowered is not None:
                        actions.append(
                            {
                                "bin": b,
                                "action": "lower",
                                "from": bin_budget(schedule, b),
                                "to": bin_budget(lowered, b),
                            }
                        )
                        schedule = lowered
                    streak[b] = 0
            streak = {b: n for b, n in streak.items() if n}
        return schedule, streak
