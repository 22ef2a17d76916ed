"""Test helpers: a tiny random HF Qwen3 checkpoint, and running a function on N gloo processes."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from sparrow_nemo.grpo.world import one_rank_world
from sparrow_nemo.hf_qwen3 import hf_config_dict
from sparrow_nemo.model_shapes import Qwen3Shape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_hf_checkpoint(
    shape: Qwen3Shape, out_dir: Path, seed: int = 0, shard_size: str | None = None
) -> Path:
    """Save a randomly initialised transformers Qwen3ForCausalLM of ``shape`` to ``out_dir`` (fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**hf_config_dict(shape), initializer_range=0.2)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return Path(out_dir)


#: RANK/WORLD_SIZE/MASTER_* for a one-process gloo world, restored afterwards
single_rank_env = one_rank_world


def _entry(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    except Exception:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def run_distributed(fn, world: int, *args, timeout: float = 300) -> None:
    """Run ``fn(rank, *args)`` on ``world`` spawned processes with the gloo env set; re-raise failures.

    ``timeout``: seconds to wait for each process (a hung one is killed and reported)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            failures.append(f"pid {p.pid} timed out")
        elif p.exitcode != 0 and not failures:
            failures.append(f"pid {p.pid} exit code {p.exitcode}")
    if failures:
        raise AssertionError("\n".join(failures))
