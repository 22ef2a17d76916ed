"""Save and resume the policy: a sharded checkpoint of model + optimizer (megatron ``dist_checkpointing``) and
each rank's RNG states, inside the step's atomic folder.

Layout inside ``step_<n>/`` (written through :mod:`sparrow_nemo.checkpoint.atomic`, so an interrupted save never
loads):

- ``policy/``: megatron's ``torch_dist`` sharded checkpoint (``.metadata``, ``__<rank>_<i>.distcp``,
  ``common.pt``, ``metadata.json``) of the model's ``sharded_state_dict`` and the optimizer's: every rank writes
  the tensors it is the main replica of - its TP x PP shard of the weights (DP rank 0 of each shard) and, with
  megatron's distributed optimizer, its own DP shard of the fp32 master weights and Adam moments
  (``dp_reshardable``); no rank gathers another's state. The CPU path's AdamW (state replicated over
  DP) is laid out like the weights (:meth:`~sparrow_nemo.policy.optim.TorchPolicyOptimizer.sharded_state_dict`).
- ``rng_tp<t>_pp<p>_dp<d>.pt``: each rank's RNGs (torch CPU, CUDA, megatron's tracker), all seeded from
  ``trainer.seed``; tensors only.

Loading checks the manifest first (format, model shape, TP and PP: a different one is refused with one line
naming both), then the sha256 of every file, the ranks sharing the hashing (each file once) and agreeing on the
outcome before any state is touched; ``policy/.metadata`` (a pickle that torch's loader reads) is checked to
hold only checkpoint metadata classes, so a tampered checkpoint whose hashes were recomputed cannot run code.
The tensors are stored in global (model-space) coordinates, so a different data-parallel size resumes: each
rank reads its own part; the RNG states come from the same DP rank, or DP rank 0 of the same TP x PP shard.
Format 2 checkpoints (one torch file per rank, before sharded checkpoints) are refused with one line.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import io
import logging
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from sparrow_nemo.checkpoint.atomic import (
    CheckpointError,
    atomic_torch_save,
    disk_full_error,
    finalize,
    partial_dir,
    read_bounded,
    read_manifest,
    sha256_file,
    verify_checkpoint,
)
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.cpu_shims import dist_checkpointing_on_cpu
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model

#: 3: sharded (megatron dist_checkpointing) model + optimizer, per-rank RNG files
FORMAT_VERSION = 3
#: the sharded checkpoint's folder inside the step folder
SHARDED = "policy"
#: the largest ``.metadata`` read for its safety check (a real one: ~1 KB per tensor)
MAX_METADATA_BYTES = 64 << 20


def _rng_file(spec: PolicyModelSpec, dp_rank: int) -> str:
    return f"rng_tp{spec.tp_rank:02d}_pp{spec.pp_rank:02d}_dp{dp_rank:03d}.pt"


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


def _writer():
    """megatron's ``torch_dist`` writer, synchronous and one file per rank (``__<rank>_0.distcp``).

    Synchronous saves run megatron's writer in this process, so its results need no queue in a separate
    manager process (``filesystem_async._get_write_results_queue`` starts one per process otherwise: it
    outlives a killed trainer and holds its output pipes); an in-process queue carries them."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


@contextlib.contextmanager
def _writer_errors_raised_not_logged() -> Iterator[None]:
    """Inside, megatron's writer does not log a worker's failure: the exception it raises carries it (and a
    full disk is then one line, :func:`~sparrow_nemo.checkpoint.atomic.disk_full_error`)."""
    writer_log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    level = writer_log.level
    writer_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        writer_log.setLevel(level)


def _sharded_state(model: torch.nn.Module, optimizer, is_loading: bool, with_optimizer: bool) -> dict:
    """The sharded state dict megatron saves / fills in: ``model``, ``optimizer`` (when it has moments)."""
    model_sharded = unwrap_model(model).sharded_state_dict()
    state = {"model": model_sharded, "optimizer_saved": with_optimizer}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sharded, is_loading)
    return state


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
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from torch.distributed.checkpoint.api import CheckpointException

    name = f"step_{step:08d}"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(Path(root) / f"{name}.partial", ignore_errors=True)  # leftovers of a crashed save
        partial_dir(root, name).joinpath(SHARDED).mkdir()
    dist.barrier()
    staging = partial_dir(root, name)
    error = None
    try:
        state = _sharded_state(model, optimizer, False, optimizer.has_moments())
        try:
            with dist_checkpointing_on_cpu(), _writer_errors_raised_not_logged():
                dist_checkpointing.save(state, str(staging / SHARDED), sharded_strategy=_writer())
        except (Exception, CheckpointException) as exc:  # a failed write, on every rank (a BaseException)
            full = disk_full_error(staging / SHARDED / f"__{dist.get_rank()}_0.distcp", exc)
            if full is None:
                raise
            raise full from None
        atomic_torch_save({"rng": rng_state()}, staging / _rng_file(spec, ps.get_data_parallel_rank()))
        if rank0 and write_extra is not None:
            write_extra(staging)
    except (CheckpointError, OSError) as exc:  # the disk is full
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
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
    if not dist.is_initialized():
        return error
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


def _check_manifest(path: Path, manifest: dict, spec: PolicyModelSpec) -> None:
    """Format, shape, TP and PP as this run's (the DP size may differ)."""
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format_version={version!r:.20} but this version reads {FORMAT_VERSION} (sharded); "
            "format 2 (one torch file per rank) resumes only with the sparrow-nemo version that wrote it"
        )
    expected = _meta(spec, manifest.get("step", -1))
    if manifest.get("shape") != expected["shape"]:
        raise CheckpointError(
            f"{path}: checkpoint shape={manifest.get('shape')} but this run has {expected['shape']}"
        )
    found = manifest.get("layout")
    ours = expected["layout"]
    differs = {
        k: v
        for k, v in ours.items()
        if k not in ("dp", "world_size") and (not isinstance(found, dict) or found.get(k) != v)
    }
    if differs:
        raise CheckpointError(
            f"{path}: checkpoint layout={found} but this run has {ours}: only the data-parallel size may differ"
        )


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP metadata only: the classes of ``torch.distributed.checkpoint`` (dataclasses and
    enums: building one runs no code of the file's choosing), ``torch.Size``, torch's dtype / layout / memory
    format values (a layout by name: ``torch.serialization._get_layout``) and ``OrderedDict``; any other global
    (a function to call) is refused, its module not even imported."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.serialization", "_get_layout"):  # a torch.layout by its name
            return super().find_class(module, name)
        if not (module in ("torch", "collections") or module.startswith("torch.distributed.checkpoint.")):
            raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")  # not even imported
        found = super().find_class(module, name)
        checkpoint_class = module.startswith("torch.distributed.checkpoint.") and isinstance(found, type)
        if checkpoint_class and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
            return found
        if found is torch.Size or found is collections.OrderedDict:
            return found
        if module == "torch" and isinstance(found, torch.dtype | torch.layout | torch.memory_format):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def _check_metadata(path: Path) -> None:
    """``policy/.metadata`` holds checkpoint metadata only (torch's loader unpickles it unrestricted)."""
    file = path / SHARDED / ".metadata"
    try:
        _MetadataUnpickler(io.BytesIO(read_bounded(file, MAX_METADATA_BYTES))).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise CheckpointError(f"{file}: refused, it holds more than checkpoint metadata ({exc})") from None


def _verify_share(path: Path, manifest: dict) -> None:
    """This rank's share of the sha256 checks: every ``world``-th file of the manifest (all ranks: every file)."""
    names = sorted(manifest["files"])
    for name in names[dist.get_rank() :: dist.get_world_size()]:
        if sha256_file(path / name) != manifest["files"][name]:
            raise CheckpointError(f"{path}: '{name}' does not match its sha256 in the manifest")


def _checked_rng(rng_file: Path, saved: object) -> dict:
    """The RNG state in ``saved`` (what :func:`save_policy_checkpoint` wrote) after checking its form, else a
    :class:`CheckpointError` naming the file: ``{"rng": {"torch": uint8 tensor, ...}}``."""
    rng = saved.get("rng") if isinstance(saved, dict) else None
    cpu = rng.get("torch") if isinstance(rng, dict) else None
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.dim() == 1):
        raise CheckpointError(f"{rng_file}: expected {{'rng': {{'torch': a 1-d uint8 RNG state, ...}}}}")
    return rng


def load_policy_checkpoint(path: str | Path, model: torch.nn.Module, optimizer, spec: PolicyModelSpec) -> int:
    """Collective: restore every rank's model, optimizer and RNG from a complete checkpoint; returns its step.

    Everything is checked (manifest, layout, every file's sha256 shared between the ranks, the metadata's
    classes) and agreed over the ranks before any state is touched, so a :class:`CheckpointError` (raised on
    every rank alike) leaves the model, optimizer and RNG as they were.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    path = Path(path)
    error, rng_file, saved = None, None, False
    try:
        manifest = verify_checkpoint(path, check_hashes=False)
        _check_manifest(path, manifest, spec)
        _verify_share(path, manifest)
        _check_metadata(path)
        dp_rank = ps.get_data_parallel_rank()
        same_dp = manifest["layout"].get("dp") == spec.layout.dp
        rng_file = path / _rng_file(spec, dp_rank if same_dp else 0)
        if rng_file.relative_to(path).as_posix() not in manifest["files"]:
            raise CheckpointError(f"{path}: no file '{rng_file.name}' for this rank in the manifest")
        common = torch.load(path / SHARDED / "common.pt", map_location="cpu", weights_only=True)
        saved = bool(common.get("optimizer_saved")) if isinstance(common, dict) else False
        rng = _checked_rng(rng_file, torch.load(rng_file, map_location="cpu", weights_only=True))
    except CheckpointError as exc:
        error = str(exc)
    except (pickle.UnpicklingError, RuntimeError, OSError) as exc:
        error = f"{path}: unreadable ({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})"
    error = _first_error(error)
    if error is not None:
        raise CheckpointError(error)
    with dist_checkpointing_on_cpu():
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, True, saved), str(path / SHARDED))
    unwrap_model(model).load_state_dict(loaded["model"], strict=True)
    if saved:
        optimizer.load_sharded_state_dict(loaded["optimizer"])
    else:
        optimizer.reset_state()
    set_rng_state(rng)
    return int(manifest["step"])
