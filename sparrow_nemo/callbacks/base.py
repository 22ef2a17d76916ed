"""Callback protocol: NeMo/Lightning-style hooks, what a callback sees, and building callbacks from a recipe.

``callbacks:`` in a recipe is for user extras. The components a recipe section configures are built by the
trainer itself and may not be listed again (:func:`instantiate_callbacks` refuses them): the Sparrow controller
(``control.*``, :mod:`sparrow_nemo.control`) and DistillSparse (``distill.*``). The trainer calls, once per run / step, in this order::

    on_train_start(trainer)
    [on_validation_end(trainer, metrics)]          after the start evaluation
    per step: on_rollout_end(trainer, report) -> on_train_batch_end(trainer, report, metrics)
              [on_save_checkpoint(trainer) -> state]
    [on_validation_end(trainer, metrics)]          after the end evaluation
    on_train_end(trainer)

and, when it resumes, ``on_load_checkpoint(trainer, state)`` before ``on_train_start``. ``report`` is a typed
:class:`StepReport` (the step's statistics over all ranks), ``metrics`` plain numbers. A callback changes the
sparsity of the next rollout by assigning ``trainer.schedule``; it reports numbers with ``trainer.log(metrics)``,
which the trainer writes under the callback's own prefix ``callbacks/<key>/`` (``key``: its class name,
suffixed ``_1``, ``_2`` ... for repeats, :meth:`CallbackList.state_keys`).

Processes: the trainer runs callbacks on rank 0 only, except those whose class sets ``collective = True``:
these run on every rank, all hooks in the same order, ``on_save_checkpoint`` / ``on_load_checkpoint`` too
(rank 0's returned state is the one saved; the loaded state reaches every rank). After a step's hooks, rank
0's schedule is every rank's schedule.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from sparrow_nemo.control.report import StepReport

if TYPE_CHECKING:
    from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

#: Hook names every :class:`Callback` has, in the order a run calls them.
HOOKS: tuple[str, ...] = (
    "on_train_start",
    "on_load_checkpoint",
    "on_rollout_end",
    "on_train_batch_end",
    "on_validation_end",
    "on_save_checkpoint",
    "on_train_end",
)


@runtime_checkable
class TrainerLike(Protocol):
    """The part of the trainer that callbacks use.

    Attributes:
        schedule: the budget schedule the next rollout will use; callbacks may assign a new one.
        run_dir: the run's output folder (callbacks write their files under it).
    """

    schedule: BudgetSchedule
    run_dir: Path

    def log(self, metrics: Mapping[str, float]) -> None:
        """Record flat scalar metrics (``"group/name/bin_3": value``) for the current step."""
        ...


class Callback:
    """Base class: every hook is a no-op; subclasses override the ones they need.

    Attributes:
        collective: True = the trainer runs this callback on every rank (its hooks call the policy's
            collectives); False = rank 0 only.
        built_in: the recipe section from which the trainer builds this component itself (then it cannot be
            listed under ``callbacks:``); None for a user callback.
    """

    collective: ClassVar[bool] = False
    built_in: ClassVar[str | None] = None

    def on_train_start(self, trainer: TrainerLike) -> None:
        """Before the first step (after a resume has loaded its state)."""

    def on_rollout_end(self, trainer: TrainerLike, report: StepReport) -> None:
        """After the step's rollouts are generated, scored and rewarded, before the policy update."""

    def on_train_batch_end(
        self, trainer: TrainerLike, report: StepReport, metrics: Mapping[str, float]
    ) -> None:
        """After the step's policy update; ``metrics`` are the step's training metrics."""

    def on_validation_end(self, trainer: TrainerLike, metrics: Mapping[str, float]) -> None:
        """After an evaluation pass; ``metrics`` are its results."""

    def on_save_checkpoint(self, trainer: TrainerLike) -> dict[str, Any]:
        """Return this callback's state; empty when it has none.

        Values are plain JSON types, except that a top-level entry may hold torch tensors (an adapter, an
        optimizer state dict): the trainer stores such entries in a torch file beside the JSON.
        """
        return {}

    def on_load_checkpoint(self, trainer: TrainerLike, state: Mapping[str, Any]) -> None:
        """Restore the state that :meth:`on_save_checkpoint` returned."""

    def on_train_end(self, trainer: TrainerLike) -> None:
        """After the last step."""


class CallbackList(Callback):
    """Dispatches every hook to its callbacks in list order.

    Checkpoint state is one dict keyed by callback name (the class name, suffixed ``_1``, ``_2`` ... for
    repeats of a class), so each callback gets back exactly what it saved.
    """

    def __init__(self, callbacks: Sequence[Callback] = ()) -> None:
        for index, callback in enumerate(callbacks):
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks[{index}]: expected a Callback, got {type(callback).__name__}")
        self.callbacks: list[Callback] = list(callbacks)
        #: the key of the callback whose hook is running (None between hooks): whose metrics ``log`` gets
        self.current: str | None = None

    def _each(self):
        """(key, callback) pairs; ``current`` names the callback while the caller runs its hook."""
        for key, callback in zip(self.state_keys(), self.callbacks):
            self.current = key
            try:
                yield key, callback
            finally:
                self.current = None

    def __len__(self) -> int:
        return len(self.callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def state_keys(self) -> list[str]:
        """Checkpoint key of each callback, in order."""
        seen: dict[str, int] = {}
        keys = []
        for callback in self.callbacks:
            name = type(callback).__name__
            count = seen.get(name, 0)
            seen[name] = count + 1
            keys.append(name if count == 0 else f"{name}_{count}")
        return keys

    def on_train_start(self, trainer: TrainerLike) -> None:
        for _, callback in self._each():
            callback.on_train_start(trainer)

    def on_rollout_end(self, trainer: TrainerLike, report: StepReport) -> None:
        for _, callback in self._each():
            callback.on_rollout_end(trainer, report)

    def on_train_batch_end(
        self, trainer: TrainerLike, report: StepReport, metrics: Mapping[str, float]
    ) -> None:
        for _, callback in self._each():
            callback.on_train_batch_end(trainer, report, metrics)

    def on_validation_end(self, trainer: TrainerLike, metrics: Mapping[str, float]) -> None:
        for _, callback in self._each():
            callback.on_validation_end(trainer, metrics)

    def on_save_checkpoint(self, trainer: TrainerLike) -> dict[str, Any]:
        states = {}
        for key, callback in self._each():
            state = callback.on_save_checkpoint(trainer)
            if state:
                states[key] = state
        return states

    def on_load_checkpoint(self, trainer: TrainerLike, state: Mapping[str, Any]) -> None:
        keys = self.state_keys()
        for key, callback in self._each():
            if key in state:
                callback.on_load_checkpoint(trainer, state[key])
        unknown = sorted(set(state) - set(keys))
        if unknown:
            logger.warning("checkpoint holds state for callbacks not configured in this run: %s", unknown)

    def on_train_end(self, trainer: TrainerLike) -> None:
        for _, callback in self._each():
            callback.on_train_end(trainer)


class CallbackConfigError(ValueError):
    """A ``callbacks:`` recipe entry cannot be built; the message names the entry and the bad key."""


def _suggest(name: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1)
    return f" - did you mean '{close[0]}'?" if close else ""


def _import_target(where: str, target: Any) -> type:
    if not isinstance(target, str) or "." not in target:
        raise CallbackConfigError(
            f"{where}._target_={target!r}: expected a dotted path like 'my_package.callbacks.MyCallback'"
        )
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CallbackConfigError(
            f"{where}._target_='{target}': cannot import module '{module_name}' ({exc})"
        ) from exc
    if not hasattr(module, attr):
        public = [name for name in dir(module) if not name.startswith("_")]
        raise CallbackConfigError(
            f"{where}._target_='{target}': module '{module_name}' has no attribute '{attr}'{_suggest(attr, public)}"
        )
    cls = getattr(module, attr)
    built_in = getattr(cls, "built_in", None)
    if isinstance(built_in, str):
        raise CallbackConfigError(
            f"{where}._target_='{target}': {attr} is built by the trainer from the recipe's {built_in}; "
            "remove it from callbacks (the callbacks list is for user extras)"
        )
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise CallbackConfigError(f"{where}._target_='{target}': is not a Callback subclass")
    return cls


def _check_kwargs(where: str, target: str, cls: type, kwargs: Mapping[str, Any]) -> None:
    signature = inspect.signature(cls).parameters.values()
    params = {
        p.name: p
        for p in signature
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature)
    for key in kwargs:
        if key not in params and not open_kwargs:
            raise CallbackConfigError(
                f"{where}: unknown argument '{key}' for {target}{_suggest(key, list(params))} "
                f"(allowed: {', '.join(params)})"
            )
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise CallbackConfigError(f"{where}: {target} needs argument(s) {', '.join(missing)}")


def instantiate_callbacks(entries: Sequence[Mapping[str, Any]] | None) -> CallbackList:
    """Build callbacks from recipe entries ``{"_target_": "pkg.module.Class", **kwargs}``, in order.

    Raises:
        CallbackConfigError: naming the entry (``callbacks[i]``) and the bad target or argument, with a
            close-match suggestion for a misspelled argument or class name; errors the constructor raises
            (``ValueError``/``TypeError``) are re-raised with the entry prefixed.
    """
    callbacks: list[Callback] = []
    for index, entry in enumerate(entries or ()):
        where = f"callbacks[{index}]"
        if not isinstance(entry, Mapping):
            raise CallbackConfigError(
                f"{where}: expected a mapping with a '_target_' key, got {type(entry).__name__}"
            )
        if "_target_" not in entry:
            raise CallbackConfigError(
                f"{where}: missing '_target_' (keys given: {', '.join(map(str, entry)) or 'none'})"
            )
        kwargs = {str(k): v for k, v in entry.items() if k != "_target_"}
        target = entry["_target_"]
        cls = _import_target(where, target)
        _check_kwargs(where, target, cls, kwargs)
        try:
            callbacks.append(cls(**kwargs))
        except (TypeError, ValueError) as exc:
            raise CallbackConfigError(f"{where} ({target}): {exc}") from exc
    return CallbackList(callbacks)
