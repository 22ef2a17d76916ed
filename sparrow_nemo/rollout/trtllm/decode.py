"""The generation phase of the "sparrow" algorithm inside TensorRT-LLM (plain torch + ``sparrow_kernels``).

Where the sparse indices go depends on the GPU (:func:`generation_path`):

- SM100 family (Blackwell, TRTLLM-GEN kernels): TensorRT-LLM's attention op consumes the pages we select
  (``sparse_attn_indices``/``sparse_attn_offsets`` from ``sparse_attn_predict``) in its generation
  kernels; :func:`predict_native_indices` builds them.
- Anything else, Hopper (SM90) included: TensorRT-LLM's generation kernels ignore the indices (see
  :func:`generation_path`), so the plugin runs the whole generation phase itself with
  :func:`sparse_decode_step`: ``sparrow_kernels.append_kv`` writes the new token's K/V into TensorRT-LLM's
  paged pool (and updates the page's landmarks: centroid, or key bounds under ``page_score="minmax"``),
  ``page_selection`` picks the pages (physical ids) by the same score and
  ``decode_attention_paged`` attends to them (three launches per layer), all over the pool's own pages and block table
  (:mod:`~sparrow_nemo.rollout.trtllm.layout`). The context phase stays TensorRT-LLM's.

Budgets come from a device-resident :class:`BudgetTable` so that nothing here reads a device value on the
host; shapes are static (the block table's width), so a step is CUDA-graph capturable.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from sparrow_kernels.landmarks import Landmarks

from sparrow_nemo.rollout.trtllm.kv_cache import LandmarkPool
from sparrow_nemo.rollout.trtllm.layout import kv_page_views
from sparrow_nemo.sparse.schedule import BudgetSchedule

GenerationPath = Literal["native", "sparrow_kernels"]

#: SM versions >= 100 whose generation phase does not use TRTLLM-GEN (consumer Blackwell)
_NO_TLLM_GEN = (120, 121)


def generation_path(sm_version: int) -> GenerationPath:
    """Who computes sparse decode attention on a GPU of compute capability ``sm_version`` (e.g. 90).

    TensorRT-LLM's ``AttentionOp`` (``cpp/tensorrt_llm/common/attentionOp.h``) uses the TRTLLM-GEN FMHA
    only when ``mUseTllmGen = (mSM >= 100) && (mSM != 120)`` (``&& mSM != 121`` in later files;
    ``cpp/tensorrt_llm/kernels/fmhaDispatcher.cpp``: ``isSM100Family()``), and only that path reads
    the sparse attention indices in the generation phase (the sparse-attention developer guide: sparse
    generation compute is SM100+). Elsewhere the XQA/MMHA kernels attend densely.
    """
    if sm_version >= 100 and sm_version not in _NO_TLLM_GEN:
        return "native"
    return "sparrow_kernels"


class BudgetTable:
    """KV budget (tokens) per bin on the device, looked up without a host sync.

    Holds ``ceil(max_seq_len / bin_tokens) + 1`` bins (the schedule's last budget repeats, as
    :meth:`BudgetSchedule.budget` does past the last bin), so a new schedule with the same bin width and
    page size is copied into the same tensor in place (a captured CUDA graph sees it).
    """

    def __init__(self, schedule: BudgetSchedule, max_seq_len: int, device: str | torch.device) -> None:
        if max_seq_len < 1:
            raise ValueError(f"BudgetTable: max_seq_len must be >= 1 token, got {max_seq_len}")
        self.bin_tokens = schedule.bin_tokens
        self.page_size = schedule.page_size
        self.num_bins = math.ceil(max_seq_len / self.bin_tokens) + 1
        self.table = torch.empty(self.num_bins, dtype=torch.int32, device=device)
        self.update(schedule)

    def update(self, schedule: BudgetSchedule) -> None:
        """Use ``schedule`` from now on (host-to-device copy: call between steps, not inside a graph)."""
        if (schedule.bin_tokens, schedule.page_size) != (self.bin_tokens, self.page_size):
            raise ValueError(
                f"BudgetTable: schedule '{schedule.name}' has bin_tokens={schedule.bin_tokens}, "
                f"page_size={schedule.page_size}; the engine was built with {self.bin_tokens}, {self.page_size}"
            )
        per_bin = [schedule.budget(i * self.bin_tokens) for i in range(self.num_bins)]
        self.table.copy_(torch.tensor(per_bin, dtype=torch.int32))

    def budgets(self, seq_len: torch.Tensor) -> torch.Tensor:
        """int32 [B] budgets for cached lengths ``seq_len`` [B] (the current token included)."""
        bins = torch.div(seq_len.to(torch.int64), self.bin_tokens, rounding_mode="floor")
        return self.table[bins.clamp(max=self.num_bins - 1)]


def split_fused_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a fused ``[T, (Hq + 2 Hkv) * D]`` tensor -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"fused qkv must be [T, {width}] for Hq={num_heads}, Hkv={num_kv_heads}, D={head_dim}, "
            f"got {tuple(qkv.shape)}"
        )
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (
        qkv[:, :q_end].view(-1, num_heads, head_dim),
        qkv[:, q_end:k_end].view(-1, num_kv_heads, head_dim),
        qkv[:, k_end:].view(-1, num_kv_heads, head_dim),
    )


def sparse_decode_step(
    qkv: torch.Tensor,
    layer_pool: torch.Tensor,
    landmarks: Landmarks,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budgets: torch.Tensor,
    *,
    num_heads: int,
    sink_pages: int,
    local_pages: int,
    scale: float,
) -> torch.Tensor:
    """One generation step of one layer over TensorRT-LLM's pool, computed by ``sparrow_kernels``.

    Args:
        qkv: [G, (Hq + 2 Hkv) * D] fused q/k/v of the G generation tokens (after q/k norm and rotary),
            in the KV-cache dtype.
        layer_pool: ``get_buffers(layer, kv_layout="HND")`` [num_blocks, 2, Hkv, page, D]; the new
            token's K and V are written into it (where TensorRT-LLM's kernels would put them).
        landmarks: the layer's page landmarks (:meth:`LandmarkPool.layer`, updated in place): float32
            [num_blocks, Hkv, D] centroids, or a ``sparrow_kernels.KeyBounds`` of two (minmax); the
            pages are scored by the matching rule.
        block_table: int32 [G, max_pages] (:func:`~sparrow_nemo.rollout.trtllm.layout.block_table_from_offsets`).
        seq_len: int32 [G] tokens in the cache with the current one. budgets: int32 [G] tokens.
        num_heads: query heads Hq. scale: softmax scale (``1 / (q_scaling * sqrt(D))``).

    Returns:
        [G, Hq * D] attention output in qkv's dtype.
    """
    import sparrow_kernels

    k_pages, v_pages = kv_page_views(layer_pool)
    num_kv_heads, page_size, head_dim = k_pages.shape[1:]
    q, k, v = split_fused_qkv(qkv, num_heads, num_kv_heads, head_dim)
    sparrow_kernels.append_kv(k_pages, v_pages, landmarks, block_table, seq_len - 1, k, v)
    # page_selection returns physical page ids and merge tickets too: the attention reads pages through
    # one indirection, with no logical -> physical translation between the two launches
    selection = sparrow_kernels.page_selection(
        q, landmarks, block_table, seq_len, budgets, page_size, sink_pages, local_pages
    )
    out = sparrow_kernels.decode_attention_paged(q, k_pages, v_pages, block_table, seq_len, selection, scale)
    return out.reshape(q.shape[0], num_heads * head_dim)


def predict_native_indices(
    q: torch.Tensor,
    k: torch.Tensor,
    pool: LandmarkPool,
    layer_idx: int,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    budgets: torch.Tensor,
    *,
    sink_pages: int,
    local_pages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SM100 path: update the page landmarks with the new keys, select pages, in TensorRT-LLM's layout.

    TensorRT-LLM's attention op writes the new K/V itself on this path; only the landmarks move here
    (centroids, or key bounds: the pool's page score decides the selection's too).

    Args:
        q: [G, Hq, D], k: [G, Hkv, D] the generation tokens' query and key (after norm and rotary).
        block_table: int32 [G, max_pages]; seq_len: int32 [G] with the current token; budgets: int32 [G].

    Returns:
        ``sparse_attn_predict``'s (indices int32 [Hkv, G * max_pages + 1], offsets int32 [G + 1]), see
        :func:`to_trtllm_indices`.
    """
    import sparrow_kernels

    pool.append(layer_idx, k, block_table, seq_len - 1)
    page_idx, counts = sparrow_kernels.select_pages_paged(
        q, pool.layer(layer_idx), block_table, seq_len, budgets, pool.page_size, sink_pages, local_pages
    )
    return to_trtllm_indices(page_idx, counts)


def to_trtllm_indices(page_idx: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request page lists -> TensorRT-LLM's ``sparse_attn_indices`` / ``sparse_attn_offsets``.

    Layout (``tensorrt_llm/_torch/attention_backend/interface.py`` ``SparseAttentionParams``:
    indices ``[num_kv_heads, num_sparse_attn_indices]``, offsets ``[num_generations + 1]``): request b's
    pages are columns ``offsets[b] .. offsets[b+1] - 1`` of every head's row. The kernels address a
    head's row with the tensor's last-dimension size as stride (``cpp/tensorrt_llm/thop/attentionOp.cpp``:
    ``sparse_attn_indices_stride = sparse_attn_indices.size(-1)``; ``gatherKvPageOffsets`` reads
    ``head * stride + offsets[b] + i``), so the width may be a static capacity: ``B * P`` columns and one
    spare that takes the padding entries; columns past ``offsets[B]`` are never read. Sparrow's rule keeps the same number of pages in every KV head of a
    request, so head 0's count gives the offsets.

    Args:
        page_idx: integer [B, Hkv, P] logical pages, ascending, the first ``counts[b, h]`` valid.
        counts: integer [B, Hkv] kept pages.

    Returns:
        (indices int32 [Hkv, B * P + 1] contiguous, offsets int32 [B + 1]); unused columns hold 0 or
        padding.
    """
    if page_idx.dim() != 3 or counts.shape != page_idx.shape[:2]:
        raise ValueError(
            f"page_idx must be [B, Hkv, P] and counts [B, Hkv], got {tuple(page_idx.shape)} and {tuple(counts.shape)}"
        )
    batch, num_kv_heads, width = page_idx.shape
    per_request = counts[:, 0].to(torch.int32)
    offsets = torch.zeros(batch + 1, dtype=torch.int32, device=page_idx.device)
    offsets[1:] = torch.cumsum(per_request, dim=0)
    column = torch.arange(width, device=page_idx.device, dtype=torch.int32)[None, :]
    trash = batch * width  # the spare column
    dest = torch.where(column < per_request[:, None], offsets[:-1, None] + column, trash)
    indices = torch.zeros(num_kv_heads, trash + 1, dtype=torch.int32, device=page_idx.device)
    indices.scatter_(
        1,
        dest.reshape(1, -1).expand(num_kv_heads, -1).long(),
        page_idx.to(torch.int32).permute(1, 0, 2).reshape(num_kv_heads, -1),
    )
    return indices, offsets
