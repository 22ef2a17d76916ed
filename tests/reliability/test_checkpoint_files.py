"""The run checkpoint on disk: what goes where, retention, candidate selection and fallback past bad ones.

A real one-rank megatron policy (``tiny-test``) writes real checkpoints; each corruption is applied to
the newest one, and loading must restore the previous one (weights, optimizer, trainer state) with a
warning that names the bad checkpoint and why.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from policy._helpers import single_rank_env
from policy._scenarios import SETTINGS, make_batches, pg_loss

from sparrow_nemo.checkpoint.atomic import CheckpointError, finalize, partial_dir
from sparrow_nemo.checkpoint.run_state import (
    CALLBACK_TENSORS,
    TRAINER_STATE,
    prune_checkpoints,
    read_run_state,
    resume_candidates,
    write_run_state,
)
from sparrow_nemo.grpo.checkpoint import load_run_checkpoint
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy

REPO = Path(__file__).resolve().parents[2]


def _policy() -> MegatronPolicy:
    return MegatronPolicy(PRESETS["tiny-test"], ParallelLayout(), SETTINGS, "float32", seed=3)


def _weights(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.export_hf().items()}


def _save(policy: MegatronPolicy, root: Path, step: int) -> Path:
    """One train step, then a checkpoint with a trainer state and a tensor-holding callback state."""
    policy.train_step(make_batches(policy.spec.shape.vocab_size, n=2, seed=step), pg_loss)
    callbacks = {"Cb": {"step": step, "tensor": {"x": torch.full((3,), float(step))}}}
    return policy.save(root, step, lambda staging: write_run_state(staging, {"step": step}, callbacks))


@pytest.fixture
def two_checkpoints(tmp_path: Path):
    """(root, weights after step 1, weights after step 2) with complete checkpoints step_1 and step_2."""
    root = tmp_path / "ckpt"
    with single_rank_env():
        policy = _policy()
        try:
            _save(policy, root, 1)
            first = _weights(policy)
            _save(policy, root, 2)
            second = _weights(policy)
        finally:
            policy.close()
    return root, first, second


def _load(root: Path):
    with single_rank_env():
        policy = _policy()
        try:
            loaded = load_run_checkpoint(resume_candidates("auto", root), policy, is_main=True)
            return loaded, _weights(policy)
        finally:
            policy.close()


def test_everything_is_in_one_folder_and_tensors_stay_out_of_json(two_checkpoints) -> None:
    root, _, second = two_checkpoints
    folder = root / "step_00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    sharded = {f"policy/{f.name}" for f in (folder / "policy").iterdir()}
    assert {"policy/.metadata", "policy/common.pt", "policy/metadata.json"} < sharded
    assert "policy/__0_0.distcp" in sharded  # one shard file per rank
    assert set(manifest["files"]) == {TRAINER_STATE, CALLBACK_TENSORS, "rng_tp00_pp00_dp000.pt"} | sharded
    plain = json.loads((folder / TRAINER_STATE).read_text())
    assert plain == {"trainer": {"step": 2}, "callbacks": {"Cb": {"step": 2}}}
    trainer, callbacks = read_run_state(folder)
    assert trainer == {"step": 2} and callbacks["Cb"]["step"] == 2
    assert torch.equal(callbacks["Cb"]["tensor"]["x"], torch.full((3,), 2.0))
    loaded, weights = _load(root)
    assert loaded.path == folder and loaded.trainer == {"step": 2}
    for name, w in second.items():
        assert torch.equal(weights[name], w), name


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "policy shard bit flip": ("policy/__0_0.distcp", _flip_a_byte, "does not match its sha256"),
    "policy shard truncated": ("policy/__0_0.distcp", _truncate, "does not match its sha256"),
    "sharded metadata deleted": ("policy/.metadata", Path.unlink, "is missing"),
    "RNG file bit flip": ("rng_tp00_pp00_dp000.pt", _flip_a_byte, "does not match its sha256"),
    "trainer state truncated": (TRAINER_STATE, _truncate, "does not match its sha256"),
    "callback tensors bit flip": (CALLBACK_TENSORS, _flip_a_byte, "does not match its sha256"),
    "callback tensors deleted": (CALLBACK_TENSORS, Path.unlink, "is missing"),
    "manifest garbled": ("manifest.json", _truncate, "manifest.json is not valid JSON"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    two_checkpoints, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, first, _ = two_checkpoints
    file, corrupt, reason = CORRUPTIONS[name]
    corrupt(root / "step_00000002" / file)
    with caplog.at_level(logging.WARNING):
        loaded, weights = _load(root)
    assert loaded.path == root / "step_00000001" and loaded.trainer == {"step": 1}
    assert torch.equal(loaded.callbacks["Cb"]["tensor"]["x"], torch.full((3,), 1.0))
    for key, w in first.items():
        assert torch.equal(weights[key], w), key
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "step_00000002" in warning and reason in warning, warning


def test_no_usable_checkpoint_is_an_error_naming_each(two_checkpoints) -> None:
    root, _, _ = two_checkpoints
    for step in (1, 2):
        _flip_a_byte(root / f"step_{step:08d}" / TRAINER_STATE)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint: step_00000002 .*; step_00000001"):
        _load(root)


def test_kill_during_the_checkpoint_write_leaves_the_previous_one_loadable(tmp_path: Path) -> None:
    # a real SIGKILL of the saving process after its shard and trainer state, before the manifest
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path[:0] = [{str(REPO / "tests")!r}]
        from reliability.test_checkpoint_files import _policy, _save
        from policy._helpers import single_rank_env
        from sparrow_nemo.checkpoint.run_state import write_run_state
        from pathlib import Path
        root = Path({str(tmp_path / "ckpt")!r})
        with single_rank_env():
            policy = _policy()
            _save(policy, root, 1)

            def die(staging):
                write_run_state(staging, {{"step": 2}}, {{}})
                os.kill(os.getpid(), signal.SIGKILL)

            policy.save(root, 2, die)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    partial = tmp_path / "ckpt" / "step_00000002.partial"
    assert (partial / TRAINER_STATE).is_file() and not (partial / "manifest.json").exists()
    loaded, _ = _load(tmp_path / "ckpt")
    assert loaded.path == tmp_path / "ckpt" / "step_00000001" and loaded.trainer == {"step": 1}


def _fake_checkpoint(root: Path, step: int) -> Path:
    name = f"step_{step:08d}"
    (partial_dir(root, name) / "payload.bin").write_bytes(bytes([step]))
    return finalize(root, name, {"step": step})


def test_retention_keeps_the_newest_n_up_to_the_new_one_and_never_the_new_one(tmp_path: Path) -> None:
    for step in range(1, 6):
        _fake_checkpoint(tmp_path, step)
    # resumed from step 2 and saved step 3 again: 4 and 5 belong to an abandoned timeline
    written = _fake_checkpoint(tmp_path, 3)
    removed = prune_checkpoints(tmp_path, written, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000004", "step_00000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    assert prune_checkpoints(tmp_path, written, keep_last=1) == [tmp_path / "step_00000002"]
    # an unfinished save is never a reason to delete anything
    unfinished = partial_dir(tmp_path, "step_00000004")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        prune_checkpoints(tmp_path, unfinished, keep_last=1)
    assert (tmp_path / "step_00000003").is_dir()


def test_resume_candidates(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert resume_candidates("auto", root) == []  # no folder yet: a fresh run
    for step in (1, 2):
        _fake_checkpoint(root, step)
    newest_first = [root / "step_00000002", root / "step_00000001"]
    assert resume_candidates("auto", root) == newest_first
    assert resume_candidates("never", root) == []
    assert resume_candidates(str(root / "step_00000001"), root) == [root / "step_00000001"]
    assert resume_candidates(str(root), tmp_path / "elsewhere") == newest_first
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume=.*missing: does not exist"):
        resume_candidates(str(tmp_path / "missing"), root)
