"""One decode step of the torch rollout engine: the new token of every row through all layers.

The engine's model runner calls it for every decode step, eagerly or inside a CUDA graph captured at the step's
bucket size (``cuda_graphs.DecodeGraphs``); speculative drafts call it too. Per layer:
q/k/v of the new token, its key/value appended to the paged cache (its page's landmarks updated), attention
over the cache (dense for the first ``dense_layers`` layers, else the Sparrow rule within the row's
budget), then the output projection and MLP; finally the LM head.

The attention backend is an object with ``append(cache, layer, block_table, positions, k, v)`` and
``attend(q, cache, layer, block_table, seq_len, budget_tokens, sink_pages, local_pages)``:
:class:`~sparrow_nemo.rollout.torch.paged_attention.TorchDecode` (CPU, and GPUs without the kernels) or
:class:`~sparrow_nemo.rollout.torch.paged_attention.KernelDecode` (the fused Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder


class DecodeAttention(Protocol):
    """What :class:`DecodeStep` needs from an attention backend (see the module docstring)."""

    def append(
        self,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        cache: PagedKVCache,
        layer: int,
        block_table: torch.Tensor,
        seq_len: torch.Tensor,
        budget_tokens: torch.Tensor | None,
        sink_pages: int,
        local_pages: int,
    ) -> torch.Tensor: ...


@dataclass
class DecodeStep:
    """``step(cache, block_table, tokens, seq_len, budgets) -> logits [B, V] fp32``.

    Attributes:
        model: the decoder (its LoRA adapter, when set, applies).
        attention: the decode-attention backend.
        dense_layers: leading layers that ignore the budgets (paper: 2).
        sink_pages, local_pages: pages the sparse rule always keeps (paper: 1, 2).
    """

    model: Qwen3Decoder
    attention: DecodeAttention
    dense_layers: int
    sink_pages: int
    local_pages: int

    def __call__(
        self,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        tokens: torch.Tensor,
        seq_len: torch.Tensor,
        budgets: torch.Tensor | None,
    ) -> torch.Tensor:
        """Feed ``tokens [B]`` int64 at index ``seq_len - 1`` (``seq_len [B]`` counts them; their pages
        are reserved in ``block_table [B, P]``). ``budgets [B]`` int64 tokens per row, or None = dense.

        Returns logits ``[B, V]`` fp32 of the next token.
        """
        positions = seq_len - 1
        h = self.model.embed(tokens)
        rope = self.model.rope(positions[:, None], h.dtype)
        for layer in range(self.model.shape.num_layers):
            q, k, v = self.model.attention_inputs(layer, h[:, None], positions[:, None], rope)
            q, k, v = q[:, 0], k[:, 0], v[:, 0]
            self.attention.append(cache, layer, block_table, positions, k, v)
            attn = self.attention.attend(
                q,
                cache,
                layer,
                block_table,
                seq_len,
                budgets if layer >= self.dense_layers else None,
                self.sink_pages,
                self.local_pages,
            )
            h = self.model.attention_output(layer, h, attn)
        return self.model.logits(h)
