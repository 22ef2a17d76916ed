"""Worker bodies of the sharded-checkpoint tests (module level, so ``spawn`` can pickle them): megatron's GPU
branch (DDP + distributed optimizer, through the test-only :mod:`megatron_gpu_branch.cuda_on_cpu` shim) saves
after one GRPO update, and a run of any data-parallel size resumes and makes the next one."""

from __future__ import annotations

import os

import torch
from megatron_gpu_branch.cuda_on_cpu import cuda_on_cpu

from policy._offload_scenarios import SETTINGS, _update
from policy._update_scenarios import SHAPE
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy


def _policy(dtype: str, hf_dir: str | None) -> MegatronPolicy:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return MegatronPolicy(
        SHAPE, ParallelLayout.for_world(world), SETTINGS, dtype, hf_dir=hf_dir, megatron_training=True
    )


def save_and_continue(rank: int, dtype: str, hf_dir: str, root: str, out_file: str) -> None:
    """Update, checkpoint ``step_00000001``, update: the weights after each update."""
    from megatron.core import parallel_state

    with cuda_on_cpu():
        policy = _policy(dtype, hf_dir)
        _update(policy, 3)
        saved = policy.export_hf()
        policy.save(root, 1)
        _update(policy, 4)
        after = policy.export_hf()
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save({"saved": saved, "after": after}, out_file)


def resume_and_continue(rank: int, dtype: str, checkpoint: str, out_file: str) -> None:
    """A randomly initialised policy loads ``checkpoint`` and makes the next update."""
    from megatron.core import parallel_state

    with cuda_on_cpu():
        policy = _policy(dtype, None)
        step = policy.load(checkpoint)
        loaded = policy.export_hf()
        _update(policy, 4)
        after = policy.export_hf()
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save({"step": step, "loaded": loaded, "after": after}, out_file)
