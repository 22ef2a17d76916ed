"""Targets per GPU kind, and the identity every results line of the GPU window carries.

A rollout's memory-bound speedup limit (bytes read dense / bytes read sparse per decode step, from the
project's decode cost model, :class:`sparrow_nemo.sparse.cost_model.DecodeCostModel`) falls with the batch:
the weights are read once per step for the whole batch. The batch that fits at 32K depends on the GPU's
memory, so an H100 80 GB holds about half an H200's rows and, at 32K, the 4B/8B/14B limits there are below
the paper's speedups (8B: ~1.8x possible vs 2.06x). A line is judged by the limit of the GPU it ran on and
the batch it ran at, and carries both kinds' limits (at the batch each fits) beside it.

``SPARROW_COMMIT`` (set by ``benchmarks/gpu_window.sh`` from its ``--commit``) goes into every line: the
device machine gets a copy of the working tree without git.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import BudgetSchedule


@dataclass(frozen=True)
class GpuKind:
    """One GPU the device tool lends: its memory as torch reports it (GiB) and its cost-model constants."""

    label: str
    memory_gib: float
    hardware: str


#: The kinds the window may run on (torch's ``total_memory``: H100 80 GB ~79.1 GiB, H200 141 GB ~139.8 GiB).
KINDS: dict[str, GpuKind] = {
    "h100": GpuKind("H100 80GB", 79.1, "h100"),
    "h200": GpuKind("H200 141GB", 139.8, "h200"),
}
#: GPU memory kept free besides the weights and the KV cache when sizing a batch (rollout_speedup's default).
HEADROOM_GIB = 8.0
#: Most rows a batch is sized at (tiny shapes would fit millions; the recipes decode at most 256 at once).
MAX_ROWS = 1024
#: A rollout line's target: its measured speedup at least this fraction of its memory-bound limit.
FRACTION_OF_LIMIT = 0.8
#: The paper's rollout speedups at its 0.86 schedules (4xH200, SGLang).
PAPER_SPEEDUP = {"qwen3-1.7b": 2.21, "qwen3-4b": 2.41, "qwen3-8b": 2.06, "qwen3-14b": 1.49}


def commit() -> str | None:
    """The commit the window was run from (``SPARROW_COMMIT``), or None outside the window."""
    return os.environ.get("SPARROW_COMMIT") or None


def kind_of(gpu_name: str | None) -> str | None:
    """``h100`` / ``h200`` from a device name (``NVIDIA H200``, ``NVIDIA H100 80GB HBM3``), else None."""
    name = (gpu_name or "").upper()
    return next((k for k in KINDS if k.upper() in name), None)


def cache_bytes_per_token(shape: Qwen3Shape, kv_bytes: int = 2, page_size: int = 16) -> float:
    """KV-cache bytes one token holds over all layers: K and V plus its share of the fp32 page centroid."""
    kv_d = shape.num_key_value_heads * shape.head_dim
    return shape.num_layers * (2 * kv_d * kv_bytes + kv_d * 4 / page_size)


def fitting_batch(shape: Qwen3Shape, kind: str, tokens_per_seq: int, weight_bytes: int = 2) -> int:
    """Sequences of ``tokens_per_seq`` whose whole KV cache fits on one GPU of ``kind`` beside the bf16
    weights and :data:`HEADROOM_GIB` (what the engine benchmarks do with the free memory they measure), at
    most :data:`MAX_ROWS`."""
    free = (KINDS[kind].memory_gib - HEADROOM_GIB) * 2**30 - shape.num_parameters() * weight_bytes
    return max(0, min(MAX_ROWS, int(free // (cache_bytes_per_token(shape) * tokens_per_seq))))


def spread(lengths: Sequence[int], n: int) -> list[int]:
    """``n`` lengths evenly spaced over the sorted ``lengths`` (the same mix at another batch size)."""
    ordered = sorted(int(x) for x in lengths)
    if n <= 0 or not ordered:
        return []
    return [ordered[min(len(ordered) - 1, math.floor((i + 0.5) * len(ordered) / n))] for i in range(n)]


def memory_bound_model(shape: Qwen3Shape, dense_layers: int = 2) -> DecodeCostModel:
    """The decode cost model with its compute and overhead terms gone: time = bytes / bandwidth. A speedup it
    predicts is the memory-bound limit (on a GPU every read runs at one bandwidth, so the kind cancels)."""
    bandwidth = HARDWARE["h200"].mem_bandwidth
    return DecodeCostModel(
        shape, Hardware("memory-bound", peak_flops=1e30, mem_bandwidth=bandwidth), dense_layers
    )


def memory_bound_limit(
    shape: Qwen3Shape, schedule: BudgetSchedule, lengths: Sequence[int], prompt: int, dense_layers: int = 2
) -> float:
    """Decode bytes dense / bytes under ``schedule`` for one batch of ``lengths`` responses after ``prompt``
    tokens (:func:`memory_bound_model`)."""
    lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
    return memory_bound_model(shape, dense_layers).predicted_speedup(schedule, lengths, prompt)


def rollout_limits(
    shape: Qwen3Shape,
    schedule: BudgetSchedule,
    lengths: Sequence[int],
    prompt: int,
    dense_layers: int,
    batch: int,
) -> dict[str, dict[str, float | int]]:
    """Per kind: the batch that fits at prompt + the longest length and the memory-bound limit of the same
    length mix at that batch; ``ran``: the limit at the batch that ran."""
    longest = prompt + max(int(x) for x in lengths)
    out: dict[str, dict[str, float | int]] = {}
    for kind in KINDS:
        fit = fitting_batch(shape, kind, longest)
        out[kind] = {
            "batch": fit,
            "memory_bound_limit": memory_bound_limit(
                shape, schedule, spread(lengths, fit), prompt, dense_layers
            )
            if fit
            else float("nan"),
        }
    out["ran"] = {
        "batch": batch,
        "memory_bound_limit": memory_bound_limit(
            shape, schedule, spread(lengths, batch), prompt, dense_layers
        ),
    }
    return out


def paper_reachable(name: str, shape: Qwen3Shape, schedule: BudgetSchedule, dense_layers: int = 2) -> dict:
    """Whether the paper's speedup is reachable at all on each kind: the memory-bound limit of a full 32K
    generation (512-token prompt) at the batch that fits there, against the paper's number."""
    paper = PAPER_SPEEDUP.get(name)
    out: dict = {"paper_speedup": paper}
    for kind in KINDS:
        fit = fitting_batch(shape, kind, 512 + 32768)
        limit = memory_bound_limit(shape, schedule, [32768] * fit, 512, dense_layers) if fit else float("nan")
        out[kind] = {"batch_32k": fit, "limit_32k": limit, "reachable": paper is not None and limit > paper}
    return out


def judge(value: float, limit: float, op: str) -> dict:
    """``{"value", "limit", "op", "pass"}`` for one target (op ``>=`` or ``<=``)."""
    ok = value >= limit if op == ">=" else value <= limit
    return {"value": value, "limit": limit, "op": op, "pass": bool(ok) and math.isfinite(value)}


def rollout_target(speedup: float, limits: dict, kind: str | None) -> dict:
    """The rollout line's target on the GPU it ran on: speedup >= :data:`FRACTION_OF_LIMIT` x the memory-bound
    limit at the batch it ran (``limits["ran"]``); ``kind`` only labels it (None off the two kinds)."""
    limit = float(limits["ran"]["memory_bound_limit"])
    target = judge(speedup / limit, FRACTION_OF_LIMIT, ">=")
    target.update(gpu_kind=kind, memory_bound_limit=limit, batch=limits["ran"]["batch"])
    return target
