"""Optional Weights & Biases logging: the step metrics of ``metrics.jsonl``, under the same names.

``logging.wandb.enabled: true`` opens one W&B run on rank 0 (``wandb`` is imported only then: it is the
``wandb`` extra, ``pip install 'sparrow_nemo[wandb]'``). ``mode: offline`` writes the run under
``<run_dir>/wandb`` without a network or an account (``wandb sync`` uploads it later); ``online`` needs
``WANDB_API_KEY`` or ``wandb login``. Every row :class:`~sparrow_nemo.run_io.metrics.MetricsWriter` writes
is logged with ``step`` as the W&B step and the same keys (``reward/mean``, ``acceptance/p5/bin_3``, ...);
non-finite values are left out, as in TensorBoard. The step histograms (``response_length/histogram``,
``acceptance/histogram``: :mod:`sparrow_nemo.run_io.histograms`) go in the same row as ``wandb.Histogram`` of
their bins. The resolved recipe is the run's config.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sparrow_nemo.config.schema import Section, knob
from sparrow_nemo.run_io.histograms import Histogram

__all__ = ["WandbConfig", "WandbSink", "open_wandb"]


@dataclass(frozen=True)
class WandbConfig(Section):
    """The recipe's ``logging.wandb`` section (none of it enters the config hash)."""

    enabled: bool = knob(
        False, "log the step metrics to Weights & Biases (needs the wandb package)", hashed=False
    )
    mode: Literal["online", "offline"] = knob(
        "offline",
        "online (needs an API key) or offline (files under <run_dir>/wandb; `wandb sync` later)",
        hashed=False,
    )
    project: str = knob("sparrow_nemo", "W&B project", hashed=False)
    entity: str | None = knob(None, "W&B entity (team or user); null = the account's default", hashed=False)
    group: str | None = knob(None, "W&B run group (e.g. one experiment's arms); null = none", hashed=False)
    tags: tuple[str, ...] = knob((), "W&B run tags", hashed=False)


class WandbSink:
    """One W&B run; :meth:`log` takes the metric rows of one step.

    Args:
        config: the ``logging.wandb`` section.
        run_dir: the run folder (W&B files go to ``<run_dir>/wandb``); its name is the W&B run name.
        recipe: the resolved recipe as plain data (the W&B run config).

    The W&B run id is fixed by the run folder, so a resumed training run logs into the same W&B run.
    """

    def __init__(self, config: WandbConfig, run_dir: Path, recipe: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "logging.wandb.enabled=true needs the wandb package: pip install 'sparrow_nemo[wandb]' "
                "(or set logging.wandb.enabled=false)"
            ) from None
        run_dir = Path(run_dir)
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            group=config.group,
            tags=list(config.tags),
            name=run_dir.name,
            dir=str(run_dir),
            mode=config.mode,
            config=dict(recipe),
            id=_run_id(run_dir),
            resume="allow",
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(
        self, step: int, metrics: Mapping[str, float], histograms: Mapping[str, Histogram] | None = None
    ) -> None:
        """One step's metrics (finite values only) and non-empty histograms (``wandb.Histogram`` of their bins)
        at W&B step ``step``, in one W&B history row."""
        import wandb

        row: dict[str, Any] = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        for name, h in (histograms or {}).items():
            if h.total > 0:
                row[name] = wandb.Histogram(np_histogram=(list(h.counts), list(h.edges)))
        self.run.log(row, step=max(step, 0))

    def close(self) -> None:
        self.run.finish()


def open_wandb(config: WandbConfig, run_dir: Path, recipe: Mapping[str, Any]) -> WandbSink | None:
    """A :class:`WandbSink` when ``logging.wandb.enabled``, else None."""
    return WandbSink(config, run_dir, recipe) if config.enabled else None


def _run_id(run_dir: Path) -> str:
    """A W&B run id fixed by the run folder, so an attempt that resumes the folder resumes the W&B run."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
