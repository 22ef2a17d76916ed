"""The Hugging Face Qwen3 checkpoint format: tensor names and shapes, config.json, safetensors, LoRA by HF name.

One module below both the policy (:mod:`sparrow_nemo.policy.hf_import`: megatron <-> HF) and the rollout
engines (:mod:`sparrow_nemo.rollout.torch.qwen3`, TensorRT-LLM), so that neither imports the other:

- names: a decoder layer's linears (:data:`ATTN_LINEARS`, :data:`MLP_LINEARS`; the LoRA targets),
  every parameter's name and shape (:func:`expected_weight_shapes`, :func:`linear_in_out`);
- ``config.json`` <-> :class:`~sparrow_nemo.model_shapes.Qwen3Shape` (:func:`shape_from_hf_config`,
  :func:`hf_config_dict`); the recipe's dtype names (:func:`resolve_dtype`);
- files: :class:`SafetensorsDir` (single or sharded safetensors) and :func:`save_hf_checkpoint`;
- :class:`LoraAdapter`: LoRA ``(A, B)`` pairs by HF module name, what the policy exports and the engines load.

A bad checkpoint raises :class:`CheckpointFormatError` naming the file and the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sparrow_nemo.model_shapes import Qwen3Shape

#: the attention and MLP linears of a decoder layer, by HF name (``model.layers.{i}.self_attn.q_proj``)
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: every decoder-layer linear: the LoRA targets (DistillSparse adapts all of them by default, as the paper)
LINEARS = ATTN_LINEARS + MLP_LINEARS


class CheckpointFormatError(ValueError):
    """A Hugging Face checkpoint that does not match what the policy expects."""


# ----------------------------------------------------------------------------- names and shapes
def linear_in_out(shape: Qwen3Shape) -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) of every decoder-layer linear (LoRA targets)."""
    weights = expected_weight_shapes(shape)
    out = {}
    for i in range(shape.num_layers):
        for module in [f"self_attn.{n}" for n in ATTN_LINEARS] + [f"mlp.{n}" for n in MLP_LINEARS]:
            name = f"model.layers.{i}.{module}"
            fan_out, fan_in = weights[name + ".weight"]
            out[name] = (fan_in, fan_out)
    return out


def expected_weight_shapes(shape: Qwen3Shape) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> tensor shape for ``shape`` (``lm_head.weight`` only when untied)."""
    h, d, hq, hkv = shape.hidden_size, shape.head_dim, shape.num_attention_heads, shape.num_key_value_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (hq * d, h)
        out[p + "self_attn.k_proj.weight"] = (hkv * d, h)
        out[p + "self_attn.v_proj.weight"] = (hkv * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, hq * d)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (shape.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (shape.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, shape.intermediate_size)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def hf_tensor_shape(name: str, shape: Qwen3Shape) -> tuple[int, ...]:
    """The shape the HF tensor ``name`` must have for ``shape`` (KeyError for a name Qwen3 does not have)."""
    return expected_weight_shapes(shape)[name]


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` ... -> ``torch.dtype``; a clear error otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


# ----------------------------------------------------------------------------- config.json
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


# ----------------------------------------------------------------------------- files
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


# ----------------------------------------------------------------------------- LoRA by HF name
@dataclass(frozen=True)
class LoraAdapter:
    """LoRA weights by HF module name, plus the output scaling (alpha / rank)."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float

    @classmethod
    def from_alpha(
        cls, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], alpha: float
    ) -> LoraAdapter:
        """Adapter with ``scaling = alpha / r`` (r read from the first A matrix; all ranks must agree)."""
        ranks = {a.shape[0] for a, _ in weights.values()}
        if len(ranks) != 1:
            raise ValueError(
                f"LoRA adapter: all A matrices must share one rank to use alpha, got ranks {ranks}"
            )
        return cls(weights=dict(weights), scaling=alpha / ranks.pop())

    def validate(self, in_out: Mapping[str, tuple[int, int]]) -> None:
        """Check names and shapes against ``in_out``: module name -> (in_features, out_features)."""
        for name, pair in self.weights.items():
            if name not in in_out:
                allowed = ", ".join(sorted({n.split(".")[-1] for n in in_out}))
                raise KeyError(
                    f"LoRA adapter: '{name}' is not a decoder linear (allowed per layer: {allowed})"
                )
            if len(pair) != 2:
                raise ValueError(f"LoRA adapter: '{name}' must map to (A, B), got {len(pair)} tensors")
            a, b = pair
            fan_in, fan_out = in_out[name]
            if (
                a.dim() != 2
                or b.dim() != 2
                or a.shape[1] != fan_in
                or b.shape[0] != fan_out
                or a.shape[0] != b.shape[1]
            ):
                raise ValueError(
                    f"LoRA adapter: '{name}' has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                    f"A [r, {fan_in}] and B [{fan_out}, r]"
                )

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> LoraAdapter:
        """A copy with every matrix moved/cast."""
        moved = {
            n: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for n, (a, b) in self.weights.items()
        }
        return LoraAdapter(weights=moved, scaling=self.scaling)
