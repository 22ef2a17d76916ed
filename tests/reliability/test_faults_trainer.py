"""Fault injection through the GRPO trainer: poisoned steps are skipped (policy and engine unchanged),
logged and counted, a good step resets the count, and ``trainer.max_consecutive_nonfinite`` in a row abort.

The trainer is the real one on the smoke recipe (random init, no warm-start, tiny batches); the poison is a
wrapper around the update phase's GRPO loss (``sparrow_nemo.grpo.update.grpo_loss_fn``) that returns a NaN
loss on chosen RL steps.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from policy._helpers import single_rank_env

from sparrow_nemo.grpo import update
from sparrow_nemo.grpo.objective import grpo_loss_fn
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.trainer import GrpoTrainer, NonFiniteTrainingError
from sparrow_nemo.policy.pipeline import LossFn
from sparrow_nemo.run_io.metrics import read_metrics

OVERRIDES = [
    "warmstart.enabled=false",
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "evaluation.num_prompts=2",
    "logging.plots=false",
    "checkpoint.enabled=false",
    "trainer.max_consecutive_nonfinite=2",
]


def poisoned(trainer: GrpoTrainer, steps: set[int]):
    """``grpo_loss_fn`` whose losses are NaN on the RL steps in ``steps``."""

    def make(config, normalizer) -> LossFn:
        inner = grpo_loss_fn(config, normalizer)

        def loss_fn(out, batch):
            loss, metrics = inner(out, batch)
            return (loss * float("nan") if trainer.state.step in steps else loss), metrics

        return loss_fn

    return make


def weights(trainer: GrpoTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(policy weights, rollout engine weights), copied."""
    policy = {k: v.clone() for k, v in trainer.policy.export_hf().items()}
    engine = {k: v.clone() for k, v in trainer.rollout_engine.model.params.items()}
    return policy, engine


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_poisoned_steps_are_skipped_and_enough_in_a_row_abort(tmp_path: Path, caplog, monkeypatch) -> None:
    config = load_config("tiny_cpu_short_smoke", OVERRIDES)
    caplog.set_level(logging.WARNING, logger="sparrow_nemo.grpo.trainer")
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path)
        try:
            monkeypatch.setattr(update, "grpo_loss_fn", poisoned(trainer, {1, 3, 4}))
            trainer.step()  # step 0: good
            before = weights(trainer)
            trainer.step()  # step 1: skipped
            after = weights(trainer)
            assert same(after[0], before[0]) and same(after[1], before[1])
            trainer.step()  # step 2: good again, streak reset; the update reaches the engine
            trained = weights(trainer)
            assert not same(trained[0], after[0]) and same(trained[0], trained[1])
            trainer.step()  # step 3: skipped, 1 in a row
            with pytest.raises(NonFiniteTrainingError, match=r"^step 4: 2 steps in a row skipped .*"):
                trainer.step()  # step 4: skipped, 2 in a row -> abort
        finally:
            trainer.metrics.close()
            trainer.policy.close()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 0]
    assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert rows[1]["train/loss"] is None and rows[2]["train/loss"] is not None
    warnings = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert warnings == [
        f"step {s}: update skipped, mini-batch 0 of 2: loss is nan in micro-batch 0 of data-parallel rank 0"
        for s in (1, 3, 4)
    ]
