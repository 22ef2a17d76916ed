"""The policy-update phase of a GRPO step: mini-batches, the step-normalised loss, ``policy.train_step``.

Entry point: :func:`update_policy`, called on every rank with that data-parallel rank's share of the
step's samples (:class:`UpdateBatch`; the ranks of one TP/PP group pass the same share).

1. The share is cut into ``grpo.mini_batches_per_step`` contiguous mini-batches; mini-batch ``m`` of the
   step is the union of every DP rank's ``m``-th piece. Each is one optimizer step. The trainer orders its
   share with :func:`mini_batch_order` first, so mini-batch ``m`` is the same GRPO groups at any DP size.
2. Per mini-batch, the loss denominators (response tokens and non-empty sequences: verl's
   ``global_batch_num_tokens``, NeMo-RL's ``global_valid_toks`` / ``global_valid_seqs``) are counted over
   all DP ranks: one all-reduce of a ``[mini_batches, 2]`` tensor over the DP group for the whole step.
3. Each micro-batch's loss is its share of the mini-batch's loss (:class:`~sparrow_nemo.grpo.losses.
   LossNormalizer`), summed over micro-batches and DP ranks by ``train_step(reduction="sum")``: the loss
   and its gradient do not depend on micro-batch size, DP size or pipeline schedule.
4. ``old_logprobs`` were computed once, before the first update, with the step's starting weights: in
   mini-batch 0 the PPO ratio is exactly 1, in later ones the weights have moved and the clip acts.

Sizes at recipe scale (512 x 40K tokens, 32 GPUs): nothing here is bigger than this rank's share; the
only collectives are the counts above and ``train_step``'s own (gradients, a few scalar metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from sparrow_nemo.grpo.losses import LossNormalizer, PolicyLossConfig
from sparrow_nemo.grpo.objective import grpo_loss_fn
from sparrow_nemo.grpo.rollout_corr import mismatch_metrics
from sparrow_nemo.policy.packing import micro_batches
from sparrow_nemo.policy.train_step import StepResult

#: metrics combined over mini-batches by max / min (the others: means weighted by the mini-batch's tokens)
_EXTREMA = {"ratio_max": max, "ratio_min": min}


@dataclass
class UpdateBatch:
    """One data-parallel rank's share of an RL step's samples (CPU tensors, ``n`` rows right-padded to S).

    Column ``j`` of the ``[n, S-1]`` tensors scores token ``j + 1`` (:mod:`sparrow_nemo.grpo.rollout_step`).

    Attributes:
        tokens: [n, S] int64 prompt + response.
        lengths: [n] int64 real tokens per row.
        response_mask: [n, S-1] bool, True at the columns scoring a response token.
        advantages: [n] float32 per-sample advantage.
        rollout_logprobs: [n, S-1] float32 rollout engine (sparse) logprob of each response token.
        old_logprobs: [n, S-1] float32 dense policy logprobs before this step's first update.
        ref_logprobs: [n, S-1] float32 frozen reference policy logprobs (needed when ``kl_coef > 0``).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, s = self.tokens.shape
        expected = {"lengths": (n,), "advantages": (n,), "response_mask": (n, s - 1)}
        expected |= {"rollout_logprobs": (n, s - 1), "old_logprobs": (n, s - 1), "ref_logprobs": (n, s - 1)}
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"UpdateBatch.{name}: expected shape {shape}, got {tuple(value.shape)}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice | torch.Tensor) -> UpdateBatch:
        """The rows ``index`` of every tensor."""
        return UpdateBatch(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                for f in fields(self)
            }
        )


@dataclass
class UpdateResult:
    """What the update phase reports (identical on every rank).

    Attributes:
        metrics: ``train/*``: loss and grad_norm (means over the mini-batches), the loss's token means
            (clip_fraction, ratio_mean, entropy, kl, ...; over all the step's response tokens), ratio_max /
            ratio_min, optimizer_steps (mini-batches applied) and skipped_nonfinite (1.0 when any was not).
        updated: at least one mini-batch changed the weights.
        skipped: None when every mini-batch was applied; else the first skip's reason (``StepResult.skipped``).
        skip_detail: where the first skip came from, with its mini-batch.
    """

    metrics: dict[str, float]
    updated: bool
    skipped: str | None = None
    skip_detail: str = ""


def mini_batch_order(num_rows: int, group_size: int, mini_batches: int) -> torch.Tensor:
    """Row order of a replica's share (whole GRPO groups of ``group_size`` consecutive rows, in prompt order)
    whose ``m``-th contiguous ``1/mini_batches`` is its part of the step's mini-batch ``m``.

    Mini-batch ``m`` of the step is the groups ``g`` with ``g % mini_batches == m``. A replica holds a
    contiguous block of the step's groups (:meth:`~sparrow_nemo.grpo.process_model.RankPlan.replica_prompts`)
    whose start is a multiple of ``mini_batches`` when its group count is, so its local group ``q`` falls in
    mini-batch ``q % mini_batches`` for every DP size: the mini-batches do not depend on the layout.
    Returns [num_rows] int64; raises when the replica's groups do not split evenly.
    """
    groups, rest = divmod(num_rows, group_size)
    if rest or groups % mini_batches:
        raise ValueError(
            f"{num_rows} sequences on this data-parallel rank ({group_size} per prompt) do not split into "
            f"grpo.mini_batches_per_step={mini_batches} mini-batches of whole prompts (grpo.prompts_per_step "
            "must be a multiple of the data-parallel size x grpo.mini_batches_per_step)"
        )
    by_group = torch.arange(num_rows).view(groups // mini_batches, mini_batches, group_size)
    return by_group.transpose(0, 1).reshape(-1)


def step_normalizers(batch: UpdateBatch, mini_batches: int) -> list[LossNormalizer]:
    """The loss denominators of each mini-batch, counted over every DP rank (one all-reduce over DP)."""
    counts = batch.response_mask.sum(dim=1).view(mini_batches, -1)
    local = torch.stack([counts.sum(dim=1), (counts > 0).sum(dim=1)], dim=1).to(torch.float64)
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() > 1:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        local = local.to(device)
        dist.all_reduce(local, group=ps.get_data_parallel_group())
        local = local.cpu()
    return [LossNormalizer(tokens=float(t), sequences=float(s)) for t, s in local.tolist()]


def update_policy(
    policy,
    batch: UpdateBatch,
    loss: PolicyLossConfig,
    micro_batch_size: int,
    mini_batches: int = 1,
    max_tokens_per_micro_batch: int | None = None,
) -> UpdateResult:
    """Run the step's optimizer updates on this DP rank's share ``batch``; collective over all ranks.

    Args:
        policy: the :class:`~sparrow_nemo.policy.policy.MegatronPolicy`.
        batch: this DP rank's share of the step (the same number of rows on every DP rank).
        loss: the policy loss (``grpo.loss``).
        micro_batch_size: rows per forward/backward (``policy.micro_batch_size``).
        mini_batches: optimizer steps per RL step (``grpo.mini_batches_per_step``).
        max_tokens_per_micro_batch: a token budget per micro-batch instead of ``micro_batch_size`` rows
            (``policy.max_tokens_per_micro_batch``; length-sorted rows, :mod:`sparrow_nemo.policy.packing`).
            The number of micro-batches may then differ between DP ranks; the loss does not.
    """
    n = len(batch)
    whole = max_tokens_per_micro_batch is not None or (n // max(mini_batches, 1)) % micro_batch_size == 0
    if mini_batches < 1 or n % mini_batches or not whole:
        raise ValueError(
            f"{n} sequences on this data-parallel rank do not split into grpo.mini_batches_per_step="
            f"{mini_batches} mini-batches of whole micro-batches (policy.micro_batch_size={micro_batch_size})"
        )
    if loss.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("grpo.loss.kl_coef > 0 needs UpdateBatch.ref_logprobs; got None")
    normalizers = step_normalizers(batch, mini_batches)
    mismatch = mismatch_metrics(
        batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, loss, _data_parallel_group()
    )
    per = n // mini_batches
    results = []
    for m, normalizer in enumerate(normalizers):
        if normalizer.tokens == 0:
            raise ValueError(f"mini-batch {m} of the step has no response token on any data-parallel rank")
        piece = batch.rows(slice(m * per, (m + 1) * per))
        extras = {
            "mask": piece.response_mask,
            "old_logprobs": piece.old_logprobs,
            "rollout_logprobs": piece.rollout_logprobs,
            "advantages": piece.advantages.float(),
        }
        if loss.kl_coef > 0:
            extras["ref_logprobs"] = piece.ref_logprobs
        batches = micro_batches(
            piece.tokens, piece.lengths, extras, micro_batch_size, max_tokens_per_micro_batch
        )
        results.append(policy.train_step(batches, grpo_loss_fn(loss, normalizer), reduction="sum"))
    result = _combine(results, [nz.tokens for nz in normalizers])
    result.metrics.update(mismatch)
    return result


def _data_parallel_group():
    """Megatron's data-parallel group when it spans several ranks, else None."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None


def _combine(results: list[StepResult], tokens: list[float]) -> UpdateResult:
    """One :class:`UpdateResult` from the mini-batches' step results (token-weighted token means)."""
    total = sum(tokens)
    metrics: dict[str, float] = {}
    for key in results[0].metrics:
        values = [r.metrics[key] for r in results]
        if key in _EXTREMA:
            metrics[key] = _EXTREMA[key](values)
        elif key == "loss":
            continue
        else:
            metrics[key] = sum(v * t for v, t in zip(values, tokens, strict=True)) / total
    out = {f"train/{k}": v for k, v in metrics.items()}
    out["train/loss"] = math.fsum(r.loss for r in results) / len(results)
    out["train/grad_norm"] = math.fsum(r.grad_norm for r in results) / len(results)
    applied = [r.skipped is None for r in results]
    out["train/optimizer_steps"] = float(sum(applied))
    out["train/skipped_nonfinite"] = float(not all(applied))
    first = next((m for m, r in enumerate(results) if r.skipped is not None), None)
    if first is None:
        return UpdateResult(out, updated=True)
    detail = results[first].skip_detail
    if len(results) > 1:
        detail = f"mini-batch {first} of {len(results)}: {detail}"
    return UpdateResult(out, updated=any(applied), skipped=results[first].skipped, skip_detail=detail)
