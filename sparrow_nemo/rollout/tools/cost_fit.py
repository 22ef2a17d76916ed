"""The decode cost model of the machine a run is on: its hardware constants, named or fitted.

``rollout.cost_hardware`` picks them (:func:`rollout_cost_model`):

- ``h200`` / ``h100``: the constants of :data:`sparrow_nemo.sparse.cost_model.HARDWARE`;
- a path ending in ``.json``: :meth:`Hardware.from_json` (e.g. written by :meth:`Hardware.to_json`);
- ``auto``: a GPU's preset by its name (``H100`` -> h100, any other -> h200), and on the CPU constants
  fitted at startup from timed decode steps of the rollout engine itself (:func:`fit_cpu_hardware`).

Why fit on the CPU: a named GPU's constants say nothing about a CPU, where one torch thread's per-step
overhead (op dispatch, norms, small matmuls: 2-4 ms for the 4-layer tiny model at batch 32) is as large as its
memory traffic at 1K tokens, and a sparse layer's scattered page reads run several times slower than in-order
reads (docs/cpu_decode.md). The fit times three configurations on a cache of random keys and values (``batch``
rows): dense at a short (:data:`FIT_SHORT`) and a long (:data:`FIT_LONG`) context, and a fixed budget of 1/8 of
the long one; the cost model's own byte and FLOP counts (:meth:`DecodeCostModel.step_bytes`,
:meth:`DecodeCostModel.step_cost`) then give, in order (:func:`solve_hardware`):

    mem_bandwidth        = (in-order bytes long - short) / (time long - time short, compute taken off)
    step_overhead_s      = what the short dense step's time leaves beyond its compute and bytes
    page_read_bandwidth  = scattered bytes of the sparse step / what its time leaves beyond the rest

with ``peak_flops`` from a matmul on the process's threads. It takes 1-2 s for the tiny model, once per process.
The long context must outgrow the CPU's caches (2K tokens x batch 32 = 128 MB for the tiny model; at 1K the
fit read 61 GB/s "in order"). Noise cannot make a constant negative: a long step not slower than the short one
keeps half the measured copy bandwidth, and a sparse step faster than its in-order part keeps the page reads at
the in-order bandwidth. Measured at 2K (docs/speculative.md): predictions within 17 % of the measured
speedups of sparse and speculative decoding (1.91x vs 2.25x, 1.50x vs 1.36x), ranked as measured.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.rollout.engine import RolloutConfig
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)

__all__ = [
    "COST_HARDWARE_FILE",
    "FitPoint",
    "engine_cost_model",
    "fit_cpu_hardware",
    "matmul_flops",
    "rollout_cost_model",
    "rollout_hardware",
    "solve_hardware",
]

#: decode steps timed per configuration of the CPU fit, and how many times they take turns
FIT_STEPS = 8
FIT_REPEATS = 2
#: the fit's short and (at most) long cached lengths, tokens
FIT_SHORT = 64
FIT_LONG = 2048
#: the file of a run folder that keeps the constants fitted at its start (read again on resume)
COST_HARDWARE_FILE = "cost_hardware.json"


@dataclass(frozen=True)
class FitPoint:
    """One timed configuration: ``batch`` rows at ``cached_len`` tokens each reading ``kv_tokens_read`` tokens
    per sparse layer and scoring ``scored_pages`` pages there (the cost model's ``step_cost`` arguments), one
    decode step taking ``seconds``."""

    cached_len: float
    kv_tokens_read: float
    scored_pages: float
    batch: int
    seconds: float


def _terms(model: DecodeCostModel, point: FitPoint) -> tuple[float, float, float]:
    """(compute seconds at the model's peak_flops, in-order bytes, scattered bytes) of one step of ``point``."""
    args = [torch.tensor([[v]], dtype=torch.float64) for v in (point.cached_len, point.kv_tokens_read)]
    args += [torch.tensor([[point.scored_pages]], dtype=torch.float64), torch.tensor([[float(point.batch)]])]
    compute = float(model.step_cost(*args).compute_s[0])
    in_order, scattered = (float(x[0]) for x in model.step_bytes(*args))
    return compute, in_order, scattered


def solve_hardware(
    model: DecodeCostModel,
    short: FitPoint,
    long: FitPoint,
    sparse: FitPoint,
    peak_flops: float,
    fallback_bandwidth: float,
    name: str = "cpu (fitted)",
) -> Hardware:
    """The :class:`Hardware` whose cost model (``model``'s shape and byte sizes) reproduces the three timed
    steps: two dense ones at different contexts and one whose sparse layers select pages (module docstring).

    ``fallback_bandwidth`` (bytes/s) is the in-order bandwidth when the two dense times do not grow with the
    context (noise); the page reads never come out faster than in-order reads.
    """
    model = replace(model, hardware=Hardware(name, peak_flops=peak_flops, mem_bandwidth=1.0))
    (c_s, a_s, _), (c_l, a_l, _), (c_p, a_p, s_p) = (_terms(model, p) for p in (short, long, sparse))
    grows = (long.seconds - c_l) - (short.seconds - c_s)
    bandwidth = (a_l - a_s) / grows if grows > 0 and a_l > a_s else fallback_bandwidth
    overhead = max(short.seconds - c_s - a_s / bandwidth, 0.0)
    left = sparse.seconds - c_p - a_p / bandwidth - overhead
    page_bandwidth = min(s_p / left, bandwidth) if left > 0 and s_p > 0 else bandwidth
    return Hardware(name, peak_flops, bandwidth, step_overhead_s=overhead, page_read_bandwidth=page_bandwidth)


def matmul_flops(size: int = 256, repeats: int = 5) -> float:
    """FLOP/s of a float32 ``size`` x ``size`` matmul on this process's torch threads (best of ``repeats``)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


#: fitted constants per (everything that changes a fit's timings) within this process: trainers built one
#: after another (tests, experiments) on the same machine measure once
_FITTED: dict[tuple, Hardware] = {}


def fit_cpu_hardware(engine: Any, batch: int = 32, seed: int = 0) -> Hardware:
    """:class:`Hardware` fitted to ``engine`` (a CPU :class:`TorchRolloutEngine`) from timed decode steps.

    ``batch`` rows (at most the engine's ``max_batch_size``); the long context is :data:`FIT_LONG` tokens or
    what the model's positions allow. About 1-2 s for the tiny model, once per process for the same model
    shape, dtype, attention settings, batch and thread count.
    """
    batch = max(1, min(batch, engine.max_batch_size or batch))
    key = (
        engine.shape,
        engine.model.dtype,
        engine.page_size,
        engine.dense_layers,
        engine.sink_pages,
        engine.local_pages,
        engine.page_score,
        engine.backend,
        engine.model.heads,
        batch,
        seed,
        torch.get_num_threads(),
    )
    if key not in _FITTED:
        _FITTED[key] = _fit(engine, batch, seed)
    return _FITTED[key]


def _fit(engine: Any, batch: int, seed: int) -> Hardware:
    from sparrow_nemo.rollout.tools.bench import copy_bandwidth, time_decode_steps

    ps, shape = engine.page_size, engine.shape
    longest = (shape.max_position_embeddings - FIT_STEPS - 4) // ps * ps
    long_ctx = min(FIT_LONG, longest)
    short_ctx = min(FIT_SHORT, long_ctx // 4 // ps * ps) or ps
    budget = max(long_ctx // 8 // ps * ps, (engine.sink_pages + engine.local_pages + 1) * ps)
    dense = BudgetSchedule.dense(2 * long_ctx, ps)
    fixed = BudgetSchedule(bin_tokens=2 * long_ctx, budgets=(budget,), page_size=ps, name=f"fixed:{budget}")
    _, (t_short,) = time_decode_steps(engine, short_ctx, [dense], batch, FIT_STEPS, seed, FIT_REPEATS)
    _, (t_long, t_sparse) = time_decode_steps(
        engine, long_ctx, [dense, fixed], batch, FIT_STEPS, seed, FIT_REPEATS
    )
    model = engine_cost_model(engine, Hardware("fit", 1.0, 1.0))
    # the timed steps run at cached lengths context + 2 .. context + steps + 1
    mean_offset = (FIT_STEPS + 3) / 2

    def point(context: int, schedule: BudgetSchedule, seconds: float) -> FitPoint:
        cached = torch.tensor([context + mean_offset])
        read, scored = model.sparse_reads(cached.round().to(torch.int64), schedule)
        return FitPoint(float(cached), float(read), float(scored), batch, seconds / FIT_STEPS)

    hardware = solve_hardware(
        model,
        point(short_ctx, dense, t_short),
        point(long_ctx, dense, t_long),
        point(long_ctx, fixed, t_sparse),
        peak_flops=matmul_flops(),
        fallback_bandwidth=copy_bandwidth(repeats=2) / 2,
    )
    logger.info(
        "decode cost model fitted on this CPU (batch %d, %d / %d tokens, %d-token budget): %.1f GFLOP/s, "
        "%.1f GB/s in order, %.1f GB/s selected pages, %.2f ms per step",
        batch,
        short_ctx,
        long_ctx,
        budget,
        hardware.peak_flops / 1e9,
        hardware.mem_bandwidth / 1e9,
        hardware.page_bandwidth / 1e9,
        hardware.step_overhead_s * 1e3,
    )
    return hardware


def engine_cost_model(engine: Any, hardware: Hardware) -> DecodeCostModel:
    """The decode cost model of a torch ``engine``'s model, dense layers, page score and element sizes on
    ``hardware``."""
    itemsize = engine.model.dtype.itemsize
    return DecodeCostModel(
        engine.shape,
        hardware,
        dense_layers=engine.dense_layers,
        weight_bytes=itemsize,
        kv_bytes=itemsize,
        page_score=engine.page_score,
    )


def rollout_hardware(spec: str, engine: Any, saved: Path | None = None, write: bool = True) -> Hardware:
    """The hardware ``rollout.cost_hardware`` = ``spec`` names for ``engine`` (module docstring).

    ``saved``: where a run keeps constants fitted to the CPU (a JSON file in its folder). When it exists they
    are read instead of fitted, so a resumed run prices steps, and the speculative planner decides, as before
    the interruption; a fit writes it (atomically) when ``write`` (false on the other ranks of a
    tensor-parallel engine, which fit along with its first: they take part in its timed steps).
    """
    from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine

    if spec.endswith(".json"):
        if not Path(spec).is_file():
            raise FileNotFoundError(f"rollout.cost_hardware: {spec} not found (a Hardware JSON file)")
        return Hardware.from_json(spec)
    if spec != "auto":
        return HARDWARE[spec]
    torch_engine = isinstance(engine, TorchRolloutEngine)
    if torch_engine and engine.device.type == "cpu":
        if saved is not None and saved.is_file():
            return Hardware.from_json(saved)
        hardware = fit_cpu_hardware(engine)
        if saved is not None and write:
            partial = saved.with_name(saved.name + ".partial")
            hardware.to_json(partial)
            partial.replace(saved)
        return hardware
    # a GPU engine (TensorRT-LLM's has no device attribute: the process's current GPU)
    gpu = (
        torch.cuda.get_device_name(engine.device if torch_engine else None)
        if torch.cuda.is_available()
        else ""
    )
    return HARDWARE["h100" if "H100" in gpu.upper() else "h200"]


def rollout_cost_model(
    rollout: RolloutConfig,
    sparsity: SparsityConfig,
    shape: Qwen3Shape,
    engine: Any,
    saved: Path | None = None,
    write: bool = True,
) -> DecodeCostModel:
    """The decode cost model of ``engine`` on ``rollout.cost_hardware`` (:func:`rollout_hardware`, ``saved`` and
    ``write`` as there): a torch engine's model, dense layers, page score and element sizes, else (TensorRT-LLM)
    ``shape``, ``sparsity.dense_layers`` and ``sparsity.page_score`` in bf16."""
    from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine

    hardware = rollout_hardware(rollout.cost_hardware, engine, saved, write)
    if isinstance(engine, TorchRolloutEngine):
        return engine_cost_model(engine, hardware)
    return DecodeCostModel(
        shape, hardware, dense_layers=sparsity.dense_layers, page_score=sparsity.page_score
    )
