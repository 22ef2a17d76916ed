"""Paged KV cache shared by the torch rollout engine and the fused kernels (sparrow_kernels).

Per decoder layer, preallocated pools:
    k_pages, v_pages: [num_pages, Hkv, page_size, D] in the model dtype,
and the page landmarks the page score reads (``page_score``, sparrow_nemo.sparse.attention), each
[num_pages, Hkv, D] in the model dtype (``centroid_dtype`` to override):
    centroids:          ``centroid``: the float32 mean of the keys stored so far in each page, rounded once;
    key_min, key_max:   ``minmax``: the per-channel minimum and maximum of those keys (exact in any dtype).
Only the pools of the cache's own page score are allocated (the other list is empty). A page's landmarks
cover its stored tokens only; the first append into a page (slot 0) resets them to that key.
A sequence owns a row of a block table ``[B, max_pages_per_seq]`` int32 (logical page -> physical
page, -1 where nothing is allocated yet); token t lives in page ``block_table[b, t // page_size]`` at
slot ``t % page_size``. Keys are stored after q/k RMSNorm and rotary embedding. Which sequence owns which
page is :class:`~sparrow_nemo.rollout.torch.block_manager.BlockManager`'s business; :func:`fill_block_table`
and :func:`free_block_table` give a fixed batch its pages (benchmarks, kernel tests).
"""

from __future__ import annotations

import math

import torch

from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.sparse.pattern import PAGE_SCORES, PAGE_SIZE


class PagedKVCache:
    """Page pools for every layer (a physical page holds the same tokens in every layer)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = PAGE_SIZE,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        centroid_dtype: torch.dtype | None = None,  # None: the K/V dtype (bf16 halves the scoring bytes)
        page_score: str = "centroid",  # the landmarks kept per page: "centroid" or "minmax" (PAGE_SCORES)
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(
                f"PagedKVCache: num_pages and page_size must be > 0, got {num_pages}, {page_size}"
            )
        if page_score not in PAGE_SCORES:
            raise ValueError(f"PagedKVCache: page_score must be one of {PAGE_SCORES}, got {page_score!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.page_score = page_score
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        def pools(wanted: str) -> list[torch.Tensor]:
            if page_score != wanted:
                return []
            mark = (num_pages, num_kv_heads, head_dim)
            return [
                torch.zeros(mark, dtype=centroid_dtype or dtype, device=device) for _ in range(num_layers)
            ]

        self.centroids = pools("centroid")
        self.key_min = pools("minmax")
        self.key_max = pools("minmax")

    def landmarks(self, layer: int) -> list[torch.Tensor]:
        """The landmark pools of ``layer`` in the page score's order: [centroids] or [key_min, key_max]."""
        if self.page_score == "minmax":
            return [self.key_min[layer], self.key_max[layer]]
        return [self.centroids[layer]]

    @property
    def landmark_pools(self) -> list[torch.Tensor]:
        """Every layer's landmark pools (what a page copy must copy besides keys and values)."""
        return self.centroids + self.key_min + self.key_max

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (keys, values, landmarks)."""
        return sum(t.numel() * t.element_size() for t in self.k_pages + self.v_pages + self.landmark_pools)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys, values and landmarks of physical pages ``src`` into ``dst`` (every layer)."""
        if src:
            s = torch.tensor(src, device=self.k_pages[0].device)
            d = torch.tensor(dst, device=self.k_pages[0].device)
            for pool in (*self.k_pages, *self.v_pages, *self.landmark_pools):
                pool[d] = pool[s]

    # ----------------------------------------------------------------- writes
    def write_prefill(
        self,
        layer: int,
        block_table: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: torch.Tensor,
        start: int = 0,
    ) -> None:
        """Store a chunk of a right-padded prompt batch.

        Args:
            k, v: [B, T, Hkv, D] keys/values of positions start .. start + T - 1.
            lengths: [B] prompt lengths; positions at or past them are not stored.
            start: first position of the chunk, a multiple of page_size (chunks cover whole pages).

        Pages must already be reserved. Each page's landmarks are set from its valid keys (:meth:`refresh`).
        """
        batch, t, hkv, d = k.shape
        ps = self.page_size
        if start % ps:
            raise ValueError(f"write_prefill: start={start} must be a multiple of page_size={ps}")
        n_pages = math.ceil(t / ps)
        pos = start + torch.arange(n_pages * ps, device=k.device)
        valid = pos[None, :] < lengths.to(k.device)[:, None]  # [B, n_pages * ps]
        pad = n_pages * ps - t
        k_pad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)) * valid[:, :, None, None]
        v_pad = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)) * valid[:, :, None, None]
        k_pg = k_pad.view(batch, n_pages, ps, hkv, d).transpose(2, 3)  # [B, n_pages, Hkv, ps, D]
        v_pg = v_pad.view(batch, n_pages, ps, hkv, d).transpose(2, 3)
        counts = valid.view(batch, n_pages, ps).sum(-1)  # [B, n_pages]
        used = counts > 0
        phys = block_table[:, start // ps : start // ps + n_pages][used].long()
        stored = k_pg[used].to(self.k_pages[layer].dtype)  # [N, Hkv, ps, D]
        self.k_pages[layer][phys] = stored
        self.v_pages[layer][phys] = v_pg[used].to(self.v_pages[layer].dtype)
        self.refresh(layer, phys, counts[used], stored)

    def refresh(
        self, layer: int, phys: torch.Tensor, counts: torch.Tensor, stored: torch.Tensor | None = None
    ) -> None:
        """Set the landmarks of physical pages ``phys [N]`` from their first ``counts [N]`` (>= 1) stored keys:
        the float32 mean rounded once to the centroid dtype, or the per-channel min and max.

        ``stored``: those pages' keys [N, Hkv, ps, D] when the caller holds them (else read from the pool);
        slots at or past ``counts`` may hold anything finite.
        """
        keys = (self.k_pages[layer][phys] if stored is None else stored).float()
        upto = (torch.arange(self.page_size, device=phys.device)[None, :] < counts[:, None])[:, None, :, None]
        if self.page_score == "minmax":
            lo, hi = self.key_min[layer], self.key_max[layer]
            lo[phys] = keys.masked_fill(~upto, math.inf).amin(dim=2).to(lo.dtype)
            hi[phys] = keys.masked_fill(~upto, -math.inf).amax(dim=2).to(hi.dtype)
            return
        sums = (keys * upto).sum(dim=2)  # [N, Hkv, D]: centroids average the keys as stored
        self.centroids[layer][phys] = (sums / counts.to(torch.float32)[:, None, None]).to(
            self.centroids[layer].dtype
        )

    def append(
        self,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> None:
        """Store one token per sequence at ``positions [B]`` (its index = the old length).

        ``k_new, v_new``: [B, Hkv, D]. The page's centroid becomes the fp32 mean of its stored keys
        (slots 0 .. slot), rounded once to the centroid dtype (as ``sparrow_kernels.append_kv``); its key
        bounds (``minmax``) take the stored key in, or are set to it at slot 0.
        """
        rows = torch.arange(positions.shape[0], device=positions.device)
        page = block_table[rows, positions // self.page_size].long()
        slot = positions % self.page_size
        self.k_pages[layer][page, :, slot] = k_new.to(self.k_pages[layer].dtype)
        self.v_pages[layer][page, :, slot] = v_new.to(self.v_pages[layer].dtype)
        if self.page_score == "minmax":
            key = self.k_pages[layer][page, :, slot].to(self.key_min[layer].dtype)  # [B, Hkv, D] as stored
            fresh = (slot == 0)[:, None, None]
            lo, hi = self.key_min[layer][page], self.key_max[layer][page]
            self.key_min[layer][page] = torch.where(fresh, key, torch.minimum(lo, key))
            self.key_max[layer][page] = torch.where(fresh, key, torch.maximum(hi, key))
            return
        upto = torch.arange(self.page_size, device=slot.device)[None, :] <= slot[:, None]  # [B, ps]
        stored = torch.where(
            upto[:, None, :, None], self.k_pages[layer][page].float(), 0.0
        )  # [B, Hkv, ps, D]
        mean = stored.sum(dim=2) / (slot + 1).to(torch.float32)[:, None, None]
        self.centroids[layer][page] = mean.to(self.centroids[layer].dtype)

    # ----------------------------------------------------------------- reads
    def gather_centroids(self, layer: int, block_table: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """Centroids of each sequence's pages: [B, Hkv, n_pages_max, D] fp32, zero past ``seq_len``.

        n_pages_max = ceil(max(seq_len) / page_size).
        """
        return self._gather_pages(self.centroids[layer], block_table, seq_len)

    def gather_key_bounds(
        self, layer: int, block_table: torch.Tensor, seq_len: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key bounds (``minmax``) of each sequence's pages: (k_min, k_max), each [B, Hkv, n_pages_max, D] fp32,
        zero past ``seq_len`` (the layout of :func:`sparrow_nemo.sparse.attention.page_key_bounds`)."""
        return (
            self._gather_pages(self.key_min[layer], block_table, seq_len),
            self._gather_pages(self.key_max[layer], block_table, seq_len),
        )

    def _gather_pages(
        self, pool: torch.Tensor, block_table: torch.Tensor, seq_len: torch.Tensor
    ) -> torch.Tensor:
        """``pool [num_pages, Hkv, D]`` at each sequence's pages: [B, Hkv, n_pages_max, D] fp32, zero past seq_len."""
        n_pages = math.ceil(int(seq_len.max()) / self.page_size)
        table = block_table[:, :n_pages].long()
        marks = pool[table.clamp(min=0)].float()  # [B, n_pages, Hkv, D]
        live = torch.arange(n_pages, device=table.device)[None, :] * self.page_size < seq_len[:, None]
        return (marks * live[:, :, None, None]).transpose(1, 2)

    def gather(
        self, layer: int, block_table: torch.Tensor, page_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values of selected pages, one page list per (sequence, KV head).

        Args:
            page_idx: [B, Hkv, n] int64 logical page indices, -1 = padding.

        Returns:
            k, v: [B, Hkv, n * page_size, D] in the cache dtype (padding pages read physical page
            of logical page 0 and must be masked); positions: [B, Hkv, n * page_size] int64 token
            index of every gathered slot, negative for padding.
        """
        batch, hkv, n = page_idx.shape
        logical = page_idx.clamp(min=0).reshape(batch, hkv * n)
        phys = torch.gather(block_table.long(), 1, logical).view(batch, hkv, n)
        head = torch.arange(hkv, device=page_idx.device)[None, :, None]
        ps = self.page_size
        k = self.k_pages[layer][phys, head].flatten(2, 3)  # [B, Hkv, n * ps, D]
        v = self.v_pages[layer][phys, head].flatten(2, 3)
        slots = torch.arange(ps, device=page_idx.device)
        positions = torch.where(page_idx[..., None] >= 0, page_idx[..., None] * ps + slots, -1)
        return k, v, positions.flatten(2)

    def contiguous(
        self, layer: int, block_table: torch.Tensor, seq_len: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache of ``layer`` as contiguous ``[B, Hkv, L, D]`` keys and values (L = max seq_len)."""
        n_pages = math.ceil(int(seq_len.max()) / self.page_size)
        hkv = self.k_pages[layer].shape[1]
        every = torch.arange(n_pages, device=block_table.device).expand(block_table.shape[0], hkv, n_pages)
        k, v, _ = self.gather(layer, block_table, every)
        length = int(seq_len.max())
        return k[:, :, :length], v[:, :, :length]


def fill_block_table(blocks: BlockManager, block_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """Give every row of ``block_table [B, P]`` (in place) pages from ``blocks`` for ``lengths [B]`` tokens:
    rows keep the pages they have, new ones are taken in row order. Raises
    :class:`~sparrow_nemo.rollout.torch.block_manager.OutOfPages` when the pool runs out."""
    have = (block_table >= 0).sum(dim=1)
    need = (lengths.to(have.device) + blocks.page_size - 1) // blocks.page_size
    if need.numel() and int(need.max()) > block_table.shape[1]:
        raise ValueError(
            f"fill_block_table: {int(need.max())} pages needed but the block table has {block_table.shape[1]} columns"
        )
    cols = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
    new = (cols >= have[:, None]) & (cols < need[:, None])
    count = int(new.sum())
    if count:
        pages = blocks.allocate(count)
        block_table[new] = torch.tensor(pages, dtype=block_table.dtype, device=block_table.device)


def free_block_table(blocks: BlockManager, block_table: torch.Tensor) -> None:
    """Return every page of the rows of ``block_table`` to ``blocks`` (entries set to -1)."""
    blocks.release(block_table[block_table >= 0].tolist())
    block_table.fill_(-1)
