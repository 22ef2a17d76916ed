"""The process world of a run: ranks from the launcher's environment, the default process group.

Knows no recipe, so every layer may use it (the trainer, DistillSparse, the warm-start, the commands).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist

#: The variables a launcher (torchrun, srun) sets to place a process in its world.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def env_without_launcher() -> dict[str, str]:
    """This process's environment minus :data:`LAUNCHER_ENV`: for a subprocess that must start its own
    world (a caller's earlier 1-rank run may have left its variables set, and its port still held)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}


def single_process_defaults() -> None:
    """Outside torchrun / srun (no ``WORLD_SIZE``): a 1-rank world on a free local port.

    ``init_distributed`` would otherwise use port 29500, which another local job may hold.
    """
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def free_port() -> int:
    """A local TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A fresh one-process world (RANK/WORLD_SIZE/MASTER_* on a free port) inside; the env restored after.

    For running several trainers one after another in one process (experiments, tests): each gets a new
    port, since the previous one closed its process group.
    """
    saved = {k: os.environ.pop(k, None) for k in LAUNCHER_ENV}
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
        if os.environ.get("WORLD_SIZE") == "1" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # one rank hosts its own store, so any free port will do; an inherited one may still be held
            os.environ["MASTER_PORT"] = str(free_port())
    timeout = None if dist_timeout_minutes is None else datetime.timedelta(minutes=dist_timeout_minutes)
    init_distributed(timeout=timeout)


def world_size() -> int:
    """Ranks of this run (``WORLD_SIZE`` as set by torchrun / srun; 1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (``RANK``; 0 when absent)."""
    return int(os.environ.get("RANK", "0"))
