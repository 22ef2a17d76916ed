"""Step metrics: the numbers of one RL step (NeMo-RL / verl names), and where they are written.

:func:`rollout_metrics` turns a step's rollouts, rewards, mismatch and schedule into flat ``"group/name"``
scalars; :class:`MetricsWriter` appends one JSON line per step to ``<run_dir>/metrics.jsonl`` (and
TensorBoard scalars when enabled and installed); :func:`progress` is the tqdm bar factory.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.atomic_io import atomic_write
from sparrow_nemo.config.schema import Section, knob
from sparrow_nemo.grpo.wandb_logger import WandbConfig, WandbSink
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.sparse.mismatch import tail_by_bin
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

logger = logging.getLogger(__name__)


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    v = values.double()
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/std": float(v.std()) if v.numel() > 1 else 0.0}


def rollout_metrics(
    samples: Sequence[RolloutSample],
    rewards: torch.Tensor,
    mismatch: TokenMismatch,
    schedule: BudgetSchedule,
    quantile: float,
    tokens_per_s: float,
    predicted_speedup: float,
) -> dict[str, float]:
    """Rollout-side metrics of one step.

    Args:
        samples: the step's N rollouts. rewards: [N] float in [0, 1] (accuracy = reward == 1).
        mismatch: per response token acceptance rate and cached length (dense policy vs sparse engine).
        schedule: the schedule the rollouts used. quantile: tail level (0.05 -> ``acceptance/p5/bin_i``).
        tokens_per_s: generated tokens per second of rollout wall time.
        predicted_speedup: cost model, this schedule vs dense on the step's lengths.
    """
    lengths = torch.tensor([s.response_ids.numel() for s in samples], dtype=torch.float64)
    truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.float64)
    m: dict[str, float] = {
        **_stats("reward", rewards),
        "reward/accuracy": float((rewards >= 1.0).double().mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/truncation_rate": float(truncated.mean()),
        "rollout/tokens": float(lengths.sum()),
        "rollout/tokens_per_s": tokens_per_s,
        "sparsity/predicted_speedup": predicted_speedup,
        "sparsity/dense": float(schedule.is_dense),
    }
    if mismatch.alpha.numel():
        stat = f"p{100 * quantile:g}"
        m["acceptance/mean"] = float(mismatch.alpha.double().mean())
        m[f"acceptance/{stat}"] = float(torch.quantile(mismatch.alpha.double(), quantile))
        bins = tail_by_bin(mismatch.alpha, mismatch.cached_len, schedule.bin_tokens, quantile)
        index = mismatch.cached_len // schedule.bin_tokens
        counts = torch.bincount(index)
        sums = torch.bincount(index, weights=mismatch.alpha.double())
        for b, value in bins.items():
            m[f"acceptance/{stat}/bin_{b}"] = float(value)
            m[f"acceptance/mean/bin_{b}"] = float(sums[b] / counts[b])
            m[f"acceptance/tokens/bin_{b}"] = float(counts[b])
        diff = (mismatch.train_logprobs - mismatch.gen_logprobs).double()
        m["token_mult_prob_error"] = float(torch.exp(diff.abs()).mean())
        m["rollout_is/log_ppl_diff"] = float(diff.mean())
        for b in range(max([len(schedule.budgets), *(k + 1 for k in bins)])):
            budget = schedule.budget(b * schedule.bin_tokens)
            m[f"sparsity/budget/bin_{b}"] = float("inf") if budget == DENSE_BUDGET else float(budget)
    return m


@dataclass(frozen=True)
class LoggingConfig(Section):
    """Metrics, progress and plots: the recipe's ``logging`` section (none of it enters the config hash)."""

    run_dir: str | None = knob(
        None, "folder that holds the run folders <name>-<timestamp>; null = runs/", hashed=False
    )
    jsonl: bool = knob(
        True, "metrics as JSON lines in <run_dir>/metrics.jsonl (one row per step)", hashed=False
    )
    tensorboard: bool = knob(
        False, "TensorBoard event files in <run_dir>/tensorboard (needs tensorboard)", hashed=False
    )
    wandb: WandbConfig = knob(doc="Weights & Biases, the same metric names (optional)", factory=WandbConfig)
    progress_bar: bool = knob(True, "progress bars (rate and ETA) on the terminal", hashed=False)
    plots: bool = knob(True, "PNG plots in <run_dir>/plots at the end", hashed=False)


class MetricsWriter:
    """Per-step metrics to ``<run_dir>/metrics.jsonl`` (one line per step with "step" and "time").

    Args:
        run_dir: the run folder. jsonl: write the JSON lines. tensorboard: also write TensorBoard scalars
            under ``<run_dir>/tensorboard`` (skipped with a warning when no TensorBoard writer is installed).
        wandb: also log every row to this W&B run (:mod:`sparrow_nemo.grpo.wandb_logger`), same names.
    """

    def __init__(
        self, run_dir: Path, jsonl: bool = True, tensorboard: bool = False, wandb: WandbSink | None = None
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.jsonl = jsonl
        self._wandb = wandb
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            except ImportError:
                logger.warning("logging.tensorboard=true but tensorboard is not installed: JSONL only")
        self.history: list[dict[str, Any]] = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one step; non-finite values are written as null."""
        row = {"step": step, "time": time.time()}
        row.update({k: (float(v) if math.isfinite(float(v)) else None) for k, v in sorted(metrics.items())})
        self.history.append(row)
        if self.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, metrics)

    def keep_rows(self, count: int) -> int:
        """Continue the file of an earlier attempt of this run: keep its first ``count`` rows (also as
        ``history``) and drop the rest, which the resumed run computes again. Returns the rows dropped.

        A last line cut short by a kill is dropped too. Without the JSONL file the history starts empty.
        """
        rows: list[dict[str, Any]] = []
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        for number, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number}: not a JSON line") from None
        if len(rows) < count:
            logger.warning("%s has %d rows, the checkpoint counted %d", self.path, len(rows), count)
        self.history = rows[:count]
        if len(lines) > len(self.history):
            text = "".join(json.dumps(row) + "\n" for row in self.history)
            atomic_write(self.path, lambda f: f.write(text.encode()))
            logger.info("%s: dropped %d rows after the checkpoint", self.path, len(lines) - len(self.history))
        return len(lines) - len(self.history)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def progress(iterable: Iterable | None = None, *, enabled: bool, **kwargs: Any):
    """A tqdm bar (rate and ETA) when ``enabled``, else a silent one with the same interface."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kwargs)


def rollout_progress(num_samples: int, max_new_tokens: int, enabled: bool):
    """A tokens bar for one rollout (``update`` is the engine's ``on_tokens``); closes with ``with``.

    Its total is the length cap (``num_samples x max_new_tokens``), so the ETA is an upper bound and
    the bar ends short of 100 % when responses stop early.
    """
    return progress(
        total=num_samples * max_new_tokens, enabled=enabled, desc="rollout", unit="tok", leave=False
    )
