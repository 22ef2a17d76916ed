"""Flash-decoding over the paged KV cache: one kernel for sparse decode, dense decode and the
multi-query verify pass, with the split-K merge fused into the last split's program.

One program per (sequence b, KV head h, split s). It holds the query rows of KV head h as one
[M_PAD, D] tile: the G query heads of the GQA group for each of the NUM_Q query tokens (row
r = token i * G + head g, padded to >= 16 rows for tl.dot), so every K/V tile is loaded once for
all of them. Its share of the row's page list is walked PAGES_PER_ITER pages (a TILE_TOKENS tile) at a time:

- the page list holds physical page ids (the selection's ``physical``, or the block table row
  itself for dense attention): one indirection from list to K/V;
- the list is preloaded CHUNK entries at a time and each iteration's ids are taken from registers
  (``tl.gather``), so K/V addresses need no load inside the loop and Triton's software pipeliner
  turns the K and V loads into asynchronous copies into a ring of ``num_stages - 1`` shared-memory
  buffers (the next tiles stream in while the current one is computed; ``sparrow_kernels.aot``
  checks this in the compiled code);
- an online softmax in float32 (base-2 exponentials) accumulates the output.

With one split the program writes the output. With several, each split stores its normalised
partial output and log2-sum-exp to a scratch buffer and takes a ticket (an atomic add on the
row's counter); the program that draws the last ticket merges the row's splits, writes the output
and resets the counter to 0, so no merge launch is needed and the counters are reusable.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparrow_kernels import _checks
from sparrow_kernels._runtime import INTERPRETED, launch, next_pow2, num_sms
from sparrow_kernels.landmarks import Landmarks
from sparrow_kernels.selection import PageSelection, page_selection

#: Tokens per K/V tile of the attention kernel's loop (2 pages of 16: 39 KB of shared memory with the
#: double-buffered ring at D = 128, 5 programs per H200 SM, so batch 64 x 8 KV heads is one wave).
TILE_TOKENS = 32
#: Page-list entries preloaded at once.
LIST_CHUNK = 512
#: Software-pipeline stages (3 = K and V double-buffered).
NUM_STAGES = 3
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
_STREAMING_PROGRAMS_PER_SM = 3
_SHARED_BYTES_PER_SM = 227 * 1024  # H100/H200


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


# num_splits stays specialised: with 1 split the merge code compiles away.
@triton.jit(do_not_specialize=["num_kv_heads", "max_pages"])
def _paged_attention_kernel(
    q, k_pages, v_pages, block_table, seq_len, pages, counts, tickets, o_part, lse_part, out,
    scale_log2,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_bt, stride_pb, stride_ob, stride_ot, stride_oh,
    num_kv_heads, num_splits, max_pages,
    GROUP: tl.constexpr, NUM_Q: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    PAGES_PER_ITER: tl.constexpr, CHUNK: tl.constexpr, DENSE: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """Program (b * Hkv + h, split): softmax attention of KV head h's query rows over its page share."""
    tl.static_assert(DENSE or NUM_Q == 1, "several query tokens need the causal mask of dense lists")
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    seq = tl.load(seq_len + b).to(tl.int32)
    n_pages = tl.minimum(tl.cdiv(seq, PAGE), max_pages)
    bt_row = block_table + b * stride_bt
    if DENSE:
        count = n_pages
        row = bt_row
    else:
        count = tl.load(counts + pid)
        row = pages + pid * stride_pb
    # A sparse list holds physical ids only; the partial last page is recognised by its id.
    tail_len = seq - (n_pages - 1) * PAGE
    tail_phys = tl.load(bt_row + tl.maximum(n_pages - 1, 0), mask=n_pages > 0, other=-1)
    share = tl.cdiv(tl.cdiv(count, num_splits), PAGES_PER_ITER) * PAGES_PER_ITER
    start = split * share
    end = tl.minimum(start + share, count)

    r = tl.arange(0, M_PAD)
    token = r // GROUP
    head = h * GROUP + r % GROUP
    row_ok = r < NUM_Q * GROUP
    d = tl.arange(0, D)
    q_tile = tl.load(
        q + b * stride_qb + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    last_pos = seq - NUM_Q + token  # causal: the last cache position each query row attends to

    BLOCK_N: tl.constexpr = PAGES_PER_ITER * PAGE
    n = tl.arange(0, BLOCK_N)
    page_of = n // PAGE
    slot = n % PAGE
    m_i = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_PAD,), tl.float32)
    acc = tl.zeros((M_PAD, D), tl.float32)
    for c0 in range(start, end, CHUNK):
        c1 = tl.minimum(c0 + CHUNK, end)
        cp = c0 + tl.arange(0, CHUNK)
        ids = tl.load(row + cp, mask=cp < c1, other=0)
        for j in range(c0, c1, PAGES_PER_ITER):
            entry = j + page_of
            phys = tl.gather(ids, entry - c0, 0)
            if DENSE:
                pos = entry * PAGE + slot
                col_ok = (entry < c1) & (pos < seq)
            else:
                col_ok = (entry < c1) & ((phys != tail_phys) | (slot < tail_len))
            phys = phys.to(tl.int64)
            k = tl.load(
                k_pages + phys[:, None] * stride_kp + h * stride_kh + slot[:, None] * stride_ks + d[None, :],
                mask=col_ok[:, None], other=0.0,
            )  # fmt: skip
            s = _mma(q_tile, tl.trans(k), tl.zeros((M_PAD, BLOCK_N), tl.float32), UPCAST, IEEE) * scale_log2
            if NUM_Q > 1:
                s = tl.where(col_ok[None, :] & (pos[None, :] <= last_pos[:, None]), s, float("-inf"))
            else:
                s = tl.where(col_ok[None, :], s, float("-inf"))
            # The floor keeps a fully masked tile (a causal row, an empty share) from producing NaN.
            m_new = tl.maximum(tl.maximum(m_i, tl.max(s, axis=1)), -1e30)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_pages + phys[:, None] * stride_vp + h * stride_vh + slot[:, None] * stride_vs + d[None, :],
                mask=col_ok[:, None], other=0.0,
            )  # fmt: skip
            acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
            m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_ptrs = out + b * stride_ob + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if num_splits == 1:
        tl.store(out_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        part = pid * num_splits + split
        tl.store(o_part + (part * M_PAD + r[:, None]) * D + d[None, :], o, mask=row_ok[:, None])
        tl.store(lse_part + part * M_PAD + r, lse, mask=row_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket (acq_rel, gpu scope)
        ticket = tl.atomic_add(tickets + pid, 1)
        if ticket == num_splits - 1:
            m = tl.full((M_PAD,), float("-inf"), tl.float32)
            den = tl.zeros((M_PAD,), tl.float32)
            num = tl.zeros((M_PAD, D), tl.float32)
            for other in range(0, num_splits):
                base = pid * num_splits + other
                # .cg: read the other programs' partials from L2, never from a stale L1 line.
                lse_s = tl.load(
                    lse_part + base * M_PAD + r, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
                )
                o_s = tl.load(o_part + (base * M_PAD + r[:, None]) * D + d[None, :], mask=row_ok[:, None], other=0.0,
                              cache_modifier=".cg")  # fmt: skip
                m_new = tl.maximum(tl.maximum(m, lse_s), -1e30)
                w_old = tl.exp2(m - m_new)
                w = tl.exp2(lse_s - m_new)
                den = den * w_old + w
                num = num * w_old[:, None] + o_s * w[:, None]
                m = m_new
            merged = num / tl.where(den > 0.0, den, 1.0)[:, None]
            tl.store(out_ptrs, merged.to(out.dtype.element_ty), mask=row_ok[:, None])
            tl.store(tickets + pid, 0)


def query_rows(num_q_tokens: int, group: int) -> int:
    """Rows of the attention kernel's query tile: NUM_Q * G padded to a power of two >= 16."""
    return max(16, next_pow2(num_q_tokens * group))


def shared_bytes(num_stages: int, pages_per_iter: int, page_size: int, head_dim: int, m_pad: int,
                 elem_bytes: int) -> int:  # fmt: skip
    """Estimated shared memory of one attention program: the K and V rings plus the query tile."""
    tile = pages_per_iter * page_size * head_dim * elem_bytes
    return max(num_stages - 1, 1) * 2 * tile + m_pad * head_dim * elem_bytes + 4096


def default_pages_per_iter(page_size: int) -> int:
    """Pages per loop iteration: TILE_TOKENS tokens (at least one page)."""
    return max(1, TILE_TOKENS // page_size)


def default_num_splits(
    rows: int, max_list_pages: int, page_size: int, device: torch.device, programs_per_sm: int
) -> int:
    """Splits per (sequence, KV head) row, from host-side sizes only (no device sync).

    One split when the rows alone give every SM ``min(programs_per_sm, 3)`` programs (each keeps a
    K/V tile pair in flight, so 3 per SM stream at the HBM limit): batch 64 x 8 KV heads on an
    H200 (132 SMs). Otherwise enough splits to fill every resident program slot
    (``programs_per_sm`` from the shared-memory estimate), at most one split per 4 loop iterations
    of the longest possible list, and at most 32.
    """
    sms = num_sms(device)
    if rows >= min(programs_per_sm, _STREAMING_PROGRAMS_PER_SM) * sms:
        return 1
    cap = max(1, max_list_pages * page_size // (4 * TILE_TOKENS))
    return max(1, min(triton.cdiv(sms * programs_per_sm, max(rows, 1)), cap, _MAX_SPLITS))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    selection: PageSelection | None,
    scale: float | None = None,
    num_splits: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] (T query tokens per sequence, the last ones of the cache) over the
    paged cache: one launch, plus a counter memset when a dense call has several splits.

    ``selection`` None: every page (dense; causal among the T tokens). Otherwise the selection's
    physical pages (T must be 1). Returns [B, T, Hq, D] in q.dtype. The knobs are described at
    :func:`decode_attention_paged`.
    """
    _, num_kv_heads, page_size, head_dim = _checks.check_pages(k_pages, v_pages)
    _checks.check_page_args(page_size)
    if q.dim() != 4 or q.shape[3] != head_dim:
        raise ValueError(f"q must be [B, T, Hq, D={head_dim}], got shape {tuple(q.shape)}")
    batch, num_q, num_q_heads, _ = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads Hq={num_q_heads} must be a multiple of KV heads Hkv={num_kv_heads}")
    if q.dtype != k_pages.dtype:
        raise ValueError(
            f"q dtype {q.dtype} must equal the cache dtype {k_pages.dtype} (one tensor-core dtype)"
        )
    group = num_q_heads // num_kv_heads
    max_pages = _checks.check_block_table(block_table, batch)
    _checks.check_per_seq("seq_len", seq_len, batch)
    device = _checks.check_device(
        q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table, seq_len=seq_len
    )
    _checks.check_last_dim_contiguous(q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table)
    _checks.check_last_dim_contiguous(seq_len=seq_len)
    dense = selection is None
    if not dense:
        _check_selection(selection, batch, num_kv_heads, device)
        if num_q != 1:
            raise ValueError(f"a page selection serves one query token per sequence, got T={num_q}")
    pages_per_iter = default_pages_per_iter(page_size) if pages_per_iter is None else pages_per_iter
    if pages_per_iter < 1 or pages_per_iter & (pages_per_iter - 1) or pages_per_iter * page_size < 16:
        raise ValueError(
            f"pages_per_iter must be a power of two with pages_per_iter * page_size >= 16, got {pages_per_iter}"
        )
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    m_pad = query_rows(num_q, group)
    if num_warps is None:
        num_warps = 8 if m_pad >= 64 else 4
    rows = batch * num_kv_heads
    list_pages = max_pages if dense else selection.physical.shape[2]
    if num_splits is None:
        smem = shared_bytes(num_stages, pages_per_iter, page_size, head_dim, m_pad, k_pages.element_size())
        num_splits = default_num_splits(
            rows, list_pages, page_size, device, max(1, _SHARED_BYTES_PER_SM // smem)
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    out = torch.empty_like(q)
    if rows == 0 or num_q == 0:
        return out
    if num_splits > 1:
        o_part = torch.empty(rows * num_splits * m_pad * head_dim, dtype=torch.float32, device=device)
        lse_part = torch.empty(rows * num_splits * m_pad, dtype=torch.float32, device=device)
        tickets = torch.zeros(rows, dtype=torch.int32, device=device) if dense else selection.tickets
    else:  # never touched: the one-split program writes the output directly
        o_part = lse_part = torch.empty(0, dtype=torch.float32, device=device)
        tickets = seq_len
    pages = block_table if dense else selection.physical
    counts = seq_len if dense else selection.counts
    chunk = min(LIST_CHUNK, max(next_pow2(list_pages), pages_per_iter))
    launch(
        _paged_attention_kernel, (rows, num_splits),
        q, k_pages, v_pages, block_table, seq_len, pages, counts, tickets, o_part, lse_part, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table.stride(0), 0 if dense else pages.stride(1), out.stride(0), out.stride(1), out.stride(2),
        num_kv_heads, num_splits, max_pages,
        GROUP=group, NUM_Q=num_q, M_PAD=m_pad, D=head_dim, PAGE=page_size, PAGES_PER_ITER=pages_per_iter,
        CHUNK=chunk, DENSE=dense, UPCAST=INTERPRETED, IEEE=k_pages.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _check_selection(selection: PageSelection, batch: int, num_kv_heads: int, device: torch.device) -> None:
    """A PageSelection for [B, Hkv] rows, int32, on ``device``, with contiguous [B * Hkv] row layouts."""
    if not isinstance(selection, PageSelection):
        raise ValueError(f"selection must be a PageSelection, got {type(selection).__name__}")
    physical, counts, tickets = selection.physical, selection.counts, selection.tickets
    if physical.dim() != 3 or physical.shape[:2] != (batch, num_kv_heads) or physical.dtype != torch.int32:
        raise ValueError(
            f"selection.physical must be int32 [B, Hkv, n]=[{batch}, {num_kv_heads}, n], "
            f"got {physical.dtype} {tuple(physical.shape)}"
        )
    for name, t in (("counts", counts), ("tickets", tickets)):
        if t.shape != (batch, num_kv_heads) or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(
                f"selection.{name} must be a contiguous int32 [B, Hkv]={(batch, num_kv_heads)} tensor, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if physical.stride(2) != 1 or physical.stride(0) != num_kv_heads * physical.stride(1):
        raise ValueError(
            f"selection.physical must be [B * Hkv] rows of stride 1, got strides {physical.stride()}"
        )
    _checks.check_device(physical=physical, counts=counts, tickets=tickets)
    if physical.device != device:
        raise ValueError(f"selection is on {physical.device} but q is on {device}")


def decode_attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    selection: PageSelection | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Exact softmax attention of one query token per sequence over its selected pages (one launch).

    Args:
        q: [B, Hq, D] in the cache dtype; heads h*G .. h*G+G-1 belong to KV head h.
        k_pages, v_pages: [num_pages, Hkv, page_size, D] float32/float16/bfloat16, any strides with a
            contiguous last dimension (e.g. the K and V halves of one pool).
        block_table: int32/int64 [B, P] logical -> physical page; seq_len: int32/int64 [B] tokens
            in the cache (the current token included).
        selection: a :class:`PageSelection` (from :func:`sparrow_kernels.page_selection`, or built
            by hand: ascending pages, zeroed tickets), or None for every page (dense decode).
        scale: softmax scale, default 1/sqrt(D).
        num_splits: splits per (sequence, KV head); default :func:`default_num_splits`.
        pages_per_iter (power of two, default :func:`default_pages_per_iter`), num_warps (default 4,
            8 for >= 64 query rows), num_stages (pipeline depth; 3 double-buffers K and V): launch
            knobs the benchmark sweeps.

    Returns:
        [B, Hq, D] in q.dtype; float32 softmax and accumulation (the probabilities are rounded to
        the cache dtype for the P.V tensor-core product); zeros for a row with seq_len 0.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    out = paged_attention(q[:, None], k_pages, v_pages, block_table, seq_len, selection, scale, num_splits,
                          pages_per_iter, num_warps, num_stages)  # fmt: skip
    return out[:, 0]


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
    """:func:`decode_attention_paged` over given *logical* page lists (e.g. ``select_pages_paged``'s).

    For callers that hold logical lists: translates them to physical ids with one gather through the
    block table and zeroes the merge tickets (a few small torch ops); :func:`page_selection` already
    returns both, so the fused path skips this.

    Args:
        page_idx: int32/int64 [B, Hkv, n] logical pages, ascending, the first counts[b, h] valid;
        counts: integer [B, Hkv]; the rest as :func:`decode_attention_paged`.
    """
    if (
        page_idx.dim() != 3
        or page_idx.shape[0] != block_table.shape[0]
        or page_idx.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"page_idx must be an int32/int64 [B, Hkv, n] tensor, got {page_idx.dtype} {tuple(page_idx.shape)}"
        )
    physical = torch.gather(block_table, 1, page_idx.long().clamp(min=0).flatten(1)).view(page_idx.shape)
    counts = counts.to(torch.int32).contiguous()
    selection = PageSelection(page_idx, counts, physical.to(torch.int32), torch.zeros_like(counts))
    return decode_attention_paged(q, k_pages, v_pages, block_table, seq_len, selection, scale, num_splits)


def sparse_decode_attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    landmarks: Landmarks,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: int | torch.Tensor,
    page_size: int = 16,
    sink_pages: int = 1,
    local_pages: int = 2,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Sparrow sparse decode attention on the paged cache: select pages, then attend (scale 1/sqrt(D)).

    Two launches (selection, attention with its merge fused); one when ``budget_tokens`` is an int
    covering the block table's capacity (dense layers, the dense schedule: no landmark is read),
    plus a counter memset if that dense call splits. Every launch is CUDA-graph capturable.

    Args:
        q: [B, Hq, D] in the cache dtype; k_pages, v_pages: [num_pages, Hkv, page_size, D];
        landmarks: centroids [num_pages, Hkv, D] float32 or the cache dtype, or
        :class:`~sparrow_kernels.KeyBounds` (``page_score="minmax"``: key_min, key_max of that shape,
        scored by :func:`~sparrow_kernels.page_selection`'s key-bound rule); block_table: int32/int64 [B, P];
        seq_len: int32/int64 [B] tokens (the current token included); budget_tokens: int or
        int32/int64 [B] tokens.

    Returns:
        [B, Hq, D] in q.dtype. Equals dense attention for rows whose budget covers the sequence.
    """
    _checks.check_page_args(page_size, sink_pages, local_pages, cache_page_size=k_pages.shape[2])
    capacity = block_table.shape[1] * page_size if block_table.dim() == 2 else 0
    if isinstance(budget_tokens, int) and not isinstance(budget_tokens, bool) and budget_tokens >= capacity:
        num_pages, num_kv_heads, _, head_dim = _checks.check_pages(k_pages, v_pages)
        _checks.check_landmarks(landmarks, num_pages, num_kv_heads, head_dim)
        selection = None
    else:
        selection = page_selection(q, landmarks, block_table, seq_len, budget_tokens, page_size, sink_pages,
                                   local_pages)  # fmt: skip
    return decode_attention_paged(q, k_pages, v_pages, block_table, seq_len, selection, num_splits=num_splits)
