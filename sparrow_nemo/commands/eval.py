"""``sparrow eval``: evaluate a policy on a prompt set (issue 8)."""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args, not_implemented

NAME = "eval"
HELP = "evaluate a policy (dense or sparse rollout) on data.val_path"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config_from_args(args)
    return not_implemented(NAME, issue=8)
