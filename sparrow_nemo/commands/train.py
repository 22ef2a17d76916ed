"""``sparrow train``: GRPO with sparse rollouts (no --config: the embedded tiny CPU recipe)."""

from __future__ import annotations

import argparse
import logging

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "train"
HELP = "GRPO training with sparse rollouts (no --config: the tiny CPU recipe)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        default=None,
        help="output folder (default: <logging.run_dir or runs>/<name>-<timestamp>)",
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from sparrow_nemo.grpo.setup import rank
    from sparrow_nemo.grpo.summary import format_summary
    from sparrow_nemo.grpo.trainer import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    summary, run_dir = train(config, args.run_dir)
    if rank() == 0:
        print(f"\nrun folder: {run_dir}\n{format_summary(summary)}")
    return 0
