"""Weights for the TensorRT-LLM engine: our HF-named export -> what its Qwen3 model loader takes.

TensorRT-LLM's PyTorch Qwen3 model loads Hugging Face parameter names and fuses q/k/v and gate/up itself,
so a refit sends HF names. What this module adds is the checking and shaping the engine needs:

- :func:`refit_tensors`: validate names and shapes against the Qwen3 shape (a typo or a wrong layout is
  an error naming the tensor, not a silently ignored key), drop ``lm_head.weight`` when the embeddings
  are tied (the loader ties them itself), cast to the engine dtype, make contiguous;
- :func:`merge_lora`: DistillSparse's adapter folded into the base linears, ``W + scaling * B @ A``
  (TensorRT-LLM then runs the merged weights; dense scoring goes back to the base weights);
- :func:`buckets`: the tensors split into groups of bounded bytes (whole layers), one IPC transfer each;
- :func:`refit_messages` / :func:`merge_handles` / :func:`check_handles`: what each GPU sends to
  TensorRT-LLM's ``WorkerExtension.update_weights`` (``tensorrt_llm/llmapi/rlhf_utils.py``, read at
  commit 04762f3b82e2410c84ccdfd7901844831147668a): a dict from device UUID to that device's
  ``[(name, reduce_tensor(t))]``; every worker looks up *its own* UUID (``get_device_uuid(self.device_id)``)
  and raises "Device UUID ... not found in ipc_handles" when it is absent; ``None`` finalises the load
  (``process_weights_after_loading`` / ``post_load_weights``). So each GPU's policy rank sends handles
  of tensors on its own GPU keyed by its own UUID, and an engine spanning several GPUs needs every
  worker's UUID in the one dict its driver sends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

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


#: ``WorkerExtension.update_weights``' argument: device UUID -> [(HF name, IPC handle)] of that device
IpcHandles = dict[str, list[tuple[str, Any]]]


def refit_messages(
    named: list[tuple[str, torch.Tensor]],
    device_uuid: str,
    device: torch.device,
    max_bytes: int,
    reduce: Callable[[torch.Tensor], Any],
) -> Iterator[IpcHandles | None]:
    """One GPU's refit, as the ``update_weights`` arguments it sends in order: one dict per bucket, keyed
    by this GPU's own UUID, then ``None`` (finalise).

    Each bucket is moved to ``device`` (a no-op for tensors already there) just before its message is
    yielded and kept alive until the next one is asked for, i.e. while the worker reads the handles.

    Args:
        named: this rank's HF-named tensors (:func:`refit_tensors`).
        device_uuid: this GPU's UUID (``tensorrt_llm._torch.utils.get_device_uuid``). device: this GPU.
        reduce: tensor -> IPC handle (``torch.multiprocessing.reductions.reduce_tensor``: ``(rebuild_fn, args)``
            whose ``args[6]`` the worker replaces with its own device index).
    """
    if not device_uuid:
        raise ValueError("refit_messages: device_uuid is empty")
    for group in buckets(named, max_bytes):
        staged = [(n, t.to(device)) for n, t in group]
        yield {device_uuid: [(n, reduce(t)) for n, t in staged]}
    yield None


def merge_handles(parts: Sequence[IpcHandles]) -> IpcHandles:
    """The same bucket from every GPU of one engine, in the one dict its driver sends (UUIDs disjoint)."""
    merged: IpcHandles = {}
    for part in parts:
        for uuid, items in part.items():
            if uuid in merged:
                raise ValueError(f"merge_handles: two ranks sent weights for device {uuid}")
            merged[uuid] = items
    return merged


def check_handles(handles: IpcHandles, worker_uuids: Sequence[str]) -> IpcHandles:
    """``handles`` unchanged when they hold exactly the engine workers' devices, else a ValueError that
    names them (instead of the worker's "Device UUID ... not found in ipc_handles" mid-refit)."""
    missing = sorted(set(worker_uuids) - set(handles))
    extra = sorted(set(handles) - set(worker_uuids))
    if missing or extra:
        raise ValueError(
            f"TensorRT-LLM refit: the engine's workers run on devices {sorted(worker_uuids)}, the weights "
            f"came for {sorted(handles)} (missing {missing}, not an engine device {extra}); each GPU's "
            "engine must be refit from the policy rank on that same GPU"
        )
    return handles
