"""The TensorRT-LLM side of the "sparrow" algorithm; runs only where tensorrt_llm is importable.

Not run in this repository's CI (TensorRT-LLM cannot be installed on the CPU machines).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from sparrow_nemo.rollout.trtllm.sparse import SparrowSparseSpec
from sparrow_nemo.sparse.schedule import BudgetSchedule

pytest.importorskip(
    "tensorrt_llm", reason="needs tensorrt_llm (extra 'cluster'); not run in this repository's CI"
)


def test_config_class_and_registration() -> None:  # pragma: no cover - needs tensorrt_llm
    plugin = importlib.import_module("sparrow_nemo.rollout.trtllm.plugin")
    spec = SparrowSparseSpec(BudgetSchedule.from_preset("qwen3-8b-0.86"), dense_layers=2)
    config = plugin.SparrowSparseAttentionConfig(**spec.to_config_dict())
    assert config.spec() == spec
    minmax = dataclasses.replace(spec, page_score="minmax")  # the field exists and round-trips
    assert plugin.SparrowSparseAttentionConfig(**minmax.to_config_dict()).spec() == minmax
    assert config.get_indices_block_size() == 16 and config.supports_backend("pytorch")
    utils = importlib.import_module("tensorrt_llm._torch.attention_backend.sparse.utils")
    for _ in range(2):  # register() is idempotent
        assert utils.get_trtllm_sparse_attn_attention_backend(config) is plugin.SparrowTrtllmAttention
        assert utils.get_sparse_attn_kv_cache_manager(config) is plugin.SparrowKVCacheManager
        plugin.register()
    from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    assert issubclass(plugin.SparrowKVCacheManager, KVCacheManager)
    field = TorchLlmArgs.model_fields["sparse_attention_config"]
    assert "SparrowSparseAttentionConfig" in str(field.annotation)
    from sparrow_nemo.rollout.trtllm.runtime import check_runtime, probe_runtime

    check_runtime(probe_runtime(importlib.import_module("tensorrt_llm")))
