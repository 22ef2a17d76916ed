"""rollout.mode=speculative on 2 gloo ranks (each rank's engine speculates on its half of the step) equals one rank.

``torchrun --nproc_per_node=2`` runs 2 GRPO steps of the smoke recipe (warm-started) speculatively at DP2; the
same runs in-process on one rank. Checked:

- step 0 and step 1 draw the same samples as the one-rank run (reward, accuracy, lengths, token counts exactly):
  per-sample seeds by global index, and at step 1 every rank drafts with the plan made from *all* ranks'
  acceptance (a plan from rank 0's half alone would draw other samples);
- both ranks' planners end with one acceptance table and one plan, equal to the one-rank plan; the table's
  test counts equal the one-rank table's and its alpha sums agree to rel 1e-5 (each alpha is float32 math
  in a batch of another size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from policy._helpers import free_port, single_rank_env

from rollout._spec_ranks_run import RECIPE, train_speculative
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.warmstart import ensure_warm_start
from sparrow_nemo.grpo.world import env_without_launcher
from sparrow_nemo.run_io.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

OVERRIDES = [
    "trainer.max_steps=2",
    "evaluation.num_prompts=4",
    "logging.plots=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "checkpoint.enabled=false",
    # fixed constants: both runs plan alike (each would fit its own to this CPU, and rightly stop speculating
    # at these ~30-token contexts)
    "rollout.cost_hardware=h200",
]
EXACT = (
    "reward/mean",
    "reward/accuracy",
    "response_length/mean",
    "response_length/median",
    "response_length/max",
    "rollout/tokens",
)
#: the 2-rank run under torchrun, seconds (2 processes on 2 loaded cores)
TIMEOUT = 900


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 0]


def _planner(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"planner_rank{rank}.json").read_text())


def test_two_ranks_speculate_like_one(tmp_path: Path) -> None:
    cache = [] if os.environ.get("SPARROW_CACHE") else [f"warmstart.cache_dir={tmp_path / 'ws'}"]
    overrides = [*OVERRIDES, *cache]
    config = load_config(RECIPE, ["rollout.mode=speculative", *overrides])
    with single_rank_env():
        ensure_warm_start(config, build_prompt_source(config), show_progress=False)
        train_speculative(tmp_path / "one", overrides)
    env = env_without_launcher()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    torchrun = Path(sys.executable).parent / "torchrun"
    script = Path(__file__).with_name("_spec_ranks_run.py")
    command = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", str(script)]
    done = subprocess.run(
        [*command, str(tmp_path / "two"), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-4000:]

    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["step"] for r in two] == [0, 1]
    for a, b in zip(one, two):
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["spec/accept_rate"] is not None  # rank 0's share
    p0, p1, ref = _planner(tmp_path / "two", 0), _planner(tmp_path / "two", 1), _planner(tmp_path / "one", 0)
    assert p0 == p1  # one table, one plan on every rank
    assert p0["plan"] is not None  # the same plan; its predicted gains from float32 alphas of other batches
    assert {k: v for k, v in p0["plan"].items() if k != "predicted"} == {
        k: v for k, v in ref["plan"].items() if k != "predicted"
    }
    assert p0["plan"]["predicted"] == pytest.approx(ref["plan"]["predicted"], rel=1e-6)
    cells = {(b, budget): (s, n) for b, budget, s, n in p0["table"]["cells"]}
    ref_cells = {(b, budget): (s, n) for b, budget, s, n in ref["table"]["cells"]}
    assert cells.keys() == ref_cells.keys()
    for key, (s, n) in ref_cells.items():  # alpha is float32 from batches of other sizes: rel 1e-5
        assert cells[key][1] == n and cells[key][0] == pytest.approx(s, rel=1e-5)
