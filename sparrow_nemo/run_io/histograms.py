"""Per-step histograms of the rollouts: response lengths and per-token acceptance rates, merged over the world.

Two distributions of each RL step (:meth:`~sparrow_nemo.grpo.step_batch.StepStats.histograms`):

- ``response_length/histogram``: the step's samples by response length (tokens), :data:`BINS` equal bins over
  ``[0, rollout.max_new_tokens]``;
- ``acceptance/histogram``: every response token by its acceptance rate (``sum_v min(p, q)`` of the policy's
  dense and the engine's sparse top-K; 1 = no mismatch), :data:`BINS` bins of 0.02 over ``[0, 1]``.

Each rank bins its own samples and tokens into fixed edges and one all-reduce of sums and one of maxima merge
them (:func:`~sparrow_nemo.grpo.step_batch.merged_histograms`), so a histogram is ``BINS`` counts and five moments whatever the batch (10M
tokens at recipe scale); no value leaves its rank. Rank 0 writes them to TensorBoard
(``add_histogram_raw``), to W&B (``wandb.Histogram``) and to ``<run_dir>/histograms.jsonl``, from which the
end-of-run PNG plots draw them (:mod:`sparrow_nemo.run_io.plots`). This module is the data type;
the merge is the step's (it is collective).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

#: bins of every step histogram
BINS = 50


@dataclass(frozen=True)
class Histogram:
    """Counts of values in fixed bins, with the moments TensorBoard's histograms carry.

    Attributes:
        edges: ``BINS + 1`` increasing bin edges; bin ``i`` is ``[edges[i], edges[i + 1])``, the last one closed
            (values outside the edges count in the end bins).
        counts: values per bin. total: all values. sum, sum_squares: of the values.
        min, max: the smallest and largest value (``inf`` / ``-inf`` when there is none).
    """

    edges: tuple[float, ...]
    counts: tuple[float, ...]
    total: float
    sum: float
    sum_squares: float
    min: float
    max: float

    def __post_init__(self) -> None:
        if len(self.edges) != len(self.counts) + 1:
            raise ValueError(f"histogram: {len(self.edges)} edges for {len(self.counts)} bins")

    @property
    def mean(self) -> float:
        return self.sum / self.total if self.total else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON; ``min`` / ``max`` of an empty histogram as null)."""
        out = asdict(self) | {"edges": list(self.edges), "counts": list(self.counts)}
        return out | {k: (v if math.isfinite(v) else None) for k, v in (("min", self.min), ("max", self.max))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Histogram:
        """Inverse of :meth:`to_dict`."""
        extreme = {"min": math.inf, "max": -math.inf}
        return cls(
            edges=tuple(float(e) for e in data["edges"]),
            counts=tuple(float(c) for c in data["counts"]),
            total=float(data["total"]),
            sum=float(data["sum"]),
            sum_squares=float(data["sum_squares"]),
            **{k: float(extreme[k] if data[k] is None else data[k]) for k in extreme},
        )
