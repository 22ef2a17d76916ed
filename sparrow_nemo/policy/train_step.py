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
:class:`StepResult` names the offending statistic. Finite gradients can still make non-finite weights (an
infinite or huge learning rate): the weights are checked after every applied update (one flag per
parameter, one host sync and one all-reduce per step) and :class:`NonFiniteWeightsError` names the first
offending parameter and the learning rate; such weights cannot be undone, so the run stops there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.model import PolicyModelSpec
from sparrow_nemo.policy.pipeline import LossFn, broadcast_from_last_stage, run_microbatches


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


class NonFiniteWeightsError(FloatingPointError):
    """An applied update left parameters that are not finite; the message names one and the learning rate."""


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """Collective: None when every parameter of every rank is finite; else the first offender, named.

    One flag per parameter computed where it lives, one host sync, one all-reduce; the names are gathered
    only when some rank has a non-finite parameter.
    """
    params = list(model.named_parameters())
    flags = (
        torch.stack([torch.isfinite(p).all() for _, p in params])
        if params
        else torch.ones(1, dtype=torch.bool)
    )
    where = None
    if not bool(flags.all()):
        name = params[int((~flags).nonzero()[0, 0])][0]
        where = f"'{name}' on rank {dist.get_rank() if dist.is_initialized() else 0}"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return where
    any_bad = torch.tensor([int(where is not None)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(any_bad, op=dist.ReduceOp.MAX)
    if not any_bad.item():
        return None
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, where)
    return next(w for w in found if w is not None)


#: all-reduce MIN sentinel: no non-finite loss on this rank
_NO_BAD_LOSS = 1 << 62
#: bits of the micro-batch index in the MIN code (the DP rank sits above them)
_MICRO_BITS = 24


def first_nonfinite_loss(losses: list[torch.Tensor]) -> str | None:
    """Which micro-batch loss is not finite, agreed by every rank of the run (collective when distributed).

    Args:
        losses: this rank's per-micro-batch scalar losses (empty off the last pipeline stage; the number may
            differ between data-parallel ranks).

    Returns:
        None when all are finite everywhere; else ``"loss is nan|inf in micro-batch i of data-parallel
        rank r"`` for the first offender (lowest data-parallel rank, then micro-batch).
    """
    from megatron.core import parallel_state as ps

    code = _NO_BAD_LOSS
    for i, loss in enumerate(losses):
        value = float(loss)
        if not math.isfinite(value):
            code = (((ps.get_data_parallel_rank() << _MICRO_BITS) | i) << 1) | int(math.isinf(value))
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([code], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        code = int(flag.item())
    if code == _NO_BAD_LOSS:
        return None
    rank, micro = divmod(code >> 1, 1 << _MICRO_BITS)
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
        batches: this data-parallel rank's micro-batches (``reduction="mean"`` needs the same number on every
            rank; ``"sum"`` does not).
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
    detail = first_nonfinite_loss([r[0] for r in results])
    if detail is not None:
        grad_norm, skipped = float("nan"), "loss"
    else:
        outcome = optimizer.step()
        grad_norm, skipped = outcome.grad_norm, outcome.skipped
        if skipped is None and (bad := first_nonfinite_weight(model)) is not None:
            settings = getattr(optimizer, "settings", None)
            lr = f"learning rate {settings.lr}" if settings is not None else "the learning rate"
            raise NonFiniteWeightsError(
                f"the update left non-finite weights (first: parameter {bad}) although the loss and the "
                f"gradient norm {grad_norm:.4g} were finite; {lr} (policy.optimizer.lr) is too large or not "
                "finite: lower it and resume from the last checkpoint"
            )
        if skipped == "grad_norm":
            detail = f"grad_norm is {grad_norm}"
        elif skipped == "loss_scale":
            detail = "fp16 loss-scale overflow"
    loss, metrics = _reduce_over_step(results, weight, spec)
    return StepResult(
        loss=loss, grad_norm=grad_norm, metrics=metrics, skipped=skipped, skip_detail=detail or ""
    )
