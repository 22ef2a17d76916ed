"""How HF Qwen3 linear weights map onto megatron's tensor-parallel shards (shared by import/export and LoRA).

A weight's layout over the ``tp`` tensor-parallel ranks is one of:

- ``REPLICATED``: every rank holds the whole tensor (norm weights);
- ``COLUMNS``: split on dim 1, the input features (row-parallel ``linear_proj`` / ``linear_fc2``);
- ``VOCAB``: rows padded with zeros to the padded vocabulary, then split on dim 0 (embedding, output);
- ``QKV``: megatron's fused ``linear_qkv``: rows grouped per KV head ``[q heads of the group, k, v]``,
  the KV groups split over ranks;
- ``FC1``: megatron's fused ``linear_fc1``: each rank's rows are ``[gate slice; up slice]``.

The functions here are pure tensor reshuffles (any dtype/device) plus two collective helpers (the TP
all-gather of a shard, the pipeline stages' named tensors on every stage); they know nothing of checkpoints
or modules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparrow_nemo.model_shapes import Qwen3Shape

REPLICATED, COLUMNS, QKV, FC1, VOCAB = "replicated", "columns", "qkv", "fc1", "vocab"


def split_shard(full: torch.Tensor, layout: str, tp: int, rank: int, padded_vocab: int) -> torch.Tensor:
    """This TP rank's megatron slice of one unfused HF tensor (``REPLICATED``, ``COLUMNS`` or ``VOCAB``).

    ``padded_vocab`` (rows after padding) is read only for ``VOCAB``.
    """
    if layout == REPLICATED:
        return full
    if layout == COLUMNS:
        return full.chunk(tp, dim=1)[rank]
    if layout == VOCAB:
        padded = full.new_zeros((padded_vocab, full.shape[1]))
        padded[: full.shape[0]] = full
        return padded.chunk(tp, dim=0)[rank]
    raise ValueError(f"split_shard: layout {layout!r} is fused; use fuse_qkv / fuse_fc1")


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Qwen3Shape, tp: int, rank: int
) -> torch.Tensor:
    """[Hq*D, X], [Hkv*D, X], [Hkv*D, X] -> this rank's ``linear_qkv`` rows [(Hkv/tp)*(G+2)*D, X].

    X is the hidden size for weights and the LoRA rank for adapter B matrices.
    """
    hkv, d, g, x = shape.num_key_value_heads, shape.head_dim, shape.gqa_group_size, q.shape[1]
    grouped = torch.cat([q.view(hkv, g * d, x), k.view(hkv, d, x), v.view(hkv, d, x)], dim=1)
    return grouped.chunk(tp, dim=0)[rank].reshape(-1, x)


def unfuse_qkv(shards: list[torch.Tensor], shape: Qwen3Shape) -> list[torch.Tensor]:
    """Inverse of :func:`fuse_qkv` over all TP shards (rank order) -> [q, k, v] in HF layout."""
    return _split_qkv(torch.cat(shards, dim=0), shape)


def _split_qkv(fused: torch.Tensor, shape: Qwen3Shape) -> list[torch.Tensor]:
    """``linear_qkv`` rows of whole KV groups (all of them, or one rank's) -> [q, k, v] of those groups, HF
    row order (q heads of the groups, then their k heads, then their v heads)."""
    d, g, x = shape.head_dim, shape.gqa_group_size, fused.shape[1]
    grouped = fused.view(-1, (g + 2) * d, x)
    q, k, v = grouped.split([g * d, d, d], dim=1)
    return [t.reshape(-1, x).contiguous() for t in (q, k, v)]


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """[I, X] gate and up -> this rank's ``linear_fc1`` rows [2*I/tp, X] = [gate slice; up slice]."""
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)


def unfuse_fc1(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`fuse_fc1` over all TP shards (rank order) -> [gate, up]."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return [torch.cat([h[0] for h in halves]).contiguous(), torch.cat([h[1] for h in halves]).contiguous()]


def local_hf_tensors(shard: torch.Tensor, layout: str, shape: Qwen3Shape) -> list[torch.Tensor]:
    """One rank's megatron shard of one tensor -> that rank's slices of its HF tensors (list, HF-name order):
    what a tensor-parallel rollout engine over the same ranks holds
    (:mod:`sparrow_nemo.rollout.torch.tensor_parallel`): q, k, v of the rank's KV groups, its rows of gate and
    up, its columns, its padded vocabulary rows, a replicated tensor whole."""
    if layout == QKV:
        return _split_qkv(shard, shape)
    if layout == FC1:
        return [half.contiguous() for half in shard.chunk(2, dim=0)]
    return [shard]


def merge_shards(shards: list[torch.Tensor], layout: str, shape: Qwen3Shape) -> list[torch.Tensor]:
    """All TP shards (rank order) of one megatron tensor -> its HF tensors (list, HF-name order)."""
    if layout == REPLICATED:
        return [shards[0].clone()]
    if layout == COLUMNS:
        return [torch.cat(shards, dim=1)]
    if layout == VOCAB:
        return [torch.cat(shards, dim=0)[: shape.vocab_size].contiguous()]
    if layout == QKV:
        return unfuse_qkv(shards, shape)
    if layout == FC1:
        return unfuse_fc1(shards)
    raise ValueError(f"merge_shards: unknown layout {layout!r}")


def all_gather_shards(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of the process ``group`` (same shape on all), in rank order. Collective."""
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def gather_stage_tensors(local: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Every pipeline stage's named CPU tensors ``local`` on every rank of the pipeline ``group``. Collective.

    Stage by stage (rank order), the stage's names, shapes and dtypes go out as one small object, then
    each tensor as a tensor broadcast (on the current CUDA device under NCCL, which moves no CPU tensors):
    the peak beyond the result is one tensor, never a pickled model (at 14B and PP 4 a stage's share is
    ~7 GB bf16). A name that more than one stage holds (a tied embedding) keeps the earliest stage's copy.
    """
    if dist.get_world_size(group) == 1:
        return dict(local)
    me = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    merged: dict[str, torch.Tensor] = {}
    for src in dist.get_process_group_ranks(group):
        mine = src == me
        meta = [[(name, tuple(t.shape), t.dtype) for name, t in local.items()] if mine else None]
        dist.broadcast_object_list(meta, src=src, group=group)
        for name, shape, dtype in meta[0]:
            buf = local[name] if mine else torch.empty(shape, dtype=dtype)
            wire = buf.to(device) if device is not None else buf
            dist.broadcast(wire, src=src, group=group)
            if name not in merged:
                merged[name] = buf if mine else wire.cpu()
    return merged
