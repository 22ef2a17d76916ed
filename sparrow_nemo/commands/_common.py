"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

from sparrow_nemo.config import DEFAULT_RECIPE
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config RECIPE`` and trailing ``KEY=VALUE`` overrides."""
    parser.add_argument(
        "--config",
        metavar="RECIPE",
        default=None,
        help=f"recipe YAML path or shipped recipe name (default: {DEFAULT_RECIPE})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides after the options: a.b=value sets a key, +a.b=value adds one, ++a.b=value adds or sets",
    )


def config_from_args(args: argparse.Namespace) -> SparrowConfig:
    """The resolved recipe named by ``--config`` plus the overrides (ConfigError on a bad one)."""
    return load_config(args.config, args.overrides)
