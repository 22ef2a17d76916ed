"""Loading a checkpoint runs no code, and two identical policies write byte-identical checkpoint files.

A tampered policy or RNG file whose manifest hash was recomputed (so the sha256 check passes) holds a pickle
payload: ``torch.load(weights_only=True)`` refuses it with one line naming the file, and the payload never
runs. The saved RNG states are torch's only, so nothing unseeded makes two equal runs' files differ (but the
sharded checkpoint's ``.metadata``, which records the save's id and folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from policy._helpers import single_rank_env

from sparrow_nemo.checkpoint.atomic import MANIFEST, CheckpointError, sha256_file
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.checkpoint import rng_state
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel
from sparrow_nemo.policy.policy import MegatronPolicy

SHAPE = PRESETS["tiny-test"]


class _Payload:
    """Unpickling this runs ``os.system``: what a tampered checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save_one(root: Path) -> Path:
    with single_rank_env():
        policy = MegatronPolicy(SHAPE, ParallelLayout(), OptimizerSettings(), "float32", seed=7)
        try:
            return policy.save(root, 1)
        finally:
            destroy_parallel()


def _rehash(folder: Path, changed: Path) -> None:
    """Record ``changed``'s new sha256 in the manifest, as a tamperer who knows the format would."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][changed.relative_to(folder).as_posix()] = sha256_file(changed)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _load_refused(folder: Path, message: str) -> None:
    with single_rank_env():
        policy = MegatronPolicy(SHAPE, ParallelLayout(), OptimizerSettings(), "float32", seed=7)
        try:
            with pytest.raises(CheckpointError, match=message):
                policy.load(folder)
        finally:
            destroy_parallel()


# the common state every rank reads (the shards are megatron's), and this rank's RNG file
@pytest.mark.parametrize("pattern", ["policy/common.pt", "rng_*.pt"])
def test_a_pickle_payload_with_a_valid_hash_is_refused_and_never_runs(tmp_path: Path, pattern: str) -> None:
    folder = _save_one(tmp_path / "ckpt")
    (rank_file,) = folder.glob(pattern)
    payload = torch.load(rank_file, weights_only=True)
    marker = tmp_path / "payload_ran"
    payload["evil"] = _Payload(marker)
    torch.save(payload, rank_file)
    _rehash(folder, rank_file)
    _load_refused(folder, rf"^{folder}: unreadable \(Weights only load failed")
    assert not marker.exists()


def test_an_rng_file_of_another_form_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = _save_one(tmp_path / "ckpt")
    (rng_file,) = folder.glob("rng_*.pt")
    torch.save({"rng": {"torch": torch.zeros(3, dtype=torch.float32)}}, rng_file)
    _rehash(folder, rng_file)
    _load_refused(folder, rf"^{rng_file}: expected .*uint8 RNG state")


def test_identical_policies_write_byte_identical_files(tmp_path: Path) -> None:
    assert set(rng_state()) <= {"torch", "cuda", "tracker"}  # no unseeded python / numpy state
    first, second = _save_one(tmp_path / "a"), _save_one(tmp_path / "b")
    names = sorted(p.relative_to(first).as_posix() for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file())
    # torch's distributed-checkpoint metadata records the save's own id and folder, and the manifest hashes it
    differ = [n for n in names if sha256_file(first / n) != sha256_file(second / n)]
    assert set(differ) <= {"policy/.metadata", MANIFEST}, differ
