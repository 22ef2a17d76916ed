"""The in-place CPU decode-attention kernel (rollout.cpu_attention) against the method layer.

Reference: the pages gathered out of the pool (``PagedKVCache.gather``) into
``sparrow_nemo.sparse.attention.decode_attention``. Shapes cover the vector path (16-token pages, head dim
a multiple of 16) and the plain loop (4-token pages, head dim 24), partial last pages, rows of different
lengths, padded page lists and scattered physical pages. Tolerance 1e-5 (fp32, different summation order).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.torch import cpu_attention
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.paged_attention import all_pages, decode_attention_torch
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache, fill_block_table
from sparrow_nemo.sparse.attention import decode_attention, select_pages_from_centroids
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE, ScatteredBlocks

# Only a machine without a C compiler may skip: where one exists, a kernel that fails to build fails here
# (test_the_kernel_builds_where_a_compiler_exists names the compiler's error) instead of skipping silently.
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler for the CPU kernel"
)


def test_the_kernel_builds_where_a_compiler_exists():
    cpu_attention._build()  # raises with the compiler's message when the source does not compile
    assert cpu_attention.available()


def filled_cache(
    seq_len: list[int], hkv: int, head_dim: int, page_size: int, seed: int
) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache whose rows own scattered physical pages, filled through append (centroids as in decode)."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // page_size) for n in seq_len) + 3
    cache = PagedKVCache(1, pages, hkv, head_dim, page_size)
    blocks = ScatteredBlocks(pages, page_size, seed)  # scattered pages, not row order
    table = torch.full((len(seq_len), -(-max(seq_len) // page_size)), -1, dtype=torch.int32)
    lengths = torch.tensor(seq_len)
    fill_block_table(blocks, table, lengths)
    cache.blocks = blocks  # the test's own: further pages come from the same allocator
    for t in range(max(seq_len)):
        rows = (lengths > t).nonzero().flatten()
        k = torch.randn(rows.numel(), hkv, head_dim, generator=gen)
        v = torch.randn(rows.numel(), hkv, head_dim, generator=gen)
        cache.append(0, table[rows], torch.full((rows.numel(),), t), k, v)
    return cache, table


def reference(q, cache, table, seq_len, page_idx) -> torch.Tensor:
    k, v, positions = cache.gather(0, table, page_idx)
    return decode_attention(q, k, v, (positions >= 0) & (positions < seq_len[:, None, None]))


@pytest.mark.parametrize(
    "page_size,head_dim,group", [(16, 32, 2), (16, 64, 1), (4, 24, 3), (8, 16, 2)], ids=str
)
def test_dense_and_sparse_match_the_method_layer(page_size: int, head_dim: int, group: int) -> None:
    hkv, lengths = 2, [77, 16, 130, 1]
    cache, table = filled_cache(lengths, hkv, head_dim, page_size, seed=page_size + head_dim)
    seq_len = torch.tensor(lengths)
    q = torch.randn(len(lengths), hkv * group, head_dim, generator=torch.Generator().manual_seed(7))
    dense = cpu_attention.paged_decode_attention(q, cache, 0, table, seq_len, None)
    expect = reference(q, cache, table, seq_len, all_pages(seq_len, hkv, page_size))
    assert (dense - expect).abs().max() < 1e-5
    for b in range(len(lengths)):  # a row's result does not depend on the longer rows beside it, bit for bit
        alone = cpu_attention.paged_decode_attention(
            q[b : b + 1], cache, 0, table[b : b + 1], seq_len[b : b + 1], None
        )
        assert torch.equal(alone, dense[b : b + 1])
    cent = cache.gather_centroids(0, table, seq_len)
    budget = torch.tensor([5 * page_size, 1000, 6 * page_size, 1000])  # rows 1 and 3 fit it: dense
    page_idx = select_pages_from_centroids(q, cent, seq_len, budget, page_size, 1, 2)
    assert (page_idx < 0).any()  # the rows keep different page counts: the list is padded
    sparse = cpu_attention.paged_decode_attention(q, cache, 0, table, seq_len, page_idx)
    assert (sparse - reference(q, cache, table, seq_len, page_idx)).abs().max() < 1e-5
    assert torch.equal(sparse[[1, 3]], dense[[1, 3]])  # a covering budget is dense, bit for bit


def test_unread_slots_never_leak_into_the_result() -> None:
    """Slots past seq_len and pages the rule dropped may hold anything (here NaN): the output ignores them."""
    cache, table = filled_cache([40, 40], 2, 32, 16, seed=3)
    seq_len = torch.tensor([33, 40])  # row 0 ends 7 tokens into its last page
    page_idx = torch.tensor([[[0, 2, -1], [1, 2, -1]], [[0, 1, 2], [0, 2, -1]]])
    clean = cpu_attention.paged_decode_attention(torch.ones(2, 4, 32), cache, 0, table, seq_len, page_idx)
    for p in range(cache.num_pages):
        if p not in table[:, :3].flatten().tolist():
            cache.k_pages[0][p] = float("nan")
    row0_last = int(table[0, 2])
    cache.k_pages[0][row0_last, :, 1:] = float("nan")  # slots 33.. of row 0
    cache.v_pages[0][row0_last, :, 1:] = float("nan")
    cache.k_pages[0][int(table[0, 1]), 0] = float("nan")  # page 1 of row 0, head 0: not chosen
    dirty = cpu_attention.paged_decode_attention(torch.ones(2, 4, 32), cache, 0, table, seq_len, page_idx)
    assert torch.isfinite(dirty).all() and torch.equal(clean, dirty)


def test_the_build_cache_key_covers_source_flags_and_compiler(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed source, flag, compiler or compiler version is a different cached library; same inputs, same."""
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    base = cpu_attention.library_path("cc", "cc 1.0")
    assert base == cpu_attention.library_path("cc", "cc 1.0") and base.parent == tmp_path / "cpu_kernels"
    assert cpu_attention.library_path("clang", "cc 1.0") != base
    assert cpu_attention.library_path("cc", "cc 1.1") != base
    monkeypatch.setattr(cpu_attention, "CFLAGS", (*cpu_attention.CFLAGS, "-DEXTRA"))
    assert cpu_attention.library_path("cc", "cc 1.0") != base
    monkeypatch.undo()
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    edited = tmp_path / "cpu_layer.c"
    edited.write_text(cpu_attention.SOURCES[1].read_text() + "\n/* edited */\n")
    monkeypatch.setattr(cpu_attention, "SOURCES", (cpu_attention.SOURCES[0], edited))
    assert cpu_attention.library_path("cc", "cc 1.0") != base


@pytest.fixture
def no_compiler(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """No C compiler and an empty kernel cache; the real library is reloaded afterwards."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    cpu_attention._library.cache_clear()
    yield
    cpu_attention._library.cache_clear()


def test_without_a_compiler_decode_falls_back_to_the_torch_path(no_compiler, caplog) -> None:
    """No compiler: the build fails with OSError, available() is False (one warning), and decode attention,
    the append and a whole generate run on the torch gather path with the kernel path's results."""
    lengths = [77, 16, 130]
    cache, table = filled_cache(lengths, 2, 32, 16, seed=3)
    seq_len = torch.tensor(lengths)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1))
    budget = torch.tensor([64, 1000, 80])
    cpu_attention._library.cache_clear()
    with pytest.MonkeyPatch.context() as real:  # the kernel's results first, with the real compiler
        real.delenv("CC")
        kernel = [decode_attention_torch(q, cache, 0, table, seq_len, b, 1, 2) for b in (None, budget)]
        assert cpu_attention.available()
    cpu_attention._library.cache_clear()
    with pytest.raises(OSError):
        cpu_attention._build()
    with caplog.at_level("WARNING", logger=cpu_attention.__name__):
        assert not cpu_attention.available() and not cpu_attention.supports(q, cache)
    assert sum("torch gather path" in r.message for r in caplog.records) == 1
    for b, expect in zip((None, budget), kernel):
        assert (decode_attention_torch(q, cache, 0, table, seq_len, b, 1, 2) - expect).abs().max() < 1e-5
    engine = TorchRolloutEngine.from_shape(SHAPE, seed=0, dense_layers=1, page_size=4)
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=())
    out = engine.generate([[5, 6, 7, 8, 9]] * 2, sampling, BudgetSchedule.from_preset("fixed:8", 8, 4))
    assert [len(s.response_ids) for s in out.samples] == [12, 12]
    assert all(torch.isfinite(torch.as_tensor(s.logprobs)).all() for s in out.samples)


def test_append_equals_the_cache_method() -> None:
    """Keys, values and incremental centroids after kernel appends equal PagedKVCache.append's."""
    ref, table = filled_cache([21, 5, 40], 2, 24, 4, seed=11)
    mine, _ = filled_cache([21, 5, 40], 2, 24, 4, seed=11)
    gen = torch.Generator().manual_seed(5)
    positions = torch.tensor([21, 5, 40])
    big = torch.full((3, table.shape[1] + 2), -1, dtype=torch.int32)
    big[:, : table.shape[1]] = table
    for cache in (ref, mine):
        fill_block_table(cache.blocks, big, positions + 2)
    for step in range(2):
        k, v = torch.randn(3, 2, 24, generator=gen), torch.randn(3, 2, 24, generator=gen)
        ref.append(0, big, positions + step, k, v)
        cpu_attention.paged_append(mine, 0, big, positions + step, k, v)
    for a, b in ((ref.k_pages, mine.k_pages), (ref.v_pages, mine.v_pages), (ref.centroids, mine.centroids)):
        assert torch.allclose(a[0], b[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("page_size", [16, 4])
def test_selection_is_the_method_layers(page_size: int) -> None:
    """The kernel's page choice (scores summed in its own order) equals select_pages_from_centroids on the
    same centroids for random queries (no two scores within rounding of each other), and exact ties go to
    the lower page index as there."""
    lengths = [300, 17, 160, 64, 1]
    cache, table = filled_cache(lengths, 2, 32, page_size, seed=21)
    seq_len = torch.tensor(lengths)
    gen = torch.Generator().manual_seed(8)
    for budget in ([64, 64, 64, 64, 64], [128, 16, 48, 1000, 64], [0, 0, 0, 0, 0]):
        budget = torch.tensor(budget)
        q = torch.randn(5, 4, 32, generator=gen)
        mine = cpu_attention.select_pages(q, cache, 0, table, seq_len, budget, 1, 2)
        cent = cache.gather_centroids(0, table, seq_len)
        assert torch.equal(mine, select_pages_from_centroids(q, cent, seq_len, budget, page_size, 1, 2))
    # equal scores (a zero query): lower page indices win, as in the method layer
    zero = torch.zeros(5, 4, 32)
    tie = cpu_attention.select_pages(zero, cache, 0, table, seq_len, torch.full((5,), 6 * page_size), 1, 2)
    cent = cache.gather_centroids(0, table, seq_len)
    expect = select_pages_from_centroids(
        zero, cent, seq_len, torch.full((5,), 6 * page_size), page_size, 1, 2
    )
    assert torch.equal(tie, expect)


@pytest.mark.parametrize("page_size,head_dim,group", [(16, 32, 2), (4, 24, 3)], ids=str)
def test_fused_sparse_step_is_select_then_attend(page_size: int, head_dim: int, group: int) -> None:
    """sparse_decode_attention (choice and attention in one pass) keeps the method layer's pages and returns
    what paged_decode_attention returns on them, bit for bit; a covering budget gives the dense result."""
    lengths = [300, 17, 160, 64, 1, 129]
    cache, table = filled_cache(lengths, 2, head_dim, page_size, seed=5)
    seq_len = torch.tensor(lengths)
    gen = torch.Generator().manual_seed(9)
    cent = cache.gather_centroids(0, table, seq_len)
    for budget in ([64, 64, 64, 64, 64, 64], [128, 16, 48, 1000, 64, 32], [0] * 6, [10_000] * 6):
        budget = torch.tensor(budget)
        q = torch.randn(len(lengths), 2 * group, head_dim, generator=gen)
        out, page_idx = cpu_attention.sparse_decode_attention(q, cache, 0, table, seq_len, budget, 1, 2)
        expect = select_pages_from_centroids(q, cent, seq_len, budget, page_size, 1, 2)
        assert torch.equal(page_idx[..., : expect.shape[-1]], expect)
        assert (page_idx[..., expect.shape[-1] :] == -1).all()
        assert torch.equal(out, cpu_attention.paged_decode_attention(q, cache, 0, table, seq_len, expect))
        assert (out - reference(q, cache, table, seq_len, expect)).abs().max() < 1e-5
    dense = cpu_attention.paged_decode_attention(q, cache, 0, table, seq_len, None)
    assert torch.equal(out, dense)  # the last budget covers every row
