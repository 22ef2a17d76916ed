"""The ``minmax`` page score in the torch rollout engine, against the method layer.

- the cache keeps only its page score's landmarks, and its key bounds equal ``page_key_bounds`` of the keys
  it stores after a chunked prefill of repeated prompts (the shared-prefill page copies), decode appends
  across page boundaries (the C kernel and the torch method, which agree bit for bit);
- the C kernel's page choice on key bounds equals ``select_pages_from_key_bounds`` on random caches with
  partial pages, and on exact ties (integer keys and queries) the lower page index wins as there; the fused
  step is select-then-attend;
- greedy decode of the engine equals a loop that decodes with ``sparse_decode_attention(page_score="minmax")``
  over a contiguous cache, token for token, for 240 tokens, on the C path and on the torch fallback;
- the recipe key reaches the engine of train / calibrate / eval (``grpo.setup.build_engine``) and ``sparrow bench
  rollout`` (printed).
(Speculative rollback and minmax drafts: tests/rollout/test_speculative.py.)
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from sparrow_nemo import cli
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.torch import cpu_attention
from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.model_runner import SlotTable
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache, fill_block_table
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.scheduler import Scheduler
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.sparse.attention import (
    decode_attention,
    group_mean_query,
    key_bound_scores,
    page_key_bounds,
    select_pages_from_key_bounds,
)
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE, ScatteredBlocks, contiguous_reference

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler for the CPU kernel"
)


def bounds_cache(
    seq_len: list[int], hkv: int, head_dim: int, page_size: int, seed: int, integer: bool = False
) -> tuple[PagedKVCache, torch.Tensor]:
    """A minmax cache whose rows own scattered physical pages, filled through append (bounds as in decode);
    ``integer``: keys in {-2, ..., 2} (exact scores, many ties)."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // page_size) for n in seq_len) + 3
    cache = PagedKVCache(1, pages, hkv, head_dim, page_size, page_score="minmax")
    blocks = ScatteredBlocks(pages, page_size, seed)  # scattered pages, not row order
    table = torch.full((len(seq_len), -(-max(seq_len) // page_size)), -1, dtype=torch.int32)
    lengths = torch.tensor(seq_len)
    fill_block_table(blocks, table, lengths)
    cache.blocks = blocks  # the test's own: further pages come from the same allocator
    for t in range(max(seq_len)):
        rows = (lengths > t).nonzero().flatten()
        shape = (rows.numel(), hkv, head_dim)
        k = (
            torch.randint(-2, 3, shape, generator=gen).float()
            if integer
            else torch.randn(shape, generator=gen)
        )
        cache.append(0, table[rows], torch.full((rows.numel(),), t), k, torch.randn(shape, generator=gen))
    return cache, table


def gathered_attention(q, cache, table, seq_len, page_idx) -> torch.Tensor:
    """The method layer's attention over the pages ``page_idx`` gathered out of the pool."""
    k, v, positions = cache.gather(0, table, page_idx)
    return decode_attention(q, k, v, (positions >= 0) & (positions < seq_len[:, None, None]))


def assert_bounds_match_keys(cache: PagedKVCache, table: torch.Tensor, seq_len: torch.Tensor) -> None:
    for layer in range(len(cache.k_pages)):
        keys, _ = cache.contiguous(layer, table, seq_len)
        for got, want in zip(
            cache.gather_key_bounds(layer, table, seq_len), page_key_bounds(keys, seq_len, cache.page_size)
        ):
            assert torch.equal(got, want)


def test_the_cache_keeps_only_its_page_scores_landmarks() -> None:
    centroid = PagedKVCache(2, 4, 2, 8, 4)
    minmax = PagedKVCache(2, 4, 2, 8, 4, page_score="minmax")
    assert len(centroid.centroids) == 2 and not centroid.key_min and not centroid.key_max
    assert not minmax.centroids and len(minmax.key_min) == len(minmax.key_max) == 2
    assert minmax.landmarks(1) == [minmax.key_min[1], minmax.key_max[1]]
    with pytest.raises(ValueError, match="page_score must be one of"):
        PagedKVCache(1, 4, 2, 8, 4, page_score="mean")
    with pytest.raises(ValueError, match="page_score must be one of"):
        TorchRolloutEngine.from_shape(SHAPE, page_score="quest")


@torch.no_grad()
def test_bounds_follow_prefill_shared_prefixes_and_appends() -> None:
    """Chunked prefill (16-token chunks, prompts ending mid-page) of a batch that repeats two prompts, shared
    through their prefixes (whole pages shared, the last partial page copied), then decode steps across page
    boundaries: the bounds of every row equal page_key_bounds of its stored keys."""
    engine = TorchRolloutEngine.from_shape(
        SHAPE, seed=3, dense_layers=0, page_size=4, page_score="minmax", prefill_chunk_tokens=16
    )
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(3, SHAPE.vocab_size, (n,), generator=gen) for n in (37, 10))
    prompts = [a, b, a, a, b]
    cache = engine._pool(5 * 16)
    scheduler = Scheduler(BlockManager(cache.num_pages - 1, 4), 8)
    seqs = [Seq(i, 0 if p is a else 1, p.numel(), 40) for i, p in enumerate(prompts)]
    scheduler.add(seqs)
    admitted = scheduler.admit()
    slots = SlotTable(8, 16, cache.num_pages - 1, engine.device)
    engine.runner.prefill(cache, [x.prefix for x in admitted[:2]], [a, b])
    engine.runner.fill(cache, slots, [(x.seq, x.prefix) for x in admitted], BudgetSchedule.dense(16, 4))
    seq_len = torch.tensor([s.cached for s in seqs])
    table = slots.rows(seqs, 16)
    rows_a = table[[0, 2, 3]]
    assert bool((rows_a[:, :9] == rows_a[0, :9]).all()) and len(set(rows_a[:, 9].tolist())) == 3
    assert_bounds_match_keys(cache, table, seq_len)
    tokens = engine.runner.first_logits([s.prompt_id for s in seqs]).argmax(dim=-1)
    budgets = torch.full((5,), 12)
    for _ in range(7):  # rows 1 and 4 go 10 -> 17 tokens: pages 3 and 4 start and fill
        scheduler.reserve(lambda s: s.cached + 1)
        for s in seqs:
            s.cached += 1
        seq_len = seq_len + 1
        table = slots.rows(seqs, 16)
        tokens = engine.decode_step(cache, table, tokens, seq_len, budgets).argmax(dim=-1)
    assert_bounds_match_keys(cache, table, seq_len)


@needs_cc
def test_kernel_append_equals_the_cache_method_bit_for_bit() -> None:
    ref, table = bounds_cache([21, 5, 40], 2, 24, 4, seed=11)
    mine, _ = bounds_cache([21, 5, 40], 2, 24, 4, seed=11)
    gen = torch.Generator().manual_seed(5)
    positions = torch.tensor([21, 5, 40])
    big = torch.full((3, table.shape[1] + 2), -1, dtype=torch.int32)
    big[:, : table.shape[1]] = table
    for cache in (ref, mine):
        fill_block_table(cache.blocks, big, positions + 4)
        for pool in cache.key_min + cache.key_max:  # stale bounds of a recycled page: slot 0 must reset them
            pool[big[0, 6]] = 99.0
    for step in range(4):  # row 0 fills page 5 and starts page 6
        k, v = torch.randn(3, 2, 24, generator=gen), torch.randn(3, 2, 24, generator=gen)
        ref.append(0, big, positions + step, k, v)
        cpu_attention.paged_append(mine, 0, big, positions + step, k, v)
    for a, b in ((ref.k_pages, mine.k_pages), (ref.key_min, mine.key_min), (ref.key_max, mine.key_max)):
        assert torch.equal(a[0], b[0])
    assert_bounds_match_keys(mine, big, positions + 4)


@needs_cc
@pytest.mark.parametrize(
    "page_size,head_dim", [(16, 32), (4, 24)], ids=str
)  # the vector path, the plain loop
def test_kernel_selection_on_key_bounds_is_the_method_layers(page_size: int, head_dim: int) -> None:
    lengths = [300, 17, 160, 64, 1, 131]
    seq_len = torch.tensor(lengths)
    gen = torch.Generator().manual_seed(8)
    budgets = ([64] * 6, [128, 16, 48, 1000, 64, 80], [0] * 6)
    for integer in (False, True):
        cache, table = bounds_cache(lengths, 2, head_dim, page_size, seed=21, integer=integer)
        k_min, k_max = cache.gather_key_bounds(0, table, seq_len)
        ties = 0
        for budget in map(torch.tensor, budgets):
            for _ in range(3):
                q = torch.randn(6, 4, head_dim, generator=gen)
                if integer:  # group means of integers are halves: every score is exact, equal ones tie
                    q = torch.randint(-1, 2, q.shape, generator=gen).float()
                mine = cpu_attention.select_pages(q, cache, 0, table, seq_len, budget, 1, 2)
                expect = select_pages_from_key_bounds(q, k_min, k_max, seq_len, budget, page_size, 1, 2)
                assert torch.equal(mine, expect)
                middle = key_bound_scores(group_mean_query(q, 2), k_min, k_max)[
                    0, :, 1 : 300 // page_size - 2
                ]
                ties += int((middle[:, None, :] == middle[:, :, None]).sum()) - middle.numel()
        assert not integer or ties > 100  # the integer caches really tie


@needs_cc
@pytest.mark.parametrize("page_size,head_dim,group", [(16, 32, 2), (4, 24, 3)], ids=str)
def test_fused_minmax_step_is_select_then_attend(page_size: int, head_dim: int, group: int) -> None:
    lengths = [300, 17, 160, 64, 1, 129]
    cache, table = bounds_cache(lengths, 2, head_dim, page_size, seed=5)
    seq_len = torch.tensor(lengths)
    k_min, k_max = cache.gather_key_bounds(0, table, seq_len)
    gen = torch.Generator().manual_seed(9)
    for budget in map(torch.tensor, ([64] * 6, [128, 16, 48, 1000, 64, 32], [10_000] * 6)):
        q = torch.randn(len(lengths), 2 * group, head_dim, generator=gen)
        out, page_idx = cpu_attention.sparse_decode_attention(q, cache, 0, table, seq_len, budget, 1, 2)
        expect = select_pages_from_key_bounds(q, k_min, k_max, seq_len, budget, page_size, 1, 2)
        assert torch.equal(page_idx[..., : expect.shape[-1]], expect)
        assert torch.equal(out, cpu_attention.paged_decode_attention(q, cache, 0, table, seq_len, expect))
        assert (out - gathered_attention(q, cache, table, seq_len, expect)).abs().max() < 1e-5
    assert torch.equal(out, cpu_attention.paged_decode_attention(q, cache, 0, table, seq_len, None))


@torch.no_grad()
@pytest.mark.parametrize("path", ["cpu kernel", "torch fallback"])
def test_greedy_minmax_decode_equals_the_contiguous_method_layer_loop(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """240 greedy tokens at a fixed 48-token budget (4-token pages: 1 sink + 2 local + 9 chosen pages of
    contexts up to 290 tokens), every layer sparse; the centroid score decodes differently."""
    if path == "torch fallback":
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
    elif not cpu_attention.available():
        pytest.skip("no C compiler for the CPU kernel")
    model = Qwen3Decoder.random(SHAPE.replace(max_position_embeddings=512), seed=1)
    schedule = BudgetSchedule(bin_tokens=64, budgets=(48,), page_size=4, name="fixed48")
    engine = TorchRolloutEngine(
        model, dense_layers=0, page_size=4, page_score="minmax", attention_backend="torch"
    )
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in (50, 13)]
    greedy = SamplingParams(max_new_tokens=240, temperature=0.0, stop_token_ids=())
    out = engine.generate(prompts, greedy, schedule)
    for prompt, sample in zip(prompts, out.samples):
        tokens, logprobs = contiguous_reference(
            model, prompt, 240, schedule, 0, page_size=4, page_score="minmax"
        )
        assert sample.response_ids.tolist() == tokens
        assert (sample.logprobs - logprobs).abs().max() < 1e-4
    centroid = TorchRolloutEngine(model, dense_layers=0, page_size=4, attention_backend="torch")
    other = centroid.generate(prompts, greedy, schedule)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(out.samples, other.samples))


def test_bench_rollout_takes_the_page_score_from_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--contexts", "48", "--batch", "2", "--steps", "2", "--tail-batch", "2", "--gen-len", "8"]
    assert (
        cli.main(
            ["bench", "rollout", *small, "--config", "tiny_cpu_short_smoke", "sparsity.page_score=minmax"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "page score minmax" in out and "rollout bench: batch 2" in out


def test_the_recipe_builds_a_minmax_engine_for_train_calibrate_and_eval() -> None:
    """grpo.setup.build_engine (the trainer's, sparrow calibrate's and sparrow eval's engine) reads the key."""
    from sparrow_nemo.grpo.setup import build_engine

    config = load_config("tiny_cpu_short_smoke", ["sparsity.page_score=minmax"])
    weights = Qwen3Decoder.random(config.model.shape(), seed=0).params
    engine = build_engine(config, weights)
    assert engine.page_score == "minmax" and engine._pool(4).key_max
    assert build_engine(load_config("tiny_cpu_short_smoke"), weights).page_score == "centroid"
