"""The policy worker's refit (:meth:`MegatronPolicy.refit <sparrow_nemo.policy.policy.MegatronPolicy.refit>`):
each rank's rollout engine gets the policy's new weights, on the device, one piece at a time.

With one engine per GPU (``rollout.tensor_parallel_size = 1``) every engine holds the whole model in HF
layout while the policy rank holds only its TP x PP shard. Per step, for every piece of the model (the
embedding, one decoder layer, the final norm and the output layer):

1. the stage that holds it all-gathers the tensor-parallel shards inside its TP group, on the device
   (:func:`~sparrow_nemo.policy.tp_layout.all_gather_shards`), and merges them into HF tensors;
2. with pipeline parallelism, that stage broadcasts the merged tensors to the other stages of its pipeline
   group (tensor broadcasts; every rank knows the names and shapes from the model's shape: nothing pickled);
3. every rank hands the piece to its engine (``engine.update_weights(piece)``) and drops it.

So no rank ever holds a full copy besides its engine's own weights, and nothing goes through the host
unless the engine lives there (CPU runs). Cost per rank and step: one TP all-gather of its stage's shards
(``(tp - 1) / tp`` of the stage's weights received) and, with ``pp > 1``, the other stages' weights received
once. The trainer builds its engines empty and fills them by a first refit.

With tensor-parallel engines over the policy's whole TP group (``rollout.tensor_parallel_size`` = ``tp`` > 1)
a rank's engine shard is its megatron shard (:mod:`sparrow_nemo.rollout.torch.tensor_parallel`), so the refit
gathers nothing: each rank converts its own shards to HF-named slices
(:func:`~sparrow_nemo.policy.tp_layout.local_hf_tensors`) and, with ``pp > 1``, a stage broadcasts them to the
same TP rank of the other stages (``1 / tp`` of the model received per rank). Engines over fewer ranks get the
full pieces and slice them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from sparrow_nemo.hf_qwen3 import hf_tensor_shape
from sparrow_nemo.policy.hf_import import weight_plan
from sparrow_nemo.policy.model import unwrap_model
from sparrow_nemo.policy.tp_layout import REPLICATED, all_gather_shards, local_hf_tensors, merge_shards
from sparrow_nemo.rollout.torch.tensor_parallel import local_weight_shape

#: a piece of the model: HF name -> full tensor on this rank's device
Piece = dict[str, torch.Tensor]


def _piece_of(hf_name: str) -> str:
    """Which piece an HF weight belongs to: ``layer.<i>`` for decoder layers, else ``embed`` / ``head``."""
    if hf_name.startswith("model.layers."):
        return "layer." + hf_name.split(".")[2]
    return "embed" if "embed_tokens" in hf_name else "head"


def _stage_plans(spec) -> list[list[tuple[str, tuple[str, ...], str]]]:
    """``weight_plan`` of every pipeline stage (each rank can compute all of them from the model's shape)."""
    return [weight_plan(dataclasses.replace(spec, pp_rank=s)) for s in range(spec.layout.pp)]


def pieces(policy, local: bool = False) -> Iterator[Piece]:
    """The policy's whole model as HF-named full tensors on this rank's device, a piece at a time; with
    ``local``, this TP rank's slices of them instead (the shard of a tensor-parallel engine over the TP group).

    Collective over the tensor- (unless ``local``) and pipeline-parallel groups (every rank iterates to the
    end). Yields the same pieces in the same order on every rank. A tensor held by two stages (tied embeddings
    on a separate last stage) comes once, from the first.
    """
    from megatron.core import parallel_state as ps

    spec = policy.spec
    params = dict(unwrap_model(policy.model).named_parameters())
    tp_group = ps.get_tensor_model_parallel_group()
    pp = spec.layout.pp
    pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
    device = next(iter(params.values())).device
    dtype = next(iter(params.values())).dtype
    seen: set[str] = set()
    for stage, plan in enumerate(_stage_plans(spec)):
        src = dist.get_global_rank(pp_group, stage) if pp_group is not None else None
        current: str | None = None
        piece: Piece = {}
        for key, hf_names, layout in plan:
            if all(name in seen for name in hf_names):
                continue
            if stage == spec.pp_rank:
                mine = params[key].detach()
                if local:
                    tensors = local_hf_tensors(mine, layout, spec.shape)
                else:
                    shards = all_gather_shards(mine, tp_group) if layout != REPLICATED else [mine]
                    tensors = merge_shards(shards, layout, spec.shape)
            else:
                tensors = [torch.empty(_shape(n, spec, local), dtype=dtype, device=device) for n in hf_names]
            if pp_group is not None:
                for t in tensors:
                    dist.broadcast(t, src=src, group=pp_group)
            for name, tensor in zip(hf_names, tensors, strict=True):
                seen.add(name)
                name_piece = _piece_of(name)
                if current is not None and name_piece != current:
                    yield piece
                    piece = {}
                current = name_piece
                piece[name] = tensor
        if piece:
            yield piece


def _shape(name: str, spec, local: bool) -> tuple[int, ...]:
    """The shape of HF tensor ``name`` as :func:`pieces` yields it: whole, or this TP rank's slice."""
    full = hf_tensor_shape(name, spec.shape)
    return local_weight_shape(name, full, spec.layout.tp, spec.padded_vocab) if local else full


def holds_megatron_shard(policy, engine: Any) -> bool:
    """Whether ``engine`` is a tensor-parallel engine over the policy's whole TP group (its shard of every
    weight is this rank's megatron shard: the refit sends each rank its own). A padded vocabulary other than
    the policy's is refused (ValueError)."""
    tp = getattr(engine, "tensor_parallel", None)
    layout = policy.spec.layout
    if tp is None or tp.size != layout.tp or layout.tp == 1:
        return False
    if tp.padded_vocab != policy.spec.padded_vocab:
        raise ValueError(
            f"refit: the engine pads the vocabulary to {tp.padded_vocab} rows, the policy to "
            f"{policy.spec.padded_vocab}; a tensor-parallel engine over the policy's TP group must use the policy's"
        )
    return True


def stream_weights(policy, engine: Any) -> int:
    """Stream the policy's weights into ``engine``: ``engine.update_weights(piece)`` per piece (``engine`` None on
    a rank without one, which still takes part in the collectives); each rank's own TP slices for a
    tensor-parallel engine over the policy's TP group (:func:`holds_megatron_shard`), else the full pieces.
    Returns the number of tensors sent. Collective."""
    count = 0
    for piece in pieces(policy, holds_megatron_shard(policy, engine)):
        if engine is not None:
            engine.update_weights(piece)
        count += len(piece)
    return count
