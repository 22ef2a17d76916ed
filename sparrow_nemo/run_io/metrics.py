"""Step metrics: the numbers of one RL step (NeMo-RL / verl names), and where they are written.

:func:`merge_metrics` joins the step's components' flat ``"group/name"`` scalars (the rollout statistics come
from :meth:`sparrow_nemo.grpo.step_batch.StepStats.metrics`); :class:`MetricsWriter` appends one JSON line per step to ``<run_dir>/metrics.jsonl``
and the step's histograms (:mod:`sparrow_nemo.run_io.histograms`) to ``<run_dir>/histograms.jsonl``, and logs both to
TensorBoard (:mod:`sparrow_nemo.run_io.tensorboard_logger`) and W&B when enabled.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from sparrow_nemo.atomic_io import atomic_write
from sparrow_nemo.config.schema import Section, knob
from sparrow_nemo.run_io.histograms import Histogram
from sparrow_nemo.run_io.metric_names import with_aliases
from sparrow_nemo.run_io.tensorboard_logger import TensorboardSink
from sparrow_nemo.run_io.wandb_logger import WandbConfig, WandbSink

logger = logging.getLogger(__name__)

#: the step histograms' JSON lines in the run folder (one line per step: {"step": n, name: Histogram.to_dict()})
HISTOGRAMS_FILE = "histograms.jsonl"


def merge_metrics(*parts: Mapping[str, float]) -> dict[str, float]:
    """One row from the step's components (trainer, update, DistillSparse, scheduler, callbacks, timing).

    Every name has one owner: a name that two parts both set is an error (no hidden precedence).
    """
    out: dict[str, float] = {}
    for part in parts:
        clash = sorted(set(out) & set(part))
        if clash:
            raise ValueError(f"metrics: {clash} set twice in one step (each metric has one owner)")
        out.update(part)
    return out


@dataclass(frozen=True)
class LoggingConfig(Section):
    """Metrics, progress and plots: the recipe's ``logging`` section (none of it enters the config hash)."""

    renamed_keys: ClassVar[dict[str, str]] = {
        "log_every_n_steps": "it was removed (never read: every step is logged)"
    }

    run_dir: str | None = knob(
        None, "folder that holds the run folders <name>-<timestamp>; null = runs/", hashed=False
    )
    jsonl: bool = knob(
        True, "metrics as JSON lines in <run_dir>/metrics.jsonl (one row per step)", hashed=False
    )
    tensorboard: bool = knob(
        False,
        "TensorBoard event files in <run_dir>/tensorboard: the metrics and the response-length and acceptance "
        "histograms (needs the tensorboard extra; run_io/tensorboard_logger.py)",
        hashed=False,
    )
    wandb: WandbConfig = knob(doc="Weights & Biases, the same metric names (optional)", factory=WandbConfig)
    progress_bar: bool = knob(True, "progress bars (rate and ETA) on the terminal", hashed=False)
    plots: bool = knob(
        True, "PNG plots in <run_dir>/plots at the end (with the step histograms as heat maps)", hashed=False
    )
    metric_aliases: Literal["nemo_rl", "verl"] | None = knob(
        None,
        "also write each metric under NeMo-RL's (nemo_rl) or verl's (verl) name, beside ours "
        "(sparrow_nemo/run_io/metric_names.py); null = ours only",
        hashed=False,
    )


class MetricsWriter:
    """Per-step metrics to ``<run_dir>/metrics.jsonl`` (one line per step with "step" and "time").

    Args:
        run_dir: the run folder. jsonl: write the JSON lines (``metrics.jsonl``, ``histograms.jsonl``).
        tensorboard: also write TensorBoard event files under ``<run_dir>/tensorboard``
            (:class:`~sparrow_nemo.run_io.tensorboard_logger.TensorboardSink`; an error without the package).
        wandb: also log every row to this W&B run (:mod:`sparrow_nemo.run_io.wandb_logger`), same names.
        aliases: ``logging.metric_aliases`` (:mod:`sparrow_nemo.run_io.metric_names`): their names beside ours.

    Attributes:
        history: the rows written (or kept from an earlier attempt). histograms: ``(step, {name: Histogram})``
            of each step that had histograms, in order.
    """

    def __init__(
        self,
        run_dir: Path,
        jsonl: bool = True,
        tensorboard: bool = False,
        wandb: WandbSink | None = None,
        aliases: str | None = None,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.histograms_path = Path(run_dir) / HISTOGRAMS_FILE
        self.jsonl = jsonl
        self.aliases = aliases
        self._wandb = wandb
        self._tb = TensorboardSink(run_dir) if tensorboard else None
        self.history: list[dict[str, Any]] = []
        self.histograms: list[tuple[int, dict[str, Histogram]]] = []

    def row(self, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """The JSON row of one step: ``step``, ``time``, then the metrics by name with the aliases' names too
        (non-finite ones null)."""
        metrics = with_aliases(metrics, self.aliases)
        row: dict[str, Any] = {"step": step, "time": time.time()}
        row.update({k: (float(v) if math.isfinite(float(v)) else None) for k, v in sorted(metrics.items())})
        return row

    def write(
        self, step: int, metrics: Mapping[str, float], histograms: Mapping[str, Histogram] | None = None
    ) -> None:
        """Record one step (:meth:`row`; TensorBoard and W&B get the aliases' names too) and its
        ``histograms`` (``histograms.jsonl``, TensorBoard, W&B; our names only)."""
        row = self.row(step, metrics)
        metrics = with_aliases(metrics, self.aliases)
        self.history.append(row)
        histograms = dict(histograms or {})
        if histograms:
            self.histograms.append((step, histograms))
        if self.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if histograms:
                line = {"step": step} | {k: h.to_dict() for k, h in sorted(histograms.items())}
                with self.histograms_path.open("a") as f:
                    f.write(json.dumps(line) + "\n")
        if self._tb is not None:
            self._tb.log(step, metrics, histograms)
        if self._wandb is not None:
            self._wandb.log(step, metrics, histograms)

    def keep_rows(self, count: int, pending: dict[str, Any] | None = None) -> int:
        """Continue the file of an earlier attempt of this run: keep its first ``count`` rows (also as
        ``history``) and drop the rest, which the resumed run computes again. Returns the rows dropped.

        ``pending``: the checkpoint's copy of its last row (written after the checkpoint): appended when the
        file holds exactly the ``count - 1`` rows before it (a kill between the two). A last line cut short
        by a kill is dropped too. Without the JSONL file the history starts empty (or with ``pending``).
        """
        if count < 0:
            raise ValueError(f"{self.path}: cannot keep {count} rows")
        rows, lines = _file_rows(self.path)
        rebuilt = pending is not None and len(rows) == count - 1
        if rebuilt:
            rows.append(pending)
            logger.info("%s: row %d (step %s) rebuilt from the checkpoint", self.path, count, pending["step"])
        elif len(rows) < count:
            logger.warning("%s has %d rows, the checkpoint counted %d", self.path, len(rows), count)
        self.history = rows[:count]
        if lines > len(self.history) or (rebuilt and (self.jsonl or self.path.is_file())):
            text = "".join(json.dumps(row) + "\n" for row in self.history)
            atomic_write(self.path, lambda f: f.write(text.encode()))
            if lines > len(self.history):
                logger.info("%s: dropped %d rows after the checkpoint", self.path, lines - len(self.history))
        self._keep_histograms(self.history[-1]["step"] if self.history else -1)
        return max(0, lines - len(self.history))

    def _keep_histograms(self, last_step: int) -> None:
        """Continue ``histograms.jsonl`` of an earlier attempt: keep its steps up to ``last_step`` (also as
        ``histograms``), drop the later ones (the resumed run writes them again) and a last line cut short. They
        only feed the plots: a file or row that does not read as histograms is dropped with a warning."""
        try:
            rows, lines = _file_rows(self.histograms_path)
        except ValueError as exc:
            logger.warning("%s; its histograms are dropped", exc)
            rows, lines = [], 1
        kept, self.histograms = [], []
        for row in rows:
            step = row.get("step")
            if not (type(step) is int and 0 <= step <= last_step):
                continue
            try:
                self.histograms.append(
                    (step, {k: Histogram.from_dict(v) for k, v in row.items() if k != "step"})
                )
                kept.append(row)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                logger.warning(
                    "%s: step %d does not read as histograms (%r); dropped", self.histograms_path, step, exc
                )
        if lines > len(kept):
            text = "".join(json.dumps(row) + "\n" for row in kept)
            atomic_write(self.histograms_path, lambda f: f.write(text.encode()))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _file_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(the complete rows of a metrics file, its lines): a last line cut short by a kill is not a row.

    Raises:
        ValueError: a line before the last that is not a JSON object (naming the file and line).
    """
    lines = path.read_text().splitlines() if path.is_file() else []
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON row")
            continue
        rows.append(row)
    return rows, len(lines)


def check_resume_rows(path: Path, count: int, step: int, pending: dict[str, Any] | None) -> None:
    """Whether the metrics file ``path`` can continue from a checkpoint of ``step`` that counted ``count``
    rows (``pending``: its copy of the last one): it holds at least ``count`` rows (or ``count - 1`` and
    the pending one), and for ``step > 0`` the last counted row is step ``step - 1``'s. Without the file
    there is nothing to keep or cut: any count passes.

    Raises:
        ValueError: what does not match, naming the file.
    """
    if not path.is_file():
        return
    rows, _ = _file_rows(path)
    if len(rows) >= count:
        last = rows[count - 1] if count else None
    elif pending is not None and len(rows) == count - 1:
        last = pending
    else:
        raise ValueError(f"{path} has {len(rows)} rows, the checkpoint counts {count}")
    if step > 0 and (last is None or last.get("step") != step - 1):
        found = "no row" if last is None else f"row {count} is step {last.get('step')!r:.20}"
        raise ValueError(f"{path}: {found}, the checkpoint's last step is {step - 1}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
