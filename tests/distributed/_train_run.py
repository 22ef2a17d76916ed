"""``sparrow train`` of a recipe that also saves the final policy weights (HF names) for comparison.

Run under torchrun (``torchrun --nproc_per_node=4 tests/distributed/_train_run.py RUN_DIR RECIPE [k=v ...]``)
or called in-process on one rank (:func:`train_and_export`). Rank 0 writes ``RUN_DIR/final_weights.pt``; every
rank writes ``RUN_DIR/refit_rank<r>.json``: the largest difference between its engine's weights and the
policy's after the run (the last refit), over every HF tensor (its shard of each, for a tensor-parallel engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from sparrow_nemo.callbacks import Callback
from sparrow_nemo.grpo import setup, world
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import start_checkpoint
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.sparse.schedule import BudgetSchedule

WEIGHTS = "final_weights.pt"


class ScheduleBump(Callback):
    """A user callback (rank 0 only) that raises every budget by one page after step 0: the next rollouts,
    on every rank, must use the new schedule (the trainer hands rank 0's schedule to all ranks)."""

    def on_train_batch_end(self, trainer, report, metrics) -> None:
        if report.step == 0:
            s = trainer.schedule
            budgets = tuple(b + s.page_size for b in s.budgets)
            trainer.schedule = BudgetSchedule(s.bin_tokens, budgets, s.page_size, name="bumped")
            trainer.log({"bumped": 1.0})


def torchrun_train(run_dir: Path, recipe: str, overrides: list[str], nproc: int, timeout: float) -> None:
    """:func:`train_and_export` on ``nproc`` gloo ranks under torchrun (one torch thread each, a free port);
    a failed run fails the calling test with the end of its stderr."""
    from policy._helpers import free_port

    from sparrow_nemo.grpo.world import env_without_launcher

    env = env_without_launcher()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), f"--nproc_per_node={nproc}", f"--master_port={free_port()}", __file__]
    done = subprocess.run(
        [*command, str(run_dir), recipe, *overrides], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]


def train_and_export(run_dir: Path, recipe: str, overrides: list[str]) -> None:
    """Train ``recipe`` with ``overrides`` into ``run_dir`` and save the final weights there (rank 0)."""
    config = load_config(recipe, overrides)
    world.start_processes(config.trainer.dist_timeout_minutes)
    setup.apply_cpu_threads(config)
    trainer = GrpoTrainer(config, run_dir, start_checkpoint(config, show_progress=False))
    try:
        trainer.fit()
        weights = trainer.policy.export_hf()
        model = trainer.rollout_engine.model
        engine, tp = model.params, model.tensor_parallel
        weights_held = {
            n: w if tp is None else tp.shard(n, w) for n, w in weights.items()
        }  # the engine's shard
        gap = max(
            float((engine[n].float() - w.float()).abs().max()) for n, w in weights_held.items() if n in engine
        )
        names = sorted(set(weights) & set(engine))
        refit = {"max_abs_diff": gap, "tensors": len(names)}
        (Path(run_dir) / f"refit_rank{world.rank()}.json").write_text(json.dumps(refit))
        if world.rank() == 0:
            torch.save(weights, Path(run_dir) / WEIGHTS)
    finally:
        trainer.policy.close()


if __name__ == "__main__":
    train_and_export(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
