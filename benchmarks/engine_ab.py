"""Rollout tokens/s of this tree's engine against an earlier commit's, in ABBA alternation on the same machine.

The default run's evaluation workload: the recipe's held-out prompts (128), one sample each with its per-prompt
seed, EOS honoured (responses ~300-1,900 tokens), on the same weights (``--weights``: an HF checkpoint folder,
default the shipped warm-start of the default recipe), dense and under a sparse schedule. Each arm runs in its
own process from its own source tree (this one, and a ``git worktree`` of ``--baseline`` in a temporary folder),
in the order A B B A per repeat so a drift of a shared machine's speed falls on both alike (each row records the
1-minute load average before every pair: other work on the machine shows there, and the median pair ratio and
the tokens per CPU second of each arm's process, which other work disturbs less than wall seconds). The arm's process
builds the engine with the recipe's ``setup.build_engine`` (the call both engines share), generates 8 prompts
untimed, then the whole batch timed, and prints one JSON line. Per schedule the result pools each arm's tokens
over its seconds; one JSON line per schedule goes to ``benchmarks/results/engine_ab.jsonl``.

    python benchmarks/engine_ab.py --baseline db8a16e --repeats 2
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import machine_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "engine_ab.jsonl"
#: the default run's final schedule (docs/results.md: 192 tokens up to 768 cached, 256, 512, dense from 1,280)
SPARSE = "[192,192,192,256,512,2147483647]"


def shipped_warm_start(recipe: str = "tiny_cpu") -> Path:
    """The shipped warm-start folder of ``recipe`` (its manifest names the recipe)."""
    for manifest in sorted((REPO / "sparrow_nemo" / "tasks" / "warmstart").glob("*/manifest.json")):
        if json.loads(manifest.read_text()).get("recipe") == recipe:
            return manifest.parent
    raise FileNotFoundError(f"no shipped warm-start of {recipe}")


#: what each arm's process runs (the same text in both trees: only public calls both engines have)
ARM = r"""
import json, sys, time
import torch
from sparrow_nemo.grpo import setup
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from safetensors.torch import load_file
from sparrow_nemo.rollout.sampling import sample_seed
weights, budgets, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3])
overrides = ["warmstart.enabled=false", "control.calibrate=false", "sparsity.schedule=explicit", f"sparsity.budgets={budgets}"]
config = load_config("tiny_cpu", overrides)
setup.apply_cpu_threads(config)
source = build_prompt_source(config)
state = load_file(weights + "/model.safetensors")
engine = setup.build_engine(config, state, source.tokenizer)
schedule = config.sparsity.build_schedule()
items = source.eval_batch(prompts)
ids = [list(i.prompt_ids) for i in items]
sampling = setup.sampling_params(config, seed=1)
seeds = [sample_seed(1, i) for i in range(len(ids))]
engine.generate(ids[:8], sampling, schedule, sample_seeds=seeds[:8])
t0, c0 = time.perf_counter(), time.process_time()
batch = engine.generate(ids, sampling, schedule, sample_seeds=seeds)
seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
tokens = sum(s.response_ids.numel() for s in batch.samples)
print(json.dumps({"tokens": tokens, "seconds": seconds, "cpu_s": cpu_s, "decode_s": batch.decode_s}))
"""


def run_arm(tree: Path, weights: Path, budgets: str, prompts: int) -> dict:
    """One generation of the batch from source ``tree`` in a fresh process -> its JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", ARM, str(weights), budgets, str(prompts)],
        cwd=tree,
        env={"PYTHONPATH": f"{tree}:{tree / 'kernels'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"arm in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the git revision whose engine is the baseline")
    p.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="HF checkpoint folder both arms load (default: the shipped warm-start of the default recipe)",
    )
    p.add_argument("--prompts", type=int, default=128, help="held-out prompts per generation")
    p.add_argument("--repeats", type=int, default=2, help="ABBA pairs per schedule")
    p.add_argument("--schedules", nargs="+", default=["dense", "sparse"], choices=["dense", "sparse"])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.weights = args.weights or shipped_warm_start()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.baseline], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), rev], cwd=REPO, check=True, capture_output=True
        )
        try:
            for name in args.schedules:
                budgets = "[2147483647]" if name == "dense" else SPARSE
                totals = {"baseline": [0, 0.0], "this": [0, 0.0]}
                cpu = {"baseline": 0.0, "this": 0.0}
                pairs, loads = [], []
                for r in range(args.repeats):
                    loads.append(round(os.getloadavg()[0], 2))
                    order = ("baseline", "this") if r % 2 == 0 else ("this", "baseline")
                    got = {}
                    for arm in order:
                        tree = base if arm == "baseline" else REPO
                        got[arm] = run_arm(tree, args.weights, budgets, args.prompts)
                        totals[arm][0] += got[arm]["tokens"]
                        totals[arm][1] += got[arm]["seconds"]
                        cpu[arm] += got[arm]["cpu_s"]
                    rates = {a: got[a]["tokens"] / got[a]["seconds"] for a in got}
                    pairs.append(rates["this"] / rates["baseline"])
                    print(f"{name} pair {r + 1} ({' then '.join(order)}): baseline {rates['baseline']:.0f} tok/s, "
                          f"this {rates['this']:.0f} tok/s, ratio {pairs[-1]:.3f}", flush=True)  # fmt: skip
                pooled = {a: t / s for a, (t, s) in totals.items()}
                per_cpu = {a: totals[a][0] / cpu[a] for a in cpu}
                row = {
                    "benchmark": "engine_ab",
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                    "machine": machine_info("cpu"),
                    "baseline": rev,
                    "this": head,
                    "schedule": name,
                    "budgets": budgets,
                    "prompts": args.prompts,
                    "repeats": args.repeats,
                    "baseline_tokens_per_s": pooled["baseline"],
                    "this_tokens_per_s": pooled["this"],
                    "ratio": pooled["this"] / pooled["baseline"],
                    "pair_ratios": pairs,
                    "median_pair_ratio": statistics.median(pairs),
                    "baseline_tokens_per_cpu_s": per_cpu["baseline"],
                    "this_tokens_per_cpu_s": per_cpu["this"],
                    "cpu_ratio": per_cpu["this"] / per_cpu["baseline"],
                    "load_avg_1min": loads,
                }
                print(
                    f"{name}: this / baseline = {row['ratio']:.3f} (pooled over {args.repeats} pairs; median pair "
                    f"{row['median_pair_ratio']:.3f}; per CPU second {row['cpu_ratio']:.3f})",
                    flush=True,
                )
                rows.append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)],
                cwd=REPO,
                check=False,
                capture_output=True,
            )
    return rows


if __name__ == "__main__":
    main()
