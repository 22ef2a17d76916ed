"""The trainer builds the engine ``rollout.backend`` names; TensorRT-LLM is the cluster extra."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from sparrow_nemo._optional import MissingOptionalDependency, is_available
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.setup import build_engine


def _tiny_hf_dir(path: Path) -> Path:
    config = Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def test_trtllm_backend_needs_a_checkpoint() -> None:
    config = load_config("tiny_cpu", ["rollout.backend=trtllm", "trainer.device=cuda"])
    with pytest.raises(ValueError, match=r"model\.hf_checkpoint"):
        build_engine(config, {})


@pytest.mark.skipif(is_available("tensorrt_llm"), reason="tensorrt_llm is installed here")
def test_trtllm_backend_without_tensorrt_llm_names_the_cluster_extra(tmp_path: Path) -> None:
    model_dir = _tiny_hf_dir(tmp_path / "hf")
    config = load_config(
        "tiny_cpu", ["rollout.backend=trtllm", "trainer.device=cuda", f"model.hf_checkpoint={model_dir}"]
    )
    with pytest.raises(MissingOptionalDependency, match=r"sparrow-nemo\[cluster\]"):
        build_engine(config, {})
