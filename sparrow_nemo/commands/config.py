"""``sparrow config show``: print the resolved recipe (defaults merged, overrides applied, validated).

``--doc`` puts each key's doc string above it as a comment: the text the component that owns the knob
declares (:func:`sparrow_nemo.config.schema.knob`), the one place it is written.
"""

from __future__ import annotations

import argparse
import sys

from sparrow_nemo.commands._common import add_config_arguments, config_from_args
from sparrow_nemo.config.docs import documented_yaml

NAME = "config"
HELP = "inspect recipes: 'config show' prints the resolved config as YAML ('--doc': with every key's doc)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the resolved config (a valid recipe) and its hash",
        description="Print the resolved config as YAML; the first line is a comment with its hash.",
    )
    show.add_argument("--doc", action="store_true", help="a comment with each key's doc string above it")
    add_config_arguments(show)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    body = documented_yaml(config) if args.doc else config.to_yaml()
    sys.stdout.write(f"# sparrow config '{config.name}', hash {config.hash()}\n{body}")
    return 0
