"""Sparse flash-decoding over the selected pages of the paged KV cache (split-K + log-sum-exp merge).

Stage "attention" (``sparse_decode_split``): one program per (sequence b, KV head h, split s). It
holds the whole GQA group's queries as one [G_PAD, D] tile (G padded to >= 16 rows for tl.dot),
walks its share of the row's sorted page list ``PAGES_PER_ITER`` pages (16 tokens each) at a time,
gathers those pages' keys and values through the block table, and runs an online softmax with
float32 accumulation. Each selected page is read once per KV head, for all G query heads.
Stage "merge" (``merge_splits``): one program per (b, query head) combines the splits' partial
outputs with their log-sum-exp weights. Scores use base-2 exponentials internally; the log-sum-exps
passed between the stages are in log2 units.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparrow_kernels import _checks
from sparrow_kernels._runtime import INTERPRETED, next_pow2, num_sms
from sparrow_kernels.selection import select_pages_paged

#: Pages gathered per loop iteration of the attention kernel (4 pages = a 64-token tile).
PAGES_PER_ITER = 4
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation. UPCAST: compute in fp32 (the interpreter cannot multiply
    bf16 tiles); IEEE: exact fp32 products for fp32 inputs (no TF32 rounding) on GPU."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _split_decode_kernel(
    q, k_pages, v_pages, block_table, seq_len, page_idx, counts, o_part, lse_part,
    scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_bt, stride_ib, stride_ih, stride_cb, stride_ch,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    num_kv_heads, num_splits,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    PAGES_PER_ITER: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (b * Hkv + h, split): softmax attention of q[b, h*G:(h+1)*G] over its page share."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    count = tl.load(counts + b * stride_cb + h * stride_ch)
    seq = tl.load(seq_len + b)
    # Balanced contiguous shares of the row's page list, whole iterations each.
    chunk = tl.cdiv(tl.cdiv(count, num_splits), PAGES_PER_ITER) * PAGES_PER_ITER
    start = split * chunk
    end = tl.minimum(start + chunk, count)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = h * GROUP + g
    q_tile = tl.load(
        q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0
    )

    BLOCK_N: tl.constexpr = PAGES_PER_ITER * PAGE
    n = tl.arange(0, BLOCK_N)
    page_of = n // PAGE
    slot = n % PAGE
    idx_row = page_idx + b * stride_ib + h * stride_ih
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for j in range(start, end, PAGES_PER_ITER):
        page_live = j + page_of < end
        logical = tl.load(idx_row + j + page_of, mask=page_live, other=0)
        phys = tl.load(block_table + b * stride_bt + logical, mask=page_live, other=0).to(tl.int64)
        live = page_live & (logical * PAGE + slot < seq)
        k = tl.load(
            k_pages + phys[:, None] * stride_kp + h * stride_kh + slot[:, None] * stride_ks + d[None, :],
            mask=live[:, None], other=0.0,
        )  # fmt: skip
        s = _mma(q_tile, tl.trans(k), tl.zeros((G_PAD, BLOCK_N), tl.float32), UPCAST, IEEE) * scale_log2
        s = tl.where(live[None, :], s, float("-inf"))
        # The first page of every iteration is live, so m_new is finite for valid page lists; the
        # floor only keeps an invalid (all-masked) tile from producing NaN.
        m_new = tl.maximum(tl.maximum(m_i, tl.max(s, axis=1)), -1e30)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_pages + phys[:, None] * stride_vp + h * stride_vh + slot[:, None] * stride_vs + d[None, :],
            mask=live[:, None], other=0.0,
        )  # fmt: skip
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
        m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    row_ok = g < GROUP
    o_ptrs = o_part + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None])
    tl.store(lse_part + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    o_part, lse_part, out,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
    num_q_heads, num_splits,
    D: tl.constexpr, SPLITS_POW2: tl.constexpr,
):  # fmt: skip
    """Program b * Hq + hq: out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    pid = tl.program_id(0)
    b = pid // num_q_heads
    hq = pid % num_q_heads
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, D)
    in_range = s < num_splits
    lse = tl.load(lse_part + b * stride_lb + hq * stride_lh + s, mask=in_range, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(
        o_part + b * stride_ob + hq * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=in_range[:, None], other=0.0,
    )  # fmt: skip
    den = tl.sum(w, axis=0)
    merged = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out + b * stride_b + hq * stride_h + d, merged.to(out.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) so that about 4 programs per SM are in flight.

    Uses only host-side sizes (no device sync): enough splits that batch * Hkv * splits reaches
    4 * SMs, at most one split per ``2 * PAGES_PER_ITER`` pages of the longest possible row, and
    at most 32.
    """
    want = triton.cdiv(4 * num_sms(device), max(batch * num_kv_heads, 1))
    cap = max(1, triton.cdiv(max_pages, 2 * PAGES_PER_ITER))
    return max(1, min(want, cap, _MAX_SPLITS))


def sparse_decode_split(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    page_idx: torch.Tensor,
    counts: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    pages_per_iter: int = PAGES_PER_ITER,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention stage: per-split partial outputs over the selected pages.

    Args:
        q: [B, Hq, D] in the cache dtype; k_pages, v_pages: [num_pages, Hkv, page_size, D].
        block_table: integer [B, P]; seq_len: integer [B] tokens in the cache.
        page_idx: integer [B, Hkv, n] logical pages to attend, ascending, first counts[b, h] valid.
        counts: integer [B, Hkv] (>= 1 for every row with seq_len >= 1).
        scale: softmax scale, default 1/sqrt(D). num_splits: default ``default_num_splits``.
        pages_per_iter (power of two), num_warps: launch tuning knobs (the benchmark sweeps them).

    Returns:
        (o_part float32 [B, Hq, S, D] softmax-normalised partial outputs per split,
         lse_part float32 [B, Hq, S] their log2-sum-exp2 of scaled scores, -inf for empty splits).
    """
    _, num_kv_heads, page_size, head_dim = _checks.check_pages(k_pages, v_pages)
    group = _checks.check_query(q, num_kv_heads, head_dim)
    if q.dtype != k_pages.dtype:
        raise ValueError(
            f"q dtype {q.dtype} must equal the cache dtype {k_pages.dtype} (one tensor-core dtype)"
        )
    batch = q.shape[0]
    max_pages = _checks.check_block_table(block_table, batch)
    _checks.check_per_seq("seq_len", seq_len, batch)
    if page_idx.dim() != 3 or page_idx.shape[:2] != (batch, num_kv_heads) or page_idx.dtype.is_floating_point:
        raise ValueError(
            f"page_idx must be an integer [B, Hkv, n]=[{batch}, {num_kv_heads}, n] tensor, "
            f"got {page_idx.dtype} {tuple(page_idx.shape)}"
        )
    if counts.shape != (batch, num_kv_heads) or counts.dtype.is_floating_point:
        raise ValueError(f"counts must be an integer [B, Hkv]={(batch, num_kv_heads)} tensor, got {counts.dtype} "
                         f"{tuple(counts.shape)}")  # fmt: skip
    device = _checks.check_device(
        q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table, seq_len=seq_len,
        page_idx=page_idx, counts=counts,
    )  # fmt: skip
    _checks.check_last_dim_contiguous(q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table)
    _checks.check_last_dim_contiguous(page_idx=page_idx, seq_len=seq_len)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_pages, device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if pages_per_iter < 1 or pages_per_iter & (pages_per_iter - 1) or pages_per_iter * page_size < 16:
        raise ValueError(
            f"pages_per_iter must be a power of two with pages_per_iter * page_size >= 16, got {pages_per_iter}"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    num_q_heads = q.shape[1]
    o_part = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    lse_part = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
    if batch == 0:
        return o_part, lse_part
    grid = (batch * num_kv_heads, num_splits)
    _split_decode_kernel[grid](
        q, k_pages, v_pages, block_table, seq_len, page_idx, counts, o_part, lse_part,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table.stride(0), page_idx.stride(0), page_idx.stride(1), counts.stride(0), counts.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        num_kv_heads, num_splits,
        GROUP=group, G_PAD=max(16, next_pow2(group)), D=head_dim, PAGE=page_size,
        PAGES_PER_ITER=pages_per_iter, UPCAST=INTERPRETED, IEEE=k_pages.dtype == torch.float32,
        num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    return o_part, lse_part


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Merge stage: combine per-split partial outputs.

    Args:
        o_part: float32 [B, Hq, S, D]; lse_part: float32 [B, Hq, S] (log2 units, -inf = empty split).
        out_dtype: dtype of the result.

    Returns:
        [B, Hq, D] in out_dtype (zeros for a row whose splits are all empty).
    """
    if o_part.dim() != 4 or o_part.dtype != torch.float32:
        raise ValueError(f"o_part must be float32 [B, Hq, S, D], got {o_part.dtype} {tuple(o_part.shape)}")
    if lse_part.shape != o_part.shape[:3] or lse_part.dtype != torch.float32:
        raise ValueError(
            f"lse_part must be float32 [B, Hq, S]={tuple(o_part.shape[:3])}, got {lse_part.dtype} {tuple(lse_part.shape)}"
        )
    _checks.check_device(o_part=o_part, lse_part=lse_part)
    _checks.check_last_dim_contiguous(o_part=o_part, lse_part=lse_part)
    batch, num_q_heads, num_splits, head_dim = o_part.shape
    out = torch.empty(batch, num_q_heads, head_dim, dtype=out_dtype, device=o_part.device)
    if out.numel() == 0:
        return out
    _merge_splits_kernel[(batch * num_q_heads,)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        num_q_heads, num_splits,
        D=head_dim, SPLITS_POW2=max(2, next_pow2(num_splits)),
    )  # fmt: skip
    return out


def sparse_decode_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    page_idx: torch.Tensor,
    counts: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Exact softmax attention of one query token per sequence over the given pages.

    Args: as :func:`sparse_decode_split` (page_idx, counts from :func:`select_pages_paged`).

    Returns:
        [B, Hq, D] in q.dtype; scale 1/sqrt(D) by default, float32 softmax and accumulation
        (the probabilities are rounded to the cache dtype for the P.V tensor-core product).
    """
    o_part, lse_part = sparse_decode_split(q, k_pages, v_pages, block_table, seq_len, page_idx, counts, scale,
                                           num_splits)  # fmt: skip
    return merge_splits(o_part, lse_part, q.dtype)


def sparse_decode_attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Sparrow sparse decode attention on the paged cache: select pages, then attend (scale 1/sqrt(D)).

    Args:
        q: [B, Hq, D] in the cache dtype; k_pages, v_pages: [num_pages, Hkv, page_size, D];
        centroids: float32 [num_pages, Hkv, D]; block_table: integer [B, P]; seq_len: integer [B]
        tokens (>= 1, the current token included); budget_tokens: int or integer [B] tokens.

    Returns:
        [B, Hq, D] in q.dtype. Equals dense attention for rows whose budget covers the sequence.
    """
    _checks.check_page_args(page_size, sink_pages, local_pages, cache_page_size=k_pages.shape[2])
    page_idx, counts = select_pages_paged(q, centroids, block_table, seq_len, budget_tokens, page_size,
                                          sink_pages, local_pages)  # fmt: skip
    return sparse_decode_paged(q, k_pages, v_pages, block_table, seq_len, page_idx, counts, None, num_splits)
