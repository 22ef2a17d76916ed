"""The dense verify pass of speculative rollout, and the cache repair after it.

``verify_forward`` runs T = k + 1 tokens per sequence (the pending token and the k drafts) through every
layer densely and without the LoRA adapter (the dense policy): per layer their keys and values overwrite
the draft's at the same positions of the paged cache, then causal attention of the T queries over the
cache (query i of a row sees cache positions 0 .. start + i). Two attention backends with one contract:

- :class:`TorchVerify`: on the CPU with an fp32 cache the compiled kernel
  :func:`~sparrow_nemo.rollout.torch.cpu_attention.paged_verify_attention` (reads the paged cache in place, each key
  and value once for all T * G queries of its KV head); elsewhere :func:`verify_attention_torch`, the cache as
  contiguous keys/values and one masked SDPA of the T * G queries of each KV head (fp32, scale 1/sqrt(D));
- :class:`KernelVerify`: ``sparrow_kernels.verify_attention_paged`` (Triton, GQA-aware, reads each K/V
  tile once for all T queries), which needs every row's pages reserved up to ``start + T``.

After the acceptance test only the accepted prefix stays: :func:`rebuild_landmarks` recomputes the
landmarks (centroid, or key bounds: these cannot be "un-averaged") of every page the round wrote from its
keys below the new length, so they equal those of a cache that never saw the rejected tokens; their keys/values beyond the new
length are ignored by every reader (masked by the sequence length) and overwritten by later tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

import sparrow_nemo.rollout.torch.cpu_attention as cpu_attention
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder


class VerifyAttention(Protocol):
    """``attend(q [B, T, Hq, D], cache, layer, block_table, start [B], num_queries [B]) -> [B, T, Hq, D]``:
    query i of row b at cache position ``start[b] + i`` attends to positions 0 .. start[b] + i (their K/V
    already stored); only the first ``num_queries[b]`` queries of a row are real (the others' outputs are
    meaningless and a backend may leave their positions unread)."""

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        start: torch.Tensor,
        num_queries: torch.Tensor,
    ) -> torch.Tensor: ...


def verify_attention_torch(
    q: torch.Tensor, cache: PagedKVCache, layer: int, block_table: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """The plain-torch verify attention: the cache as contiguous keys and values (every row up to
    ``start + T``), one masked SDPA of the T * G queries of each KV head (each key read once for all of them).
    ``q [B, T, Hq, D]`` -> ``[B, T, Hq, D]`` in q.dtype."""
    batch, t, hq, d = q.shape
    k_all, v_all = cache.contiguous(layer, block_table, start + t)  # [B, Hkv, L, D]
    hkv, length = k_all.shape[1], k_all.shape[2]
    group = hq // hkv
    q_pos = start[:, None] + torch.arange(t, device=q.device)  # [B, T]
    visible = torch.arange(length, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, T, L]
    mask = visible[:, :, None, :].expand(batch, t, group, length).reshape(batch, 1, t * group, length)
    qg = q.view(batch, t, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(batch, hkv, t * group, d)
    # slots past a row's visible range (its rejected drafts, pages of other rows) hold finite keys and
    # values written by the model (pools start at zero) and get probability exactly 0
    out = F.scaled_dot_product_attention(qg.float(), k_all.float(), v_all.float(), attn_mask=mask)
    return out.view(batch, hkv, t, group, d).permute(0, 2, 1, 3, 4).reshape(batch, t, hq, d).to(q.dtype)


class TorchVerify:
    """The verify attention of the torch backend: the compiled CPU kernel where it takes the tensors
    (:func:`~sparrow_nemo.rollout.torch.cpu_attention.supports`: CPU, fp32), else :func:`verify_attention_torch`."""

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        start: torch.Tensor,
        num_queries: torch.Tensor,
    ) -> torch.Tensor:
        if cpu_attention.supports(q, cache):
            return cpu_attention.paged_verify_attention(q, cache, layer, block_table, start, num_queries)
        return verify_attention_torch(q, cache, layer, block_table, start)


class KernelVerify:
    """``sparrow_kernels.verify_attention_paged`` over the engine's page pools (one launch per layer)."""

    def __init__(self) -> None:
        from sparrow_kernels import verify_attention_paged

        self._attend = verify_attention_paged

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        start: torch.Tensor,
        num_queries: torch.Tensor,
    ) -> torch.Tensor:
        """Every query of every row (``num_queries`` unused: the pages are reserved up to ``start + T``)."""
        k_pages = cache.k_pages[layer]
        out = self._attend(
            q.to(k_pages.dtype), k_pages, cache.v_pages[layer], block_table, start + q.shape[1]
        )
        return out.to(q.dtype)


def token_slots(
    cache: PagedKVCache, block_table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Where the valid tokens of ``positions [B, T]`` (``valid [B, T]``, pages reserved) live: (row, column,
    physical page, slot), each [N] int64 - the same for every layer."""
    rows, cols = torch.nonzero(valid, as_tuple=True)
    pos = positions[rows, cols]
    return rows, cols, block_table[rows, pos // cache.page_size].long(), pos % cache.page_size


def write_tokens(
    cache: PagedKVCache, layer: int, slots: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the keys/values ``k, v [B, T, Hkv, D]`` at ``slots`` (:func:`token_slots`); landmarks are left
    alone (:func:`rebuild_landmarks` repairs them after the acceptance test)."""
    rows, cols, page, slot = slots
    cache.k_pages[layer][page, :, slot] = k[rows, cols].to(cache.k_pages[layer].dtype)
    cache.v_pages[layer][page, :, slot] = v[rows, cols].to(cache.v_pages[layer].dtype)


def rebuild_landmarks(
    cache: PagedKVCache, block_table: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> None:
    """Landmarks of the pages holding positions ``start .. length - 1`` of each row, every layer, from the
    page's keys at positions below ``length [B]`` (``start [B]``; rows with length <= start are left alone)
    (:meth:`PagedKVCache.refresh`): the centroid is their fp32 mean rounded once to the centroid dtype, the
    key bounds their per-channel min and max - what appending those keys one by one gives."""
    ps = cache.page_size
    first = start // ps
    span = int(((length - 1) // ps - first).max()) + 1 if length.numel() else 0
    if span <= 0:
        return
    logical = first[:, None] + torch.arange(span, device=start.device)[None, :]  # [B, span]
    count = torch.clamp(length[:, None] - logical * ps, min=0, max=ps)  # keys below length per page
    used = (count > 0) & (length > start)[:, None]
    rows, cols = torch.nonzero(used, as_tuple=True)
    phys = block_table[rows, logical[rows, cols]].long()
    for layer in range(len(cache.k_pages)):
        cache.refresh(layer, phys, count[rows, cols])


def verify_forward(
    model: Qwen3Decoder,
    attention: VerifyAttention,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    tokens: torch.Tensor,
    start: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """Dense forward of ``tokens [B, T]`` int64 at positions ``start[b] + i`` (``start [B]`` = tokens cached
    before them); ``valid [B, T]`` marks real tokens (a row's padding is neither stored nor meaningful).

    The LoRA adapter is off (the dense policy). Pages must be reserved for every valid position (and up to
    ``start + T`` for :class:`KernelVerify`). Returns logits ``[B, T, V]`` fp32: entry i predicts the token
    after ``tokens[:, i]``.
    """
    positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    num_queries = valid.sum(dim=1)
    adapter, model.lora = model.lora, None
    try:
        h = model.embed(tokens)
        rope = model.rope(positions, h.dtype)  # once for every layer
        slots = token_slots(cache, block_table, positions, valid)
        for layer in range(model.shape.num_layers):
            q, k, v = model.attention_inputs(layer, h, positions, rope)
            write_tokens(cache, layer, slots, k, v)
            attn = attention.attend(q, cache, layer, block_table, start, num_queries)
            h = model.attention_output(layer, h, attn)
        return model.logits(h)
    finally:
        model.lora = adapter
