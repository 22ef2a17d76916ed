"""append_kv: token-by-token writes into a shuffled, NaN-filled page pool.

After appending, every valid slot must hold the token, untouched slots must still be NaN, and
each live page's centroid must equal the method layer's ``page_centroids`` of the stored keys
rounded to the centroid dtype (float32: within 1e-5, a reordered sum; bfloat16: within one ulp,
the same float32 mean rounded to nearest on both sides) and the rollout cache's torch append.
Then the cache built this way must give the reference's sparse attention (the engine's use).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import empty_paged_cache
from sparrow_kernels import append_kv, sparse_decode_attention_paged

from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.sparse.attention import page_centroids, sparse_decode_attention

SEQ_LENS = [40, 17, 33]  # mixed lengths: partial last pages, one sequence stops early


def _gather(pages: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Tokens [0, n) of sequence b as [Hkv, n, D]."""
    page_size = pages.shape[2]
    rows = [pages[int(block_table[b, t // page_size]), :, t % page_size] for t in range(n)]
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_then_attend(device: torch.device, dtype: torch.dtype) -> None:
    """Centroids in the cache dtype (the engine's layout): float32 for float32, bfloat16 for bfloat16."""
    batch, num_kv_heads, head_dim, max_len = len(SEQ_LENS), 2, 32, max(SEQ_LENS)
    gen = torch.Generator().manual_seed(1)
    # New keys/values arrive in the cache dtype, as the engine computes them (Triton's interpreter
    # truncates float32 -> bfloat16 where the GPU rounds to nearest, so rounding is not tested here).
    k_src = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_src = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    cache = empty_paged_cache(batch, num_kv_heads, 3, head_dim, dtype, device, seed=2, centroid_dtype=dtype)
    torch_cache = PagedKVCache(1, cache.k_pages.shape[0], num_kv_heads, head_dim, dtype=dtype, device=device)
    lengths = torch.tensor(SEQ_LENS, device=device)
    for t in range(max_len):
        positions = torch.where(lengths > t, t, -1).to(torch.int32)  # -1: this sequence is done
        append_kv(cache.k_pages, cache.v_pages, cache.centroids, cache.block_table, positions,
                  k_src[:, :, t], v_src[:, :, t])  # fmt: skip
        live = lengths > t
        torch_cache.append(0, cache.block_table[live], positions[live], k_src[live, :, t], v_src[live, :, t])

    stored_centroids = page_centroids(k_src, lengths).to(dtype)  # [B, Hkv, P, D]
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    for b, n in enumerate(SEQ_LENS):
        assert torch.equal(_gather(cache.k_pages, cache.block_table, b, n), k_src[b, :, :n])
        assert torch.equal(_gather(cache.v_pages, cache.block_table, b, n), v_src[b, :, :n])
        last = cache.k_pages[int(cache.block_table[b, (n - 1) // 16]), :, (n - 1) % 16 + 1 :]
        assert bool(last.isnan().all()), "slots past seq_len must stay untouched"
        for p in range((n + 15) // 16):
            phys = int(cache.block_table[b, p])
            assert cache.centroids[phys].dtype == dtype
            torch.testing.assert_close(cache.centroids[phys], stored_centroids[b, :, p], rtol=ulp, atol=1e-5)
            torch.testing.assert_close(
                cache.centroids[phys], torch_cache.centroids[0][phys], rtol=ulp, atol=1e-5
            )

    q = torch.randn(batch, num_kv_heads * 4, head_dim, generator=gen).to(device=device, dtype=dtype)
    seq_len = lengths.to(torch.int32)
    budget = torch.tensor([32, 16, 48], dtype=torch.int32, device=device)
    out = sparse_decode_attention_paged(
        q, cache.k_pages, cache.v_pages, cache.centroids, cache.block_table, seq_len, budget
    )
    ref = sparse_decode_attention(q, k_src, v_src, seq_len, budget)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


def test_slot_zero_restarts_a_reused_page(device: torch.device) -> None:
    """A recycled page keeps a stale centroid; the first token written resets it to that key."""
    cache = empty_paged_cache(1, 2, 1, 16, torch.float32, device)
    phys = int(cache.block_table[0, 0])
    cache.centroids[phys] = 123.0
    k_new = torch.randn(1, 2, 16, device=device)
    append_kv(cache.k_pages, cache.v_pages, cache.centroids, cache.block_table,
              torch.zeros(1, dtype=torch.int32, device=device), k_new, torch.zeros_like(k_new))  # fmt: skip
    torch.testing.assert_close(cache.centroids[phys], k_new[0], rtol=0, atol=0)
