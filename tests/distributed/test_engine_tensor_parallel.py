"""GRPO with tensor-parallel rollout engines (``rollout.tensor_parallel_size=2``, torch backend) on 2 gloo ranks.

``torchrun --nproc_per_node=2`` runs 2 steps of the smoke recipe at policy TP2 with one engine sharded over both
ranks (from a random HF checkpoint of the recipe's model, not the warm-start, which would train for minutes;
calibration on, so the ranks of rank 0's engine calibrate together; and once in speculative mode with
DistillSparse probing every step, the recipe's budgets uncalibrated: drafts with the sharded adapter, the planner fed by rank 0's samples, the probe
run by both ranks); the same recipe runs on one rank in-process with a whole engine. Every engine call is made
by both ranks with the same arguments (generate, score, the CPU cost fit's timed steps, calibration, evaluation,
the probe); rank 0 keeps the samples. Checked against the one-rank run:

- the calibrated schedule and each step's samples: reward, accuracy, response lengths, token counts exactly
  (the TP2 engine samples what the whole engine samples), and only rank 0 reports rollout tokens; the
  speculative statistics and the probe's tails to float32 precision (up to the first adapter update, which
  differs between the runs on the policy's side);
- the evaluations: accuracy and lengths exactly (counted once, by the engine's leader);
- each rank's engine holds exactly its shard of the policy's final weights (the refit sent each rank its own
  megatron shard: no all-gather).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from policy._helpers import make_hf_checkpoint, single_rank_env

from distributed._train_run import torchrun_train, train_and_export
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.run_io.metrics import read_metrics

pytestmark = pytest.mark.multiproc

RECIPE = "tiny_cpu_short_smoke"
OVERRIDES = [
    "warmstart.enabled=false",
    "trainer.max_steps=2",
    "grpo.prompts_per_step=4",
    "evaluation.num_prompts=8",
    "control.calibrate=true",
    "control.calibration.num_prompts=4",
    "control.calibration.samples_per_prompt=2",
    "logging.plots=false",
    "logging.tensorboard=false",
    "checkpoint.enabled=false",
]
TP2 = ["policy.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=2"]
MODES = {
    "sparse": [],
    # fixed cost constants: both runs plan alike (each would fit its own to this CPU)
    "speculative_distill": [
        "rollout.mode=speculative",
        "rollout.cost_hardware=h200",
        "distill.enabled=true",
        "distill.probe_every=1",
        "distill.steps=1",
        "control.calibration.samples_per_prompt=1",
        "control.calibrate=false",  # a calibration of this random model keeps every bin dense: nothing to draft
    ],
}
EXACT = ("reward/", "response_length/", "rollout/tokens", "sparsity/budget/", "calibration/budget/")
#: the 2-rank run under torchrun, seconds (2 processes on 2 loaded cores: ~30 s measured idle)
TIMEOUT = 600


def _rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_tp2_engines_train_like_one_rank(mode: str, tmp_path: Path) -> None:
    start = make_hf_checkpoint(load_config(RECIPE).model.shape(), tmp_path / "hf")
    overrides = [*OVERRIDES, *MODES[mode], f"model.hf_checkpoint={start}"]
    with single_rank_env():
        train_and_export(tmp_path / "one", RECIPE, overrides)
    torchrun_train(tmp_path / "two", RECIPE, [*overrides, *TP2], nproc=2, timeout=TIMEOUT)

    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    steps = [-1, 0, 1] if mode == "sparse" else [0, 1]  # the calibration's row, then the steps
    assert [r["step"] for r in two] == [r["step"] for r in one] == steps
    # with DistillSparse, the adapter trained after step 0 differs between the runs (Adam's first step on
    # ~1e-5 gradients moves each element by ~lr whatever its float noise: a policy-side difference, see
    # tests/policy/test_lora_tp.py), so the rollouts are compared up to it
    last = 1 if mode == "sparse" else 0
    for a, b in zip(one, two):
        if a["step"] > last:
            continue
        compared = [k for k in a if k.startswith(EXACT) and not k.startswith("rollout/tokens_")]
        assert compared, a["step"]
        for key in compared:
            assert b[key] == a[key], (mode, a["step"], key, a[key], b[key])
        for key in (k for k in a if k.startswith(("spec/", "distill/p5_before/"))):  # float32 math
            assert b[key] == pytest.approx(a[key], rel=1e-5), (mode, a["step"], key)
    assert any(k.startswith("spec/") for k in two[-1]) == (mode != "sparse")
    for row in two[-2:]:
        assert row["rollout/tokens_rank_0"] == row["rollout/tokens"] and row["rollout/tokens_rank_1"] == 0
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("one", "two")]
    for tag in ("start", "start_dense", "end", "end_dense")[: 4 if mode == "sparse" else 2]:
        evals = [s["evals"][tag] for s in summaries]
        for key in ("accuracy", "response_length_mean", "prompts"):
            assert evals[1][key] == evals[0][key], (tag, key)
    for rank in range(2):
        refit = json.loads((tmp_path / "two" / f"refit_rank{rank}.json").read_text())
        assert refit["max_abs_diff"] == 0.0, (rank, refit)
