"""``rollout_corr/*``: how far the rollout engine's (sparse) token distribution is from the trained policy's,
measured every step on the sampled tokens (verl's ``rollout_corr/`` diagnostics, the same names).

With ``rho = exp(old_logprob - rollout_logprob)`` (the dense policy before the update over the rollout engine,
per sampled response token):

- ``rollout_corr/k3_kl``: mean of ``rho - 1 - log rho``, the k3 estimate of KL(rollout || policy) from the
  rollout's own samples (>= 0 per token);
- ``rollout_corr/ratio_p01`` / ``ratio_p50`` / ``ratio_p99`` / ``ratio_max``: quantiles of rho over the step's
  tokens (exact over the data-parallel ranks, :func:`~sparrow_nemo.control.tail_stats.merged_quantiles`);
- ``rollout_corr/masked_fraction``: tokens whose ``grpo.loss.correction`` weight is 0 (mis, icepop and the
  sequence masks drop tokens; tis never does); ``rollout_corr/weight_mean``: the mean correction weight.

Collective over the data-parallel group (each replica's rows counted once): one all-reduce of sums, one of the
maximum, and the radix select of three quantiles. Sizes: this rank's tokens only.
"""

from __future__ import annotations

import torch

from sparrow_nemo.control.tail_stats import _all_reduce, bin_counts, merged_quantiles
from sparrow_nemo.grpo.losses import PolicyLossConfig, get_correction

#: the ratio quantiles reported (name suffix, level)
QUANTILES = (("p01", 0.01), ("p50", 0.5), ("p99", 0.99))


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    group=None,
) -> dict[str, float]:
    """The ``rollout_corr/*`` metrics (module docstring) of ``[n, T]`` logprobs at the ``[n, T]`` bool ``mask``.

    ``group``: the data-parallel process group (None: this process alone). Empty masks give 0 counts and NaN
    means."""
    import torch.distributed as dist

    log_ratio = (old_logprobs.double() - rollout_logprobs.double()).masked_fill(~mask, 0.0)
    maskf = mask.double()
    weight, _ = get_correction(config.correction)(log_ratio, maskf, config)
    rho = torch.exp(log_ratio[mask])
    k3 = rho - 1.0 - log_ratio[mask]
    sums = torch.tensor(
        [float(rho.numel()), float(k3.sum()), float(((weight == 0) & mask).sum()), float(weight[mask].sum())],
        dtype=torch.float64,
    )
    n, k3_sum, masked, weight_sum = _all_reduce(
        sums, dist.ReduceOp.SUM if dist.is_initialized() else None, group
    )
    top = torch.tensor([float(rho.max()) if rho.numel() else float("-inf")], dtype=torch.float64)
    ratio_max = float(_all_reduce(top, dist.ReduceOp.MAX, group)[0])
    bins = torch.zeros(rho.numel(), dtype=torch.int64)
    levels = torch.tensor([[level] for _, level in QUANTILES], dtype=torch.float64)
    quantiles = merged_quantiles(rho, bins, levels, bin_counts(bins, 1, group), group)[:, 0]
    count = float(n)
    nan = float("nan")
    out = {
        "rollout_corr/k3_kl": float(k3_sum) / count if count else nan,
        "rollout_corr/masked_fraction": float(masked) / count if count else nan,
        "rollout_corr/weight_mean": float(weight_sum) / count if count else nan,
        "rollout_corr/ratio_max": ratio_max if count else nan,
    }
    out.update(
        {
            f"rollout_corr/ratio_{name}": float(q) if count else nan
            for (name, _), q in zip(QUANTILES, quantiles)
        }
    )
    return out
