"""``sparrow train`` of the smoke recipe in ``rollout.mode=speculative``, then each rank's planner state.

Run under torchrun (``torchrun --nproc_per_node=2 tests/rollout/_spec_ranks_run.py RUN_DIR [k=v ...]``) or
called in-process on one rank (:func:`train_speculative`). Every rank writes ``RUN_DIR/planner_rank<r>.json``:
its engine's :class:`~sparrow_nemo.control.speculative.SpeculativePlanner` state after the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparrow_nemo.grpo import setup, world
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import start_checkpoint
from sparrow_nemo.grpo.trainer import GrpoTrainer

RECIPE = "tiny_cpu_short_smoke"


def train_speculative(run_dir: Path, overrides: list[str]) -> None:
    """Train the smoke recipe speculatively with ``overrides`` into ``run_dir``; write this rank's planner."""
    config = load_config(RECIPE, ["rollout.mode=speculative", *overrides])
    world.start_processes(config.trainer.dist_timeout_minutes)
    setup.apply_cpu_threads(config)
    trainer = GrpoTrainer(config, run_dir, start_checkpoint(config, show_progress=False))
    try:
        trainer.fit()
        state = trainer.rollout_engine.planner.state_dict()
        (Path(run_dir) / f"planner_rank{world.rank()}.json").write_text(json.dumps(state))
    finally:
        trainer.policy.close()


if __name__ == "__main__":
    train_speculative(Path(sys.argv[1]), sys.argv[2:])
