"""The ``sparrow`` command line: ``sparrow <command> [--config RECIPE] [KEY=VALUE ...]``.

Subcommands live in :mod:`sparrow_nemo.commands` (one module each). A :class:`ConfigError`, a
missing optional package, or bad input (``ValueError`` / ``FileNotFoundError`` naming the file, tensor or
key) is reported as one line on stderr with exit status 2, no traceback; ``SPARROW_DEBUG=1`` shows the
traceback of bad-input errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import sparrow_nemo
from sparrow_nemo import commands
from sparrow_nemo._optional import MissingOptionalDependency
from sparrow_nemo.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command module."""
    parser = argparse.ArgumentParser(
        prog="sparrow",
        description="GRPO for Qwen3 thinking models with sparse rollouts (the Sparrow method).",
        epilog="Overrides follow NeMo/Hydra: sparsity.threshold=0.88, ++reward.options.key=value. "
        "See 'sparrow <command> --help'.",
    )
    parser.add_argument("--version", action="version", version=f"sparrow {sparrow_nemo.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in commands.discover():
        sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparrow`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, MissingOptionalDependency) as exc:
        print(str(exc) if isinstance(exc, ConfigError) else f"sparrow {args.command}: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("SPARROW_DEBUG"):
            raise
        print(f"sparrow {args.command}: {exc} (SPARROW_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
