"""``sparrow bench rollout`` on the default and the smoke recipe (tiny contexts), and its throughput rows."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo import cli
from sparrow_nemo.commands.bench import fraction_schedule
from sparrow_nemo.rollout.tools.bench import (
    decode_throughput,
    dense_step_bytes,
    format_throughput,
    make_engine,
)
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE

SMALL = ["--contexts", "48", "96", "--batch", "3", "--steps", "3", "--tail-batch", "2", "--gen-len", "12"]


@pytest.mark.parametrize("recipe", [None, "tiny_cpu_short_smoke"])
def test_bench_rollout_runs_on_the_recipe(recipe: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "rollout", *SMALL, *(["--config", recipe] if recipe else [])]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "decode throughput: batch 3" in out and "bound/dense" in out and "10% fixed tok/s" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("48 ", "96 "))]
    assert [r[0] for r in rows] == ["48", "96"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)  # dense tok/s, bound tok/s
    assert "rollout bench: batch 2" in out and "p5 bin" in out  # the acceptance-tail table


def test_bench_rollout_default_contexts_fit_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """The README command's default contexts (512 .. 4096) on the default recipe: the 4K row starts where
    its timed steps still fit the model's 4096 positions, instead of a config error."""
    argv = ["bench", "rollout", "--batch", "1", "--steps", "2", "--tail-batch", "1", "--gen-len", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "contexts [512, 1024, 2048, 4096] -> [512, 1024, 2048, 4092]" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert rows[:4] == ["512", "1024", "2048", "4092"]


def test_throughput_rows_hold_the_bound_and_the_kept_fraction() -> None:
    engine = make_engine(SHAPE, dense_layers=0, page_size=16)
    rows = decode_throughput(
        engine,
        [64, 160],
        lambda c: [fraction_schedule(0.25, c, 32, 16, 64)],
        batch=2,
        steps=3,
        bandwidth=1e10,
    )
    assert [(r["context"], r["schedule"]) for r in rows] == [
        (64, "dense"),
        (64, "25% fixed"),
        (160, "dense"),
        (160, "25% fixed"),
    ]
    for r in rows:
        expect = 2 / (dense_step_bytes(engine, 2, r["context"] + 3) / 1e10)
        assert r["bound_tokens_per_s"] == pytest.approx(expect) and r["tokens_per_s"] > 0
    assert rows[0]["kept_kv_fraction"] == 1.0 and rows[0]["speedup_vs_dense"] == 1.0
    # 25% of 160 tokens rounds to 2 pages, below the 64-token minimum: 64 of the 162-164 cached tokens
    assert rows[3]["kept_kv_fraction"] == pytest.approx(float((64 / torch.arange(162.0, 165.0)).mean()))
    assert "context" in format_throughput(rows).splitlines()[1]


def test_dense_step_bytes_counts_kv_and_weights() -> None:
    engine = make_engine(SHAPE)
    kv_per_token = 2 * SHAPE.num_layers * SHAPE.num_key_value_heads * SHAPE.head_dim * 4
    assert dense_step_bytes(engine, 4, 100) - dense_step_bytes(engine, 4, 0) == pytest.approx(
        4 * 100 * kv_per_token
    )
    assert dense_step_bytes(engine, 1, 0) > 0
    assert BudgetSchedule.dense().is_dense
