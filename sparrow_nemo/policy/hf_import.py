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

import json
from pathlib import Path

import torch
import torch.distributed as dist

from sparrow_nemo.model_shapes import Qwen3Shape
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


class CheckpointFormatError(ValueError):
    """A Hugging Face checkpoint that does not match what the policy expects."""


# ----------------------------------------------------------------------------- config


def shape_from_hf_config(config: dict) -> Qwen3Shape:
    """A :class:`Qwen3Shape` from a Qwen3 ``config.json`` dict; refuses features the policy does not model."""
    required = (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    missing = [k for k in required if k not in config]
    if missing:
        raise CheckpointFormatError(f"config.json lacks {missing}")
    if config.get("model_type", "qwen3") != "qwen3":
        raise CheckpointFormatError(f"config.json model_type={config.get('model_type')!r}, expected 'qwen3'")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(f"config.json hidden_act={config['hidden_act']!r}, expected 'silu'")
    if config.get("attention_bias", False):
        raise CheckpointFormatError("config.json attention_bias=true is not supported (Qwen3 has none)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointFormatError(f"config.json rope scaling {rope} is not supported (plain RoPE only)")
    theta = config.get("rope_theta", rope.get("rope_theta", 10_000.0))
    eos = config.get("eos_token_id", 151_645)
    return Qwen3Shape(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=config.get("max_position_embeddings", 40_960),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def hf_config_dict(shape: Qwen3Shape, dtype: torch.dtype = torch.float32) -> dict:
    """A Qwen3 ``config.json`` dict for ``shape`` (loads with ``transformers.AutoConfig``)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "eos_token_id": shape.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
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


# ----------------------------------------------------------------------------- reading HF files


class SafetensorsDir:
    """Lazy reader of one HF checkpoint directory (single or sharded safetensors)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointFormatError(f"{index}: no 'weight_map' object")
            self.weight_map: dict[str, str] = weight_map
        elif single.is_file():
            with _open_safetensors(single) as f:
                self.weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(
                f"{self.path}: neither model.safetensors nor model.safetensors.index.json"
            )

    def config(self) -> dict:
        """The parsed config.json."""
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{cfg} not found")
        return _read_json(cfg)

    def get(self, name: str) -> torch.Tensor:
        """One tensor by HF name; a KeyError names the tensor and the directory."""
        from safetensors import SafetensorError

        if name not in self.weight_map:
            raise KeyError(f"tensor '{name}' not found in the checkpoint {self.path}")
        file = self.path / self.weight_map[name]
        with _open_safetensors(file) as f:
            try:
                return f.get_tensor(name)
            except SafetensorError as exc:
                raise CheckpointFormatError(f"{file}: cannot read tensor '{name}' ({exc})") from None


def _read_json(path: Path) -> dict:
    """A JSON object file; CheckpointFormatError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _open_safetensors(path: Path):
    """``safe_open(path)``; CheckpointFormatError naming the file when it is truncated or not safetensors."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (named by the checkpoint index)")
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise CheckpointFormatError(f"{path}: not a readable safetensors file ({exc})") from None


def _hf_shape(name: str, shape: Qwen3Shape) -> tuple[int, ...]:
    """The shape an HF Qwen3 tensor must have."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    suffix_shapes = {
        "embed_tokens.weight": (shape.vocab_size, h),
        "lm_head.weight": (shape.vocab_size, h),
        "q_proj.weight": (shape.num_attention_heads * d, h),
        "k_proj.weight": (shape.num_key_value_heads * d, h),
        "v_proj.weight": (shape.num_key_value_heads * d, h),
        "o_proj.weight": (h, shape.num_attention_heads * d),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate_proj.weight": (i, h),
        "up_proj.weight": (i, h),
        "down_proj.weight": (h, i),
    }
    for suffix, expected in suffix_shapes.items():
        if name.endswith(suffix):
            return expected
    return (h,)  # the RMSNorm weights


def megatron_shard_from_hf(
    hf: dict[str, torch.Tensor] | SafetensorsDir, spec: PolicyModelSpec
) -> dict[str, torch.Tensor]:
    """This rank's megatron-named tensors built from HF tensors (a dict or a checkpoint reader)."""
    get = hf.get if isinstance(hf, SafetensorsDir) else hf.__getitem__
    where = f"{hf.path}: " if isinstance(hf, SafetensorsDir) else ""
    shape, tp, rank = spec.shape, spec.layout.tp, spec.tp_rank
    out: dict[str, torch.Tensor] = {}
    for key, hf_names, layout in weight_plan(spec):
        tensors = []
        for name in hf_names:
            t = get(name)
            if tuple(t.shape) != _hf_shape(name, shape):
                raise CheckpointFormatError(
                    f"{where}tensor '{name}' has shape {tuple(t.shape)}, expected {_hf_shape(name, shape)}"
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
    gathered: list[dict[str, torch.Tensor] | None] = [None] * spec.layout.pp
    dist.all_gather_object(gathered, local, group=parallel_state.get_pipeline_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            merged.setdefault(name, tensor)
    return merged


def save_hf_checkpoint(state_dict: dict[str, torch.Tensor], shape: Qwen3Shape, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (loads with ``Qwen3ForCausalLM.from_pretrained``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state_dict.values())).dtype
    (out / "config.json").write_text(json.dumps(hf_config_dict(shape, dtype), indent=2))
    save_file(
        {k: v.contiguous() for k, v in state_dict.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out
