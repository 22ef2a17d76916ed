"""The trainer's step as phases, in one process on the smoke recipe (random init, tiny batches).

- every phase is timed into the step's row (``timing/*``), the tail scheduler's next budgets reach the row,
  a user callback's metrics carry its own prefix and it sees each evaluation (``on_validation_end``);
- a stop signal during a step's rollout abandons that step before the update: the run checkpoints the last
  completed step (prompt cursor at that step's end), and the resumed run redoes the step and ends as an
  uninterrupted run does;
- ``checkpoint.every_n_minutes`` saves by the clock between the step-count saves;
- ``trainer.dist_timeout_minutes`` is the process group's timeout.
"""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from policy._helpers import single_rank_env

from sparrow_nemo.callbacks import Callback
from sparrow_nemo.checkpoint.atomic import complete_checkpoints
from sparrow_nemo.grpo import world
from sparrow_nemo.grpo.preemption import Preempted
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import train
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.run_io.metrics import read_metrics

pytestmark = pytest.mark.slow

FAST = [
    "warmstart.enabled=false",
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "evaluation.num_prompts=2",
    "logging.plots=false",
    "trainer.max_steps=3",
    "checkpoint.every_n_steps=100",
]
PHASES = ("rollout", "reward", "exchange", "logprobs", "stats", "update", "refit", "checkpoint", "step")


class LoggingCallback(Callback):
    """Logs ``{"seen": step}`` each step (the trainer writes it under the callback's prefix)."""

    def on_train_batch_end(self, trainer, report, metrics):
        trainer.log({"seen": float(report.step)})


class Recorder(Callback):
    """Keeps the metrics of every ``on_validation_end``."""

    def __init__(self) -> None:
        self.validations: list[dict[str, float]] = []

    def on_validation_end(self, trainer, metrics):
        self.validations.append(dict(metrics))


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 0]


def test_rows_carry_timings_next_budgets_and_prefixed_callback_metrics(tmp_path) -> None:
    config = load_config(
        "tiny_cpu_short_smoke",
        [
            *FAST,
            "checkpoint.enabled=false",
            "evaluation.speed_pairs=2",
            "sparsity.noise_unit=sequence",  # the tails' bounds per sample (tests/distributed: their values)
            "callbacks=[{_target_: test_trainer_phases.LoggingCallback}, {_target_: test_trainer_phases.Recorder}]",
        ],
    )
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path)
        try:
            summary = trainer.fit()
        finally:
            trainer.policy.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert len(summary["measured_rollout_speedup_pairs"]) == 2 and summary["measured_rollout_speedup"] > 0
    for row in rows:
        for phase in PHASES:
            assert row[f"timing/{phase}"] >= 0.0, phase
        assert row["timing/step"] >= row["timing/rollout"] + row["timing/update"]
        assert row["timing/rollout_max"] == pytest.approx(row["timing/rollout"], rel=0.5)
        assert row["rollout/tokens_rank_0"] == row["rollout/tokens"]
        assert row["callbacks/LoggingCallback/seen"] == row["step"]
        assert "sparsity/next_budget/bin_0" in row and "sparsity/budget/bin_0" in row
    validations = trainer.callbacks.callbacks[1].validations
    assert [sorted(v)[0].split("/")[1] for v in validations] == [
        "start",
        "start_dense",
        "end",
        "end_dense",
        "end_dense_repeat_1",  # the second pair in the other order (ABBA)
        "end_repeat_1",
    ]
    assert validations[0]["eval/start/prompts"] == 2.0


def test_a_stop_during_the_rollout_abandons_the_step_and_the_resume_redoes_it(
    tmp_path, restore_stop_handlers
) -> None:
    config = load_config("tiny_cpu_short_smoke", FAST)
    with single_rank_env():
        train(config, tmp_path / "straight")
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path / "stopped")
        generate = trainer.rollout_engine.generate

        def signalled(*args, **kwargs):
            if trainer.state.step == 1:  # step 1's rollout: the signal arrives mid-phase
                os.kill(os.getpid(), signal.SIGUSR1)
            return generate(*args, **kwargs)

        trainer.rollout_engine.generate = signalled
        try:
            with pytest.raises(Preempted) as info:
                trainer.fit()
        finally:
            trainer.policy.close()
    assert info.value.step == 1 and info.value.signal_name == "SIGUSR1"
    assert [s for s, _ in complete_checkpoints(tmp_path / "stopped" / "checkpoints")] == [1]
    assert [r["step"] for r in _rows(tmp_path / "stopped")] == [0]  # step 1 was abandoned before its update
    with single_rank_env():
        train(config, tmp_path / "stopped")  # resumes at step 1
    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        for key in ("reward/mean", "response_length/mean", "train/grad_norm", "acceptance/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_time_based_checkpoints(tmp_path) -> None:
    # 0.0001 minutes = 6 ms: every step takes longer, so every step saves; every_n_steps alone saves at the end
    config = load_config(
        "tiny_cpu_short_smoke", [*FAST, "checkpoint.every_n_minutes=0.0001", "checkpoint.keep_last=5"]
    )
    with single_rank_env():
        train(config, tmp_path / "timed")
    assert [s for s, _ in complete_checkpoints(tmp_path / "timed" / "checkpoints")] == [3, 2, 1]
    with single_rank_env():
        train(load_config("tiny_cpu_short_smoke", [*FAST, "checkpoint.keep_last=5"]), tmp_path / "steps")
    assert [s for s, _ in complete_checkpoints(tmp_path / "steps" / "checkpoints")] == [3]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["grpo.prompts_per_step=3"], r"grpo\.mini_batches_per_step=2 mini-batches of whole prompts"),
        (
            ["grpo.mini_batches_per_step=1", "policy.micro_batch_size=3"],
            r"in grpo\.mini_batches_per_step=1 mini-batches is not a multiple of policy\.micro_batch_size=3",
        ),
    ],
)
def test_a_step_that_does_not_split_is_refused_at_construction(tmp_path, overrides, expected) -> None:
    config = load_config("tiny_cpu_short_smoke", [*FAST, *overrides])
    with single_rank_env(), pytest.raises(ValueError, match=expected):
        GrpoTrainer(config, tmp_path)
    assert not dist.is_initialized()


def test_the_process_group_gets_the_recipe_timeout() -> None:
    config = load_config("tiny_cpu_short_smoke", ["trainer.dist_timeout_minutes=7"])
    with single_rank_env():
        world.start_processes(config.trainer.dist_timeout_minutes)
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            assert backend.options._timeout == datetime.timedelta(minutes=7)
        finally:
            dist.destroy_process_group()


def test_dense_rollout_of_a_random_model_reads_alpha_one_with_the_whole_vocabulary(tmp_path) -> None:
    """rollout.logprobs_topk is K on both sides: at K = the vocabulary alpha is exact, so a dense rollout of a
    random-init model (next-token distributions near uniform, where a top-20 bound reads ~its top-20 mass)
    reads 1 at every token."""
    rows = {}
    for k in (128, 20):
        config = load_config(
            "tiny_cpu_short_smoke",
            [
                *FAST,
                "trainer.max_steps=1",
                "checkpoint.enabled=false",
                "sparsity.schedule=dense",
                "control.scheduler.adapt='off'",
                f"rollout.logprobs_topk={k}",
            ],
        )
        assert config.model.preset == "tiny"  # a 128-token vocabulary
        with single_rank_env():
            train(config, tmp_path / f"k{k}")
        (rows[k],) = _rows(tmp_path / f"k{k}")
    assert rows[128]["acceptance/mean"] > 0.9999 and rows[128]["acceptance/p5"] > 0.999, rows[128]
    assert rows[20]["acceptance/mean"] < 0.9, rows[20]  # the bound misses the flat tail
