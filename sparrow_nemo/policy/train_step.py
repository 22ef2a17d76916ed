"""One optimizer step: forward/backward over micro-batches (gradient accumulation), sync, clip, update."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.model import PolicyModelSpec
from sparrow_nemo.policy.schedule import LossFn, broadcast_from_last_stage, run_microbatches


@dataclass
class StepResult:
    """What one train step reports, identical on every rank.

    Attributes:
        loss: mean over micro-batches and data-parallel replicas of the loss_fn values.
        grad_norm: global L2 gradient norm before clipping.
        metrics: loss_fn metrics, mean over micro-batches (of this data-parallel replica's last stage).
    """

    loss: float
    grad_norm: float
    metrics: dict[str, float]


def train_step(
    model: torch.nn.Module, optimizer, spec: PolicyModelSpec, batches: list[PolicyBatch], loss_fn: LossFn
) -> StepResult:
    """Accumulate gradients of ``mean_i loss_fn(outputs_i, batch_i)`` over ``batches``, then one optimizer step.

    Args:
        model: the (on GPU: DDP-wrapped) model from :func:`sparrow_nemo.policy.optim.wrap_for_training`.
        optimizer: its optimizer (``TorchPolicyOptimizer`` or ``MegatronPolicyOptimizer``).
        batches: this data-parallel rank's micro-batches (all of the same [B, S]).
        loss_fn: ``(LogprobOutput, PolicyBatch) -> (scalar loss, metrics)``, e.g. the GRPO loss.
    """
    model.train()
    optimizer.zero_grad()
    results = run_microbatches(model, spec, batches, loss_fn)
    grad_norm = optimizer.step()
    if spec.post_process:
        loss = torch.stack([r[0].float().cpu() for r in results]).mean()
        keys = results[0][1].keys()
        metrics = {k: sum(float(r[1][k]) for r in results) / len(results) for k in keys}
    else:
        loss, metrics = torch.zeros(()), {}
    from megatron.core import parallel_state as ps

    if spec.layout.dp > 1:
        dp_group = ps.get_data_parallel_group()
        loss = loss.to("cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(loss, group=dp_group)
        loss = loss.cpu() / spec.layout.dp
    loss_value, metrics = broadcast_from_last_stage(spec, (float(loss), metrics))
    return StepResult(loss=loss_value, grad_norm=grad_norm, metrics=metrics)
