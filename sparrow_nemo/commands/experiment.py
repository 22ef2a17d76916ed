"""``sparrow experiment``: the toy-scale evidence run (issue 10): every arm x seed, then the report.

Arms are config overrides on the base recipe, listed in an arms file (default
``experiments/tiny_arms.yaml``); see :mod:`sparrow_nemo.experiments`. Finished runs are skipped, so an
interrupted experiment resumes where it stopped; ``--report-only`` rebuilds the report from the run folders.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

NAME = "experiment"
HELP = "run the toy-scale experiment (arms x seeds of GRPO runs) and write its report"
DEFAULT_ARMS = "experiments/tiny_arms.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="RECIPE", default="tiny_cpu", help="base recipe (default: tiny_cpu)"
    )
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"arms file (default: {DEFAULT_ARMS})")
    parser.add_argument(
        "--seeds", type=int, default=1, help="seeds per arm: rollout.seed = 0 .. N-1 (default: 1)"
    )
    parser.add_argument("--out", default="experiments", help="output folder (default: experiments)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once, one process each (default 1; 2 fills a 2-core CPU)"
    )
    parser.add_argument("--smoke", action="store_true", help="the arms file's cut-down pipeline check")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from existing runs")
    parser.add_argument("--note", default="", help="a line shown at the top of the report")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="overrides for every arm (after the arm's own)"
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparrow_nemo.experiments.arms import ArmsError, load_arms
    from sparrow_nemo.experiments.pipeline import run_experiment

    if args.seeds < 1 or args.jobs < 1:
        print(
            f"sparrow experiment: --seeds {args.seeds} / --jobs {args.jobs} - expected at least 1",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    words = ["sparrow", NAME, "--config", args.config, "--arms", args.arms, "--seeds", str(args.seeds)]
    words += ["--out", args.out, *(["--smoke"] if args.smoke else []), *args.overrides]
    command = " ".join(shlex.quote(w) for w in words)
    try:
        spec = load_arms(args.arms)
        paths = run_experiment(
            args.config,
            spec,
            list(range(args.seeds)),
            Path(args.out),
            command=command,
            extra=args.overrides,
            smoke=args.smoke,
            report_only=args.report_only,
            note=args.note,
            jobs=args.jobs,
        )
    except (ArmsError, FileNotFoundError) as exc:
        print(f"sparrow experiment: {exc}", file=sys.stderr)
        return 2
    print(f"report: {paths.report}\nfigures: {paths.plots}\nresults: {paths.results}\nruns: {paths.runs}")
    return 0
