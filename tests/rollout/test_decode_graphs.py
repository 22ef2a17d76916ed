"""The bucketed CUDA-graph decode path (rollout.torch.cuda_graphs) against the engine's eager steps.

On a GPU the engine replays each decode step from a graph captured at the step's bucket size, its rows padded
(a padding row decodes at cached length 1 over the scratch page). On CPU the same padded static step runs
eagerly (``DecodeGraphs(capture=False)``, installed into an engine as its runner's graphs): it must give the
eager engine's tokens, logprobs, top-k, cached lengths, budgets and finish reasons while the batch shrinks and
grows through bucket sizes; the fused-kernel path runs under TRITON_INTERPRET=1. Tolerance for float outputs:
1e-5 (fp32; the two paths run the same ops per row, the kernel and torch paths differ by summation order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparrow_nemo.rollout import SamplingParams, TorchRolloutEngine
from sparrow_nemo.rollout.torch.cuda_graphs import MAX_BINS, DecodeGraphs, DeviceBudgets, bucket_sizes
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
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
    """(eager, padded) engines sharing one decoder: the second runs its decode steps through the padded static
    buffers a CUDA graph reads, eagerly."""
    common = {"dense_layers": 1, "attention_backend": backend, **kw}
    eager, padded = TorchRolloutEngine(model, **common), TorchRolloutEngine(model, **common)
    max_pages = -(-(SHAPE.max_position_embeddings + 1) // padded.page_size)
    padded.runner.graphs = DecodeGraphs(padded._step_fn, padded.device, 16, max_pages, capture=False)
    return eager, padded


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
def test_padded_steps_equal_eager_steps_torch_backend(
    model: Qwen3Decoder, temperature: float, page_score: str
) -> None:
    """Three rows padded to bucket 4, with a schedule loaded into the device table."""
    eager, padded = engines(model, "torch", page_score=page_score)
    params = SamplingParams(max_new_tokens=11, temperature=temperature, top_p=0.9, seed=3, stop_token_ids=())
    prompts = make_prompts((40, 9, 57))
    assert_same(eager.generate(prompts, params, SCHEDULE), padded.generate(prompts, params, SCHEDULE))


@torch.no_grad()
@pytest.mark.skipif(not _kernels_ready(), reason="sparrow_kernels cannot run on CPU (no TRITON_INTERPRET=1)")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_kernel_steps_equal_eager_torch_steps(model: Qwen3Decoder, temperature: float) -> None:
    """The fast path: fused kernels over the padded buffers, vs the eager torch reference path."""
    eager, _ = engines(model, "torch")
    _, padded = engines(model, "triton")
    params = SamplingParams(max_new_tokens=9, temperature=temperature, seed=7, stop_token_ids=())
    prompts = make_prompts((45, 7))
    a, b = eager.generate(prompts, params, SCHEDULE), padded.generate(prompts, params, SCHEDULE)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.response_ids, y.response_ids)
        assert torch.equal(x.kv_budget, y.kv_budget) and torch.equal(x.cached_len, y.cached_len)
        assert (x.logprobs - y.logprobs).abs().max() < 1e-4  # kernel vs torch summation order


@torch.no_grad()
def test_batch_through_buckets_with_stops_and_admissions(model: Qwen3Decoder) -> None:
    """Stop tokens end samples at different steps and the queue admits others (3 running at most): the
    batch moves through bucket sizes 1, 2, 4; dense and sparse schedules."""
    eager, padded = engines(model, "torch", max_batch_size=3)
    prompts = make_prompts((30, 12, 50, 5, 9), seed=1)
    free = SamplingParams(max_new_tokens=14, temperature=1.0, seed=11, stop_token_ids=())
    first = eager.generate(prompts, free, SCHEDULE)
    # Stop on a token that the unconstrained run samples mid-response in some sample.
    stop_id = int(first.samples[0].response_ids[4])
    params = SamplingParams(max_new_tokens=14, temperature=1.0, seed=11, stop_token_ids=(stop_id,))
    for schedule in (SCHEDULE, BudgetSchedule.dense()):
        a, b = eager.generate(prompts, params, schedule), padded.generate(prompts, params, schedule)
        assert_same(a, b)
    lengths = {int(s.response_ids.numel()) for s in a.samples}
    assert len(lengths) > 1 and min(lengths) <= 5
    assert a.samples[0].finish_reason == "stop_token"


@torch.no_grad()
def test_per_sample_position_cap(model: Qwen3Decoder) -> None:
    """A prompt near max_position_embeddings gets a shorter cap than its batch-mate."""
    eager, padded = engines(model, "torch")
    max_pos = SHAPE.max_position_embeddings
    prompts = make_prompts((max_pos - 4, 10), seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
    a, b = eager.generate(prompts, params, SCHEDULE), padded.generate(prompts, params, SCHEDULE)
    assert_same(a, b)
    assert [s.response_ids.numel() for s in b.samples] == [4, 8]


def test_buckets() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(256)[-3:] == [224, 240, 256]
    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"), 40, 4, capture=False)
    assert [graphs.bucket(b) for b in (1, 3, 8, 9, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]
    with pytest.raises(ValueError, match="exceed the largest bucket 40"):
        graphs.bucket(41)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(lambda *a: None, torch.device("cpu"), 4, 4, capture=True)


def test_device_budgets_equal_schedule_budgets_and_reload_in_place() -> None:
    budgets = DeviceBudgets(torch.device("cpu"))
    table = budgets.table
    for schedule in (SCHEDULE, BudgetSchedule.from_preset("qwen3-8b-0.86"), BudgetSchedule.dense()):
        budgets.load(schedule)
        lens = torch.tensor([0, 1, 31, 32, 33, 1999, 2000, 2001, 40_000, 10**7])
        assert torch.equal(budgets(lens), schedule.budgets_for(lens))
    assert budgets.table is table  # a captured graph keeps reading the same tensor
    with pytest.raises(ValueError, match=f"holds {MAX_BINS}"):
        budgets.load(BudgetSchedule(bin_tokens=16, budgets=tuple(range(16, 16 * (MAX_BINS + 2), 16))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@torch.no_grad()
def test_cuda_graph_steps_equal_eager_steps(hf_dir: Path) -> None:
    """On a GPU: graph replay at bucketed sizes gives the tokens of eager steps (fp32, fused kernels)."""
    gpu_model = Qwen3Decoder.from_hf_dir(hf_dir, device="cuda")
    kw = {"dense_layers": 1, "attention_backend": "triton", "max_batch_size": 8}
    graph = TorchRolloutEngine(gpu_model, cuda_graph=True, **kw)
    eager = TorchRolloutEngine(gpu_model, cuda_graph=False, **kw)
    assert graph.runner.graphs is not None and eager.runner.graphs is None
    params = SamplingParams(max_new_tokens=13, temperature=1.0, seed=5, stop_token_ids=(7,))
    prompts = make_prompts((45, 7, 80))
    assert_same(eager.generate(prompts, params, SCHEDULE), graph.generate(prompts, params, SCHEDULE))


@torch.no_grad()
def test_on_tokens_hears_every_generated_token_a_few_times(model: Qwen3Decoder) -> None:
    """The progress callback reports the exact token total, in a few calls (not one per token), with
    admissions, stop tokens and the length cap; results are the same with and without it."""
    eager, padded = engines(model, "torch", max_batch_size=3)
    prompts = make_prompts((30, 12, 50, 5, 9), seed=1)
    free = SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=())
    stop_id = int(eager.generate(prompts, free, SCHEDULE).samples[0].response_ids[20])
    for params in (
        free,
        SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=(stop_id,)),
    ):
        for engine in (eager, padded):
            heard: list[int] = []
            batch = engine.generate(prompts, params, SCHEDULE, on_tokens=heard.append)
            assert sum(heard) == batch.num_response_tokens, heard
            assert 2 <= len(heard) <= 20 and min(heard) > 0, heard
            assert_same(batch, engine.generate(prompts, params, SCHEDULE))
