"""The compiled CPU verify attention (``cpu_attention.paged_verify_attention``) against the torch fallback.

Several query positions per row, causal among them, GQA groups, rows with different numbers of real queries,
scattered physical pages, and the kernel's partial blocks: query rows that fill 16 lanes exactly, or not (18, 15,
12, 13 rows per KV head), pages of 4, 8, 16 and 32 slots (a 32-slot page is two chunks of 16), head dims that are
a multiple of its 8-wide blocks or not (20). It never reads past a row's last real query: NaN there leaves every
real output unchanged.
"""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.rollout.torch import cpu_attention
from sparrow_nemo.rollout.torch.extend import TorchVerify, verify_attention_torch
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the CPU kernel")


@pytest.mark.parametrize(
    ("hkv", "group", "head_dim", "page_size", "t"),
    [
        (2, 2, 32, 16, 9),
        (2, 2, 32, 16, 8),
        (2, 3, 64, 16, 5),
        (1, 4, 24, 8, 3),
        (3, 1, 16, 4, 13),
        (2, 2, 20, 32, 8),
    ],
)
def test_cpu_verify_equals_the_torch_fallback(
    hkv: int, group: int, head_dim: int, page_size: int, t: int
) -> None:
    gen = torch.Generator().manual_seed(hkv * 100 + head_dim + t)
    batch, cols = 5, 24
    cache = PagedKVCache(1, batch * cols, hkv, head_dim, page_size)
    for pool in (cache.k_pages[0], cache.v_pages[0]):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    table = torch.randperm(batch * cols, generator=gen).to(torch.int32).view(batch, cols)  # scattered pages
    start = torch.randint(0, cols * page_size - t, (batch,), generator=gen)
    start[0] = 0  # a row whose first query sees only itself
    num_queries = torch.randint(1, t + 1, (batch,), generator=gen)
    num_queries[1] = t
    q = torch.randn(batch, t, hkv * group, head_dim, generator=gen)

    want = verify_attention_torch(q, cache, 0, table, start)
    got = cpu_attention.paged_verify_attention(q, cache, 0, table, start, num_queries)
    real = torch.arange(t)[None, :] < num_queries[:, None]
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-5)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))  # the queries past num_queries are zeros
    torch.testing.assert_close(
        TorchVerify().attend(q, cache, 0, table, start, num_queries), got, atol=0, rtol=0
    )

    # positions at or past start + num_queries are never read: NaN there changes nothing
    for pool in (cache.k_pages[0], cache.v_pages[0]):
        for b in range(batch):
            end = int(start[b] + num_queries[b])
            for pos in range(end, cols * page_size):
                pool[table[b, pos // page_size], :, pos % page_size] = float("nan")
    again = cpu_attention.paged_verify_attention(q, cache, 0, table, start, num_queries)
    assert torch.equal(again, got)
