"""Save -> kill mid-save -> resume gives the same next step as the uninterrupted run (TP=2, 2 processes)."""

from __future__ import annotations

import pytest
import torch

from policy._helpers import make_hf_checkpoint, run_distributed
from policy._scenarios import resume_and_step, train_save_crash
from sparrow_nemo.checkpoint.atomic import CheckpointError, latest_checkpoint, verify_checkpoint
from sparrow_nemo.model_shapes import PRESETS


@pytest.mark.multiproc
def test_kill_during_save_then_resume_matches_uninterrupted(tmp_path):
    ckpt = make_hf_checkpoint(PRESETS["tiny-test"], tmp_path / "hf")
    root = tmp_path / "ckpts"
    run_distributed(train_save_crash, 2, 2, 1, str(ckpt), str(root), str(tmp_path / "a.pt"))

    # the interrupted save left shards but no manifest: it must never count as a checkpoint
    partial = root / "step_00000002.partial"
    assert sorted(f.name for f in partial.glob("policy/__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(list(partial.glob("rng_*.pt"))) == 2
    with pytest.raises(CheckpointError, match="unfinished"):
        verify_checkpoint(partial)
    assert latest_checkpoint(root) == root / "step_00000001"

    run_distributed(resume_and_step, 2, 2, 1, str(root), str(tmp_path / "b.pt"))
    a = torch.load(tmp_path / "a.pt", weights_only=False)
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    assert (b["step"], b["latest"]) == (1, "step_00000001")
    assert b["loss"] == a["loss"]  # same arithmetic on the same state: bit-identical on CPU
    assert b["grad_norm"] == a["grad_norm"]
    for name, w in a["weights"].items():
        assert torch.equal(b["weights"][name], w), name
