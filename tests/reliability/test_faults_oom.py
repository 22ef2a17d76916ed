"""Rollout out of memory: the batch is retried in halves and the samples equal those of one big batch
(tokens exactly; logprobs to float rounding, as any two batch sizes of the torch rollout engine).

A CPU cannot run out of accelerator memory on demand, so the engine under test is the real reference
engine with one change: ``generate`` raises ``torch.OutOfMemoryError`` for batches above a size limit.
"""

from __future__ import annotations

import logging
from dataclasses import fields

import pytest
import torch
from rollout._helpers import SHAPE

from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams
from sparrow_nemo.rollout.oom_retry import OomRetryEngine
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.schedule import BudgetSchedule


class SmallMemoryEngine(TorchRolloutEngine):
    """The torch rollout engine, out of memory for more than ``limit`` sequences; records every batch size asked."""

    limit = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def generate(self, prompts, sampling, schedule, *, sample_seeds=None, on_tokens=None):
        self.asked.append(len(prompts))
        if len(prompts) > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (test: {len(prompts)} > {self.limit} sequences)"
            )
        return super().generate(prompts, sampling, schedule, sample_seeds=sample_seeds, on_tokens=on_tokens)


SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop_token_ids=())
SCHEDULE = BudgetSchedule.from_preset("fixed:48")
PROMPTS = [[(7 * i + j) % SHAPE.vocab_size for j in range(20 + 9 * i)] for i in range(7)]


def assert_same_samples(a: list[RolloutSample], b: list[RolloutSample]) -> None:
    """Same tokens, stops and budgets; logprobs equal up to batch-size-dependent float rounding (1e-5)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for f in fields(RolloutSample):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if isinstance(u, torch.Tensor) and u.is_floating_point():
                assert (u - v).abs().max() < 1e-5, f.name
            else:
                assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, f.name


def test_out_of_memory_splits_in_halves_and_matches_one_big_batch(caplog) -> None:
    reference = TorchRolloutEngine.from_shape(SHAPE, seed=4).generate(PROMPTS, SAMPLING, SCHEDULE)
    small = SmallMemoryEngine.from_shape(SHAPE, seed=4)
    caplog.set_level(logging.WARNING, logger="sparrow_nemo.rollout.oom_retry")
    out = OomRetryEngine(small).generate(PROMPTS, SAMPLING, SCHEDULE)
    assert small.asked == [7, 3, 1, 2, 4, 2, 2]  # depth-first halves until each part fits
    assert_same_samples(out.samples, reference.samples)
    assert out.schedule_name == reference.schedule_name and out.num_response_tokens == 7 * 24
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout ran out of memory on a batch of {n} sequences; retrying as {a} + {b}"
        for n, a, b in ((7, 3, 4), (3, 1, 2), (4, 2, 2))
    ]


def test_explicit_sample_seeds_are_kept_across_the_split() -> None:
    seeds = [11, 5, 99, 2, 40]
    reference = TorchRolloutEngine.from_shape(SHAPE, seed=4).generate(
        PROMPTS[:5], SAMPLING, SCHEDULE, sample_seeds=seeds
    )
    out = OomRetryEngine(SmallMemoryEngine.from_shape(SHAPE, seed=4)).generate(
        PROMPTS[:5], SAMPLING, SCHEDULE, sample_seeds=seeds
    )
    assert_same_samples(out.samples, reference.samples)


def test_one_sequence_that_does_not_fit_reraises() -> None:
    engine = SmallMemoryEngine.from_shape(SHAPE, seed=4)
    engine.limit = 0
    with pytest.raises(torch.OutOfMemoryError, match="1 > 0 sequences"):
        OomRetryEngine(engine).generate(PROMPTS[:2], SAMPLING, SCHEDULE)
    assert engine.asked == [2, 1]


def test_the_wrapper_forwards_the_rest_of_the_engine() -> None:
    engine = TorchRolloutEngine.from_shape(SHAPE, seed=4)
    wrapped = OomRetryEngine(engine)
    assert wrapped.shape is engine.shape and wrapped.model is engine.model
    scored = wrapped.score([PROMPTS[0]])[0]
    assert scored.logprobs.shape == (len(PROMPTS[0]) - 1,)
