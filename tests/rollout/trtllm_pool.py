"""A KV pool laid out and addressed exactly as TensorRT-LLM's C++ KV-cache manager does it (test support).

Independent of the adapter under test (``sparrow_nemo.rollout.trtllm.layout``): it writes and reads tokens
with the C++ address arithmetic, so the adapter's views must see what TensorRT-LLM's kernels wrote.

- primary pool ``[num_blocks, num_layers, 2, Hkv * tokens_per_block * D]`` (``KVCacheManager.get_buffers``
  docstring: ``[max_num_pages, num_layers, kv_factor, page_size * num_kv_heads * head_dim]``);
- block offsets ``[num_pools, rows, 2, max_blocks]`` = ``flat_index3(block, 0, field, num_layers, 2)``
  (``kvCacheManager.cpp`` ``WindowBlockManager::setOffsets``); the attention op adds the layer as a
  pool-pointer offset of ``layer * 2`` blocks;
- element of token t, head h, channel c inside a block: ``h * tokens_per_block * D + (t % tokens_per_block) * D + c``
  (``kvCacheUtils.h`` ``KVBlockArray::getKVLocalIdx``).
"""

from __future__ import annotations

import torch


class TrtllmPool:
    """One cache pool of ``num_layers`` layers; requests own lists of physical block ids."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        num_kv_heads: int,
        tokens_per_block: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.shape = (num_blocks, num_layers, num_kv_heads, tokens_per_block, head_dim)
        self.block_elems = num_kv_heads * tokens_per_block * head_dim
        self.primary = torch.zeros(num_blocks, num_layers, 2, self.block_elems, dtype=dtype)

    def get_buffers_hnd(self, layer: int) -> torch.Tensor:
        """``KVCacheManager.get_buffers(layer, kv_layout="HND")``: the layer's slice, reshaped."""
        num_blocks, _, hkv, tpb, d = self.shape
        return self.primary[:, layer].reshape(num_blocks, 2, hkv, tpb, d)

    def block_offsets(self, tables: list[list[int]], max_blocks: int) -> torch.Tensor:
        """int32 [1, rows, 2, max_blocks] as ``copy_batch_block_offsets`` fills it (unused entries 0)."""
        num_layers = self.shape[1]
        out = torch.zeros(1, len(tables), 2, max_blocks, dtype=torch.int32)
        for row, blocks in enumerate(tables):
            for j, block in enumerate(blocks):
                for field in (0, 1):
                    out[0, row, field, j] = (block * num_layers + 0) * 2 + field
        return out

    def _index(
        self, layer: int, offsets: torch.Tensor, row: int, field: int, token: int, head: int
    ) -> torch.Tensor:
        _, _, _, tpb, d = self.shape
        offset = int(offsets[0, row, field, token // tpb])
        base = layer * 2 * self.block_elems + offset * self.block_elems  # layer pointer + block pointer
        return base + head * tpb * d + (token % tpb) * d + torch.arange(d)

    def write(
        self, layer: int, offsets: torch.Tensor, row: int, token: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store token ``token`` of request ``row``: k, v [Hkv, D], as the attention op does."""
        flat = self.primary.view(-1)
        for head in range(self.shape[2]):
            flat[self._index(layer, offsets, row, 0, token, head)] = k[head].to(flat.dtype)
            flat[self._index(layer, offsets, row, 1, token, head)] = v[head].to(flat.dtype)

    def read(
        self, layer: int, offsets: torch.Tensor, row: int, token: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Hkv, D] of token ``token`` of request ``row``, as the attention kernels read them."""
        flat = self.primary.view(-1)
        heads = range(self.shape[2])
        k = torch.stack([flat[self._index(layer, offsets, row, 0, token, h)] for h in heads])
        v = torch.stack([flat[self._index(layer, offsets, row, 1, token, h)] for h in heads])
        return k, v
