"""Bad inputs raise ValueError naming the tensor and the expectation; available() reports the mode."""

from __future__ import annotations

import pytest
import sparrow_kernels
import torch
from kernel_cases import random_case
from sparrow_kernels import (
    append_kv,
    merge_splits,
    select_from_scores,
    select_pages_paged,
    sparse_decode_attention_paged,
    sparse_decode_paged,
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
    with pytest.raises(ValueError, match="centroids must be float32"):
        sparse_decode_attention_paged(case.q, c.k_pages, c.v_pages, c.centroids.half(), *args[3:])
    with pytest.raises(ValueError, match="block_table must be an integer"):
        select_pages_paged(case.q, c.centroids, c.block_table.float(), c.seq_len, 32)
    with pytest.raises(ValueError, match=r"seq_len must be an integer \[B\]=\[2\]"):
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
        sparse_decode_paged(case.q.half(), c.k_pages, c.v_pages, c.block_table, c.seq_len,
                            torch.zeros(2, 2, 1, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32))  # fmt: skip
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
    with pytest.raises(ValueError, match=r"lse_part must be float32 \[B, Hq, S\]"):
        merge_splits(
            torch.zeros(2, 4, 3, 32, device=device), torch.zeros(2, 4, 2, device=device), torch.float32
        )
    with pytest.raises(ValueError, match="scores must be float32"):
        select_from_scores(torch.zeros(2, 3, device=device), c.seq_len, case.budget)
