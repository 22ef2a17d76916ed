"""CPU decode throughput of the torch rollout engine at fixed cached lengths, next to the memory bound.

Random weights of a Qwen3 shape preset and a cache of random keys/values; per context, dense decode,
fixed budgets of the given fractions of the context, and the memory-bound limit of dense decode (bytes
per step over the copy bandwidth measured in the same run; see ``sparrow_nemo.rollout.bench``). One JSON
object per (context, schedule) is appended to ``benchmarks/results/cpu_decode.jsonl`` with the machine,
the load average and the date; the table is printed.

Example (the README's numbers):
    python benchmarks/cpu_decode.py --shape tiny --batch 128 --contexts 512 1024 2048 4096 \
        --fractions 0.1 0.25 --steps 16 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info

from sparrow_nemo.commands.bench import fraction_schedule
from sparrow_nemo.rollout.bench import decode_throughput, format_throughput, make_engine

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_decode.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", help="Qwen3 shape preset (sparrow_nemo.model_shapes.PRESETS)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration")
    p.add_argument(
        "--repeats", type=int, default=3, help="turns per context; each configuration keeps its best"
    )
    p.add_argument(
        "--fractions", type=float, nargs="+", default=[0.1], help="fixed budgets, fraction of context"
    )
    p.add_argument("--dense-layers", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    engine = make_engine(args.shape, seed=args.seed, dense_layers=args.dense_layers, page_size=args.page_size)
    min_budget = 4 * args.page_size

    def schedules(context: int):
        return [
            fraction_schedule(f, context, 8 * args.page_size, args.page_size, min_budget)
            for f in args.fractions
        ]

    rows = decode_throughput(
        engine, args.contexts, schedules, args.batch, args.steps, args.seed, repeats=args.repeats
    )
    print(format_throughput(rows))
    meta = {
        **machine_info("cpu"),
        "load_avg_1m_start": load_start,
        "load_avg_1m": os.getloadavg()[0],
        "backend": engine.backend,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps({"benchmark": "cpu_decode", "shape": args.shape, **meta, **row}) + "\n")
    print(f"wrote {len(rows)} lines to {args.out}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
