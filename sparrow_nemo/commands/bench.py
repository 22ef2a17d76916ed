"""``sparrow bench <target>``: throughput benchmarks (attention kernels: issue 4, rollout: issue 5)."""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args, not_implemented

NAME = "bench"
HELP = "benchmarks: 'bench attention' (sparse decode kernels), 'bench rollout' (tokens/s and tail)"

#: target -> (help line, issue that delivers it)
TARGETS: dict[str, tuple[str, int]] = {
    "attention": ("sparse vs dense decode attention time per step", 4),
    "rollout": ("dense vs sparse rollout tokens/s and the acceptance-rate tail per bin", 5),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for target, (text, _issue) in TARGETS.items():
        add_config_arguments(targets.add_parser(target, help=text, description=text))


def run(args: argparse.Namespace) -> int:
    config_from_args(args)
    return not_implemented(f"{NAME} {args.target}", issue=TARGETS[args.target][1])
