"""Per-token mismatch between the sparse rollout policy and the dense policy, and its tail by bin.

alpha_t = sum_v min(p_t(v), q_t(v)) = 1 - TV(p_t, q_t) for the dense (p) and sparse (q) next-token
distributions at position t: 1 means identical. The paper's stability statistic is the 5th
percentile of alpha over all tokens whose cached length falls in one 2,000-token bin.

Quantiles use linear interpolation between order statistics (numpy's default "linear" method):
the q-quantile of n sorted values v is v[i] + f * (v[i+1] - v[i]) with i + f = q * (n - 1).
"""

from __future__ import annotations

import torch

__all__ = [
    "PAPER_QUANTILE",
    "acceptance_rate",
    "acceptance_rate_topk",
    "binned_quantiles",
    "summarize",
    "tail_by_bin",
    "tail_name",
]


#: The paper's tail level: the 5th percentile of the acceptance rate per bin of cached length.
PAPER_QUANTILE = 0.05


def tail_name(quantile: float) -> str:
    """The metric name of a tail level: 0.05 -> ``p5``, 0.01 -> ``p1`` (``acceptance/p5/bin_3``)."""
    return f"p{100 * quantile:g}"


def acceptance_rate(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Exact acceptance rate sum_v min(p(v), q(v)) over the last dim.

    Args:
        logp, logq: [..., V] log-probabilities (natural log; -inf allowed) of the two distributions.

    Returns:
        [...] float32 (float64 for float64 inputs), clamped to [0, 1] against rounding.
    """
    if logp.shape != logq.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and logq {tuple(logq.shape)} must have the same shape")
    dtype = torch.float64 if torch.float64 in (logp.dtype, logq.dtype) else torch.float32
    overlap = torch.exp(torch.minimum(logp.to(dtype), logq.to(dtype))).sum(dim=-1)
    return overlap.clamp(0.0, 1.0)


def _check_topk(ids: torch.Tensor, logprobs: torch.Tensor, name: str) -> None:
    if ids.shape != logprobs.shape:
        raise ValueError(
            f"{name}_ids {tuple(ids.shape)} and {name}_logprobs {tuple(logprobs.shape)} must match"
        )
    if ids.dtype.is_floating_point:
        raise ValueError(f"{name}_ids must be integer token ids, got {ids.dtype}")
    if ids.shape[-1] > 1:
        srt = torch.sort(ids, dim=-1).values
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        if bool(dup.any()):
            raise ValueError(f"{name}_ids repeats a token id within a row; top-k ids must be distinct")


def acceptance_rate_topk(
    p_ids: torch.Tensor, p_logprobs: torch.Tensor, q_ids: torch.Tensor, q_logprobs: torch.Tensor
) -> torch.Tensor:
    """Lower bound of the acceptance rate from each side's top-k tokens (the paper uses k = 20).

    Sum over the union of both top-k sets of min(p(v), q(v)), where a token missing from one side's
    list counts 0 there; so only tokens in both lists contribute. Every term is an exact min(p, q)
    or 0 <= min(p, q), hence the result is <= :func:`acceptance_rate` of the full distributions,
    and equal to it when both lists hold the whole vocabulary.

    Args:
        p_ids, p_logprobs: [..., Kp] distinct token ids (negative ids = padding) and their exact
            log-probabilities under p. q_ids, q_logprobs: [..., Kq] likewise under q.

    Returns:
        [...] float32 (float64 for float64 inputs) in [0, 1].
    """
    _check_topk(p_ids, p_logprobs, "p")
    _check_topk(q_ids, q_logprobs, "q")
    if p_ids.shape[:-1] != q_ids.shape[:-1]:
        raise ValueError(f"p_ids {tuple(p_ids.shape)} and q_ids {tuple(q_ids.shape)} differ in leading dims")
    dtype = torch.float64 if torch.float64 in (p_logprobs.dtype, q_logprobs.dtype) else torch.float32
    if p_ids.shape[-1] == 0 or q_ids.shape[-1] == 0:  # an empty list shares no token
        return torch.zeros(p_ids.shape[:-1], dtype=dtype, device=p_ids.device)
    # Match each p id in q's sorted list: O(K log K) per row and [..., K] memory, so k = the whole
    # vocabulary (an exact alpha for small vocabularies) costs no [..., Kp, Kq] intermediate.
    q_sorted, order = torch.sort(q_ids, dim=-1)
    at = torch.searchsorted(q_sorted, p_ids.contiguous()).clamp(max=q_ids.shape[-1] - 1)
    same = (q_sorted.gather(-1, at) == p_ids) & (p_ids >= 0)
    q_lp = q_logprobs.to(dtype).gather(-1, order.gather(-1, at))
    low = torch.minimum(p_logprobs.to(dtype), q_lp)
    overlap = torch.where(same, torch.exp(low), torch.zeros((), dtype=dtype, device=low.device))
    return overlap.sum(dim=-1).clamp(0.0, 1.0)


def _check_tokens(alpha: torch.Tensor, cached_len: torch.Tensor, bin_tokens: int) -> None:
    if alpha.dim() != 1 or cached_len.shape != alpha.shape:
        raise ValueError(
            f"alpha and cached_len must both be [N] (one entry per token), got {tuple(alpha.shape)} "
            f"and {tuple(cached_len.shape)}"
        )
    if cached_len.dtype.is_floating_point or cached_len.dtype == torch.bool:
        raise ValueError(f"cached_len must be an integer tensor (tokens), got {cached_len.dtype}")
    if bin_tokens <= 0:
        raise ValueError(f"bin_tokens must be > 0, got {bin_tokens}")
    if alpha.numel() and (int(cached_len.min()) < 0 or not bool(torch.isfinite(alpha).all())):
        raise ValueError("cached_len must be >= 0 and alpha finite for every token")


def binned_quantiles(
    values: torch.Tensor, bins: torch.Tensor, quantiles: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantiles of ``values`` within each group of equal ``bins`` (linear interpolation).

    Args:
        values: [N] float; bins: [N] integer group ids; quantiles: levels in [0, 1].

    Returns:
        (bin_ids [M] int64 ascending, counts [M] int64, table [len(quantiles), M] float64) over the
        M distinct bins present.
    """
    if any(not 0.0 <= q <= 1.0 for q in quantiles):
        raise ValueError(f"quantiles must lie in [0, 1], got {quantiles}")
    vals = values.detach().to(torch.float64).flatten()
    ids = bins.detach().to(torch.int64).flatten()
    by_value = torch.sort(vals, stable=True).indices
    order = by_value[torch.sort(ids[by_value], stable=True).indices]  # by bin, then by value
    vals, ids = vals[order], ids[order]
    bin_ids, counts = torch.unique_consecutive(ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    level = torch.tensor(quantiles, dtype=torch.float64, device=vals.device)[:, None]  # [Q, 1]
    pos = starts[None, :] + level * (counts[None, :] - 1)  # [Q, M]
    lo = pos.floor().to(torch.int64)
    hi = torch.minimum(lo + 1, (starts + counts - 1)[None, :].expand_as(lo))
    table = vals[lo] + (pos - lo) * (vals[hi] - vals[lo])
    return bin_ids, counts, table


def tail_by_bin(
    alpha: torch.Tensor, cached_len: torch.Tensor, bin_tokens: int = 2000, quantile: float = PAPER_QUANTILE
) -> dict[int, float]:
    """The ``quantile`` of alpha per bin of cached length, pooled over all trajectories.

    Args:
        alpha: [N] per-token acceptance rates; cached_len: [N] integer tokens in the KV cache when
            the token was generated; a token falls in bin cached_len // bin_tokens.

    Returns:
        {bin_index: quantile of alpha} for the bins that hold at least one token, ascending.
    """
    _check_tokens(alpha, cached_len, bin_tokens)
    if alpha.numel() == 0:
        return {}
    bin_ids, _, table = binned_quantiles(alpha, cached_len // bin_tokens, (quantile,))
    return {int(b): float(v) for b, v in zip(bin_ids, table[0])}


def summarize(
    alpha: torch.Tensor,
    cached_len: torch.Tensor,
    bin_tokens: int = 2000,
    train_logprobs: torch.Tensor | None = None,
    gen_logprobs: torch.Tensor | None = None,
) -> dict[str, float]:
    """Flat mismatch metrics for one batch of rollout tokens (keys usable as JSONL fields).

    Args:
        alpha: [N] per-token acceptance rates of valid (unmasked) tokens.
        cached_len: [N] integer cached length (tokens) at each of those tokens.
        bin_tokens: bin width in tokens.
        train_logprobs, gen_logprobs: optional [N] log-probabilities of the sampled tokens under the
            training (dense) policy and the generating (sparse) policy; pass both or neither.

    Returns:
        ``acceptance/{mean,p1,p5,p50}`` and ``acceptance/tokens`` over all tokens; the same per bin
        as ``acceptance/<stat>/bin_<i>``; ``acceptance/min_p5`` = the lowest per-bin p5 (the tail
        the threshold applies to). With logprobs, NeMo-RL's ``token_mult_prob_error`` = mean of
        exp(|gen - train|) and ``gen_kl_error`` = mean k3 estimate of KL(gen || train):
        exp(train - gen) - (train - gen) - 1 on tokens sampled from gen.
    """
    _check_tokens(alpha, cached_len, bin_tokens)
    metrics: dict[str, float] = {"acceptance/tokens": float(alpha.numel())}
    if (train_logprobs is None) != (gen_logprobs is None):
        raise ValueError("summarize needs both train_logprobs and gen_logprobs, or neither")
    if train_logprobs is not None and gen_logprobs is not None:
        if train_logprobs.shape != alpha.shape or gen_logprobs.shape != alpha.shape:
            raise ValueError(
                f"train_logprobs {tuple(train_logprobs.shape)} and gen_logprobs {tuple(gen_logprobs.shape)} "
                f"must be [N]={tuple(alpha.shape)} like alpha"
            )
        if alpha.numel():
            log_ratio = train_logprobs.double() - gen_logprobs.double()
            metrics["token_mult_prob_error"] = float(torch.exp(log_ratio.abs()).mean())
            metrics["gen_kl_error"] = float((torch.exp(log_ratio) - log_ratio - 1).mean())
    if alpha.numel() == 0:
        return metrics

    levels = {"p1": 0.01, "p5": 0.05, "p50": 0.5}
    alpha64 = alpha.detach().double()
    _, _, overall = binned_quantiles(alpha64, torch.zeros_like(cached_len), tuple(levels.values()))
    metrics["acceptance/mean"] = float(alpha64.mean())
    for j, key in enumerate(levels):
        metrics[f"acceptance/{key}"] = float(overall[j, 0])

    bins = cached_len.to(torch.int64) // bin_tokens
    bin_ids, counts, table = binned_quantiles(alpha64, bins, tuple(levels.values()))
    sums = torch.zeros(len(bin_ids), dtype=torch.float64, device=alpha64.device).index_add_(
        0, torch.searchsorted(bin_ids, bins), alpha64
    )
    for m, b in enumerate(bin_ids.tolist()):
        metrics[f"acceptance/mean/bin_{b}"] = float(sums[m] / counts[m])
        for j, key in enumerate(levels):
            metrics[f"acceptance/{key}/bin_{b}"] = float(table[j, m])
        metrics[f"acceptance/tokens/bin_{b}"] = float(counts[m])
    metrics["acceptance/min_p5"] = float(table[list(levels).index("p5")].min())
    return metrics
