"""TailMismatchScheduler: keep the per-bin tail of the acceptance rate at the threshold during training.

Built by the trainer from the recipe's ``sparsity`` and ``tail_scheduler`` sections when the run adapts,
calibrates or starts sparse, and run on every rank (its decisions depend only on the step's report, which is the
same everywhere; only rank 0 writes its files). Per step (in ``on_train_batch_end``, once the step's rollouts are
scored dense), for every bin of cached length with at least ``sparsity.min_bin_tokens`` tokens, the tail
statistic (p5) and its confidence bounds come from the :class:`StepReport` (computed once per step over all
ranks, :mod:`sparrow_nemo.callbacks.tail_stats`). Then, in this order:

1. collapse guard: when the mean response length or the mean reward of the last ``collapse_smooth`` steps fell
   below the best mean of as many consecutive earlier steps of the ``collapse_window`` by more than
   ``collapse_drop`` (a fraction of that best) and by more than ``collapse_noise_z`` standard errors of the
   difference (the step-to-step noise, from successive differences: with a few prompts per step the step reward
   is noisy) AND some bin is below the threshold, install the dense schedule for the rest of the run and log
   ``collapse guard: ...``;
2. ``mode`` ``raise`` / ``raise_and_lower``: each bin below the threshold (``ucb < threshold``) moves one
   rung of the budget ladder above the budget it was measured at (later bins are lifted to stay monotone;
   several raised bins combine by per-bin maximum, so a bin is never moved two rungs in one step);
3. ``mode`` ``raise_and_lower``: a bin whose lower bound stayed above ``threshold + lower_margin`` for
   ``patience`` consecutive steps moves down one rung (never below the previous bin's budget).

The ladder is the sorted ``sparsity.calibration.candidate_budgets`` (tokens) followed by "dense" for that bin.
The new schedule is assigned to ``trainer.schedule``, so the next rollout uses it, and logged as
``sparsity/next_budget/bin_<b>`` (``sparsity/budget/bin_<b>`` is the trainer's: the budgets the step's rollouts
used). Optionally, before training (``sparsity.calibrate``), a calibration pass
(:func:`sparrow_nemo.callbacks.calibration.run_calibration`) picks
the starting schedule. State (schedule, counters, guard window, history) round-trips through checkpoints.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sparrow_nemo.callbacks.base import CalibratingTrainer, Callback, StepReport, TrainerLike
from sparrow_nemo.callbacks.schedule_edit import bin_budget, lower_bin, pointwise_max, raise_bin
from sparrow_nemo.callbacks.tail_report import plot_tail_history
from sparrow_nemo.callbacks.tail_stats import BinTail
from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, OPEN_UNIT, Section, knob
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.mismatch import tail_name
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

logger = logging.getLogger(__name__)

Mode = Literal["off", "raise", "raise_and_lower"]

#: Subfolder of the run directory for this callback's files.
OUTPUT_SUBDIR = "sparsity"
_STATE_VERSION = 1


@dataclass(frozen=True)
class TailSchedulerConfig(Section):
    """The recipe's ``tail_scheduler`` section: how the schedule adapts online, and the collapse guard.

    What the tail must meet (``sparsity.threshold``, ``quantile``, ``bin_tokens``, ``noise_z``,
    ``min_bin_tokens``) and the budget ladder (``sparsity.calibration.candidate_budgets``) are the
    ``sparsity`` section's; the trainer builds the scheduler whenever the schedule is sparse, calibration
    runs or ``adapt`` is not off.
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


class TailMismatchScheduler(Callback):
    """Adapts the sparsity schedule so every bin's acceptance-rate tail stays at or above ``threshold``.

    A built-in (``built_in``): the trainer makes it from ``sparsity.*``; it is not listed under ``callbacks:``.

    Args:
        sparsity: the tail requirement (threshold, quantile, bin_tokens, noise_z, min_bin_tokens), the
            budget ladder (``calibration.candidate_budgets``; above the largest a bin goes dense) and
            ``calibrate`` (run the calibration pass in ``on_train_start``, not on resume).
        settings: the adaptation mode, its hysteresis and the collapse guard.
        write_files: write ``<run_dir>/sparsity/``: ``schedule.yaml`` (the schedule in force), ``tail_history.jsonl``
            (one line per step) and, at the end, ``tail_history.png``; and the calibration's files.
        calibrate: None = ``sparsity.calibrate``; False on ranks that must not calibrate (the ranks of rank 0's
            engine do: every rank of a tensor-parallel engine takes part in its calls).
    """

    built_in = (
        "sparsity and tail_scheduler sections (tail_scheduler.adapt, sparsity.calibrate, a sparse schedule)"
    )

    def __init__(
        self,
        sparsity: SparsityConfig,
        settings: TailSchedulerConfig | None = None,
        write_files: bool = True,
        calibrate: bool | None = None,
    ) -> None:
        settings = settings or TailSchedulerConfig()
        self.threshold = sparsity.threshold
        self.quantile = sparsity.quantile
        self.mode = settings.adapt
        self.candidates = sorted(sparsity.calibration.candidate_budgets)
        self.bin_tokens: int | None = sparsity.bin_tokens
        self.noise_z = sparsity.noise_z
        self.min_bin_tokens = sparsity.min_bin_tokens
        self.lower_margin = settings.lower_margin
        self.patience = settings.patience
        self.collapse_guard = settings.collapse_guard
        self.collapse_drop = settings.collapse_drop
        self.collapse_min_steps = settings.collapse_min_steps
        self.collapse_smooth = settings.collapse_smooth
        self.collapse_noise_z = settings.collapse_noise_z
        self.calibrate = sparsity.calibrate if calibrate is None else calibrate
        self.write_files = write_files
        self.collapsed = False
        self.history: list[dict[str, Any]] = []
        self._above_streak: dict[int, int] = {}
        self._recent: deque[tuple[float, float]] = deque(maxlen=settings.collapse_window - 1)
        self._restored = False

    # ----- names ---------------------------------------------------------------------------
    @property
    def stat_name(self) -> str:
        """Metric name of the tail statistic, e.g. ``p5`` for quantile 0.05."""
        return tail_name(self.quantile)

    @property
    def ladder(self) -> list[int]:
        """Candidate budgets (tokens), ascending, then dense."""
        return [*self.candidates, DENSE_BUDGET]

    # ----- hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerLike) -> None:
        if self.calibrate and not self._restored:
            self._run_calibration(trainer)
        if self.write_files:  # restart the file from the (restored) history: a resumed run redoes later steps
            lines = "".join(json.dumps(entry) + "\n" for entry in self.history)
            (self._out_dir(trainer) / "tail_history.jsonl").write_text(lines)
        schedule = trainer.schedule
        if self.bin_tokens is None:
            self.bin_tokens = schedule.bin_tokens
        if schedule.is_dense and schedule.bin_tokens != self.bin_tokens:  # same behaviour, our bins
            trainer.schedule = schedule = BudgetSchedule.dense(
                bin_tokens=self.bin_tokens, page_size=schedule.page_size
            )
        self._check_bins(schedule)
        bad = [c for c in self.candidates if c % schedule.page_size]
        if bad:
            raise ValueError(
                f"TailMismatchScheduler: candidates {bad} are not multiples of the schedule's page_size "
                f"{schedule.page_size}"
            )
        self._write_schedule(trainer)

    def on_train_batch_end(
        self, trainer: TrainerLike, report: StepReport, metrics: Mapping[str, float]
    ) -> None:
        if self.bin_tokens is None:
            raise RuntimeError("TailMismatchScheduler: on_train_start must run before the first step")
        self._check_bins(trainer.schedule)
        if (report.quantile, report.noise_z) != (self.quantile, self.noise_z):
            raise ValueError(
                f"TailMismatchScheduler: the step report's tails are at quantile {report.quantile}, noise_z "
                f"{report.noise_z}; the scheduler needs quantile {self.quantile}, noise_z {self.noise_z}"
            )
        if report.schedule.bin_tokens != self.bin_tokens:
            raise ValueError(
                f"TailMismatchScheduler: the step report's tails use {report.schedule.bin_tokens}-token bins, "
                f"the scheduler {self.bin_tokens}"
            )
        tails = list(report.tails)
        decided = [t for t in tails if t.tokens >= self.min_bin_tokens]
        below = [t.bin for t in decided if t.ucb < self.threshold]
        actions: list[dict[str, Any]] = []
        guard_fired = False
        if self.collapse_guard and not self.collapsed and below:
            reason = self._collapse_reason(report)
            if reason:
                guard_fired = True
                self._go_dense(trainer, report, below, reason, actions)
        if not self.collapsed and self.mode != "off":
            self._adapt(trainer, decided, below, actions)
        self._recent.append((report.reward_mean, report.response_length_mean))
        self._record(trainer, report, tails, actions, guard_fired)
        if actions:
            self._write_schedule(trainer)

    def on_train_end(self, trainer: TrainerLike) -> None:
        if self.write_files and self.history:
            out = self._out_dir(trainer) / "tail_history.png"
            plot_tail_history(self.history, self.threshold, self.stat_name, out)

    def on_save_checkpoint(self, trainer: TrainerLike) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "schedule": trainer.schedule.to_dict(),
            "bin_tokens": self.bin_tokens,
            "collapsed": self.collapsed,
            "above_streak": {str(b): n for b, n in self._above_streak.items()},
            "recent": [list(pair) for pair in self._recent],
            "history": self.history,
        }

    def on_load_checkpoint(self, trainer: TrainerLike, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"TailMismatchScheduler checkpoint state: version {state.get('version')!r}, expected {_STATE_VERSION}"
            )
        trainer.schedule = BudgetSchedule.from_dict(state["schedule"])
        self.bin_tokens = state["bin_tokens"]
        self.collapsed = bool(state["collapsed"])
        self._above_streak = {int(b): int(n) for b, n in state["above_streak"].items()}
        self._recent = deque(((float(r), float(n)) for r, n in state["recent"]), maxlen=self._recent.maxlen)
        self.history = list(state["history"])
        self._restored = True

    def _check_bins(self, schedule: BudgetSchedule) -> None:
        """The tail bins must be the schedule's bins, or a raised bin would move the wrong budget."""
        if schedule.bin_tokens != self.bin_tokens:
            raise ValueError(
                f"TailMismatchScheduler: bin_tokens={self.bin_tokens} but schedule '{schedule.name}' has "
                f"bin_tokens={schedule.bin_tokens}; set the scheduler's bin_tokens to the schedule's"
            )

    # ----- decisions -----------------------------------------------------------------------
    def _collapse_reason(self, report: StepReport) -> str:
        """Why the run looks collapsing (empty when it does not), from the window of previous steps."""
        if len(self._recent) < self.collapse_min_steps + self.collapse_smooth - 1:
            return ""
        reasons = [
            self._fall(name, [step[i] for step in self._recent] + [now], digits)
            for i, name, now, digits in (
                (1, "response length", report.response_length_mean, 1),
                (0, "reward", report.reward_mean, 4),
            )
        ]
        return "; ".join(r for r in reasons if r)

    def _fall(self, name: str, window: list[float], digits: int) -> str:
        """``name`` collapsing, said in words (empty when not): the mean of the last ``collapse_smooth`` values of
        ``window`` (oldest first, this step last) against the best mean of as many consecutive earlier values."""
        n = self.collapse_smooth
        earlier = window[:-n]
        current = sum(window[-n:]) / n
        k = min(n, len(earlier))
        best = max(sum(earlier[i : i + k]) / k for i in range(len(earlier) - k + 1))
        # step noise from successive differences: neither a slow trend nor the fall itself widens it much
        steps = [b - a for a, b in itertools.pairwise(window)]
        mean_step = sum(steps) / len(steps)
        noise = (sum((d - mean_step) ** 2 for d in steps) / len(steps) / 2) ** 0.5
        margin = max(self.collapse_drop * best, self.collapse_noise_z * noise * (2 / n) ** 0.5)
        if best <= 0 or best - current <= margin:
            return ""
        what = f"{name} {current:.{digits}f}" + (f" (mean of the last {n} steps)" if n > 1 else "")
        return f"{what} < best {best:.{digits}f} - {margin:.{digits}f}"

    def _go_dense(
        self,
        trainer: TrainerLike,
        report: StepReport,
        below: list[int],
        reason: str,
        actions: list[dict[str, Any]],
    ) -> None:
        old = trainer.schedule
        trainer.schedule = BudgetSchedule.dense(bin_tokens=old.bin_tokens, page_size=old.page_size)
        self.collapsed = True
        actions.append({"bin": None, "action": "dense", "from": old.to_dict()["budgets"], "to": "dense"})
        logger.warning(
            "collapse guard: step %d: %s, with the %s of bins %s below threshold %.3f; "
            "switching to the dense schedule for the rest of the run",
            report.step,
            reason,
            self.stat_name,
            below,
            self.threshold,
        )

    def _adapt(
        self, trainer: TrainerLike, decided: list[BinTail], below: list[int], actions: list[dict[str, Any]]
    ) -> None:
        measured = schedule = trainer.schedule  # the budgets this step's rollouts were generated with
        for b in below:  # each bin one rung above what it was measured at; combined by per-bin max
            self._above_streak[b] = 0
            raised = raise_bin(measured, b, self.ladder)
            if raised is None:
                actions.append({"bin": b, "action": "at_top", "from": bin_budget(measured, b), "to": None})
                continue
            schedule = pointwise_max(schedule, raised)
            actions.append(
                {"bin": b, "action": "raise", "from": bin_budget(measured, b), "to": bin_budget(schedule, b)}
            )
        if self.mode == "raise_and_lower":
            well_above = {t.bin for t in decided if t.lcb > self.threshold + self.lower_margin}
            for b in sorted(set(self._above_streak) | well_above):
                self._above_streak[b] = self._above_streak.get(b, 0) + 1 if b in well_above else 0
                if self._above_streak[b] >= self.patience:
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
                    self._above_streak[b] = 0
            self._above_streak = {b: n for b, n in self._above_streak.items() if n}
        trainer.schedule = schedule

    # ----- outputs -------------------------------------------------------------------------
    def _record(
        self,
        trainer: TrainerLike,
        report: StepReport,
        tails: list[BinTail],
        actions: list[dict[str, Any]],
        guard_fired: bool,
    ) -> None:
        schedule = trainer.schedule
        entry = {
            "step": report.step,
            "bins": [t.to_dict() for t in tails],
            "actions": actions,
            "reward_mean": report.reward_mean,
            "response_length_mean": report.response_length_mean,
            "schedule": schedule.to_dict()["budgets"],
        }
        self.history.append(entry)
        metrics: dict[str, float] = {}
        last_bin = max([len(schedule.budgets) - 1, *(t.bin for t in tails)])
        for b in range(last_bin + 1):
            metrics[f"sparsity/next_budget/bin_{b}"] = float(bin_budget(schedule, b))
        metrics["sparsity/raised_bins"] = float(sum(a["action"] == "raise" for a in actions))
        metrics["sparsity/lowered_bins"] = float(sum(a["action"] == "lower" for a in actions))
        metrics["sparsity/below_bins"] = float(
            sum(t.tokens >= self.min_bin_tokens and t.ucb < self.threshold for t in tails)
        )
        metrics["sparsity/next_dense"] = float(schedule.is_dense)
        metrics["sparsity/collapse_guard"] = float(guard_fired)
        trainer.log(metrics)
        if self.write_files:
            out = self._out_dir(trainer)
            with (out / "tail_history.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")

    def _out_dir(self, trainer: TrainerLike) -> Path:
        out = Path(trainer.run_dir) / OUTPUT_SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        return out

    def _write_schedule(self, trainer: TrainerLike) -> None:
        if self.write_files:
            trainer.schedule.to_yaml(self._out_dir(trainer) / "schedule.yaml")

    def _run_calibration(self, trainer: CalibratingTrainer) -> None:
        from sparrow_nemo.callbacks.calibration import run_calibration

        missing = [
            name
            for name in ("rollout_engine", "sampling", "calibration_prompts")
            if not hasattr(trainer, name)
        ]
        if missing:
            raise TypeError(
                f"TailMismatchScheduler (sparsity.calibrate): the trainer lacks {', '.join(missing)}"
            )
        schedule = trainer.schedule
        result = run_calibration(
            engine=trainer.rollout_engine,
            prompts=trainer.calibration_prompts,
            candidates=self.candidates,
            sampling=trainer.sampling,
            bin_tokens=self.bin_tokens or schedule.bin_tokens,
            threshold=self.threshold,
            quantile=self.quantile,
            page_size=schedule.page_size,
            run_dir=self._out_dir(trainer) / "calibration" if self.write_files else None,
        )
        trainer.schedule = result.schedule
        metrics = {f"calibration/budget/bin_{b}": float(v) for b, v in enumerate(result.schedule.budgets)}
        metrics["calibration/unsatisfied_bins"] = float(len(result.unsatisfied_bins))
        trainer.log(metrics)
        logger.info("calibration installed schedule %s", result.schedule.to_dict()["budgets"])
