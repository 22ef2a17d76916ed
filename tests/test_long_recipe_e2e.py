"""End to end: the long-CoT recipe's smoke variant from a cold cache loads the shipped warm-start (no
training), and its rollouts are long: responses of ~100-160 tokens over a table up to ~250 tokens back, the tail kept in every decided bin, the sparse/dense speedup measured in the summary."""

from __future__ import annotations

from pathlib import Path

import pytest
from policy._helpers import single_rank_env

from sparrow_nemo.grpo import warmstart
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import train
from sparrow_nemo.run_io.metrics import read_metrics
from sparrow_nemo.run_io.summary import tail_per_bin

pytestmark = pytest.mark.slow


def test_long_smoke_run_loads_the_shipped_warm_start_and_rolls_out_long_responses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args, **kwargs):
        raise AssertionError("trained the warm-start although the package ships it")

    monkeypatch.setattr(warmstart, "_train_and_cache", no_training)
    config = load_config("tiny_cpu_long_smoke", [f"warmstart.cache_dir={tmp_path / 'cold'}"])
    with single_rank_env():
        summary, _ = train(config, tmp_path / "run")
    rows = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if row["step"] >= 0]
    assert len(rows) == config.trainer.max_steps
    # long responses: the task's solutions are 127-157 tokens and the warm-started policy writes most of one
    # (measured: mean 101-170 tokens per step over 60 steps of tiny_cpu_long)
    for row in rows:
        assert row["response_length/mean"] > 60, row
    for tag in ("start", "start_dense", "end", "end_dense"):
        assert summary["evals"][tag]["response_length_mean"] > 60, summary["evals"]
    # every decided bin of the last step keeps its tail (the recipe's schedule, 16-token pages, 128-token bins)
    last = rows[-1]
    decided = [
        b
        for b in tail_per_bin([last], "p5")
        if (last.get(f"acceptance/tokens/bin_{b}") or 0) >= config.sparsity.min_bin_tokens
    ]
    assert len(decided) >= 2, last
    for b in decided:
        assert last[f"acceptance/p5/bin_{b}"] >= config.sparsity.threshold, (b, last)
    assert summary["measured_rollout_speedup"] > 0 and summary["predicted_speedup_mean"] > 0, summary
    assert summary["measured_decode_speedup"] > 0, summary  # decode time only: prefill is dense in both
