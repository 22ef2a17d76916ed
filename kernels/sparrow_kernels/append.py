"""Append one decoded token's key and value to the paged KV cache and update the page's landmarks.

Layout (shared with the reference rollout engine, ``sparrow_nemo.rollout.torch.paged_cache``): k_pages,
v_pages [num_pages, Hkv, page_size, D]; landmarks (:mod:`sparrow_kernels.landmarks`): centroids
[num_pages, Hkv, D], or key_min / key_max of that shape, in the key dtype (or float32); block_table
[B, max_pages_per_seq] maps logical page -> physical page. Token t of sequence b lives at physical
page block_table[b, t // page_size], slot t % page_size.

The landmarks are recomputed from the page's stored keys at every append (slots 0..slot), not
updated as a running value: a running mean kept in bfloat16 would round at every token, and
recomputed bounds always equal those of the stored keys (whatever was written or rolled back before).
The centroid is a float32 mean rounded once to the centroid dtype; the bounds are exact in any dtype.
Reading the page's keys costs page_size * D elements per (sequence, KV head), a few MB per layer at
batch 64: noise next to the attention's reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow_kernels import _checks
from sparrow_kernels._runtime import launch
from sparrow_kernels.landmarks import Landmarks, page_score_of


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x -> dtype, rounding to nearest even also under the interpreter (whose float32 ->
    bfloat16 cast truncates); on the GPU the bfloat16 branch equals ``cvt.rn.bf16.f32`` for finite x."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _append_kv_kernel(
    k_pages, v_pages, landmarks, key_max, block_table, positions, k_new, v_new,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_cp, stride_ch,
    stride_xp, stride_xh,
    stride_bt,
    stride_knb, stride_knh, stride_vnb, stride_vnh,
    D: tl.constexpr, PAGE: tl.constexpr, MINMAX: tl.constexpr,
):  # fmt: skip
    """One program per (sequence b, KV head h): store k, v at slot pos % PAGE; recompute the page's
    centroid, or with MINMAX its key bounds (``landmarks`` holds the centroids, or key_min)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(positions + b).to(tl.int64)
    if pos >= 0:
        slot = pos % PAGE
        phys = tl.load(block_table + b * stride_bt + pos // PAGE).to(tl.int64)
        d = tl.arange(0, D)
        k = tl.load(k_new + b * stride_knb + h * stride_knh + d).to(k_pages.dtype.element_ty)
        v = tl.load(v_new + b * stride_vnb + h * stride_vnh + d).to(v_pages.dtype.element_ty)
        page_k = k_pages + phys * stride_kp + h * stride_kh
        tl.store(page_k + slot * stride_ks + d, k)
        tl.store(v_pages + phys * stride_vp + h * stride_vh + slot * stride_vs + d, v)
        # Landmarks of the keys as stored: slots before this one from the page, this one from registers
        # (no read-after-write across threads). Slot 0 restarts the page, so stale keys never leak.
        s = tl.arange(0, PAGE)
        before = (s < slot)[:, None]
        earlier = tl.load(page_k + s[:, None] * stride_ks + d[None, :], mask=before, other=0.0)
        if MINMAX:
            kf = k.to(tl.float32)
            lo = tl.minimum(tl.min(tl.where(before, earlier.to(tl.float32), float("inf")), axis=0), kf)
            hi = tl.maximum(tl.max(tl.where(before, earlier.to(tl.float32), float("-inf")), axis=0), kf)
            tl.store(landmarks + phys * stride_cp + h * stride_ch + d, lo.to(landmarks.dtype.element_ty))
            tl.store(key_max + phys * stride_xp + h * stride_xh + d, hi.to(key_max.dtype.element_ty))
        else:
            total = tl.sum(earlier.to(tl.float32), axis=0) + k.to(tl.float32)
            mean = total / (slot + 1).to(tl.float32)
            tl.store(
                landmarks + phys * stride_cp + h * stride_ch + d, round_to(mean, landmarks.dtype.element_ty)
            )


def append_kv(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    landmarks: Landmarks,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Write one new token per sequence into the paged cache, in place (one launch).

    Args:
        k_pages, v_pages: [num_pages, Hkv, page_size, D] float32/float16/bfloat16 cache pages (any
            strides with the last dimension contiguous, e.g. views of one K/V pool).
        landmarks: centroids [num_pages, Hkv, D] in k_pages' dtype or float32: the entry of the
            written page becomes round(mean over slots 0..slot of the stored keys), computed in
            float32; or :class:`~sparrow_kernels.KeyBounds` (key_min, key_max of that shape and
            dtype rule): the written page's entries become the per-channel min / max over slots
            0..slot of the stored keys (exact).
        block_table: int32/int64 [B, max_pages_per_seq], logical -> physical page.
        positions: int32/int64 [B], the new token's index in its sequence (= old seq_len). A
            negative position skips that sequence (e.g. a finished one in a static batch).
        k_new, v_new: [B, Hkv, D] the token's key (after q/k norm and rotary) and value, any float
            dtype; they are converted to the cache dtype when stored.

    The physical page must already be allocated in block_table; positions must lie below
    max_pages_per_seq * page_size (not checked on the device, to avoid a sync).
    """
    num_pages, num_kv_heads, page_size, head_dim = _checks.check_pages(k_pages, v_pages)
    first, second = _checks.check_landmarks(
        landmarks, num_pages, num_kv_heads, head_dim, key_dtype=k_pages.dtype
    )
    _checks.check_block_table(block_table)
    batch = block_table.shape[0]
    _checks.check_per_seq("positions", positions, batch)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (batch, num_kv_heads, head_dim) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be a float [B, Hkv, D]={(batch, num_kv_heads, head_dim)} tensor, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    named = _checks.landmark_tensors(landmarks)
    _checks.check_device(
        k_pages=k_pages, v_pages=v_pages, **named, block_table=block_table,
        positions=positions, k_new=k_new, v_new=v_new,
    )  # fmt: skip
    _checks.check_last_dim_contiguous(k_pages=k_pages, v_pages=v_pages, **named, block_table=block_table)
    _checks.check_last_dim_contiguous(k_new=k_new, v_new=v_new, positions=positions)
    if batch == 0:
        return
    launch(
        _append_kv_kernel, (batch, num_kv_heads),
        k_pages, v_pages, first, second, block_table, positions, k_new, v_new,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        first.stride(0), first.stride(1),
        second.stride(0), second.stride(1),
        block_table.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        D=head_dim, PAGE=page_size, MINMAX=page_score_of(landmarks) == "minmax",
    )  # fmt: skip
