"""The "sparrow" sparse-attention algorithm's settings for TensorRT-LLM (plain torch, no TensorRT-LLM import).

:class:`SparrowSparseSpec` holds the algorithm's settings (page size, sink/local pages, dense first
layers, the page score, the budget schedule) and translates them to and from the ``sparse_attention_config`` dict that
TensorRT-LLM receives and that :class:`~sparrow_nemo.rollout.trtllm.plugin.SparrowSparseAttentionConfig`
validates. The rest of the algorithm's TensorRT-LLM side that runs without TensorRT-LLM: the page
landmarks, centroids or key bounds (:mod:`~sparrow_nemo.rollout.trtllm.kv_cache`), the pool layout
(:mod:`~sparrow_nemo.rollout.trtllm.layout`) and the generation step
(:mod:`~sparrow_nemo.rollout.trtllm.decode`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.pattern import PAGE_SCORES
from sparrow_nemo.sparse.schedule import BudgetSchedule

#: the value of ``sparse_attention_config.algorithm`` that selects this algorithm
ALGORITHM = "sparrow"


@dataclass(frozen=True)
class SparrowSparseSpec:
    """Settings of the "sparrow" algorithm (docs/METHOD.md: page 16, 1 sink page, 2 local pages, 2 dense layers).

    Attributes:
        schedule: KV budget (tokens, reserved pages included) per bin of cached length.
        dense_layers: the first layers attend densely (no selection).
        sink_pages, local_pages: pages always kept at the start / end of the cache.
        page_score: how pages are ranked (``sparsity.page_score``): "centroid" (the paper) or "minmax"
            (per-page key bounds, twice the landmark memory).
    """

    schedule: BudgetSchedule
    dense_layers: int = 2
    sink_pages: int = 1
    local_pages: int = 2
    page_score: str = "centroid"

    def __post_init__(self) -> None:
        if self.dense_layers < 0 or self.sink_pages < 0 or self.local_pages < 0:
            raise ValueError(
                "SparrowSparseSpec: dense_layers, sink_pages and local_pages must be >= 0, got "
                f"{self.dense_layers}, {self.sink_pages}, {self.local_pages}"
            )
        if self.page_score not in PAGE_SCORES:
            raise ValueError(
                f"sparse_attention_config.page_score must be one of {PAGE_SCORES}, got {self.page_score!r}"
            )

    @property
    def page_size(self) -> int:
        """Tokens per page (= TensorRT-LLM KV block size, ``tokens_per_block``)."""
        return self.schedule.page_size

    @classmethod
    def from_sparsity(cls, s: SparsityConfig, schedule: BudgetSchedule | None = None) -> SparrowSparseSpec:
        """The spec of the recipe's ``sparsity`` section (``schedule`` replaces the section's)."""
        return cls(
            schedule=schedule if schedule is not None else s.build_schedule(),
            dense_layers=s.dense_layers,
            sink_pages=s.sink_pages,
            local_pages=s.local_pages,
            page_score=s.page_score,
        )

    def with_schedule(self, schedule: BudgetSchedule) -> SparrowSparseSpec:
        """The same spec with another schedule (the trainer adapts budgets between steps)."""
        if schedule.page_size != self.page_size:
            raise ValueError(
                f"schedule '{schedule.name}' uses page_size={schedule.page_size}, but the engine's KV blocks "
                f"hold {self.page_size} tokens"
            )
        return dataclasses.replace(self, schedule=schedule)

    def keeps_landmarks(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` may select pages under some schedule (not a dense first layer),
        so it keeps page landmarks (centroids or key bounds)."""
        return layer_idx >= self.dense_layers

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` selects pages under the current schedule."""
        return self.keeps_landmarks(layer_idx) and not self.schedule.is_dense

    def to_config_dict(self) -> dict[str, Any]:
        """The ``sparse_attention_config`` mapping TensorRT-LLM receives (YAML/JSON friendly)."""
        sched = self.schedule.to_dict()
        return {
            "algorithm": ALGORITHM,
            "page_size": self.page_size,
            "sink_pages": self.sink_pages,
            "local_pages": self.local_pages,
            "dense_layers": self.dense_layers,
            "page_score": self.page_score,
            "bin_tokens": sched["bin_tokens"],
            "budgets": sched["budgets"],
            "schedule_name": sched["name"],
        }

    @classmethod
    def from_config_dict(cls, data: Mapping[str, Any]) -> SparrowSparseSpec:
        """Inverse of :meth:`to_config_dict`; a wrong algorithm or a missing/unknown key is a ValueError
        (a dict without ``page_score``, written before it existed, means "centroid")."""
        known = {
            "algorithm",
            "page_size",
            "sink_pages",
            "local_pages",
            "dense_layers",
            "page_score",
            "bin_tokens",
            "budgets",
            "schedule_name",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"sparse_attention_config: unknown keys {sorted(unknown)}; expected {sorted(known)}"
            )
        if data.get("algorithm") != ALGORITHM:
            raise ValueError(
                f"sparse_attention_config.algorithm must be '{ALGORITHM}', got {data.get('algorithm')!r}"
            )
        missing = {"page_size", "bin_tokens", "budgets"} - set(data)
        if missing:
            raise ValueError(f"sparse_attention_config: missing keys {sorted(missing)}")
        schedule = BudgetSchedule.from_dict(
            {
                "name": data.get("schedule_name", ""),
                "bin_tokens": data["bin_tokens"],
                "page_size": data["page_size"],
                "budgets": list(data["budgets"]),
            }
        )
        return cls(
            schedule=schedule,
            dense_layers=int(data.get("dense_layers", 2)),
            sink_pages=int(data.get("sink_pages", 1)),
            local_pages=int(data.get("local_pages", 2)),
            page_score=str(data.get("page_score", "centroid")),
        )
