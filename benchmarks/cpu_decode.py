"""CPU decode throughput of the torch rollout engine at fixed cached lengths, next to the memory bound.

Random weights of a Qwen3 shape preset and a cache of random keys/values; per context, dense decode,
fixed budgets of the given fractions of the context, and the memory-bound limit of dense decode (bytes
per step over the copy bandwidth measured in the same run; see ``sparrow_nemo.rollout.tools.bench``). One JSON
object per (context, schedule) is appended to ``benchmarks/results/cpu_decode.jsonl`` with the machine,
the load average and the date; the table is printed. ``--page-scores centroid minmax`` measures the page
scores side by side: engines over one model (one per score) take turns, each keeping its best time per
configuration.

Example (docs/results.md's numbers):
    python benchmarks/cpu_decode.py --shape tiny --batch 128 --contexts 512 1024 2048 4096 \
        --fractions 0.1 0.25 --steps 16 --repeats 6
The page scores at 10% of 2K (docs/cpu_decode.md):
    python benchmarks/cpu_decode.py --shape tiny --batch 128 --contexts 2048 --fractions 0.1 --steps 16 \
        --repeats 6 --page-scores centroid minmax
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
from sparrow_nemo.rollout.tools.bench import decode_throughput, format_throughput, make_engine
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.pattern import PAGE_SCORES

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
    p.add_argument(
        "--page-scores",
        nargs="+",
        default=["centroid"],
        choices=PAGE_SCORES,
        help="page scores measured side by side (one engine each over the same model, taking turns)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    first = make_engine(args.shape, seed=args.seed, dense_layers=args.dense_layers, page_size=args.page_size)
    engines = [
        TorchRolloutEngine(
            first.model, dense_layers=args.dense_layers, page_size=args.page_size, page_score=score
        )
        for score in args.page_scores
    ]
    min_budget = 4 * args.page_size

    def schedules(context: int):
        return [
            fraction_schedule(f, context, 8 * args.page_size, args.page_size, min_budget)
            for f in args.fractions
        ]

    turns = [  # turn t of every engine before turn t + 1 of any: load bursts hit all page scores alike
        [
            decode_throughput(e, args.contexts, schedules, args.batch, args.steps, args.seed, repeats=1)
            for e in engines
        ]
        for _ in range(args.repeats)
    ]
    bandwidth = max(r["bandwidth_gb_s"] for turn in turns for rows in turn for r in rows)
    rows = [best_of([turn[i] for turn in turns], bandwidth) for i in range(len(engines))]
    for part in rows:
        print(format_throughput(part))
    rows = [row for part in rows for row in part]
    meta = {
        **machine_info("cpu"),
        "load_avg_1m_start": load_start,
        "load_avg_1m": os.getloadavg()[0],
        "backend": first.backend,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps({"benchmark": "cpu_decode", "shape": args.shape, **meta, **row}) + "\n")
    print(f"wrote {len(rows)} lines to {args.out}", file=sys.stderr)
    return rows


def best_of(turns: list[list[dict]], bandwidth: float) -> list[dict]:
    """One engine's throughput rows over several single-turn runs: per (context, schedule) the fastest turn,
    its ratios to dense and to the memory bound recomputed against the fastest dense turn and ``bandwidth``
    (GB/s, the best copy of the whole run)."""
    best = [max(rows, key=lambda r: r["tokens_per_s"]) for rows in zip(*turns)]
    out = []
    for row in best:
        dense = next(r for r in best if r["context"] == row["context"] and r["schedule"] == "dense")
        bound = row["bound_tokens_per_s"] * bandwidth / row["bandwidth_gb_s"]
        out.append(
            {
                **row,
                "repeats": len(turns),
                "speedup_vs_dense": row["tokens_per_s"] / dense["tokens_per_s"],
                "bound_tokens_per_s": bound,
                "dense_vs_bound": bound / dense["tokens_per_s"],
                "bandwidth_gb_s": bandwidth,
            }
        )
    return out


if __name__ == "__main__":
    main()
