"""Test helpers: a paged KV cache built from a contiguous one (shuffled block table), random decode
cases, and the selection check against the method layer.

Physical pages are assigned in random order and the pool has spare pages, so a kernel that
ignores the block table or reads a page it should not is caught. Every cache slot that holds no
valid token (past seq_len, or in an unassigned page) is filled with NaN: touching one poisons the
result. Centroids come from the method layer's ``page_centroids`` (the specification), rounded to
the centroid dtype under test; key bounds (``page_score="minmax"``) from its ``page_key_bounds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sparrow_kernels import KeyBounds, page_selection

from sparrow_nemo.sparse.attention import (
    page_centroids,
    page_key_bounds,
    select_pages,
    select_pages_from_centroids,
    select_pages_from_key_bounds,
    selected_page_count,
)


@dataclass
class PagedCache:
    """k_pages, v_pages [num_pages, Hkv, page_size, D]; centroids [num_pages, Hkv, D] (float32 or the
    cache dtype); block_table int32 [B, P]; seq_len int32 [B]."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    centroids: torch.Tensor
    block_table: torch.Tensor
    seq_len: torch.Tensor


def empty_paged_cache(
    batch: int, num_kv_heads: int, max_pages: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    page_size: int = 16, spare_pages: int = 3, seed: int = 0, centroid_dtype: torch.dtype = torch.float32,
) -> PagedCache:  # fmt: skip
    """A NaN-filled pool of batch * max_pages + spare_pages pages and a random block table."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = batch * max_pages + spare_pages
    order = torch.randperm(num_pages, generator=gen)[: batch * max_pages]
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    return PagedCache(
        k_pages=torch.full(shape, math.nan, dtype=dtype, device=device),
        v_pages=torch.full(shape, math.nan, dtype=dtype, device=device),
        centroids=torch.full(
            (num_pages, num_kv_heads, head_dim), math.nan, dtype=centroid_dtype, device=device
        ),
        block_table=order.view(batch, max_pages).to(device=device, dtype=torch.int32),
        seq_len=torch.zeros(batch, dtype=torch.int32, device=device),
    )


def paged_from_contiguous(
    k: torch.Tensor, v: torch.Tensor, seq_len: torch.Tensor, page_size: int = 16, seed: int = 0,
    centroid_dtype: torch.dtype = torch.float32,
) -> PagedCache:  # fmt: skip
    """Copy the first seq_len[b] tokens of k, v [B, Hkv, L, D] into a shuffled paged cache; the
    centroids are the method layer's float32 page means rounded to ``centroid_dtype``."""
    batch, num_kv_heads, max_len, head_dim = k.shape
    max_pages = math.ceil(max_len / page_size)
    cache = empty_paged_cache(batch, num_kv_heads, max_pages, head_dim, k.dtype, k.device, page_size, seed=seed,
                              centroid_dtype=centroid_dtype)  # fmt: skip
    cache.seq_len = seq_len.to(device=k.device, dtype=torch.int32)
    centroids = page_centroids(k, seq_len, page_size).to(centroid_dtype)  # [B, Hkv, P, D]
    for b in range(batch):
        n = int(seq_len[b])
        for p in range(math.ceil(n / page_size)):
            phys = int(cache.block_table[b, p])
            lo, hi = p * page_size, min((p + 1) * page_size, n)
            cache.k_pages[phys, :, : hi - lo] = k[b, :, lo:hi]
            cache.v_pages[phys, :, : hi - lo] = v[b, :, lo:hi]
            cache.centroids[phys] = centroids[b, :, p]
    return cache


@dataclass
class DecodeCase:
    """One decode step on random data: q [B, Hq, D]; contiguous k, v [B, Hkv, L, D]; seq_len int32 [B];
    budget int32 [B] tokens; and the same cache in paged form."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_len: torch.Tensor
    budget: torch.Tensor
    paged: PagedCache


def random_case(
    seq_lens: list[int], budgets: list[int], num_kv_heads: int = 2, group: int = 2, head_dim: int = 32,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
    centroid_dtype: torch.dtype = torch.float32,
) -> DecodeCase:  # fmt: skip
    """Gaussian q, k, v (L = max(seq_lens)) and the paged copy of k, v."""
    gen = torch.Generator().manual_seed(seed)
    batch, max_len = len(seq_lens), max(seq_lens)
    k = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(device=device, dtype=dtype)
    seq_len = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    budget = torch.tensor(budgets, dtype=torch.int32, device=device)
    paged = paged_from_contiguous(k, v, seq_len, seed=seed, centroid_dtype=centroid_dtype)
    return DecodeCase(q, k, v, seq_len, budget, paged)


def key_bound_pools(case: DecodeCase, dtype: torch.dtype = torch.float32) -> KeyBounds:
    """The method layer's page_key_bounds of case.k in case.paged's physical pages (NaN in every page
    no sequence owns), in ``dtype``."""
    c = case.paged
    k_min, k_max = page_key_bounds(case.k, case.seq_len)  # [B, Hkv, P, D] float32
    shape = c.centroids.shape
    pools = KeyBounds(*(torch.full(shape, math.nan, dtype=dtype, device=c.k_pages.device) for _ in range(2)))
    for b in range(k_min.shape[0]):
        for p in range(math.ceil(int(case.seq_len[b]) / c.k_pages.shape[2])):
            phys = int(c.block_table[b, p])
            pools.key_min[phys] = k_min[b, :, p]
            pools.key_max[phys] = k_max[b, :, p]
    return pools


def check_selection(
    case: DecodeCase, budget: torch.Tensor | int, page_score: str = "centroid", **kw: int
) -> None:
    """page_selection on case.paged equals the method layer's select_pages_from_centroids on the
    contiguous cache's page means in the same centroid dtype (``page_score="minmax"``:
    select_pages_from_key_bounds on its page_key_bounds, the kernel reading them through the block
    table as KeyBounds) (same pages, order, -1 padding); its counts equal selected_page_count, its
    physical ids are the block table's, its tickets are 0."""
    c = case.paged
    if page_score == "minmax":
        landmarks = key_bound_pools(case, c.centroids.dtype)
        k_min, k_max = (t.to(c.centroids.dtype) for t in page_key_bounds(case.k, case.seq_len))
        ref = select_pages_from_key_bounds(case.q, k_min, k_max, case.seq_len, budget, **kw)
    else:
        landmarks = c.centroids
        centroids = page_centroids(case.k, case.seq_len).to(c.centroids.dtype)
        ref = select_pages_from_centroids(case.q, centroids, case.seq_len, budget, **kw)
    selection = page_selection(case.q, landmarks, c.block_table, c.seq_len, budget, **kw)
    page_idx, counts = selection.page_idx, selection.counts
    if c.centroids.dtype == torch.float32:  # and the specification from the keys themselves
        spec = select_pages(case.q, case.k, case.seq_len, budget, page_score=page_score, **kw)
        assert torch.equal(ref, spec)
    width = ref.shape[-1]
    assert page_idx.dtype == torch.int32 and page_idx.shape[:2] == ref.shape[:2]
    assert torch.equal(page_idx[..., :width].long().cpu(), ref.cpu())
    assert bool((page_idx[..., width:] == -1).all())
    expected_counts = selected_page_count(case.seq_len, budget, **kw)
    assert torch.equal(counts.long().cpu(), expected_counts[:, None].expand_as(counts).cpu())
    for b in range(counts.shape[0]):
        for h in range(counts.shape[1]):
            n = int(counts[b, h])
            assert torch.equal(selection.physical[b, h, :n], c.block_table[b, page_idx[b, h, :n].long()])
    assert bool((selection.tickets == 0).all())
