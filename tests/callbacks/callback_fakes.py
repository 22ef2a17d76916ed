"""Test doubles for the user-callback tests: a minimal trainer and recording callbacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sparrow_nemo.callbacks.base import Callback
from sparrow_nemo.sparse.schedule import BudgetSchedule


@dataclass
class FakeTrainer:
    """Implements sparrow_nemo.callbacks.TrainerLike: a schedule slot, a run dir and a metric log."""

    schedule: BudgetSchedule
    run_dir: Path
    logged: list[dict[str, float]] = field(default_factory=list)

    def log(self, metrics: dict[str, float]) -> None:
        self.logged.append(dict(metrics))


class RecordingCallback(Callback):
    """Appends (name, hook, args) to a shared list for every hook; has state {'name': name, 'n': calls}."""

    def __init__(self, name: str, calls: list | None = None) -> None:
        self.name = name
        self.calls = [] if calls is None else calls
        self.loaded: dict | None = None

    def _rec(self, hook: str, *args: object) -> None:
        self.calls.append((self.name, hook, args))

    def on_train_start(self, trainer):
        self._rec("on_train_start", trainer)

    def on_rollout_end(self, trainer, report):
        self._rec("on_rollout_end", trainer, report)

    def on_train_batch_end(self, trainer, report, metrics):
        self._rec("on_train_batch_end", trainer, report, metrics)

    def on_validation_end(self, trainer, metrics):
        self._rec("on_validation_end", trainer, metrics)

    def on_save_checkpoint(self, trainer):
        self._rec("on_save_checkpoint", trainer)
        return {"name": self.name}

    def on_load_checkpoint(self, trainer, state):
        self._rec("on_load_checkpoint", trainer, state)
        self.loaded = dict(state)

    def on_train_end(self, trainer):
        self._rec("on_train_end", trainer)


class OpenKwargsCallback(Callback):
    """Takes any keyword arguments (instantiation must not reject them)."""

    def __init__(self, **options: object) -> None:
        self.options = options


class ThresholdCallback(Callback):
    """A user callback with checked keyword arguments (instantiation errors name the entry)."""

    def __init__(self, threshold: float = 0.5, mode: str = "watch") -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"ThresholdCallback: invalid threshold={threshold!r}")
        if mode not in ("watch", "act"):
            raise ValueError(f"ThresholdCallback: mode={mode!r}, expected one of watch, act")
        self.threshold = threshold
        self.mode = mode
