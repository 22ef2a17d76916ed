"""TensorRT-LLM's paged KV pool seen as ``sparrow_kernels`` pages (plain torch, no TensorRT-LLM import).

TensorRT-LLM (1.2 line, PyTorch backend, ``KVCacheManager`` v1) keeps one primary pool per cache pool:
``[num_blocks, num_layers_in_pool, kv_factor=2, Hkv * tokens_per_block * D]``, K then V of a layer
side by side inside each block, and within a K (or V) block the layout ``[Hkv, tokens_per_block, D]``
("HND"). Contracts read, in the index copies of the NVIDIA/TensorRT-LLM sources of that line:

- ``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` ``KVCacheManager.get_buffers(layer_idx,
  kv_layout)``: ``impl.get_primary_pool_data(layer_offset)`` is the layer's slice
  ``[num_blocks, kv_factor, block_elems]``; ``kv_layout="HND"`` reshapes it to
  ``[num_blocks, 2, Hkv, tokens_per_block, D]``;
- ``cpp/tensorrt_llm/kernels/kvCacheUtils.h`` ``KVBlockArray::getKVLocalIdx``: element
  ``head * tokens_per_block * D + (token % tokens_per_block) * D + channel`` of a block, i.e. HND is
  the layout the attention kernels read and write (the reason :func:`kv_page_views` asks for HND);
- ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`` ``WindowBlockManager::setOffsets``: the
  block offsets tensor ``[num_pools, rows, 2, max_blocks_per_seq]`` holds, for K (field 0) and V
  (field 1), ``flat_index3(memory_pool_block_index, 0, field, num_layers_in_pool, kv_factor)``
  = ``(block * num_layers_in_pool) * kv_factor + field`` (the layer is added by the attention op as a
  pool-pointer offset), so the physical block is ``offset // (num_layers_in_pool * kv_factor)``;
- ``tensorrt_llm/_torch/attention_backend/trtllm.py`` ``TrtllmAttentionMetadata.prepare``: row ``i`` of
  ``kv_cache_block_offsets`` is the ``i``-th request of the step (context requests first, then
  generation requests), copied to the device once per step.

Everything here is a view or a few elementwise ops on device tensors: no copy of the pool, no host
sync, static shapes (CUDA-graph capturable). The CPU tests build a pool exactly this way, write it
through the ``KVBlockArray`` address arithmetic and read it back through these views with the kernels.
"""

from __future__ import annotations

import torch

#: K and V: the ``kv_factor`` of a (non-MLA) self-attention pool
KV_FACTOR = 2


def kv_page_views(layer_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V pages of one layer, as ``sparrow_kernels`` takes them (views, no copy).

    Args:
        layer_pool: ``KVCacheManager.get_buffers(layer, kv_layout="HND")``:
            [num_blocks, 2, Hkv, tokens_per_block, D], D contiguous.

    Returns:
        (k_pages, v_pages), each [num_blocks, Hkv, tokens_per_block, D] with the pool's strides
        (block stride = num_layers_in_pool * 2 * Hkv * tokens_per_block * D elements).
    """
    if layer_pool.dim() != 5 or layer_pool.shape[1] != KV_FACTOR:
        raise ValueError(
            "layer_pool must be the HND view [num_blocks, 2, Hkv, tokens_per_block, D] "
            f"(KVCacheManager.get_buffers(layer, kv_layout='HND')), got shape {tuple(layer_pool.shape)}"
        )
    if layer_pool.stride(-1) != 1:
        raise ValueError(f"layer_pool must have a contiguous head dim, got strides {layer_pool.stride()}")
    return layer_pool[:, 0], layer_pool[:, 1]


def block_table_from_offsets(
    block_offsets: torch.Tensor, pool_index: int, first_row: int, num_rows: int, layers_in_pool: int
) -> torch.Tensor:
    """Physical block of every logical page of ``num_rows`` requests, from TRT-LLM's block offsets.

    Args:
        block_offsets: ``metadata.kv_cache_block_offsets`` int32 [num_pools, max_rows, 2, max_blocks]
            (K offsets in field 0), on the device.
        pool_index: the layer's cache pool (``kv_cache_pool_mapping[layer, 0]``).
        first_row, num_rows: the requests (batch rows) wanted, e.g. the generation requests
            ``num_contexts .. num_seqs - 1``.
        layers_in_pool: layers that share the pool (the multiplier of ``setOffsets``).

    Returns:
        int32 [num_rows, max_blocks] block ids, indexing dim 0 of :func:`kv_page_views` (entries past a
        request's last page are whatever the manager left there; the kernels read only pages below
        ``ceil(seq_len / tokens_per_block)``).
    """
    if block_offsets.dim() != 4 or block_offsets.shape[2] != KV_FACTOR:
        raise ValueError(
            "block_offsets must be [num_pools, rows, 2, max_blocks_per_seq] "
            f"(metadata.kv_cache_block_offsets), got shape {tuple(block_offsets.shape)}"
        )
    if layers_in_pool < 1:
        raise ValueError(f"layers_in_pool must be >= 1, got {layers_in_pool}")
    k_offsets = block_offsets[pool_index, first_row : first_row + num_rows, 0]
    return torch.div(k_offsets, layers_in_pool * KV_FACTOR, rounding_mode="floor").to(torch.int32)


def layers_per_pool(pool_mapping: torch.Tensor) -> dict[int, int]:
    """How many layers each cache pool holds, from ``KVCacheManager.kv_cache_pool_mapping``.

    Args:
        pool_mapping: host int tensor [num_local_layers, 2]: (pool index, layer index within the pool)
            per local layer.
    """
    if pool_mapping.dim() != 2 or pool_mapping.shape[1] != 2 or pool_mapping.device.type != "cpu":
        raise ValueError(
            "pool_mapping must be the host [num_local_layers, 2] kv_cache_pool_mapping, got "
            f"{pool_mapping.device} {tuple(pool_mapping.shape)}"
        )
    pools = pool_mapping[:, 0].tolist()  # a host tensor: no device sync
    return {p: pools.count(p) for p in sorted(set(pools))}
