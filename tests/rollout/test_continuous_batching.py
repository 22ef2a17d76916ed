"""Continuous batching under a KV budget: decode steps near the lower bound, the same tokens as with no budget.

16 requests (2 prompts x 8 samples, a GRPO step in miniature) whose lengths are set by stop tokens the
scheduler cannot know, spread over 10x or more (the stop set is picked by measuring the unconstrained run, so
the test holds on any CPU's floating point). The KV pool holds 4.5 or 2.0 full-length rows (prompt + cap).
Lower bound on decode steps: the longest response, and the KV token-steps the responses must hold (each
response's own tokens at every step it decodes, plus each prompt once while any of its samples runs: GRPO
groups share their prompt pages) over the pool's tokens. Each constrained run must return every sample token
for token as the unconstrained run (per-sample position-indexed draws; a preempted sequence's cache is
recomputed with the rule it was decoded with).
"""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import RolloutBatch, SamplingParams
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.schedule import BudgetSchedule

SHAPE = PRESETS["tiny-test"].replace(num_layers=3)
PROMPT, CAP, SAMPLES = 24, 320, 8
#: bins of 64 cached tokens; 48 / 64-token budgets, far below most contexts here (sparse decode bites)
SPARSE = BudgetSchedule(bin_tokens=64, budgets=(48, 48, 64), name="t")


@pytest.fixture(scope="module")
def engine() -> TorchRolloutEngine:
    return TorchRolloutEngine.from_shape(SHAPE, seed=1, dense_layers=1, attention_backend="torch")


def requests() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE.vocab_size, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    return [p for p in prompts for _ in range(SAMPLES)]


def lower_bound(batch: RolloutBatch, budget_tokens: int) -> float:
    """max(longest response, KV token-steps / pool tokens), prompts counted once per group."""
    lengths = [s.response_ids.numel() for s in batch.samples]
    own = sum(n * (n - 1) / 2 for n in lengths)  # response tokens held at each of its steps
    prompts = sum(PROMPT * max(lengths[g * SAMPLES : (g + 1) * SAMPLES]) for g in range(2))
    return max(max(lengths), (own + prompts) / budget_tokens)


def pool(rows: float) -> int:
    """KV tokens for ``rows`` full-length rows (prompt + cap), whole pages."""
    return int(rows * (PROMPT + CAP)) // 16 * 16


def spread_run(engine: TorchRolloutEngine, schedule: BudgetSchedule) -> tuple[SamplingParams, RolloutBatch]:
    """The first stop token (from a fixed list) whose unconstrained run ends every sample by a stop token,
    spreads the lengths over 10x or more and holds more pages at its peak than the 2-row pool has, with that
    run."""
    for stop in range(3, SHAPE.vocab_size):
        sampling = SamplingParams(max_new_tokens=CAP, temperature=1.0, seed=5, stop_token_ids=(stop,))
        free = engine.generate(requests(), sampling, schedule)
        lengths = [s.response_ids.numel() for s in free.samples]
        stopped = all(s.finish_reason == "stop_token" for s in free.samples)
        if stopped and max(lengths) >= 10 * min(lengths) and free.peak_pages > 1.3 * pool(2.0) / 16:
            return sampling, free
    raise AssertionError("no stop token spreads the lengths 10x and outgrows the pool")


@pytest.mark.parametrize("schedule", [SPARSE, BudgetSchedule.dense(64)], ids=["sparse", "dense"])
def test_decode_steps_near_the_bound_and_the_same_tokens_under_a_kv_budget(
    engine: TorchRolloutEngine, schedule: BudgetSchedule
) -> None:
    sampling, free = spread_run(engine, schedule)
    assert free.preemptions == 0
    for rows, slack, preempts in ((4.5, 1.2, False), (2.0, 1.5, True)):
        budget = pool(rows)
        tight = TorchRolloutEngine(
            engine.model, dense_layers=1, attention_backend="torch", max_cache_tokens=budget
        )
        out = tight.generate(requests(), sampling, schedule)
        bound = lower_bound(free, budget)
        assert out.decode_steps <= slack * bound, (rows, out.decode_steps, bound)
        assert out.capacity_pages == budget // 16 and out.peak_pages <= out.capacity_pages
        if preempts:
            assert out.preemptions > 0  # the pool really was short: sequences were recomputed
        for a, b in zip(free.samples, out.samples):
            assert torch.equal(a.response_ids, b.response_ids)
            assert torch.equal(a.cached_len, b.cached_len) and torch.equal(a.kv_budget, b.kv_budget)
            assert (a.logprobs - b.logprobs).abs().max() < 1e-4
            assert (a.finish_reason, a.stop) == (b.finish_reason, b.stop)


def test_per_prompt_caps_and_stats(engine: TorchRolloutEngine) -> None:
    """``max_new_tokens`` per prompt (vLLM's per-request cap); the batch says how it was scheduled."""
    sampling = SamplingParams(max_new_tokens=50, temperature=1.0, seed=2, stop_token_ids=())
    caps = [5, 40, 1, 17]
    out = engine.generate(requests()[:4], sampling, SPARSE, max_new_tokens=caps)
    assert [s.response_ids.numel() for s in out.samples] == caps
    assert all(s.finish_reason == "length" for s in out.samples)
    assert out.decode_steps == max(caps) - 1 and out.preemptions == 0 and out.peak_pages > 0
    alone = engine.generate(
        requests()[1:2], sampling, SPARSE, max_new_tokens=[40], sample_seeds=[out_seed(1)]
    )
    assert torch.equal(alone.samples[0].response_ids, out.samples[1].response_ids)
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 4 prompts"):
        engine.generate(requests()[:4], sampling, SPARSE, max_new_tokens=[3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be >= 1"):
        engine.generate(requests()[:2], sampling, SPARSE, max_new_tokens=[3, 0])


def out_seed(index: int) -> int:
    from sparrow_nemo.rollout.sampling import sample_seed

    return sample_seed(2, index)


def test_a_pool_too_small_for_one_sequence_names_the_knob(engine: TorchRolloutEngine) -> None:
    tight = TorchRolloutEngine(engine.model, dense_layers=1, attention_backend="torch", max_cache_tokens=64)
    sampling = SamplingParams(max_new_tokens=200, temperature=1.0, seed=1, stop_token_ids=())
    with pytest.raises(RuntimeError, match="max_cache_tokens"):
        tight.generate(requests()[:1], sampling, SPARSE)
