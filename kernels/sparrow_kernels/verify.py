"""Dense attention of the speculative verify pass: k + 1 query tokens per sequence over the paged cache.

Speculative rollout (sparse draft, dense verify) scores the k drafted tokens and the token after
them in one dense forward of T = k + 1 positions. Their keys and values are appended to the cache
first, so query i (0-based among the T) sits at cache position seq_len - T + i and attends to
positions 0 .. seq_len - T + i: every cached token before the T, and causally among them.

It runs the decode attention kernel (``sparrow_kernels.decode``) with T * G query rows per KV head:
each K/V tile of the cache is read once per KV head for all T tokens and all G heads of its GQA
group, so one verify reads the cache about as often as one dense decode step.
"""

from __future__ import annotations

import torch

from sparrow_kernels.decode import NUM_STAGES, paged_attention


def verify_attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Causal dense attention of the last T tokens of every sequence over its paged KV cache.

    Args:
        q: [B, T, Hq, D] queries (after q norm and rotary) of the T = k + 1 newest tokens of each
            sequence, in the cache dtype; heads h*G .. h*G+G-1 belong to KV head h.
        k_pages, v_pages: [num_pages, Hkv, page_size, D] float32/float16/bfloat16 pools holding those
            T tokens already (the decode kernels' layout; any strides with a contiguous last dim).
        block_table: int32/int64 [B, P] logical -> physical page.
        seq_len: int32/int64 [B] tokens in the cache, the T new ones included (>= T; a row with
            seq_len 0 is idle and gets zeros).
        scale: softmax scale, default 1/sqrt(D).
        num_splits, pages_per_iter, num_warps, num_stages: launch knobs, as for
            :func:`sparrow_kernels.decode_attention_paged` (default splits fill the GPU).

    Returns:
        [B, T, Hq, D] in q.dtype: out[b, i] attends to cache positions 0 .. seq_len[b] - T + i
        (float32 softmax, probabilities rounded to the cache dtype for the P.V product).
        One launch (plus a counter memset when the call splits); CUDA-graph capturable.
    """
    return paged_attention(q, k_pages, v_pages, block_table, seq_len, None, scale, num_splits, pages_per_iter,
                           num_warps, num_stages)  # fmt: skip
