"""The TensorRT-LLM side of the "sparrow" algorithm; runs only where tensorrt_llm is importable.

Not run in this repository's CI (TensorRT-LLM cannot be installed on the CPU machines).
"""

from __future__ import annotations

import importlib

import pytest

from sparrow_nemo.rollout.trtllm_sparse import SparrowSparseSpec
from sparrow_nemo.sparse.schedule import BudgetSchedule

pytest.importorskip(
    "tensorrt_llm", reason="needs tensorrt_llm (extra 'cluster'); not run in this repository's CI"
)


def test_config_class_and_registration() -> None:  # pragma: no cover - needs tensorrt_llm
    plugin = importlib.import_module("sparrow_nemo.rollout.trtllm_plugin")
    spec = SparrowSparseSpec(BudgetSchedule.from_preset("qwen3-8b-0.86"), dense_layers=2)
    config = plugin.SparrowSparseAttentionConfig(**spec.to_config_dict())
    assert config.spec() == spec
    assert config.get_indices_block_size() == 16 and config.supports_backend("pytorch")
    utils = importlib.import_module("tensorrt_llm._torch.attention_backend.sparse.utils")
    assert utils.get_trtllm_sparse_attn_attention_backend(config) is plugin.SparrowTrtllmAttention
    plugin.register()  # idempotent
    assert utils.get_trtllm_sparse_attn_attention_backend(config) is plugin.SparrowTrtllmAttention
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    field = TorchLlmArgs.model_fields["sparse_attention_config"]
    assert "SparrowSparseAttentionConfig" in str(field.annotation)
