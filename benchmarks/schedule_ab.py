"""Rollout speedup of a schedule over dense, measured in alternation on a recipe's held-out prompts.

The default run's summary measures its speedup from two evaluations a minute apart, and on a shared VM the
same dense evaluation moves by tens of percent between minutes (2,900-4,200 tokens/s on the default run). Here
the two arms alternate in ABBA order (dense, sparse, sparse, dense, ...), each generating the same
``--prompts`` held-out prompts with the same per-prompt seeds, so a drift of the machine's speed falls on both
arms alike. Per repeat pair it prints both tokens/s and their ratio; the speedup is the ratio of the arms'
pooled tokens/s (and the median of the pair ratios beside it). One JSON line goes to
``benchmarks/results/schedule_ab.jsonl``.

Weights: ``model.hf_checkpoint`` (e.g. a run's checkpoint exported to HF), else the recipe's warm-start. The
schedule: ``--schedule FILE`` (e.g. a run's ``sparsity/schedule.yaml``), else the recipe's
``sparsity.build_schedule()``.

Example (docs/results.md: the default run's final schedule on its warm-start, ~3 min):
    python benchmarks/schedule_ab.py --repeats 4 control.calibrate=false \
        "sparsity.budgets=[192,192,192,256,512,2147483647]"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info

from sparrow_nemo.grpo import setup
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config
from sparrow_nemo.grpo.start import start_weights
from sparrow_nemo.rollout.engine import RolloutEngine, SamplingParams
from sparrow_nemo.sparse.schedule import BudgetSchedule

RESULTS = Path(__file__).resolve().parent / "results" / "schedule_ab.jsonl"


def parser(description: str, results: Path) -> argparse.ArgumentParser:
    """The options this script and ``decode_profile.py`` share (recipe, schedule, prompts, ABBA repeats, output)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="recipe (name or YAML path; default: the default recipe)")
    p.add_argument("--schedule", type=Path, default=None, help="schedule YAML (default: the recipe's)")
    p.add_argument("--prompts", type=int, default=128, help="held-out prompts per generation")
    p.add_argument("--repeats", type=int, default=4, help="dense/sparse pairs, in ABBA order")
    p.add_argument("--out", type=Path, default=results, help="JSONL file to append to")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    return p


def check_counts(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` once ``--repeats`` and ``--prompts`` are positive (else ``p.error``)."""
    if args.repeats < 1 or args.prompts < 1:
        p.error(f"--repeats and --prompts must be >= 1, got {args.repeats} and {args.prompts}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, RESULTS)
    return check_counts(p, p.parse_args(argv))


def abba(repeats: int) -> list[tuple[str, str]]:
    """The arms' order per pair: dense first in even pairs, sparse first in odd ones."""
    return [("dense", "sparse") if r % 2 == 0 else ("sparse", "dense") for r in range(repeats)]


@dataclass
class Arms:
    """The two arms on one engine: ``schedules`` (``dense`` and ``sparse``), the held-out ``prompts`` (token
    ids) with their per-prompt ``seeds``, the recipe's ``sampling`` and ``config``."""

    config: SparrowConfig
    engine: RolloutEngine
    schedules: dict[str, BudgetSchedule]
    prompts: list[list[int]]
    seeds: list[int]
    sampling: SamplingParams


def prepare(args: argparse.Namespace) -> Arms:
    """The recipe's engine on its weights (``start_weights``), the schedule (``--schedule`` or the recipe's,
    refused when dense) beside dense, and ``--prompts`` held-out prompts."""
    config = load_config(args.config, args.overrides)
    setup.apply_cpu_threads(config)
    s = config.sparsity
    schedule = BudgetSchedule.from_yaml(args.schedule) if args.schedule else s.build_schedule()
    if schedule.is_dense:
        raise SystemExit("schedule_ab: the schedule is dense; give a sparse one (--schedule or sparsity.*)")
    source = build_prompt_source(config)
    items = source.eval_batch(args.prompts)
    return Arms(
        config=config,
        engine=setup.build_engine(config, start_weights(config, source, False), source.tokenizer),
        schedules={"dense": BudgetSchedule.dense(s.bin_tokens, s.page_size), "sparse": schedule},
        prompts=[i.prompt_ids for i in items],
        seeds=list(range(len(items))),
        sampling=setup.sampling_params(config),
    )


def alternate(arms: Arms, repeats: int) -> Iterator[tuple[int, str, int, float]]:
    """Generate the prompts under each arm in :func:`abba` order; per generation ``(pair, arm, response tokens,
    wall seconds)``, yielded before the next one starts."""
    for pair, order in enumerate(abba(repeats)):
        for arm in order:
            start = time.perf_counter()
            batch = arms.engine.generate(
                arms.prompts, arms.sampling, arms.schedules[arm], sample_seeds=arms.seeds
            )
            yield pair, arm, batch.num_response_tokens, time.perf_counter() - start


def append_row(path: Path, row: dict) -> None:
    """One JSON line appended to ``path`` (its folder made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    arms = prepare(args)
    config, schedule = arms.config, arms.schedules["sparse"]
    load_start = os.getloadavg()[0]
    runs: dict[str, list[tuple[int, float]]] = {"dense": [], "sparse": []}  # (tokens, seconds) per repeat
    for pair, arm, tokens, seconds in alternate(arms, args.repeats):
        runs[arm].append((tokens, seconds))
        if len(runs["dense"]) == len(runs["sparse"]):
            (dt, ds), (st, ss) = runs["dense"][-1], runs["sparse"][-1]
            print(
                f"pair {pair}: dense {dt / ds:,.0f} tok/s, sparse {st / ss:,.0f} tok/s, {(st / ss) / (dt / ds):.2f}x"
            )
    rate = {arm: sum(t for t, _ in r) / sum(sec for _, sec in r) for arm, r in runs.items()}
    pairs = [(st / ss) / (dt / ds) for (dt, ds), (st, ss) in zip(runs["dense"], runs["sparse"], strict=True)]
    row = {
        "benchmark": "schedule_ab",
        "recipe": config.name,
        "overrides": args.overrides,
        "weights": config.model.hf_checkpoint or "warm-start",
        "schedule": schedule.to_dict(),
        "prompts": len(arms.prompts),
        "repeats": args.repeats,
        "dense_tokens_per_s": rate["dense"],
        "sparse_tokens_per_s": rate["sparse"],
        "speedup": rate["sparse"] / rate["dense"],
        "pair_speedups": pairs,
        "median_pair_speedup": statistics.median(pairs),
        "runs": runs,
        **machine_info("cpu"),
        "load_avg_1m_start": load_start,
        "load_avg_1m": os.getloadavg()[0],
    }
    print(f"speedup {row['speedup']:.2f}x (pooled), median pair {row['median_pair_speedup']:.2f}x")
    append_row(args.out, row)
    return row


if __name__ == "__main__":
    main()
