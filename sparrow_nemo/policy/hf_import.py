"""Hugging Face Qwen3 checkpoints <-> the megatron-core policy, for any TP/PP layout.

Import reads ``config.json`` and ``model.safetensors`` (or a sharded set listed in
``model.safetensors.index.json``) and loads into each rank only its own shard: the layers of its
pipeline stage, the tensor-parallel slice of every split weight, with

- QKV fusion: megatron's ``linear_qkv`` rows are grouped per KV head ``[q heads of the group, k, v]``
  and the KV groups are split over tensor-parallel ranks;
- gate/up fusion: each rank's ``linear_fc1`` rows are ``[gate slice; up slice]``;
- vocab padding: embedding / output rows padded with zeros to ``padded_vocab`` and split over TP.

Export inverts this and returns **full, HF-named tensors on every rank** (all-gather over the TP
group, then over the PP group), which is what a rollout engine's weight refit takes.
Import followed by export is bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparrow_nemo.hf_qwen3 import (
    CheckpointFormatError,
    SafetensorsDir,
    expected_weight_shapes,
    shape_from_hf_config,
)
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model
from sparrow_nemo.policy.parallel import stage_layer_range
from sparrow_nemo.policy.tp_layout import (
    COLUMNS,
    FC1,
    QKV,
    REPLICATED,
    VOCAB,
    all_gather_shards,
    fuse_fc1,
    fuse_qkv,
    gather_stage_tensors,
    merge_shards,
    split_shard,
)

#: per-layer weights: (megatron suffix, HF suffixes, layout). The two norms have TE-spec names too.
_LAYER_RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), COLUMNS),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), COLUMNS),
)
#: Transformer Engine spec fuses these norms into the next linear layer.
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


# ----------------------------------------------------------------------------- name plan


def weight_plan(spec: PolicyModelSpec) -> list[tuple[str, tuple[str, ...], str]]:
    """This rank's weights: ``(megatron state-dict key, HF names, layout)`` in a fixed order."""
    shape = spec.shape
    plan: list[tuple[str, tuple[str, ...], str]] = []
    if spec.pre_process:
        plan.append(("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB))
    for local, layer in enumerate(stage_layer_range(shape.num_layers, spec.layout.pp, spec.pp_rank)):
        for mcore, hf_names, layout in _LAYER_RULES:
            mcore = _TE_NAMES.get(mcore, mcore) if spec.use_te else mcore
            plan.append(
                (
                    f"decoder.layers.{local}.{mcore}",
                    tuple(f"model.layers.{layer}.{n}" for n in hf_names),
                    layout,
                )
            )
    if spec.post_process:
        plan.append(("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
        if not shape.tie_word_embeddings:
            plan.append(("output_layer.weight", ("lm_head.weight",), VOCAB))
        elif not spec.pre_process:
            # Tied weights on a separate last stage: megatron keeps a copy of the embedding there.
            plan.append(("output_layer.weight", ("model.embed_tokens.weight",), VOCAB))
    return plan


def megatron_shard_from_hf(
    hf: dict[str, torch.Tensor] | SafetensorsDir, spec: PolicyModelSpec
) -> dict[str, torch.Tensor]:
    """This rank's megatron-named tensors built from HF tensors (a dict or a checkpoint reader)."""
    get = hf.get if isinstance(hf, SafetensorsDir) else hf.__getitem__
    where = f"{hf.path}: " if isinstance(hf, SafetensorsDir) else ""
    shape, tp, rank = spec.shape, spec.layout.tp, spec.tp_rank
    expected = expected_weight_shapes(shape)
    out: dict[str, torch.Tensor] = {}
    for key, hf_names, layout in weight_plan(spec):
        tensors = []
        for name in hf_names:
            t = get(name)
            if tuple(t.shape) != expected[name]:
                raise CheckpointFormatError(
                    f"{where}tensor '{name}' has shape {tuple(t.shape)}, expected {expected[name]}"
                    " from the model config"
                )
            tensors.append(t)
        if layout == QKV:
            out[key] = fuse_qkv(*tensors, shape=shape, tp=tp, rank=rank)
        elif layout == FC1:
            out[key] = fuse_fc1(*tensors, tp=tp, rank=rank)
        else:
            out[key] = split_shard(tensors[0], layout, tp, rank, spec.padded_vocab)
    return out


@torch.no_grad()
def load_hf_into_model(model: torch.nn.Module, spec: PolicyModelSpec, hf_dir: str | Path) -> None:
    """Copy an HF Qwen3 checkpoint into this rank's megatron shard (shapes and config checked)."""
    model = unwrap_model(model)
    reader = SafetensorsDir(hf_dir)
    ckpt_shape = shape_from_hf_config(reader.config())
    if ckpt_shape != spec.shape:
        diff = {
            f: (getattr(ckpt_shape, f), getattr(spec.shape, f))
            for f in ckpt_shape.__dataclass_fields__
            if getattr(ckpt_shape, f) != getattr(spec.shape, f)
        }
        raise CheckpointFormatError(
            f"{hf_dir}/config.json differs from the model shape: {diff} (ckpt, model)"
        )
    params = dict(model.named_parameters())
    for key, tensor in megatron_shard_from_hf(reader, spec).items():
        if key not in params:
            raise KeyError(f"megatron model has no parameter '{key}' (spec use_te={spec.use_te})")
        if params[key].shape != tensor.shape:
            raise CheckpointFormatError(
                f"'{key}': model shard {tuple(params[key].shape)} vs {tuple(tensor.shape)}"
            )
        params[key].copy_(tensor)


# ----------------------------------------------------------------------------- export


@torch.no_grad()
def export_hf_state_dict(model: torch.nn.Module, spec: PolicyModelSpec) -> dict[str, torch.Tensor]:
    """Full HF-named tensors (CPU, the model's dtype) of the whole model, returned on every rank.

    Collective: every rank of the model-parallel group must call it.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    params = dict(unwrap_model(model).named_parameters())
    local: dict[str, torch.Tensor] = {}
    for key, hf_names, layout in weight_plan(spec):
        shards = (
            all_gather_shards(params[key].detach(), tp_group)
            if layout != REPLICATED
            else [params[key].detach()]
        )
        for name, tensor in zip(hf_names, merge_shards(shards, layout, spec.shape), strict=True):
            local[name] = tensor.cpu()
    if spec.layout.pp == 1:
        return local
    return gather_stage_tensors(local, parallel_state.get_pipeline_model_parallel_group())
