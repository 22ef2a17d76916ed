"""The static-shape decode loop (rollout.static_decode) against the engine's compact loop.

The compact loop is the engine's executable specification (tested against transformers and a
contiguous-cache reference in test_reference_engine.py); the static loop must give the same tokens,
logprobs, top-k, cached lengths, budgets and finish reasons. On CPU the static step runs eagerly (the
same function a CUDA graph captures on a GPU); the fused-kernel path runs under TRITON_INTERPRET=1.
Tolerance for float outputs: 1e-5 (fp32; both loops run the same ops in the same order per row, the
kernel and torch paths differ only by summation order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparrow_nemo.rollout import SamplingParams, TorchRolloutEngine
from sparrow_nemo.rollout.sampling import draw_uniforms, make_generators
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.static_decode import DeviceBudgets, StaticDecoder, draw_uniform_block
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE

TOL = 1e-5
#: Budgets small enough that the tiny prompts below exceed them (sparse selection really happens).
SCHEDULE = BudgetSchedule(bin_tokens=32, budgets=(48, 64), name="tiny-sparse")
FIELDS = ("response_ids", "top_ids", "cached_len", "kv_budget")
FLOATS = ("logprobs", "top_logprobs")


def _kernels_ready() -> bool:
    try:
        import sparrow_kernels
    except ImportError:
        return False
    return sparrow_kernels.available(torch.device("cpu"))


def make_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def engines(model: Qwen3Decoder, backend: str, **kw) -> tuple[TorchRolloutEngine, TorchRolloutEngine]:
    """(compact, static) engines sharing one decoder."""
    common = {"dense_layers": 1, "attention_backend": backend, **kw}
    return (
        TorchRolloutEngine(model, decode_loop="compact", **common),
        TorchRolloutEngine(model, decode_loop="static", stop_check_every=3, **common),
    )


def assert_same(a, b) -> None:
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        for name in FIELDS:
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        for name in FLOATS:
            assert (getattr(x, name) - getattr(y, name)).abs().max() < TOL, name
        assert (x.finish_reason, x.stop) == (y.finish_reason, y.stop)


@pytest.fixture(scope="module")
def model(hf_dir: Path) -> Qwen3Decoder:
    return Qwen3Decoder.from_hf_dir(hf_dir)


@torch.no_grad()
@pytest.mark.parametrize("temperature,page_score", [(0.0, "centroid"), (1.0, "centroid"), (1.0, "minmax")])
def test_static_loop_equals_compact_loop_torch_backend(
    model: Qwen3Decoder, temperature: float, page_score: str
) -> None:
    compact, static = engines(model, "torch", page_score=page_score)
    assert static.decode_loop == "static" and not static.cuda_graph
    params = SamplingParams(max_new_tokens=11, temperature=temperature, top_p=0.9, seed=3, stop_token_ids=())
    prompts = make_prompts((40, 9, 57))
    assert_same(compact.generate(prompts, params, SCHEDULE), static.generate(prompts, params, SCHEDULE))


@torch.no_grad()
@pytest.mark.skipif(not _kernels_ready(), reason="sparrow_kernels cannot run on CPU (no TRITON_INTERPRET=1)")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_loop_equals_compact_loop_kernel_backend(model: Qwen3Decoder, temperature: float) -> None:
    """The fast path: fused kernels + static steps, vs the compact loop on the torch reference path."""
    compact, _ = engines(model, "torch")
    _, static = engines(model, "triton")
    params = SamplingParams(max_new_tokens=9, temperature=temperature, seed=7, stop_token_ids=())
    prompts = make_prompts((45, 7))
    a, b = compact.generate(prompts, params, SCHEDULE), static.generate(prompts, params, SCHEDULE)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.response_ids, y.response_ids)
        assert torch.equal(x.kv_budget, y.kv_budget) and torch.equal(x.cached_len, y.cached_len)
        assert (x.logprobs - y.logprobs).abs().max() < 1e-4  # kernel vs torch summation order


@torch.no_grad()
def test_static_loop_stops_like_compact_loop(model: Qwen3Decoder) -> None:
    """Stop tokens found between host checks (every 3 steps) end each sample at the same token; the
    batch-mates keep their own lengths; the dense schedule too."""
    compact, static = engines(model, "torch")
    prompts = make_prompts((30, 12, 50, 5), seed=1)
    free = SamplingParams(max_new_tokens=14, temperature=1.0, seed=11, stop_token_ids=())
    first = compact.generate(prompts, free, SCHEDULE)
    # Stop on a token that the unconstrained run samples mid-response in some sample.
    stop_id = int(first.samples[0].response_ids[4])
    params = SamplingParams(max_new_tokens=14, temperature=1.0, seed=11, stop_token_ids=(stop_id,))
    for schedule in (SCHEDULE, BudgetSchedule.dense()):
        a, b = compact.generate(prompts, params, schedule), static.generate(prompts, params, schedule)
        assert_same(a, b)
    lengths = {int(s.response_ids.numel()) for s in a.samples}
    assert len(lengths) > 1 and min(lengths) <= 5
    assert a.samples[0].finish_reason == "stop_token"


@torch.no_grad()
def test_static_loop_respects_per_sample_position_cap(model: Qwen3Decoder) -> None:
    """A prompt near max_position_embeddings gets a shorter cap than its batch-mate (as in compact)."""
    compact, static = engines(model, "torch")
    max_pos = SHAPE.max_position_embeddings
    prompts = make_prompts((max_pos - 4, 10), seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
    a, b = compact.generate(prompts, params, SCHEDULE), static.generate(prompts, params, SCHEDULE)
    assert_same(a, b)
    assert [s.response_ids.numel() for s in b.samples] == [4, 8]


def test_device_budgets_equal_schedule_budgets() -> None:
    for schedule in (SCHEDULE, BudgetSchedule.from_preset("qwen3-8b-0.86"), BudgetSchedule.dense()):
        lens = torch.tensor([0, 1, 31, 32, 33, 1999, 2000, 2001, 40_000, 10**7])
        got = DeviceBudgets(schedule, torch.device("cpu"))(lens)
        assert torch.equal(got, schedule.budgets_for(lens))


def test_uniform_block_equals_successive_draws() -> None:
    seeds = [5, 17, 123456789]
    block = draw_uniform_block(make_generators(seeds), 40)
    gens = make_generators(seeds)
    rows = torch.stack([draw_uniforms(gens) for _ in range(40)])
    assert block.shape == (40, 3) and torch.equal(block, rows)
    # The next block continues the streams.
    more = draw_uniform_block(gens, 2)
    fresh = make_generators(seeds)
    draw_uniform_block(fresh, 40)
    assert torch.equal(more, draw_uniform_block(fresh, 2))


def test_bad_decode_options_are_refused(model: Qwen3Decoder) -> None:
    with pytest.raises(ValueError, match="decode_loop"):
        TorchRolloutEngine(model, decode_loop="fast")
    with pytest.raises(ValueError, match="stop_check_every"):
        TorchRolloutEngine(model, stop_check_every=0)


def test_auto_loop_is_compact_on_cpu(model: Qwen3Decoder) -> None:
    engine = TorchRolloutEngine(model, attention_backend="torch")
    assert engine.decode_loop == "compact" and not engine.cuda_graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@torch.no_grad()
def test_cuda_graph_loop_equals_eager_static_loop(hf_dir: Path) -> None:
    """On a GPU: graph replay gives the tokens of the eager static loop (fp32, fused kernels)."""
    gpu_model = Qwen3Decoder.from_hf_dir(hf_dir, device="cuda")
    kw = {"dense_layers": 1, "attention_backend": "triton", "decode_loop": "static", "stop_check_every": 4}
    graph = TorchRolloutEngine(gpu_model, cuda_graph=True, **kw)
    eager = TorchRolloutEngine(gpu_model, cuda_graph=False, **kw)
    assert graph.cuda_graph and not eager.cuda_graph
    params = SamplingParams(max_new_tokens=13, temperature=1.0, seed=5, stop_token_ids=(7,))
    prompts = make_prompts((45, 7, 80))
    assert_same(eager.generate(prompts, params, SCHEDULE), graph.generate(prompts, params, SCHEDULE))


@torch.no_grad()
def test_retired_rows_decode_at_position_zero(model: Qwen3Decoder) -> None:
    """A retired row restarts at cached length 1 every step; live rows advance and are unaffected."""
    engine = TorchRolloutEngine(model, dense_layers=1, attention_backend="torch", decode_loop="static")
    cache = engine._ensure_cache(8)
    table = torch.full((2, 4), -1, dtype=torch.int32)
    cache.reserve(table, torch.tensor([40, 40]))
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=())
    dec = StaticDecoder(
        engine.decode_step, "torch", cache, table, torch.tensor([20, 20]), 4, params, SCHEDULE, check_every=4
    )
    dec.run(1)
    dec.retire([1])
    dec.run(2)
    assert dec.seq_len.tolist() == [23, 1]
    assert dec.rec_cached[1:4].tolist() == [[21, 21], [22, 1], [23, 1]]
    assert dec.live.tolist() == [True, False]


@torch.no_grad()
def test_on_tokens_hears_every_generated_token_a_few_times(model: Qwen3Decoder) -> None:
    """The progress callback: both loops report the exact token total, in a few calls (not one per token),
    with waves, stop tokens and the length cap; results are the same with and without it."""
    compact, static = engines(model, "torch", max_batch_size=3)
    prompts = make_prompts((30, 12, 50, 5, 9), seed=1)
    free = SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=())
    stop_id = int(compact.generate(prompts, free, SCHEDULE).samples[0].response_ids[20])
    for params in (
        free,
        SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=(stop_id,)),
    ):
        for engine in (compact, static):
            heard: list[int] = []
            batch = engine.generate(prompts, params, SCHEDULE, on_tokens=heard.append)
            assert sum(heard) == batch.num_response_tokens, (engine.decode_loop, heard)
            assert 2 <= len(heard) <= 12 and min(heard) > 0, heard
            assert_same(batch, engine.generate(prompts, params, SCHEDULE))
