"""Causal core attention for megatron's local layer spec through torch SDPA: no ``[S, S]`` tensor.

megatron-core's local ``DotProductAttention`` materialises ``[B, Hq, S, S]`` scores and needs an explicit
mask; at 40K tokens that is tens of GiB per layer. This module takes its place in the local spec (CPU,
and GPU without Transformer Engine): ``torch.nn.functional.scaled_dot_product_attention`` with
``is_causal=True`` and grouped-query heads, which on CPU and GPU runs a flash / memory-efficient kernel
(memory O(S) per head, backward included). With Transformer Engine the TE spec's own flash attention is
used instead.
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
