"""Per-token log-probabilities, top-k and entropy from vocab-parallel logits (no full-vocab gather).

Each tensor-parallel rank holds logits for a contiguous vocab slice ``[rank*Vl, (rank+1)*Vl)``.
With ``m`` the global max over the vocab, ``S_r = sum_{v in r} exp(z_v - m)`` and
``A_r = sum_{v in r} exp(z_v - m) * (z_v - m)``:

- normaliser ``L = m + log(sum_r S_r)`` (all-reduce max, then all-reduce sum);
- target log-prob ``z_target - L`` where ``z_target`` comes from the owning shard (all-reduce sum);
- entropy ``H = log(sum_r S_r) - (sum_r A_r) / (sum_r S_r)``;
- top-k: local top-k of each shard, all-gather of ``k * tp`` candidates, final top-k.

Padded vocab rows (ids >= ``vocab_size``) get probability 0. All math in float32.

Two implementations of the same formulas:

- :func:`chunked_head_logprobs`, the training path: the output layer and the formulas fused in one
  autograd function over chunks of ``chunk`` positions. Only one chunk's ``[chunk, Vl]`` float32 logits
  exist at a time (plus a quarter of that for ``exp``); the backward recomputes each chunk's logits
  from the saved hidden states and forms ``dL/dz = g_lp * (onehot - p) - g_H * p * (log p + H)``
  directly, so no ``[S, V]`` tensor is ever held. Its collectives run in the forward only (the
  backward needs just the saved global ``L`` and ``H``).
- :func:`vocab_parallel_logprobs`, for logits that already exist (the unchunked reference the tests
  compare against): autograd through the formulas, every reduced term from its own rank's logits,
  reduced with megatron's ``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward
  identity).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model

if TYPE_CHECKING:
    from sparrow_nemo.policy.batch import Placement, PolicyBatch

TOP_K = 20
#: the vocab shard is exponentiated in this many column blocks: the transient next to a chunk's
#: logits is 1 / VOCAB_BLOCKS of them
VOCAB_BLOCKS = 4


@dataclass
class LogprobOutput:
    """Per-position outputs for tokens ``[B, S]``.

    Attributes:
        logprobs: [B, S] float32, log p(target) (differentiable).
        entropy: [B, S] float32, entropy of the full next-token distribution, nats (differentiable).
        topk_ids: [B, S, k] int64, global token ids of the k most likely tokens, descending.
        topk_logprobs: [B, S, k] float32, their log-probabilities (detached).
        placement: the micro-batch's rows in the step (see :mod:`sparrow_nemo.policy.packing`), or None.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    placement: Placement | None = None

    def detach(self) -> LogprobOutput:
        """A copy with every tensor detached, on CPU."""
        return LogprobOutput(
            *(t.detach().cpu() for t in (self.logprobs, self.entropy, self.topk_ids, self.topk_logprobs)),
            placement=self.placement,
        )


def _tp(tp_group) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group (``None`` = one rank)."""
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _check_targets(targets: torch.Tensor, vocab_size: int, columns: int, tp: int) -> None:
    if vocab_size > tp * columns:
        raise ValueError(f"vocab_size={vocab_size} exceeds the {tp}x{columns} logits columns")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(
            f"targets must lie in [0, {vocab_size}); got [{int(targets.min())}, {int(targets.max())}]"
        )


def _merge_topk(
    vals: torch.Tensor, ids: torch.Tensor, k: int, tp: int, tp_group
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k from each rank's local candidates ``vals``/``ids`` [..., k_local] (all-gather)."""
    if tp > 1:
        all_vals = [torch.empty_like(vals) for _ in range(tp)]
        all_ids = [torch.empty_like(ids) for _ in range(tp)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
    vals, order = vals.topk(k, dim=-1)
    return vals, torch.gather(ids, -1, order)


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over the TP group: forward all-reduce, backward identity (megatron's mapping)."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    top_k: int = TOP_K,
    tp_group=None,
) -> LogprobOutput:
    """Log-probs of ``targets``, top-k and entropy from this rank's vocab shard of existing logits.

    Memory: several float32 copies of ``logits`` (the training path is :func:`chunked_head_logprobs`).

    Args:
        logits: [B, S, Vl] this rank's shard (any float dtype), rank r covers ids ``[r*Vl, (r+1)*Vl)``.
        targets: [B, S] int64 global token ids (must be < vocab_size).
        vocab_size: real vocab size; ids at or above it (padding rows) are excluded.
        top_k: candidates to return per position.
        tp_group: the tensor-parallel group (``None`` = a single rank holding the whole vocab).
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, S, V] and targets [B, S]; got {tuple(logits.shape)}, {tuple(targets.shape)}"
        )
    tp, rank = _tp(tp_group)
    local_v = logits.shape[-1]
    start = rank * local_v
    _check_targets(targets, vocab_size, local_v, tp)
    z = logits.float()
    n_valid = min(max(vocab_size - start, 0), local_v)
    if n_valid < local_v:
        z = torch.cat([z[..., :n_valid], torch.full_like(z[..., n_valid:], float("-inf"))], dim=-1)

    with torch.no_grad():
        m = z.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp(z - m.unsqueeze(-1))
    sum_exp = _reduce(e.sum(-1), tp_group)
    z_finite = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    sum_ez = _reduce((e * z_finite).sum(-1), tp_group)
    log_norm = m + torch.log(sum_exp)

    local_t = targets - start
    owned = (local_t >= 0) & (local_t < local_v)
    picked = torch.gather(z, -1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
    z_target = _reduce(torch.where(owned, picked, torch.zeros_like(picked)), tp_group)

    with torch.no_grad():
        vals, ids = z.topk(min(top_k, local_v), dim=-1)
        vals, ids = _merge_topk(vals, ids + start, min(top_k, vocab_size), tp, tp_group)
        top_lp = vals - log_norm.detach().unsqueeze(-1)

    return LogprobOutput(
        logprobs=z_target - log_norm,
        entropy=log_norm - sum_ez / sum_exp,
        topk_ids=ids.long(),
        topk_logprobs=top_lp,
    )


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, nv] float32 logits of one chunk (the output layer's matmul in the model dtype, then fp32)."""
    z = torch.nn.functional.linear(hidden, weight)
    return z if z.dtype == torch.float32 else z.float()


def _blocks(columns: int) -> list[slice]:
    step = max(1, -(-columns // VOCAB_BLOCKS))
    return [slice(lo, min(lo + step, columns)) for lo in range(0, columns, step)]


class _ChunkedHead(torch.autograd.Function):
    """Output layer + vocab-parallel logprob / entropy / top-k over chunks of positions (module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size, chunk, top_k, tp_group):
        tp, rank = _tp(tp_group)
        local_v = weight.shape[0]
        start = rank * local_v
        n_valid = min(max(vocab_size - start, 0), local_v)
        w = weight[:n_valid]
        count = hidden.shape[0]
        k_local, k = min(top_k, local_v), min(top_k, vocab_size)
        log_norm = hidden.new_empty(count, dtype=torch.float32)
        entropy = torch.empty_like(log_norm)
        logprobs = torch.empty_like(log_norm)
        top_vals = hidden.new_empty((count, k), dtype=torch.float32)
        top_ids = torch.empty((count, k), dtype=torch.int64, device=hidden.device)
        for lo in range(0, count, chunk):
            hi = min(lo + chunk, count)
            z = _chunk_logits(hidden[lo:hi], w)  # [c, n_valid]
            c = hi - lo
            if n_valid:
                m = z.max(dim=-1).values
                vals, ids = z.topk(min(k_local, n_valid), dim=-1)
            else:
                m = z.new_full((c,), float("-inf"))
                vals, ids = z.new_empty((c, 0)), torch.empty((c, 0), dtype=torch.int64, device=z.device)
            if vals.shape[1] < k_local:  # a shard with fewer real ids than k: pad with impossible ones
                pad = k_local - vals.shape[1]
                vals = torch.cat([vals, vals.new_full((c, pad), float("-inf"))], dim=1)
                ids = torch.cat([ids, ids.new_zeros((c, pad))], dim=1)
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            local_t = targets[lo:hi] - start
            owned = (local_t >= 0) & (local_t < n_valid)
            stats = torch.zeros((3, c), dtype=torch.float32, device=z.device)
            if n_valid:
                picked = z.gather(1, local_t.clamp(0, n_valid - 1)[:, None]).squeeze(1)
                stats[2] = torch.where(owned, picked, torch.zeros_like(picked))
                z.sub_(m[:, None])
                for cols in _blocks(n_valid):
                    e = z[:, cols].exp()
                    stats[0] += e.sum(dim=-1)
                    stats[1] += e.mul_(z[:, cols]).sum(dim=-1)
                    del e
            del z
            if tp > 1:
                dist.all_reduce(stats, group=tp_group)
            log_sum = torch.log(stats[0])
            log_norm[lo:hi] = m + log_sum
            entropy[lo:hi] = log_sum - stats[1] / stats[0]
            logprobs[lo:hi] = stats[2] - log_norm[lo:hi]
            vals, ids = _merge_topk(vals, ids + start, k, tp, tp_group)
            top_vals[lo:hi] = vals - log_norm[lo:hi, None]
            top_ids[lo:hi] = ids
        ctx.save_for_backward(hidden, weight, targets, log_norm, entropy)
        ctx.meta = (start, n_valid, chunk)
        ctx.mark_non_differentiable(top_vals, top_ids)
        return logprobs, entropy, top_vals, top_ids

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, _g_vals, _g_ids):
        hidden, weight, targets, log_norm, entropy = ctx.saved_tensors
        start, n_valid, chunk = ctx.meta
        w = weight[:n_valid]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if not n_valid or (g_logprobs is None and g_entropy is None):
            return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), *([None] * 5)
        if g_logprobs is None:
            g_logprobs = torch.zeros_like(log_norm)
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            h = hidden[lo:hi]
            glp = g_logprobs[lo:hi, None].float()
            z = _chunk_logits(h, w).sub_(log_norm[lo:hi, None])  # log p, [c, n_valid]
            for cols in _blocks(n_valid):
                logp = z[:, cols]
                p = logp.exp()
                if g_entropy is None:  # dL/dz = -p * g_lp (+ g_lp at the target)
                    logp.copy_(p).mul_(-glp)
                else:  # dL/dz = -p * (g_lp + g_H * (log p + H))
                    gh = g_entropy[lo:hi, None].float()
                    logp.add_(entropy[lo:hi, None]).mul_(gh).add_(glp).mul_(p).neg_()
                del p, logp  # the view would keep the chunk alive into the next one
            local_t = targets[lo:hi] - start
            owned = (local_t >= 0) & (local_t < n_valid)
            rows = owned.nonzero().squeeze(1)
            z[rows, local_t[rows]] += glp[rows, 0]
            gz = z if z.dtype == weight.dtype else z.to(weight.dtype)
            del z
            if grad_hidden is not None:
                grad_hidden[lo:hi] = gz @ w
            if grad_weight is not None:
                if gz.dtype == torch.float32:
                    grad_weight[:n_valid].addmm_(gz.t(), h)
                else:  # the chunk's product in the model dtype (as the output layer's backward), summed in fp32
                    grad_weight[:n_valid].add_(gz.t() @ h)
            del gz
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), *([None] * 5)


def chunked_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk: int,
    top_k: int = TOP_K,
    tp_group=None,
) -> LogprobOutput:
    """Log-probs, entropy and top-k of ``targets`` under ``hidden @ weight.T``, ``chunk`` positions at a time.

    Equal to ``vocab_parallel_logprobs(hidden @ weight.T, ...)`` in values and gradients (to rounding),
    with peak extra memory ``(1 + 1/VOCAB_BLOCKS) x chunk x Vl x 4`` bytes instead of several ``T x Vl``.

    Args:
        hidden: [T, H] final hidden states (one row per scored position; identical on every TP rank).
        weight: [Vl, H] this rank's output-layer shard (rows ``[r*Vl, (r+1)*Vl)`` of the padded vocab).
        targets: [T] int64 global token ids (< vocab_size).
        vocab_size: real vocab size (ids at or above it are padding rows and get probability 0).
        chunk: positions per chunk.
        tp_group: the tensor-parallel group (``None`` = one rank holding the whole vocab).

    Returns:
        :class:`LogprobOutput` of [T] / [T, k] tensors; logprobs and entropy differentiable in hidden
        and weight.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and weight [Vl, H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T]={hidden.shape[0]}, got {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 position, got {chunk}")
    tp, _ = _tp(tp_group)
    _check_targets(targets, vocab_size, weight.shape[0], tp)
    lp, ent, vals, ids = _ChunkedHead.apply(hidden, weight, targets, vocab_size, chunk, top_k, tp_group)
    return LogprobOutput(logprobs=lp, entropy=ent, topk_ids=ids, topk_logprobs=vals)


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The output layer's weight shard [Vl, H] of the last stage (the tied embedding when shared)."""
    inner = unwrap_model(model)
    if inner.share_embeddings_and_output_weights:
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


def policy_outputs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    batch: PolicyBatch,
    spec: PolicyModelSpec,
    top_k: int = TOP_K,
) -> LogprobOutput:
    """The last stage's outputs for ``batch`` from the decoder's final hidden states.

    Position j scores token ``tokens[:, j+1]``; only positions that predict a real token are computed
    (the others are 0 in every field).

    Args:
        model: this rank's model (its output layer weight is used).
        hidden: [S', B, H] the model's output (megatron layout; [S'/tp, B, H] under sequence parallelism;
            S' >= S when the inputs were padded for sequence parallelism).

    Returns:
        :class:`LogprobOutput` of [B, S-1] / [B, S-1, k] tensors with ``batch.placement``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    tp_group = parallel_state.get_tensor_model_parallel_group() if spec.layout.tp > 1 else None
    if spec.memory.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    elif tp_group is not None:
        hidden = copy_to_tensor_model_parallel_region(hidden)  # backward: all-reduce of the input grad
    b, s = batch.tokens.shape
    mask = batch.target_mask().to(hidden.device)  # [B, S-1]
    scored = hidden[: s - 1].transpose(0, 1)[mask]  # [T, H], row-major over (B, S-1)
    targets = batch.tokens[:, 1:].to(hidden.device)[mask]
    out = chunked_head_logprobs(
        scored,
        output_weight(model),
        targets,
        spec.shape.vocab_size,
        spec.memory.logprob_chunk_tokens,
        top_k,
        tp_group,
    )
    k = out.topk_ids.shape[-1]

    def grid(values: torch.Tensor, *tail: int) -> torch.Tensor:
        full = values.new_zeros((b, s - 1, *tail))
        return full.index_put((mask,), values)

    return replace(
        out,
        logprobs=grid(out.logprobs),
        entropy=grid(out.entropy),
        topk_ids=grid(out.topk_ids, k),
        topk_logprobs=grid(out.topk_logprobs, k),
        placement=batch.placement,
    )
