"""The Sparrow method, framework-free torch: page selection and sparse decode attention,
per-token mismatch (acceptance rate) and its tail by bin, the budget schedule, its calibration,
and the decode cost model. No megatron, transformers or triton imports here."""

from sparrow_nemo.sparse.attention import (
    PAGE_SCORES,
    decode_attention,
    group_mean_query,
    key_bound_scores,
    page_centroids,
    page_key_bounds,
    select_pages,
    select_pages_from_centroids,
    select_pages_from_key_bounds,
    selected_page_count,
    selected_token_mask,
    sparse_decode_attention,
)
from sparrow_nemo.sparse.calibration import CalibrationResult, calibrate_schedule
from sparrow_nemo.sparse.cost_model import (
    HARDWARE,
    DecodeCostModel,
    Hardware,
    RolloutCost,
    predicted_speedup,
    rollout_cost,
)
from sparrow_nemo.sparse.mismatch import (
    acceptance_rate,
    acceptance_rate_topk,
    binned_quantiles,
    summarize,
    tail_by_bin,
)
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, PAPER_SCHEDULES, BudgetSchedule

__all__ = [
    "DENSE_BUDGET",
    "HARDWARE",
    "PAGE_SCORES",
    "PAPER_SCHEDULES",
    "BudgetSchedule",
    "CalibrationResult",
    "DecodeCostModel",
    "Hardware",
    "RolloutCost",
    "acceptance_rate",
    "acceptance_rate_topk",
    "binned_quantiles",
    "calibrate_schedule",
    "decode_attention",
    "group_mean_query",
    "key_bound_scores",
    "page_centroids",
    "page_key_bounds",
    "predicted_speedup",
    "rollout_cost",
    "select_pages",
    "select_pages_from_centroids",
    "select_pages_from_key_bounds",
    "selected_page_count",
    "selected_token_mask",
    "sparse_decode_attention",
    "summarize",
    "tail_by_bin",
]
