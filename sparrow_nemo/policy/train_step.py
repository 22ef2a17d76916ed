"""One optimizer step: forward/backward over micro-batches (gradient accumulation), sync, clip, update.

How the micro-batch losses combine (``reduction``):

- ``"mean"``: the step's loss is the mean of ``loss_fn`` over the micro-batches of every data-parallel
  rank (each value a micro-batch mean: the warm-start's SFT loss, the LoRA step's);
- ``"sum"``: each ``loss_fn`` value is already its micro-batch's share of the step's loss, normalised by
  counts of the whole step (the GRPO loss, :mod:`sparrow_nemo.grpo.update`); the step's loss is their sum.
  The gradient is then independent of micro-batch size, data-parallel size and pipeline schedule.

Both are one rule: micro-batch ``i`` is weighted ``w = 1 / (micro-batches x dp)`` or ``1``, every backward
runs on ``w * loss_i``, gradients are summed over the data-parallel ranks, and the logged loss and
metrics are ``sum_i w * value_i`` over all micro-batches and ranks (keys ending in ``_max`` / ``_min``:
max / min), identical on every rank.

Non-finite guard: a NaN/inf loss in any micro-batch on any rank, or a non-finite global gradient norm
after the gradient sync, skips the update on every rank (weights and optimizer moments unchanged); the
:class:`StepResult` names the offending statistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.model import PolicyModelSpec
from sparrow_nemo.policy.schedule import LossFn, broadcast_from_last_stage, run_microbatches


@dataclass
class StepResult:
    """What one train step reports, identical on every rank.

    Attributes:
        loss: the step's loss: mean (``reduction="mean"``) or sum (``"sum"``) of the loss_fn values over the
            micro-batches of every data-parallel rank.
        grad_norm: global L2 gradient norm before clipping.
        metrics: loss_fn metrics reduced like the loss over all micro-batches and ranks (``*_max`` / ``*_min``
            keys by max / min).
        skipped: None when the update was applied; else the statistic that was not finite: ``"loss"``,
            ``"grad_norm"`` or ``"loss_scale"`` (megatron's fp16 grad-scaler overflow, which recovers by itself).
        skip_detail: for a skipped step, which value and where, e.g. ``"loss is nan in micro-batch 1 of
            data-parallel rank 0"``.
    """

    loss: float
    grad_norm: float
    metrics: dict[str, float]
    skipped: str | None = None
    skip_detail: str = ""


#: all-reduce MIN sentinel: no non-finite loss on this rank
_NO_BAD_LOSS = 1 << 62


def first_nonfinite_loss(losses: list[torch.Tensor], num_microbatches: int) -> str | None:
    """Which micro-batch loss is not finite, agreed by every rank of the run (collective when distributed).

    Args:
        losses: this rank's per-micro-batch scalar losses (empty off the last pipeline stage).
        num_microbatches: micro-batches per data-parallel rank (the same on every rank).

    Returns:
        None when all are finite everywhere; else ``"loss is nan|inf in micro-batch i of data-parallel
        rank r"`` for the first offender (lowest data-parallel rank, then micro-batch).
    """
    from megatron.core import parallel_state as ps

    code = _NO_BAD_LOSS
    for i, loss in enumerate(losses):
        value = float(loss)
        if not math.isfinite(value):
            code = ((ps.get_data_parallel_rank() * num_microbatches + i) << 1) | int(math.isinf(value))
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([code], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        code = int(flag.item())
    if code == _NO_BAD_LOSS:
        return None
    rank, micro = divmod(code >> 1, num_microbatches)
    return f"loss is {'inf' if code & 1 else 'nan'} in micro-batch {micro} of data-parallel rank {rank}"


Reduction = Literal["mean", "sum"]


def _reduce_over_step(
    results: list[tuple[torch.Tensor, dict, object]], weight: float, spec: PolicyModelSpec
) -> tuple[float, dict[str, float]]:
    """``sum_i weight * value_i`` of the losses and metrics over this rank's micro-batches and the DP group
    (``*_max`` / ``*_min`` keys: max / min), then on every pipeline stage. Collective."""
    from megatron.core import parallel_state as ps

    if not spec.post_process:  # the last stage's values arrive by the broadcast below
        return broadcast_from_last_stage(spec, None)
    keys = sorted(results[0][1])
    peak_keys = [k for k in keys if k.endswith(("_max", "_min"))]
    sum_keys = [k for k in keys if k not in peak_keys]
    signs = [1.0 if k.endswith("_max") else -1.0 for k in peak_keys]  # min(x) = -max(-x)
    # column 0 the loss, then the summed metrics; the peaks as maxima of signed values
    sums = torch.tensor([[float(loss), *(float(m[k]) for k in sum_keys)] for loss, m, _ in results])
    peaks = torch.tensor([[s * float(m[k]) for k, s in zip(peak_keys, signs)] for _, m, _ in results])
    sums, peaks = sums.double().sum(dim=0) * weight, peaks.double().amax(dim=0)
    if spec.layout.dp > 1:  # a DP group holds ranks of one pipeline stage: all of them are here
        group, device = ps.get_data_parallel_group(), _collective_device()
        sums, peaks = sums.to(device), peaks.to(device)
        dist.all_reduce(sums, group=group)
        if peak_keys:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        sums, peaks = sums.cpu(), peaks.cpu()
    metrics = dict(zip(sum_keys, sums[1:].tolist(), strict=True))
    metrics.update((k, s * v) for k, s, v in zip(peak_keys, signs, peaks.tolist(), strict=True))
    return broadcast_from_last_stage(spec, (float(sums[0]), metrics))


def _collective_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def train_step(
    model: torch.nn.Module,
    optimizer,
    spec: PolicyModelSpec,
    batches: list[PolicyBatch],
    loss_fn: LossFn,
    reduction: Reduction = "mean",
) -> StepResult:
    """Accumulate the gradient of the step's loss over ``batches`` (see the module docstring), then one
    optimizer step.

    Args:
        model: the (on GPU: DDP-wrapped) model from :func:`sparrow_nemo.policy.optim.wrap_for_training`.
        optimizer: its optimizer (``TorchPolicyOptimizer``: torch GPipe schedule; ``MegatronPolicyOptimizer``:
            megatron-core's schedule).
        batches: this data-parallel rank's micro-batches (all of the same [B, S]; the same number on every rank).
        loss_fn: ``(LogprobOutput, PolicyBatch) -> (scalar loss, metrics)``, e.g. the GRPO loss.
        reduction: ``"mean"`` or ``"sum"`` of the loss_fn values (module docstring).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"train_step: reduction must be 'mean' or 'sum', got {reduction!r}")
    weight = 1.0 / (len(batches) * spec.layout.dp) if reduction == "mean" else 1.0
    model.train()
    optimizer.zero_grad()
    results = run_microbatches(
        model, spec, batches, loss_fn, loss_scale=weight, megatron=optimizer.megatron_schedule
    )
    detail = first_nonfinite_loss([r[0] for r in results], len(batches))
    if detail is not None:
        grad_norm, skipped = float("nan"), "loss"
    else:
        outcome = optimizer.step()
        grad_norm, skipped = outcome.grad_norm, outcome.skipped
        if skipped == "grad_norm":
            detail = f"grad_norm is {grad_norm}"
        elif skipped == "loss_scale":
            detail = "fp16 loss-scale overflow"
    loss, metrics = _reduce_over_step(results, weight, spec)
    return StepResult(
        loss=loss, grad_norm=grad_norm, metrics=metrics, skipped=skipped, skip_detail=detail or ""
    )
