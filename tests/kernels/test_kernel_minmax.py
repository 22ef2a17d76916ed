"""``page_score="minmax"`` in the kernels: key bounds kept by ``append_kv``, scored by ``page_selection``,
used by the fused sparse decode, each against the method layer (``sparrow_nemo.sparse.attention``).

Selection must equal ``select_pages_from_key_bounds`` on the same bounds exactly (pages, order,
-1 padding, counts, physical ids); the bounds ``append_kv`` keeps must equal ``page_key_bounds`` of
the stored keys exactly (a min/max is exact in any dtype); the fused decode must match
``sparse_decode_attention(..., page_score="minmax")`` within the decode tests' tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import DecodeCase, empty_paged_cache, key_bound_pools, paged_from_contiguous, random_case
from kernel_cases import check_selection as check_selection_of
from sparrow_kernels import KeyBounds, append_kv, page_selection, sparse_decode_attention_paged

from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.paged_attention import KernelDecode, TorchDecode
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache, fill_block_table
from sparrow_nemo.sparse.attention import page_key_bounds, sparse_decode_attention

SEQ_LENS = [77, 160, 5, 123]  # a partial last page, exact pages, one page, and a longer one
BUDGETS = [48, 96, 16, 2048]  # below, at and above the length (3 reserved pages)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # as tests/kernels/test_kernel_decode.py


def check_selection(case: DecodeCase, budget: torch.Tensor | int, **kw: int) -> None:
    """kernel_cases.check_selection under the key-bound score."""
    check_selection_of(case, budget, page_score="minmax", **kw)


@pytest.mark.parametrize("group", [1, 5])  # 5: Qwen3-14B (40 q heads, 8 KV heads)
def test_selection_matches_key_bound_reference(device: torch.device, group: int) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=group, device=device, seed=group)
    check_selection(case, case.budget)
    check_selection(case, 64, sink_pages=2, local_pages=1)
    check_selection(case, 48, sink_pages=0, local_pages=0)


def test_bfloat16_bounds_match_reference_on_the_same_bounds(device: torch.device) -> None:
    """Bounds in the key dtype (bf16 keys: their min/max is exact in bf16), budgets as a tensor, an int,
    and int64 entries past int32 (clamped on the device)."""
    case = random_case([300, 250], [96, 48], num_kv_heads=2, group=4, dtype=torch.bfloat16, device=device,
                       seed=3, centroid_dtype=torch.bfloat16)  # fmt: skip
    check_selection(case, case.budget)
    check_selection(case, 128)
    check_selection(case, torch.tensor([2**33, 64], dtype=torch.int64, device=device))


def test_bound_score_differs_from_the_centroid_score(device: torch.device) -> None:
    """Not the centroid rule under another name: one page whose keys cancel in the mean but hold one
    key aligned with the query is kept by the bound and dropped by the centroid."""
    case = random_case([160], [64], num_kv_heads=1, group=1, device=device, seed=5)
    case.k[0, 0, 16:128] *= 0.01  # quiet middle pages: the spike page must stand out under both
    case.k[0, 0, 80] = 4 * case.q[0, 0]
    case.k[0, 0, 81] = -4 * case.q[0, 0]  # page 5's mean ignores the spike, its bounds do not
    case.paged = paged_from_contiguous(case.k, case.v, case.seq_len, seed=5)
    c = case.paged
    bounds = key_bound_pools(case)
    minmax = page_selection(case.q, bounds, c.block_table, c.seq_len, 64)
    centroid = page_selection(case.q, c.centroids, c.block_table, c.seq_len, 64)
    assert 5 in minmax.page_idx[0, 0].tolist() and 5 not in centroid.page_idx[0, 0].tolist()
    check_selection(case, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_keeps_page_key_bounds(device: torch.device, dtype: torch.dtype) -> None:
    """Token-by-token appends into a NaN-filled, shuffled pool (a fresh page's stale NaN bounds must not
    leak), sequences of mixed lengths (partial last pages, one stops early); then a rollback: the last
    tokens are rewritten with other keys and the bounds must be those of the keys now stored (the
    rejected keys, still in the slots past the rewrite, are not read). Bounds in the cache dtype."""
    lens = [40, 17, 33]
    batch, num_kv_heads, head_dim, max_len = len(lens), 2, 16, max(lens)
    gen = torch.Generator().manual_seed(11)
    k_src = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_src = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    cache = empty_paged_cache(batch, num_kv_heads, 3, head_dim, dtype, device, seed=4)
    bounds = KeyBounds(*(torch.full_like(cache.centroids, math.nan, dtype=dtype) for _ in range(2)))
    lengths = torch.tensor(lens, device=device)

    def append(t: int, keys: torch.Tensor, upto: torch.Tensor) -> None:
        positions = torch.where(upto > t, t, -1).to(torch.int32)
        append_kv(
            cache.k_pages, cache.v_pages, bounds, cache.block_table, positions, keys[:, :, t], v_src[:, :, t]
        )

    def check(keys: torch.Tensor) -> None:
        k_min, k_max = page_key_bounds(keys, lengths)
        for b, n in enumerate(lens):
            for p in range(math.ceil(n / 16)):
                phys = int(cache.block_table[b, p])
                assert bounds.key_min[phys].dtype == dtype
                assert torch.equal(bounds.key_min[phys].float(), k_min[b, :, p]), (b, p)
                assert torch.equal(bounds.key_max[phys].float(), k_max[b, :, p]), (b, p)
        assert bool(cache.centroids.isnan().all()), "the centroid pool is not an argument: untouched"

    for t in range(max_len):
        append(t, k_src, lengths)
    check(k_src)
    # Roll back 4 tokens (seq 1 by 3, into its first page's last slot) and decode different ones.
    redo = k_src.clone()
    redo[:, :, -8:] = torch.randn(batch, num_kv_heads, 8, head_dim, generator=gen).to(
        device=device, dtype=dtype
    )
    redo[1, :, 14:17] = (redo[1, :, 14:17] * 0.1).to(dtype)  # inside the old bounds: must shrink them
    starts = torch.tensor([36, 14, 29], device=device)
    for t in range(int(starts.min()), max_len):
        positions = torch.where((lengths > t) & (t >= starts), t, -1).to(torch.int32)
        append_kv(
            cache.k_pages, cache.v_pages, bounds, cache.block_table, positions, redo[:, :, t], v_src[:, :, t]
        )
    keys = torch.where(torch.arange(max_len, device=device)[None, None, :, None] >= starts[:, None, None, None],
                       redo, k_src)  # fmt: skip
    check(keys)


@pytest.mark.parametrize(
    ("dtype", "num_splits"), [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 2)]
)
def test_fused_sparse_decode_matches_method_layer(
    device: torch.device, dtype: torch.dtype, num_splits: int
) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=4, dtype=dtype, device=device, seed=num_splits,
                       centroid_dtype=dtype)  # fmt: skip
    c = case.paged
    out = sparse_decode_attention_paged(case.q, c.k_pages, c.v_pages, key_bound_pools(case, dtype), c.block_table,
                                        c.seq_len, case.budget, num_splits=num_splits)  # fmt: skip
    ref = sparse_decode_attention(case.q, case.k, case.v, case.seq_len, case.budget, page_score="minmax")
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=0, atol=TOL[dtype])


def test_bad_key_bounds_name_the_tensor(device: torch.device) -> None:
    case = random_case([40, 20], [32, 32], device=device)
    c = case.paged
    bounds = key_bound_pools(case)
    args = (c.block_table, c.seq_len, case.budget)
    with pytest.raises(ValueError, match=r"key_max must be float32/float16/bfloat16 \[num_pages, Hkv, D\]"):
        page_selection(case.q, KeyBounds(bounds.key_min, bounds.key_max[:, :1]), *args)
    with pytest.raises(ValueError, match="key_min and key_max must share one dtype"):
        page_selection(case.q, KeyBounds(bounds.key_min, bounds.key_max.half()), *args)
    with pytest.raises(
        ValueError, match=r"landmarks must be a centroid tensor or sparrow_kernels\.KeyBounds"
    ):
        page_selection(case.q, tuple(bounds), *args)
    with pytest.raises(ValueError, match="key_min must have stride 1"):
        page_selection(case.q, KeyBounds(bounds.key_min.transpose(1, 2).contiguous().transpose(1, 2),
                                         bounds.key_max), *args)  # fmt: skip
    k_new = torch.zeros(2, 2, 32, device=device)
    with pytest.raises(ValueError, match=r"key_min must be float32 \[num_pages, Hkv, D\]"):
        append_kv(c.k_pages, c.v_pages, KeyBounds(bounds.key_min.half(), bounds.key_max.half()), c.block_table,
                  c.seq_len, k_new, k_new)  # fmt: skip


def test_engine_kernel_path_equals_its_torch_path(device: torch.device) -> None:
    """The rollout engine's fused path (``KernelDecode``) on a minmax ``PagedKVCache``: token-by-token appends
    keep the same key bounds as the torch path's cache, and each step's sparse attention matches it."""
    lens, num_kv_heads, group, head_dim = [70, 61], 2, 4, 32
    batch, max_len = len(lens), max(lens)
    gen = torch.Generator().manual_seed(13)
    keys = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device)
    values = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=gen).to(device)
    caches = [
        PagedKVCache(1, 16, num_kv_heads, head_dim, page_score="minmax", device=device) for _ in range(2)
    ]
    block_table = torch.full((batch, 5), -1, dtype=torch.int32, device=device)
    fill_block_table(BlockManager(16, 16), block_table, torch.tensor(lens, device=device))  # both caches
    fused, plain = KernelDecode(), TorchDecode()
    lengths = torch.tensor(lens, device=device)
    steps = 0
    for t in range(max_len):
        live = lengths > t
        positions = torch.full((int(live.sum()),), t, dtype=torch.int64, device=device)
        for path, cache in zip((fused, plain), caches, strict=True):
            path.append(cache, 0, block_table[live], positions, keys[live, :, t], values[live, :, t])
        if t >= 47 and bool(live.all()):  # past three pages: the budget below drops some
            seq_len = torch.full((batch,), t + 1, dtype=torch.int64, device=device)
            q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(device)
            budget = torch.full((batch,), 48, dtype=torch.int64, device=device)
            out = fused.attend(q, caches[0], 0, block_table, seq_len, budget, 1, 1)
            ref = plain.attend(q, caches[1], 0, block_table, seq_len, budget, 1, 1)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
            steps += 1
    assert steps == lens[1] - 47  # 4 pages and more against a 3-page budget: real selections
    for got, want in zip(caches[0].landmarks(0), caches[1].landmarks(0), strict=True):
        assert torch.equal(got, want)
