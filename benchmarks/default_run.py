"""The default `sparrow train` from a cold cache, once per rollout seed, against issue 17's targets.

Each run is the README's command, ``sparrow train rollout.seed=S`` (plus ``--override``s), in a subprocess
with an empty ``SPARROW_CACHE`` (the shipped warm-start copied and hash-checked, the CPU kernels compiled: what
a fresh clone does) and its own run folder; ``--jobs`` runs go at once (2 fills a 2-core CPU, as CI would see
it: each run's wall time then includes the other's contention). Per run one JSON line is appended to
``benchmarks/results/default_run.jsonl``: the command, the wall time, the machine and the load average before
and after, and the run's ``summary.json``. The table it prints gives per seed the held-out accuracy start ->
end under the sparse and the dense schedule, the median response length, the measured rollout speedup of the
final schedule vs dense (same prompts, same run), the cost model's prediction and whether every decided
bin's last tail meets the threshold; then the means over the seeds.

Example (docs/results.md's numbers):
    python benchmarks/default_run.py --seeds 0 1 2 --jobs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info

from sparrow_nemo.grpo.world import env_without_launcher

RESULTS = Path(__file__).resolve().parent / "results" / "default_run.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rollout.seed of each run")
    p.add_argument("--jobs", type=int, default=2, help="runs at once")
    p.add_argument("--override", action="append", default=[], help="extra key=value for every run")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    return p.parse_args(argv)


def one_run(seed: int, overrides: list[str], folder: Path) -> dict:
    """``sparrow train rollout.seed=seed`` with an empty cache under ``folder``; its summary and wall time."""
    words = ["sparrow", "train", f"rollout.seed={seed}", f"logging.run_dir={folder / 'run'}", *overrides]
    env = env_without_launcher()  # a fresh 1-rank world, whatever the caller's earlier runs left set
    env["SPARROW_CACHE"] = str(folder / "cache")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "sparrow_nemo.cli", *words[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(words)} failed ({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads(next((folder / "run").rglob("summary.json")).read_text())
    return {
        "recipe": "tiny_cpu",
        "command": " ".join(w for w in words if not w.startswith("logging.run_dir=")),
        "rollout_seed": seed,
        "wall_s": wall,
        "load_before": load,
        "load_after": os.getloadavg()[0],
        **machine_info("cpu"),
        "summary": summary,
    }


def _tails_ok(tails: dict) -> bool:
    """Whether every decided bin's last tail meets the threshold (``decided``: enough tokens; older summaries
    lack it and count every bin)."""
    return all(v["ok"] for v in tails.values() if v.get("decided", True))


def table(rows: list[dict]) -> str:
    """Per seed and on average: accuracies, median length, speedup measured and predicted, tails (the rule's
    statistic and the paper's p5, decided bins of the last step), minutes."""
    head = (
        "seed  sparse start->end  dense start->end  median len  speedup (pred.)  rule tail ok  p5 ok  minutes"
    )
    lines, gains, dense_gains, speedups = [head], [], [], []
    for r in rows:
        s = r["summary"]
        rule_ok = _tails_ok(s["tail_per_bin"])
        p5_ok = _tails_ok(s.get("paper_tail_per_bin", s["tail_per_bin"]))
        gains.append(s["accuracy_end"] - s["accuracy_start"])
        dense_gains.append(s["accuracy_end_dense"] - s["accuracy_start_dense"])
        speedups.append(s["measured_rollout_speedup"])
        lines.append(
            f"{r['rollout_seed']:>4}  {s['accuracy_start']:.3f} -> {s['accuracy_end']:.3f}     "
            f"{s['accuracy_start_dense']:.3f} -> {s['accuracy_end_dense']:.3f}    "
            f"{s.get('response_length_median_mean') or float('nan'):>10.0f}  {s['measured_rollout_speedup']:.2f}x "
            f"({s['predicted_speedup_mean']:.2f}x)  {'yes' if rule_ok else 'no':>12}  {'yes' if p5_ok else 'no':>5}"
            f"  {r['wall_s'] / 60:>7.1f}"
        )
    lines.append(
        f"mean: sparse {100 * statistics.fmean(gains):+.1f} points, dense {100 * statistics.fmean(dense_gains):+.1f}"
        f" points, speedup {statistics.fmean(speedups):.2f}x"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sparrow_default_run_") as tmp:
        folders = [Path(tmp) / f"seed_{s}" for s in args.seeds]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(one_run, args.seeds, [args.override] * len(args.seeds), folders))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(table(rows))
    print(f"wrote {len(rows)} lines to {args.out}")
    return rows


if __name__ == "__main__":
    main()
