"""Per-step histograms of the rollouts: response lengths and per-token acceptance rates, merged over the world.

Two distributions of each RL step (:meth:`~sparrow_nemo.grpo.step_batch.StepStats.histograms`):

- ``response_length/histogram``: the step's samples by response length (tokens), :data:`BINS` equal bins over
  ``[0, rollout.max_new_tokens]``;
- ``acceptance/histogram``: every response token by its acceptance rate (``sum_v min(p, q)`` of the policy's
  dense and the engine's sparse top-K; 1 = no mismatch), :data:`BINS` bins of 0.02 over ``[0, 1]``.

Each rank bins its own samples and tokens into fixed edges and one all-reduce of sums and one of maxima merge
them (:func:`merged_histograms`), so a histogram is ``BINS`` counts and five moments whatever the batch (10M
tokens at recipe scale); no value leaves its rank. Rank 0 writes them to TensorBoard
(``add_histogram_raw``), to W&B (``wandb.Histogram``) and to ``<run_dir>/histograms.jsonl``, from which the
end-of-run PNG plots draw them (:mod:`sparrow_nemo.grpo.plots`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sparrow_nemo.grpo.process_model import reduce_max, reduce_sums

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


def merged_histograms(
    parts: Sequence[tuple[torch.Tensor, float, float]], bins: int = BINS
) -> list[Histogram]:
    """One :class:`Histogram` per ``(values, low, high)`` of this rank (any shape), ``bins`` equal bins over
    ``[low, high]``, merged over every rank: one all-reduce of sums, one of maxima. Collective; every rank must
    pass the same ``low``, ``high`` and number of parts."""
    sums: list[float] = []
    extremes: list[float] = []
    edges = []
    for values, low, high in parts:
        if not high > low:
            raise ValueError(f"histogram: edges [{low}, {high}] are empty")
        grid = torch.linspace(low, high, bins + 1, dtype=torch.float64)
        v = values.detach().reshape(-1).double().cpu()
        index = torch.bucketize(
            v, grid[1:-1], right=True
        )  # [low, e1) -> 0 ... [e_{bins-1}, high] -> bins - 1
        counts = torch.bincount(index, minlength=bins).double()
        sums += [*counts.tolist(), float(v.numel()), float(v.sum()), float((v * v).sum())]
        extremes += [float(v.max()), -float(v.min())] if v.numel() else [-math.inf, -math.inf]
        edges.append(tuple(grid.tolist()))
    sums, extremes = reduce_sums(sums), reduce_max(extremes)
    out = []
    for k, grid in enumerate(edges):
        s = sums[k * (bins + 3) : (k + 1) * (bins + 3)]
        top, neg_bottom = extremes[2 * k : 2 * k + 2]
        out.append(Histogram(grid, tuple(s[:bins]), s[bins], s[bins + 1], s[bins + 2], -neg_bottom, top))
    return out
