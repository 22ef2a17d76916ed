"""Atomic checkpoint directories: manifest written last, hashes verified, partial saves ignored."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sparrow_nemo.checkpoint.atomic import (
    CheckpointError,
    atomic_torch_save,
    finalize,
    latest_checkpoint,
    partial_dir,
    verify_checkpoint,
)
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.checkpoint import FORMAT_VERSION, load_policy_checkpoint
from sparrow_nemo.policy.model import PolicyModelSpec
from sparrow_nemo.policy.parallel import ParallelLayout


def _save(root, step: int, value: float):
    name = f"step_{step:08d}"
    staging = partial_dir(root, name)
    for rank in range(2):
        atomic_torch_save({"w": torch.full((3,), value + rank)}, staging / f"rank{rank}.pt")
    return finalize(root, name, {"step": step})


def test_complete_save_verifies_and_latest_picks_highest_step(tmp_path):
    first = _save(tmp_path, 1, 1.0)
    second = _save(tmp_path, 2, 2.0)
    manifest = verify_checkpoint(second)
    assert manifest["step"] == 2 and sorted(manifest["files"]) == ["rank0.pt", "rank1.pt"]
    assert latest_checkpoint(tmp_path) == second
    assert torch.equal(torch.load(first / "rank1.pt")["w"], torch.full((3,), 2.0))
    assert not list(tmp_path.glob("*/.*.tmp")), "no temp files left behind"


def test_unfinished_and_corrupted_saves_are_refused(tmp_path):
    done = _save(tmp_path, 1, 1.0)
    staging = partial_dir(tmp_path, "step_00000002")  # a save that died before finalize
    atomic_torch_save({"w": torch.zeros(3)}, staging / "rank0.pt")
    assert latest_checkpoint(tmp_path) == done
    with pytest.raises(CheckpointError, match="unfinished"):
        verify_checkpoint(staging)
    no_manifest = tmp_path / "step_00000003"
    no_manifest.mkdir()
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        verify_checkpoint(no_manifest)
    torch.save({"w": torch.ones(3)}, done / "rank0.pt")  # altered after the save
    with pytest.raises(CheckpointError, match=r"'rank0\.pt' does not match its sha256"):
        verify_checkpoint(done)
    (done / "rank1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"'rank1\.pt' listed in the manifest is missing"):
        verify_checkpoint(done, check_hashes=False)


def test_resaving_a_step_replaces_it_whole(tmp_path):
    _save(tmp_path, 1, 1.0)
    again = _save(tmp_path, 1, 5.0)
    verify_checkpoint(again)
    assert torch.equal(torch.load(again / "rank0.pt")["w"], torch.full((3,), 5.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_resume_refuses_another_layout(tmp_path):
    shape = PRESETS["tiny-test"]
    path = tmp_path / "step_00000001"
    path.mkdir()

    meta = {
        "format_version": FORMAT_VERSION,
        "step": 1,
        "layout": ParallelLayout(2, 1, 1).to_dict(),
        "shape": dataclasses.asdict(shape),
        "files": {},
    }
    (path / "manifest.json").write_text(json.dumps(meta))
    spec = PolicyModelSpec(shape, ParallelLayout(1, 1, 1), 128, False, 0, 0)
    with pytest.raises(CheckpointError, match="layout="):
        load_policy_checkpoint(path, torch.nn.Linear(1, 1), None, spec)


def test_an_old_format_checkpoint_is_refused_with_one_line(tmp_path):
    """Format 2 (one torch file per rank, before sharded checkpoints): refused, naming both formats."""
    shape = PRESETS["tiny-test"]
    path = tmp_path / "step_00000001"
    path.mkdir()
    meta = {
        "format_version": 2,
        "step": 1,
        "layout": ParallelLayout(1, 1, 1).to_dict(),
        "shape": dataclasses.asdict(shape),
        "files": {},
    }
    (path / "manifest.json").write_text(json.dumps(meta))
    spec = PolicyModelSpec(shape, ParallelLayout(1, 1, 1), 128, False, 0, 0)
    with pytest.raises(CheckpointError) as info:
        load_policy_checkpoint(path, torch.nn.Linear(1, 1), None, spec)
    message = str(info.value)
    assert "\n" not in message and f"format_version=2 but this version reads {FORMAT_VERSION}" in message
