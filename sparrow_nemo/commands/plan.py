"""``sparrow plan``: the parallel layout and memory plan of a recipe (issue 3)."""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args, not_implemented

NAME = "plan"
HELP = "show the tensor/pipeline/data-parallel layout and memory plan of a recipe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config_from_args(args)
    return not_implemented(NAME, issue=3)
