"""The speculative verify kernel: causal dense attention of the T = k + 1 newest tokens per sequence.

Checked against an independent float64 loop (one query, one head, one softmax at a time) and
against the method layer's dense path (``sparse_decode_attention`` with a budget covering the
prefix each query may see), on a shuffled NaN-filled paged pool, for GQA groups 1/4/5, split or
not; T = 1 equals the dense decode kernel. Tolerances as in test_kernel_decode.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import random_case
from sparrow_kernels import decode_attention_paged, verify_attention_paged

from sparrow_nemo.sparse.attention import sparse_decode_attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SEQ_LENS = [77, 160, 9, 40]  # 9 = T: the first new token attends to itself only


def _loop_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """float64 attention, query by query: q [B, T, Hq, D], k/v [B, Hkv, L, D] -> [B, T, Hq, D]."""
    batch, num_q, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for i in range(num_q):
            visible = seq_lens[b] - num_q + i + 1
            for hq in range(num_q_heads):
                keys = k[b, hq // group, :visible].double()
                logits = keys @ q[b, i, hq].double() / math.sqrt(head_dim)
                out[b, i, hq] = torch.softmax(logits, dim=0) @ v[b, hq // group, :visible].double()
    return out


def _method_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
    """The method layer's dense decode of each query token over the prefix it may see."""
    num_q = q.shape[1]
    rows = [sparse_decode_attention(q[:, i], k, v, seq_len - num_q + i + 1, 10**9) for i in range(num_q)]
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize(("group", "dtype", "num_splits"), [(1, torch.float32, 1), (4, torch.bfloat16, 3),
                                                            (5, torch.float32, 2)])  # fmt: skip
def test_verify_matches_float64_loop_and_method_layer(
    device: torch.device, group: int, dtype: torch.dtype, num_splits: int
) -> None:
    num_q = 9  # k = 8 drafted tokens + 1
    case = random_case(SEQ_LENS, [0] * 4, num_kv_heads=2, group=group, dtype=dtype, device=device, seed=group)
    c = case.paged
    gen = torch.Generator().manual_seed(100 + group)
    q = torch.randn(len(SEQ_LENS), num_q, 2 * group, case.q.shape[-1], generator=gen).to(
        device=device, dtype=dtype
    )
    out = verify_attention_paged(q, c.k_pages, c.v_pages, c.block_table, c.seq_len, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    loop = _loop_reference(q.cpu(), case.k.cpu(), case.v.cpu(), SEQ_LENS)
    torch.testing.assert_close(out.double().cpu(), loop, rtol=0, atol=TOL[dtype])
    method = _method_layer(q, case.k, case.v, case.seq_len)
    torch.testing.assert_close(out.float().cpu(), method.float().cpu(), rtol=0, atol=TOL[dtype])


def test_one_query_token_is_dense_decode_and_idle_rows_give_zeros(device: torch.device) -> None:
    case = random_case(SEQ_LENS, [0] * 4, num_kv_heads=2, group=4, device=device, seed=21)
    c = case.paged
    seq_len = c.seq_len.clone()
    seq_len[2] = 0  # an idle row of a static batch
    out = verify_attention_paged(case.q[:, None], c.k_pages, c.v_pages, c.block_table, seq_len, num_splits=2)
    dense = decode_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table, seq_len, None, num_splits=1)
    torch.testing.assert_close(out[:, 0], dense, rtol=0, atol=1e-6)
    assert bool((out[2] == 0).all())
    with pytest.raises(ValueError, match=r"q must be \[B, T, Hq, D=32\]"):
        verify_attention_paged(case.q, c.k_pages, c.v_pages, c.block_table, seq_len)
