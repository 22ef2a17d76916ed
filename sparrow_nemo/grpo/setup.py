"""Build the run's workers from a recipe: the megatron policy, the rollout engine, the sampling settings.

Shared by ``sparrow train`` (the trainer) and ``sparrow calibrate`` so both read the recipe the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.config import SparrowConfig
from sparrow_nemo.rollout.engine import SamplingParams


def single_process_defaults() -> None:
    """Outside torchrun / srun (no ``WORLD_SIZE``): a 1-rank world on a free local port.

    ``init_distributed`` would otherwise use port 29500, which another local job may hold.
    """
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A fresh one-process world (RANK/WORLD_SIZE/MASTER_* on a free port) inside; the env restored after.

    For running several trainers one after another in one process (experiments, tests): each gets a new
    port, since the previous one closed its process group.
    """
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k, None) for k in keys}
    single_process_defaults()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_processes(dist_timeout_minutes: float | None = None) -> None:
    """The default process group (gloo on CPU, nccl on GPU) from the launcher's env, or a 1-rank one.

    ``dist_timeout_minutes`` (``trainer.dist_timeout_minutes``) bounds every collective; None = torch's default.
    """
    from sparrow_nemo.grpo.process_model import forget_object_group
    from sparrow_nemo.policy.parallel import init_distributed

    single_process_defaults()
    if not dist.is_initialized():
        forget_object_group()
    timeout = None if dist_timeout_minutes is None else datetime.timedelta(minutes=dist_timeout_minutes)
    init_distributed(timeout=timeout)


def broadcast_from_rank0(obj: Any) -> Any:
    """``obj`` as rank 0 has it, on every rank (over gloo; identity without a multi-rank process group)."""
    from sparrow_nemo.grpo.process_model import broadcast_object

    return broadcast_object(obj, src=0)


def world_size() -> int:
    """Ranks of this run (``WORLD_SIZE`` as set by torchrun / srun; 1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (``RANK``; 0 when absent)."""
    return int(os.environ.get("RANK", "0"))


def device(config: SparrowConfig) -> torch.device:
    """``trainer.device`` resolved: auto = cuda when available."""
    if config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_cpu_threads(config: SparrowConfig) -> None:
    """``torch.set_num_threads(trainer.cpu_threads)`` when the run is on the CPU and the key is not 0."""
    if config.trainer.cpu_threads and device(config).type == "cpu":
        torch.set_num_threads(config.trainer.cpu_threads)


def build_policy(config: SparrowConfig, hf_dir: str | Path | None, lr: float | None = None):
    """A :class:`~sparrow_nemo.policy.policy.MegatronPolicy` for the recipe, from ``hf_dir`` or random init.

    Args:
        lr: learning rate override (the warm-start uses its own); None = ``policy.optimizer.lr``.
    """
    from sparrow_nemo.policy.memory import MemorySettings
    from sparrow_nemo.policy.optim import OptimizerSettings
    from sparrow_nemo.policy.parallel import ParallelLayout
    from sparrow_nemo.policy.policy import MegatronPolicy

    p, o = config.policy, config.policy.optimizer
    layout = ParallelLayout.for_world(
        world_size(), p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    )
    if p.data_parallel_size is not None and p.data_parallel_size != layout.dp:
        raise ValueError(
            f"policy.data_parallel_size={p.data_parallel_size} but {world_size()} ranks with tp="
            f"{layout.tp}, pp={layout.pp} give dp={layout.dp}"
        )
    settings = OptimizerSettings(
        lr=o.lr if lr is None else lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        distributed=o.distributed,
    )
    return MegatronPolicy(
        config.model.shape(),
        layout,
        settings,
        dtype=p.precision,
        hf_dir=hf_dir,
        seed=config.trainer.seed + 1,
        memory=MemorySettings.from_policy_config(p),
    )


def build_engine(config: SparrowConfig, weights: Mapping[str, torch.Tensor], tokenizer=None):
    """The rollout engine of ``rollout.backend`` over HF-named ``weights`` (e.g. ``policy.export_hf()``)."""
    if config.rollout.backend == "trtllm":
        if config.model.hf_checkpoint is None:
            raise ValueError("rollout.backend=trtllm needs model.hf_checkpoint (the LLM starts from it)")
        from sparrow_nemo.rollout.trtllm import TrtllmRolloutEngine

        engine = TrtllmRolloutEngine.from_recipe(config, config.model.hf_checkpoint)
        engine.update_weights(weights)
        return engine
    from sparrow_nemo.policy.model import resolve_dtype
    from sparrow_nemo.rollout.qwen3_torch import Qwen3Decoder
    from sparrow_nemo.rollout.torch_engine import TorchRolloutEngine

    dtype, dev = resolve_dtype(config.model.dtype), device(config)
    params = {name: t.to(device=dev, dtype=dtype) for name, t in weights.items()}
    s, r = config.sparsity, config.rollout
    return TorchRolloutEngine(
        Qwen3Decoder(config.model.shape(), params),
        dense_layers=s.dense_layers,
        page_size=s.page_size,
        sink_pages=s.sink_pages,
        local_pages=s.local_pages,
        attention_backend=r.attention_impl,
        tokenizer=tokenizer,
        max_batch_size=r.max_batch_size,
        prefill_chunk_tokens=r.prefill_chunk_tokens,
    )


def sampling_params(config: SparrowConfig, seed: int | None = None) -> SamplingParams:
    """The recipe's :class:`SamplingParams`; ``seed`` replaces ``rollout.seed`` (one per RL step)."""
    r = config.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=r.seed if seed is None else seed,
        stop_token_ids=r.stop_token_ids,
        stop_strings=r.stop_strings,
        logprobs_topk=r.logprobs_topk,
    )
