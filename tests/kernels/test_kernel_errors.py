"""Bad inputs raise ValueError naming the tensor and the expectation; available() reports the mode."""

from __future__ import annotations

import pytest
import sparrow_kernels
import torch
from kernel_cases import random_case
from sparrow_kernels import (
    append_kv,
    decode_attention_paged,
    page_selection,
    select_pages_paged,
    sparse_decode_attention_paged,
    verify_attention_paged,
)


def test_available_matches_the_import_mode() -> None:
    assert sparrow_kernels.available("cpu") == sparrow_kernels.INTERPRETED
    assert sparrow_kernels.available("meta") is False
    if torch.cuda.is_available():
        assert sparrow_kernels.available("cuda") == (not sparrow_kernels.INTERPRETED)


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = sparrow_kernels.nope


def test_bad_inputs_name_the_tensor(device: torch.device) -> None:
    case = random_case([40, 20], [32, 32], device=device)
    c = case.paged
    args = (c.k_pages, c.v_pages, c.centroids, c.block_table, c.seq_len, case.budget)
    with pytest.raises(ValueError, match="q heads Hq=3 must be a multiple of KV heads Hkv=2"):
        sparse_decode_attention_paged(case.q[:, :3], *args)
    with pytest.raises(ValueError, match="v_pages shape"):
        sparse_decode_attention_paged(case.q, c.k_pages, c.v_pages[:, :1], *args[2:])
    with pytest.raises(ValueError, match=r"centroids must be float32/float16/bfloat16 \[num_pages, Hkv, D\]"):
        sparse_decode_attention_paged(case.q, c.k_pages, c.v_pages, c.centroids.double(), *args[3:])
    with pytest.raises(ValueError, match=r"centroids must be float32 \[num_pages, Hkv, D\]"):  # fp32 cache
        append_kv(
            c.k_pages, c.v_pages, c.centroids.half(), c.block_table, c.seq_len, case.q[:, :2], case.q[:, :2]
        )
    with pytest.raises(ValueError, match=r"block_table must be an int32/int64 \[B, max_pages_per_seq\]"):
        select_pages_paged(case.q, c.centroids, c.block_table.float(), c.seq_len, 32)
    with pytest.raises(ValueError, match=r"seq_len must be an int32/int64 \[B\]=\[2\]"):
        select_pages_paged(case.q, c.centroids, c.block_table, c.seq_len[:1], 32)
    with pytest.raises(ValueError, match="budget_tokens must be >= 0"):
        select_pages_paged(case.q, c.centroids, c.block_table, c.seq_len, -16)
    with pytest.raises(ValueError, match="page_size=8 does not match"):
        sparse_decode_attention_paged(case.q, *args, page_size=8)
    with pytest.raises(ValueError, match="head dim D must be a power of two"):
        sparse_decode_attention_paged(
            case.q[..., :24], c.k_pages[..., :24], c.v_pages[..., :24], c.centroids[..., :24], *args[3:]
        )
    with pytest.raises(ValueError, match=r"q dtype torch\.float16 must equal the cache dtype"):
        decode_attention_paged(case.q.half(), c.k_pages, c.v_pages, c.block_table, c.seq_len)
    with pytest.raises(ValueError, match=r"block_table must be an int32/int64"):
        decode_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table.short(), c.seq_len)
    with pytest.raises(ValueError, match="k_new must be a float"):
        append_kv(c.k_pages, c.v_pages, c.centroids, c.block_table, c.seq_len, case.q, case.q[:, :2])
    with pytest.raises(ValueError, match="centroids is on cpu but the other tensors are on meta"):
        select_pages_paged(case.q.to("meta"), c.centroids, c.block_table, c.seq_len, 32)


def test_strided_and_stage_inputs_are_checked(device: torch.device) -> None:
    case = random_case([40, 20], [32, 32], device=device)
    c = case.paged
    strided_seq = torch.stack([c.seq_len, c.seq_len], dim=1)[:, 0]  # stride 2
    with pytest.raises(ValueError, match="seq_len must have stride 1 in its last dimension"):
        select_pages_paged(case.q, c.centroids, c.block_table, strided_seq, 32)
    selection = page_selection(case.q, c.centroids, c.block_table, c.seq_len, 32)
    with pytest.raises(ValueError, match=r"selection.counts must be a contiguous int32 \[B, Hkv\]"):
        decode_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table, c.seq_len,
                               selection._replace(counts=selection.counts.long()))  # fmt: skip
    with pytest.raises(ValueError, match="a page selection serves one query token per sequence, got T=2"):
        from sparrow_kernels.decode import paged_attention

        paged_attention(case.q[:, None].expand(-1, 2, -1, -1), c.k_pages, c.v_pages, c.block_table, c.seq_len,
                        selection)  # fmt: skip
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        verify_attention_paged(case.q[:, None], c.k_pages, c.v_pages, c.block_table, c.seq_len, num_stages=0)
