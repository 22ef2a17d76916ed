"""The policy's training state off its device while the rollout engine runs, and back before the update.

During rollout a rank's GPU holds the policy's weights (the refit reads them, the logprob phase runs on
them), the rollout engine, and what only the update needs: the gradient buffers and the optimizer's state.
:class:`TrainingStateOffload` releases the latter two (``policy.offload_during_rollout``), as NeMo-RL and verl
do around generation:

- gradients are freed, not copied: the next update zeroes them first. megatron's DDP frees its contiguous
  fp32 grad buffers (``DistributedDataParallel.offload_grad_buffers``: ``storage().resize_(0)``, every view -
  ``param.main_grad``, the buckets - stays a valid tensor object) and rebuilds them zeroed
  (``restore_grad_buffers``); the CPU branch drops ``param.grad`` (``zero_grad(set_to_none=True)``), which
  the backward rebuilds.
- the optimizer's state (Adam's moments, step counts, and the fp32 master weights of bf16 training: megatron's
  ``shard_fp32_from_float16_groups``) is copied to host memory - pinned on CUDA, allocated once and reused
  every step - and its device storage resized to 0; the restore resizes it back and copies the bytes in.
  Tensor objects, views and the optimizer's references to them are unchanged, so training after a cycle is
  bit-identical to training without one. Tensors that share storage with the model's weights (fp32 training:
  the master weights *are* the weights, or views of megatron's param buffer) stay: the weights never move.

megatron-core 0.16.1's own ``MegatronOptimizer.offload_to_cpu`` replaces ``param.data`` instead (a new,
unpinned tensor each time, and for fp32 parameters a copy that stops aliasing the model's weights), hence the
storage-level version here.

:func:`device_bytes` counts what the optimizer and gradients hold on the policy's device (the measure the
tests and ``sparrow plan`` use): on a CPU-only machine the "device" is the host, and what counts is the
storage the optimizer and gradients own, not the offloaded copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def _unique_storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    """The non-empty storages behind ``tensors``, each once (views of one buffer share it)."""
    seen: set[tuple[str, int]] = set()
    for t in tensors:
        key = _storage_key(t)
        if t.untyped_storage().nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        yield t.untyped_storage()


def _on_device(t: torch.Tensor) -> bool:
    """On CUDA only CUDA tensors count (torch Adam keeps its step counts on the host already)."""
    return t.is_cuda or not torch.cuda.is_available()


def _model_storage_keys(model: torch.nn.Module) -> set[tuple[str, int]]:
    """Storages holding the model's weights (megatron's param buffers included: the params view them)."""
    return {_storage_key(p) for p in model.parameters() if p.untyped_storage().nbytes() > 0}


def optimizer_state_tensors(optimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state on the policy's device that do not hold the model's weights:
    Adam's moments and steps, and master weights kept apart from the model's (bf16 training)."""
    weights = _model_storage_keys(model)
    return [
        t
        for t in optimizer.state_tensors()
        if _on_device(t) and t.untyped_storage().nbytes() > 0 and _storage_key(t) not in weights
    ]


def device_bytes(optimizer, model: torch.nn.Module) -> dict[str, int]:
    """Bytes the policy holds on its device, by kind: ``weights``, ``gradients`` (grad buffers or
    ``param.grad``), ``optimizer`` (:func:`optimizer_state_tensors`); each storage counted once."""
    weights = [p for p in model.parameters() if _on_device(p)]
    return {
        "weights": sum(s.nbytes() for s in _unique_storages(weights)),
        "gradients": sum(s.nbytes() for s in _unique_storages(optimizer.grad_tensors())),
        "optimizer": sum(s.nbytes() for s in _unique_storages(optimizer_state_tensors(optimizer, model))),
    }


class TrainingStateOffload:
    """Offload / restore of one policy's gradients and optimizer state (module docstring).

    ``offload()`` then ``restore()``, any number of times; each is a no-op when already done, so the policy
    can restore before anything that needs the state (update, checkpoint save or load).
    """

    def __init__(self, optimizer, model: torch.nn.Module) -> None:
        self.optimizer = optimizer
        self.model = model
        self.offloaded = False
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._host: dict[int, torch.Tensor] = {}  # reused host buffers by storage position

    def offload(self) -> int:
        """Free the gradients and move the optimizer state to host; returns the device bytes released."""
        if self.offloaded:
            return 0
        before = device_bytes(self.optimizer, self.model)
        storages = list(_unique_storages(optimizer_state_tensors(self.optimizer, self.model)))
        pinned = torch.cuda.is_available()
        for i, storage in enumerate(storages):
            host = self._host.get(i)
            if host is None or host.numel() != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
                self._host[i] = host
            host.untyped_storage().copy_(storage, non_blocking=pinned)
            self._parked.append((storage, host))
        if pinned:
            torch.cuda.synchronize()  # the copies are done before their source is freed
        for storage, _ in self._parked:
            storage.resize_(0)
        self.optimizer.free_grads()
        if pinned:
            torch.cuda.empty_cache()  # for an engine with its own allocator (TensorRT-LLM)
        self.offloaded = True
        after = device_bytes(self.optimizer, self.model)
        return sum(before.values()) - sum(after.values())

    def restore(self) -> None:
        """Optimizer state back on the device from host, gradient storage rebuilt (zeroed where megatron's)."""
        if not self.offloaded:
            return
        pinned = torch.cuda.is_available()
        for storage, host in self._parked:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()
        self._parked = []
        self.optimizer.rebuild_grads()
        self.offloaded = False
