"""End to end: the smoke recipe trains on the synthetic task (fixed seeds, one process, CPU).

One warm-start per test session (session fixture, in a temporary cache), then:
- the GRPO smoke run trains (every update reaches the weights) without losing held-out accuracy: neither
  the sampled accuracy (sparse and dense schedule) beyond its paired sampling noise, nor the policy's
  probability of the held-out reference solutions (teacher-forced, no sampling noise) beyond a margin; it
  keeps every decided bin's p5 at or above the threshold under the tail scheduler and writes metrics,
  plots, checkpoint and summary. It does not assert an improvement: 20 steps of this recipe do not give
  one that noise cannot hide (see the test);
- a fixed budget far too small (16 tokens = 1 top-k page, every layer sparse, no adaptation) shows bins
  below the threshold;
- with the dense schedule the rollout engine and the megatron policy agree token by token (alpha ~ 1);
- ``grpo.loss.kl_coef > 0`` trains against the frozen initial policy (KL 0 at the first update);
- ``grpo.mini_batches_per_step > 1`` makes the PPO ratio real (clipped tokens), 1 keeps it exactly 1;
- two tensor-parallel ranks under torchrun give the one-rank step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from policy._helpers import free_port, single_rank_env

from sparrow_nemo import cli
from sparrow_nemo.grpo.prompt_source import EVAL_OFFSET
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config
from sparrow_nemo.grpo.rollout_step import pad_pairs
from sparrow_nemo.grpo.start import start_checkpoint, train
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.grpo.warmstart import ensure_warm_start
from sparrow_nemo.grpo.world import env_without_launcher
from sparrow_nemo.policy.packing import concat_outputs, micro_batches
from sparrow_nemo.run_io.metrics import read_metrics
from sparrow_nemo.run_io.summary import tail_per_bin
from sparrow_nemo.tasks.chain import ChainTask

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smoke_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The smoke recipe with its warm-start trained once into a session cache ($SPARROW_CACHE when set)."""
    overrides = (
        [] if os.environ.get("SPARROW_CACHE") else [f"warmstart.cache_dir={tmp_path_factory.mktemp('ws')}"]
    )
    config = load_config("tiny_cpu_short_smoke", overrides)
    with single_rank_env():
        ensure_warm_start(config, build_prompt_source(config), show_progress=False)
    return overrides


def _train(config: SparrowConfig, run_dir: Path) -> tuple[dict, list[dict]]:
    with single_rank_env():
        summary, _ = train(config, run_dir)
    return summary, [row for row in read_metrics(run_dir / "metrics.jsonl") if row["step"] >= 0]


#: held-out problems whose reference solutions the smoke test scores before and after RL
PROBE_PROBLEMS = 256


def _solution_probability(trainer: GrpoTrainer, count: int) -> torch.Tensor:
    """[count] the policy's probability of each held-out problem's reference solution (its trace and eos),
    teacher-forced: a lower bound of the dense schedule's chance to solve it at temperature 1, top_p 1, with
    no sampling noise. The problems are the evaluation's (indices from ``EVAL_OFFSET``)."""
    task, tok = ChainTask(trainer.config.task), trainer.prompts.tokenizer
    problems = [task.problem(EVAL_OFFSET + i) for i in range(count)]
    prompts = [torch.tensor(tok.encode(p.prompt, add_special_tokens=True)) for p in problems]
    solutions = [torch.tensor([*tok.encode(p.trace), tok.eos_token_id]) for p in problems]
    tokens, lengths, mask = pad_pairs(prompts, solutions, tok.pad_token_id)
    batches = micro_batches(tokens, lengths, {}, trainer.config.policy.micro_batch_size)
    logprobs = concat_outputs(trainer.policy.logprobs(batches)).logprobs
    return torch.exp((logprobs.double() * mask).sum(dim=1))


def test_smoke_run_trains_without_losing_accuracy_and_keeps_the_tail(smoke_overrides, tmp_path: Path) -> None:
    config = load_config("tiny_cpu_short_smoke", smoke_overrides)
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path, start_checkpoint(config, show_progress=False))
        try:
            before = _solution_probability(trainer, PROBE_PROBLEMS)
            summary = trainer.fit()
            after = _solution_probability(trainer, PROBE_PROBLEMS)
        finally:
            trainer.policy.close()
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if row["step"] >= 0]
    assert len(rows) == config.trainer.max_steps
    # every update with a learning signal reaches the weights; a step whose groups all have equal rewards (a
    # near-deterministic policy on the short task) has none and a zero gradient, as in any GRPO
    assert all(row["train/skipped_nonfinite"] == 0.0 for row in rows), rows
    assert all(row["train/grad_norm"] > 0 for row in rows if row["advantage/nonzero_fraction"] > 0), rows
    assert sum(row["advantage/nonzero_fraction"] > 0 for row in rows) >= len(rows) // 2, rows
    # 20 steps at this size move the held-out accuracy by less than its noise. Measured on a cold cache (2-core
    # machine, one warm-start): mean probability of the 256 reference solutions 0.561 -> 0.567 (+0.006, s.e.
    # 0.005, 117 of 256 up; 1-hop problems 0.825 -> 0.827, 2-hop 0.029 -> 0.044: RL sharpens) with one update
    # per step, 0.561 -> 0.551 (-0.010, s.e. 0.005, 62 up) with grpo.mini_batches_per_step 2 and the
    # step-normalised loss; sampled dense accuracy of 128 prompts 0.539 -> 0.539 and 0.539 -> 0.516. The
    # 20-step runs of experiments/tiny_runs went up or down by 0.02-0.04 by seed, within the paired noise of
    # 128 samples (~0.06). So the test asserts what holds on any warm-start: the updates changed the policy,
    # and no accuracy fell beyond its noise (-0.05 for the mean probability: 5x the drop measured).
    change = after - before
    assert float(change.abs().max()) > 1e-3, change  # the updates reached the weights the probe reads
    assert float(change.mean()) > -0.05, (float(before.mean()), float(after.mean()))
    # The sampled held-out accuracies did not fall beyond 3 standard errors of a paired difference.
    n = config.evaluation.num_prompts
    for start, end in (("accuracy_start", "accuracy_end"), ("accuracy_start_dense", "accuracy_end_dense")):
        p = summary[start]
        assert summary[end] >= p - 3 * (2 * p * (1 - p) / n) ** 0.5, summary
    # the scheduler's decisions hold: in the last step, every bin with enough tokens meets the threshold
    last = rows[-1]
    decided = [
        b
        for b in tail_per_bin([last], "p5")
        if (last.get(f"acceptance/tokens/bin_{b}") or 0) >= config.sparsity.min_bin_tokens
    ]
    assert decided, last
    for b in decided:
        assert last[f"acceptance/p5/bin_{b}"] >= config.sparsity.threshold, (b, last)
    for key in (
        "train/loss",
        "train/clip_fraction",
        "train/entropy",
        "rollout/tokens_per_s",
        "sparsity/predicted_speedup",
        "token_mult_prob_error",
        "response_length/truncation_rate",
    ):
        assert key in last, key
    assert last["response_length/min"] <= last["response_length/median"] <= last["response_length/max"]
    for tag in ("start", "end", "end_dense"):  # decode-only throughput beside the wall number, every eval
        assert summary["evals"][tag]["decode_tokens_per_s"] >= summary["evals"][tag]["tokens_per_s"] > 0, tag
    assert summary["measured_decode_speedup"] > 0, summary
    for name in ("reward.png", "response_length.png", "tail_per_bin.png", "schedule.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    for name in ("response_length_histogram.png", "acceptance_histogram.png"):  # the step histograms
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    step_dir = tmp_path / "checkpoints" / f"step_{config.trainer.max_steps:08d}"
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert (
        state["trainer"]["step"] == config.trainer.max_steps and "TailMismatchScheduler" in state["callbacks"]
    )
    assert (tmp_path / "summary.txt").read_text().startswith("steps:")
    assert (tmp_path / "config.yaml").is_file()


def test_fixed_budget_far_too_small_shows_bins_below_threshold(
    smoke_overrides, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # through the command line: `sparrow train` prints the summary, which flags the failing bins.
    # All 4 layers sparse: with the paper's 2 dense layers this 4-layer model does its look-ups in the
    # dense layers and shrugs off any budget (measured: p5 >= 0.99 at 8 tokens).
    overrides = [
        *smoke_overrides,
        "sparsity.budgets=[16]",
        "sparsity.dense_layers=0",
        "control.scheduler.adapt='off'",
        "trainer.max_steps=2",
        "checkpoint.enabled=false",
        "logging.plots=false",
        "evaluation.num_prompts=8",
    ]
    with single_rank_env():
        assert (
            cli.main(["train", "--config", "tiny_cpu_short_smoke", "--run-dir", str(tmp_path), *overrides])
            == 0
        )
    out = capsys.readouterr().out
    assert f"run folder: {tmp_path}" in out and "BELOW" in out
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if row["step"] >= 0]
    threshold = load_config("tiny_cpu_short_smoke", overrides).sparsity.threshold
    tails = {b: t["min"] for b, t in tail_per_bin(rows, "p5").items()}
    assert any(v < threshold for v in tails.values()), tails


def test_dense_rollout_matches_the_policy_token_by_token(smoke_overrides, tmp_path: Path) -> None:
    config = load_config(
        "tiny_cpu_short_smoke",
        [
            *smoke_overrides,
            "sparsity.schedule=dense",
            "control.scheduler.adapt='off'",
            "trainer.max_steps=2",
            "checkpoint.enabled=false",
            "logging.plots=false",
            "evaluation.num_prompts=8",
        ],
    )
    _, rows = _train(config, tmp_path)
    for row in rows:  # step 1 runs after a policy update and the engine refit
        assert row["acceptance/p5"] > 0.999, row
        assert row["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)


def test_kl_penalty_to_the_initial_policy(smoke_overrides, tmp_path: Path) -> None:
    # the reference is the warm-started policy: the k3 KL is 0 at the first update and grows after it
    config = load_config(
        "tiny_cpu_short_smoke",
        [
            *smoke_overrides,
            "grpo.loss.kl_coef=0.05",
            "grpo.mini_batches_per_step=1",  # the whole of step 0 is the first update
            "trainer.max_steps=2",
            "checkpoint.enabled=false",
            "logging.plots=false",
            "evaluation.num_prompts=8",
        ],
    )
    _, rows = _train(config, tmp_path)
    assert [row["step"] for row in rows] == [0, 1]
    assert rows[0]["train/kl"] == pytest.approx(0.0, abs=1e-7)
    assert rows[1]["train/kl"] > 1e-6, rows[1]


def test_mini_batches_make_the_ppo_ratio_and_clip_real(smoke_overrides, tmp_path: Path) -> None:
    # old logprobs come from the step's starting weights: one update per step is exactly on-policy, with four
    # the later mini-batches see moved weights and some tokens leave the clip range (a narrow one, +-2 %: at the
    # recipe's 0.2 / 0.28 whether any token of two steps leaves it depends on the samples)
    common = [
        *smoke_overrides,
        "grpo.loss.clip_low=0.02",
        "grpo.loss.clip_high=0.02",
        "trainer.max_steps=2",
        "checkpoint.enabled=false",
        "logging.plots=false",
        "evaluation.num_prompts=8",
    ]
    _, one = _train(
        load_config("tiny_cpu_short_smoke", [*common, "grpo.mini_batches_per_step=1"]), tmp_path / "m1"
    )
    _, four = _train(
        load_config("tiny_cpu_short_smoke", [*common, "grpo.mini_batches_per_step=4"]), tmp_path / "m4"
    )
    for row in one:
        assert row["train/optimizer_steps"] == 1.0
        assert row["train/clip_fraction"] == 0.0
        assert row["train/ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert row["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    for row in four:
        assert row["train/optimizer_steps"] == 4.0
        assert row["train/ratio_min"] < 0.95 or row["train/ratio_max"] > 1.05, row
    assert max(row["train/clip_fraction"] for row in four) > 0.0, four


def test_two_tensor_parallel_ranks_match_one_rank(smoke_overrides, tmp_path: Path) -> None:
    # torchrun, 2 gloo ranks, TP=2: rank 0 samples and broadcasts, both ranks score and train
    overrides = [
        *smoke_overrides,
        "trainer.max_steps=1",
        "checkpoint.enabled=false",
        "logging.plots=false",
        "evaluation.num_prompts=8",
    ]
    env = env_without_launcher()
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "sparrow_nemo.cli"]
    args = ["train", "--config", "tiny_cpu_short_smoke", "--run-dir", str(tmp_path / "tp2")]
    done = subprocess.run(
        [*command, *args, *overrides, "policy.tensor_model_parallel_size=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (two,) = read_metrics(tmp_path / "tp2" / "metrics.jsonl")[-1:]
    _, (one,) = _train(load_config("tiny_cpu_short_smoke", overrides), tmp_path / "tp1")
    assert two["reward/mean"] == one["reward/mean"]  # same rollouts: same weights in the engine
    for key in ("acceptance/mean", "train/entropy", "train/loss"):
        assert two[key] == pytest.approx(one[key], abs=1e-4), key
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-3)
