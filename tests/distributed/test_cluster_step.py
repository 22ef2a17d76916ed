"""The cluster RL step on 4 gloo ranks equals the one-rank step (issue 15's "done when").

``torchrun --nproc_per_node=4`` runs 2 GRPO steps of the smoke recipe (8 prompts x 8 samples, warm-started)
at DP4, TP2 x DP2 and PP2 x DP2, every rank with its own rollout engine; the same recipe runs on one rank
in-process. Checked per step against the one-rank run:

- the same samples: reward, accuracy, response lengths and token counts exactly (per-sample seeds by global
  index; the engine's samples do not depend on their batch mates), and each rank generated its quarter
  (``rollout/tokens_rank_<r>``, summing to ``rollout/tokens``);
- the same statistics up to float reduction order: acceptance tails and means, entropy, grad norm, clip and
  ratio metrics to rel 1e-4 (TP splits the vocab reductions, padding widths differ per replica); the
  loss and the log-ppl difference, values near 0, to abs 1e-6;
- the same final weights: every tensor within rel 1e-4 of the one-rank run (L2) and 1e-3 of it element-wise
  (one Adam step moves an element by at most ~lr = 1e-3; a gradient element near 0 may change sign);
- every rank's engine holds exactly the policy's final weights (the refit reached all of them);
- ``checkpoint.save_hf`` wrote the final weights once, as an HF folder ``hf`` with exactly them (the gathers
  of every layout; rank 0 writes, no staging folder left);
- a user callback (rank 0 only) that changes the schedule after step 0 changes it for every rank's step-1
  rollouts (``ScheduleBump``; step 1 would differ otherwise).

``sparsity/predicted_speedup`` is per engine batch (the slowest engine's), so it is not compared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from policy._helpers import single_rank_env
from safetensors.torch import load_file

from distributed._train_run import WEIGHTS, torchrun_train, train_and_export
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.warmstart import ensure_warm_start
from sparrow_nemo.run_io.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

RECIPE = "tiny_cpu_short_smoke"
OVERRIDES = [
    "trainer.max_steps=2",
    "evaluation.num_prompts=8",
    "logging.plots=false",
    "checkpoint.enabled=false",
    "checkpoint.save_hf=true",
    "callbacks=[{_target_: distributed._train_run.ScheduleBump}]",
]
LAYOUTS = {
    "dp4": [],
    "tp2_dp2": ["policy.tensor_model_parallel_size=2"],
    "pp2_dp2": ["policy.pipeline_model_parallel_size=2"],
}
EXACT = ("reward/mean", "reward/accuracy", "response_length/", "rollout/tokens", "acceptance/tokens/")
NEAR_ZERO = ("train/loss", "rollout_is/log_ppl_diff")
NOT_COMPARED = (
    "timing/",
    "rollout/tokens_per_s",
    "rollout/tokens_rank_",
    "sparsity/predicted_speedup",
    "time",
)
#: each 4-rank run under torchrun, seconds (4 processes on 2 loaded cores: ~40 s measured idle)
TIMEOUT = 900


@pytest.fixture(scope="module")
def cache_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The smoke recipe's warm-start, trained once into $SPARROW_CACHE (or a temporary cache)."""
    overrides = (
        [] if os.environ.get("SPARROW_CACHE") else [f"warmstart.cache_dir={tmp_path_factory.mktemp('ws')}"]
    )
    config = load_config(RECIPE, overrides)
    with single_rank_env():
        ensure_warm_start(config, build_prompt_source(config), show_progress=False)
    return overrides


@pytest.fixture(scope="module")
def one_rank(cache_overrides, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_rank")
    with single_rank_env():
        train_and_export(run_dir, RECIPE, [*OVERRIDES, *cache_overrides])
    return run_dir


def _torchrun(run_dir: Path, overrides: list[str]) -> None:
    torchrun_train(run_dir, RECIPE, overrides, nproc=4, timeout=TIMEOUT)


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_four_ranks_give_the_one_rank_step(layout, one_rank, cache_overrides, tmp_path) -> None:
    run_dir = tmp_path / layout
    _torchrun(run_dir, [*OVERRIDES, *cache_overrides, *LAYOUTS[layout]])
    ones, fours = _rows(one_rank), _rows(run_dir)
    assert [r["step"] for r in fours] == [r["step"] for r in ones] == [0, 1]
    assert ones[1]["sparsity/budget/bin_0"] == ones[0]["sparsity/budget/bin_0"] + 4  # bumped by one page
    for one, four in zip(ones, fours):
        compared = [k for k in one if not k.startswith(NOT_COMPARED)]
        assert sorted(compared) == sorted(k for k in four if not k.startswith(NOT_COMPARED))
        for key in compared:
            if key.startswith(EXACT):
                assert four[key] == one[key], (layout, one["step"], key)
            elif key.startswith(NEAR_ZERO):
                assert four[key] == pytest.approx(one[key], abs=1e-6), (layout, one["step"], key)
            else:
                assert four[key] == pytest.approx(one[key], rel=1e-4, abs=1e-9), (layout, one["step"], key)
        assert four.get("callbacks/ScheduleBump/bumped") == one.get("callbacks/ScheduleBump/bumped")
        shares = [four[f"rollout/tokens_rank_{r}"] for r in range(4)]
        assert sum(shares) == four["rollout/tokens"] and "rollout/tokens_rank_4" not in four
        for share in shares:  # 2 of the step's 8 prompts (16 samples) on every rank's engine
            assert 0.15 < share / four["rollout/tokens"] < 0.35, shares
    a, b = torch.load(one_rank / WEIGHTS), torch.load(run_dir / WEIGHTS)
    assert sorted(a) == sorted(b)
    for name, want in a.items():
        got = b[name]
        assert float((got - want).norm() / want.norm()) < 1e-4, name
        assert float((got - want).abs().max()) < 1e-3, name
    for folder in (one_rank, run_dir):
        saved = load_file(str(folder / "hf" / "model.safetensors"))
        weights = torch.load(folder / WEIGHTS)
        assert sorted(saved) == sorted(weights) and all(torch.equal(saved[n], weights[n]) for n in weights)
        assert not [p.name for p in folder.iterdir() if p.name.startswith("hf.")]
    for rank in range(4):
        refit = json.loads((run_dir / f"refit_rank{rank}.json").read_text())
        assert refit["tensors"] == len(a) and refit["max_abs_diff"] == 0.0, (rank, refit)
