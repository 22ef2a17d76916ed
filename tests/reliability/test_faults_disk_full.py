"""A disk that fills up during a checkpoint: one line saying so (exit 2), and no partial folder left.

The run's checkpoint folder is a tmpfs too small for one checkpoint, mounted by bubblewrap in a private
mount namespace around ``sparrow train`` (the rest of the file system is the host's, unchanged).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from reliability import _train_process as tp
from sparrow_nemo.grpo.world import env_without_launcher

pytestmark = pytest.mark.slow

FULL = "/sparrow_full_disk"


def test_disk_full_during_a_checkpoint_is_one_line_and_leaves_no_partial_folder(tmp_path: Path) -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("needs bubblewrap (apt-get install bubblewrap) to mount a tiny file system")
    train = tp.command(
        tmp_path / "run", "trainer.max_steps=1", "checkpoint.every_n_steps=1", f"checkpoint.dir={FULL}"
    )
    script = f'"$@"; echo "exit=$?"; ls -A {FULL}'
    cmd = [bwrap, "--dev-bind", "/", "/", "--size", str(256 << 10), "--tmpfs", FULL, "--"]
    out = subprocess.run(
        [*cmd, "sh", "-c", script, "sh", *train],
        capture_output=True,
        text=True,
        timeout=tp.TIMEOUT,
        env=env_without_launcher(),
    )
    if "Creating new namespace failed" in out.stderr:
        pytest.skip(f"bubblewrap cannot make a mount namespace here: {out.stderr.strip()}")
    assert out.stdout.splitlines() == ["exit=2"], (out.stdout, out.stderr[-3000:])  # ls: the folder is empty
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sparrow train: ") and "the disk is full" in last and "step_00000001" in last
    assert "Traceback" not in out.stderr and "inline_container" not in out.stderr
