"""``rollout.mode`` in training: the mode wrapper, the planner and its metrics, and ``sparrow train`` end to end.

- ``RolloutModeEngine``: dense mode decodes every call densely; speculative mode speculates with the planner's
  plan on a sparse schedule and decodes densely on a dense one (the dense evaluations);
- ``SpeculativePlanner.observe``: the ``spec/*`` totals and per-bin metrics add up to the draft logs, the
  planner re-plans from them and its state survives a round trip;
- config: the new keys are checked (one-line errors);
- slow: ``sparrow train --config tiny_cpu_short_smoke rollout.mode=speculative`` runs end to end: spec metrics every
  step, the importance correction's ratio exactly 1, the summary line and the plots, and the planner's state in
  the checkpoint, restored on resume.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow_nemo.checkpoint.run_state import read_run_state
from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.setup import rollout_mode_engine
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.rollout_mode import RolloutModeEngine
from sparrow_nemo.rollout.tools.cost_fit import rollout_cost_model
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.spec_decode import SpeculativeSample
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

SHAPE = PRESETS["tiny-test"].replace(num_layers=3)
SCHEDULE = BudgetSchedule(bin_tokens=16, budgets=(16, 24), page_size=4, name="two-bins")


def _config(*overrides: str):
    return load_config(
        "tiny_cpu_short_smoke",
        ["sparsity.page_size=4", "sparsity.bin_tokens=16", "sparsity.dense_layers=1", *overrides],
    )


@pytest.fixture(scope="module")
def engine() -> TorchRolloutEngine:
    return TorchRolloutEngine.from_shape(
        SHAPE, seed=0, dense_layers=1, page_size=4, attention_backend="torch"
    )


def _wrap(config, engine: TorchRolloutEngine):
    """``engine`` in the recipe's rollout mode, on the recipe's cost model (fitted to this CPU)."""
    return rollout_mode_engine(
        config, engine, rollout_cost_model(config.rollout, config.sparsity, config.model.shape(), engine)
    )


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in (20, 35, 9, 44)]


SAMPLING = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=())


def test_dense_mode_decodes_every_call_densely(engine) -> None:
    wrapped = _wrap(_config("rollout.mode=dense"), engine)
    assert isinstance(wrapped, RolloutModeEngine) and wrapped.planner is None
    out = wrapped.generate(_prompts(), SAMPLING, SCHEDULE)
    assert all(bool((s.kv_budget == DENSE_BUDGET).all()) for s in out.samples)
    assert _wrap(_config(), engine) is engine  # sparse: the engine itself


def test_speculative_mode_and_its_planner(engine) -> None:
    wrapped = _wrap(_config("rollout.mode=speculative", "control.speculative.draft_tokens=3"), engine)
    planner = wrapped.planner
    assert planner.config_for(SCHEDULE).draft_tokens == (3, 3)
    out = wrapped.generate(_prompts(), SAMPLING, SCHEDULE)
    assert all(isinstance(s, SpeculativeSample) for s in out.samples)
    dense_eval = wrapped.generate(_prompts(), SAMPLING, BudgetSchedule.dense(16, 4))
    assert not any(isinstance(s, SpeculativeSample) for s in dense_eval.samples)

    m = planner.observe(out.samples, SCHEDULE)
    logs = [s.draft for s in out.samples]
    assert m["spec/draft_tokens"] == sum(d.drafted for d in logs) > 0
    assert m["spec/verify_steps"] == sum(d.verifies for d in logs)
    accepted = sum(int(d.accepted.sum()) for d in logs)
    assert m["spec/accepted_per_verify"] == pytest.approx(accepted / m["spec/verify_steps"])
    assert m["spec/accept_rate"] == pytest.approx(accepted / sum(d.accepted.numel() for d in logs))
    emitted = sum(s.response_ids.numel() - 1 for s in out.samples)  # the first token comes from the prefill
    assert m["spec/tokens_per_verify"] == pytest.approx(emitted / m["spec/verify_steps"])
    assert sum(int(d.round_emitted.sum()) for d in logs) == emitted
    for name in ("draft_tokens", "verify_steps"):
        per_bin = sum(v for k, v in m.items() if k.startswith(f"spec/{name}/bin_"))
        assert per_bin == m[f"spec/{name}"]
    assert sum(v for k, v in m.items() if k.startswith("spec/tests/bin_")) == sum(
        d.accepted.numel() for d in logs
    )
    assert m["spec/budget/bin_1"] == 24 and m["spec/k/bin_2"] == 3  # the plan used (last bin holds on)
    assert m["spec/predicted_speedup"] > 0 and m["spec/predicted_tokens_per_verify"] >= 1

    assert planner.plan is not None  # re-planned from the measured acceptance
    assert list(planner.plan.budgets) == sorted(planner.plan.budgets)
    assert set(planner.plan.budgets) <= set(planner.candidates)
    state = json.loads(json.dumps(planner.state_dict()))
    clone = _wrap(_config("rollout.mode=speculative"), engine).planner
    clone.load_state_dict(state)
    assert clone.plan == planner.plan and clone.table.sums == planner.table.sums
    assert planner.config_for(SCHEDULE).draft_schedule.budgets == planner.plan.budgets


def test_config_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.mode"):
        load_config("tiny_cpu_short_smoke", ["rollout.mode=fast"])
    with pytest.raises(ConfigError, match="draft_tokens"):
        load_config(
            "tiny_cpu_short_smoke",
            ["control.speculative.draft_tokens=9", "control.speculative.max_draft_tokens=8"],
        )
    with pytest.raises(ConfigError, match=r"rollout\.mode"):
        load_config("tiny_cpu_short_smoke", ["rollout.mode=speculative", "rollout.backend=trtllm"])


QUICK = [
    "trainer.max_steps=2",
    "evaluation.num_prompts=16",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "checkpoint.every_n_steps=1",
    # H200 constants: they speculate at these ~30-token contexts, where the ones fitted to this CPU rightly
    # re-plan to k = 0 (a draft step costs about as much as a dense step when per-step overhead dominates)
    "rollout.cost_hardware=h200",
]


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["train", "--config", "tiny_cpu_short_smoke", "--run-dir", str(run_dir), *QUICK, *overrides]
    done = subprocess.run(
        [sys.executable, "-m", "sparrow_nemo.cli", *args], capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_sparrow_train_speculative_end_to_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, "rollout.mode=speculative")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        for key in (
            "accept_rate",
            "accepted_per_verify",
            "draft_tokens",
            "verify_steps",
            "predicted_speedup",
        ):
            assert row[f"spec/{key}"] is not None, key
        assert any(k.startswith("spec/accept_rate/bin_") for k in row)
        # the importance correction sees the policy itself: every token's ratio is exp(0) = 1 exactly; the
        # metric sums float32 shares of the step's mean over micro-batches (grpo/update.py), so 1 to 1e-6
        assert row["train/rollout_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert row["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-6)
        assert row["rollout_is/log_ppl_diff"] == 0.0
    summary = (run / "summary.txt").read_text()
    assert "speculative rollout (lossless)" in summary and "speculative vs dense" in summary
    assert "last step's plan per bin: k [" in summary and "(h200 cost model)" in summary
    assert (run / "plots" / "speculative.png").is_file() and (
        run / "plots" / "speculative_tokens.png"
    ).is_file()
    trainer, callbacks = read_run_state(sorted((run / "checkpoints").glob("step_*"))[-1])
    assert trainer["step"] == 2 and callbacks["SpeculativePlanner"]["plan"] is not None
    resumed = _train(run, "rollout.mode=speculative", "trainer.max_steps=3")
    assert "resumed from" in resumed.stderr
