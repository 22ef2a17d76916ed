"""The unbiased pass@k estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code").

With n samples of a problem of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k): the probability
that at least one of k samples drawn without replacement from the n is correct. Computed as the
product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which stays exact-ish in floating point for large n.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (1 <= k <= n, 0 <= c <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: correct count c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}] (n samples per prompt)")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def default_ks(n: int) -> list[int]:
    """The k values reported for n samples: powers of two below n, and n itself."""
    if n < 1:
        raise ValueError(f"samples per prompt must be >= 1, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]
