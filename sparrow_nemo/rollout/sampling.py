"""Next-token sampling with position-indexed random draws, and logprob bookkeeping.

Every random number a sample uses is a pure function of (its seed, the response position it is for, a stream):
:func:`position_uniforms` hashes the three (splitmix64) into a uniform in [0, 1). No generator carries state
from one step to the next, so a sample's tokens depend only on its prompt, its seed and the model: not on which
rows share a decode step, on the batch size, on admission order, on preemption and recompute, or on the device.
Streams: :data:`TOKEN` draws the token emitted at a position (plain decoding, and the token a speculative round
emits after its accepted drafts), :data:`DRAFT` a speculative draft token, :data:`ACCEPT` its acceptance test,
:data:`INJECT` whether mismatch is injected there (``rollout.inject_mismatch``, :func:`injection_mix`).

The draw (:func:`sample_from`) is an inverse CDF over the kept probabilities in vocabulary order, in two levels
(fp64 sums of 1,024-token blocks, then a cumulative sum inside the chosen block): no sort of the vocabulary and
no [B, V] fp64 tensor. Only top-p needs the probabilities ranked (a sort), and top-k alone a ``topk``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sparrow_nemo.rollout.engine import MismatchInjection, SamplingParams

_MASK64 = (1 << 64) - 1

#: random streams of a position (:func:`position_uniforms`)
TOKEN, DRAFT, ACCEPT, INJECT = 0, 1, 2, 3

#: tokens per block of the two-level inverse CDF (:func:`sample_from`)
CDF_BLOCK = 1024


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


def position_uniforms(
    seeds: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, stream: int
) -> torch.Tensor:
    """U[0, 1) draws, one per row: a splitmix64 hash of (seed, response position, stream) -> [B] float64 (CPU).

    ``seeds`` [B] non-negative ints (:func:`sample_seed`), ``positions`` [B] response indices (0 = the first
    response token), ``stream`` one of :data:`TOKEN`, :data:`DRAFT`, :data:`ACCEPT`. Equal inputs give equal
    draws on any machine; the 53 high bits of the hash make the float (every value k / 2**53 is reachable).
    """
    s = np.asarray(seeds, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = s * np.uint64(0x9E3779B97F4A7C15) + (p + np.uint64(1)) * np.uint64(0xD1B54A32D192ED03)
        z = z + np.uint64(stream + 1) * np.uint64(0x8CB92BA72F3D8DD7)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def sample_from(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``weights [B, V]`` (non-negative float, any positive total) with ``uniforms [B]`` in
    [0, 1) -> [B] int64: the first id whose cumulative weight (vocabulary order) exceeds ``u * total``, never a
    zero-weight id.

    In fp64; a vocabulary of more than :data:`CDF_BLOCK` ids in two levels: the cumulative sum of its blocks'
    sums picks the block, a cumulative sum inside that block picks the id (memory [B, V / CDF_BLOCK + CDF_BLOCK]
    fp64, no sort, no [B, V] fp64 tensor).
    """
    target = uniforms.to(device=weights.device, dtype=torch.float64)[:, None]
    batch, vocab = weights.shape
    if vocab <= CDF_BLOCK:
        return _inverse_cdf(torch.cumsum(weights, dim=-1, dtype=torch.float64), target).squeeze(-1)
    blocks = -(-vocab // CDF_BLOCK)
    padded = torch.nn.functional.pad(weights, (0, blocks * CDF_BLOCK - vocab)).view(batch, blocks, CDF_BLOCK)
    block_cdf = torch.cumsum(padded.sum(dim=-1, dtype=torch.float64), dim=-1)  # [B, blocks]
    target = target * block_cdf[:, -1:]
    block = _inverse_cdf(block_cdf, target, scaled=True)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = padded.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK))[:, 0]
    pick = _inverse_cdf(torch.cumsum(inner, dim=-1, dtype=torch.float64), target - before, scaled=True)
    return (block * CDF_BLOCK + pick).squeeze(-1)


def _inverse_cdf(cdf: torch.Tensor, target: torch.Tensor, scaled: bool = False) -> torch.Tensor:
    """The first index of each row of ``cdf [B, N]`` (a cumulative sum) above ``target [B, 1]`` (``u`` in [0, 1)
    times the row's total unless ``scaled``), at most the index where the sum reached its total (the last
    positive entry: ``u * total`` may round up to the total) -> [B, 1] int64."""
    total = cdf[:, -1:]
    value = target if scaled else target * total
    last = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(cdf, value, right=True), last)


def kept_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """What a token is sampled from, before renormalisation: ``logits [..., V]`` -> fp32 ``[..., V]``.

    Temperature 0: one-hot at the argmax (lowest id on ties). Otherwise softmax(logits / temperature) on the
    top_k most likely tokens and then the shortest prefix of the descending list (ties in id order) whose mass
    reaches top_p, 0 elsewhere. Without top-k and top-p nothing is ranked.
    """
    if sampling.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p >= 1.0:
        if sampling.top_k == 0 or sampling.top_k >= probs.shape[-1]:
            return probs
        kth = torch.topk(probs, sampling.top_k, dim=-1).values.min(dim=-1, keepdim=True).values
        above, tied = probs > kth, probs == kth  # ties at the k-th value: the lowest ids among them stay
        room = sampling.top_k - above.sum(dim=-1, keepdim=True)
        keep = above | (tied & (torch.cumsum(tied.to(torch.int64), dim=-1) <= room))
        return torch.where(keep, probs, torch.zeros_like(probs))
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if sampling.top_k > 0:
        keep &= torch.arange(sorted_p.shape[-1], device=logits.device) < sampling.top_k
    keep &= torch.cumsum(sorted_p.double(), dim=-1) - sorted_p.double() < sampling.top_p
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def sampling_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The sampling distribution itself: :func:`kept_probs` renormalised to sum 1 (float64 ``[..., V]``)."""
    kept = kept_probs(logits, sampling).double()
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """Pick one token per row: ``logits [B, V]`` fp32, ``uniforms [B]`` float64 in [0, 1) (ignored when greedy)
    -> [B] int64, ``sample_from(kept_probs(logits, params), uniforms)``; greedy (temperature 0) is the argmax."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    return sample_from(kept_probs(logits, params), uniforms)


def injection_mix(
    inject: MismatchInjection, seeds: Sequence[int], positions: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """Per row, the uniform weight d of its draw (``inject.mix`` where the :data:`INJECT` draw of (seed, response
    position) is below ``inject.fraction``, else 0) -> [B] float64 on ``device``; None when ``inject`` is off
    (the draw is then exactly the plain one). See :class:`~sparrow_nemo.rollout.engine.MismatchInjection`."""
    if not inject.on:
        return None
    hit = position_uniforms(seeds, positions, INJECT) < inject.fraction
    return torch.where(hit, inject.mix, 0.0).to(device)


def inject_mixture(
    logits: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor, mix: torch.Tensor
) -> torch.Tensor:
    """``tokens [B]`` with the rows where ``mix [B] > 0`` redrawn, with the same ``uniforms [B]``, from
    ``(1 - mix) softmax(logits) + mix / V`` (``logits [B, V]``; [B, V] fp32 weights) -> [B] int64."""
    d = mix.to(torch.float32)[:, None]
    weights = (1 - d) * torch.softmax(logits.float(), dim=-1) + d / logits.shape[-1]
    return torch.where(mix > 0, sample_from(weights, uniforms), tokens)


def mixture_logprobs(logprobs: torch.Tensor, mix: torch.Tensor, vocab: int) -> torch.Tensor:
    """Model logprobs ``[B]`` or ``[B, K]`` as logprobs of the mixture with uniform weight ``mix [B]`` over
    ``vocab`` ids: ``log((1 - d) exp(lp) + d / V)`` (fp64 inside, the input's dtype out; rows with d = 0 as given)."""
    d = mix.to(torch.float64).view(-1, *([1] * (logprobs.dim() - 1)))
    mixed = torch.log((1 - d) * torch.exp(logprobs.double()) + d / vocab).to(logprobs.dtype)
    return torch.where(d > 0, mixed, logprobs)


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
