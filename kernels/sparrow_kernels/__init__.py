"""sparrow_kernels: Triton kernels for Sparrow sparse decode attention over a paged KV cache.

Public API (reference semantics in ``sparrow_nemo.sparse.attention``; cache layout below):

- ``append_kv``: write a decoded token's K/V into its page and recompute the page's landmarks.
- ``page_selection`` -> ``PageSelection``: GQA-mean query x page landmarks, sink + local + top-k
  pages (logical and physical ids), one launch; ``select_pages_paged``: its (page_idx, counts).
- ``KeyBounds``: per-page key_min / key_max, passed where centroids go to score pages with
  ``page_score="minmax"`` (:mod:`sparrow_kernels.landmarks`).
- ``decode_attention_paged``: one query token per sequence over a selection's pages (or every
  page), split-K flash-decoding with the merge fused, one launch.
- ``sparse_decode_attention_paged``: selection and attention in one call (two launches).
- ``sparse_decode_paged``: attention over given logical page lists (translated with one gather).
- ``verify_attention_paged``: causal dense attention of the k + 1 newest tokens per sequence
  (speculative decoding's verify pass), one launch.
- ``available(device)``: whether the kernels can run there (CUDA, or CPU under TRITON_INTERPRET=1).
- ``recorded_launches()``: record instead of run the launches of a block (launch counts, AOT).

Layout every entry point takes as plain tensors (no engine object): k_pages, v_pages
[num_pages, Hkv, page_size, D] in float32/float16/bfloat16 with any strides on the first three
dimensions and a contiguous last one (so the K and V halves of one pool laid out
[num_pages, 2, Hkv, page_size, D] work as ``pool[:, 0]``, ``pool[:, 1]``); centroids (or
KeyBounds' key_min and key_max) [num_pages, Hkv, D] in float32 or the cache dtype, last dim
contiguous; block_table int32/int64
[B, P] (logical page -> physical page, row stride free, last dim contiguous; entries past a
sequence's pages are never read); seq_len, positions, budgets int32/int64 [B] contiguous. Token t
of sequence b lives in page block_table[b, t // page_size], slot t % page_size.

``python -m sparrow_kernels.aot`` compiles every kernel for sm_90 without a GPU (resource report).

The kernel modules import triton lazily (on first use of a kernel name), so ``available`` works
where triton is not installed. Set TRITON_INTERPRET=1 before importing this package to run the
kernels on CPU tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

from sparrow_kernels._runtime import INTERPRETED, available, recorded_launches
from sparrow_kernels.landmarks import KeyBounds

_LAZY = {
    "append_kv": "sparrow_kernels.append",
    "PageSelection": "sparrow_kernels.selection",
    "page_selection": "sparrow_kernels.selection",
    "select_pages_paged": "sparrow_kernels.selection",
    "default_num_splits": "sparrow_kernels.decode",
    "decode_attention_paged": "sparrow_kernels.decode",
    "sparse_decode_attention_paged": "sparrow_kernels.decode",
    "sparse_decode_paged": "sparrow_kernels.decode",
    "verify_attention_paged": "sparrow_kernels.verify",
}

__all__ = ["INTERPRETED", "KeyBounds", "available", "recorded_launches", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sparrow_kernels' has no attribute '{name}'")
    try:
        module = importlib.import_module(_LAZY[name])
    except ImportError as exc:
        if exc.name != "triton":
            raise
        raise ImportError(
            f"sparrow_kernels.{name} needs triton; install it with: pip install 'sparrow-nemo[kernels]'"
        ) from exc
    return getattr(module, name)
