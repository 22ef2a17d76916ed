"""The fused CPU layer kernels (rollout/torch/cpu_layer.c) against the decoder's torch ops: RMSNorm, q/k norm +
rotary, residual add + norm, SwiGLU, with and without a LoRA adapter, and the autograd fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.torch import cpu_layer
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder, rms_norm


def _decoder(lora: bool) -> Qwen3Decoder:
    model = Qwen3Decoder.random(PRESETS["tiny-test"], seed=4)
    if lora:
        gen = torch.Generator().manual_seed(9)
        s = model.shape
        q_out, kv_out = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        sizes = {"self_attn.q_proj": q_out, "self_attn.v_proj": kv_out, "mlp.up_proj": s.intermediate_size}
        model.lora = LoraAdapter(
            weights={
                f"model.layers.1.{m}": (
                    0.1 * torch.randn(4, s.hidden_size, generator=gen),
                    0.1 * torch.randn(out, 4, generator=gen),
                )
                for m, out in sizes.items()
            },
            scaling=2.0,
        )
    return model


@pytest.mark.parametrize("lora", [False, True])
def test_layer_pieces_equal_the_torch_ops(lora: bool) -> None:
    model = _decoder(lora)
    s = model.shape
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(3, 5, s.hidden_size, generator=gen)
    positions = torch.arange(5)[None].expand(3, 5) + torch.tensor([[0], [7], [300]])
    attn = torch.randn(3, 5, s.num_attention_heads, s.head_dim, generator=gen)
    rope = model.rope(positions, h.dtype)

    def pieces() -> list[torch.Tensor]:
        q, k, v = model.attention_inputs(1, h, positions, rope)
        return [q, k, v, model.attention_output(1, h, attn), model.logits(h)]

    reference = pieces()  # autograd on: the torch ops (the kernels record no graph)
    assert not cpu_layer.supports(h)
    with torch.no_grad():
        assert cpu_layer.supports(h)
        fused = pieces()
    for name, a, b in zip(("q", "k", "v", "layer out", "logits"), fused, reference):
        assert a.shape == b.shape, name
        assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max()), name


def test_kernels_on_their_own() -> None:
    gen = torch.Generator().manual_seed(2)
    x, d = (
        torch.randn(7, 40, generator=gen),
        torch.randn(7, 40, generator=gen),
    )  # 40: a vector part and a tail
    w = torch.randn(40, generator=gen)
    with torch.no_grad():
        assert torch.allclose(cpu_layer.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), atol=1e-6)
        h_out, normed = cpu_layer.add_rms_norm(x, d, w, 1e-6)
        assert torch.equal(h_out, x + d) and torch.allclose(normed, rms_norm(x + d, w, 1e-6), atol=1e-6)
        gate = torch.cat([torch.linspace(-120, 120, 37)[None], torch.randn(6, 37, generator=gen)])
        up = torch.randn(7, 37, generator=gen)
        got = cpu_layer.silu_mul(torch.cat([gate, up], -1))  # 37: one 16-lane pair and a scalar tail
        assert torch.isfinite(got).all()
        assert torch.allclose(got, F.silu(gate) * up, atol=1e-6, rtol=1e-5)
