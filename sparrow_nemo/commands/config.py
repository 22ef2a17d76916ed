"""``sparrow config show``: print the resolved recipe (defaults merged, overrides applied, validated)."""

from __future__ import annotations

import argparse
import sys

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "config"
HELP = "inspect recipes: 'config show' prints the resolved config as YAML"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the resolved config (a valid recipe) and its hash",
        description="Print the resolved config as YAML; the first line is a comment with its hash.",
    )
    add_config_arguments(show)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    sys.stdout.write(f"# sparrow config '{config.name}', hash {config.hash()}\n{config.to_yaml()}")
    return 0
