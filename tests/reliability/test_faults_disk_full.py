"""A disk that fills up during a checkpoint: one line saying so (exit 2), and no partial folder left.

The run's checkpoint folder is a tmpfs too small for one checkpoint, mounted by bubblewrap in a private
mount namespace around ``sparrow train`` (the rest of the file system is the host's, unchanged).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import _train_process as tp

pytestmark = pytest.mark.slow

FULL = "/sparrow_full_disk"


def test_disk_full_during_a_checkpoint_is_one_line_and_leaves_no_partial_folder(tmp_path: Path) -> None:
    train = tp.command(
        tmp_path / "run", "trainer.max_steps=1", "checkpoint.every_n_steps=1", f"checkpoint.dir={FULL}"
    )
    lines, err = tp.run_on_small_disk(train, FULL, 256 << 10)
    assert lines == ["exit=2"], (lines, err[-3000:])  # ls: the folder is empty
    last = err.strip().splitlines()[-1]
    assert last.startswith("sparrow train: ") and "the disk is full" in last and "step_00000001" in last
    assert "Traceback" not in err and "inline_container" not in err
