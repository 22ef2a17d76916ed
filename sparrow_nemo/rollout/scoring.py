"""Per-token rollout/dense mismatch of a generated batch: the rollout scored by the dense model.

Used by ``bench rollout`` and calibration: generate (sparse) with an engine, re-score the same tokens
with the engine's dense teacher-forced forward (:meth:`RolloutEngine.score`, no LoRA), and compare the
two top-K lists per token (K = the rollout's ``logprobs_topk``) with the method layer's acceptance-rate bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow_nemo.rollout.engine import RolloutBatch, RolloutEngine
from sparrow_nemo.sparse.mismatch import acceptance_rate_topk


@dataclass
class TokenMismatch:
    """Flattened over all response tokens of a batch (N tokens, sample-major order).

    Attributes:
        alpha: [N] float32 acceptance rate (top-K union lower bound) between dense p and rollout q.
        cached_len: [N] int64 tokens in the cache when the token was sampled.
        train_logprobs: [N] float32 dense logprob of the sampled token.
        gen_logprobs: [N] float32 rollout-engine logprob of the sampled token.
    """

    alpha: torch.Tensor
    cached_len: torch.Tensor
    train_logprobs: torch.Tensor
    gen_logprobs: torch.Tensor


def measure_mismatch(engine: RolloutEngine, batch: RolloutBatch) -> TokenMismatch:
    """Score ``batch`` densely with ``engine.score`` and compare per token with the rollout's top-K."""
    if not batch.samples:
        empty = torch.empty(0)
        return TokenMismatch(empty, torch.empty(0, dtype=torch.int64), empty, empty)
    topk = batch.samples[0].top_ids.shape[-1]
    sequences = [torch.cat([s.prompt_ids, s.response_ids]).tolist() for s in batch.samples]
    scored = engine.score(sequences, topk=topk)
    alpha, cached, train, gen = [], [], [], []
    for s, d in zip(batch.samples, scored):
        start = s.prompt_ids.numel() - 1  # score entry t predicts token t + 1
        span = slice(start, start + s.response_ids.numel())
        alpha.append(acceptance_rate_topk(d.top_ids[span], d.top_logprobs[span], s.top_ids, s.top_logprobs))
        cached.append(s.cached_len)
        train.append(d.logprobs[span])
        gen.append(s.logprobs)
    return TokenMismatch(torch.cat(alpha), torch.cat(cached), torch.cat(train), torch.cat(gen))
