"""Where a rank's TensorRT-LLM engine runs: on that rank's own GPU (colocated, one engine per GPU).

TensorRT-LLM's Ray orchestrator (``tensorrt_llm/executor/ray_executor.py`` ``RayExecutor``, 1.2 line) starts
its GPU workers from the process that builds the ``LLM``:

- ``TLLM_RAY_FORCE_LOCAL_CLUSTER=1`` makes it ``ray.init(address="local")``: a private Ray instance per
  rank instead of attaching to a shared cluster (where a worker could land on any GPU of the node);
- it sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` and gives the workers a copy of
  ``os.environ`` (``create_workers``: ``runtime_env["env_vars"] = os.environ.copy()``), so a worker
  sees the builder's ``CUDA_VISIBLE_DEVICES``; Ray counts the GPUs of a local instance from it;
- the worker maps its Ray GPU id to a local index with ``RayWorkerWrapper.physical_to_local_id``
  (position of the id in ``CUDA_VISIBLE_DEVICES``) and keys refits by that device's UUID.

So an engine built while ``CUDA_VISIBLE_DEVICES`` names only the rank's own physical GPU, in a
private Ray instance, has its one worker on that GPU, and the rank's refit handles (keyed by the
rank's device UUID) match the worker's. The rank's own process already initialised CUDA with its
usual visibility, so the variable is set only while the ``LLM`` is built (:func:`engine_env`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def physical_gpu(local_index: int, visible_devices: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's CUDA device ``local_index``.

    Args:
        local_index: ``torch.cuda.current_device()`` of the rank. visible_devices: the rank's
            ``CUDA_VISIBLE_DEVICES`` (None or empty: every GPU is visible, index = physical id).
    """
    if local_index < 0:
        raise ValueError(f"physical_gpu: local_index must be >= 0, got {local_index}")
    if not visible_devices:
        return str(local_index)
    entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
    if local_index >= len(entries):
        raise ValueError(
            f"CUDA device {local_index} is not visible: CUDA_VISIBLE_DEVICES={visible_devices!r} lists "
            f"{len(entries)} device(s)"
        )
    return entries[local_index]


def engine_env(local_index: int, visible_devices: str | None) -> dict[str, str]:
    """Environment under which a rank builds its colocated engine (one worker, on the rank's GPU)."""
    return {
        "CUDA_VISIBLE_DEVICES": physical_gpu(local_index, visible_devices),
        "TLLM_RAY_FORCE_LOCAL_CLUSTER": "1",
    }


@contextmanager
def patched_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block, then restore the previous values exactly."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
