"""Batched next-token sampling with one random stream per sample, and logprob bookkeeping.

Every sample owns a CPU ``torch.Generator`` seeded from (base seed, sample index), and each step
draws exactly one uniform number from it; the token is then picked by inverse-CDF over the sorted,
filtered distribution. A sample's tokens therefore depend only on its own prompt and seed, not on
its batch mates, the batch size or the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import sparrow_nemo.rollout.torch.cpu_attention as cpu_attention
from sparrow_nemo.rollout.engine import SamplingParams

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` for base ``seed`` (splitmix64 mix, fits a torch seed)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def batch_seeds(seed: int, count: int, sample_seeds: Sequence[int] | None = None) -> list[int]:
    """Per-sample seeds of a ``count``-prompt batch: ``sample_seeds`` when given (checked to have ``count``
    entries), else ``sample_seed(seed, i)`` for i in 0..count-1."""
    if sample_seeds is None:
        return [sample_seed(seed, i) for i in range(count)]
    if len(sample_seeds) != count:
        raise ValueError(f"sample_seeds has {len(sample_seeds)} entries for {count} prompts")
    return [int(s) for s in sample_seeds]


def make_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample."""
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One U[0, 1) draw per generator: [B] float64 on CPU."""
    if not generators:
        return torch.empty(0, dtype=torch.float64)
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def _sort_descending(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(probs, dim=-1, descending=True, stable=True)`` of fp32 ``[B, V]`` probabilities: on the
    CPU the decode kernels' radix sort (same values and order, a fraction of the time), else torch's. Sorting
    the fp32 values orders exactly as sorting their fp64 casts would (the cast is exact and monotonic)."""
    if probs.device.type == "cpu" and probs.dim() == 2 and cpu_attention.available():
        return cpu_attention.sort_rows_descending(probs)
    return torch.sort(probs, dim=-1, descending=True, stable=True)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [B, V] float32 next-token logits.
        params: temperature (0 = greedy), top_k, top_p.
        uniforms: [B] float64 in [0, 1), one per row (ignored when greedy).

    Returns:
        [B] int64 token ids. Filtering: keep the top_k most likely, then the smallest prefix of the
        descending-probability list whose mass reaches top_p; sample within the kept set.
    """
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_p, order = _sort_descending(probs)
    sorted_p = sorted_p.double()
    vocab = sorted_p.shape[-1]
    if params.top_k > 0 or params.top_p < 1.0:
        rank = torch.arange(vocab, device=logits.device)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if params.top_k > 0:
            keep &= rank < params.top_k
        if params.top_p < 1.0:
            mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            keep &= mass_before < params.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        last = keep.sum(dim=-1) - 1
    else:  # nothing filtered: every token is kept, no mask to build
        last = torch.full((sorted_p.shape[0],), vocab - 1, device=logits.device)
    cdf = torch.cumsum(sorted_p, dim=-1)
    target = uniforms.to(device=logits.device, dtype=torch.float64) * cdf[:, -1]
    pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    pick = torch.minimum(pick, last)
    return order.gather(-1, pick[:, None]).squeeze(-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the model distribution (raw logits, temperature 1).

    Args:
        logits: [..., V] float32; tokens: [...] int64 ids to score; topk: pairs to return (capped at V).

    Returns:
        (logprob of ``tokens`` [...] float32, top ids [..., k] int64, top logprobs [..., k] float32).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = torch.topk(logp, min(topk, logp.shape[-1]), dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), top_ids, top_lp
