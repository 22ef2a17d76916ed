"""Page-landmark memory beside TensorRT-LLM's KV cache (plain torch; the manager class is in the plugin).

The "sparrow" algorithm scores pages by a landmark per page: the centroid (mean key, the paper's
``page_score="centroid"``) or the per-channel minimum and maximum key (``"minmax"``, after Quest). The
landmarks live next to the KV pool, are indexed by the same physical block ids, and are owned by the
KV-cache manager (``SparrowKVCacheManager`` in :mod:`~sparrow_nemo.rollout.trtllm.plugin`, RocketKV's
pattern: ``tensorrt_llm/_torch/attention_backend/sparse/rocket.py`` ``RocketKVCacheManager`` allocates its
``kt_cache`` in ``__init__`` and overrides the static ``get_cache_size_per_token`` so that the KV-cache
budget counts it). This module holds what needs no TensorRT-LLM:

- :func:`centroid_bytes_per_token`: what one cached token costs in landmarks (added to the manager's
  per-token KV bytes, so the memory estimate sizes the pool with the landmarks counted; twice the
  centroid bytes under minmax);
- :class:`LandmarkPool`: float32 ``[num_blocks, Hkv, D]`` per sparse layer (two under minmax: a
  ``sparrow_kernels.KeyBounds``), allocated at once for all of them when the manager is built (its
  ``blocks_in_primary_pool``), freed with it;
- :func:`context_token_positions`: request row and position of every context token of a step.

No method here reads a device value on the host (no ``.item()``, ``.tolist()``, ``int()``/``bool()`` of
a device tensor) and every output has a static shape: the per-layer calls are CUDA-graph capturable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from sparrow_kernels.landmarks import KeyBounds, Landmarks

from sparrow_nemo.sparse.pattern import landmarks_per_page

#: landmark dtype (centroids and key bounds). ``sparrow_kernels`` also accepts centroids in the key dtype (``_checks.check_centroids``),
#: which would halve their bytes, but :meth:`LandmarkPool.append` keeps a running mean, which needs float32
#: (bf16 would need the page's stored keys re-read at each append, as ``sparrow_kernels.append_kv`` does).
#: Key bounds would be exact in the KV dtype; they are float32 too, so that one constant sizes both.
CENTROID_DTYPE = torch.float32


def centroid_bytes_per_token(
    num_sparse_layers: int, num_kv_heads: int, head_dim: int, page_size: int, page_score: str = "centroid"
) -> float:
    """Landmark bytes per cached token: one ``[Hkv, D]`` float32 vector per page per sparse layer (the
    centroid), two under ``page_score="minmax"`` (key_min and key_max).

    Args:
        num_sparse_layers: layers of this pipeline rank that select pages (the dense first layers keep
            no landmarks). num_kv_heads: KV heads per layer on this rank (after tensor parallelism).
    """
    if min(num_sparse_layers, num_kv_heads, head_dim) < 0 or page_size < 1:
        raise ValueError(
            "centroid_bytes_per_token: layers, heads and head_dim must be >= 0 and page_size >= 1, got "
            f"{num_sparse_layers}, {num_kv_heads}, {head_dim}, {page_size}"
        )
    element = torch.empty((), dtype=CENTROID_DTYPE).element_size()
    return landmarks_per_page(page_score) * num_sparse_layers * num_kv_heads * head_dim * element / page_size


def context_token_positions(seq_lens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request row and position of each of the step's context tokens (packed, request after request).

    Args:
        seq_lens: integer [num_contexts] new tokens per context request, on the device
            (``metadata.seq_lens_cuda[:num_contexts]``; a whole prompt: no chunked prefill, no reuse).
        num_tokens: their sum (``metadata.num_ctx_tokens``, known on the host).

    Returns:
        (rows int64 [num_tokens], positions int64 [num_tokens]).
    """
    lens = seq_lens.to(torch.int64)
    ends = torch.cumsum(lens, dim=0)
    token = torch.arange(num_tokens, device=seq_lens.device)
    rows = torch.searchsorted(ends, token, right=True)
    return rows, token - (ends - lens)[rows]


class LandmarkPool:
    """Page landmarks per sparse layer, indexed by physical KV block: float32 [num_blocks, Hkv, D]
    centroids, or under ``page_score="minmax"`` a ``KeyBounds`` of two such tensors.

    A centroid is the mean of the keys stored in its block, key bounds their per-channel min / max,
    after the keys are rounded to the KV-cache dtype (what attention reads), as the torch rollout
    engine's paged cache keeps them. :meth:`layer` returns what ``sparrow_kernels`` takes as landmarks.

    Args:
        num_blocks: physical KV blocks (``KVCacheManager.blocks_in_primary_pool``).
        layers: the layer indices that select pages (each gets a pool).
        num_kv_heads, head_dim: per layer. page_size: tokens per block (= ``tokens_per_block``).
        kv_dtype: dtype of the stored keys. device: where the pools live.
        page_score: "centroid" or "minmax" (``SparrowSparseSpec.page_score``).
    """

    def __init__(
        self,
        num_blocks: int,
        layers: Sequence[int],
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        kv_dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        page_score: str = "centroid",
    ) -> None:
        if num_blocks <= 0 or num_kv_heads <= 0 or head_dim <= 0 or page_size <= 0:
            raise ValueError(
                "LandmarkPool: num_blocks, num_kv_heads, head_dim and page_size must be > 0, got "
                f"{num_blocks}, {num_kv_heads}, {head_dim}, {page_size}"
            )
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.page_score = page_score

        def pool() -> torch.Tensor:
            return torch.zeros(num_blocks, num_kv_heads, head_dim, dtype=CENTROID_DTYPE, device=device)

        per_page = landmarks_per_page(page_score)
        self._layers: dict[int, Landmarks] = {
            int(layer): KeyBounds(pool(), pool()) if per_page == 2 else pool() for layer in layers
        }

    def _tensors(self) -> list[torch.Tensor]:
        return [t for lm in self._layers.values() for t in (lm if isinstance(lm, KeyBounds) else (lm,))]

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' pools."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def layer(self, layer_idx: int) -> Landmarks:
        """The landmarks of ``layer_idx``: centroids, or KeyBounds (a KeyError names the sparse layers when
        it has none)."""
        pool = self._layers.get(layer_idx)
        if pool is None:
            raise KeyError(
                f"layer {layer_idx} keeps no page landmarks; sparse layers: {sorted(self._layers)}"
            )
        return pool

    def write_prefill(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        """Landmarks of the pages the step's prompts fill (the blocks are overwritten, not blended).

        Args:
            keys: [T, Hkv, D] the context tokens' keys (after q/k norm and rotary).
            rows, positions: [T] each token's request row in ``block_table`` and index in its sequence
                (:func:`context_token_positions`); a prompt starts at position 0.
            block_table: integer [num_contexts, max_pages] physical block per logical page.
        """
        pool = self.layer(layer_idx)
        shape = (pool.key_min if isinstance(pool, KeyBounds) else pool).shape
        if keys.dim() != 3 or keys.shape[1:] != shape[1:]:
            raise ValueError(
                f"write_prefill: keys must be [T, {shape[1]}, {shape[2]}], got {tuple(keys.shape)}"
            )
        blocks = block_table[rows, torch.div(positions, self.page_size, rounding_mode="floor")].long()
        stored = keys.to(self.kv_dtype).to(CENTROID_DTYPE)
        if isinstance(pool, KeyBounds):  # min / max over each block's tokens (the old contents excluded)
            index = blocks[:, None, None].expand_as(stored)
            pool.key_min.scatter_reduce_(0, index, stored, "amin", include_self=False)
            pool.key_max.scatter_reduce_(0, index, stored, "amax", include_self=False)
            return
        pool.index_fill_(0, blocks, 0.0)
        pool.index_add_(0, blocks, stored)
        counts = torch.zeros(self.num_blocks, dtype=CENTROID_DTYPE, device=pool.device)
        counts.index_add_(0, blocks, torch.ones_like(blocks, dtype=CENTROID_DTYPE))
        # every copy written to a block carries the same value, so duplicate indices are harmless
        pool.index_copy_(0, blocks, pool.index_select(0, blocks) / counts[blocks][:, None, None])

    def append(
        self, layer_idx: int, k_new: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Add one key per sequence. Centroid: ``c <- k`` in a fresh page (slot 0), else
        ``c + (k - c) / (slot + 1)``; key bounds: ``lo, hi <- k`` in a fresh page, else ``min(lo, k)``,
        ``max(hi, k)``.

        The landmarks ``sparrow_kernels.append_kv`` keeps (which also writes K/V; this one is for the path
        where TensorRT-LLM's attention op writes them and the page's keys are not read back).

        Args:
            k_new: [B, Hkv, D] keys of the tokens at ``positions`` [B] (index in the sequence).
            block_table: integer [B, max_pages] physical block per logical page.
        """
        pool = self.layer(layer_idx)
        rows = torch.arange(positions.shape[0], device=block_table.device)
        pos = positions.to(device=block_table.device, dtype=torch.int64)
        block = block_table[rows, torch.div(pos, self.page_size, rounding_mode="floor")].long()
        slot = (pos % self.page_size).to(CENTROID_DTYPE)[:, None, None]
        stored = k_new.to(self.kv_dtype).to(CENTROID_DTYPE)
        if isinstance(pool, KeyBounds):
            fresh = slot == 0
            pool.key_min[block] = torch.where(fresh, stored, torch.minimum(pool.key_min[block], stored))
            pool.key_max[block] = torch.where(fresh, stored, torch.maximum(pool.key_max[block], stored))
            return
        c = pool[block]
        pool[block] = torch.where(slot == 0, stored, c + (stored - c) / (slot + 1))

    def gather(self, layer_idx: int, block_table: torch.Tensor) -> Landmarks:
        """Landmarks of every logical page of each row: [B, Hkv, max_pages, D] float32 (static width), a
        KeyBounds of two under minmax."""
        index = block_table.long().clamp(min=0)
        pool = self.layer(layer_idx)
        if isinstance(pool, KeyBounds):
            return KeyBounds(*(t[index].transpose(1, 2) for t in pool))
        return pool[index].transpose(1, 2)
