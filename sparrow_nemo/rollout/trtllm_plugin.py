"""TensorRT-LLM classes of the "sparrow" sparse-attention algorithm (needs ``tensorrt_llm``; cluster only).

Written against tensorrt-llm 1.2.0 (PyTorch backend), following its sparse-attention developer guide:

- :class:`SparrowSparseAttentionConfig`: the user-facing config, ``algorithm: "sparrow"``;
- :class:`SparrowTrtllmAttention`: a ``TrtllmAttention`` whose ``sparse_kv_predict`` writes the prompt's
  page centroids (it evicts nothing: prefill stays dense) and whose ``sparse_attn_predict`` appends the new
  key to its page centroid and returns the pages of :func:`~sparrow_nemo.rollout.trtllm_sparse.predict_pages`
  (the method layer's rule, or the ``sparrow_kernels`` Triton kernel on CUDA) in TensorRT-LLM's
  ``(indices [Hkv, total], offsets [B + 1])`` layout, indices in units of ``page_size``-token blocks;
- :class:`SparrowWorkerExtension`: the RL worker extension (``update_weights`` from TensorRT-LLM) plus
  ``set_sparrow_schedule`` / ``reset_sparrow_centroids`` for the schedule the trainer adapts each step.

Registration: 1.2.0 dispatches sparse algorithms with hard-coded ``if algorithm == ...`` functions and a
closed pydantic union for ``sparse_attention_config``. :func:`register` (run when this module is imported,
which the Ray workers do because the worker extension lives here) widens that union and wraps the
dispatch functions so "sparrow" resolves to the classes above and every other algorithm is unchanged.

Assumptions (from reading the 1.2.0 source; not yet run on a GPU in this repository):
- the q/k the attention backend receives for Qwen3 are after q/k RMSNorm and rotary embedding
  (Qwen3 applies them in the module, not fused into the attention op);
- ``metadata.kv_lens_cuda_runtime`` counts the current token; one new token per generation request
  (no speculative decoding); KV cache with ``tokens_per_block == page_size``, no block reuse, no
  chunked prefill (the engine's LLM kwargs set all three).
"""

from __future__ import annotations

import functools
import operator
import typing
from typing import Any, Literal

import torch
from pydantic import Field
from tensorrt_llm._torch.attention_backend.trtllm import TrtllmAttention
from tensorrt_llm.llmapi import llm_args
from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension

from sparrow_nemo.rollout.trtllm_sparse import (
    ALGORITHM,
    CentroidPool,
    SparrowSparseSpec,
    flatten_page_indices,
    predict_pages,
    split_fused_qkv,
)


class SparrowSparseAttentionConfig(llm_args.BaseSparseAttentionConfig):
    """``sparse_attention_config`` of the "sparrow" algorithm (fields of ``SparrowSparseSpec.to_config_dict``)."""

    algorithm: Literal["sparrow"] = ALGORITHM
    page_size: int = Field(default=16, description="Tokens per page (= KV cache tokens_per_block).")
    sink_pages: int = Field(default=1, description="First pages always attended (attention sink).")
    local_pages: int = Field(default=2, description="Most recent pages always attended.")
    dense_layers: int = Field(default=2, description="First decoder layers that attend densely.")
    bin_tokens: int = Field(default=2000, description="Width of a schedule bin, tokens of cached length.")
    budgets: list[int | str] = Field(
        default_factory=lambda: ["dense"], description="KV budget per bin, tokens incl. the reserved pages."
    )
    schedule_name: str = Field(default="", description="Label of the schedule.")

    def supports_backend(self, backend: str) -> bool:
        return backend == "pytorch"

    def get_indices_block_size(self) -> int:
        return self.page_size

    def spec(self) -> SparrowSparseSpec:
        """The validated :class:`SparrowSparseSpec`."""
        return SparrowSparseSpec.from_config_dict(self.model_dump(exclude={"seq_len_threshold"}))


class _Runtime:
    """Per-process state shared by the attention layers: the current spec and the centroid pool."""

    def __init__(self) -> None:
        self.spec: SparrowSparseSpec | None = None
        self.pool: CentroidPool | None = None
        self.use_kernel: bool | None = None
        self.tables: dict[
            tuple, torch.Tensor
        ] = {}  # this step's block tables (context rows, generation rows)

    def pool_for(self, kv_cache_manager: Any, layer: TrtllmAttention, q: torch.Tensor) -> CentroidPool:
        if self.pool is None:
            assert self.spec is not None
            self.pool = CentroidPool(
                kv_cache_manager.blocks_in_primary_pool,
                layer.num_kv_heads,
                layer.head_dim,
                self.spec.page_size,
                kv_dtype=q.dtype,
                device=q.device,
            )
        if self.use_kernel is None:
            try:
                import sparrow_kernels

                self.use_kernel = bool(sparrow_kernels.available(q.device))
            except ImportError:
                self.use_kernel = False
        return self.pool


_RUNTIME = _Runtime()


class SparrowTrtllmAttention(TrtllmAttention):
    """``TrtllmAttention`` with Sparrow's decode page selection (see the module docstring)."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        quant_config: Any = None,
        q_scaling: float | None = None,
        sparse_attention_config: SparrowSparseAttentionConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if sparse_attention_config is None:
            raise ValueError("SparrowTrtllmAttention needs sparse_attention_config (algorithm 'sparrow')")
        super().__init__(
            layer_idx,
            num_heads,
            head_dim,
            sparse_attention_config=sparse_attention_config,
            num_kv_heads=num_kv_heads,
            quant_config=quant_config,
            q_scaling=q_scaling,
            **kwargs,
        )
        if _RUNTIME.spec is None:
            _RUNTIME.spec = sparse_attention_config.spec()

    def _q_k(self, q: torch.Tensor, k: torch.Tensor | None, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, Hq, D] and keys [T, Hkv, D] of token rows ``rows`` (fused qkv when k is None)."""
        if k is None:
            return split_fused_qkv(q[rows], self.num_heads, self.num_kv_heads, self.head_dim)
        return (
            q[rows].reshape(-1, self.num_heads, self.head_dim),
            k[rows].reshape(-1, self.num_kv_heads, self.head_dim),
        )

    @staticmethod
    def _block_table(metadata: Any, rows: slice, device: torch.device) -> torch.Tensor:
        """[n, max_blocks] int32 physical KV block per logical page of requests ``rows``, -1 padded.

        Built once per step (all layers share it): cached on the request ids and their KV lengths.
        """
        request_ids = list(metadata.request_ids[rows])
        key = (tuple(request_ids), tuple(metadata.kv_lens[rows].tolist()), str(device))
        table = _RUNTIME.tables.get(key)
        if table is None:
            blocks = metadata.kv_cache_manager.get_batch_cache_indices(request_ids)
            width = max((len(b) for b in blocks), default=0)
            table = torch.full((len(blocks), width), -1, dtype=torch.int32)
            for i, b in enumerate(blocks):
                table[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
            if len(_RUNTIME.tables) >= 4:  # older steps' tables
                _RUNTIME.tables.clear()
            table = _RUNTIME.tables[key] = table.to(device)
        return table

    def sparse_kv_predict(
        self, q: torch.Tensor, k: torch.Tensor | None, metadata: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Prefill: write the prompts' page centroids; keep every prompt token (returns no eviction)."""
        spec = _RUNTIME.spec
        if metadata.num_contexts == 0 or spec is None or not spec.is_sparse_layer(self.layer_idx):
            return None, None
        pool = _RUNTIME.pool_for(metadata.kv_cache_manager, self, q)
        _, keys = self._q_k(q, k, slice(0, metadata.num_ctx_tokens))
        lengths = metadata.context_lens[: metadata.num_contexts].tolist()
        table = self._block_table(metadata, slice(0, metadata.num_contexts), q.device)
        start = 0
        for i, n in enumerate(lengths):
            pool.write_prefill(self.layer_idx, keys[start : start + n], table[i])
            start += n
        return None, None

    def sparse_attn_predict(
        self, q: torch.Tensor, k: torch.Tensor | None, metadata: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Decode: update the centroids with the new keys and select the pages to attend to."""
        spec = _RUNTIME.spec
        if metadata.num_generations == 0 or spec is None or not spec.is_sparse_layer(self.layer_idx):
            return None, None
        pool = _RUNTIME.pool_for(metadata.kv_cache_manager, self, q)
        q_gen, k_gen = self._q_k(q, k, slice(metadata.num_ctx_tokens, None))
        gen = slice(metadata.num_contexts, metadata.num_seqs)
        seq_len = metadata.kv_lens_cuda_runtime[gen].to(torch.int64)
        table = self._block_table(metadata, gen, q.device)
        pool.append(self.layer_idx, k_gen, table, seq_len - 1)
        page_idx = predict_pages(q_gen, pool, self.layer_idx, table, seq_len, spec, bool(_RUNTIME.use_kernel))
        return flatten_page_indices(page_idx)


class SparrowWorkerExtension(WorkerExtension):
    """TensorRT-LLM's RL worker extension plus the Sparrow schedule controls (called by collective RPC)."""

    def set_sparrow_schedule(self, config: dict[str, Any]) -> None:
        """Use the spec of ``config`` (a ``SparrowSparseSpec.to_config_dict()``) from the next step on."""
        _RUNTIME.spec = SparrowSparseSpec.from_config_dict(config)

    def reset_sparrow_centroids(self) -> None:
        """Drop the centroid pool (after sleep: the KV cache it mirrors was released)."""
        _RUNTIME.pool = None
        _RUNTIME.tables.clear()


# --------------------------------------------------------------------------------------- registration
_DISPATCH_MODULES = (
    "tensorrt_llm._torch.attention_backend.sparse.utils",
    "tensorrt_llm._torch.attention_backend.utils",
    "tensorrt_llm._torch.pyexecutor._util",
)


def _wrap(original: Any, ours: Any) -> Any:
    def dispatch(sparse_attn_config: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(sparse_attn_config, "algorithm", None) == ALGORITHM:
            return ours
        return original(sparse_attn_config, *args, **kwargs)

    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


def register() -> None:
    """Make TensorRT-LLM accept ``algorithm: sparrow`` (idempotent; see the module docstring)."""
    import importlib

    from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager

    ours = {
        "get_sparse_attn_kv_cache_manager": KVCacheManager,
        "get_trtllm_sparse_attn_attention_backend": SparrowTrtllmAttention,
    }
    for module_name in _DISPATCH_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, cls in ours.items():
            fn = getattr(module, name, None)
            if fn is not None and not hasattr(fn, "__wrapped__"):
                setattr(module, name, _wrap(fn, cls))
    for args_cls in (llm_args.BaseLlmArgs, llm_args.TorchLlmArgs):
        field = args_cls.model_fields.get("sparse_attention_config")
        if field is None:
            continue
        members = [m for m in typing.get_args(field.annotation) if m is not type(None)]
        flat = [a for m in members for a in (typing.get_args(m) or (m,))]
        if SparrowSparseAttentionConfig not in flat:
            field.annotation = functools.reduce(operator.or_, [*flat, SparrowSparseAttentionConfig]) | None
            args_cls.model_rebuild(force=True)


register()
