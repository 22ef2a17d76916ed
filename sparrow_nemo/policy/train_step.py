"""One optimizer step: forward/backward over micro-batches (gradient accumulation), sync, clip, update.

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
        flag = torch.tensor([code], dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        code = int(flag.item())
    if code == _NO_BAD_LOSS:
        return None
    rank, micro = divmod(code >> 1, num_microbatches)
    return f"loss is {'inf' if code & 1 else 'nan'} in micro-batch {micro} of data-parallel rank {rank}"


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
    detail = first_nonfinite_loss([r[0] for r in results], len(batches))
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
    return StepResult(
        loss=loss_value, grad_norm=grad_norm, metrics=metrics, skipped=skipped, skip_detail=detail or ""
    )
