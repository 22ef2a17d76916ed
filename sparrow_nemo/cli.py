"""The ``sparrow`` command line: ``sparrow <command> [--config RECIPE] [KEY=VALUE ...]``.

Subcommands live in :mod:`sparrow_nemo.commands` (one module each). A :class:`ConfigError`, a
missing optional package, or bad input (``ValueError`` / ``FileNotFoundError`` naming the file, tensor or
key) is reported as one line on stderr with exit status 2, no traceback; so is a file system that cannot
take a write (full, over quota, read-only), naming the path. ``SPARROW_DEBUG=1`` shows the traceback of
bad-input and file-system errors.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
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
    except (ValueError, FileNotFoundError, OSError) as exc:
        line = str(exc) if isinstance(exc, ValueError | FileNotFoundError) else disk_failure(exc)
        if line is None or os.environ.get("SPARROW_DEBUG"):
            raise
        print(f"sparrow {args.command}: {line} (SPARROW_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


#: the errors of a file system that cannot take a write
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def disk_failure(exc: OSError) -> str | None:
    """One line for a write a full, over-quota or read-only file system refused, naming the path; None for
    any other OSError. ``shutil.copytree`` reports its files' errors together (``shutil.Error``): the first
    such one is named."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        for entry in exc.args[0]:
            if len(entry) == 3 and any(f"[Errno {code}]" in str(entry[2]) for code in _DISK_ERRORS):
                reason = str(entry[2]).split("] ", 1)[-1].split(": '", 1)[0]  # "[Errno 28] No space...: 'a'"
                return f"cannot write {entry[1]}: {reason}"
        return None
    if exc.errno not in _DISK_ERRORS:
        return None
    return f"cannot write {exc.filename or 'a file'}: {exc.strerror}"


if __name__ == "__main__":
    sys.exit(main())
