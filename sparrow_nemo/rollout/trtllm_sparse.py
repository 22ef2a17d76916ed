"""The "sparrow" sparse-attention algorithm for TensorRT-LLM, as plain torch (no TensorRT-LLM import).

TensorRT-LLM's PyTorch backend asks a sparse attention backend, once per layer and forward step, for
the KV pages each generation request attends to (``sparse_attn_predict``). This module holds
everything that answer needs and that can run without TensorRT-LLM, so it is tested on CPU:

- :class:`SparrowSparseSpec`: the algorithm's settings (page size, sink/local pages, dense first layers,
  the budget schedule) and their translation to/from the ``sparse_attention_config`` dict;
- :class:`CentroidPool`: per-layer page centroids (mean key of each KV block) indexed by TensorRT-LLM's
  physical block ids, written at prefill and updated incrementally at each decode step;
- :func:`predict_pages`: the page selection of one decode step, which is the method layer's rule
  (``select_pages_from_centroids``) or, on CUDA, the same rule as the fused ``sparrow_kernels`` kernel;
- :func:`flatten_page_indices`: the selection in TensorRT-LLM's sparse-index layout.

The TensorRT-LLM classes that call these live in :mod:`sparrow_nemo.rollout.trtllm_plugin`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sparrow_nemo.sparse.attention import page_centroids, select_pages_from_centroids
from sparrow_nemo.sparse.schedule import BudgetSchedule

#: the value of ``sparse_attention_config.algorithm`` that selects this algorithm
ALGORITHM = "sparrow"


@dataclass(frozen=True)
class SparrowSparseSpec:
    """Settings of the "sparrow" algorithm (METHOD.md: page 16, 1 sink page, 2 local pages, 2 dense layers).

    Attributes:
        schedule: KV budget (tokens, reserved pages included) per bin of cached length.
        dense_layers: the first layers attend densely (no selection).
        sink_pages, local_pages: pages always kept at the start / end of the cache.
    """

    schedule: BudgetSchedule
    dense_layers: int = 2
    sink_pages: int = 1
    local_pages: int = 2

    def __post_init__(self) -> None:
        if self.dense_layers < 0 or self.sink_pages < 0 or self.local_pages < 0:
            raise ValueError(
                "SparrowSparseSpec: dense_layers, sink_pages and local_pages must be >= 0, got "
                f"{self.dense_layers}, {self.sink_pages}, {self.local_pages}"
            )

    @property
    def page_size(self) -> int:
        """Tokens per page (= TensorRT-LLM KV block size, ``tokens_per_block``)."""
        return self.schedule.page_size

    @classmethod
    def from_recipe(cls, config: Any, schedule: BudgetSchedule | None = None) -> SparrowSparseSpec:
        """The spec of a :class:`~sparrow_nemo.config.SparrowConfig` (``schedule`` replaces the recipe's)."""
        s = config.sparsity
        return cls(
            schedule=schedule if schedule is not None else s.build_schedule(),
            dense_layers=s.dense_layers,
            sink_pages=s.sink_pages,
            local_pages=s.local_pages,
        )

    def with_schedule(self, schedule: BudgetSchedule) -> SparrowSparseSpec:
        """The same spec with another schedule (the trainer adapts budgets between steps)."""
        if schedule.page_size != self.page_size:
            raise ValueError(
                f"schedule '{schedule.name}' uses page_size={schedule.page_size}, but the engine's KV blocks "
                f"hold {self.page_size} tokens"
            )
        return SparrowSparseSpec(schedule, self.dense_layers, self.sink_pages, self.local_pages)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` selects pages (not one of the dense first layers)."""
        return layer_idx >= self.dense_layers and not self.schedule.is_dense

    def to_config_dict(self) -> dict[str, Any]:
        """The ``sparse_attention_config`` mapping TensorRT-LLM receives (YAML/JSON friendly)."""
        sched = self.schedule.to_dict()
        return {
            "algorithm": ALGORITHM,
            "page_size": self.page_size,
            "sink_pages": self.sink_pages,
            "local_pages": self.local_pages,
            "dense_layers": self.dense_layers,
            "bin_tokens": sched["bin_tokens"],
            "budgets": sched["budgets"],
            "schedule_name": sched["name"],
        }

    @classmethod
    def from_config_dict(cls, data: Mapping[str, Any]) -> SparrowSparseSpec:
        """Inverse of :meth:`to_config_dict`; a wrong algorithm or a missing/unknown key is a ValueError."""
        known = {
            "algorithm",
            "page_size",
            "sink_pages",
            "local_pages",
            "dense_layers",
            "bin_tokens",
            "budgets",
            "schedule_name",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"sparse_attention_config: unknown keys {sorted(unknown)}; expected {sorted(known)}"
            )
        if data.get("algorithm") != ALGORITHM:
            raise ValueError(
                f"sparse_attention_config.algorithm must be '{ALGORITHM}', got {data.get('algorithm')!r}"
            )
        missing = {"page_size", "bin_tokens", "budgets"} - set(data)
        if missing:
            raise ValueError(f"sparse_attention_config: missing keys {sorted(missing)}")
        schedule = BudgetSchedule.from_dict(
            {
                "name": data.get("schedule_name", ""),
                "bin_tokens": data["bin_tokens"],
                "page_size": data["page_size"],
                "budgets": list(data["budgets"]),
            }
        )
        return cls(
            schedule=schedule,
            dense_layers=int(data.get("dense_layers", 2)),
            sink_pages=int(data.get("sink_pages", 1)),
            local_pages=int(data.get("local_pages", 2)),
        )


class CentroidPool:
    """Page centroids of one engine's KV cache, per layer: float32 [num_blocks, Hkv, D].

    Block ``i`` of the pool belongs to TensorRT-LLM's physical KV block ``i`` (the KV cache must use
    ``tokens_per_block == page_size``). A centroid is the mean of the keys stored in its block, taken
    after the keys are rounded to the KV-cache dtype (what attention reads), as in the reference cache.

    Args:
        num_blocks: physical KV blocks of the cache; num_kv_heads, head_dim: per layer.
        page_size: tokens per block. kv_dtype: dtype of the stored keys. device: where the pools live.
    """

    def __init__(
        self,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        kv_dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks <= 0 or num_kv_heads <= 0 or head_dim <= 0 or page_size <= 0:
            raise ValueError(
                "CentroidPool: num_blocks, num_kv_heads, head_dim and page_size must be > 0, got "
                f"{num_blocks}, {num_kv_heads}, {head_dim}, {page_size}"
            )
        self.shape = (num_blocks, num_kv_heads, head_dim)
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        self._layers: dict[int, torch.Tensor] = {}

    def layer(self, layer_idx: int) -> torch.Tensor:
        """The pool of layer ``layer_idx`` (allocated, zeroed, on first use)."""
        pool = self._layers.get(layer_idx)
        if pool is None:
            pool = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
            self._layers[layer_idx] = pool
        return pool

    def clear(self) -> None:
        """Free every layer's pool (engine sleep)."""
        self._layers.clear()

    def write_prefill(self, layer_idx: int, keys: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Centroids of one prompt's pages.

        Args:
            keys: [L, Hkv, D] the prompt's keys (after q/k norm and rotary), positions 0 .. L-1.
            block_ids: [>= ceil(L / page_size)] integer physical block of each logical page.
        """
        n_tok, hkv, d = keys.shape
        if (hkv, d) != self.shape[1:]:
            raise ValueError(
                f"write_prefill: keys are [L, {hkv}, {d}], expected [L, {self.shape[1]}, {self.shape[2]}]"
            )
        n_pages = math.ceil(n_tok / self.page_size)
        if block_ids.numel() < n_pages:
            raise ValueError(
                f"write_prefill: {block_ids.numel()} block ids for {n_pages} pages of {n_tok} tokens"
            )
        stored = keys.to(self.kv_dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        length = torch.tensor([n_tok], device=keys.device)
        cent = page_centroids(stored, length, self.page_size)[0]  # [Hkv, P, D]
        self.layer(layer_idx)[block_ids[:n_pages].long().to(self.device)] = cent.transpose(0, 1).to(
            self.device
        )

    def append(
        self, layer_idx: int, k_new: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Add one key per sequence: ``c <- c + (k - c) / (n + 1)``, n = keys already in the page.

        Args:
            k_new: [B, Hkv, D] keys of the tokens at ``positions`` [B] (index = old length).
            block_table: [B, max_pages] integer physical block per logical page.
        """
        rows = torch.arange(positions.shape[0], device=block_table.device)
        pos = positions.to(block_table.device).long()
        block = block_table[rows, pos // self.page_size].long()
        slot = (pos % self.page_size).to(torch.float32)
        pool = self.layer(layer_idx)
        c = pool[block]
        stored = k_new.to(self.kv_dtype).float().to(pool.device)
        pool[block] = c + (stored - c) / (slot + 1)[:, None, None]

    def gather(self, layer_idx: int, block_table: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """Centroids of each sequence's pages: [B, Hkv, n_pages_max, D] float32 (n_pages_max from seq_len)."""
        n_pages = math.ceil(int(seq_len.max()) / self.page_size)
        table = block_table[:, :n_pages].long().clamp(min=0)
        return self.layer(layer_idx)[table].transpose(1, 2)


def predict_pages(
    q: torch.Tensor,
    pool: CentroidPool,
    layer_idx: int,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    spec: SparrowSparseSpec,
    use_kernel: bool = False,
) -> torch.Tensor:
    """Pages each KV head of each generation request attends to at this decode step.

    The budget of each request is ``spec.schedule`` at its cached length ``seq_len`` (the current token
    included), exactly as the torch rollout engine computes it.

    Args:
        q: [B, Hq, D] queries of the current tokens (after q norm and rotary).
        block_table: [B, max_pages] integer physical block per logical page; seq_len: [B] integer tokens.
        use_kernel: use the fused ``sparrow_kernels.select_pages_paged`` (CUDA; same rule and result).

    Returns:
        [B, Hkv, n] int64 logical page indices, ascending per row, padded with -1 at the end.
    """
    budgets = spec.schedule.budgets_for(seq_len.to(torch.int64))
    if use_kernel:
        import sparrow_kernels

        page_idx, _ = sparrow_kernels.select_pages_paged(
            q,
            pool.layer(layer_idx),
            block_table.to(torch.int32),
            seq_len.to(torch.int32),
            budgets.to(torch.int32),
            page_size=spec.page_size,
            sink_pages=spec.sink_pages,
            local_pages=spec.local_pages,
        )
        width = int((page_idx >= 0).sum(dim=-1).max()) if page_idx.numel() else 0
        return page_idx[..., :width].to(torch.int64)
    centroids = pool.gather(layer_idx, block_table, seq_len)
    return select_pages_from_centroids(
        q, centroids, seq_len, budgets, spec.page_size, spec.sink_pages, spec.local_pages
    )


def flatten_page_indices(page_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request page lists -> TensorRT-LLM's sparse-attention index layout.

    Args:
        page_idx: [B, Hkv, n] integer logical page indices, -1 padded; every KV head of a request keeps
            the same number of pages (true of Sparrow's rule).

    Returns:
        (indices int32 [Hkv, total]: request 0's pages, then request 1's, ... for each KV head;
         offsets int32 [B + 1]: request b's pages are columns offsets[b] .. offsets[b+1] - 1).
    """
    if page_idx.dim() != 3:
        raise ValueError(f"page_idx must be [B, Hkv, n], got shape {tuple(page_idx.shape)}")
    kept = page_idx >= 0
    counts = kept.sum(dim=-1)  # [B, Hkv]
    if counts.numel() and not bool((counts == counts[:, :1]).all()):
        raise ValueError("page_idx: the KV heads of a request keep different numbers of pages")
    batch, hkv, _ = page_idx.shape
    per_req = counts[:, 0] if hkv else torch.zeros(batch, dtype=torch.int64, device=page_idx.device)
    offsets = torch.zeros(batch + 1, dtype=torch.int32, device=page_idx.device)
    offsets[1:] = torch.cumsum(per_req, dim=0).to(torch.int32)
    by_head = page_idx.transpose(0, 1)  # [Hkv, B, n]
    indices = by_head[kept.transpose(0, 1)].view(hkv, -1).to(torch.int32)
    return indices, offsets


def unflatten_page_indices(indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`flatten_page_indices`: -> [B, Hkv, n] int64, -1 padded."""
    counts = (offsets[1:] - offsets[:-1]).tolist()
    width = max(counts, default=0)
    out = torch.full((len(counts), indices.shape[0], width), -1, dtype=torch.int64, device=indices.device)
    for b, (start, n) in enumerate(zip(offsets[:-1].tolist(), counts)):
        out[b, :, :n] = indices[:, start : start + n]
    return out


def split_fused_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys of a fused ``[T, (Hq + 2 Hkv) * D]`` tensor -> ([T, Hq, D], [T, Hkv, D])."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"fused qkv must be [T, {width}] for Hq={num_heads}, Hkv={num_kv_heads}, D={head_dim}, got {tuple(qkv.shape)}"
        )
    q = qkv[:, : num_heads * head_dim].reshape(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].reshape(
        -1, num_kv_heads, head_dim
    )
    return q, k
