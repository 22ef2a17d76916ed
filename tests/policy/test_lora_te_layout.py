"""LoRA under the Transformer Engine layer spec (TE cannot be installed here: tested on TE's layout).

megatron-core 0.16.1's TE spec fuses the input / pre-MLP RMSNorm into ``linear_qkv`` / ``linear_fc1``
(TE ``LayerNormLinear``: ``layer_norm_weight``, ``normalization``, ``eps``, ``zero_centered_gamma``), so the
adapter's forward hook sees the un-normalised input. Checked:

- :func:`~sparrow_nemo.policy.fused_norm.linear_input` against megatron's own (local-spec) RMSNorm, a
  zero-centred gamma and torch's LayerNorm, on tensors named and laid out as TE names and lays them out;
- a megatron model re-laid out as the TE spec builds it (norm modules replaced by ``IdentityOp``, the norm
  inside a ``LayerNormLinear``-shaped module that runs megatron's norm then the linear) gives, with the
  adapter enabled (``spec.use_te=True``: refused before), the local spec's adapted logits (``atol=1e-5``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy.test_sparse_forward import SHAPE, random_lora
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.fused_norm import apply_fused_norm, fused_norm, linear_input
from sparrow_nemo.policy.lora import MegatronLora
from sparrow_nemo.policy.model import build_model
from sparrow_nemo.policy.parallel import ParallelLayout


class TeLayerNormLinear(torch.nn.Module):
    """A linear with its norm fused in, with TE ``LayerNormLinear``'s parameter and attribute names
    (``transformer_engine/pytorch/module/layernorm_linear.py``); the forward runs megatron's own norm module
    and the linear, and returns megatron's ``(out, bias)`` pair like ``TELayerNormColumnParallelLinear``."""

    def __init__(self, norm: torch.nn.Module, linear: torch.nn.Module, eps: float) -> None:
        super().__init__()
        self.norm, self.linear = norm, linear
        self.layer_norm_weight = norm.weight  # the same parameter, under TE's name
        self.layer_norm_bias = None
        self.normalization, self.eps, self.zero_centered_gamma = "RMSNorm", eps, False

    def forward(self, x):
        return self.linear(self.norm(x))


def _te_like(weight: torch.Tensor, **attrs) -> torch.nn.Module:
    module = torch.nn.Module()
    module.layer_norm_weight = torch.nn.Parameter(weight)
    module.layer_norm_bias = attrs.pop("bias", None)
    for key, value in {
        "normalization": "RMSNorm",
        "eps": 1e-6,
        "zero_centered_gamma": False,
        **attrs,
    }.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def model(single_rank):
    layout = ParallelLayout.for_world(1)
    single_rank(layout, SHAPE)
    return build_model(SHAPE, layout)


def test_fused_rmsnorm_matches_megatrons_own(model):
    gpt, _ = model
    layer = gpt.decoder.layers[0]
    norm = layer.input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(7, 2, SHAPE.hidden_size) * 3
    eps = gpt.config.layernorm_epsilon
    te = _te_like(norm.weight.detach().clone(), eps=eps)
    torch.testing.assert_close(linear_input(te, x), norm(x), atol=1e-6, rtol=1e-5)
    centred = _te_like(norm.weight.detach() - 1.0, eps=eps, zero_centered_gamma=True)
    torch.testing.assert_close(linear_input(centred, x), norm(x), atol=1e-6, rtol=1e-5)
    # a plain linear (local spec, TE's row-parallel layers) has no fused norm: its input is used as is
    assert fused_norm(layer.self_attention.linear_qkv) is None
    assert linear_input(layer.self_attention.linear_qkv, x) is x


def test_fused_layernorm_and_bf16():
    x = torch.randn(5, 16) * 2 + 1
    w, b = torch.rand(16) + 0.5, torch.randn(16)
    te = _te_like(w.clone(), normalization="LayerNorm", bias=torch.nn.Parameter(b.clone()), eps=1e-5)
    expected = torch.nn.functional.layer_norm(x, (16,), w, b, eps=1e-5)
    torch.testing.assert_close(linear_input(te, x), expected, atol=1e-5, rtol=1e-5)
    out = apply_fused_norm(x.bfloat16(), fused_norm(te))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="normalization='ScaleNorm'"):
        fused_norm(_te_like(w, normalization="ScaleNorm"))


def _adapted_logits(gpt, lora: MegatronLora, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, pos, mask = batch.model_inputs()
    with torch.no_grad():
        base = gpt(tokens, pos, mask)
        with lora.active():
            adapted = gpt(tokens, pos, mask)
    return base, adapted


def test_lora_on_the_te_layout_equals_the_local_spec(model):
    from megatron.core.transformer.identity_op import IdentityOp

    gpt, spec = model
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)  # non-trivial norms, so a missing normalisation shows
    config, adapter = random_lora(seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 10), generator=g)
    batch = PolicyBatch(tokens, torch.tensor([10, 7]))
    local = MegatronLora(gpt, spec, config, adapter)
    base_local, adapted_local = _adapted_logits(gpt, local, batch)
    local.remove()
    eps = gpt.config.layernorm_epsilon
    for layer in gpt.decoder.layers:  # as get_gpt_layer_with_transformer_engine_spec builds the layer
        attention, mlp = layer.self_attention, layer.mlp
        attention.linear_qkv = TeLayerNormLinear(layer.input_layernorm, attention.linear_qkv, eps)
        mlp.linear_fc1 = TeLayerNormLinear(layer.pre_mlp_layernorm, mlp.linear_fc1, eps)
        layer.input_layernorm, layer.pre_mlp_layernorm = IdentityOp(), IdentityOp()
    te = MegatronLora(gpt, dataclasses.replace(spec, use_te=True), config, adapter)
    base_te, adapted_te = _adapted_logits(gpt, te, batch)
    torch.testing.assert_close(base_te, base_local, atol=1e-6, rtol=0)  # the re-layout changed nothing
    assert (adapted_local - base_local).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(adapted_te, adapted_local, atol=1e-5, rtol=0)
