"""Tensor / pipeline / data parallel layout: validation with clear reasons, and megatron start-up.

Ranks are laid out the megatron-core way (order ``tp-cp-ep-dp-pp``): tensor-parallel ranks are
adjacent, pipeline stages are the slowest-varying index.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparrow_nemo.model_shapes import Qwen3Shape


class LayoutError(ValueError):
    """A parallel layout that cannot run: the message says which size and why."""


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks split one model.

    Attributes:
        tp: tensor-parallel size (attention heads, MLP width and vocab are split over it).
        pp: pipeline-parallel size (contiguous ranges of decoder layers per stage).
        dp: data-parallel size (model replicas); ``tp * pp * dp == world_size``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        """Ranks the layout occupies."""
        return self.tp * self.pp * self.dp

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> ParallelLayout:
        """The layout with data parallelism filling ``world_size``; refuses a ``tp*pp`` that does not divide it."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if world_size % (tp * pp):
            raise LayoutError(
                f"tp*pp = {tp}*{pp} = {tp * pp} does not divide the world size {world_size}: "
                "every data-parallel replica needs a full tp x pp grid of ranks"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    def validate(self, shape: Qwen3Shape, world_size: int | None = None) -> None:
        """Raise :class:`LayoutError` naming the first size that does not divide.

        Args:
            shape: the model to split.
            world_size: when given, also checked against ``tp * pp * dp``.
        """
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} does not match the "
                f"world size {world_size}"
            )
        checks = (
            (
                shape.num_layers,
                self.pp,
                "num_layers",
                "pp",
                "each pipeline stage holds a whole number of layers",
            ),
            (
                shape.num_attention_heads,
                self.tp,
                "num_attention_heads",
                "tp",
                "each tensor-parallel rank holds whole query heads",
            ),
            (
                shape.num_key_value_heads,
                self.tp,
                "num_key_value_heads",
                "tp",
                "each tensor-parallel rank holds whole KV heads (GQA groups are not split)",
            ),
            (
                shape.intermediate_size,
                self.tp,
                "intermediate_size",
                "tp",
                "the SwiGLU width is split evenly over tensor-parallel ranks",
            ),
        )
        for total, parts, what, by, why in checks:
            if total % parts:
                raise LayoutError(f"{by}={parts} does not divide {what}={total}: {why}")

    def to_dict(self) -> dict[str, int]:
        """``{"tp", "pp", "dp", "world_size"}``."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "world_size": self.world_size}


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """Global decoder-layer indices held by pipeline ``stage`` (even split; validated by the layout)."""
    if num_layers % pp:
        raise LayoutError(f"pp={pp} does not divide num_layers={num_layers}")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Start the default process group from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    A single process with no env vars gets a 1-rank group. Backend: ``nccl`` with CUDA, else ``gloo``.
    ``timeout``: of every collective (None = torch's default).
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)


def initialize_parallel(layout: ParallelLayout, shape: Qwen3Shape, seed: int = 1234) -> None:
    """Validate ``layout`` against the model and the running world, then set up megatron's parallel_state.

    Also applies the CPU shims (when there is no GPU) and seeds the model-parallel RNG. Every group megatron
    makes (tensor, pipeline, data parallel, their gloo twins, ...) bounds its collectives by the default
    group's timeout (:func:`default_timeout_minutes`).
    """
    from megatron.core import parallel_state

    from sparrow_nemo.policy.cpu_shims import apply_cpu_shims, seed_model_parallel

    init_distributed()
    layout.validate(shape, world_size=dist.get_world_size())
    apply_cpu_shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    minutes = default_timeout_minutes()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        distributed_timeout_minutes=minutes,
    )
    # megatron-core 0.16.1 makes some groups without its timeout (EXPERT_DATA_PARALLEL_GROUP_GLOO): set it on
    # every group this rank belongs to (a local setting, no collective)
    for group in parallel_state._global_process_group_list or []:
        if group is not None:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(minutes=minutes), group)
    seed_model_parallel(seed)


def default_timeout_minutes() -> float:
    """The default process group's collective timeout, minutes (``trainer.dist_timeout_minutes`` when
    :func:`init_distributed` started it): megatron's groups get the same bound instead of its own 30."""
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    backend = dist.distributed_c10d._get_default_group()._get_backend(device)
    return backend.options._timeout.total_seconds() / 60.0


def destroy_parallel() -> None:
    """Tear down megatron's parallel_state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
