"""LoRA configuration and adapter import checks (no model forward; one rank)."""

from __future__ import annotations

import pytest
import torch

from policy._helpers import single_rank_env
from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.lora import LoraConfig, MegatronLora, init_adapter
from sparrow_nemo.policy.model import build_model
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel, initialize_parallel

SHAPE = PRESETS["tiny-test"]


def test_hf_targets_map_to_fused_megatron_linears():
    config = LoraConfig.from_hf_targets(4, 8.0, ["q_proj", "k_proj", "v_proj", "down_proj"])
    assert config.targets == ("linear_qkv", "linear_fc2") and config.scaling == 2.0
    with pytest.raises(ValueError, match="fused"):
        LoraConfig.from_hf_targets(4, 8.0, ["q_proj", "o_proj"])
    with pytest.raises(ValueError, match="unknown"):
        LoraConfig.from_hf_targets(4, 8.0, ["gate_proj", "up_proj", "lm_head"])
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)


def test_fresh_adapter_starts_at_zero_and_bad_adapters_are_refused():
    config = LoraConfig(rank=2, alpha=4.0, targets=("linear_qkv", "linear_fc2"))
    fresh = init_adapter(SHAPE, config, seed=3)
    assert fresh.scaling == 2.0 and all(float(b.abs().max()) == 0 for _, b in fresh.weights.values())
    q, k = fresh.weights["model.layers.0.self_attn.q_proj"], fresh.weights["model.layers.0.self_attn.k_proj"]
    assert torch.equal(q[0], k[0]), "q/k/v share the fused layer's A"
    with single_rank_env():
        initialize_parallel(ParallelLayout(), SHAPE)
        try:
            model, spec = build_model(SHAPE, ParallelLayout())
            lora = MegatronLora(model, spec, config, fresh)
            split = dict(fresh.weights)
            a, b = split["model.layers.1.self_attn.k_proj"]
            split["model.layers.1.self_attn.k_proj"] = (a + 1.0, b)
            with pytest.raises(ValueError, match="share one A"):
                lora.load_adapter(LoraAdapter(split, fresh.scaling))
            missing = {n: w for n, w in fresh.weights.items() if "layers.1.mlp" not in n}
            with pytest.raises(KeyError, match="down_proj"):
                lora.load_adapter(LoraAdapter(missing, fresh.scaling))
            with pytest.raises(ValueError, match="scaling"):
                lora.load_adapter(LoraAdapter(fresh.weights, 1.0))
            x = torch.randn(3, 1, SHAPE.hidden_size)
            base = model.decoder.layers[0].self_attention.linear_qkv(x)[0]
            with lora.active():  # B = 0: the adapted output equals the base output
                assert torch.equal(model.decoder.layers[0].self_attention.linear_qkv(x)[0], base)
        finally:
            destroy_parallel()
