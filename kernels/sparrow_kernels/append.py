"""Append one decoded token's key and value to the paged KV cache and update the page centroid.

Layout (shared with the reference rollout engine): k_pages, v_pages [num_pages, Hkv, page_size, D];
centroids float32 [num_pages, Hkv, D]; block_table [B, max_pages_per_seq] maps logical page
-> physical page. Token t of sequence b lives at physical page block_table[b, t // page_size],
slot t % page_size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow_kernels import _checks


@triton.jit
def _append_kv_kernel(
    k_pages, v_pages, centroids, block_table, positions, k_new, v_new,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_cp, stride_ch,
    stride_bt,
    stride_knb, stride_knh, stride_vnb, stride_vnh,
    D: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """One program per (sequence b, KV head h): store k, v at slot pos % PAGE; update the centroid."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(positions + b).to(tl.int64)
    if pos >= 0:
        slot = pos % PAGE
        phys = tl.load(block_table + b * stride_bt + pos // PAGE).to(tl.int64)
        d = tl.arange(0, D)
        k = tl.load(k_new + b * stride_knb + h * stride_knh + d).to(k_pages.dtype.element_ty)
        v = tl.load(v_new + b * stride_vnb + h * stride_vnh + d).to(v_pages.dtype.element_ty)
        tl.store(k_pages + phys * stride_kp + h * stride_kh + slot * stride_ks + d, k)
        tl.store(v_pages + phys * stride_vp + h * stride_vh + slot * stride_vs + d, v)
        # Running mean over the page's valid slots, of the key as stored (after rounding to the
        # cache dtype). Slot 0 starts the page afresh, so stale values of a reused page never leak.
        c_ptrs = centroids + phys * stride_cp + h * stride_ch + d
        k32 = k.to(tl.float32)
        c = tl.load(c_ptrs)
        c = tl.where(slot == 0, k32, c + (k32 - c) / (slot + 1).to(tl.float32))
        tl.store(c_ptrs, c)


def append_kv(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Write one new token per sequence into the paged cache, in place.

    Args:
        k_pages, v_pages: [num_pages, Hkv, page_size, D] float32/float16/bfloat16 cache pages.
        centroids: float32 [num_pages, Hkv, D]; the entry of the written page becomes the mean of
            its valid keys: c <- c + (k - c) / (slot + 1), and c <- k when the slot is 0.
        block_table: integer [B, max_pages_per_seq], logical -> physical page.
        positions: integer [B], the new token's index in its sequence (= old seq_len). A negative
            position skips that sequence (e.g. a finished one in a static batch).
        k_new, v_new: [B, Hkv, D] the token's key (after q/k norm and rotary) and value, any float
            dtype; they are rounded to the cache dtype when stored.

    The physical page must already be allocated in block_table; positions must lie below
    max_pages_per_seq * page_size (not checked on the device, to avoid a sync).
    """
    num_pages, num_kv_heads, page_size, head_dim = _checks.check_pages(k_pages, v_pages)
    _checks.check_centroids(centroids, num_pages, num_kv_heads, head_dim)
    _checks.check_block_table(block_table)
    batch = block_table.shape[0]
    _checks.check_per_seq("positions", positions, batch)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (batch, num_kv_heads, head_dim) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be a float [B, Hkv, D]={(batch, num_kv_heads, head_dim)} tensor, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    _checks.check_device(
        k_pages=k_pages, v_pages=v_pages, centroids=centroids, block_table=block_table,
        positions=positions, k_new=k_new, v_new=v_new,
    )  # fmt: skip
    _checks.check_last_dim_contiguous(
        k_pages=k_pages, v_pages=v_pages, centroids=centroids, block_table=block_table
    )
    _checks.check_last_dim_contiguous(k_new=k_new, v_new=v_new, positions=positions)
    if batch == 0:
        return
    _append_kv_kernel[(batch, num_kv_heads)](
        k_pages, v_pages, centroids, block_table, positions, k_new, v_new,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        centroids.stride(0), centroids.stride(1),
        block_table.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        D=head_dim, PAGE=page_size,
    )  # fmt: skip
