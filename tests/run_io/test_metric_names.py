"""``logging.metric_aliases``: NeMo-RL's or verl's names written beside ours (JSONL and W&B offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparrow_nemo.run_io.metric_names import NEMO_RL, VERL, with_aliases
from sparrow_nemo.run_io.metrics import MetricsWriter, read_metrics

ROW = {"timing/rollout": 2.5, "reward/mean": 0.25, "train/clip_fraction": 0.01, "response_length/mean": 30.0}


def test_aliases_are_added_beside_ours_never_over_them() -> None:
    verl = with_aliases(ROW, "verl")
    assert (
        verl["timing_s/gen"] == 2.5
        and verl["critic/score/mean"] == 0.25
        and verl["actor/pg_clipfrac"] == 0.01
    )
    assert {k: verl[k] for k in ROW} == ROW  # ours are all there, unchanged
    nemo = with_aliases(ROW, "nemo_rl")
    assert nemo["timing/train/generation"] == 2.5 and nemo["train/mean_gen_tokens_per_sample"] == 30.0
    assert with_aliases(ROW, None) == ROW
    assert with_aliases({"train/loss": 1.0}, "nemo_rl") == {"train/loss": 1.0}  # the same name: one entry
    assert len(set(VERL.values())) == len(VERL) and len(set(NEMO_RL.values())) == len(NEMO_RL)


def test_jsonl_and_wandb_rows_carry_both_names(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from run_io.test_wandb_logger import _history

    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.run_io.wandb_logger import open_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config("tiny_cpu_short", ["logging.wandb.enabled=true", "logging.metric_aliases=verl"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    wandb = open_wandb(config.logging.wandb, run_dir, config.to_dict())
    writer = MetricsWriter(run_dir, wandb=wandb, aliases=config.logging.metric_aliases)
    writer.write(0, ROW)
    writer.close()
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["timing/rollout"] == row["timing_s/gen"] == 2.5
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    (logged,) = _history(run_file)
    assert logged["critic/score/mean"] == logged["reward/mean"] == 0.25
