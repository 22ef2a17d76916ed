"""Run every arm x seed of an experiment as a normal GRPO run, each in its own folder; resumable.

Layout under the runs folder: ``<arm>/seed_<s>/`` holds the trainer's own files (``config.yaml``,
``metrics.jsonl``, ``summary.json`` ...) plus ``experiment_run.json`` (arm, seed, wall and CPU seconds).
A run is done when its folder has ``summary.json``: a second invocation skips it. A run is made in
``seed_<s>.partial/`` and renamed when it finishes, so an interrupted run leaves no folder that looks done
(a stale ``.partial`` is removed and the run starts over). A done folder whose ``config.yaml`` differs from
the config the arms file now gives, in any knob, is an error, not silently reused; a knob added since the
run was made counts as equal at its default (a new knob's default is the behaviour before it existed), so
adding knobs keeps old runs usable.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from sparrow_nemo.config.compose import dotted_leaves
from sparrow_nemo.config.yaml_io import YamlProblem, load_yaml
from sparrow_nemo.experiments.arms import Arm, ArmsError, ArmsSpec, arm_config
from sparrow_nemo.grpo.recipe import SparrowConfig
from sparrow_nemo.grpo.world import one_rank_world

__all__ = ["RUN_RECORD", "RunPlan", "execute", "plan_runs", "run_folder"]

logger = logging.getLogger(__name__)

#: Written into each finished run folder by the runner.
RUN_RECORD = "experiment_run.json"


@dataclass(frozen=True)
class RunPlan:
    """One arm/seed run: its resolved config and its folder."""

    arm: Arm
    seed: int
    config: SparrowConfig
    folder: Path

    @property
    def done(self) -> bool:
        """True when the folder holds a finished run (its summary)."""
        return (self.folder / "summary.json").is_file()


def run_folder(root: Path, arm: str, seed: int) -> Path:
    """The folder of arm ``arm`` with seed ``seed`` under the experiment's runs folder ``root``."""
    return Path(root) / arm / f"seed_{seed}"


_MISSING = object()


def config_drift(stored_text: str, config: SparrowConfig) -> str | None:
    """How a finished run's ``config.yaml`` differs from ``config``, knob by knob, else None.

    A knob the stored file lacks matches when ``config`` holds its default (added after the run); one
    ``config`` lacks (removed since) never matches. Returns the first difference as ``key: stored -> now``.
    """
    try:
        stored = load_yaml(stored_text)
    except YamlProblem as problem:
        return f"config.yaml is not YAML ({problem.problem})"
    if not isinstance(stored, dict):
        return "config.yaml is not a mapping"
    old, now = dotted_leaves(stored), dotted_leaves(config.to_dict())
    default = dotted_leaves(SparrowConfig().to_dict())
    for key, value in now.items():
        before = old.get(key, _MISSING)
        if before is _MISSING and default.get(key, _MISSING) != value:
            return f"{key}: absent -> {value!r}, not a default"
        if before is not _MISSING and before != value:
            return f"{key}: {before!r} -> {value!r}"
    removed = sorted(set(old) - set(now))
    return f"{removed[0]}: no longer a knob" if removed else None


def plan_runs(
    recipe: str | Path | None,
    spec: ArmsSpec,
    seeds: Sequence[int],
    root: Path,
    extra: Sequence[str] = (),
    smoke: bool = False,
) -> list[RunPlan]:
    """Every arm x seed of the experiment with its config (all resolved before any run starts).

    Raises ArmsError for an invalid override, or for a finished folder made with another config.
    """
    plans = []
    for arm in spec.selected(smoke):
        for seed in arm.seeds_for(seeds, smoke):
            config = arm_config(recipe, spec, arm, seed, extra, smoke)
            plan = RunPlan(arm, seed, config, run_folder(root, arm.name, seed))
            drift = config_drift((plan.folder / "config.yaml").read_text(), config) if plan.done else None
            if drift is not None:
                raise ArmsError(
                    f"run folder {plan.folder} was made with another config than arm {arm.name} now gives "
                    f"({drift}); delete it (or use another --out) to rerun it"
                )
            plans.append(plan)
    return plans


def _run_one(plan: RunPlan) -> None:
    """Train one run into ``<folder>.partial`` and rename it to ``<folder>`` when it finishes."""
    from sparrow_nemo.grpo.start import train

    partial = plan.folder.with_name(plan.folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    with one_rank_world():
        train(plan.config, partial)
    record = {
        "arm": plan.arm.name,
        "role": plan.arm.role,
        "seed": plan.seed,
        "wall_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (partial / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    partial.rename(plan.folder)


def execute(plans: Sequence[RunPlan], show_progress: bool = True, jobs: int = 1) -> int:
    """Run every plan that is not done, with a bar over all of them; returns how many ran.

    ``jobs`` = 1 runs them in order in this process (rank 0 of a one-rank world per run); more runs up to
    ``jobs`` of them at once, each in its own spawned process (its own one-rank world and torch threads,
    ``trainer.cpu_threads``), so a 2-core machine can keep both cores busy. Under torchrun/srun with more
    ranks: ValueError.
    """
    from sparrow_nemo.run_io.progress import progress

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("sparrow experiment runs in one process; start it without torchrun/srun")
    if jobs < 1:
        raise ValueError(f"sparrow experiment: jobs must be >= 1, got {jobs}")
    todo = [p for p in plans if not p.done]
    if len(todo) < len(plans):
        logger.info("experiment: %d of %d runs already done, skipped", len(plans) - len(todo), len(plans))
    bar = progress(total=len(todo), enabled=show_progress, desc="experiment", unit="run")
    if jobs == 1:
        for plan in todo:
            bar.set_postfix_str(f"{plan.arm.name} seed {plan.seed}")
            _run_one(plan)
            bar.update(1)
        bar.close()
        return len(todo)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_one, plan): plan for plan in todo}
        for future in as_completed(futures):
            future.result()  # a failed run stops the experiment with its error
            plan = futures[future]
            bar.set_postfix_str(f"{plan.arm.name} seed {plan.seed} done")
            bar.update(1)
    bar.close()
    return len(todo)
