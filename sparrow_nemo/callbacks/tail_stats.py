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


def confidence_levels(tokens: int, quantile: float, z: float) -> tuple[float, float]:
    """Quantile levels ``(q - z*se, q + z*se)`` clipped to [0, 1], ``se = sqrt(q (1 - q) / tokens)``."""
    if tokens <= 0:
        raise ValueError(f"confidence_levels: tokens must be positive, got {tokens}")
    se = math.sqrt(quantile * (1.0 - quantile) / tokens)
    return max(quantile - z * se, 0.0), min(quantile + z * se, 1.0)


def bin_tails(
    alpha: torch.Tensor, cached_len: torch.Tensor, bin_tokens: int, quantile: float = 0.05, z: float = 2.0
) -> list[BinTail]:
    """Tail statistic and its confidence bounds for every bin that holds tokens, ascending by bin.

    Args:
        alpha: [N] floating per-token acceptance rates in [0, 1].
        cached_len: [N] integer cached length (tokens) of each token; bin = cached_len // bin_tokens.
        bin_tokens: bin width in tokens of cached length.
        quantile: tail level in (0, 1), e.g. 0.05 for the paper's p5.
        z: standard errors of the confidence interval (2.0 ~ 95% two-sided).

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
    bins = torch.div(cached_len, bin_tokens, rounding_mode="floor")
    bin_ids, counts, _ = binned_quantiles(alpha, bins, (quantile,))
    tails = []
    for b, tokens in zip(bin_ids.tolist(), counts.tolist()):
        in_bin = alpha[bins == b]
        low, high = confidence_levels(tokens, quantile, z)
        _, _, table = binned_quantiles(
            in_bin, torch.zeros_like(in_bin, dtype=torch.int64), (quantile, low, high)
        )
        value, lcb, ucb = table[:, 0].tolist()
        tails.append(BinTail(bin=b, tokens=tokens, value=value, lcb=lcb, ucb=ucb))
    return tails
