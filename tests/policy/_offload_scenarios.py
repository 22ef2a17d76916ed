"""Worker bodies of the offload tests (module level, so ``spawn`` can pickle them).

Each builds the policy on one branch (the CPU path, or megatron's DDP + distributed optimizer through the
test-only :mod:`megatron_gpu_branch.cuda_on_cpu` shim), trains two GRPO updates with or without an offload /
restore cycle between them (the dense logprobs of the rollout's samples computed while offloaded, as the
trainer does), and records the device bytes and the final weights on rank 0.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from megatron_gpu_branch.cuda_on_cpu import cuda_on_cpu

from policy._update_scenarios import SHAPE, replica_share, step_batch
from sparrow_nemo.grpo.losses import PolicyLossConfig
from sparrow_nemo.grpo.update import update_policy
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.packing import micro_batches
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy

SETTINGS = OptimizerSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, grad_clip=0.5)
LOSS = PolicyLossConfig(correction="tis", kl_coef=0.0, tis_cap=1.5)


def _update(policy: MegatronPolicy, seed: int) -> dict[str, float]:
    from megatron.core import parallel_state as ps

    share = replica_share(step_batch(seed), policy.spec.layout.dp, ps.get_data_parallel_rank(), 1)
    return update_policy(policy, share, LOSS, 1).metrics


def cycle(rank: int, megatron: bool, dtype: str, offload: bool, hf_dir: str, out_file: str) -> None:
    """Update, [offload, logprobs, (offload again: a no-op)], checkpoint, update, update; device bytes at each
    point. The checkpoint is saved while offloaded (a stop during rollout saves then): it restores first."""
    from megatron.core import parallel_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with cuda_on_cpu() if megatron else contextlib.nullcontext():
        policy = MegatronPolicy(
            SHAPE, ParallelLayout.for_world(world), SETTINGS, dtype, hf_dir=hf_dir, megatron_training=megatron
        )
        bytes_ = {"built": policy.device_bytes()}
        _update(policy, 3)
        bytes_["trained"] = policy.device_bytes()
        released = again = 0
        scored = step_batch(5)
        batches = micro_batches(scored.tokens, scored.lengths, {}, 4)
        if offload:
            released = policy.offload_training_state()
            bytes_["offloaded"] = policy.device_bytes()
            again = policy.offload_training_state()
        logprobs = [o.logprobs for o in policy.logprobs(batches)]
        saved = policy.save(Path(out_file).parent / f"ckpt_{offload}", 1)
        metrics = [_update(policy, 4), _update(policy, 6)]
        bytes_["restored"] = policy.device_bytes()
        weights = policy.export_hf()
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(
            {
                "bytes": bytes_,
                "released": released,
                "again": again,
                "logprobs": logprobs,
                "metrics": metrics,
                "weights": weights,
                "checkpoint": str(saved),
            },
            out_file,
        )
