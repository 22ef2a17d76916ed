"""The "sparrow" TensorRT-LLM algorithm's torch side: config translation, centroid pool, page prediction.

The prediction the TensorRT-LLM attention subclass makes must equal the reference engine's selection
(``select_pages_from_centroids`` on ``PagedKVCache`` centroids) and the method layer's specification
(``select_pages`` on the contiguous keys) for the same cache contents.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparrow_nemo.config import load_config
from sparrow_nemo.rollout.paged_cache import PagedKVCache
from sparrow_nemo.rollout.trtllm_sparse import (
    ALGORITHM,
    CentroidPool,
    SparrowSparseSpec,
    flatten_page_indices,
    predict_pages,
    split_fused_qkv,
    unflatten_page_indices,
)
from sparrow_nemo.sparse.attention import select_pages, select_pages_from_centroids
from sparrow_nemo.sparse.schedule import BudgetSchedule

PS, HKV, HQ, D = 4, 2, 4, 16


def _spec(budgets: tuple[int, ...] = (16, 24), bin_tokens: int = 20) -> SparrowSparseSpec:
    return SparrowSparseSpec(
        BudgetSchedule(bin_tokens=bin_tokens, budgets=budgets, page_size=PS, name="t"), dense_layers=1
    )


def test_config_dict_round_trip_and_recipe() -> None:
    spec = SparrowSparseSpec(BudgetSchedule.from_preset("qwen3-1.7b-0.86"))
    data = spec.to_config_dict()
    assert data["algorithm"] == ALGORITHM == "sparrow"
    assert data["page_size"] == 16 and data["sink_pages"] == 1 and data["local_pages"] == 2
    assert data["dense_layers"] == 2 and data["bin_tokens"] == 2000
    assert data["budgets"][0] == (29 + 3) * 16 and data["budgets"][-1] == (253 + 3) * 16
    assert SparrowSparseSpec.from_config_dict(data) == spec
    dense = SparrowSparseSpec(BudgetSchedule.dense())
    assert dense.to_config_dict()["budgets"] == ["dense"]
    assert SparrowSparseSpec.from_config_dict(dense.to_config_dict()) == dense
    assert not dense.is_sparse_layer(5) and spec.is_sparse_layer(2) and not spec.is_sparse_layer(1)

    config = load_config(None, ["sparsity.dense_layers=1", "sparsity.sink_pages=0"])
    from_recipe = SparrowSparseSpec.from_recipe(config)
    assert (from_recipe.dense_layers, from_recipe.local_pages, from_recipe.sink_pages) == (1, 2, 0)
    assert from_recipe.schedule == config.sparsity.build_schedule()


def test_config_dict_errors_name_the_key() -> None:
    good = _spec().to_config_dict()
    with pytest.raises(ValueError, match="algorithm must be 'sparrow'"):
        SparrowSparseSpec.from_config_dict({**good, "algorithm": "rocket"})
    with pytest.raises(ValueError, match="unknown keys \\['topk'\\]"):
        SparrowSparseSpec.from_config_dict({**good, "topk": 4})
    with pytest.raises(ValueError, match="missing keys \\['budgets'\\]"):
        SparrowSparseSpec.from_config_dict({k: v for k, v in good.items() if k != "budgets"})
    with pytest.raises(ValueError, match="multiple of page_size"):
        SparrowSparseSpec.from_config_dict({**good, "budgets": [17]})
    with pytest.raises(ValueError, match="page_size=16"):
        _spec().with_schedule(BudgetSchedule.from_preset("fixed:64"))


def _run_both(kv_dtype: torch.dtype, use_kernel: bool) -> None:
    """Prefill + decode steps into the reference PagedKVCache and a CentroidPool; compare selections."""
    gen = torch.Generator().manual_seed(0)
    spec = _spec()
    prompt_lens = [9, 30, 17]
    steps = 12
    batch = len(prompt_lens)
    max_len = max(prompt_lens) + steps
    pages_per_seq = math.ceil(max_len / PS)
    num_blocks = batch * pages_per_seq + 3
    # physical blocks shuffled, as a KV cache manager hands them out
    perm = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq]
    block_table = perm.view(batch, pages_per_seq).to(torch.int32)

    # CentroidPool keeps float32 centroids: so does this reference cache
    ref = PagedKVCache(1, num_blocks, HKV, D, PS, dtype=kv_dtype, centroid_dtype=torch.float32)
    pool = CentroidPool(num_blocks, HKV, D, PS, kv_dtype=kv_dtype)
    keys = torch.randn(batch, max_len, HKV, D, generator=gen)
    lengths = torch.tensor(prompt_lens)
    ref.write_prefill(0, block_table, keys[:, : max(prompt_lens)], keys[:, : max(prompt_lens)], lengths)
    for b, n in enumerate(prompt_lens):
        pool.write_prefill(0, keys[b, :n], block_table[b])

    seq_len = lengths.clone()
    for _ in range(steps):
        ref.append(
            0, block_table, seq_len, keys[torch.arange(batch), seq_len], keys[torch.arange(batch), seq_len]
        )
        pool.append(0, keys[torch.arange(batch), seq_len], block_table, seq_len)
        seq_len = seq_len + 1
        q = torch.randn(batch, HQ, D, generator=gen)
        got = predict_pages(q, pool, 0, block_table, seq_len, spec, use_kernel=use_kernel)
        budgets = spec.schedule.budgets_for(seq_len)
        reference = select_pages_from_centroids(
            q, ref.gather_centroids(0, block_table, seq_len), seq_len, budgets, PS, 1, 2
        )
        assert torch.equal(got, reference)
        contiguous = keys[:, : int(seq_len.max())].to(kv_dtype).transpose(1, 2)  # [B, Hkv, L, D]
        assert torch.equal(got, select_pages(q, contiguous, seq_len, budgets, PS, 1, 2))
        # the pool's centroids are the reference cache's (stored-dtype keys, fp32 means), tolerance fp32
        torch.testing.assert_close(
            pool.gather(0, block_table, seq_len),
            ref.gather_centroids(0, block_table, seq_len),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_prediction_equals_reference_engine_selection(kv_dtype: torch.dtype) -> None:
    _run_both(kv_dtype, use_kernel=False)


def test_kernel_prediction_equals_reference_engine_selection() -> None:
    sparrow_kernels = pytest.importorskip("sparrow_kernels")
    if not sparrow_kernels.available(torch.device("cpu")):
        pytest.skip("sparrow_kernels cannot run on CPU here (needs TRITON_INTERPRET=1)")
    _run_both(torch.float32, use_kernel=True)


def test_flatten_layout_and_round_trip() -> None:
    page_idx = torch.tensor(
        [
            [[0, 2, 5], [0, 3, 5]],
            [[0, -1, -1], [1, -1, -1]],
            [[0, 1, 4], [2, 3, 4]],
        ]
    )
    indices, offsets = flatten_page_indices(page_idx)
    assert offsets.tolist() == [0, 3, 4, 7] and offsets.dtype == torch.int32
    assert indices.tolist() == [[0, 2, 5, 0, 0, 1, 4], [0, 3, 5, 1, 2, 3, 4]]
    assert torch.equal(unflatten_page_indices(indices, offsets), page_idx)
    with pytest.raises(ValueError, match="different numbers of pages"):
        flatten_page_indices(torch.tensor([[[0, 1], [0, -1]]]))


def test_split_fused_qkv() -> None:
    q = torch.randn(3, HQ, D)
    k = torch.randn(3, HKV, D)
    v = torch.randn(3, HKV, D)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q2, k2 = split_fused_qkv(fused, HQ, HKV, D)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    with pytest.raises(ValueError, match="fused qkv must be"):
        split_fused_qkv(fused[:, :-1], HQ, HKV, D)


def test_pool_input_errors() -> None:
    pool = CentroidPool(4, HKV, D, PS)
    with pytest.raises(ValueError, match="keys are"):
        pool.write_prefill(0, torch.randn(5, HKV + 1, D), torch.arange(2))
    with pytest.raises(ValueError, match="2 block ids for 3 pages"):
        pool.write_prefill(0, torch.randn(9, HKV, D), torch.arange(2))
    with pytest.raises(ValueError, match="must be > 0"):
        CentroidPool(0, HKV, D, PS)
