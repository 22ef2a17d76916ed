"""Page scoring and top-k page selection over the paged cache (the first stage of sparse decode).

Stage 1, ``page_scores_paged`` (Triton): for each (sequence, KV head) the mean of the GQA group's
queries dotted with the centroid of every logical page, read through the block table.
Stage 2, ``select_from_scores`` (Triton): per (sequence, KV head), keep every page when the budget
covers the sequence; otherwise the sink pages, the local pages and the top-k middle pages, written
as ascending logical page indices. Top-k needs no sort: a 32-step binary search over the
order-preserving integer image of the float32 scores finds the k-th largest score, equal scores are
broken towards the lower page index with a prefix count, and a prefix sum over the kept-page mask
gives each kept page its output slot. This reproduces ``sparrow_nemo.sparse.attention.select_pages``
(stable descending sort) exactly, ties included, on the same scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow_kernels import _checks
from sparrow_kernels._runtime import next_pow2

#: Logical pages scored by one program of the scoring kernel.
_SCORE_BLOCK_PAGES = 64


@triton.jit
def _page_scores_kernel(
    q, centroids, block_table, seq_len, scores,
    stride_qb, stride_qh, stride_cp, stride_ch, stride_bt, stride_sb, stride_sh,
    num_kv_heads, max_pages,
    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Program (b * Hkv + h, page block): scores[b, h, p] = mean_g(q[b, h*G+g]) . centroid(p), fp32."""
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    n_pages = (tl.load(seq_len + b) + PAGE - 1) // PAGE
    g = tl.arange(0, GROUP_POW2)
    d = tl.arange(0, D)
    q_ptrs = q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
    q_group = tl.load(q_ptrs, mask=(g < GROUP)[:, None], other=0.0).to(tl.float32)
    q_mean = tl.sum(q_group, axis=0) / GROUP  # [D]

    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = p < n_pages
    phys = tl.load(block_table + b * stride_bt + p, mask=live, other=0).to(tl.int64)
    c = tl.load(
        centroids + phys[:, None] * stride_cp + h * stride_ch + d[None, :], mask=live[:, None], other=0.0
    )
    s = tl.sum(c * q_mean[None, :], axis=1)
    s = tl.where(live, s, float("-inf"))
    tl.store(scores + b * stride_sb + h * stride_sh + p, s, mask=p < max_pages)


@triton.jit
def _select_pages_kernel(
    scores, seq_len, budget, page_idx, counts,
    stride_sb, stride_sh, stride_ib, stride_ih,
    num_kv_heads, max_pages, sink_pages, local_pages,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Program b * Hkv + h: kept logical pages of row (b, h), ascending, -1 padded; and their count."""
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    n_pages = (tl.load(seq_len + b) + PAGE - 1) // PAGE
    budget_pages = tl.load(budget + b) // PAGE
    p = tl.arange(0, BLOCK_P)
    in_seq = p < n_pages
    forced = in_seq & ((p < sink_pages) | (p >= n_pages - local_pages))
    middle = in_seq & ~forced

    # Order-preserving int32 image of the float32 score (-0.0 folded onto +0.0 so they tie, as in
    # a float comparison): non-negative floats keep their bits, negative ones flip the magnitude bits.
    s = tl.load(scores + b * stride_sb + h * stride_sh + p, mask=middle, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)

    top_k = tl.minimum(
        tl.maximum(budget_pages - sink_pages - local_pages, 0), tl.sum(middle.to(tl.int32), axis=0)
    )
    # Largest threshold t with #{middle keys >= t} >= top_k, i.e. the top_k-th largest key. The
    # invariant holds at lo = -2^31 (all keys count) and fails at hi = 2^31; 32 halvings close it.
    lo = tl.full((), -(2**31), tl.int64)
    hi = tl.full((), 2**31, tl.int64)
    for _ in range(32):
        mid = (lo + hi) >> 1
        enough = tl.sum((middle & (key >= mid)).to(tl.int32), axis=0) >= top_k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    above = middle & (key > lo)
    at = middle & (key == lo)
    ties_needed = top_k - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= ties_needed))

    # (tl.where, not `|`, with the scalar condition: the interpreter widens a broadcast bool to int32.)
    keep = tl.where(n_pages <= budget_pages, in_seq, in_seq & (forced | chosen))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    count = tl.sum(keep.to(tl.int32), axis=0)
    row = page_idx + b * stride_ib + h * stride_ih
    tl.store(row + slot, p, mask=keep)
    tl.store(row + p, tl.full((BLOCK_P,), -1, tl.int32), mask=(p >= count) & (p < max_pages))
    tl.store(counts + pid, count)


def _check_inputs(
    q: torch.Tensor, centroids: torch.Tensor, block_table: torch.Tensor, seq_len: torch.Tensor, page_size: int
) -> int:
    """Validate the selection inputs; returns the GQA group size G."""
    _checks.check_page_args(page_size)
    _checks.check_block_table(block_table)
    batch = block_table.shape[0]
    if centroids.dim() != 3:
        raise ValueError(f"centroids must be float32 [num_pages, Hkv, D], got shape {tuple(centroids.shape)}")
    num_pages, num_kv_heads, head_dim = centroids.shape
    _checks.check_head_dim(head_dim)
    _checks.check_centroids(centroids, num_pages, num_kv_heads, head_dim)
    group = _checks.check_query(q, num_kv_heads, head_dim)
    if q.shape[0] != batch:
        raise ValueError(f"q has batch {q.shape[0]} but block_table has {batch} rows")
    _checks.check_per_seq("seq_len", seq_len, batch)
    _checks.check_device(q=q, centroids=centroids, block_table=block_table, seq_len=seq_len)
    _checks.check_last_dim_contiguous(q=q, centroids=centroids, block_table=block_table, seq_len=seq_len)
    return group


def _launch_scores(
    q: torch.Tensor, centroids: torch.Tensor, block_table: torch.Tensor, seq_len: torch.Tensor, page_size: int,
    group: int,
) -> torch.Tensor:  # fmt: skip
    batch, max_pages = block_table.shape
    num_kv_heads, head_dim = centroids.shape[1:]
    scores = torch.empty(batch, num_kv_heads, max_pages, dtype=torch.float32, device=q.device)
    if scores.numel() == 0:
        return scores
    grid = (batch * num_kv_heads, triton.cdiv(max_pages, _SCORE_BLOCK_PAGES))
    _page_scores_kernel[grid](
        q, centroids, block_table, seq_len, scores,
        q.stride(0), q.stride(1), centroids.stride(0), centroids.stride(1), block_table.stride(0),
        scores.stride(0), scores.stride(1),
        num_kv_heads, max_pages,
        GROUP=group, GROUP_POW2=next_pow2(group), D=head_dim, PAGE=page_size, BLOCK_P=_SCORE_BLOCK_PAGES,
    )  # fmt: skip
    return scores


def page_scores_paged(
    q: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    page_size: int = 16,
) -> torch.Tensor:
    """GQA-mean query dotted with every page centroid.

    Args:
        q: [B, Hq, D] queries (float32/float16/bfloat16); heads h*G .. h*G+G-1 belong to KV head h.
        centroids: float32 [num_pages, Hkv, D] per physical page.
        block_table: integer [B, P] logical -> physical page (P = max_pages_per_seq).
        seq_len: integer [B] tokens in the cache.

    Returns:
        float32 [B, Hkv, P]: scores[b, h, p] = mean_g q[b, h*G+g] . centroids[block_table[b, p], h],
        -inf for logical pages at or past ceil(seq_len / page_size).
    """
    group = _check_inputs(q, centroids, block_table, seq_len, page_size)
    return _launch_scores(q, centroids, block_table, seq_len, page_size, group)


def select_from_scores(
    scores: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparrow's page choice from precomputed page scores.

    Args:
        scores: float32 [B, Hkv, P] page scores (only middle pages are read).
        seq_len: integer [B] tokens in the cache; budget_tokens: int32 [B] in [0, P * page_size].

    Returns:
        page_idx int32 [B, Hkv, P]: kept logical pages ascending, then -1; counts int32 [B, Hkv].
        The width is P (static, so no device sync is needed to size it); entries past counts are -1.
    """
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [B, Hkv, P], got {scores.dtype} {tuple(scores.shape)}")
    batch, num_kv_heads, max_pages = scores.shape
    _checks.check_per_seq("seq_len", seq_len, batch)
    _checks.check_per_seq("budget_tokens", budget_tokens, batch)
    _checks.check_device(scores=scores, seq_len=seq_len, budget_tokens=budget_tokens)
    _checks.check_last_dim_contiguous(scores=scores, seq_len=seq_len, budget_tokens=budget_tokens)
    page_idx = torch.empty(batch, num_kv_heads, max_pages, dtype=torch.int32, device=scores.device)
    counts = torch.empty(batch, num_kv_heads, dtype=torch.int32, device=scores.device)
    if counts.numel() == 0:
        return page_idx, counts
    block_p = max(next_pow2(max_pages), 16)
    _select_pages_kernel[(batch * num_kv_heads,)](
        scores, seq_len, budget_tokens, page_idx, counts,
        scores.stride(0), scores.stride(1), page_idx.stride(0), page_idx.stride(1),
        num_kv_heads, max_pages, sink_pages, local_pages,
        PAGE=page_size, BLOCK_P=block_p, num_warps=4 if block_p <= 1024 else 8,
    )  # fmt: skip
    return page_idx, counts


def select_pages_paged(
    q: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages each KV head attends to at this decode step (Sparrow's rule, on the paged cache).

    Per sequence: n_pages = ceil(seq_len / page_size), budget_pages = budget_tokens // page_size.
    If n_pages <= budget_pages all pages are kept; otherwise pages [0, sink_pages), the last
    local_pages pages, and the top k = max(budget_pages - sink_pages - local_pages, 0) middle pages
    by GQA-mean-query . centroid score (float32; equal scores -> the lower page index wins).

    Args:
        q: [B, Hq, D]; centroids: float32 [num_pages, Hkv, D]; block_table: integer [B, P];
        seq_len: integer [B] tokens (the current token included); budget_tokens: int or integer
        [B] tokens including the sink and local pages.

    Returns:
        (page_idx int32 [B, Hkv, P] logical page indices ascending per row, padded with -1;
         counts int32 [B, Hkv] kept pages per row). P = block_table.shape[1].

    An int budget that covers the block table's capacity (dense layers, the dense schedule) keeps
    every page without scoring: no centroid is read.
    """
    _checks.check_page_args(page_size, sink_pages, local_pages)
    group = _check_inputs(q, centroids, block_table, seq_len, page_size)
    max_tokens = block_table.shape[1] * page_size
    if isinstance(budget_tokens, int) and budget_tokens >= max_tokens:
        return _all_pages(seq_len, centroids.shape[1], block_table.shape[1], page_size)
    budget = _checks.budget_tensor(budget_tokens, q.shape[0], max_tokens, q.device)
    scores = _launch_scores(q, centroids, block_table, seq_len, page_size, group)
    return select_from_scores(scores, seq_len, budget, page_size, sink_pages, local_pages)


def _all_pages(
    seq_len: torch.Tensor, num_kv_heads: int, max_pages: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every page of every sequence: page_idx int32 [B, Hkv, P] = 0..n_pages-1 then -1; counts int32 [B, Hkv]."""
    n_pages = (seq_len.to(torch.int32) + page_size - 1) // page_size  # [B]
    pages = torch.arange(max_pages, dtype=torch.int32, device=seq_len.device)
    page_idx = torch.where(pages[None, :] < n_pages[:, None], pages[None, :], -1)  # [B, P]
    batch = seq_len.shape[0]
    return (page_idx[:, None, :].expand(batch, num_kv_heads, max_pages).contiguous(),
            n_pages[:, None].expand(batch, num_kv_heads).contiguous())  # fmt: skip
