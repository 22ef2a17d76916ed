"""Calibration of one recipe under each page score: the budgets it calibrates to and their p5 per bin.

Runs ``sparrow calibrate --config RECIPE sparsity.page_score=SCORE --out DIR/SCORE`` for every ``--page-scores``
(the recipe's warm-start or checkpoint, the same held-out prompts and candidate budgets for every score), reads
each pass's ``calibration_table.json`` and appends one JSON object per page score to
``benchmarks/results/page_score_calibration.jsonl``: the calibrated budget per bin (``null`` = no candidate met
the threshold: dense), the tail (p5) of every candidate per bin, the machine, the date and the load average
before and after. A short comparison is printed.

Example (docs/cpu_decode.md, "page scores"):
    python benchmarks/page_score_calibration.py --config tiny_cpu_haystack --page-scores centroid minmax
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info

from sparrow_nemo import cli
from sparrow_nemo.control.calibration import TABLE_JSON
from sparrow_nemo.sparse.pattern import PAGE_SCORES

RESULTS = Path(__file__).resolve().parent / "results" / "page_score_calibration.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny_cpu_haystack", help="recipe (name or YAML path)")
    p.add_argument("--page-scores", nargs="+", default=list(PAGE_SCORES), choices=PAGE_SCORES)
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    p.add_argument(
        "--work-dir", type=Path, default=None, help="where the calibration folders go (default: temp)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more recipe overrides, for every score")
    return p.parse_args(argv)


def calibrate(config: str, page_score: str, overrides: list[str], out_dir: Path) -> dict:
    """One ``sparrow calibrate`` pass -> its calibration_table.json as a dict, plus the seconds it took."""
    start = time.perf_counter()
    argv = ["calibrate", "--out", str(out_dir), "--config", config, f"sparsity.page_score={page_score}"]
    if cli.main([*argv, *overrides]) != 0:
        raise RuntimeError(f"sparrow calibrate failed for page_score={page_score}")
    table = json.loads((out_dir / TABLE_JSON).read_text())
    return {**table, "seconds": time.perf_counter() - start}


def summary_row(table: dict) -> dict:
    """The calibrated budget per bin (None: dense, no candidate met the threshold), the chosen budgets' p5 per
    bin, and every candidate's p5 per bin ({budget: {bin: p5}}, string keys as in the table)."""
    chosen = [b if isinstance(b, int) else None for b in table["schedule"]["budgets"]]
    tails = table["tails"]
    chosen_p5 = [None if b is None else tails.get(str(b), {}).get(str(i)) for i, b in enumerate(chosen)]
    return {"budgets": chosen, "chosen_p5": chosen_p5, "tails": tails}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="page_score_calibration-"))
    rows = []
    for score in args.page_scores:
        load_start = os.getloadavg()[0]
        table = calibrate(args.config, score, args.overrides, work / score)
        rows.append(
            {
                "benchmark": "page_score_calibration",
                "recipe": args.config,
                "overrides": args.overrides,
                "page_score": score,
                **machine_info("cpu"),
                "load_avg_1m_start": load_start,
                "load_avg_1m": os.getloadavg()[0],
                "seconds": table["seconds"],
                "threshold": table["threshold"],
                "quantile": table["quantile"],
                "bin_tokens": table["schedule"]["bin_tokens"],
                "unsatisfied_bins": table["unsatisfied_bins"],
                **summary_row(table),
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        cells = ", ".join(
            f"bin {i}: {'dense' if b is None else b} (p5 {p if p is not None else float('nan'):.3f})"
            for i, (b, p) in enumerate(zip(row["budgets"], row["chosen_p5"]))
        )
        print(f"{row['page_score']:>8}: {cells}")
    print(f"wrote {len(rows)} lines to {args.out}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
