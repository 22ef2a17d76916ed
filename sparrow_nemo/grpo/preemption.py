"""Preemption: SIGTERM / SIGUSR1 ask the trainer to stop, checkpoint the last completed step and exit with status 3.

Slurm sends USR1 before a time limit (``#SBATCH --signal=B:USR1@...``, forwarded by ``slurm/launch.sh``)
and TERM on preemption or ``scancel``. :class:`PreemptionGuard` turns either into a flag; the trainer
asks :meth:`PreemptionGuard.stop_agreed` between steps and between the phases of a step before its update,
which all ranks call together: a signal seen by any rank stops every rank at the same point.

Inside a rollout (one phase of up to half an hour at recipe scale) the stop is honoured between decode steps,
as NeMo-RL's ``checkpoint_must_save_by``: :meth:`PreemptionGuard.watch_rollout` wraps the engine's progress
callback, which the torch engine calls between decode steps (every ``PROGRESS_EVERY`` = 8 of them), and
abandons the generate call there (:class:`RolloutAbandoned`); the trainer then agrees on the stop over the
world right after the rollout phase, drops the step and saves the last completed one. Agreement inside a
rollout is per engine, not over the world: ranks decode in lockstep only within one engine's tensor-parallel
group (engines of different ranks run different numbers of decode steps), so each check all-reduces the flag
over that group only (a one-element all-reduce every 8 decode steps, where each step already all-reduces per
layer; no collective at all for a one-rank engine). Every rank of the job gets the signal (the launcher
signals all tasks), so every engine stops within a few decode steps; an engine whose ranks saw no signal
finishes its rollout and stops at the world agreement after it. TensorRT-LLM reports tokens once, at the end
of its generate call, so there the stop waits for the rollout's end.

A signal that arrives while the checkpoint is being
written (:meth:`PreemptionGuard.saving`) or after the stop was already requested is logged and ignored;
it does not interrupt the save. The trainer then raises :class:`Preempted`, which the CLI turns into
exit status :data:`REQUEUE_EXIT` (the launcher's "checkpointed, requeue me").

``sparrow train`` holds one more guard around the whole command (:func:`whole_run`), so that a signal is
never left to its default action: one that arrives during start-up (config, warm-start, loading, before
the trainer's guard is entered) raises :class:`StoppedDuringStartup` at once, as a kill would stop it (whatever it
interrupts is what a kill -9 leaves, which every writer here tolerates); one that arrives while the
trainer's guard is held is the trainer's (between steps, as above); one that arrives at the end (the
final evaluation, the summary) lets the run finish and is reported by the command with exit 3 too.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: exit status meaning "checkpointed, requeue me" (``SPARROW_REQUEUE_EXIT`` in slurm/launch.sh)
REQUEUE_EXIT = 3
#: the signals that request a stop
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped early on a signal after saving ``checkpoint`` (None: checkpoints disabled) at ``step``."""

    def __init__(self, step: int, signal_name: str, checkpoint: Path | None) -> None:
        where = (
            f"checkpoint {checkpoint}"
            if checkpoint is not None
            else "no checkpoint (checkpoint.enabled=false)"
        )
        super().__init__(f"stopped by {signal_name} after step {step}; {where}")
        self.step = step
        self.signal_name = signal_name
        self.checkpoint = checkpoint


class RolloutAbandoned(Exception):
    """A stop agreed within an engine's lockstep group between two decode steps: the generate call ends early
    (raised from the engine's progress callback; :meth:`PreemptionGuard.watch_rollout` catches it)."""


class StoppedDuringStartup(BaseException):
    """A stop signal during start-up, raised by the handler of :func:`whole_run` where the program is; a
    BaseException, so that no ``except Exception`` it passes through on its way out swallows it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} during start-up, before any step (nothing new to save)")
        self.signal_name = signal_name


class PreemptionGuard:
    """Signal handlers for :data:`STOP_SIGNALS` while in a ``with`` block.

    On leaving the block the previous handlers come back, unless a stop was requested: then the stop
    signals stay ignored for the rest of the process. Handlers are installed only in the main thread
    (Python delivers signals there); elsewhere the guard never fires.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._saving = False
        self._previous: dict[signal.Signals, Any] = {}
        self._outer: PreemptionGuard | None = None
        self._interrupt = False  # raise Preempted from the handler (whole_run, during start-up)

    def __enter__(self) -> PreemptionGuard:
        """Install the handlers (inside :func:`whole_run`: start-up is over, stops wait for a step's end)."""
        self._outer = _whole_run if _whole_run is not self else None
        if self._outer is not None:
            self._outer._interrupt = False  # start-up is over: this guard stops the run between steps
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        # After a stop the process is on its way out with status 3: further stop signals are ignored, so
        # that e.g. ``srun --kill-on-bad-exit`` terminating the ranks that exit a moment after the first
        # one does not turn their status 3 into "killed by SIGTERM".
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.signal_name is not None else handler)
        self._previous = {}
        if self._outer is not None and self._outer.signal_name is None:
            self._outer.signal_name = self.signal_name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            during = " (the checkpoint being written is not interrupted)" if self._saving else ""
            logger.warning("%s: ignored, already stopping on %s%s", name, self.signal_name, during)
            return
        self.signal_name = name
        if self._interrupt:
            self._interrupt = False
            raise StoppedDuringStartup(name)
        if self._saving:
            logger.warning("%s: the checkpoint being written completes, then the run stops", name)
        else:
            logger.warning(
                "%s: stopping at the next decode-step check or phase end, then checkpoint and exit", name
            )

    def stop_agreed(self) -> str | None:
        """Collective over all ranks: the name of the signal that asked to stop (any rank's), else None."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signal_name
        return self._agree(dist.group.WORLD)

    def _agree(self, group: Any) -> str | None:
        """Collective over ``group`` (None: this rank alone): any member's stop signal, adopted by every member."""
        if group is None:
            return self.signal_name
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        code = torch.tensor([0 if self.signal_name is None else signal.Signals[self.signal_name].value])
        code = code.to(device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
        value = int(code.item())
        if value and self.signal_name is None:  # another rank's signal: this rank stops as well
            self.signal_name = signal.Signals(value).name
        return self.signal_name

    @contextmanager
    def watch_rollout(self, on_tokens: Callable[[int], None], group: Any) -> Iterator[Callable[[int], None]]:
        """The progress callback to give the engine for one rollout: ``on_tokens`` plus the stop check.

        ``group``: the ranks that decode in lockstep with this one (the engine's tensor-parallel group; None
        for a one-rank engine). Each report agrees on the stop over ``group`` (collective: every member's
        engine reports after the same decode step) and, on a stop, abandons the generate call; the block then
        ends quietly and the caller's rollout result stays unset. The world-wide agreement is the caller's
        (:meth:`stop_agreed` after the rollout).
        """

        def report(tokens: int) -> None:
            on_tokens(tokens)
            if self._agree(group) is not None:
                raise RolloutAbandoned

        try:
            yield report
        except RolloutAbandoned:
            logger.warning(
                "%s: rollout abandoned between decode steps; its step is dropped", self.signal_name
            )

    @contextmanager
    def saving(self) -> Iterator[None]:
        """While a checkpoint is written (signals never interrupt it; a repeated one is only logged)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False


#: the guard of :func:`whole_run` while one is active
_whole_run: PreemptionGuard | None = None


@contextmanager
def whole_run() -> Iterator[PreemptionGuard]:
    """A guard over a whole command, start-up to exit; the trainer's own guard shares its stop (see the
    module docstring). After the block, ``guard.signal_name`` is the stop signal that arrived, if any."""
    global _whole_run
    guard = PreemptionGuard()
    guard._interrupt = True
    with guard:
        _whole_run = guard
        try:
            yield guard
        finally:
            _whole_run = None
