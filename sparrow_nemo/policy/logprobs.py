"""Per-token log-probabilities, top-k and entropy from vocab-parallel logits (no full-vocab gather).

Each tensor-parallel rank holds logits for a contiguous vocab slice ``[rank*Vl, (rank+1)*Vl)``.
With ``m`` the (detached) global max over the vocab, ``S_r = sum_{v in r} exp(z_v - m)`` and
``A_r = sum_{v in r} exp(z_v - m) * z_v``:

- normaliser ``L = m + log(sum_r S_r)`` (all-reduce max, then all-reduce sum);
- target log-prob ``z_target - L`` where ``z_target`` comes from the owning shard (all-reduce sum);
- entropy ``H = L - (sum_r A_r) / (sum_r S_r)``;
- top-k: local top-k of each shard, all-gather of ``k * tp`` candidates, final top-k.

The all-reduces use megatron's ``reduce_from_tensor_model_parallel_region`` (forward all-reduce,
backward identity): every reduced term depends only on its own rank's logits, so each rank's
backward yields the exact gradient for its shard. Padded vocab rows (ids >= ``vocab_size``) get
probability 0. All math in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

TOP_K = 20


@dataclass
class LogprobOutput:
    """Per-position outputs for tokens ``[B, S]``.

    Attributes:
        logprobs: [B, S] float32, log p(target) (differentiable).
        entropy: [B, S] float32, entropy of the full next-token distribution, nats (differentiable).
        topk_ids: [B, S, k] int64, global token ids of the k most likely tokens, descending.
        topk_logprobs: [B, S, k] float32, their log-probabilities (detached).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    def detach(self) -> LogprobOutput:
        """A copy with every tensor detached, on CPU."""
        return LogprobOutput(
            *(t.detach().cpu() for t in (self.logprobs, self.entropy, self.topk_ids, self.topk_logprobs))
        )


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
    """Log-probs of ``targets``, top-k and entropy from this rank's vocab shard of the logits.

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
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    local_v = logits.shape[-1]
    start = rank * local_v
    if vocab_size > tp * local_v:
        raise ValueError(f"vocab_size={vocab_size} exceeds the {tp}x{local_v} logits columns")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(
            f"targets must lie in [0, {vocab_size}); got [{int(targets.min())}, {int(targets.max())}]"
        )
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
        k_local = min(top_k, local_v)
        vals, ids = z.topk(k_local, dim=-1)
        ids = ids + start
        if tp > 1:
            all_vals = [torch.empty_like(vals) for _ in range(tp)]
            all_ids = [torch.empty_like(ids) for _ in range(tp)]
            dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
            dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
            vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
        k = min(top_k, vocab_size)
        vals, order = vals.topk(k, dim=-1)
        ids = torch.gather(ids, -1, order)
        top_lp = vals - log_norm.detach().unsqueeze(-1)

    return LogprobOutput(
        logprobs=z_target - log_norm,
        entropy=log_norm - sum_ez / sum_exp,
        topk_ids=ids.long(),
        topk_logprobs=top_lp,
    )
