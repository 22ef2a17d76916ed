"""sparrow_kernels: Triton kernels for Sparrow sparse decode attention over a paged KV cache.

Public API (cache layout in ``sparrow_nemo.rollout.paged_cache``, reference semantics in
``sparrow_nemo.sparse.attention``):

- ``append_kv``: write a decoded token's K/V into its page and update the page centroid.
- ``select_pages_paged``: GQA-mean query x page centroids, sink + local + top-k pages, sorted.
- ``sparse_decode_paged``: split-K flash-decoding over the selected pages, then a log-sum-exp merge.
- ``sparse_decode_attention_paged``: selection and attention in one call.
- ``available(device)``: whether the kernels can run there (CUDA, or CPU under TRITON_INTERPRET=1).

``python -m sparrow_kernels.aot`` compiles every kernel for sm_90 without a GPU (resource report).

The kernel modules import triton lazily (on first use of a kernel name), so ``available`` works
where triton is not installed. Set TRITON_INTERPRET=1 before importing this package to run the
kernels on CPU tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

from sparrow_kernels._runtime import INTERPRETED, available

_LAZY = {
    "append_kv": "sparrow_kernels.append",
    "page_scores_paged": "sparrow_kernels.selection",
    "select_from_scores": "sparrow_kernels.selection",
    "select_pages_paged": "sparrow_kernels.selection",
    "default_num_splits": "sparrow_kernels.decode",
    "merge_splits": "sparrow_kernels.decode",
    "sparse_decode_split": "sparrow_kernels.decode",
    "sparse_decode_paged": "sparrow_kernels.decode",
    "sparse_decode_attention_paged": "sparrow_kernels.decode",
}

__all__ = ["INTERPRETED", "available", *_LAZY]


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
