"""Weights for the TensorRT-LLM engine: our HF-named export -> what its Qwen3 model loader takes.

TensorRT-LLM's PyTorch Qwen3 model loads Hugging Face parameter names and fuses q/k/v and gate/up itself,
so a refit sends HF names. What this module adds is the checking and shaping the engine needs:

- :func:`refit_tensors`: validate names and shapes against the Qwen3 shape (a typo or a wrong layout is
  an error naming the tensor, not a silently ignored key), drop ``lm_head.weight`` when the embeddings
  are tied (the loader ties them itself), cast to the engine dtype, make contiguous;
- :func:`merge_lora`: DistillSparse's adapter folded into the base linears, ``W + scaling * B @ A``
  (TensorRT-LLM then runs the merged weights; dense scoring goes back to the base weights);
- :func:`buckets`: the tensors split into groups of bounded bytes (whole layers), one IPC transfer each.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sparrow_nemo.hf_qwen3 import LoraAdapter, expected_weight_shapes, linear_in_out
from sparrow_nemo.model_shapes import Qwen3Shape


def refit_tensors(
    state: Mapping[str, torch.Tensor], shape: Qwen3Shape, dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors (a subset is fine) -> ``[(name, tensor)]`` for TensorRT-LLM's weight loader.

    Raises:
        KeyError: a name that is not a Qwen3 parameter of ``shape``.
        ValueError: a tensor whose shape differs from the expected one (both shapes named).
    """
    expected = expected_weight_shapes(shape)
    out = []
    for name, tensor in state.items():
        if name == "lm_head.weight" and shape.tie_word_embeddings:
            continue
        if name not in expected:
            raise KeyError(f"TensorRT-LLM refit: '{name}' is not a Qwen3 parameter of this shape")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"TensorRT-LLM refit: '{name}' has shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
        out.append((name, tensor.detach().to(dtype).contiguous()))
    return out


def merge_lora(
    state: Mapping[str, torch.Tensor], adapter: LoraAdapter, shape: Qwen3Shape
) -> dict[str, torch.Tensor]:
    """The adapter's linears with the adapter folded in: ``{module.weight: W + scaling * B @ A}``.

    Computed in float32 and returned in each base weight's dtype. ``state`` must hold the base weight of
    every module the adapter names (KeyError otherwise).
    """
    adapter.validate(linear_in_out(shape))
    merged = {}
    for module, (a, b) in adapter.weights.items():
        name = f"{module}.weight"
        if name not in state:
            raise KeyError(f"merge_lora: the base weights have no '{name}' for the adapter's '{module}'")
        base = state[name]
        delta = adapter.scaling * (b.float() @ a.float())
        merged[name] = (base.float() + delta.to(base.device)).to(base.dtype)
    return merged


def _unit(name: str) -> str:
    """Tensors that travel in the same bucket: one decoder layer (its q/k/v and gate/up are fused on
    load), or a single tensor outside the layers."""
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("model.layers.") else name


def buckets(named: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``max_bytes``; a decoder layer's tensors are never split across groups
    (a layer, or a tensor, larger than ``max_bytes`` is a group of its own)."""
    if max_bytes <= 0:
        raise ValueError(f"buckets: max_bytes must be > 0, got {max_bytes}")
    units: list[list[tuple[str, torch.Tensor]]] = []
    for item in named:
        if units and _unit(units[-1][0][0]) == _unit(item[0]):
            units[-1].append(item)
        else:
            units.append([item])
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for unit in units:
        nbytes = sum(t.numel() * t.element_size() for _, t in unit)
        if not groups or size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += nbytes
    return groups
