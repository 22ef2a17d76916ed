"""``sparrow train``: GRPO with sparse rollouts (no --config: the embedded tiny CPU recipe)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "train"
HELP = "GRPO training with sparse rollouts (no --config: the tiny CPU recipe)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        default=None,
        help="output folder (default: <logging.run_dir or runs>/<name>-<timestamp>); an existing one is "
        "resumed from its newest good checkpoint (checkpoint.resume=auto)",
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 aborted on non-finite updates, 2 bad config, input or no usable checkpoint,
    3 stopped by a signal after a checkpoint."""
    from sparrow_nemo.grpo.preemption import REQUEUE_EXIT, Preempted, StoppedDuringStartup, whole_run
    from sparrow_nemo.grpo.world import rank

    try:
        with whole_run() as stop_signals:  # from start-up on: no stop signal takes its default action
            status = _train(config_from_args(args), args)
    except (Preempted, StoppedDuringStartup) as stop:
        if rank() == 0:
            print(f"sparrow train: {stop}; exit {REQUEUE_EXIT} (requeue to continue)", file=sys.stderr)
        return REQUEUE_EXIT
    if status == 0 and stop_signals.signal_name is not None:  # it came during the final evaluation
        print(
            f"sparrow train: stopped by {stop_signals.signal_name} at the end of the run, which completed; "
            f"exit {REQUEUE_EXIT}",
            file=sys.stderr,
        )
        return REQUEUE_EXIT
    return status


def _check_resume(config, run_dir: str | None) -> None:
    """A resume whose checkpoints hold another model shape fails here, before the run folder is written."""
    from sparrow_nemo.checkpoint.run_state import resume_candidates
    from sparrow_nemo.policy.checkpoint import check_resume_shape

    if config.checkpoint.resume == "auto" and run_dir is None and config.checkpoint.dir is None:
        return  # a new run folder: nothing to resume
    root = Path(config.checkpoint.dir or Path(run_dir or ".") / "checkpoints")
    check_resume_shape(resume_candidates(config.checkpoint.resume, root), config.model.shape())


def _train(config, args: argparse.Namespace) -> int:
    """Exit status of the training itself (a stop signal propagates as Preempted)."""
    from sparrow_nemo.checkpoint.atomic import CheckpointError
    from sparrow_nemo.grpo.start import train
    from sparrow_nemo.grpo.trainer import NonFiniteTrainingError
    from sparrow_nemo.grpo.world import rank
    from sparrow_nemo.policy.train_step import NonFiniteWeightsError
    from sparrow_nemo.run_io.summary import format_summary

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        _check_resume(config, args.run_dir)
        summary, run_dir = train(config, args.run_dir)
    except CheckpointError as exc:
        print(f"sparrow train: {exc}", file=sys.stderr)
        return 2
    except (NonFiniteTrainingError, NonFiniteWeightsError) as exc:
        print(f"sparrow train: {exc}", file=sys.stderr)
        return 1
    if rank() == 0:
        print(f"\nrun folder: {run_dir}\n{format_summary(summary)}")
    return 0
