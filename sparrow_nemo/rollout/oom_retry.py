"""A rollout engine wrapper that survives running out of accelerator memory by halving the batch.

When the wrapped engine's ``generate`` raises ``torch.OutOfMemoryError`` for a batch, the cached allocator
memory is released and the batch is generated as two halves, each retried the same way, down to single
sequences; a single sequence that still does not fit re-raises the error. Each split is logged.

The result equals that of one big batch: sample ``i`` of the whole batch keeps its seed
``sample_seed(sampling.seed, i)`` (passed to every part as ``sample_seeds``), and the engines sample every
sequence from its own seeded stream (:mod:`sparrow_nemo.rollout.sampling`), so no sample depends on its
batch mates. Timings are those of the successful calls, summed (the failed attempts are not counted).

Every other attribute (``score``, ``update_weights``, ``set_lora``, ``sleep``, ``wake``, ``model`` ...)
is the wrapped engine's own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sparrow_nemo.rollout.engine import EngineWrapper, RolloutBatch, SamplingParams, TokenProgress
from sparrow_nemo.rollout.sampling import batch_seeds
from sparrow_nemo.sparse.schedule import BudgetSchedule

logger = logging.getLogger(__name__)


class OomRetryEngine(EngineWrapper):
    """:class:`~sparrow_nemo.rollout.engine.RolloutEngine` around ``engine`` whose ``generate`` splits on OOM.

    Args:
        engine: any rollout engine whose ``generate`` accepts ``sample_seeds`` (both backends do).
    """

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        *,
        sample_seeds: Sequence[int] | None = None,
        on_tokens: TokenProgress | None = None,
    ) -> RolloutBatch:
        """``engine.generate`` of the whole batch, or of its halves (recursively) when that runs out of memory.

        ``on_tokens`` goes to every attempt (a failed attempt's tokens stay counted: it is a progress bar).
        """
        seeds = batch_seeds(sampling.seed, len(prompts), sample_seeds)
        return self._generate(list(prompts), seeds, sampling, schedule, on_tokens)

    def _generate(
        self,
        prompts: list,
        seeds: list[int],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        on_tokens: TokenProgress | None,
    ) -> RolloutBatch:
        try:
            return self.engine.generate(prompts, sampling, schedule, sample_seeds=seeds, on_tokens=on_tokens)
        except torch.OutOfMemoryError:
            if len(prompts) == 1:
                raise
        # Retried outside the except block, so the failed attempt's frames (and their tensors) are freed.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(prompts) // 2
        logger.warning(
            "rollout ran out of memory on a batch of %d sequences; retrying as %d + %d",
            len(prompts),
            half,
            len(prompts) - half,
        )
        first = self._generate(prompts[:half], seeds[:half], sampling, schedule, on_tokens)
        second = self._generate(prompts[half:], seeds[half:], sampling, schedule, on_tokens)
        return RolloutBatch(
            samples=first.samples + second.samples,
            schedule_name=first.schedule_name,
            prefill_s=first.prefill_s + second.prefill_s,
            decode_s=first.decode_s + second.decode_s,
        )
