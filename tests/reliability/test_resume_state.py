"""What a resume restores besides the checkpoint files: the run folder's recipe, the metrics file, the prompt stream."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.distributed as dist
from policy._helpers import single_rank_env

from sparrow_nemo import cli
from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.prompt_source import PromptItem, PromptSource
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.run_io.metrics import MetricsWriter
from sparrow_nemo.run_io.rundir import check_run_dir, make_run_dir


def test_a_run_folder_of_another_recipe_is_refused_unless_forced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = load_config("tiny_cpu_short_smoke")
    make_run_dir(old, tmp_path)
    check_run_dir(
        load_config("tiny_cpu_short_smoke", ["trainer.max_steps=99"]), tmp_path
    )  # not hashed: same run
    new = load_config("tiny_cpu_short_smoke", ["grpo.samples_per_prompt=4"])
    with pytest.raises(ConfigError) as refused:
        check_run_dir(new, tmp_path)
    message = str(refused.value)
    assert old.hash() in message and new.hash() in message, message
    assert "grpo.samples_per_prompt: 8 -> 4" in message and "checkpoint.force_resume=true" in message
    assert "\n" not in message
    with caplog.at_level(logging.WARNING):
        check_run_dir(
            load_config(
                "tiny_cpu_short_smoke", ["grpo.samples_per_prompt=4", "checkpoint.force_resume=true"]
            ),
            tmp_path,
        )
    assert "resuming anyway" in caplog.text
    check_run_dir(
        load_config("tiny_cpu_short_smoke", ["grpo.samples_per_prompt=4", "checkpoint.resume=never"]),
        tmp_path,
    )


def test_sparrow_train_refuses_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run_dir(load_config("tiny_cpu_short_smoke"), tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        with single_rank_env():
            status = cli.main(
                [
                    "train",
                    "--config",
                    "tiny_cpu_short_smoke",
                    "--run-dir",
                    str(tmp_path),
                    "grpo.samples_per_prompt=4",
                ]
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert status == 2
    assert "refusing to resume into it" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_metrics_continue_after_the_checkpoint_without_duplicates(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    for step in range(4):
        writer.write(step, {"reward/mean": float(step)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # the line a SIGKILL cut short
    resumed = MetricsWriter(tmp_path)
    assert resumed.keep_rows(2) == 3  # checkpoint after 2 steps: rows of steps 2, 3 and the cut one go
    assert [row["step"] for row in resumed.history] == [0, 1]
    resumed.write(2, {"reward/mean": 2.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]


def _source(size: int | None, seed: int = 0) -> PromptSource:
    return PromptSource(
        lambda i: PromptItem([i], i), size, lambda text, answer: 0.0, tokenizer=None, seed=seed
    )


def test_the_prompt_stream_continues_in_the_same_epoch_order() -> None:
    source = _source(size=5)
    source.next_batch(3)
    state = source.state_dict()
    expected = [item.answer for item in source.next_batch(6)]  # crosses into epoch 1 (a new shuffle)
    assert state == {"cursor": 3, "epoch": 0, "seed": 0, "size": 5, "shuffle": True}
    resumed = _source(size=5)
    resumed.load_state_dict(state)
    assert [item.answer for item in resumed.next_batch(6)] == expected
    with pytest.raises(ValueError, match="size=5 in the checkpoint but 6 in this run"):
        _source(size=6).load_state_dict(state)
