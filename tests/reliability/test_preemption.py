"""SIGTERM / SIGUSR1: finish the step, checkpoint, exit 3; a second signal never breaks the save.

- the guard in-process: a signal sets the stop flag, a second one is ignored (and logged), the handlers
  are restored afterwards; a real policy checkpoint written while signals arrive is complete and loads;
- two gloo ranks agree to stop when only one of them got the signal;
- ``sparrow train`` as a subprocess: SIGUSR1 -> exit 3 with a complete checkpoint at the step it reached,
  and the same command again finishes the remaining steps with each step in ``metrics.jsonl`` once.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from policy._helpers import run_distributed, single_rank_env

from reliability import _train_process as tp
from reliability.test_checkpoint_files import _policy, _weights
from sparrow_nemo.checkpoint.atomic import verify_checkpoint
from sparrow_nemo.checkpoint.run_state import resume_candidates, write_run_state
from sparrow_nemo.grpo.checkpoint import load_run_checkpoint
from sparrow_nemo.grpo.preemption import REQUEUE_EXIT, PreemptionGuard


@pytest.fixture
def stop_signal_handlers():
    """The process's TERM / USR1 handlers as they were before the test (restored after it)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_first_signal_stops_second_is_ignored_and_handlers_come_back(
    caplog: pytest.LogCaptureFixture, stop_signal_handlers
) -> None:
    with PreemptionGuard() as guard:
        assert guard.stop_agreed() is None
    assert {sig: signal.getsignal(sig) for sig in stop_signal_handlers} == stop_signal_handlers
    with caplog.at_level(logging.WARNING), PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.stop_agreed() == "SIGUSR1"
    # stopping: the process is on its way out with status 3, later stop signals must not kill it
    assert {sig: signal.getsignal(sig) for sig in stop_signal_handlers} == dict.fromkeys(
        stop_signal_handlers, signal.SIG_IGN
    )
    messages = [r.getMessage() for r in caplog.records]
    assert any("SIGUSR1: stopping at the next decode-step check" in m for m in messages), messages
    assert any("SIGTERM: ignored, already stopping on SIGUSR1" in m for m in messages), messages


def test_signals_during_a_checkpoint_write_do_not_break_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stop_signal_handlers
) -> None:
    root = tmp_path / "ckpt"

    def state_then_signals(staging: Path) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)  # the first one: stop after this save
        write_run_state(staging, {"step": 1}, {"Cb": {"t": torch.ones(2)}})
        os.kill(os.getpid(), signal.SIGTERM)  # the second one, mid-save: only logged

    with single_rank_env():
        policy = _policy()
        try:
            with caplog.at_level(logging.WARNING), PreemptionGuard() as guard, guard.saving():
                path = policy.save(root, 1, state_then_signals)
            weights = _weights(policy)
        finally:
            policy.close()
    assert guard.stop_agreed() == "SIGUSR1"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint being written completes" in messages and "not interrupted" in messages, messages
    verify_checkpoint(path)  # every file present, every sha256 right
    with single_rank_env():
        policy = _policy()
        try:
            loaded = load_run_checkpoint(resume_candidates("auto", root), policy, is_main=True)
            assert loaded.path == path and loaded.trainer == {"step": 1}
            for name, w in weights.items():
                assert torch.equal(policy.export_hf()[name], w), name
        finally:
            policy.close()


def _agree(rank: int, out_dir: str) -> None:
    from sparrow_nemo.grpo.world import start_processes

    start_processes()
    with PreemptionGuard() as guard:
        first = guard.stop_agreed()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        second = guard.stop_agreed()
    torch.save((first, second), Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
def test_ranks_agree_to_stop_when_one_of_them_got_the_signal(tmp_path: Path) -> None:
    run_distributed(_agree, 2, str(tmp_path))
    for rank in (0, 1):
        assert torch.load(tmp_path / f"rank{rank}.pt") == (None, "SIGTERM"), rank


@pytest.mark.slow
def test_sigusr1_checkpoints_exits_3_and_a_rerun_finishes(tmp_path: Path) -> None:
    steps, run_dir, log = 4, tmp_path / "run", tmp_path / "first.log"
    overrides = (f"trainer.max_steps={steps}", "checkpoint.every_n_steps=100")  # only the preemption saves
    process = tp.start(run_dir, log, *overrides)
    tp.wait_for(process, lambda: len(tp.metric_rows(run_dir)) >= 1, "the first step's metrics", log)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=tp.TIMEOUT) == REQUEUE_EXIT, log.read_text()[-3000:]
    reached = len(tp.metric_rows(run_dir))
    assert 1 <= reached < steps
    (saved,) = (run_dir / "checkpoints").iterdir()
    assert saved.name == f"step_{reached:08d}"
    verify_checkpoint(saved)
    assert f"stopped by SIGUSR1 after step {reached}" in log.read_text()

    again = tp.run(run_dir, *overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {saved}" in again.stderr
    assert [row["step"] for row in tp.metric_rows(run_dir)] == list(range(steps))
    assert tp.checkpoint_state(run_dir / "checkpoints" / f"step_{steps:08d}")["step"] == steps
