"""End to end: the haystack recipe's smoke variant from a cold cache loads the shipped warm-start (no
training) and rolls out over ~0.6-1.3K-token contexts whose table entries are scattered through filler; a bin
whose tail dips gets a larger budget (or the run goes dense), and the summary measures the sparse/dense speedup."""

from __future__ import annotations

from pathlib import Path

import pytest
from policy._helpers import single_rank_env

from sparrow_nemo.grpo import warmstart
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import train
from sparrow_nemo.run_io.metrics import read_metrics
from sparrow_nemo.run_io.summary import tail_per_bin
from sparrow_nemo.sparse.mismatch import tail_name

pytestmark = pytest.mark.slow


def test_haystack_smoke_run_loads_the_shipped_warm_start_and_rolls_out_over_long_contexts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args, **kwargs):
        raise AssertionError("trained the warm-start although the package ships it")

    monkeypatch.setattr(warmstart, "_train_and_cache", no_training)
    config = load_config("tiny_cpu_haystack_smoke", [f"warmstart.cache_dir={tmp_path / 'cold'}"])
    with single_rank_env():
        summary, _ = train(config, tmp_path / "run")
    rows = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if row["step"] >= 0]
    assert len(rows) == config.trainer.max_steps
    # dense, the warm-started policy walks the whole 20-25 hop chain (127-157 tokens; measured: accuracy 0.87 on
    # 128 held-out prompts); sparse rollouts that lose a look-up end early (under the centroid score: 48-87 tokens)
    for tag in ("start_dense", "end_dense"):
        assert summary["evals"][tag]["response_length_mean"] > 100, summary["evals"]
    for row in rows:
        assert row["response_length/mean"] > 20, row
    # the contexts are long: cached lengths of >= 512 tokens (the minimum filler) fill only bins >= 2 of 256
    last, stat = rows[-1], tail_name(config.sparsity.quantile)
    populated = [b for b in tail_per_bin([last], stat) if (last.get(f"acceptance/tokens/bin_{b}") or 0) > 0]
    assert populated and min(populated) >= 2, last
    # the tail is kept: a decided bin whose tail (the recipe's p1) dips below the threshold gets a larger budget
    # for the next step (control.scheduler.adapt: raise), or the collapse guard switches the run to dense (measured
    # in the recipe's 30-step run: bin 4's p1 fell to 0.06 at 192 tokens, raised to 512 over steps 5-15)
    threshold = config.sparsity.threshold
    for row in rows:
        for b in tail_per_bin([row], stat):
            if (row.get(f"acceptance/tokens/bin_{b}") or 0) < config.sparsity.min_bin_tokens:
                continue
            if row[f"acceptance/{stat}/bin_{b}"] < threshold:
                raised = row[f"sparsity/next_budget/bin_{b}"] > row[f"sparsity/budget/bin_{b}"]
                assert raised or row["sparsity/collapse_guard"], (b, row)
    assert summary["measured_rollout_speedup"] > 0 and summary["predicted_speedup_mean"] > 0, summary
    assert summary["measured_decode_speedup"] > 0, summary  # decode time only: prefill is dense in both
