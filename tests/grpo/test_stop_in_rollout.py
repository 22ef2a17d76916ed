"""A stop signal is honoured inside the rollout, between decode steps (NeMo-RL's ``checkpoint_must_save_by``).

- one rank, the smoke recipe: SIGUSR1 at the first progress report of step 1's rollout ends that generate call
  there (no further decode steps), the run saves the last completed step (0 -> checkpoint ``step 1``) and exits
  with :class:`Preempted`; the resumed run redoes step 1 and ends as the uninterrupted run does;
- two gloo ranks of one lockstep group (a tensor-parallel engine's): when only one of them is signalled, both
  abandon after the same report.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from policy._helpers import run_distributed, single_rank_env

from sparrow_nemo.checkpoint.atomic import complete_checkpoints
from sparrow_nemo.grpo.preemption import Preempted, PreemptionGuard
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import train
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.run_io.metrics import read_metrics

#: responses long enough for several progress reports (one every 8 decode steps) per rollout
FAST = [
    "warmstart.enabled=false",
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "rollout.max_new_tokens=40",
    "evaluation.num_prompts=2",
    "logging.plots=false",
    "trainer.max_steps=3",
    "checkpoint.every_n_steps=100",
]


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 0]


@pytest.mark.slow
def test_a_signal_mid_rollout_ends_the_generate_call_and_the_resume_matches(
    tmp_path, restore_stop_handlers
) -> None:
    config = load_config("tiny_cpu_short_smoke", FAST)
    with single_rank_env():
        train(config, tmp_path / "straight")
    reports: dict[int, list[int]] = {}  # step -> tokens of each progress report of its rollout
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path / "stopped")
        generate = trainer.rollout_engine.generate

        def signalled(*args, on_tokens=None, **kwargs):
            if on_tokens is None:  # an evaluation
                return generate(*args, **kwargs)
            step = trainer.state.step
            seen = reports.setdefault(step, [])

            def spy(tokens: int) -> None:
                seen.append(tokens)
                if step == 1 and len(seen) == 1:  # the time-limit warning, mid-rollout
                    os.kill(os.getpid(), signal.SIGUSR1)
                on_tokens(tokens)

            return generate(*args, on_tokens=spy, **kwargs)

        trainer.rollout_engine.generate = signalled
        try:
            with pytest.raises(Preempted) as info:
                trainer.fit()
        finally:
            trainer.policy.close()
    assert info.value.step == 1 and info.value.signal_name == "SIGUSR1"
    # step 0's rollout ran to its end over several reports; step 1's ended at the report that saw the signal
    assert len(reports[0]) >= 3, reports
    assert len(reports[1]) == 1 and sum(reports[1]) < sum(reports[0]), reports
    assert [s for s, _ in complete_checkpoints(tmp_path / "stopped" / "checkpoints")] == [1]
    assert [r["step"] for r in _rows(tmp_path / "stopped")] == [0]
    with single_rank_env():
        train(config, tmp_path / "stopped")  # resumes at step 1
    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        for key in ("reward/mean", "response_length/mean", "train/grad_norm", "acceptance/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


def _lockstep(rank: int, out_dir: str) -> None:
    from sparrow_nemo.grpo.setup import lockstep_group
    from sparrow_nemo.grpo.world import start_processes
    from sparrow_nemo.model_shapes import PRESETS
    from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
    from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
    from sparrow_nemo.rollout.torch.tensor_parallel import TensorParallel

    start_processes()
    shape = PRESETS["tiny"]
    sharded = Qwen3Decoder.empty(
        shape, tensor_parallel=TensorParallel.over(dist.group.WORLD, shape.vocab_size)
    )
    alone = Qwen3Decoder.empty(shape)
    # the trainer's lockstep group: a tensor-parallel engine's group, nothing for an engine of one rank
    assert lockstep_group(TorchRolloutEngine(sharded)) is dist.group.WORLD
    assert lockstep_group(TorchRolloutEngine(alone)) is None
    guard, calls = PreemptionGuard(), 0
    with guard.watch_rollout(lambda tokens: None, dist.group.WORLD) as report:
        for call in range(10):
            if rank == 1 and call == 3:  # only rank 1 is signalled, before its 4th report
                guard.signal_name = "SIGUSR1"
            report(8)
            calls += 1
    torch.save((calls, guard.signal_name), Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_the_ranks_of_one_engine_abandon_after_the_same_report(tmp_path: Path) -> None:
    run_distributed(_lockstep, 2, str(tmp_path))
    for rank in (0, 1):
        assert torch.load(tmp_path / f"rank{rank}.pt") == (3, "SIGUSR1"), rank


def test_a_one_rank_engine_checks_its_own_flag_without_a_collective() -> None:
    guard, calls = PreemptionGuard(), []
    with guard.watch_rollout(calls.append, None) as report:
        report(5)
        guard.signal_name = "SIGTERM"
        report(7)
        report(9)  # never reached
    assert calls == [5, 7] and not dist.is_initialized()
