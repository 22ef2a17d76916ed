"""``sparrow train``: GRPO with sparse rollouts (issue 6)."""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args, not_implemented

NAME = "train"
HELP = "GRPO training with sparse rollouts (no --config: the tiny CPU recipe)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config_from_args(args)
    return not_implemented(NAME, issue=6)
