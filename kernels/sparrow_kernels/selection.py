"""Sparrow's page selection on the paged cache: scoring and top-k in one launch.

One program per (sequence b, KV head h) row:

1. budget and lengths, on the device: n_pages = ceil(seq_len / page_size), budget_pages =
   clamp(budget_tokens, 0, capacity) // page_size (no host-side ``.to``/``.clamp`` launches). A row
   whose budget covers it keeps every page and reads no landmark (the dense fallback).
2. scores: the GQA group's mean query dotted (float32) with the centroid of every middle page
   (``page_score="minmax"``, landmarks given as :class:`~sparrow_kernels.KeyBounds`: the key-bound
   score sum_d max(q_d * min_d, q_d * max_d), float32, two tiles per page), streamed through the
   block table (the row's block-table chunk preloaded, so each landmark tile's address needs no
   dependent load and the tiles pipeline); the order-preserving uint32 image of each score goes
   to an L2-resident scratch row.
3. top-k: a 3-pass radix select (11 + 11 + 10 bits, one histogram per pass) finds the k-th
   largest key exactly; equal keys are cut towards the lower page index by a running prefix count.
4. output: kept pages in ascending logical order, as logical indices (-1 padded) and as physical
   page ids (what the attention kernel reads: one indirection), their count, and a zeroed merge
   ticket per row for the attention kernel's split merge.

This reproduces ``sparrow_nemo.sparse.attention.select_pages_from_centroids`` (stable descending
sort of float32 scores) exactly, ties included, on the same centroids, and
``select_pages_from_key_bounds`` on the same key bounds (up to the float32 summation order of a
score: scores closer than that rounding may rank either way; exact ties stay exact ties).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sparrow_kernels import _checks
from sparrow_kernels._runtime import launch, next_pow2
from sparrow_kernels.landmarks import Landmarks, page_score_of

#: Middle pages scored per tile (a [SCORE_TILE, D] centroid tile, or a key_min and a key_max tile).
SCORE_TILE = 64
#: Pages handled per step of the chunked passes (block-table preload, histograms, output).
CHUNK = 1024
#: Pipeline stages of the centroid stream (3: two tiles in flight while one is scored).
SCORE_STAGES = 3


class PageSelection(NamedTuple):
    """The pages each (sequence, KV head) attends to at one decode step.

    page_idx: int32 [B, Hkv, P] kept logical pages, ascending, then -1 (P = block_table width).
    counts: int32 [B, Hkv] kept pages per row.
    physical: int32 [B, Hkv, P] block_table[b, page_idx[b, h, i]] for i < counts[b, h] (same
        order); entries past counts are unspecified.
    tickets: int32 [B, Hkv] zeros: the split-merge counters of ``sparrow_kernels.decode``.
    """

    page_idx: torch.Tensor
    counts: torch.Tensor
    physical: torch.Tensor
    tickets: torch.Tensor


@triton.jit
def _order_key(s):
    """float32 -> uint32 in the same order (-0.0 folded onto +0.0 so that they tie, as floats do)."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _radix_digit(keys_row, lo, hi, k, prefix, PREFIX_SHIFT: tl.constexpr, SHIFT: tl.constexpr,
                 BITS: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """One radix pass over keys_row[lo:hi] restricted to keys whose bits above PREFIX_SHIFT equal
    prefix (no restriction when PREFIX_SHIFT == 32). Returns the digit (key >> SHIFT) % 2^BITS of
    the k-th largest such key (k >= 1) and that key's rank among the keys sharing the digit."""
    NB: tl.constexpr = 1 << BITS
    hist = tl.zeros((NB,), tl.int32)
    for c0 in range(lo, hi, CHUNK):
        pp = c0 + tl.arange(0, CHUNK)
        live = pp < hi
        key = tl.load(keys_row + pp, mask=live, other=0).to(tl.uint32, bitcast=True)
        if PREFIX_SHIFT < 32:
            live = live & ((key >> PREFIX_SHIFT) == prefix)
        hist += tl.histogram(((key >> SHIFT) & (NB - 1)).to(tl.int32), NB, mask=live)
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)
    bins = tl.arange(0, NB)
    digit = tl.max(tl.where(at_or_above >= k, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == digit, at_or_above - hist, 0), axis=0)
    return digit.to(tl.uint32), k - above


# Sizes and the scalar budget vary per call and their divisibility buys nothing: one compile for all.
@triton.jit(do_not_specialize=["budget_scalar", "num_kv_heads", "max_pages", "sink_pages", "local_pages"])
def _select_pages_kernel(
    q, landmarks, key_max, block_table, seq_len, budget, keys, page_idx, physical, counts, tickets,
    budget_scalar,
    stride_qb, stride_qh, stride_cp, stride_ch, stride_xp, stride_xh, stride_bt, stride_kb, stride_ib, stride_pb,
    num_kv_heads, max_pages, sink_pages, local_pages,
    GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    SCORE_TILE: tl.constexpr, SCORE_STAGES: tl.constexpr, CHUNK: tl.constexpr, BUDGET_TENSOR: tl.constexpr,
    MINMAX: tl.constexpr,
):  # fmt: skip
    """Program b * Hkv + h: kept pages of row (b, h) (logical and physical), count, zeroed ticket.
    ``landmarks`` holds the centroids, or with MINMAX key_min (and ``key_max`` the maxima)."""
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    n_pages = tl.minimum(tl.cdiv(tl.load(seq_len + b).to(tl.int32), PAGE), max_pages)
    if BUDGET_TENSOR:
        bud = tl.load(budget + b).to(tl.int64)
    else:
        bud = budget_scalar + tl.zeros((), tl.int64)  # (+ zeros: the JIT passes a budget of 1 as a constexpr)
    capacity = (max_pages + tl.zeros((), tl.int64)) * PAGE
    budget_pages = (tl.minimum(tl.maximum(bud, 0), capacity) // PAGE).to(tl.int32)
    mid_lo = sink_pages
    mid_hi = n_pages - local_pages
    n_middle = tl.maximum(mid_hi - mid_lo, 0)
    keep_all = n_pages <= budget_pages
    top_k = tl.where(
        keep_all, 0, tl.minimum(tl.maximum(budget_pages - sink_pages - local_pages, 0), n_middle)
    )
    bt_row = block_table + b * stride_bt
    keys_row = keys + pid * stride_kb

    thresh = tl.full((), 0xFFFFFFFF, tl.uint32)  # no middle page is chosen unless top_k > 0
    ties = tl.zeros((), tl.int32)
    if top_k > 0:
        g = tl.arange(0, GROUP_POW2)
        d = tl.arange(0, D)
        q_ptrs = q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q_mean = tl.sum(tl.load(q_ptrs, mask=(g < GROUP)[:, None], other=0.0).to(tl.float32), axis=0) / GROUP
        t = tl.arange(0, SCORE_TILE)
        for c0 in range(mid_lo, mid_hi, CHUNK):
            c1 = tl.minimum(c0 + CHUNK, mid_hi)
            cp = c0 + tl.arange(0, CHUNK)
            bt_chunk = tl.load(bt_row + cp, mask=cp < c1, other=0)
            for p0 in tl.range(
                c0, c1, SCORE_TILE, num_stages=SCORE_STAGES
            ):  # landmark tiles: async-copy ring
                live = p0 + t < c1
                phys = tl.gather(bt_chunk, p0 - c0 + t, 0).to(tl.int64)
                c = tl.load(landmarks + phys[:, None] * stride_cp + h * stride_ch + d[None, :],
                            mask=live[:, None], other=0.0)  # fmt: skip
                if MINMAX:
                    c_max = tl.load(key_max + phys[:, None] * stride_xp + h * stride_xh + d[None, :],
                                    mask=live[:, None], other=0.0)  # fmt: skip
                    bound = tl.maximum(
                        c.to(tl.float32) * q_mean[None, :], c_max.to(tl.float32) * q_mean[None, :]
                    )
                    key = _order_key(tl.sum(bound, axis=1))
                else:
                    key = _order_key(tl.sum(c.to(tl.float32) * q_mean[None, :], axis=1))
                tl.store(keys_row + p0 + t, key.to(tl.int32, bitcast=True), mask=live)
        tl.debug_barrier()  # the keys written by every thread are read back by others below
        d1, k = _radix_digit(keys_row, mid_lo, mid_hi, top_k, 0, 32, 21, 11, CHUNK)
        d2, k = _radix_digit(keys_row, mid_lo, mid_hi, k, d1, 21, 10, 11, CHUNK)
        d3, k = _radix_digit(keys_row, mid_lo, mid_hi, k, (d1 << 11) | d2, 10, 0, 10, CHUNK)
        thresh = (d1 << 21) | (d2 << 10) | d3
        ties = k  # keys equal to the threshold still to take, lowest pages first

    count = tl.where(keep_all, n_pages, n_pages - n_middle + top_k)
    kept = tl.zeros((), tl.int32)
    ties_seen = tl.zeros((), tl.int32)
    idx_row = page_idx + pid * stride_ib
    phys_row = physical + pid * stride_pb
    scored_hi = tl.where(top_k > 0, mid_hi, mid_lo)  # keys exist for the middle pages of a selecting row
    for c0 in range(0, max_pages, CHUNK):
        pp = c0 + tl.arange(0, CHUNK)
        in_seq = pp < n_pages
        middle = (pp >= mid_lo) & (pp < mid_hi)
        scored = (pp >= mid_lo) & (pp < scored_hi)
        key = tl.load(keys_row + pp, mask=scored, other=0).to(tl.uint32, bitcast=True)
        at = scored & (key == thresh)
        tie_rank = ties_seen + tl.cumsum(at.to(tl.int32), axis=0)
        chosen = scored & ((key > thresh) | (at & (tie_rank <= ties)))
        ties_seen += tl.sum(at.to(tl.int32), axis=0)
        # (tl.where, not `|`, with the scalar condition: the interpreter widens a broadcast bool to int32.)
        keep = tl.where(keep_all, in_seq, in_seq & (~middle | chosen))
        slot = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        kept += tl.sum(keep.to(tl.int32), axis=0)
        tl.store(idx_row + slot, pp, mask=keep)
        tl.store(phys_row + slot, tl.load(bt_row + pp, mask=keep, other=0).to(tl.int32), mask=keep)
        tl.store(idx_row + pp, tl.full((CHUNK,), -1, tl.int32), mask=(pp >= count) & (pp < max_pages))
    tl.store(counts + pid, count)
    tl.store(tickets + pid, 0)


def _check_inputs(
    q: torch.Tensor, landmarks: Landmarks, block_table: torch.Tensor, seq_len: torch.Tensor, page_size: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Validate the selection inputs; returns the GQA group size G and the two landmark tensors the
    kernel reads (centroids twice, or key_min and key_max)."""
    _checks.check_page_args(page_size)
    _checks.check_block_table(block_table)
    batch = block_table.shape[0]
    named = _checks.landmark_tensors(landmarks)
    lead_name, lead = next(iter(named.items()))
    if lead.dim() != 3:
        raise ValueError(f"{lead_name} must be [num_pages, Hkv, D], got shape {tuple(lead.shape)}")
    num_pages, num_kv_heads, head_dim = lead.shape
    _checks.check_head_dim(head_dim)
    first, second = _checks.check_landmarks(landmarks, num_pages, num_kv_heads, head_dim)
    group = _checks.check_query(q, num_kv_heads, head_dim)
    if q.shape[0] != batch:
        raise ValueError(f"q has batch {q.shape[0]} but block_table has {batch} rows")
    _checks.check_per_seq("seq_len", seq_len, batch)
    _checks.check_device(q=q, **named, block_table=block_table, seq_len=seq_len)
    _checks.check_last_dim_contiguous(q=q, **named, block_table=block_table, seq_len=seq_len)
    return group, first, second


def page_selection(
    q: torch.Tensor,
    landmarks: Landmarks,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> PageSelection:
    """Pages each KV head attends to at this decode step (Sparrow's rule, on the paged cache; one launch).

    Per sequence: n_pages = ceil(seq_len / page_size), budget_pages = budget_tokens // page_size
    (budget clamped to [0, P * page_size] on the device). If n_pages <= budget_pages all pages are
    kept; otherwise pages [0, sink_pages), the last local_pages pages, and the top
    k = max(budget_pages - sink_pages - local_pages, 0) middle pages by GQA-mean-query . centroid
    score, or with key bounds by sum_d max(q_d * min_d, q_d * max_d) of that mean query (float32;
    equal scores -> the lower page index wins).

    Args:
        q: [B, Hq, D] float32/float16/bfloat16; heads h*G .. h*G+G-1 belong to KV head h.
        landmarks: centroids [num_pages, Hkv, D] float32/float16/bfloat16 per physical page, or
            :class:`~sparrow_kernels.KeyBounds` (key_min, key_max, each of that shape, one dtype);
            read as stored, accumulated in float32.
        block_table: int32/int64 [B, P] logical -> physical page; seq_len: int32/int64 [B] tokens
            (the current token included).
        budget_tokens: an int, or an int32/int64 [B] tensor, of tokens including the sink and local pages.

    Returns:
        :class:`PageSelection` (P = block_table.shape[1], static, so no device sync sizes it).
    """
    _checks.check_page_args(page_size, sink_pages, local_pages)
    group, first, second = _check_inputs(q, landmarks, block_table, seq_len, page_size)
    batch, max_pages = block_table.shape
    _checks.check_budget(budget_tokens, batch)
    num_kv_heads, head_dim = first.shape[1:]
    device = q.device
    rows = batch * num_kv_heads
    keys = torch.empty(rows, max(max_pages, 1), dtype=torch.int32, device=device)
    page_idx = torch.empty(batch, num_kv_heads, max_pages, dtype=torch.int32, device=device)
    physical = torch.empty_like(page_idx)
    counts = torch.empty(batch, num_kv_heads, dtype=torch.int32, device=device)
    tickets = torch.empty_like(counts)
    selection = PageSelection(page_idx, counts, physical, tickets)
    if rows == 0:
        return selection
    is_tensor = isinstance(budget_tokens, torch.Tensor)
    chunk = min(CHUNK, max(next_pow2(max_pages), SCORE_TILE))  # a multiple of SCORE_TILE
    launch(
        _select_pages_kernel, (rows,),
        q, first, second, block_table, seq_len, budget_tokens if is_tensor else seq_len, keys, page_idx, physical,
        counts, tickets,
        0 if is_tensor else budget_tokens,
        q.stride(0), q.stride(1), first.stride(0), first.stride(1), second.stride(0), second.stride(1),
        block_table.stride(0), keys.stride(0), page_idx.stride(1), physical.stride(1),
        num_kv_heads, max_pages, sink_pages, local_pages,
        GROUP=group, GROUP_POW2=next_pow2(group), D=head_dim, PAGE=page_size, SCORE_TILE=SCORE_TILE,
        SCORE_STAGES=SCORE_STAGES, CHUNK=chunk, BUDGET_TENSOR=is_tensor, MINMAX=page_score_of(landmarks) == "minmax",
        num_warps=4,
    )  # fmt: skip
    return selection


def select_pages_paged(
    q: torch.Tensor,
    landmarks: Landmarks,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`page_selection`'s logical page lists and counts.

    Returns:
        (page_idx int32 [B, Hkv, P] logical page indices ascending per row, padded with -1;
         counts int32 [B, Hkv] kept pages per row). P = block_table.shape[1].
    """
    selection = page_selection(q, landmarks, block_table, seq_len, budget_tokens, page_size, sink_pages,
                               local_pages)  # fmt: skip
    return selection.page_idx, selection.counts
