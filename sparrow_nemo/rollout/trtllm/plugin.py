"""TensorRT-LLM classes of the "sparrow" sparse-attention algorithm (needs ``tensorrt_llm``; cluster only).

Written against the 1.2 line of TensorRT-LLM (PyTorch backend) and never run: TensorRT-LLM cannot be
installed where this repository is tested. Every tensor computation these classes make is a plain
function of ``trtllm_kv_cache`` / ``trtllm_layout`` / ``trtllm_decode``, tested on CPU on tensors laid
out as TensorRT-LLM lays them out; this module only wires them to TensorRT-LLM's hooks:

- :class:`SparrowSparseAttentionConfig`: the ``sparse_attention_config`` class, ``algorithm: "sparrow"``
  (``tensorrt_llm/llmapi/llm_args.py`` ``BaseSparseAttentionConfig``);
- :class:`SparrowKVCacheManager`: a ``KVCacheManager`` that owns the page landmarks (centroids, or key
  bounds under ``page_score="minmax"``; RocketKV's pattern,
  ``tensorrt_llm/_torch/attention_backend/sparse/rocket.py`` ``RocketKVCacheManager``): allocated in its
  ``__init__`` for ``blocks_in_primary_pool`` blocks, counted per token in the KV-cache budget
  (static ``get_cache_size_per_token(model_config, mapping, **kwargs)``), indexed by the KV block ids;
- :class:`SparrowTrtllmAttention`: a ``TrtllmAttention`` (``tensorrt_llm/_torch/attention_backend/trtllm.py``)
  whose ``sparse_kv_predict`` writes the prompts' page landmarks and whose generation phase is sparse on
  every GPU: on the SM100 family ``sparse_attn_predict`` hands TensorRT-LLM the selected pages; elsewhere
  (Hopper) ``forward`` runs TensorRT-LLM's op on the context tokens only
  (``attention_input_type=context_only``, as its MLA module does in ``tensorrt_llm/_torch/modules/attention.py``)
  and the generation tokens through ``sparrow_kernels`` over TensorRT-LLM's own KV pool;
- :class:`SparrowWorkerExtension`: TensorRT-LLM's RL worker extension plus the schedule, the sampler seed
  and the device UUID of the worker.

Registration: 1.2 dispatches sparse algorithms with hard-coded functions
(``tensorrt_llm/_torch/attention_backend/sparse/utils.py`` ``get_sparse_attn_kv_cache_manager``,
``get_trtllm_sparse_attn_attention_backend``) and a closed pydantic union for ``sparse_attention_config``.
:func:`register` (run on import, which the Ray workers do because the worker extension lives here)
widens the union and wraps the dispatch functions so "sparrow" resolves to the classes above.

Assumptions (read in the sources, not run):
- Qwen3's attention module fuses q/k RMSNorm and RoPE before the backend (``QKNormRoPEAttention``,
  ``fuse_qk_norm_rope=True``: ``rope_fusion`` off, so the backend gets ``pos_embd_params=None`` and a fused
  qkv after RoPE); :class:`SparrowTrtllmAttention` refuses a backend with RoPE fusion;
- ``metadata.kv_lens_cuda_runtime`` counts the current token; one new token per generation request (no
  speculative decoding); ``tokens_per_block == page_size``, no block reuse, no chunked prefill (the
  engine's LLM kwargs set all three); one KV-cache pool (no variable sliding windows).
"""

from __future__ import annotations

import functools
import math
import operator
import typing
import weakref
from typing import Any, Literal

import torch
from pydantic import Field
from tensorrt_llm._torch.attention_backend.interface import AttentionInputType
from tensorrt_llm._torch.attention_backend.trtllm import TrtllmAttention
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
from tensorrt_llm.llmapi import llm_args
from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension

from sparrow_nemo.rollout.trtllm.decode import (
    BudgetTable,
    generation_path,
    predict_native_indices,
    sparse_decode_step,
    split_fused_qkv,
)
from sparrow_nemo.rollout.trtllm.kv_cache import (
    LandmarkPool,
    centroid_bytes_per_token,
    context_token_positions,
)
from sparrow_nemo.rollout.trtllm.layout import block_table_from_offsets, layers_per_pool
from sparrow_nemo.rollout.trtllm.sparse import ALGORITHM, SparrowSparseSpec


class SparrowSparseAttentionConfig(llm_args.BaseSparseAttentionConfig):
    """``sparse_attention_config`` of the "sparrow" algorithm (fields of ``SparrowSparseSpec.to_config_dict``)."""

    algorithm: Literal["sparrow"] = ALGORITHM
    page_size: int = Field(default=16, description="Tokens per page (= KV cache tokens_per_block).")
    sink_pages: int = Field(default=1, description="First pages always attended (attention sink).")
    local_pages: int = Field(default=2, description="Most recent pages always attended.")
    dense_layers: int = Field(default=2, description="First decoder layers that attend densely.")
    page_score: str = Field(
        default="centroid",
        description="Page ranking: 'centroid' (mean key) or 'minmax' (per-page key bounds).",
    )
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
    """Per-process state: the current spec (the trainer's schedule) and the live KV-cache managers."""

    def __init__(self) -> None:
        self.spec: SparrowSparseSpec | None = None
        self.managers: weakref.WeakSet[SparrowKVCacheManager] = weakref.WeakSet()

    def use(self, spec: SparrowSparseSpec) -> None:
        self.spec = spec
        for manager in list(self.managers):
            manager.budget_table.update(spec.schedule)


_RUNTIME = _Runtime()


class SparrowKVCacheManager(KVCacheManager):
    """``KVCacheManager`` that also owns the page landmarks of the sparse layers (module docstring)."""

    def __init__(self, *args: Any, sparse_attn_config: SparrowSparseAttentionConfig, **kwargs: Any) -> None:
        kv_cache_config = args[0] if args else kwargs["kv_cache_config"]
        if kv_cache_config.enable_block_reuse:
            raise ValueError("the sparrow algorithm needs kv_cache_config.enable_block_reuse=False")
        super().__init__(*args, **kwargs)
        spec = _RUNTIME.spec or sparse_attn_config.spec()
        _RUNTIME.spec = spec
        if self.tokens_per_block != spec.page_size:
            raise ValueError(
                f"kv_cache_config.tokens_per_block={self.tokens_per_block} must equal the sparrow page_size "
                f"{spec.page_size} (one page landmark per KV block)"
            )
        pools = layers_per_pool(self.kv_cache_pool_mapping)
        if len(pools) != 1:
            raise ValueError(f"the sparrow algorithm supports one KV-cache pool, this model has {len(pools)}")
        ((self.sparrow_pool_index, self.sparrow_layers_in_pool),) = pools.items()
        layers = [layer for layer in self.layer_offsets if spec.keeps_landmarks(layer)]
        heads = {self.num_kv_heads_per_layer[self.layer_offsets[layer]] for layer in layers}
        if len(heads) > 1:
            raise ValueError(
                f"the sparrow algorithm needs one KV head count for all layers, got {sorted(heads)}"
            )
        kv_dtype = self.get_buffers(next(iter(self.layer_offsets)), kv_layout="HND").dtype
        self.landmarks = LandmarkPool(
            self.blocks_in_primary_pool,
            layers,
            heads.pop() if heads else 1,
            self.head_dim,
            spec.page_size,
            kv_dtype=kv_dtype,
            device="cuda",
            page_score=spec.page_score,
        )
        self.budget_table = BudgetTable(spec.schedule, self.max_seq_len, "cuda")
        _RUNTIME.managers.add(self)

    def shutdown(self) -> None:
        _RUNTIME.managers.discard(self)
        self.landmarks = None
        super().shutdown()

    @staticmethod
    def get_cache_size_per_token(model_config: Any, mapping: Any, **kwargs: Any) -> float:
        """KV bytes per token (``KVCacheManager.get_cache_size_per_token``) plus the page-landmark bytes."""
        base = KVCacheManager.get_cache_size_per_token(model_config, mapping, **kwargs)
        spec = model_config.sparse_attention_config.spec()
        config = model_config.pretrained_config
        layers = mapping.pp_layers(model_config.get_num_attention_layers())
        tp = 1 if mapping.enable_attention_dp else mapping.tp_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = max(config.num_key_value_heads // tp, 1)
        sparse = sum(1 for layer in layers if spec.keeps_landmarks(layer))
        return base + centroid_bytes_per_token(sparse, heads, head_dim, spec.page_size, spec.page_score)


class SparrowTrtllmAttention(TrtllmAttention):
    """``TrtllmAttention`` with Sparrow's sparse decode (see the module docstring)."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        quant_config: Any = None,
        q_scaling: float | None = None,
        pos_embd_params: Any = None,
        sparse_attention_config: SparrowSparseAttentionConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if sparse_attention_config is None:
            raise ValueError("SparrowTrtllmAttention needs sparse_attention_config (algorithm 'sparrow')")
        if pos_embd_params is not None:
            raise ValueError(
                "SparrowTrtllmAttention needs q/k after RoPE (the module's fused qk-norm+RoPE), but this "
                "attention backend was built with RoPE fusion"
            )
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
        major, minor = torch.cuda.get_device_capability()
        self.sparrow_path = generation_path(10 * major + minor)
        self.sparrow_scale = 1.0 / ((q_scaling or 1.0) * math.sqrt(head_dim))

    # ------------------------------------------------------------------ shared pieces
    def _sparse_now(self) -> bool:
        spec = _RUNTIME.spec
        return spec is not None and spec.is_sparse_layer(self.layer_idx)

    def _split(
        self, q: torch.Tensor, k: torch.Tensor | None, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, Hq, D] and keys [T, Hkv, D] of token rows ``rows`` (fused qkv when k is None)."""
        if k is None:
            q_rows, k_rows, _ = split_fused_qkv(q[rows], self.num_heads, self.num_kv_heads, self.head_dim)
            return q_rows, k_rows
        return (
            q[rows].reshape(-1, self.num_heads, self.head_dim),
            k[rows].reshape(-1, self.num_kv_heads, self.head_dim),
        )

    def _table(self, metadata: Any, first_row: int, num_rows: int) -> torch.Tensor:
        manager = metadata.kv_cache_manager
        return block_table_from_offsets(
            metadata.kv_cache_block_offsets,
            manager.sparrow_pool_index,
            first_row,
            num_rows,
            manager.sparrow_layers_in_pool,
        )

    def _generation_inputs(self, metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block table int32 [G, P], seq_len int32 [G] incl. the current token, budgets int32 [G])."""
        table = self._table(metadata, metadata.num_contexts, metadata.num_generations)
        seq_len = metadata.kv_lens_cuda_runtime[metadata.num_contexts : metadata.num_seqs].to(torch.int32)
        return table, seq_len, metadata.kv_cache_manager.budget_table.budgets(seq_len)

    # ------------------------------------------------------------------ TensorRT-LLM hooks
    def sparse_kv_predict(
        self, q: torch.Tensor, k: torch.Tensor | None, metadata: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Context phase: write the prompts' page landmarks; evict nothing (prefill stays dense)."""
        if metadata.num_contexts == 0 or not self._sparse_now():
            return None, None
        _, keys = self._split(q, k, slice(0, metadata.num_ctx_tokens))
        rows, positions = context_token_positions(
            metadata.seq_lens_cuda[: metadata.num_contexts], metadata.num_ctx_tokens
        )
        table = self._table(metadata, 0, metadata.num_contexts)
        metadata.kv_cache_manager.landmarks.write_prefill(self.layer_idx, keys, rows, positions, table)
        return None, None

    def sparse_attn_predict(
        self, q: torch.Tensor, k: torch.Tensor | None, metadata: Any, **kwargs: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """SM100 family: the pages TensorRT-LLM's generation kernels attend to (elsewhere: none, see forward)."""
        if self.sparrow_path != "native" or metadata.num_generations == 0 or not self._sparse_now():
            return None, None
        q_gen, k_gen = self._split(q, k, slice(metadata.num_ctx_tokens, None))
        table, seq_len, budgets = self._generation_inputs(metadata)
        spec = _RUNTIME.spec
        return predict_native_indices(
            q_gen,
            k_gen,
            metadata.kv_cache_manager.landmarks,
            self.layer_idx,
            table,
            seq_len,
            budgets,
            sink_pages=spec.sink_pages,
            local_pages=spec.local_pages,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Off the SM100 family, a sparse layer's generation tokens go through ``sparrow_kernels``."""
        if self.sparrow_path == "native" or metadata.num_generations == 0 or not self._sparse_now():
            return super().forward(q, k, v, metadata, *args, **kwargs)
        input_type = kwargs.get("attention_input_type", AttentionInputType.mixed)
        unsupported = [
            name
            for name in ("output_sf", "out_scale", "out_scale_sf", "kv_scales_sf")
            if kwargs.get(name) is not None
        ]
        if k is not None or args or unsupported or input_type != AttentionInputType.mixed:
            raise ValueError(
                "sparrow decode on this GPU takes a fused bf16/fp16 qkv in a mixed batch; got "
                f"k={'set' if k is not None else None}, {len(args)} positional extras, {unsupported}, {input_type}"
            )
        num_ctx = metadata.num_ctx_tokens
        output = kwargs.pop("output", None)
        if output is None:
            output = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if metadata.num_contexts:
            kwargs["attention_input_type"] = AttentionInputType.context_only
            super().forward(q[:num_ctx], None, None, metadata, output=output[:num_ctx], **kwargs)
        manager = metadata.kv_cache_manager
        table, seq_len, budgets = self._generation_inputs(metadata)
        spec = _RUNTIME.spec
        output[num_ctx:] = sparse_decode_step(
            q[num_ctx:],
            manager.get_buffers(self.layer_idx, kv_layout="HND"),
            manager.landmarks.layer(self.layer_idx),
            table,
            seq_len,
            budgets,
            num_heads=self.num_heads,
            sink_pages=spec.sink_pages,
            local_pages=spec.local_pages,
            scale=self.sparrow_scale,
        )
        return output


class SparrowWorkerExtension(WorkerExtension):
    """TensorRT-LLM's RL worker extension plus the Sparrow controls (called by collective RPC).

    ``self.engine`` (the PyExecutor) and ``self.device_id`` are the worker's, as
    ``tensorrt_llm/llmapi/rlhf_utils.py`` ``WorkerExtension.update_weights`` uses them.
    """

    def set_sparrow_schedule(self, config: dict[str, Any]) -> None:
        """Use the spec of ``config`` (a ``SparrowSparseSpec.to_config_dict()``) from the next step on."""
        _RUNTIME.use(SparrowSparseSpec.from_config_dict(config))

    def sparrow_device_uuid(self) -> str:
        """UUID of this worker's GPU (the key its ``update_weights`` looks up)."""
        from tensorrt_llm._torch.utils import get_device_uuid

        return get_device_uuid(self.device_id)

    def sparrow_seed_sampler(self, seed: int) -> None:
        """Re-seed TorchSampler's one generator (``TorchSampler.get_generator`` rebuilds it from
        ``_global_seed`` when ``_generator`` is None)."""
        sampler = getattr(self.engine, "sampler", None)
        if sampler is None or not hasattr(sampler, "_global_seed"):
            raise RuntimeError(f"the executor's sampler {type(sampler).__name__} is not a TorchSampler")
        sampler._global_seed = int(seed)
        sampler._generator = None


# --------------------------------------------------------------------------------------- registration
_DISPATCH_MODULES = (
    "tensorrt_llm._torch.attention_backend.sparse.utils",
    "tensorrt_llm._torch.attention_backend.sparse",
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

    ours = {
        "get_sparse_attn_kv_cache_manager": SparrowKVCacheManager,
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
