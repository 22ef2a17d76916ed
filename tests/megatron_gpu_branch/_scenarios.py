"""Worker bodies of the GPU-branch tests (module level, so ``spawn`` can pickle them).

Each builds the policy on one branch - megatron's DDP + optimizer + schedule under :mod:`.cuda_on_cpu`, or
the project's CPU path - and records what the comparison needs on rank 0.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from policy._update_scenarios import SHAPE, replica_share, step_batch

from sparrow_nemo.grpo.losses import PolicyLossConfig
from sparrow_nemo.grpo.update import update_policy
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.packing import micro_batches
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy

from .cuda_on_cpu import cuda_on_cpu

#: clipping on (the first step's gradient norm is above it), weight decay large enough to see on the norms
SETTINGS = OptimizerSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, grad_clip=0.5)
LOSS = PolicyLossConfig(correction="tis", kl_coef=0.1, tis_cap=1.5)
MICRO = 1  # rows per micro-batch: several micro-batches per DP rank, so megatron's division would show


def _branch(megatron: bool):
    return cuda_on_cpu() if megatron else contextlib.nullcontext()


def _policy(tp: int, pp: int, megatron: bool, ckpt: str | None) -> MegatronPolicy:
    layout = ParallelLayout.for_world(int(os.environ.get("WORLD_SIZE", "1")), tp=tp, pp=pp)
    return MegatronPolicy(SHAPE, layout, SETTINGS, "float32", hf_dir=ckpt, megatron_training=megatron)


def _release() -> None:
    """Drop megatron's parallel state but keep the process group: the next job of the suite reuses it (no
    new port to find on a busy machine)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _update(policy: MegatronPolicy, seed: int) -> dict[str, float]:
    from megatron.core import parallel_state as ps

    share = replica_share(step_batch(seed), policy.spec.layout.dp, ps.get_data_parallel_rank(), 1)
    return update_policy(policy, share, LOSS, MICRO).metrics


def train_two_steps(rank: int, tp: int, pp: int, megatron: bool, ckpt: str, root: str, out_file: str) -> None:
    """Checkpoint before any update (step 0), update, checkpoint (step 1), update; logprobs, metrics, weights."""
    with _branch(megatron):
        policy = _policy(tp, pp, megatron, ckpt)
        scored = step_batch(3)
        logprobs = policy.logprobs(micro_batches(scored.tokens, scored.lengths, {}, 4))
        policy.save(root, 0)
        first = _update(policy, 3)
        weights1 = policy.export_hf()
        policy.save(root, 1)
        second = _update(policy, 4)
        weights2 = policy.export_hf()
        inner = policy.optimizer.optimizer if megatron else None
        subs = getattr(inner, "chained_optimizers", [inner]) if megatron else []
        built = [type(policy.model).__name__, *(type(sub).__name__ for sub in subs)]
        _release()
    if rank == 0:
        torch.save(
            {
                "logprobs": [o.logprobs for o in logprobs],
                "first": first,
                "second": second,
                "weights1": weights1,
                "weights2": weights2,
                "built": built,
            },
            out_file,
        )


def resume(rank: int, tp: int, pp: int, megatron: bool, checkpoint: str, out_file: str) -> None:
    """A randomly initialised policy loads ``checkpoint`` (step 0 or 1) and runs the steps after it."""
    with _branch(megatron):
        policy = _policy(tp, pp, megatron, None)
        step = policy.load(checkpoint)
        first = _update(policy, 3) if step == 0 else None
        second = _update(policy, 4)
        weights2 = policy.export_hf()
        _release()
    if rank == 0:
        torch.save({"step": step, "first": first, "second": second, "weights2": weights2}, out_file)


def suite(rank: int, tp: int, pp: int, ckpt: str, root: str) -> None:
    """The megatron branch in this world: two steps with checkpoints, then a resume from each checkpoint,
    in one process group."""
    import torch.distributed as dist

    base = Path(root)
    train_two_steps(rank, tp, pp, True, ckpt, str(base / "ckpt"), str(base / "run.pt"))
    for step in (0, 1):
        resume(rank, tp, pp, True, str(base / "ckpt" / f"step_{step:08d}"), str(base / f"resume{step}.pt"))
    dist.destroy_process_group()
