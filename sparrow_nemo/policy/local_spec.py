"""megatron's local GPT layer spec (no Transformer Engine), adapted for long sequences and SP.

Two parts of megatron-core's local spec are replaced:

- core attention: the local ``DotProductAttention`` materialises ``[B, Hq, S, S]`` scores and needs an
  explicit mask (at 40K tokens tens of GiB per layer). :class:`CausalSDPAttention` calls
  ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True`` and grouped-query heads,
  which on CPU and GPU runs a flash / memory-efficient kernel (O(S) memory per head, backward included).
- norms: megatron's ``WrappedTorchNorm`` refuses sequence parallelism because it does not mark its weight
  for the tensor-parallel gradient all-reduce. :class:`LocalRMSNorm` is the same ``torch.nn.RMSNorm``
  with that mark (``weight.sequence_parallel``), which megatron's ``finalize_model_grads`` reads (GPU;
  on CPU megatron's sequence-parallel collectives allocate on CUDA, so the builder refuses SP there).

With Transformer Engine (GPU) megatron's TE spec is used instead: its own flash attention and norms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class CausalSDPAttention(torch.nn.Module):
    """Drop-in for megatron's core attention (``submodules.core_attention`` of the local spec).

    Constructor arguments are megatron's core-attention builder's (``config``, ``layer_number``,
    ``attn_mask_type``, ``attention_type``, ``softmax_scale``, ...); only ``softmax_scale`` is read.
    Takes ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (this rank's heads) and returns
    ``[sq, b, np * hn]`` in the query dtype. Refuses an explicit mask, packed sequences and attention bias.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, **kwargs) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.softmax_scale = kwargs.get("softmax_scale")

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "CausalSDPAttention is causal attention over right-padded rows: it takes no attention_mask, "
                "attention_bias or packed_seq_params"
            )
        sq, b, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from megatron's norm arguments, weight marked for sequence parallelism.

    Under sequence parallelism each TP rank normalises its slice of the sequence, so the weight's
    gradient is a partial sum that the gradient finalisation adds up over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def local_block_spec(config, pp_rank: int):
    """The decoder block of this pipeline stage: megatron's local layer spec (RMSNorm, qk-norm) with
    :class:`CausalSDPAttention` and :class:`LocalRMSNorm`, and a :class:`LocalRMSNorm` final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    layer.submodules.input_layernorm = LocalRMSNorm
    layer.submodules.pre_mlp_layernorm = LocalRMSNorm
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = CausalSDPAttention
    attention.q_layernorm = LocalRMSNorm
    attention.k_layernorm = LocalRMSNorm
    layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=LocalRMSNorm)
