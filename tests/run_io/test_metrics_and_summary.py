"""Step metrics against hand-computed values; JSONL writer; summary and plots from metric rows."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sparrow_nemo.grpo.evaluation import end_evaluation_order
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.step_batch import LocalRollout, measure_tokens, score
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.run_io.metric_names import repeat_tag
from sparrow_nemo.run_io.metrics import MetricsWriter, merge_metrics, read_metrics
from sparrow_nemo.run_io.plots import write_plots
from sparrow_nemo.run_io.progress import rollout_progress
from sparrow_nemo.run_io.summary import (
    build_summary,
    format_summary,
    pooled_speedup,
    tail_per_bin,
    timing_per_phase,
)
from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule


def _sample(n: int, reason: str) -> RolloutSample:
    return RolloutSample(
        prompt_ids=torch.tensor([1, 5]),
        response_ids=torch.arange(n) + 3,
        logprobs=torch.zeros(n),
        top_ids=torch.zeros(n, 1, dtype=torch.long),
        top_logprobs=torch.zeros(n, 1),
        cached_len=torch.arange(2, 2 + n),
        kv_budget=torch.full((n,), 32),
        finish_reason=reason,
    )


def test_a_reward_that_raises_scores_that_sample_zero_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One completion the reward function cannot take (it raises, or returns NaN) is a 0 and a count in
    ``reward/errors``, never the end of the run; the other samples keep their rewards."""

    def reward(ids: list[int], answer: int) -> float:
        if len(ids) == 3:
            raise KeyError("values")
        return math.nan if len(ids) == 4 else float(answer)

    local = LocalRollout([_sample(n, "stop_token") for n in (2, 3, 4, 5)], range(0, 4), seconds=1.0)
    score(local, [1, 0], reward, lambda r: r - r.mean(), group_size=2)
    assert local.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and local.reward_errors == 2
    assert "KeyError" in caplog.text and "nan" in caplog.text
    n = sum(s.response_ids.numel() for s in local.samples)
    mm = TokenMismatch(torch.ones(n), torch.arange(n), torch.zeros(n), torch.zeros(n))
    schedule = BudgetSchedule(bin_tokens=4, budgets=(32,), page_size=16, name="s")
    m = measure_tokens(local, mm, schedule, 0.5, 2.0).metrics(schedule, 0.5)
    assert m["reward/errors"] == 2.0 and m["reward/mean"] == 0.25


def test_step_metrics_hand_computed() -> None:
    samples = [_sample(2, "stop_token"), _sample(4, "length")]
    local = LocalRollout(
        samples,
        range(0, 2),
        seconds=0.48,
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, 0.0]),
    )
    # 6 tokens: alpha in bins of 4 tokens of cached length: cached 2,3 | 2,3,4,5 -> bin 0: 2,3,2,3; bin 1: 4,5
    alpha = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    cached = torch.tensor([2, 3, 2, 3, 4, 5])
    train = torch.tensor([0.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    gen = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    schedule = BudgetSchedule(bin_tokens=4, budgets=(32, 48), page_size=16, name="s")
    cost = DecodeCostModel.for_preset("qwen3-1.7b", "h200")
    stats = measure_tokens(local, TokenMismatch(alpha, cached, train, gen), schedule, 0.5, 2.0, cost)
    m = stats.metrics(schedule, 0.5)
    assert m["reward/mean"] == 0.5 and m["reward/std"] == pytest.approx(math.sqrt(0.5))
    assert m["reward/accuracy"] == 0.5 and m["advantage/nonzero_fraction"] == 0.5
    assert m["reward/errors"] == 0.0
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (3.0, 4.0, 2.0)
    assert m["response_length/truncation_rate"] == 0.5
    assert m["rollout/tokens"] == 6.0 and m["rollout/tokens_per_s"] == pytest.approx(12.5)
    assert m["rollout/tokens_rank_0"] == 6.0
    assert m["sparsity/predicted_speedup"] == pytest.approx(cost.predicted_speedup(schedule, [2, 4], [2, 2]))
    assert m["acceptance/mean"] == pytest.approx(0.75)
    assert m["acceptance/p50"] == pytest.approx(0.75)
    assert m["acceptance/p50/bin_0"] == pytest.approx(0.85)  # median of 1.0, 0.9, 0.8, 0.7
    assert m["acceptance/p50/bin_1"] == pytest.approx(0.55)
    # the paper's p5 is logged beside the rule's quantile: position 0.05 * (n - 1) of the sorted values
    assert m["acceptance/p5"] == pytest.approx(0.5 + 0.25 * 0.1)
    assert m["acceptance/p5/bin_0"] == pytest.approx(0.7 + 0.15 * 0.1)
    assert m["acceptance/p5/bin_1"] == pytest.approx(0.5 + 0.05 * 0.1)
    assert m["acceptance/mean/bin_0"] == pytest.approx(0.85) and m["acceptance/mean/bin_1"] == pytest.approx(
        0.55
    )
    assert (m["acceptance/tokens/bin_0"], m["acceptance/tokens/bin_1"]) == (4.0, 2.0)
    assert m["sparsity/budget/bin_0"] == 32.0 and m["sparsity/budget/bin_1"] == 48.0
    assert m["token_mult_prob_error"] == pytest.approx((4 + math.e + math.exp(0.5)) / 6)
    assert m["rollout_is/log_ppl_diff"] == pytest.approx((-1.0 + 0.5) / 6)


def test_dense_schedule_budget_is_logged_as_infinite() -> None:
    samples = [_sample(2, "stop_token"), _sample(2, "stop_token")]
    local = LocalRollout(samples, range(0, 2), seconds=1.0, rewards=torch.zeros(2))
    mm = TokenMismatch(torch.ones(4), torch.tensor([2, 3, 2, 3]), torch.zeros(4), torch.zeros(4))
    m = measure_tokens(local, mm, BudgetSchedule.dense(4), 0.05, 2.0).metrics(BudgetSchedule.dense(4), 0.05)
    assert m["sparsity/budget/bin_0"] == math.inf and m["sparsity/dense"] == 1.0


def test_a_metric_has_one_owner() -> None:
    assert merge_metrics({"a": 1.0}, {"b": 2.0}) == {"a": 1.0, "b": 2.0}
    with pytest.raises(ValueError, match=r"\['sparsity/budget/bin_0'\] set twice"):
        merge_metrics({"sparsity/budget/bin_0": 16.0}, {"sparsity/budget/bin_0": 24.0})


def test_metrics_writer_jsonl_rows_and_nulls(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    writer.write(0, {"a/b": 1.5, "c": float("inf")})
    writer.write(1, {"a/b": 2.0})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and all("time" in r for r in rows)
    assert rows[0]["a/b"] == 1.5 and rows[0]["c"] is None


def _eval(tokens: int, seconds: float, decode_seconds: float) -> dict:
    return {
        "prompts": 4,
        "response_length_mean": tokens / 4,
        "tokens_per_s": tokens / seconds,
        "decode_tokens_per_s": tokens / decode_seconds,
    }


def test_pooled_speedup_over_abba_pairs() -> None:
    evals = {
        "end": _eval(1000, 10.0, 8.0),
        "end_dense": _eval(800, 16.0, 15.0),
        "end_dense_repeat_1": _eval(800, 12.0, 11.0),  # the machine sped up between the pairs
        "end_repeat_1": _eval(1000, 6.0, 5.0),
    }
    speedup, pairs = pooled_speedup(evals, "tokens_per_s")
    assert speedup == pytest.approx((2000 / 16.0) / (1600 / 28.0))  # tokens over seconds, pooled per schedule
    assert pairs == pytest.approx([100 / 50, (1000 / 6) / (800 / 12)])
    assert pooled_speedup(evals, "decode_tokens_per_s")[0] == pytest.approx((2000 / 13.0) / (1600 / 26.0))
    # a repeat without its partner is not a pair; a pair with a missing rate gives no speedup
    one = {k: v for k, v in evals.items() if k != "end_repeat_1"}
    assert pooled_speedup(one, "tokens_per_s") == (pytest.approx(100 / 50), [pytest.approx(2.0)])
    assert pooled_speedup(
        {**evals, "end_dense": {**evals["end_dense"], "tokens_per_s": 0.0}}, "tokens_per_s"
    ) == (
        None,
        [],
    )
    assert pooled_speedup({"end": evals["end"]}, "tokens_per_s") == (None, [])
    text = format_summary(
        {
            "steps": 1,
            "threshold": 0.86,
            "accuracy_start": None,
            "accuracy_end": None,
            "accuracy_end_dense": None,
            "tail_per_bin": {},
            "final_schedule": {"budgets": [96]},
            "predicted_speedup_mean": None,
            "measured_rollout_speedup": speedup,
            "measured_rollout_speedup_pairs": pairs,
        }
    )
    assert "measured 2.19x (this machine, 2 pairs in ABBA order: 2.00x, 2.50x; decode only n/a" in text


def test_end_evaluations_alternate_abba() -> None:
    assert end_evaluation_order(1) == [("end", 0), ("end_dense", 0)]
    assert end_evaluation_order(3) == [
        ("end", 0),
        ("end_dense", 0),
        ("end_dense", 1),
        ("end", 1),
        ("end", 2),
        ("end_dense", 2),
    ]
    assert [repeat_tag(t, p) for t, p in end_evaluation_order(2)] == [
        "end",
        "end_dense",
        "end_dense_repeat_1",
        "end_repeat_1",
    ]


def _state(evals: dict, schedule: BudgetSchedule) -> SimpleNamespace:
    """What build_summary reads of a TrainerState."""
    return SimpleNamespace(step=1, evals=evals, initial_schedule=None, schedule=schedule)


def test_the_speculative_arm_joins_each_pair_and_is_pooled_against_dense() -> None:
    assert end_evaluation_order(2, speculative=True) == [
        ("end", 0),
        ("end_dense", 0),
        ("end_speculative", 0),
        ("end_speculative", 1),
        ("end_dense", 1),
        ("end", 1),
    ]
    evals = {
        "end": _eval(1000, 10.0, 8.0),
        "end_dense": _eval(800, 16.0, 15.0),
        "end_speculative": _eval(800, 8.0, 7.0),
        "end_speculative_repeat_1": _eval(800, 10.0, 9.0),
        "end_dense_repeat_1": _eval(800, 20.0, 19.0),
        "end_repeat_1": _eval(1000, 6.0, 5.0),
    }
    lossless, pairs = pooled_speedup(evals, "tokens_per_s", "end_speculative")
    assert lossless == pytest.approx((1600 / 18.0) / (1600 / 36.0)) and pairs == pytest.approx([2.0, 2.0])
    dense = BudgetSchedule.dense(256, 16)
    summary = build_summary(_state(evals, dense), [], load_config("tiny_cpu").sparsity)
    assert summary["measured_speculative_speedup"] == pytest.approx(2.0)
    assert summary["measured_rollout_speedup"] == pytest.approx((2000 / 16.0) / (1600 / 36.0))
    text = format_summary(summary)
    assert (
        "lossless speculative rollout (the final schedule drafts, dense verifies) vs dense: measured 2.00x"
        in text
    )
    # without the arm (evaluation.speculative off) the summary has no such key and no such line
    plain_evals = {k: v for k, v in evals.items() if "speculative" not in k}
    plain = build_summary(_state(plain_evals, dense), [], load_config("tiny_cpu").sparsity)
    assert "measured_speculative_speedup" not in plain and "lossless" not in format_summary(plain)


def test_tail_per_bin_summary_and_plots(tmp_path: Path) -> None:
    history = [
        {
            "step": 0,
            "reward/mean": 0.1,
            "acceptance/p5/bin_0": 0.9,
            "acceptance/p5/bin_1": 0.7,
            "sparsity/budget/bin_0": 64.0,
            "timing/step": 2.0,
            "timing/rollout": 1.5,
        },
        {
            "step": 1,
            "reward/mean": 0.2,
            "acceptance/p5/bin_0": 0.88,
            "acceptance/p5/bin_1": 0.9,
            "sparsity/budget/bin_0": 96.0,
            "timing/step": 4.0,
            "timing/rollout": 2.5,
        },
    ]
    assert timing_per_phase(history) == {"step": 3.0, "rollout": 2.0}
    tails = tail_per_bin(history, "p5")
    assert tails == {
        0: {"last": 0.88, "min": 0.88, "steps": 2, "tokens": 0},
        1: {"last": 0.9, "min": 0.7, "steps": 2, "tokens": 0},
    }
    summary = {
        "steps": 2,
        "threshold": 0.86,
        "accuracy_start": 0.25,
        "accuracy_end": 0.5,
        "accuracy_end_dense": None,
        "tail_per_bin": {str(b): {**t, "ok": t["last"] >= 0.86} for b, t in tails.items()},
        "final_schedule": {"budgets": [96]},
        "predicted_speedup_mean": 1.5,
        "measured_rollout_speedup": 1.1,
        "measured_decode_speedup": 1.7,
        "timing_mean_s": timing_per_phase(history),
        "response_length_median_mean": 412.5,
    }
    text = format_summary(summary)
    assert "response length: median 412 tokens (per step, mean over the steps)" in text
    assert "measured 1.10x (this machine; decode only 1.70x" in text
    assert (
        "start 0.250 -> end 0.500 (sparse schedule), n/a -> n/a (dense)" in text
        and "bin   1: 0.900 / 0.700  ok  [0 tokens]" in text
    )
    assert "1.50x" in text and "seconds per step (mean): step 3.00, rollout 2.00" in text
    assert "1.50x (h200 cost model)" in text  # a summary without the field: H200 constants, as they were
    summary["cost_hardware"] = "cpu (fitted)"
    summary["speculative"] = {
        "accept_rate": 0.95,
        "tokens_per_verify": 2.5,
        "predicted_tokens_per_verify": 2.8,
        "predicted_speedup": 0.9,
        "last_k": [0, 0],
        "last_draft_budget": [16, 16],
    }
    text = format_summary(summary)
    assert "0.90x (cpu (fitted) cost model)" in text
    assert "last step's plan per bin: k [0, 0], draft budget [16, 16] tokens (k = 0: plain dense" in text
    paths = write_plots(history, 0.86, tmp_path / "plots", "p5")
    assert sorted(p.name for p in paths) == [
        "response_length.png",
        "reward.png",
        "schedule.png",
        "tail_per_bin.png",
    ]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_rollout_progress_bar_counts_the_engines_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    engine = TorchRolloutEngine.from_shape(PRESETS["tiny-test"], seed=0)
    sampling = SamplingParams(max_new_tokens=30, seed=1, stop_token_ids=(5, 6, 7))
    with rollout_progress(4, sampling.max_new_tokens, enabled=True) as bar:
        batch = engine.generate([[3, 4] * 5] * 4, sampling, BudgetSchedule.dense(), on_tokens=bar.update)
        assert (bar.n, bar.total) == (batch.num_response_tokens, 120)
    assert "rollout" in capsys.readouterr().err
    with rollout_progress(4, 30, enabled=False) as silent:
        silent.update(7)  # a disabled bar takes the same calls


def test_summary_reports_the_rules_tail_and_the_papers_p5_per_bin() -> None:
    # the default recipe's rule is p1; the summary decides on it and also shows the paper's p5 of every bin
    config = load_config("tiny_cpu")
    assert config.sparsity.quantile == 0.01 and config.sparsity.min_bin_tokens == 200
    history = [
        {
            "step": 0,
            "reward/mean": 0.5,
            "acceptance/p1/bin_0": 0.95,
            "acceptance/p5/bin_0": 0.99,
            "acceptance/tokens/bin_0": 500.0,
            "acceptance/p1/bin_1": 0.70,
            "acceptance/p5/bin_1": 0.90,
            "acceptance/tokens/bin_1": 150.0,
        }
    ]
    dense = BudgetSchedule.dense(256, 16)
    state = SimpleNamespace(step=1, evals={}, initial_schedule=None, schedule=dense)
    summary = build_summary(state, history, config.sparsity)
    assert summary["tail_statistic"] == "p1"
    assert summary["tail_per_bin"]["0"] | {"ok": True, "decided": True} == summary["tail_per_bin"]["0"]
    assert summary["tail_per_bin"]["1"]["ok"] is False and summary["tail_per_bin"]["1"]["decided"] is False
    assert summary["paper_tail_per_bin"]["1"]["last"] == 0.90 and summary["paper_tail_per_bin"]["1"]["ok"]
    assert summary["bins_below_threshold_last_step"] == [1]
    text = format_summary(summary)
    assert "acceptance-rate tail per bin (p1, threshold 0.86" in text
    assert (
        "bin   1: 0.700 / 0.700  BELOW (too few tokens for a decision)  [150 tokens]  (p5 last 0.900)" in text
    )
