"""Does DistillSparse close the tail gap on the tiny task? Fresh rollouts with and without the adapter.

On the recipe's warm-started policy (held fixed), the adapter takes ``--rounds`` DistillSparse rounds on
training rollouts under the recipe's starting schedule (``benchmarks/distill_report.py``: ``distill_rounds``:
sparse PG with GRPO advantages + k3 KL, ``distill.steps`` updates per round). Then, on held-out prompts
the adapter never saw (``--eval-prompts`` x ``--samples`` fresh samples, fixed seeds):

- p5 of the acceptance rate per 16-token bin, its mean, the mean k3 KL and the response length, with and
  without the adapter (same prompts, same seeds, same schedule);
- a calibration with and without the adapter (smallest candidate budget per bin meeting the threshold)
  and the decode cost model's predicted rollout speedup of both schedules (H200, the recipe's model,
  the undistilled rollouts' lengths).

Prints a table and writes the numbers as JSON (``--out``). CPU, one process:

    .venv/bin/python benchmarks/distill_tail.py --rounds 40             # tiny_cpu_distill (20 tokens)
    .venv/bin/python benchmarks/distill_tail.py --rounds 20 'sparsity.budgets=[16,16,16,16,16]'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from distill_report import distill_rounds, measure_adapter  # benchmarks/distill_report.py, beside this script

from sparrow_nemo.grpo import world
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import start_checkpoint
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.sparse.schedule import DENSE_BUDGET

#: sampling seed of the held-out measurement rollouts (the training rounds use rollout.seed)
EVAL_SEED = 12_345


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny_cpu_distill", help="recipe name or path")
    p.add_argument("--rounds", type=int, default=40, help="adapter rounds (each: distill.steps updates)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the tail measurement")
    p.add_argument("--samples", type=int, default=2, help="samples per held-out prompt")
    p.add_argument("--out", type=Path, default=None, help="JSON output file")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    return p.parse_args(argv)


def run(args: argparse.Namespace, run_dir: Path) -> dict:
    """The measurement (see the module docstring); returns the JSON-ready result."""
    config = load_config(
        args.config, [*args.overrides, "logging.tensorboard=false", "checkpoint.enabled=false"]
    )
    torch.set_num_threads(1)
    world.start_processes()
    start = time.time()
    trainer = GrpoTrainer(config, run_dir, start_checkpoint(config))  # the recipe's warm-start
    try:
        phase = trainer.distill  # the recipe's DistillSparse phase (distill.enabled)
        phase.start(trainer.policy, trainer.rollout_engine)
        schedule = trainer.schedule
        losses = distill_rounds(trainer, phase, schedule, args.rounds)
        adapter = trainer.policy.lora.export_adapter()
        held_out = [
            i.prompt_ids for i in trainer.prompts.eval_batch(args.eval_prompts) for _ in range(args.samples)
        ]
        effect, calibrated = measure_adapter(trainer, adapter, held_out, schedule, EVAL_SEED)
    finally:
        trainer.policy.close()
    return {
        "config": args.config,
        "overrides": args.overrides,
        "rounds": args.rounds,
        "held_out_samples": len(held_out),
        "schedule": schedule.to_dict(),
        "round_losses": losses,
        "tail": {tag: t.to_dict() for tag, t in effect.items()},
        "calibrated": {
            tag: {
                "budgets": list(c.result.schedule.budgets),
                "predicted_speedup": c.speedup,
                "tails": {str(b): {str(k): v for k, v in t.items()} for b, t in c.result.tails.items()},
                "counts": {str(b): {str(k): v for k, v in t.items()} for b, t in c.result.counts.items()},
            }
            for tag, c in calibrated.items()
        },
        "seconds": time.time() - start,
    }


def report(result: dict, min_tokens: int) -> str:
    """Human-readable table of :func:`run`'s result."""
    tails = result["tail"]
    bins = sorted({int(b) for t in tails.values() for b in t["tokens"]})
    lines = [f"held-out samples: {result['held_out_samples']}, adapter rounds: {result['rounds']}", ""]
    lines.append(f"{'bin':>4} {'tokens w/o':>10} {'p5 w/o':>7} {'tokens w/':>9} {'p5 w/':>7}")
    for b in bins:
        row = [f"{b:>4}"]
        for tag in ("without", "with"):
            n = tails[tag]["tokens"].get(str(b), 0)
            p5 = tails[tag]["tail"].get(str(b))
            flag = "" if n >= min_tokens else "*"
            row.append(f"{n:>10}" if tag == "without" else f"{n:>9}")
            row.append(f"{p5:>6.3f}{flag}" if p5 is not None else f"{'-':>7}")
        lines.append(" ".join(row))
    lines.append(f"(* fewer than {min_tokens} tokens: no scheduler decision)")
    for tag in ("without", "with"):
        t, c = tails[tag], result["calibrated"][tag]
        lines.append(
            f"{tag:>7} adapter: mean alpha {t['mean_alpha']:.4f}, mean k3 {t['mean_k3']:.4f}, "
            f"response length {t['mean_length']:.1f}; calibrated budgets "
            f"{' '.join('dense' if b >= DENSE_BUDGET else str(b) for b in c['budgets'])} -> "
            f"predicted speedup {c['predicted_speedup']:.3f}x"
        )
    lines.append(f"took {result['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    run_dir = Path("runs") / f"distill_tail-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run(args, run_dir)
    print(report(result, load_config(args.config, args.overrides).sparsity.min_bin_tokens))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
