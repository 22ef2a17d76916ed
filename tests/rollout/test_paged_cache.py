"""Paged KV cache: writes land where the block table says, centroids are page means, pages recycle."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.rollout.torch.block_manager import BlockManager, OutOfPages
from sparrow_nemo.rollout.torch.paged_attention import all_pages, causal_attention, decode_attention_torch
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache, fill_block_table, free_block_table
from sparrow_nemo.sparse.attention import (
    page_centroids,
    select_pages,
    select_pages_from_centroids,
    sparse_decode_attention,
)

HKV, D, PS = 2, 8, 4


def fill(cache: PagedKVCache, prompt_lens: list[int], steps: int, gen: torch.Generator):
    """Prefill prompts of different lengths, then append ``steps`` tokens to every sequence.

    Returns the block table, final lengths and the contiguous keys/values each sequence received.
    """
    b = len(prompt_lens)
    total = max(prompt_lens) + steps
    table = torch.full((b, -(-total // PS)), -1, dtype=torch.int32)
    keys = torch.randn(b, total, HKV, D, generator=gen)
    vals = torch.randn(b, total, HKV, D, generator=gen)
    lengths = torch.tensor(prompt_lens)
    blocks = BlockManager(cache.num_pages, cache.page_size)
    fill_block_table(blocks, table, lengths)
    t = max(prompt_lens)
    cache.write_prefill(0, table, keys[:, :t], vals[:, :t], lengths)
    for _ in range(steps):
        fill_block_table(blocks, table, lengths + 1)
        cache.append(0, table, lengths, keys[torch.arange(b), lengths], vals[torch.arange(b), lengths])
        lengths = lengths + 1
    return table, lengths, keys, vals


def contiguous_truth(keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] -> [B, H, max_len, D] with positions >= length zeroed."""
    out = keys[:, : int(lengths.max())].transpose(1, 2).clone()
    for b, n in enumerate(lengths.tolist()):
        out[b, :, n:] = 0
    return out


def test_prefill_and_append_store_tokens_and_page_means() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 40, HKV, D, page_size=PS)
    table, lengths, keys, vals = fill(cache, [9, 1, 4], steps=7, gen=gen)
    # the sequences grew in lock-step, so their pages interleave in the pool
    assert len(set(table[table >= 0].tolist())) == int((table >= 0).sum())
    assert table[0].tolist()[:3] == [0, 1, 2] and table[0, 3] > 3
    k, v = cache.contiguous(0, table, lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(k[b, :, :n], keys[b, :n].transpose(0, 1))
        assert torch.equal(v[b, :, :n], vals[b, :n].transpose(0, 1))
    cent = cache.gather_centroids(0, table, lengths)
    ref = page_centroids(contiguous_truth(keys, lengths), lengths, PS)
    assert torch.allclose(cent, ref, atol=1e-6)  # incremental mean vs batch mean: rounding only


def test_release_recycles_pages_and_exhaustion_is_an_error() -> None:
    cache = PagedKVCache(1, 4, HKV, D, page_size=PS)
    blocks = BlockManager(cache.num_pages, cache.page_size)
    table = torch.full((2, 3), -1, dtype=torch.int32)
    fill_block_table(blocks, table, torch.tensor([9, 4]))
    assert blocks.num_free == 0 and blocks.peak_used == 4
    with pytest.raises(OutOfPages, match="1 KV pages needed, 0 free of 4"):
        fill_block_table(blocks, table, torch.tensor([9, 5]))
    free_block_table(blocks, table[:1])
    assert blocks.num_free == 3 and bool((table[0] == -1).all())
    with pytest.raises(ValueError, match="start=2 must be a multiple of page_size=4"):
        cache.write_prefill(
            0, table, torch.zeros(2, 3, HKV, D), torch.zeros(2, 3, HKV, D), torch.tensor([5, 5]), start=2
        )
    with pytest.raises(ValueError, match="block table has 3 columns"):
        fill_block_table(blocks, table[:1], torch.tensor([17]))


@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_decode_attention_equals_method_layer_on_the_same_cache(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    cache = PagedKVCache(1, 64, HKV, D, page_size=PS)
    table, lengths, keys, vals = fill(cache, [30, 3, 17, 41], steps=6, gen=gen)
    q = torch.randn(4, HKV * group, D, generator=gen)
    kc, vc = contiguous_truth(keys, lengths), contiguous_truth(vals, lengths)
    for budget in ([16, 16, 24, 12], [4, 8, 64, 400], [0, 0, 0, 0]):
        budget = torch.tensor(budget)
        got = decode_attention_torch(q, cache, 0, table, lengths, budget)
        ref = sparse_decode_attention(q, kc, vc, lengths, budget, page_size=PS)
        assert (got - ref).abs().max() < 1e-5
        cent = cache.gather_centroids(0, table, lengths)
        assert torch.equal(
            select_pages_from_centroids(q, cent, lengths, budget, PS),
            select_pages(q, kc, lengths, budget, PS),
        )
    dense = decode_attention_torch(q, cache, 0, table, lengths, None)
    assert (dense - sparse_decode_attention(q, kc, vc, lengths, 10**6, page_size=PS)).abs().max() < 1e-5
    assert all_pages(lengths, HKV, PS).shape == (4, HKV, 12)


def test_causal_attention_chunks_match_one_call_on_valid_rows():
    """The whole-sequence call (SDPA is_causal) and a chunked prefill (later chunks masked) give each
    sequence of a right-padded batch the rows of a dense softmax over that sequence alone: padding,
    here large finite keys and values, never reaches a valid row, so no length mask is needed."""
    gen = torch.Generator().manual_seed(0)
    b, t, hq, hkv, d = 3, 40, 4, 2, 8
    q, k, v = (torch.randn(b, t, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    lengths = [40, 23, 9]
    for i, n in enumerate(lengths):
        k[i, n:], v[i, n:] = 1e3, 1e3
    whole = causal_attention(q, k, v)
    chunks = [
        causal_attention(q[:, s : s + 16], k[:, : s + 16], v[:, : s + 16], q_offset=s) for s in (0, 16, 32)
    ]
    for i, n in enumerate(lengths):
        kk, vv = k[i, :n].repeat_interleave(2, dim=1), v[i, :n].repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[i, :n], kk) / d**0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        torch.testing.assert_close(whole[i, :n], ref)
        torch.testing.assert_close(torch.cat(chunks, 1)[i, :n], ref)
