"""The stop signal outside the step loop: during the warm-start (start-up) and during the final evaluation.

Both end with exit status 3 and one line saying where the signal came: at start-up at once, without
finishing the warm-start (not the default action, status 143); at the end after the run completed (not 0).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from reliability import _train_process as tp
from sparrow_nemo.grpo.preemption import REQUEUE_EXIT

pytestmark = pytest.mark.slow


def _wait_for_log(process, log: Path, text: str) -> None:
    tp.wait_for(process, lambda: text in log.read_text(), repr(text), log)


def test_sigterm_during_the_warm_start_exits_3_at_once(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    # its own cache: the warm-start trains (many steps, so the signal lands while it does)
    process = tp.start(run_dir, log, f"warmstart.cache_dir={tmp_path / 'cache'}", "warmstart.steps=100000")
    _wait_for_log(process, log, "warm-start: 100000 SFT steps")
    time.sleep(1.0)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == REQUEUE_EXIT, log.read_text()[-3000:]
    assert time.monotonic() - sent < 60  # it did not finish 100,000 SFT steps first
    assert "sparrow train: stopped by SIGTERM during start-up, before any step" in log.read_text()
    assert not list((tmp_path / "cache").rglob("config.json"))  # no warm-start was cached


def test_sigterm_during_the_final_evaluation_exits_3(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    process = tp.start(run_dir, log, "trainer.max_steps=1", "evaluation.num_prompts=8")
    _wait_for_log(process, log, "eval end (")  # the first final evaluation is done, the dense one runs
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=tp.TIMEOUT) == REQUEUE_EXIT, log.read_text()[-3000:]
    text = log.read_text()
    assert "sparrow train: stopped by SIGTERM at the end of the run, which completed; exit 3" in text
    assert (run_dir / "summary.json").is_file()
