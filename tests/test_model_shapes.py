"""Qwen3 presets against the published parameter counts, and shape validation."""

from __future__ import annotations

import pytest
import transformers

from sparrow_nemo.hf_qwen3 import hf_config_dict
from sparrow_nemo.model_shapes import PRESETS, Qwen3Shape, get_shape


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("qwen3-0.6b", 0.596),
        ("qwen3-1.7b", 1.721),
        ("qwen3-4b", 4.022),
        ("qwen3-8b", 8.191),
        ("qwen3-14b", 14.768),
    ],
)
def test_preset_parameter_counts_match_the_public_models(name: str, billions: float) -> None:
    assert get_shape(name).num_parameters() / 1e9 == pytest.approx(billions, abs=2e-3)


@pytest.mark.parametrize("name", ["tiny", "tiny-test"])
def test_parameter_count_equals_transformers_model(name: str) -> None:
    shape = PRESETS[name]
    config = transformers.Qwen3Config(**hf_config_dict(shape))
    model = transformers.Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()


def test_bad_gqa_and_unknown_preset_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        PRESETS["tiny"].replace(num_attention_heads=5)
    with pytest.raises(KeyError, match="known presets"):
        get_shape("qwen3-3b")
    with pytest.raises(ValueError, match="head_dim"):
        Qwen3Shape(2, 64, 4, 2, 0, 128, 96, False)


def test_kv_elements_per_token() -> None:
    # Qwen3-8B: 36 layers x 8 KV heads x 128 x (K and V)
    assert get_shape("qwen3-8b").kv_elements_per_token() == 2 * 36 * 8 * 128
