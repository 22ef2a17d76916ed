"""Several new tokens per sequence through the model over the paged cache: the speculative verify, and the
recompute of a preempted sequence.

:func:`forward_tokens` runs T tokens per row (``tokens [B, T]`` at positions ``start[b] + i``) through every
layer: per layer their keys and values are written at their positions of the paged cache (landmarks untouched),
then every query attends to the cache up to its own position with the row's attention rule:

- dense (the speculative verify, :class:`TorchVerify` / :class:`KernelVerify`): causal attention over the
  cache. :class:`TorchVerify`: on the CPU with an fp32 cache the compiled kernel
  :func:`~sparrow_nemo.rollout.torch.cpu_attention.paged_verify_attention` (each key and value read once for all
  T * G queries of its KV head), elsewhere :func:`verify_attention_torch` (one masked SDPA); :class:`KernelVerify`:
  ``sparrow_kernels.verify_attention_paged`` (Triton), which needs every row's pages up to ``start + T``;
- each query as a decode step (:class:`DecodeRule`, a preempted sequence's recompute): query i of row b is the
  decode query at cached length ``start[b] + i + 1`` with its own KV budget, exactly what decoding the tokens one
  by one computed. The landmarks of the pages the layer's new keys touched are rebuilt first (layer by layer).
  A query never scores its page or the one before (they are its local window), and every earlier page is
  complete, so writing the later tokens' keys first changes no page choice; this needs ``local_pages >= 1``.

After a speculative acceptance test only the accepted prefix stays: :func:`rebuild_landmarks` recomputes the
landmarks (centroid, or key bounds: these cannot be "un-averaged") of every page the round wrote from its keys
below the new length, so they equal those of a cache that never saw the rejected tokens; their keys/values
beyond the new length are ignored by every reader (masked by the sequence length) and overwritten later.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

import sparrow_nemo.rollout.torch.cpu_attention as cpu_attention
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder


class TokensAttention(Protocol):
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


def touched_pages(
    cache: PagedKVCache, block_table: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages holding positions ``start .. length - 1`` of each row (``start, length [B]``; rows with
    length <= start have none) -> (physical pages [N] int64, keys below ``length`` in each [N] int64)."""
    ps = cache.page_size
    first = start // ps
    span = int(((length - 1) // ps - first).max()) + 1 if length.numel() else 0
    if span <= 0:
        return torch.empty(0, dtype=torch.int64, device=start.device), torch.empty(
            0, dtype=torch.int64, device=start.device
        )
    logical = first[:, None] + torch.arange(span, device=start.device)[None, :]  # [B, span]
    count = torch.clamp(length[:, None] - logical * ps, min=0, max=ps)  # keys below length per page
    used = (count > 0) & (length > start)[:, None]
    rows, cols = torch.nonzero(used, as_tuple=True)
    return block_table[rows, logical[rows, cols]].long(), count[rows, cols]


def rebuild_landmarks(
    cache: PagedKVCache, block_table: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> None:
    """Landmarks of the pages holding positions ``start .. length - 1`` of each row, every layer, from the
    page's keys at positions below ``length [B]`` (``start [B]``; rows with length <= start are left alone)
    (:meth:`PagedKVCache.refresh`): the centroid is their fp32 mean rounded once to the centroid dtype, the
    key bounds their per-channel min and max - what appending those keys one by one gives."""
    phys, count = touched_pages(cache, block_table, start, length)
    if phys.numel():
        for layer in range(len(cache.k_pages)):
            cache.refresh(layer, phys, count)


class DecodeRule:
    """:class:`TokensAttention` that attends each query as a decode step would (see the module docstring).

    Args:
        decode: the engine's decode-attention backend (``attend(q [N, Hq, D], cache, layer, table [N, P],
            seq_len [N], budgets [N] | None, sink, local)``).
        dense: the causal attention of the dense layers (every query sees its whole prefix: the same result as
            the decode path's dense attention, each key read once for all the row's queries).
        budgets: [B, T] int64 KV budget of each query, or None (every layer dense).
        dense_layers, sink_pages, local_pages: the sparse rule's constants.
    """

    def __init__(
        self,
        decode,
        dense: TokensAttention,
        budgets: torch.Tensor | None,
        dense_layers: int,
        sink_pages: int,
        local_pages: int,
    ) -> None:
        if budgets is not None and local_pages < 1:
            raise ValueError(
                "a sparse recompute needs local_pages >= 1 (a query's own page must not be scored)"
            )
        self.decode, self.dense, self.budgets = decode, dense, budgets
        self.dense_layers, self.sink_pages, self.local_pages = dense_layers, sink_pages, local_pages

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        start: torch.Tensor,
        num_queries: torch.Tensor,
    ) -> torch.Tensor:
        if self.budgets is None or layer < self.dense_layers:
            return self.dense.attend(q, cache, layer, block_table, start, num_queries)
        phys, count = touched_pages(cache, block_table, start, start + num_queries)
        if phys.numel():  # the new keys' pages get their landmarks before any query scores them
            cache.refresh(layer, phys, count)
        t = q.shape[1]
        rows, cols = torch.nonzero(
            torch.arange(t, device=q.device)[None, :] < num_queries[:, None], as_tuple=True
        )
        out = torch.zeros_like(q)
        out[rows, cols] = self.decode.attend(
            q[rows, cols],
            cache,
            layer,
            block_table.index_select(0, rows),
            start[rows] + cols + 1,
            self.budgets[rows, cols],
            self.sink_pages,
            self.local_pages,
        )
        return out


def forward_tokens(
    model: Qwen3Decoder,
    attention: TokensAttention,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    tokens: torch.Tensor,
    start: torch.Tensor,
    valid: torch.Tensor,
    logits: bool = True,
) -> torch.Tensor | None:
    """Forward of ``tokens [B, T]`` int64 at positions ``start[b] + i`` (``start [B]`` = tokens cached before
    them); ``valid [B, T]`` marks real tokens (a row's padding is neither stored nor meaningful).

    The model's LoRA adapter applies as it is set (the verify turns it off). Pages must be held for every valid
    position (and up to ``start + T`` for :class:`KernelVerify`). Returns logits ``[B, T, V]`` fp32 (entry i
    predicts the token after ``tokens[:, i]``), or None when ``logits=False``.
    """
    positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    num_queries = valid.sum(dim=1)
    h = model.embed(tokens)
    rope = model.rope(positions, h.dtype)  # once for every layer
    slots = token_slots(cache, block_table, positions, valid)
    for layer in range(model.shape.num_layers):
        q, k, v = model.attention_inputs(layer, h, positions, rope)
        write_tokens(cache, layer, slots, k, v)
        attn = attention.attend(q, cache, layer, block_table, start, num_queries)
        h = model.attention_output(layer, h, attn)
    return model.logits(h) if logits else None
