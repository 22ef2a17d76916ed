"""``sparrow calibrate``: pick the sparsity schedule that meets ``sparsity.threshold`` on calibration prompts.

Builds the rollout engine from the recipe's model (``model.hf_checkpoint``, or the cached warm-start of
the synthetic task, trained first when missing), samples ``control.calibration.num_prompts`` held-out
prompts x ``samples_per_prompt`` sparse at every candidate budget, scores them dense, and writes the
per-bin table, the schedule YAML and the plot (:func:`sparrow_nemo.control.run_calibration`).
"""

from __future__ import annotations

import argparse
import logging

from sparrow_nemo.commands._common import add_config_arguments, config_from_args
from sparrow_nemo.config import ConfigError

NAME = "calibrate"
HELP = "calibrate a sparsity schedule: per-bin acceptance-rate tail for candidate budgets"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default: <logging.run_dir or runs>/<name>-<timestamp>/calibration)",
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from pathlib import Path

    from sparrow_nemo.control import run_calibration
    from sparrow_nemo.grpo import setup
    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.start import start_weights
    from sparrow_nemo.run_io.rundir import make_run_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    setup.apply_cpu_threads(config)
    source = build_prompt_source(config)
    s, c = config.sparsity, config.control.calibration
    items = source.eval_batch(c.num_prompts)
    if not items:
        raise ConfigError(
            f"sparrow calibrate: reward.type={config.reward.type} calibrates on held-out prompts: set "
            "data.val_path (the calibration never uses training prompts)"
        )
    weights = start_weights(config, source, config.logging.progress_bar)
    engine = setup.build_engine(config, weights, source.tokenizer)
    out = Path(args.out) if args.out else make_run_dir(config) / "calibration"
    prompts = [item.prompt_ids for item in items for _ in range(c.samples_per_prompt)]
    result = run_calibration(
        engine,
        prompts,
        c.candidate_budgets,
        setup.sampling_params(config),
        bin_tokens=s.bin_tokens,
        threshold=s.threshold,
        quantile=s.quantile,
        page_size=s.page_size,
        run_dir=out,
    )
    print(result.table())
    budgets = " ".join(str(b) for b in result.schedule.to_dict()["budgets"])  # a keep-all bin reads 'dense'
    print(f"\nschedule (tokens per {s.bin_tokens}-token bin): {budgets}")
    print(f"written to {out}")
    return 0
