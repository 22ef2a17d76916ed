"""Save and resume the policy: model shard + optimizer state + RNG states, one torch file per rank.

The files hold tensors and plain containers only and are read with ``torch.load(weights_only=True)``: a
tampered checkpoint (even one whose manifest hashes were recomputed) cannot run code when loaded. The RNG
states are torch's (CPU, CUDA, megatron's tracker), all seeded from ``trainer.seed``; Python's and numpy's
global generators are not stored: nothing on the training path draws from them (every random choice goes
through a seeded ``torch.Generator`` or ``random.Random``), and storing their unseeded states made the
files of two identical runs differ.

Written through :mod:`sparrow_nemo.checkpoint.atomic` (atomic directory + sha256 manifest), so an
interrupted save never loads. On GPU the distributed optimizer's DP-sharded moments go in one extra
file per TP x PP shard (megatron's ``save_parameter_state``; not exercised on the CPU test machine).
These are plain per-rank torch files, not megatron's
``dist_checkpointing``: resuming needs the same TP/PP/DP layout (a different one is refused with
a message naming both); re-sharding on resume goes through the HF export/import instead.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from sparrow_nemo.checkpoint.atomic import (
    CheckpointError,
    atomic_torch_save,
    finalize,
    partial_dir,
    read_manifest,
    sha256_file,
    verify_checkpoint,
)
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model

#: 2: weights_only-loadable files, no python/numpy RNG states
FORMAT_VERSION = 2


def _rank_file(spec: PolicyModelSpec) -> str:
    from megatron.core import parallel_state as ps

    return f"policy_tp{spec.tp_rank:02d}_pp{spec.pp_rank:02d}_dp{ps.get_data_parallel_rank():03d}.pt"


def _param_state_file(spec: PolicyModelSpec) -> str:
    """The distributed optimizer's parameter state of one TP x PP shard (GPU; written by DP rank 0)."""
    return f"optim_param_state_tp{spec.tp_rank:02d}_pp{spec.pp_rank:02d}.pt"


def rng_state() -> dict:
    """The RNGs the training draws from (torch CPU, CUDA, megatron's tracker); tensors only."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state_all()
        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state_all(state["cuda"])
        get_cuda_rng_tracker().set_states(state["tracker"])


def _meta(spec: PolicyModelSpec, step: int) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": spec.layout.to_dict(),
        "shape": dataclasses.asdict(spec.shape),
        "use_te": spec.use_te,
    }


def save_policy_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    spec: PolicyModelSpec,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank writes its shard; returns ``<root>/step_<step>`` once complete.

    A full disk on any rank is a :class:`CheckpointError` on every rank, and the partial folder is removed.

    ``write_extra(staging_dir)`` (rank 0 only) adds more files to the checkpoint before the manifest is
    written (the trainer's state): they are hashed and renamed together with the shards.
    """
    name = f"step_{step:08d}"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(Path(root) / f"{name}.partial", ignore_errors=True)  # leftovers of a crashed save
    dist.barrier()
    staging = partial_dir(root, name)
    payload = {
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "step": step,
    }

    error = None
    try:
        atomic_torch_save(payload, staging / _rank_file(spec))
        optimizer.save_param_state(staging / _param_state_file(spec))
        if rank0 and write_extra is not None:
            write_extra(staging)
    except CheckpointError as exc:  # the disk is full
        error = str(exc)
    final = Path(root) / name
    error = _first_error(error)
    if error is None and rank0:
        try:
            final = finalize(root, name, _meta(spec, step))
        except CheckpointError as exc:
            error = str(exc)
    error = _first_error(error)
    if error is not None:  # every rank hears of it, and nothing half-written stays
        if rank0:
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        raise CheckpointError(error)
    return final


def _first_error(error: str | None) -> str | None:
    """Collective: the first rank's error, if any rank has one (a barrier when none has)."""
    errors = [error] * dist.get_world_size()
    if dist.get_world_size() > 1:
        dist.all_gather_object(errors, error)
    else:
        dist.barrier()
    return next((e for e in errors if e is not None), None)


def check_resume_shape(candidates: list[Path], shape: Qwen3Shape) -> None:
    """Before a run writes anything: refuse when no candidate checkpoint holds a model of ``shape`` (read
    from the manifests only; unreadable candidates are the loader's business).

    Raises:
        CheckpointError: one line naming the checkpoint(s) and both shapes' differing fields.
    """
    expected = dataclasses.asdict(shape)
    mismatched = []
    for path in candidates:
        try:
            found = read_manifest(path).get("shape")
        except CheckpointError:
            return  # not a complete checkpoint: the loader reports or skips it
        if found == expected:
            return
        diff = {
            k: (found.get(k), v)
            for k, v in expected.items()
            if not isinstance(found, dict) or found.get(k) != v
        }
        mismatched.append(f"{path}: {diff}")
    if mismatched:
        raise CheckpointError(
            f"no checkpoint to resume from has this run's model shape ((checkpoint, run) per differing field): "
            f"{'; '.join(mismatched)}"
        )


def load_policy_checkpoint(path: str | Path, model: torch.nn.Module, optimizer, spec: PolicyModelSpec) -> int:
    """Restore this rank's model, optimizer and RNG from a complete checkpoint; returns its step.

    Everything this rank reads is checked (manifest, layout, sha256 of its files) before any state is
    touched, so a :class:`CheckpointError` leaves the model, optimizer and RNG as they were.
    """
    path = Path(path)
    manifest = verify_checkpoint(path, check_hashes=False)
    expected = _meta(spec, manifest.get("step", -1))
    for key in ("format_version", "layout", "shape"):
        if manifest.get(key) != expected[key]:
            raise CheckpointError(
                f"{path}: checkpoint {key}={manifest.get(key)} but this run has {expected[key]}"
            )
    rank_file = _verified_file(path, manifest, _rank_file(spec))
    param_state = None
    if _param_state_file(spec) in manifest["files"]:
        param_state = _verified_file(path, manifest, _param_state_file(spec))
    try:
        payload = torch.load(rank_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # an object other than tensors and plain containers
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(
            f"{rank_file}: refused, it holds more than tensors and plain data ({first})"
        ) from None
    unwrap_model(model).load_state_dict(payload["model"], strict=True)
    optimizer.load_state_dict(payload["optimizer"])
    if param_state is not None:
        optimizer.load_param_state(param_state)
    set_rng_state(payload["rng"])
    return int(payload["step"])


def _verified_file(path: Path, manifest: dict, name: str) -> Path:
    """``path / name`` after checking it is listed in the manifest and matches its sha256."""
    if name not in manifest["files"]:
        raise CheckpointError(f"{path}: no file '{name}' for this rank in the manifest")
    if sha256_file(path / name) != manifest["files"][name]:
        raise CheckpointError(f"{path}: '{name}' does not match its sha256 in the manifest")
    return path / name
