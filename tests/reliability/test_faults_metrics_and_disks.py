"""Faults around ``metrics.jsonl`` and the disks, on ``sparrow train`` subprocesses (the smoke recipe, 3 steps):

- SIGKILL after a checkpoint's rename and before its step's metrics row: the row comes back from the
  checkpoint on resume, and the rows equal an uninterrupted run's. The kill lands in that window every time:
  ``metrics.jsonl`` is a FIFO nobody reads, so the row's write blocks right after the checkpoint.
- A tampered newest checkpoint (``metrics_rows: -3``, hashes recomputed) is passed over for the older one and
  never cuts ``metrics.jsonl``: the resumed rows equal an uninterrupted run's.
- The run folder turning read-only mid-run (a bind mount remounted read-only in a private mount namespace;
  needs root) and a full disk while copying the default recipe's shipped warm-start into the cache (a 1 MiB
  tmpfs, bubblewrap) end in one line naming the path, exit status 2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reliability import _train_process as tp
from sparrow_nemo.checkpoint.atomic import MANIFEST, sha256_file
from sparrow_nemo.checkpoint.run_state import TRAINER_STATE
from sparrow_nemo.grpo.world import env_without_launcher

pytestmark = pytest.mark.slow

STEPS = 3
OVERRIDES = (f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The computed part of an uninterrupted run's rows."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = tp.run(run_dir, *OVERRIDES)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tp.computed(r) for r in tp.metric_rows(run_dir)]


def _same_rows(run_dir: Path, reference: list[dict]) -> None:
    rows = tp.metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS)), rows
    assert [tp.computed(r) for r in rows] == reference


def test_a_kill_between_a_checkpoint_and_its_row_resumes_to_the_same_rows(
    tmp_path: Path, reference: list[dict]
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "killed.log"
    run_dir.mkdir()
    os.mkfifo(run_dir / "metrics.jsonl")  # the first row's write waits for a reader that never comes
    process = tp.start(run_dir, log, *OVERRIDES)
    checkpoint = run_dir / "checkpoints" / "step_00000001"
    tp.wait_for(process, checkpoint.is_dir, "checkpoint 1", log)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    (run_dir / "metrics.jsonl").unlink()  # no row was written: step 0's lives only in the checkpoint
    resumed = tp.run(run_dir, *OVERRIDES)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "rebuilt from the checkpoint" in resumed.stderr
    _same_rows(run_dir, reference)


def test_a_tampered_newest_checkpoint_never_cuts_the_metrics(tmp_path: Path, reference: list[dict]) -> None:
    run_dir = tmp_path / "run"
    first = tp.run(run_dir, *OVERRIDES)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    payload = json.loads((newest / TRAINER_STATE).read_text())
    payload["trainer"]["metrics_rows"] = -3
    (newest / TRAINER_STATE).write_text(json.dumps(payload))
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"][TRAINER_STATE] = sha256_file(newest / TRAINER_STATE)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    again = tp.run(run_dir, *OVERRIDES)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"checkpoint {newest} is unusable" in again.stderr and "'metrics_rows' must be" in again.stderr
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{STEPS - 1:08d}'}" in again.stderr
    _same_rows(run_dir, reference)


def test_a_run_folder_that_turns_read_only_mid_run_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("remounting a folder read-only needs root and unshare(1)")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = (
        f'mount --bind {run_dir} {run_dir} && "$@" & pid=$!; '
        f"while [ ! -d {run_dir}/checkpoints/step_00000001 ]; do sleep 0.05; kill -0 $pid || break; done; "
        f"mount -o remount,bind,ro {run_dir}; wait $pid; echo exit=$?"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *tp.command(run_dir, *OVERRIDES)],
        capture_output=True,
        text=True,
        timeout=tp.TIMEOUT,
        env=env_without_launcher(),
    )
    assert done.stdout.splitlines() == ["exit=2"], (done.stdout, done.stderr[-3000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sparrow train: cannot write {run_dir}/"), last
    assert "Read-only file system" in last and "Traceback" not in done.stderr


def test_a_full_disk_while_copying_the_shipped_warm_start_is_one_line(tmp_path: Path) -> None:
    full = "/sparrow_full_cache"
    # the default recipe's warm-start is shipped (3.2 MB): its copy meets the full disk
    train = [sys.executable, "-m", "sparrow_nemo.cli", "train", "--run-dir", str(tmp_path / "run")]
    lines, err = tp.run_on_small_disk([*train, f"warmstart.cache_dir={full}"], full, 1 << 20)
    assert lines[0] == "exit=2", (lines, err[-3000:])
    assert all(".partial-" in name for name in lines[1:])  # no cache entry: only the staging of this pid
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"sparrow train: cannot write {full}/.") and "No space left on device" in last, (
        last
    )
    assert "Traceback" not in err and not (tmp_path / "run").exists()
