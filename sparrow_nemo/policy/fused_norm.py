"""The normalisation Transformer Engine fuses into a linear layer, as a pure function of TE's parameters.

Under megatron-core 0.16.1's Transformer Engine layer spec
(``megatron/core/models/gpt/gpt_layer_specs.py``, ``get_gpt_layer_with_transformer_engine_spec``):

- ``self_attention.linear_qkv`` and ``mlp.linear_fc1`` are ``TELayerNormColumnParallelLinear``
  (``megatron/core/extensions/transformer_engine.py``), TE's ``LayerNormLinear`` with the layer's
  input / pre-MLP RMSNorm fused in; ``input_layernorm`` and ``pre_mlp_layernorm`` are ``IdentityOp``;
- ``linear_proj`` and ``linear_fc2`` are ``TERowParallelLinear``: no norm.

TE's ``LayerNormLinear`` (``transformer_engine/pytorch/module/layernorm_linear.py``) keeps the norm as the
parameter ``layer_norm_weight`` [in_features], plus ``layer_norm_bias`` for ``LayerNorm`` only (None for
``RMSNorm``), and the attributes ``normalization`` (``"RMSNorm"`` / ``"LayerNorm"``), ``eps`` and
``zero_centered_gamma``; megatron sets them from ``config.normalization``, ``config.layernorm_epsilon`` and
``config.layernorm_zero_centered_gamma``. The formulas (``transformer_engine/common/include/
transformer_engine/rmsnorm.h``, ``layer_norm.h``): ``y = x / sqrt(mean(x^2) + eps) * g`` and
``y = (x - mean(x)) / sqrt(var(x) + eps) * g + b``, with ``g = 1 + gamma`` when ``zero_centered_gamma``.

A forward hook on such a module (the LoRA adapter's, :mod:`sparrow_nemo.policy.lora`) receives the
un-normalised input; :func:`linear_input` gives what the module's GEMM multiplies. Never run against TE
itself here (it needs CUDA to build): tested on tensors laid out as TE lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedNorm:
    """The norm inside a TE ``LayerNormLinear``, by TE's names.

    Attributes:
        weight: ``layer_norm_weight`` [in_features].
        bias: ``layer_norm_bias`` [in_features] (LayerNorm) or None (RMSNorm).
        normalization: ``"RMSNorm"`` or ``"LayerNorm"``.
        eps: added to the mean square (RMSNorm) or variance (LayerNorm).
        zero_centered_gamma: the scale is ``1 + weight``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    normalization: str
    eps: float
    zero_centered_gamma: bool


def fused_norm(module: torch.nn.Module) -> FusedNorm | None:
    """The norm fused into ``module`` (a TE ``LayerNormLinear``), or None for a plain linear layer."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return None
    normalization = module.normalization
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"{type(module).__name__}.normalization={normalization!r}: RMSNorm or LayerNorm")
    return FusedNorm(
        weight=weight,
        bias=getattr(module, "layer_norm_bias", None),
        normalization=normalization,
        eps=float(module.eps),
        zero_centered_gamma=bool(module.zero_centered_gamma),
    )


def apply_fused_norm(x: torch.Tensor, norm: FusedNorm) -> torch.Tensor:
    """TE's normalisation of ``x`` [..., in_features] (computed in fp32, returned in ``x``'s dtype)."""
    xf = x.float()
    scale = norm.weight.float() + 1.0 if norm.zero_centered_gamma else norm.weight.float()
    if norm.normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + norm.eps) * scale
    else:
        centred = xf - xf.mean(dim=-1, keepdim=True)
        y = centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + norm.eps) * scale
        if norm.bias is not None:
            y = y + norm.bias.float()
    return y.to(x.dtype)


def linear_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``module``'s GEMM multiplies for the input ``x`` it was called with: ``x`` normalised when a TE
    ``LayerNormLinear`` fuses a norm into it, ``x`` itself otherwise."""
    norm = fused_norm(module)
    return x if norm is None else apply_fused_norm(x, norm)
