"""The sparse rule's constants: KV page size, the always-kept sink and local pages, the dense layers.

One definition for the rollout engine, the policy's sparse forward, calibration and the schedules:
:data:`PAGE_SIZE` is the default page size everywhere a signature takes ``page_size`` (the paper: 16).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, knob, one_of

__all__ = ["PAGE_SCORES", "PAGE_SIZE", "SparsePattern", "landmarks_per_page"]

#: Tokens per KV page in the paper (and every default in this project).
PAGE_SIZE = 16
#: How a decode step ranks pages (sparrow_nemo.sparse.attention): the paper's mean key, or Quest's key bounds.
PAGE_SCORES = ("centroid", "minmax")


def landmarks_per_page(page_score: str) -> int:
    """[Hkv, D] vectors a page keeps per layer, and a decode step scores: 1 centroid, or 2 key bounds (minmax)."""
    if page_score not in PAGE_SCORES:
        raise ValueError(f"page_score must be one of {PAGE_SCORES}, got {page_score!r}")
    return 2 if page_score == "minmax" else 1


@dataclass(frozen=True)
class SparsePattern(Section):
    """Which pages a sparse decode step always keeps, and which layers stay dense (paper: 16, 1, 2, 2)."""

    page_size: int = knob(PAGE_SIZE, "tokens per KV page", check=AT_LEAST_ONE)
    sink_pages: int = knob(1, "first pages always kept (attention sink)", check=NON_NEGATIVE)
    local_pages: int = knob(2, "most recent pages always kept (local window)", check=NON_NEGATIVE)
    dense_layers: int = knob(2, "first decoder layers that always attend densely", check=NON_NEGATIVE)
    page_score: str = knob(
        "centroid",
        "how pages are ranked: 'centroid' (the paper: group-mean query . mean key) or 'minmax' (Quest: the "
        "upper bound per-channel min/max keys give on q . k; twice the scoring bytes)",
        check=one_of(PAGE_SCORES),
    )

    @property
    def min_budget(self) -> int:
        """Smallest budget, tokens: the always-kept sink and local pages (no top-k page on top)."""
        return (self.sink_pages + self.local_pages) * self.page_size

    def pattern(self) -> SparsePattern:
        """Just the pattern (a subclass such as the recipe's ``SparsityConfig`` carries more)."""
        return SparsePattern(
            self.page_size, self.sink_pages, self.local_pages, self.dense_layers, self.page_score
        )
