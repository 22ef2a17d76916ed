"""Small-sample statistics for between-seed rules: Student's t tail, paired equivalence (TOST), Holm, AUC.

Everything works on per-seed values (one number per run), so the variance is the between-seed variance, not a
binomial error pooled over prompts. No SciPy: the t tail comes from the regularised incomplete beta function,
evaluated by its continued fraction (Lentz's method), accurate to ~1e-10 for the degrees of freedom here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Paired", "auc", "holm", "paired", "t_sf"]


def _beta_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function I_x(a, b) (converges for x < (a + 1) / (a + b + 2))."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-12:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b), x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


@dataclass(frozen=True)
class Paired:
    """A paired comparison over seeds: per-seed differences ``arm - reference``.

    Attributes:
        n: pairs. mean, sd: of the differences (sd with n - 1). se: sd / sqrt(n).
        p_equivalent: TOST p-value that the mean difference lies inside (-margin, +margin) (max of the two
            one-sided tests); p_inferior: one-sided p-value that it is < -margin; p_worse: that it is < 0.
    """

    n: int
    mean: float
    sd: float
    se: float
    p_equivalent: float
    p_inferior: float
    p_worse: float


def paired(arm: Sequence[float], reference: Sequence[float], margin: float) -> Paired:
    """Paired t statistics of ``arm[i] - reference[i]`` (same seeds, same order); NaN p-values below 2 pairs.
    A zero spread counts as a tiny one (the p-values then follow the sign of the mean's distance)."""
    diffs = [a - r for a, r in zip(arm, reference) if math.isfinite(a) and math.isfinite(r)]
    n = len(diffs)
    if n < 2:
        mean = diffs[0] if diffs else math.nan
        return Paired(n, mean, math.nan, math.nan, math.nan, math.nan, math.nan)
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    se = max(sd / math.sqrt(n), 1e-12)
    df = n - 1
    p_low = t_sf((mean + margin) / se, df)  # H0: mean <= -margin
    p_high = t_sf((margin - mean) / se, df)  # H0: mean >= +margin
    p_equivalent, p_inferior = max(p_low, p_high), 1.0 - p_low
    return Paired(n, mean, sd, sd / math.sqrt(n), p_equivalent, p_inferior, 1.0 - t_sf(mean / se, df))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input order; NaN stays NaN."""
    order = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [math.nan] * len(p_values)
    running, m = 0.0, len(order)
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def auc(scores: Sequence[float], events: Sequence[bool]) -> float:
    """How well a LOW score predicts an event: P(score of an event run < score of a non-event run), ties
    half (the area under the ROC curve); NaN without both kinds of runs."""
    hit = [s for s, e in zip(scores, events) if e and math.isfinite(s)]
    miss = [s for s, e in zip(scores, events) if not e and math.isfinite(s)]
    if not hit or not miss:
        return math.nan
    wins = sum((h < m) + 0.5 * (h == m) for h in hit for m in miss)
    return wins / (len(hit) * len(miss))
