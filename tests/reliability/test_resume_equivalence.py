"""A run SIGKILLed at a random point and resumed equals the uninterrupted run (CPU, fp32, one rank).

Both runs are ``sparrow train`` subprocesses with the same seed into their own folders. The interrupted
one is killed at a random moment within the step after a randomly chosen checkpoint (the delay is drawn
from the step time measured between the two checkpoints before it), then started again with the same
command (``checkpoint.resume=auto``). From the resumed step on, every metric except wall-clock speeds
and the final weights and optimizer moments must be bit-identical; ``metrics.jsonl`` holds each step once.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import torch

from reliability import _train_process as tp

pytestmark = pytest.mark.slow

STEPS = 6


def test_sigkill_at_a_random_point_then_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    overrides = (f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=1")
    rng = random.Random()
    after_checkpoint = rng.choice((2, 3))

    killed_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    process = tp.start(killed_dir, log, *overrides)
    seen = []
    for step in (after_checkpoint - 1, after_checkpoint):
        marker = killed_dir / "checkpoints" / f"step_{step:08d}"
        tp.wait_for(process, marker.is_dir, f"checkpoint {step}", log)
        seen.append(time.monotonic())
    delay = rng.uniform(0.0, 0.9 * (seen[1] - seen[0]))
    where = f"killed {delay:.2f} s after checkpoint {after_checkpoint}"
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    reached = len(tp.metric_rows(killed_dir))
    assert reached < STEPS, f"{where}: the run had finished every step already"

    resumed = tp.run(killed_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr, f"{where}: the second attempt did not resume"

    reference_dir = tmp_path / "reference"
    reference = tp.run(reference_dir, *overrides)
    assert reference.returncode == 0, reference.stderr[-3000:]

    rows, expected = tp.metric_rows(killed_dir), tp.metric_rows(reference_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == list(range(STEPS)), where
    for row, ref in zip(rows, expected):
        assert tp.computed(row) == tp.computed(ref), f"{where}: step {row['step']} differs"

    final = f"step_{STEPS:08d}"
    got = tp.checkpoint_state(killed_dir / "checkpoints" / final)
    want = tp.checkpoint_state(reference_dir / "checkpoints" / final)
    for name, weight in want["model"].items():
        if isinstance(weight, torch.Tensor):
            assert torch.equal(got["model"][name], weight), f"{where}: weight {name}"
    for index, moments in want["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(got["optimizer"]["state"][index][key], value), (
                f"{where}: Adam {key} of {index}"
            )
