"""Tensor parallelism of the torch rollout engine: the slice of each HF weight a rank holds, and the collectives
of the sharded forward.

One engine over ``k`` ranks, in megatron's layout, so that at ``k`` = the policy's tensor-parallel size a rank's
engine shard is exactly its megatron shard (:mod:`sparrow_nemo.policy.tp_layout`; the refit then sends no
all-gather):

- column-parallel, the output rows in ``k`` contiguous chunks: ``q_proj``, ``k_proj``, ``v_proj`` (rank r holds
  KV heads ``[r Hkv/k, (r+1) Hkv/k)`` and the q heads of their GQA groups, q head h belonging to KV head
  ``h // G``: again a contiguous chunk of q's rows), ``gate_proj`` and ``up_proj`` (``I/k`` rows each);
- row-parallel, the input columns in ``k`` chunks: ``o_proj`` and ``down_proj``; their partial outputs are
  summed by one all-reduce each per layer (after the attention output, after the MLP);
- vocabulary-parallel: ``embed_tokens`` and ``lm_head`` rows padded with zeros to ``padded_vocab`` rows (a
  multiple of ``k``: the policy's padded vocabulary in a trainer, ``ceil(V / k) k`` for a standalone engine) and
  split in ``k`` chunks. The embedding is a masked lookup summed by an all-reduce (one non-zero term per
  token: exact), the logits ``[..., padded_vocab / k]`` are all-gathered and cut to ``V``;
- replicated: the norms.

An all-reduce leaves the same sum on every rank, so every rank carries the same residual stream and the same
full logits, and samples the same tokens (the engine's draws are position-indexed hashes of the sample seeds:
no generator state to keep in step). Qwen3 has 8 KV heads: ``k`` in {1, 2, 4, 8}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparrow_nemo.hf_qwen3 import LoraAdapter, expected_weight_shapes
from sparrow_nemo.model_shapes import Qwen3Shape

#: how a weight is split over the ranks: output rows, input columns, padded vocabulary rows, not at all
ROWS, COLUMNS, VOCAB, REPLICATED = "rows", "columns", "vocab", "replicated"

_COLUMN_PARALLEL = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def module_layout(module: str) -> str:
    """How the linear ``module`` (an HF module name, ``model.layers.<i>.self_attn.q_proj``) is split: ROWS
    (column-parallel), COLUMNS (row-parallel) or REPLICATED."""
    if module.endswith(_COLUMN_PARALLEL):
        return ROWS
    if module.endswith(_ROW_PARALLEL):
        return COLUMNS
    return REPLICATED


def weight_layout(name: str) -> str:
    """How the HF weight ``name`` is split over the ranks (module docstring)."""
    if name in _VOCAB_PARALLEL:
        return VOCAB
    return module_layout(name.removesuffix(".weight"))


def local_weight_shape(name: str, full: tuple[int, ...], size: int, padded_vocab: int) -> tuple[int, ...]:
    """The shape of one rank's slice of HF weight ``name`` (full shape ``full``) over ``size`` ranks, the
    vocabulary padded to ``padded_vocab`` rows."""
    layout = weight_layout(name)
    if layout == ROWS:
        return (full[0] // size, *full[1:])
    if layout == COLUMNS:
        return (full[0], full[1] // size)
    if layout == VOCAB:
        return (padded_vocab // size, full[1])
    return tuple(full)


@dataclass(frozen=True)
class TensorParallel:
    """One engine's tensor-parallel group and this rank's place in it.

    Attributes:
        group: the process group of the engine's ranks (every forward's collectives run over it).
        rank, size: this rank's index in ``group`` and the group's size ``k``.
        padded_vocab: embedding / output rows after padding (a multiple of ``size``, >= the vocabulary).
    """

    group: Any
    rank: int
    size: int
    padded_vocab: int

    @classmethod
    def over(cls, group: Any, vocab_size: int, padded_vocab: int | None = None) -> TensorParallel:
        """The spec of this process in ``group`` (None: the default group); ``padded_vocab`` None =
        ``ceil(vocab_size / k) k`` (a standalone engine; a trainer passes the policy's)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        padded = -(-vocab_size // size) * size if padded_vocab is None else padded_vocab
        if padded % size or padded < vocab_size:
            raise ValueError(
                f"tensor-parallel engine: padded vocabulary {padded} must be a multiple of the {size} ranks "
                f">= the vocabulary {vocab_size}"
            )
        return cls(group=group, rank=rank, size=size, padded_vocab=padded)

    # ----------------------------------------------------------------- the shard
    @property
    def vocab_rows(self) -> int:
        """Embedding / output rows per rank (``padded_vocab / k``)."""
        return self.padded_vocab // self.size

    def check(self, shape: Qwen3Shape) -> None:
        """Refuse a model the ``k`` ranks cannot split (one line naming the size)."""
        if shape.num_key_value_heads % self.size or shape.intermediate_size % self.size:
            raise ValueError(
                f"tensor-parallel engine: {self.size} ranks must divide num_key_value_heads="
                f"{shape.num_key_value_heads} and intermediate_size={shape.intermediate_size}"
            )
        if self.padded_vocab < shape.vocab_size:
            raise ValueError(
                f"tensor-parallel engine: padded vocabulary {self.padded_vocab} < vocab_size={shape.vocab_size}"
            )

    def heads(self, shape: Qwen3Shape) -> tuple[int, int]:
        """(q heads, KV heads) of this rank."""
        return shape.num_attention_heads // self.size, shape.num_key_value_heads // self.size

    def local_shape(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's slice of HF weight ``name`` whose full shape is ``full``."""
        return local_weight_shape(name, full, self.size, self.padded_vocab)

    def local_shapes(self, shape: Qwen3Shape) -> dict[str, tuple[int, ...]]:
        """HF name -> this rank's shape of every weight of ``shape``."""
        return {n: self.local_shape(n, full) for n, full in expected_weight_shapes(shape).items()}

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full HF tensor ``name`` (a view, except a vocabulary slice that reaches
        into the padding: a copy with zero rows there)."""
        layout = weight_layout(name)
        if layout == ROWS:
            return full.chunk(self.size, dim=0)[self.rank]
        if layout == COLUMNS:
            return full.chunk(self.size, dim=1)[self.rank]
        if layout == VOCAB:
            start = self.rank * self.vocab_rows
            part = full[start : start + self.vocab_rows]
            if part.shape[0] == self.vocab_rows:
                return part
            out = full.new_zeros((self.vocab_rows, full.shape[1]))
            out[: part.shape[0]] = part
            return out
        return full

    def shard_lora(self, adapter: LoraAdapter) -> LoraAdapter:
        """This rank's part of a full adapter: B's rows of a column-parallel module, A's columns of a row-parallel
        one (its delta is then a partial sum that the module's all-reduce completes)."""
        weights = {}
        for module, (a, b) in adapter.weights.items():
            layout = module_layout(module)
            if layout == ROWS:
                b = b.chunk(self.size, dim=0)[self.rank]
            elif layout == COLUMNS:
                a = a.chunk(self.size, dim=1)[self.rank]
            weights[module] = (a, b)
        return LoraAdapter(weights=weights, scaling=adapter.scaling)

    # ----------------------------------------------------------------- the collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place; returned)."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` -> hidden ``[..., hidden]`` from this rank's ``weight [padded_vocab / k, hidden]``:
        rows it holds looked up, the others zero, summed over the ranks."""
        start = self.rank * self.vocab_rows
        local = ids - start
        outside = (local < 0) | (local >= self.vocab_rows)
        h = F.embedding(local.masked_fill(outside, 0), weight)
        h.masked_fill_(outside[..., None], 0)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logits ``[..., padded_vocab / k]`` side by side, cut to ``[..., vocab_size]``."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        logits = torch.cat(parts, dim=-1)
        return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size].contiguous()
