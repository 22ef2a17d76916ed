"""Optional TensorBoard logging: the step metrics of ``metrics.jsonl`` as scalars, the step histograms as histograms.

``logging.tensorboard: true`` writes event files under ``<run_dir>/tensorboard`` on rank 0, through
``torch.utils.tensorboard``'s writer, which needs the ``tensorboard`` package (the ``tensorboard`` extra,
``pip install 'sparrow-nemo[tensorboard]'``; imported only when enabled, a missing package is a one-line error).
Scalars keep the metric names (``reward/mean``, ``acceptance/p5/bin_3``, ...; non-finite values left out, as in
W&B); the histograms of :mod:`sparrow_nemo.run_io.histograms` (``response_length/histogram``,
``acceptance/histogram``) go in as TensorBoard histograms of their bins (``add_histogram_raw``: bucket limits
are the bins' upper edges), shown in TensorBoard's Histograms and Distributions tabs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from sparrow_nemo.run_io.histograms import Histogram

__all__ = ["TensorboardSink"]


class TensorboardSink:
    """One TensorBoard event file writer in ``<run_dir>/tensorboard``; :meth:`log` takes one step."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError(
                "logging.tensorboard=true needs the tensorboard package: pip install 'sparrow-nemo[tensorboard]' "
                "(or set logging.tensorboard=false)"
            ) from None
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(
        self, step: int, metrics: Mapping[str, float], histograms: Mapping[str, Histogram] | None = None
    ) -> None:
        """One step's finite scalars and non-empty histograms at global step ``step``."""
        for name, value in metrics.items():
            if math.isfinite(float(value)):
                self.writer.add_scalar(name, float(value), step)
        for name, h in (histograms or {}).items():
            if h.total > 0:
                self.writer.add_histogram_raw(
                    name,
                    min=h.min,
                    max=h.max,
                    num=int(h.total),
                    sum=h.sum,
                    sum_squares=h.sum_squares,
                    bucket_limits=list(h.edges[1:]),
                    bucket_counts=list(h.counts),
                    global_step=step,
                )
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
