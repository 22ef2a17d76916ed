"""The colocated rollout engine's memory on the GPUs it shares with the policy (what ``sparrow plan`` prices).

The process model (:mod:`sparrow_nemo.grpo.process_model`): one engine per ``rollout.tensor_parallel_size`` =
k GPUs, colocated with their policy ranks; it sleeps (weights and KV pool released) while the policy trains,
so during rollout a GPU holds the policy's resident state (bf16 weights, fp32 gradient buffers, its optimizer
shard), 1/k of the engine's weights (its tensor-parallel shard) and the engine's KV pool: a share of the memory
those leave (``rollout.kv_cache_fraction`` for the torch engine, TensorRT-LLM's free fraction for trtllm) or
``rollout.max_cache_tokens``. A GPU of a k-GPU engine holds 1/k of every token's keys and values (its KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparrow_nemo.model_shapes import Qwen3Shape

#: bytes per element of the engine's dtypes
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class RolloutSpec:
    """The colocated rollout engine the plan sizes (recipe ``rollout``, ``sparsity`` and ``model.dtype``).

    Attributes:
        backend: ``"torch"`` or ``"trtllm"``.
        max_batch_size: ``rollout.max_batch_size`` (the most sequences running at once).
        dtype: the engine's weight and KV dtype (``model.dtype``).
        page_size: KV page tokens (``landmarks_per_page`` landmarks per page, layer and KV head: the
            torch engine's in the KV dtype in every layer, TensorRT-LLM's in fp32 in the sparse layers).
        dense_layers: leading layers without page selection (``sparsity.dense_layers``).
        page_score: ``sparsity.page_score`` (``"minmax"``: two landmarks per page).
        tensor_parallel: GPUs per engine (``rollout.tensor_parallel_size``).
        kv_cache_fraction: the torch engine's share of the free memory for its pool.
        max_cache_tokens: the torch engine's pool in tokens, when set (instead of the fraction).
    """

    backend: str
    max_batch_size: int
    dtype: str
    page_size: int
    dense_layers: int = 0
    page_score: str = "centroid"
    tensor_parallel: int = 1
    kv_cache_fraction: float = 0.9
    max_cache_tokens: int | None = None


@dataclass(frozen=True)
class RolloutMemory:
    """The colocated rollout engine, per GPU it spans.

    Attributes:
        backend: as :class:`RolloutSpec`; tensor_parallel: GPUs per engine.
        engine_weights: bytes of the engine's weights on one of its GPUs (its 1/k shard).
        kv_per_token: KV-cache bytes (keys, values, page landmarks) of one token on one of its GPUs.
        kv_per_sequence: those of one full-length (``seq_len``-token) sequence.
        kv_pool: the pool's bytes on one of its GPUs.
        pool_tokens: tokens the whole engine's pool holds.
        sequences: ``seq_len``-token sequences that fit at once (a full-length row each).
    """

    backend: str
    tensor_parallel: int
    engine_weights: int
    kv_per_token: float
    kv_per_sequence: int
    kv_pool: int
    pool_tokens: int
    sequences: int


def rollout_memory(
    shape: Qwen3Shape, seq_len: int, spec: RolloutSpec, resident: int, gpu_bytes: int
) -> RolloutMemory:
    """The engine's footprint on each of its GPUs during rollout, next to the policy's ``resident`` bytes."""
    from sparrow_nemo.rollout.trtllm.engine import KV_CACHE_FREE_FRACTION
    from sparrow_nemo.rollout.trtllm.kv_cache import centroid_bytes_per_token
    from sparrow_nemo.sparse.pattern import landmarks_per_page

    k = spec.tensor_parallel
    nbytes = DTYPE_BYTES[spec.dtype]
    engine_weights = shape.num_parameters() * nbytes // k
    kv = shape.num_layers * shape.num_key_value_heads * shape.head_dim
    if spec.backend == "trtllm":  # fp32 landmarks of the sparse layers (the KV-cache manager's pool)
        sparse_layers = shape.num_layers - spec.dense_layers
        landmarks = centroid_bytes_per_token(
            sparse_layers, shape.num_key_value_heads, shape.head_dim, spec.page_size, spec.page_score
        )
    else:  # the torch engine's paged cache: landmarks per page and layer in the KV dtype
        landmarks = landmarks_per_page(spec.page_score) * kv * nbytes / spec.page_size
    per_token = (2 * kv * nbytes + landmarks) / k
    free = max(gpu_bytes - resident - engine_weights, 0)
    if spec.backend == "trtllm":
        pool = int(KV_CACHE_FREE_FRACTION * free)
    elif spec.max_cache_tokens is not None:
        pool = int(spec.max_cache_tokens * per_token)
    else:
        pool = int(spec.kv_cache_fraction * free)
    per_sequence = int(per_token * seq_len)
    return RolloutMemory(
        spec.backend,
        k,
        engine_weights,
        per_token,
        per_sequence,
        pool,
        int(pool / per_token),
        pool // per_sequence,
    )
