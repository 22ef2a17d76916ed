"""Page-landmark memory of the TensorRT-LLM engine: centroids equal the torch rollout engine's paged cache, key
bounds (page_score=minmax) the method layer's ``page_key_bounds``, the per-token budget counts them, and the
context-token mapping matches a packed prompt batch."""

from __future__ import annotations

import math

import pytest
import torch
from sparrow_kernels import KeyBounds

from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.trtllm.kv_cache import (
    LandmarkPool,
    centroid_bytes_per_token,
    context_token_positions,
)
from sparrow_nemo.sparse.attention import page_key_bounds

PS, HKV, D = 4, 2, 16


def test_context_token_positions_of_a_packed_batch() -> None:
    rows, positions = context_token_positions(torch.tensor([3, 1, 4], dtype=torch.int32), 8)
    assert rows.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    empty_rows, empty_pos = context_token_positions(torch.tensor([], dtype=torch.int32), 0)
    assert empty_rows.numel() == empty_pos.numel() == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_centroids_equal_the_torch_engines_paged_cache(kv_dtype: torch.dtype) -> None:
    """Prefill (packed, vectorised) then decode steps into a LandmarkPool and into the torch rollout engine's
    PagedKVCache (the torch rollout engine's) with the same shuffled blocks: the centroids must agree (fp32 reassociation tolerance)."""
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [9, 30, 17]
    steps = 12
    batch = len(prompt_lens)
    max_len = max(prompt_lens) + steps
    pages_per_seq = math.ceil(max_len / PS)
    num_blocks = batch * pages_per_seq + 3
    perm = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq]
    block_table = perm.view(batch, pages_per_seq).to(torch.int32)
    keys = torch.randn(batch, max_len, HKV, D, generator=gen)
    lengths = torch.tensor(prompt_lens)

    # LandmarkPool keeps float32 centroids: so does this reference cache
    ref = PagedKVCache(1, num_blocks, HKV, D, PS, dtype=kv_dtype, centroid_dtype=torch.float32)
    ref.write_prefill(0, block_table, keys[:, : max(prompt_lens)], keys[:, : max(prompt_lens)], lengths)
    pool = LandmarkPool(num_blocks, [2], HKV, D, PS, kv_dtype=kv_dtype)
    packed = torch.cat([keys[b, :n] for b, n in enumerate(prompt_lens)])
    rows, positions = context_token_positions(lengths.to(torch.int32), packed.shape[0])
    pool.write_prefill(2, packed, rows, positions, block_table)

    def compare(seq_len: torch.Tensor) -> None:
        n_pages = math.ceil(int(seq_len.max()) / PS)
        live = (torch.arange(n_pages)[None, :] * PS < seq_len[:, None])[:, None, :, None]
        got = pool.gather(2, block_table)[:, :, :n_pages] * live
        torch.testing.assert_close(got, ref.gather_centroids(0, block_table, seq_len), rtol=1e-5, atol=1e-6)

    compare(lengths)
    seq_len = lengths.clone()
    rows_all = torch.arange(batch)
    for _ in range(steps):
        k_new = keys[rows_all, seq_len]
        ref.append(0, block_table, seq_len, k_new, k_new)
        pool.append(2, k_new, block_table, seq_len)
        seq_len = seq_len + 1
        compare(seq_len)
    assert pool.nbytes == num_blocks * HKV * D * 4
    with pytest.raises(KeyError, match=r"layer 1 keeps no page landmarks; sparse layers: \[2\]"):
        pool.layer(1)


def test_a_reused_block_starts_afresh() -> None:
    """A block freed by a finished request and handed to another holds stale centroids: slot 0 resets it,
    as ``sparrow_kernels.append_kv`` does, and a prompt's pages are overwritten, not blended."""
    pool = LandmarkPool(2, [0], HKV, D, PS, kv_dtype=torch.float32)
    pool.layer(0).fill_(float("nan"))  # stale garbage must not leak into the new page
    table = torch.tensor([[1]], dtype=torch.int32)
    k = torch.randn(1, HKV, D)
    pool.append(0, k, table, torch.tensor([0]))
    assert torch.equal(pool.layer(0)[1], k[0]) and pool.layer(0)[0].isnan().all()
    prompt = torch.randn(3, HKV, D)
    pool.write_prefill(0, prompt, torch.zeros(3, dtype=torch.int64), torch.arange(3), table)
    torch.testing.assert_close(pool.layer(0)[1], prompt.mean(dim=0))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_key_bounds_equal_the_method_layers_page_key_bounds(kv_dtype: torch.dtype) -> None:
    """page_score=minmax: a packed prefill into shuffled, NaN-filled blocks (stale bounds of a reused block
    must not leak: the prefill overwrites, slot 0 of a decoded page resets), then decode steps; the bounds
    of every live page equal page_key_bounds of the keys as stored (rounded to the KV dtype), exactly."""
    gen = torch.Generator().manual_seed(3)
    prompt_lens = [9, 30, 16]  # partial, partial, exact: the third's first decoded token opens a page
    steps = 7
    batch, max_len = len(prompt_lens), max(prompt_lens) + steps
    pages_per_seq = math.ceil(max_len / PS)
    num_blocks = batch * pages_per_seq + 3
    block_table = (
        torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq].view(batch, -1).to(torch.int32)
    )
    keys = torch.randn(batch, max_len, HKV, D, generator=gen)
    pool = LandmarkPool(num_blocks, [1], HKV, D, PS, kv_dtype=kv_dtype, page_score="minmax")
    bounds = pool.layer(1)
    assert isinstance(bounds, KeyBounds) and bounds.key_min.dtype == torch.float32
    for t in bounds:
        t.fill_(float("nan"))
    lengths = torch.tensor(prompt_lens)
    packed = torch.cat([keys[b, :n] for b, n in enumerate(prompt_lens)])
    rows, positions = context_token_positions(lengths.to(torch.int32), packed.shape[0])
    pool.write_prefill(1, packed, rows, positions, block_table)

    def compare(seq_len: torch.Tensor) -> None:
        stored = keys.to(kv_dtype).float().transpose(1, 2)  # [B, Hkv, L, D]
        ref_min, ref_max = page_key_bounds(stored, seq_len, PS)
        got = pool.gather(1, block_table)
        for b, n in enumerate(seq_len.tolist()):
            pages = math.ceil(n / PS)
            assert torch.equal(got.key_min[b, :, :pages], ref_min[b, :, :pages]), b
            assert torch.equal(got.key_max[b, :, :pages], ref_max[b, :, :pages]), b

    compare(lengths)
    seq_len = lengths.clone()
    for _ in range(steps):
        pool.append(1, keys[torch.arange(batch), seq_len], block_table, seq_len)
        seq_len = seq_len + 1
        compare(seq_len)
    assert pool.nbytes == 2 * num_blocks * HKV * D * 4


def test_centroid_bytes_are_counted_per_token() -> None:
    """What the KV-cache manager adds per token to its budget: one fp32 [Hkv, D] per page per sparse layer.
    Qwen3-8B (36 layers, 2 dense, 8 KV heads, D=128, bf16 KV, 16-token pages): 34 * 8 * 128 * 4 / 16 =
    8,704 centroid bytes per token beside 36 * 2 * 8 * 128 * 2 = 147,456 bytes of K/V, so a budget holds
    5.6% fewer tokens than without centroids, and the pool sized from it fits the budget."""
    per_token = centroid_bytes_per_token(num_sparse_layers=34, num_kv_heads=8, head_dim=128, page_size=16)
    kv_per_token = 36 * 2 * 8 * 128 * 2
    assert per_token == 34 * 8 * 128 * 4 / 16 == 8704
    assert 0.05 < per_token / (kv_per_token + per_token) < 0.06
    # the pool a budget of B bytes buys: blocks * (KV + centroid bytes of a block) <= B
    budget = 10 * 2**30
    tokens = budget // (kv_per_token + per_token)
    blocks = tokens // 16
    pool_bytes = blocks * 34 * 8 * 128 * 4
    assert blocks * 16 * kv_per_token + pool_bytes <= budget
    assert centroid_bytes_per_token(0, 8, 128, 16) == 0  # only dense layers: nothing to count
    # minmax keeps key_min and key_max: twice the bytes
    minmax = centroid_bytes_per_token(34, 8, 128, 16, page_score="minmax")
    assert minmax == 2 * per_token and 0.10 < minmax / (kv_per_token + minmax) < 0.11
    with pytest.raises(ValueError, match="page_score must be one of"):
        centroid_bytes_per_token(34, 8, 128, 16, page_score="mean")
    with pytest.raises(ValueError, match="page_size >= 1"):
        centroid_bytes_per_token(1, 8, 128, 0)
