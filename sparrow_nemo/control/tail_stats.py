"""Per-bin tail of the acceptance rate with a distribution-free confidence interval.

Noise margin (our choice of formula). Let ``q`` be the tail quantile (0.05) and ``n`` the tokens in a bin.
The fraction of tokens below the true q-quantile is a binomial proportion with standard error
``se(n) = sqrt(q (1 - q) / n)``. The empirical quantiles at the levels ``q -+ z * se(n)`` are then a
(two-sided, normal-approximation) confidence interval for the true q-quantile, in alpha units::

    lcb = quantile(alpha_bin, max(q - z * se(n), 0))
    ucb = quantile(alpha_bin, min(q + z * se(n), 1))

so the noise margin of the bin's p5 is ``margin(n) = ucb - p5`` (above) and ``p5 - lcb`` (below). A bin is
*below* the threshold only when ``ucb < threshold`` (``p5 < threshold - margin(n)``), and *well above* when
``lcb > threshold + lower_margin``. Bins with fewer than ``min_tokens`` tokens get no decision. No
assumption about the shape of the alpha distribution is needed (it is skewed: mostly ~1 with a long low tail).

Tokens of one sequence are not independent: they share a prompt and a sampled path, so a hard problem puts
many of a bin's low-alpha tokens in a few sequences, and the binomial ``se(n)`` (n tokens) is then too narrow.
Given each token's sequence (``sequence``), the bound uses the cluster-robust standard error of the fraction
of the bin's tokens at or below its quantile value ``v`` (Woodruff's interval with the ratio estimator's
variance over the K sequences in the bin; c_i of sequence i's m_i tokens in the bin are at or below v,
F = sum c_i / n)::

    se_seq = sqrt(K / (K - 1) * sum_i (c_i - F m_i)^2) / n          (infinite for K = 1)

and never less than the binomial one: ``se = max(se(n), se_seq)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from sparrow_nemo.sparse.mismatch import binned_quantiles


@dataclass(frozen=True)
class BinTail:
    """The acceptance-rate tail of one bin of cached length.

    Attributes:
        bin: bin index = cached_len // bin_tokens.
        tokens: tokens of the step that fall in the bin.
        value: the empirical ``quantile`` of alpha in the bin (e.g. p5).
        lcb: lower confidence bound of the quantile (empirical quantile at level q - z * se).
        ucb: upper confidence bound (level q + z * se).
    """

    bin: int
    tokens: int
    value: float
    lcb: float
    ucb: float

    def to_dict(self) -> dict[str, float | int]:
        """Plain JSON-serialisable form."""
        return asdict(self)


def confidence_levels(tokens: int, quantile: float, z: float, se_floor: float = 0.0) -> tuple[float, float]:
    """Quantile levels ``(q - z*se, q + z*se)`` clipped to [0, 1], ``se = max(sqrt(q (1 - q) / tokens),
    se_floor)`` (``se_floor``: e.g. :func:`sequence_se`'s)."""
    if tokens <= 0:
        raise ValueError(f"confidence_levels: tokens must be positive, got {tokens}")
    se = max(math.sqrt(quantile * (1.0 - quantile) / tokens), se_floor)
    return max(quantile - z * se, 0.0), min(quantile + z * se, 1.0)


def sequence_se(
    alpha: torch.Tensor,
    bins: torch.Tensor,
    sequence: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    group=None,
) -> torch.Tensor:
    """The cluster-robust standard error (module docstring) of each bin's fraction of tokens at or below its
    value, the tokens of a sequence counted together. Collective: one all-reduce of [5, B] float64 sums.

    Args:
        alpha: [N] floating; bins: [N] int64 bin of each token, in [0, B); sequence: [N] int64 >= 0, the
            token's sequence (numbered within this rank: a sequence never spans ranks).
        values: [B] the bin's quantile value v; counts: [B] int64 tokens per bin over the group.

    Returns:
        [B] float64: ``sqrt(K / (K - 1) * sum_i (c_i - F m_i)^2) / n``; inf where a bin holds one sequence,
        0 where it holds none.
    """
    num_bins = counts.numel()
    sums = torch.zeros(5, num_bins, dtype=torch.float64)  # sum c, c^2, c m, m^2, sequences
    if alpha.numel():
        bins, sequence = bins.to(torch.int64), sequence.to(torch.int64)
        below = (alpha.double() <= values.to(torch.float64)[bins]).double()
        stride = int(sequence.max()) + 1
        pair, where = torch.unique(bins * stride + sequence, return_inverse=True)  # (bin, sequence) pairs
        m = torch.zeros(pair.numel(), dtype=torch.float64).index_add_(0, where, torch.ones_like(below))
        c = torch.zeros(pair.numel(), dtype=torch.float64).index_add_(0, where, below)
        pair_bin = torch.div(pair, stride, rounding_mode="floor")
        for row, x in enumerate((c, c * c, c * m, m * m, torch.ones_like(m))):
            sums[row].index_add_(0, pair_bin, x)
    sums = _all_reduce(sums, _sum_op(), group)
    n = counts.to(torch.float64)
    frac = sums[0] / n.clamp(min=1)
    spread = (sums[1] - 2 * frac * sums[2] + frac * frac * sums[3]).clamp(min=0)
    k = sums[4]
    se = torch.sqrt(k / (k - 1).clamp(min=1) * spread) / n.clamp(min=1)
    return torch.where(k == 1, torch.full_like(se, math.inf), torch.where(k == 0, torch.zeros_like(se), se))


def bin_tails(
    alpha: torch.Tensor,
    cached_len: torch.Tensor,
    bin_tokens: int,
    quantile: float = 0.05,
    z: float = 2.0,
    sequence: torch.Tensor | None = None,
) -> list[BinTail]:
    """Tail statistic and its confidence bounds for every bin that holds tokens, ascending by bin.

    Args:
        alpha: [N] floating per-token acceptance rates in [0, 1].
        cached_len: [N] integer cached length (tokens) of each token; bin = cached_len // bin_tokens.
        bin_tokens: bin width in tokens of cached length.
        quantile: tail level in (0, 1), e.g. 0.05 for the paper's p5.
        z: standard errors of the confidence interval (2.0 ~ 95% two-sided).
        sequence: [N] int64 >= 0, the sequence of each token (the bounds then widen where a bin's low tokens
            sit in few sequences, :func:`sequence_se`); None = tokens independent (the binomial bound).

    Quantiles are :func:`sparrow_nemo.sparse.mismatch.binned_quantiles` (the same definition as
    ``tail_by_bin``), so ``value`` equals ``tail_by_bin(alpha, cached_len, bin_tokens, quantile)[bin]``.
    """
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"bin_tails: quantile must be in (0, 1), got {quantile}")
    if bin_tokens <= 0:
        raise ValueError(f"bin_tails: bin_tokens must be positive, got {bin_tokens}")
    if alpha.ndim != 1 or cached_len.shape != alpha.shape or cached_len.is_floating_point():
        raise ValueError(
            f"bin_tails: alpha [N] and integer cached_len [N] expected, got {tuple(alpha.shape)} {alpha.dtype} "
            f"and {tuple(cached_len.shape)} {cached_len.dtype}"
        )
    _check_sequence(sequence, alpha, "bin_tails")
    bins = torch.div(cached_len, bin_tokens, rounding_mode="floor")
    bin_ids, counts, table = binned_quantiles(alpha, bins, (quantile,))
    floors = [0.0] * len(bin_ids)
    if sequence is not None and len(bin_ids):
        num_bins = int(bin_ids.max()) + 1
        values = torch.zeros(num_bins, dtype=torch.float64).index_copy_(0, bin_ids, table[0])
        all_counts = torch.zeros(num_bins, dtype=torch.int64).index_copy_(0, bin_ids, counts)
        floors = sequence_se(alpha, bins, sequence, values, all_counts)[bin_ids].tolist()
    tails = []
    for b, tokens, floor in zip(bin_ids.tolist(), counts.tolist(), floors):
        in_bin = alpha[bins == b]
        low, high = confidence_levels(tokens, quantile, z, floor)
        _, _, table = binned_quantiles(
            in_bin, torch.zeros_like(in_bin, dtype=torch.int64), (quantile, low, high)
        )
        value, lcb, ucb = table[:, 0].tolist()
        tails.append(BinTail(bin=b, tokens=tokens, value=value, lcb=lcb, ucb=ucb))
    return tails


def _check_sequence(sequence: torch.Tensor | None, alpha: torch.Tensor, name: str) -> None:
    if sequence is not None and (
        sequence.shape != alpha.shape
        or sequence.is_floating_point()
        or (sequence.numel() and int(sequence.min()) < 0)
    ):
        raise ValueError(
            f"{name}: sequence must be a non-negative integer tensor shaped like alpha {tuple(alpha.shape)}, got "
            f"{tuple(sequence.shape)} {sequence.dtype}"
        )


# ----------------------------------------------------------------------------------------- several ranks
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)
_DIGIT_BITS = 8
_ROUNDS = 64 // _DIGIT_BITS


def _sortable(values: torch.Tensor) -> torch.Tensor:
    """float64 -> int64 bit patterns whose unsigned order is the float order (no NaN)."""
    bits = values.to(torch.float64).contiguous().view(torch.int64)
    return (bits ^ ((bits >> 63) & _INT64_MAX)) ^ _INT64_MIN


def _unsortable(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_sortable`."""
    signed = keys ^ _INT64_MIN
    return (signed ^ ((signed >> 63) & _INT64_MAX)).view(torch.float64)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else t.device
    )
    moved = t.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(t.device)


def order_statistics(
    values: torch.Tensor, bins: torch.Tensor, ranks: torch.Tensor, group=None
) -> torch.Tensor:
    """Exact order statistics per bin of the values of all ranks of ``group``, without moving the values.

    Distributed radix select: the values' float64 bit patterns (order-preserving as integers) are decided
    8 bits at a time, most significant first; each round every rank counts its values per (target, bin,
    next byte) among those that match the target's bytes decided so far, and one all-reduce of a
    [T, B, 256] count tensor picks the next byte. 8 rounds, 8 all-reduces of T * B * 256 int64 in all,
    whatever the number of tokens.

    Args:
        values: [N] floating, this rank's values (no NaN); bins: [N] int64 bin of each value, in [0, B).
        ranks: [T, B] int64, 0-based rank within bin b (in ascending order over all ranks' values) of the
            statistic wanted; entries of bins that hold no value anywhere are ignored (their result is 0).
        group: process group (None = this rank alone). Collective over it.

    Returns:
        [T, B] float64, the ``ranks[t, b]``-th smallest value of bin b over the group.
    """
    targets, num_bins = ranks.shape
    keys = _sortable(values.detach().reshape(-1).cpu())
    bin_of = bins.detach().reshape(-1).cpu().to(torch.int64)
    prefix = torch.zeros(targets, num_bins, dtype=torch.int64)
    remaining = ranks.to(torch.int64).clone()
    buckets = 1 << _DIGIT_BITS
    for r in range(_ROUNDS - 1, -1, -1):
        shift = r * _DIGIT_BITS
        high = 0 if r == _ROUNDS - 1 else -(1 << (shift + _DIGIT_BITS))  # bits already decided
        digit = (keys >> shift) & (buckets - 1)
        decided = keys & high
        hist = torch.stack(
            [
                torch.bincount(
                    (bin_of * buckets + digit)[decided == prefix[t, bin_of]], minlength=num_bins * buckets
                )
                for t in range(targets)
            ]
        ).view(targets, num_bins, buckets)
        hist = _all_reduce(hist, _sum_op(), group)
        cum = hist.cumsum(-1)
        chosen = (cum <= remaining[..., None]).sum(-1).clamp(max=buckets - 1)
        remaining = remaining - (cum - hist).gather(-1, chosen[..., None]).squeeze(-1)
        prefix = prefix | (chosen << shift)
    return _unsortable(prefix)


def _sum_op():
    import torch.distributed as dist

    return dist.ReduceOp.SUM


def bin_counts(bins: torch.Tensor, num_bins: int, group=None) -> torch.Tensor:
    """[num_bins] int64 values per bin over the group. Collective."""
    local = torch.bincount(bins.detach().reshape(-1).cpu().to(torch.int64), minlength=num_bins)
    return _all_reduce(local, _sum_op(), group)


def num_bins_of(bins: torch.Tensor, group=None) -> int:
    """1 + the largest bin index over the group (0 when no rank has a value). Collective."""
    import torch.distributed as dist

    local = torch.tensor([int(bins.max()) + 1 if bins.numel() else 0], dtype=torch.int64)
    return int(_all_reduce(local, dist.ReduceOp.MAX, group).item())


def merged_quantiles(
    values: torch.Tensor, bins: torch.Tensor, levels: torch.Tensor, counts: torch.Tensor, group=None
) -> torch.Tensor:
    """Linear-interpolation quantiles per bin of all ranks' values, exactly as :func:`binned_quantiles` of the
    union computes them bin by bin (each bin on its own: position ``level * (n - 1)``).

    Args:
        values, bins: [N] this rank's values and their bins; levels: [Q, B] float64 quantile level per bin;
        counts: [B] int64 values per bin over the group (:func:`bin_counts`). Collective over ``group``.

    Returns:
        [Q, B] float64 (0 for empty bins).
    """
    pos = torch.zeros((), dtype=torch.int64) + levels.to(torch.float64) * (counts[None, :] - 1)
    lo = pos.floor().to(torch.int64).clamp(min=0)
    hi = torch.minimum(lo + 1, (counts - 1).clamp(min=0)[None, :].expand_as(lo))
    stats = order_statistics(values, bins, torch.cat([lo, hi]), group)
    v_lo, v_hi = stats[: len(lo)], stats[len(lo) :]
    out = v_lo + (pos - lo) * (v_hi - v_lo)
    return torch.where(counts[None, :] > 0, out, torch.zeros_like(out))


def merged_bin_tails(
    alpha: torch.Tensor,
    cached_len: torch.Tensor,
    bin_tokens: int,
    quantile: float = 0.05,
    z: float = 2.0,
    group=None,
    sequence: torch.Tensor | None = None,
) -> list[BinTail]:
    """:func:`bin_tails` of the union of every rank's tokens, each rank passing only its own (``sequence``
    numbered within the rank). Collective.

    Exact: every ``value`` / ``lcb`` / ``ucb`` equals what :func:`bin_tails` gives on all the tokens gathered
    in one place (the same order statistics, the same interpolation), from one count all-reduce and the
    :func:`order_statistics` rounds; no per-token data crosses ranks.
    """
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"merged_bin_tails: quantile must be in (0, 1), got {quantile}")
    if bin_tokens <= 0:
        raise ValueError(f"merged_bin_tails: bin_tokens must be positive, got {bin_tokens}")
    if alpha.ndim != 1 or cached_len.shape != alpha.shape or cached_len.is_floating_point():
        raise ValueError(
            f"merged_bin_tails: alpha [N] and integer cached_len [N] expected, got {tuple(alpha.shape)} "
            f"{alpha.dtype} and {tuple(cached_len.shape)} {cached_len.dtype}"
        )
    _check_sequence(sequence, alpha, "merged_bin_tails")
    bins = torch.div(cached_len.cpu().to(torch.int64), bin_tokens, rounding_mode="floor")
    num_bins = num_bins_of(bins, group)
    if num_bins == 0:
        return []
    counts = bin_counts(bins, num_bins, group)
    floors = torch.zeros(num_bins, dtype=torch.float64)
    if sequence is not None:  # the values first: the bounds' width depends on them
        level = torch.full((1, num_bins), quantile, dtype=torch.float64)
        values = merged_quantiles(alpha, bins, level, counts, group)[0]
        floors = sequence_se(alpha.cpu(), bins, sequence.cpu(), values, counts, group)
    levels = torch.zeros(3, num_bins, dtype=torch.float64)
    for b, n in enumerate(counts.tolist()):
        if n:
            low, high = confidence_levels(n, quantile, z, float(floors[b]))
            levels[:, b] = torch.tensor((quantile, low, high), dtype=torch.float64)
    table = merged_quantiles(alpha, bins, levels, counts, group)
    return [
        BinTail(
            bin=b, tokens=int(n), value=float(table[0, b]), lcb=float(table[1, b]), ucb=float(table[2, b])
        )
        for b, n in enumerate(counts.tolist())
        if n
    ]
