"""Attention for the torch rollout engine: dense causal prefill, and decode over the paged KV cache.

Decode has two implementations with the same semantics (sparrow_nemo.sparse.attention):
- ``torch``: the method layer's page selection on the cache's incrementally maintained landmarks
  (``select_pages_from_centroids``, or ``select_pages_from_key_bounds`` for a ``minmax`` cache); on the CPU
  (fp32) a compiled kernel (``cpu_attention``) makes the same choice and reads the chosen pages in place,
  elsewhere they are gathered per (sequence, KV head) into the method layer's masked decode attention;
- ``triton``: the fused kernels of ``sparrow_kernels`` (select + attend in one call).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import sparrow_nemo.rollout.torch.cpu_attention as cpu_attention
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.sparse.attention import (
    decode_attention,
    select_pages_from_centroids,
    select_pages_from_key_bounds,
)
from sparrow_nemo.sparse.schedule import DENSE_BUDGET

log = logging.getLogger(__name__)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
    """Dense causal attention over a right-padded batch (prefill chunks and teacher-forced scoring).

    Right padding needs no length mask: a valid query (position < its sequence's length) only sees
    keys at or before it, all valid. A whole-sequence call (q_offset 0, Tq == Tk) takes SDPA's
    ``is_causal`` kernel (no mask tensor); a later chunk one [Tq, Tk]
    causal mask shared by the batch.

    Args:
        q: [B, Tq, Hq, D] queries at positions q_offset .. q_offset + Tq - 1;
        k, v: [B, Tk, Hkv, D] keys/values at positions 0 .. Tk - 1 (GQA: Hq a multiple of Hkv),
            finite at padded positions too (a masked weight is 0, and 0 * NaN is NaN).

    Returns:
        [B, Tq, Hq, D] in q.dtype, scale 1/sqrt(D). Rows at padded positions are finite but meaningless.
    """
    tq, hq, tk = q.shape[1], q.shape[2], k.shape[1]
    group = hq // k.shape[2]
    whole = q_offset == 0 and tq == tk
    mask = None
    if not whole:
        q_pos = torch.arange(q_offset, q_offset + tq, device=q.device)
        mask = torch.arange(tk, device=q.device)[None, :] <= q_pos[:, None]  # [Tq, Tk]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2).repeat_interleave(group, dim=1),
        v.transpose(1, 2).repeat_interleave(group, dim=1),
        attn_mask=mask,
        is_causal=whole,
    )
    return out.transpose(1, 2)


def all_pages(seq_len: torch.Tensor, num_kv_heads: int, page_size: int) -> torch.Tensor:
    """Every page of every sequence: [B, Hkv, n_max] int64 logical indices, -1 padded."""
    n_pages = (seq_len.to(torch.int64) + page_size - 1) // page_size
    idx = torch.arange(int(n_pages.max()), device=seq_len.device)[None, :]
    idx = torch.where(idx < n_pages[:, None], idx, -1)
    return idx[:, None, :].expand(-1, num_kv_heads, -1)


def decode_attention_torch(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budget_tokens: torch.Tensor | None,
    sink_pages: int = 1,
    local_pages: int = 2,
) -> torch.Tensor:
    """One decode step of attention over the paged cache (the current token already appended).

    The page choice is the method layer's for the cache's page score (``select_pages_from_centroids`` on its
    incremental centroids, ``select_pages_from_key_bounds`` on its key bounds), batched over rows and KV
    heads. On the CPU with an fp32 cache the compiled kernel makes the same choice and reads the chosen pages
    in place (:func:`~sparrow_nemo.rollout.torch.cpu_attention.sparse_decode_attention`); elsewhere they are
    gathered (:meth:`PagedKVCache.gather`) into the method layer's masked attention.

    Args:
        q: [B, Hq, D]; block_table: [B, max_pages] int32; seq_len: [B] tokens incl. the current one;
        budget_tokens: [B] tokens for the sparse rule, or None for dense (all pages).

    Returns:
        [B, Hq, D] in q.dtype (softmax in fp32, scale 1/sqrt(D)).
    """
    ps, hkv = cache.page_size, cache.k_pages[layer].shape[1]
    if cpu_attention.supports(q, cache):
        if budget_tokens is None:
            return cpu_attention.paged_decode_attention(q, cache, layer, block_table, seq_len, None)
        return cpu_attention.sparse_decode_attention(
            q, cache, layer, block_table, seq_len, budget_tokens, sink_pages, local_pages
        )[0]
    if budget_tokens is None:
        page_idx = all_pages(seq_len, hkv, ps)
    elif cache.page_score == "minmax":
        k_min, k_max = cache.gather_key_bounds(layer, block_table, seq_len)
        page_idx = select_pages_from_key_bounds(
            q, k_min, k_max, seq_len, budget_tokens, ps, sink_pages, local_pages
        )
    else:
        cent = cache.gather_centroids(layer, block_table, seq_len)
        page_idx = select_pages_from_centroids(q, cent, seq_len, budget_tokens, ps, sink_pages, local_pages)
    k, v, positions = cache.gather(layer, block_table, page_idx)
    mask = (positions >= 0) & (positions < seq_len[:, None, None])
    return decode_attention(q, k, v, mask)


class TorchDecode:
    """The plain-torch path: :meth:`PagedKVCache.append` (one kernel call on the CPU) and
    :func:`decode_attention_torch`."""

    def append(
        self,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> None:
        """Store one token per row at ``positions [B]``; ``k_new, v_new [B, Hkv, D]``."""
        if cpu_attention.supports(k_new, cache):
            cpu_attention.paged_append(cache, layer, block_table, positions, k_new, v_new)
        else:
            cache.append(layer, block_table, positions, k_new, v_new)

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        seq_len: torch.Tensor,
        budget_tokens: torch.Tensor | None,
        sink_pages: int,
        local_pages: int,
    ) -> torch.Tensor:
        """:func:`decode_attention_torch`: ``q [B, Hq, D]`` -> ``[B, Hq, D]``; None = dense."""
        return decode_attention_torch(
            q, cache, layer, block_table, seq_len, budget_tokens, sink_pages, local_pages
        )


class KernelDecode:
    """The fused ``sparrow_kernels`` path: append with landmark update, and select + attend."""

    def __init__(self) -> None:
        import sparrow_kernels

        self._k = sparrow_kernels

    def _landmarks(self, cache: PagedKVCache, layer: int):
        """What the kernels score pages by: the centroids, or a minmax cache's ``sparrow_kernels.KeyBounds``."""
        if cache.page_score == "minmax":
            return self._k.KeyBounds(cache.key_min[layer], cache.key_max[layer])
        return cache.centroids[layer]

    def append(
        self,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> None:
        """Kernel version of :meth:`PagedKVCache.append`."""
        self._k.append_kv(
            cache.k_pages[layer],
            cache.v_pages[layer],
            self._landmarks(cache, layer),
            block_table,
            positions,
            k_new.to(cache.k_pages[layer].dtype),
            v_new.to(cache.v_pages[layer].dtype),
        )

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        seq_len: torch.Tensor,
        budget_tokens: torch.Tensor | None,
        sink_pages: int,
        local_pages: int,
    ) -> torch.Tensor:
        """Kernel version of :func:`decode_attention_torch`; None = dense (every page, no scoring pass).
        Two launches (one for dense); int64 lengths and budgets are read as they are, no casts."""
        budget = DENSE_BUDGET if budget_tokens is None else budget_tokens
        return self._k.sparse_decode_attention_paged(
            q,
            cache.k_pages[layer],
            cache.v_pages[layer],
            self._landmarks(cache, layer),
            block_table,
            seq_len,
            budget,
            page_size=cache.page_size,
            sink_pages=sink_pages,
            local_pages=local_pages,
        )


def decode_attention_backend(backend: str, page_score: str) -> TorchDecode | KernelDecode:
    """The decode-attention object of a resolved ``backend`` (:func:`choose_backend`) for a cache of
    ``page_score``; the fused kernels take ``minmax`` only where ``sparrow_kernels`` has ``KeyBounds``."""
    if backend != "triton":
        return TorchDecode()
    kernels = KernelDecode()
    if page_score == "minmax" and not hasattr(kernels._k, "KeyBounds"):
        raise ValueError(
            "page_score='minmax' on the triton backend needs sparrow_kernels with key bounds (KeyBounds); "
            "use attention_backend='torch'"
        )
    return kernels


_LOGGED: set[tuple[str, str]] = set()


def _kernels_ready(device: torch.device) -> tuple[bool, str]:
    """Whether sparrow_kernels can run on ``device``, and why not."""
    try:
        import sparrow_kernels
    except ImportError as exc:
        return False, f"sparrow_kernels is not importable ({exc})"
    available = getattr(sparrow_kernels, "available", None)
    if available is None:
        return False, "sparrow_kernels has no available() (kernels not installed)"
    if not available(device):
        return False, f"sparrow_kernels.available({device}) is False"
    return True, "fused kernels"


def choose_backend(requested: str, device: torch.device) -> str:
    """Resolve ``"auto" | "torch" | "triton"`` for ``device`` and log the choice once per process.

    ``auto`` takes the fused kernels on CUDA when ``sparrow_kernels.available(device)``, else torch.
    ``triton`` insists on the kernels (raises when unavailable; on CPU it needs TRITON_INTERPRET=1).
    """
    if requested not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got '{requested}'")
    if requested == "torch":
        chosen, why = "torch", "requested"
    elif requested == "auto" and device.type != "cuda":
        chosen, why = "torch", f"no fused decode on {device.type}"
    else:
        ok, why = _kernels_ready(device)
        if not ok and requested == "triton":
            raise RuntimeError(f"attention_backend='triton' but the kernels cannot run on {device}: {why}")
        chosen = "triton" if ok else "torch"
    key = (str(device), chosen)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("rollout decode attention on %s: %s (%s)", device, chosen, why)
    return chosen
