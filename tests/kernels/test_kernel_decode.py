"""Decode attention kernel (selection + split-K attention with the merge fused) against the method
layer and against dense torch SDPA.

Tolerances (max abs error on outputs of magnitude ~1): float32 1e-5 (reordered float32 sums);
float16 2e-3 and bfloat16 2e-2: the kernel rounds the softmax probabilities to the cache dtype
for the P.V product (as flash attention does) and the output to q.dtype, the reference keeps
float32 until the final cast; 2e-2 is about two bfloat16 ulps at 1.0.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import random_case
from sparrow_kernels import (
    PageSelection,
    decode_attention_paged,
    page_selection,
    sparse_decode_attention_paged,
    sparse_decode_paged,
)

from sparrow_nemo.sparse.attention import (
    decode_attention,
    page_centroids,
    select_pages_from_centroids,
    selected_token_mask,
    sparse_decode_attention,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SEQ_LENS = [77, 160, 5, 123]
BUDGETS = [48, 96, 16, 2048]


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=0, atol=tol)


@pytest.mark.parametrize(("group", "num_splits"), [(1, 1), (4, 3), (5, 1), (8, 2)])  # 5: Qwen3-14B
def test_sparse_attention_matches_reference(device: torch.device, group: int, num_splits: int) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=group, device=device, seed=group)
    c = case.paged
    out = sparse_decode_attention_paged(
        case.q,
        c.k_pages,
        c.v_pages,
        c.centroids,
        c.block_table,
        c.seq_len,
        case.budget,
        num_splits=num_splits,
    )
    ref = sparse_decode_attention(case.q, case.k, case.v, case.seq_len, case.budget)
    _assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_attention_half_precision(device: torch.device, dtype: torch.dtype) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=4, dtype=dtype, device=device, seed=5)
    c = case.paged
    out = sparse_decode_attention_paged(
        case.q, c.k_pages, c.v_pages, c.centroids, c.block_table, c.seq_len, case.budget, num_splits=2
    )
    _assert_close(out, sparse_decode_attention(case.q, case.k, case.v, case.seq_len, case.budget))


def test_head_dim_128(device: torch.device) -> None:
    case = random_case([150, 61], [64, 48], num_kv_heads=2, group=4, head_dim=128, device=device, seed=9)
    c = case.paged
    out = sparse_decode_attention_paged(
        case.q, c.k_pages, c.v_pages, c.centroids, c.block_table, c.seq_len, case.budget
    )
    _assert_close(out, sparse_decode_attention(case.q, case.k, case.v, case.seq_len, case.budget))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_budget_covering_the_sequence_equals_dense_sdpa(device: torch.device, dtype: torch.dtype) -> None:
    """With budget >= length the sparse kernel is dense attention: compare with torch SDPA over
    each sequence's first seq_len tokens (an implementation independent of the method layer)."""
    seq_lens = [77, 160, 5]
    case = random_case(seq_lens, [2**30] * 3, num_kv_heads=2, group=4, dtype=dtype, device=device, seed=2)
    c = case.paged
    out = sparse_decode_attention_paged(
        case.q, c.k_pages, c.v_pages, c.centroids, c.block_table, c.seq_len, 2**40, num_splits=2
    )
    for b, n in enumerate(seq_lens):
        q = case.q[b, :, None].float()  # [Hq, 1, D]
        k = case.k[b, :, :n].float().repeat_interleave(4, dim=0)  # [Hq, n, D]
        v = case.v[b, :, :n].float().repeat_interleave(4, dim=0)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, 0].to(dtype)
        _assert_close(out[b], dense)


def _hand_selection(lists: list[list[list[int]]], block_table: torch.Tensor, width: int) -> PageSelection:
    """A PageSelection built by hand from logical page lists [B][Hkv][pages] (ascending)."""
    batch, heads = len(lists), len(lists[0])
    page_idx = torch.full((batch, heads, width), -1, dtype=torch.int32)
    for b, row in enumerate(lists):
        for h, pages in enumerate(row):
            page_idx[b, h, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    page_idx = page_idx.to(block_table.device)
    physical = torch.gather(block_table, 1, page_idx.clamp(min=0).flatten(1)).view_as(page_idx).contiguous()
    counts = torch.tensor(
        [[len(p) for p in row] for row in lists], dtype=torch.int32, device=block_table.device
    )
    return PageSelection(page_idx, counts, physical, torch.zeros_like(counts))


def test_attention_on_given_pages(device: torch.device) -> None:
    """decode_attention_paged on arbitrary sorted page lists (not from the selector), any count per
    head, the partial last page listed or not, a custom scale; equals masked attention of the
    reference over the same pages."""
    case = random_case([150, 99], [0, 0], num_kv_heads=2, group=2, device=device, seed=4)
    c = case.paged
    lists = [[[0, 3, 4, 9], [2, 5]], [[6], [0, 1, 2, 3, 4, 5, 6]]]  # 150 tokens: page 9 is partial
    selection = _hand_selection(lists, c.block_table, 7)
    scale = 0.3
    for splits in (1, 2):
        out = decode_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table, c.seq_len, selection, scale,
                                     num_splits=splits)  # fmt: skip
        mask = selected_token_mask(selection.page_idx.long(), case.seq_len, case.k.shape[2])
        # decode_attention uses 1/sqrt(D): fold the custom scale into q.
        ref = decode_attention(case.q * (scale * math.sqrt(case.q.shape[-1])), case.k, case.v, mask)
        _assert_close(out, ref)
    # The same lists given as logical pages (the adapter translates them through the block table).
    logical = sparse_decode_paged(case.q, c.k_pages, c.v_pages, c.block_table, c.seq_len, selection.page_idx.long(),
                                  selection.counts, scale, num_splits=2)  # fmt: skip
    torch.testing.assert_close(logical, out, rtol=0, atol=1e-6)


def test_split_count_does_not_change_the_result(device: torch.device) -> None:
    """1 to 13 splits (more splits than pages: empty splits weigh 0) give the same output; the fused
    merge resets the tickets, so the same selection serves repeated calls."""
    case = random_case([200, 131, 64], [112, 80, 48], num_kv_heads=2, group=4, device=device, seed=8)
    c = case.paged
    selection = page_selection(case.q, c.centroids, c.block_table, c.seq_len, case.budget)
    outs = []
    for splits in (1, 2, 5, 13, 5):
        outs.append(decode_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table, c.seq_len, selection,
                                           num_splits=splits))  # fmt: skip
        assert bool((selection.tickets == 0).all()), f"tickets not reset after {splits} splits"
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=1e-6)
    assert not bool(torch.isnan(outs[3]).any())
    _assert_close(outs[3], sparse_decode_attention(case.q, case.k, case.v, case.seq_len, case.budget))


def test_dense_attention_without_selection(device: torch.device) -> None:
    """selection=None reads every page straight from the block table (no selection launch), split
    or not, and equals the reference with a budget covering every sequence."""
    case = random_case(
        SEQ_LENS, BUDGETS, num_kv_heads=2, group=4, dtype=torch.bfloat16, device=device, seed=13
    )
    c = case.paged
    ref = sparse_decode_attention(case.q, case.k, case.v, case.seq_len, 10**6)
    for splits in (1, 3):
        out = decode_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table, c.seq_len, None,
                                     num_splits=splits)  # fmt: skip
        _assert_close(out, ref)


@pytest.mark.parametrize("centroid_dtype", [torch.bfloat16])
def test_end_to_end_with_cache_dtype_centroids(device: torch.device, centroid_dtype: torch.dtype) -> None:
    """bf16 cache and bf16 centroids (the engine's layout): equals the method layer run on those
    centroids' selection, i.e. sparse attention over the pages the bf16 centroids choose."""
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=4, dtype=torch.bfloat16, device=device,
                       seed=14, centroid_dtype=centroid_dtype)  # fmt: skip
    c = case.paged
    out = sparse_decode_attention_paged(case.q, c.k_pages, c.v_pages, c.centroids, c.block_table, c.seq_len,
                                        case.budget)  # fmt: skip
    centroids = page_centroids(case.k, case.seq_len).to(centroid_dtype)
    pages = select_pages_from_centroids(case.q, centroids, case.seq_len, case.budget)
    mask = selected_token_mask(pages, case.seq_len, case.k.shape[2])
    _assert_close(out, decode_attention(case.q, case.k, case.v, mask))


def test_empty_rows_give_zeros(device: torch.device) -> None:
    """A row with seq_len 0 (an idle slot in a static batch) keeps no page and returns zeros, without
    disturbing the other rows (the reference needs seq_len >= 1, so it checks the live rows only)."""
    case = random_case([70, 33], [32, 32], num_kv_heads=2, group=2, device=device, seed=6)
    c = case.paged
    seq_len = torch.tensor([70, 0], dtype=torch.int32, device=device)
    out = sparse_decode_attention_paged(case.q, c.k_pages, c.v_pages, c.centroids, c.block_table, seq_len, 32,
                                        num_splits=2)  # fmt: skip
    assert bool((out[1] == 0).all())
    ref = sparse_decode_attention(case.q[:1], case.k[:1], case.v[:1], seq_len[:1], 32)
    _assert_close(out[:1], ref)
