"""HF <-> megatron conversion: bit-exact round trip (TP=1), fusion layouts for TP>1, config checks."""

from __future__ import annotations

import json

import pytest
import torch

from policy._helpers import make_hf_checkpoint
from sparrow_nemo.hf_qwen3 import (
    CheckpointFormatError,
    SafetensorsDir,
    hf_config_dict,
    hf_tensor_shape,
    save_hf_checkpoint,
    shape_from_hf_config,
)
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy import hf_import
from sparrow_nemo.policy.hf_import import export_hf_state_dict, load_hf_into_model, megatron_shard_from_hf
from sparrow_nemo.policy.model import PolicyModelSpec, build_model, padded_vocab_size
from sparrow_nemo.policy.parallel import ParallelLayout

SHAPE = PRESETS["tiny-test"]


def test_round_trip_single_rank_bit_exact_and_reloadable(tmp_path, single_rank):
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    ckpt = make_hf_checkpoint(SHAPE, tmp_path / "hf")
    single_rank(ParallelLayout(), SHAPE)
    model, spec = build_model(SHAPE, ParallelLayout())
    load_hf_into_model(model, spec, ckpt)
    exported = export_hf_state_dict(model, spec)
    original = load_file(str(ckpt / "model.safetensors"))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    out = save_hf_checkpoint(exported, SHAPE, tmp_path / "export")
    assert shape_from_hf_config(json.loads((out / "config.json").read_text())) == SHAPE
    reloaded = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def _spec(tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0, use_te: bool = False) -> PolicyModelSpec:
    return PolicyModelSpec(
        SHAPE, ParallelLayout(tp=tp, pp=pp), padded_vocab_size(SHAPE.vocab_size, tp), use_te, pp_rank, tp_rank
    )


def _random_hf(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    names = {n for _, hf, _ in hf_import.weight_plan(_spec(1, 0)) for n in hf}
    return {n: torch.randn(hf_tensor_shape(n, SHAPE), generator=g) for n in sorted(names)}


def test_tp2_shards_follow_megatron_layout():
    """linear_qkv rows per KV group [q heads, k, v]; fc1 = [gate slice; up slice]; vocab padded then split."""
    hf = _random_hf()
    d, g, h = SHAPE.head_dim, SHAPE.gqa_group_size, SHAPE.hidden_size
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    for rank in range(2):
        shard = megatron_shard_from_hf(hf, _spec(2, rank))
        qkv = shard["decoder.layers.1.self_attention.linear_qkv.weight"]
        assert qkv.shape == ((g + 2) * d, h)  # one KV group per rank (Hkv=2, tp=2)
        assert torch.equal(qkv[: g * d], q[rank * g * d : (rank + 1) * g * d])
        assert torch.equal(qkv[g * d : (g + 1) * d], k[rank * d : (rank + 1) * d])
        assert torch.equal(qkv[(g + 1) * d :], v[rank * d : (rank + 1) * d])
        fc1 = shard["decoder.layers.1.mlp.linear_fc1.weight"]
        half = SHAPE.intermediate_size // 2
        assert torch.equal(
            fc1[:half], hf["model.layers.1.mlp.gate_proj.weight"][rank * half : (rank + 1) * half]
        )
        assert torch.equal(
            fc1[half:], hf["model.layers.1.mlp.up_proj.weight"][rank * half : (rank + 1) * half]
        )
        emb = shard["embedding.word_embeddings.weight"]
        rows = padded_vocab_size(SHAPE.vocab_size, 2) // 2
        full = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(2 * rows - SHAPE.vocab_size, h)])
        assert torch.equal(emb, full[rank * rows : (rank + 1) * rows])


def test_pipeline_stages_hold_their_layer_ranges():
    hf = _random_hf()
    first = megatron_shard_from_hf(hf, _spec(1, 0, pp=2, pp_rank=0))
    last = megatron_shard_from_hf(hf, _spec(1, 0, pp=2, pp_rank=1))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert torch.equal(
        last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"]
    )
    assert torch.equal(
        first["decoder.layers.0.input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"]
    )


def test_transformer_engine_names_agree_with_megatron_key_map():
    """The TE spec fuses the two norms into the next linear; megatron's local spec declares that same map."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    key_map = get_gpt_layer_local_spec(
        qk_layernorm=True, normalization="RMSNorm"
    ).submodules.sharded_state_dict_keys_map
    for local_name, te_name in hf_import._TE_NAMES.items():
        prefix = local_name.removesuffix("weight")
        assert key_map[prefix] + "weight" == te_name
    te_keys = {k for k, _, _ in hf_import.weight_plan(_spec(1, 0, use_te=True))}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_keys
    assert not any(k.endswith("input_layernorm.weight") for k in te_keys)


def test_bad_checkpoints_are_refused_with_the_name(tmp_path):
    hf = _random_hf()
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        megatron_shard_from_hf(hf, _spec(1, 0))
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        megatron_shard_from_hf(hf, _spec(1, 0))
    base = hf_config_dict(SHAPE)
    assert shape_from_hf_config(base) == SHAPE
    with pytest.raises(CheckpointFormatError, match="hidden_act"):
        shape_from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(CheckpointFormatError, match="rope"):
        shape_from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointFormatError, match="num_hidden_layers"):
        shape_from_hf_config({k: v for k, v in base.items() if k != "num_hidden_layers"})
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        SafetensorsDir(tmp_path)
