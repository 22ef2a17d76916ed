"""Engine rollout at the Qwen3 shapes at 32K, dense vs the paper's schedule, through the public API.

For each model (random bf16 weights drawn on the device) it builds a :class:`TorchRolloutEngine` whose KV
cache holds the rows that fit at the context length, and asks ``engine.generate(prompts, sampling,
schedule)`` for a GRPO-shaped request mix: ``--requests-per-row`` times as many requests as fit at once, in groups of
``--group`` samples of one prompt (the engine prefills a group's prompt once), prompts of ``--context -
--max-new`` tokens, so every token is sampled at 32K cached. The response lengths are a realistic mix with
EOS honoured: the stop set is the model's EOS plus ``V / --mean-new`` other token ids, so at temperature 1 a
response stops at each step with probability ~1 / mean-new (a geometric mix of lengths, capped at
``--max-new``). The engine's KV pool is ``rows x --context`` tokens (``max_cache_tokens``): it runs what fits
and admits a request as another finishes (continuous batching, pages on demand, preemption when they run out),
which is what the line measures, with the engine's counters (decode steps, preemptions, peak pages).

Each arm first runs an untimed warm-up: one short generate at every CUDA-graph bucket size the timed run can
reach (the engine captures a bucket's graph the first time it uses it and keeps it; Triton compiles on first
use), so neither lands in the timed numbers; then the timed generate. Decode throughput excludes the prefill
(the same work in both arms); ``speedup`` = sparse decode tokens/s / dense decode tokens/s.

Beside it, per GPU kind (:mod:`gpu_targets`): the batch that fits there and the cost model's memory-bound
speedup limit of the same length mix at that batch, the limit at the batch that ran, and the target
(speedup >= 80 % of that limit) on the GPU it ran on; and whether the paper's speedup is reachable at all on
each kind (a full 32K generation at the batch that fits). One JSON line per model, written as it finishes.

GPU: PYTHONPATH=kernels:. python benchmarks/engine_rollout.py --out rollout.jsonl
CPU: .venv/bin/python benchmarks/engine_rollout.py --tiny --device cpu --backend torch   (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_targets import cache_bytes_per_token, paper_reachable, rollout_limits, rollout_target
from rollout_speedup import (
    random_decoder,  # weights drawn on the device (a CPU generator takes minutes at 8B)
)

from sparrow_nemo.model_shapes import get_shape
from sparrow_nemo.rollout.engine import RolloutBatch, SamplingParams
from sparrow_nemo.rollout.torch.cuda_graphs import bucket_sizes
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.sparse.schedule import BudgetSchedule

RESULTS = Path(__file__).resolve().parent / "results" / "engine_rollout.jsonl"
#: ``--tiny``: the 2-layer test shape, a schedule scaled to its short context (rollout_speedup's).
TINY_SCHEDULE = BudgetSchedule(bin_tokens=32, budgets=(32, 48), name="tiny-steps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-8b"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="decode attention")
    p.add_argument("--tiny", action="store_true", help="the tiny-test shape at a 96-token context (CPU)")
    p.add_argument("--context", type=int, default=32768, help="prompt + longest response, tokens")
    p.add_argument("--max-new", type=int, default=384, help="response cap, tokens")
    p.add_argument("--mean-new", type=int, default=128, help="mean response length the stop set aims at")
    p.add_argument("--group", type=int, default=16, help="samples per prompt (a GRPO group)")
    p.add_argument("--requests-per-row", type=float, default=2.0, help="requests per row that fits at once")
    p.add_argument(
        "--rows", type=int, default=None, help="rows that fit at once (default: measured free memory)"
    )
    p.add_argument("--threshold", default="0.86", help="the paper's schedule: qwen3-<size>-<threshold>")
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument(
        "--headroom-gib", type=float, default=8.0, help="GPU memory kept free besides the KV cache"
    )
    p.add_argument(
        "--warmup-tokens", type=int, default=8, help="tokens of each arm's untimed warm-up generate"
    )
    p.add_argument("--time-budget-s", type=float, default=1e9, help="start no model after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON lines file to append to")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.context, args.max_new, args.mean_new = ["tiny-test"], 96, 24, 8
        args.group, args.rows, args.dense_layers, args.warmup_tokens = 2, args.rows or 2, 1, 2
    return args


def fitting_rows(shape, device: torch.device, context: int, headroom_gib: float) -> int:
    """Rows whose whole KV cache (K, V, centroids) fits in the free device memory less the headroom."""
    free = torch.cuda.mem_get_info(device)[0] - headroom_gib * 2**30
    return max(0, int(free // (cache_bytes_per_token(shape) * context)))


def request_mix(
    vocab: int, eos: int, args: argparse.Namespace, rows: int
) -> tuple[list[list[int]], tuple[int, ...]]:
    """GRPO-shaped prompts (groups of ``--group`` copies of one random prompt; ``requests-per-row x rows`` requests,
    whole groups) and the stop set (EOS + about vocab / mean-new other ids)."""
    gen = torch.Generator().manual_seed(args.seed)
    groups = max(1, math.ceil(args.requests_per_row * rows / args.group))
    prompt_len = args.context - args.max_new
    prompts = []
    for _ in range(groups):
        p = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        prompts += [p] * args.group
    others = torch.randperm(vocab, generator=gen).tolist()
    n_stop = max(1, round(vocab / args.mean_new))
    stop = (eos, *[t for t in others if t != eos][: n_stop - 1])
    return prompts, stop


def warm_up(engine: TorchRolloutEngine, sampling: SamplingParams, schedule, rows: int, tokens: int) -> float:
    """Untimed: one short generate at every CUDA-graph bucket the timed run can use (the engine captures a
    bucket's graph the first time a step runs at it, and keeps it; the kernels compile on first use), so neither
    lands in the timed decode. Short prompts: a graph depends on the batch size, not on the cached length."""
    sizes = bucket_sizes(engine.max_batch_size or rows)
    top = next((b for b in sizes if b >= rows), sizes[-1])  # the most rows the pool runs at once use this one
    prompt = list(range(3, 3 + 2 * engine.page_size))
    short = replace(sampling, max_new_tokens=tokens, stop_token_ids=())
    t0 = time.perf_counter()
    for b in (b for b in sizes if b <= top):
        engine.generate([prompt] * b, short, schedule)
    return time.perf_counter() - t0


def arm_stats(out: RolloutBatch, wall_s: float) -> dict:
    """Tokens, times, the length mix and what the engine reports about its batching (when it does)."""
    lengths = [int(s.response_ids.numel()) for s in out.samples]
    q = statistics.quantiles(lengths, n=10) if len(lengths) > 1 else lengths * 9
    stats = {
        "tokens": sum(lengths),
        "decode_s": out.decode_s,
        "prefill_s": out.prefill_s,
        "wall_s": wall_s,
        "decode_tok_s": sum(lengths) / out.decode_s if out.decode_s > 0 else float("nan"),
        "length_mean": statistics.fmean(lengths),
        "length_p10_p50_p90": [q[0], statistics.median(lengths), q[-1]],
        "length_max": max(lengths),
        "finish_reasons": dict(Counter(s.finish_reason for s in out.samples)),
        "lengths": lengths,
    }
    for name in ("decode_steps", "preemptions", "peak_pages", "capacity_pages"):  # the engine's batching
        stats[name] = getattr(out, name)
    return stats


def run_model(name: str, args: argparse.Namespace, device: torch.device, env: dict) -> dict:
    """Both arms of one model -> its JSON line."""
    shape = get_shape(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    schedule = TINY_SCHEDULE if args.tiny else BudgetSchedule.from_preset(f"{name}-{args.threshold}")
    t0 = time.perf_counter()
    decoder = random_decoder(shape, dtype, device, args.seed)
    rows = args.rows or fitting_rows(shape, device, args.context, args.headroom_gib)
    if rows <= 0:
        raise RuntimeError(f"{name}: no {args.context}-token sequence fits beside the weights")
    engine = TorchRolloutEngine(decoder, dense_layers=args.dense_layers, attention_backend=args.backend,
                                prefill_chunk_tokens=16 if args.tiny else 2048, max_cache_tokens=rows * args.context)  # fmt: skip
    build_s = time.perf_counter() - t0
    prompts, stop = request_mix(shape.vocab_size, shape.eos_token_id, args, rows)
    sampling = SamplingParams(
        max_new_tokens=args.max_new, temperature=1.0, seed=args.seed + 1, stop_token_ids=stop
    )
    dense = BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)
    arms = {}
    for arm, sched in (("dense", dense), ("sparse", schedule)):
        warmup_s = warm_up(engine, sampling, sched, rows, args.warmup_tokens)
        w0 = time.perf_counter()
        out = engine.generate(prompts, sampling, sched)
        arms[arm] = {**arm_stats(out, time.perf_counter() - w0), "warmup_s": warmup_s}
        print(f"{name} {arm}: {arms[arm]['decode_tok_s']:.0f} tok/s decode, {arms[arm]['tokens']} tokens, mean length "
              f"{arms[arm]['length_mean']:.0f}, {arms[arm]['finish_reasons']}", flush=True)  # fmt: skip
    prompt_len = args.context - args.max_new
    lengths = arms["dense"]["lengths"]
    speedup = arms["sparse"]["decode_tok_s"] / arms["dense"]["decode_tok_s"]
    limits = rollout_limits(shape, schedule, lengths, prompt_len, args.dense_layers, rows)
    row = {
        "benchmark": "engine_rollout", "model": name, "schedule": schedule.name, "rows_at_once": rows,
        "max_cache_tokens": rows * args.context, "requests": len(prompts), "group": args.group, "prompt_len": prompt_len,
        "max_new_tokens": args.max_new, "mean_new_aimed": args.mean_new, "stop_ids": len(stop),
        "dense_layers": args.dense_layers, "backend": engine.backend, "dtype": str(dtype).removeprefix("torch."),
        "requests_per_row": len(prompts) / rows, "build_s": build_s,
        "dense": arms["dense"], "sparse": arms["sparse"], "speedup": speedup, "limits": limits,
        "paper": None if args.tiny else paper_reachable(name, shape, schedule, args.dense_layers),
        **env,
    }  # fmt: skip
    row["target"] = rollout_target(speedup, limits, env.get("gpu_kind"))
    del engine, decoder
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and args.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before sparrow_kernels is imported
    import sparrow_kernels
    from sparse_attention import environment

    env = environment(sparrow_kernels, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started, rows = time.perf_counter(), []
    for name in args.models:
        if time.perf_counter() - started > args.time_budget_s:
            print(f"skipped {name}: time budget {args.time_budget_s:.0f} s spent", flush=True)
            continue
        row = run_model(name, args, device, env)
        row["model_s"] = time.perf_counter() - started - sum(r["model_s"] for r in rows)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        t = row["target"]
        print(f"{'PASS' if t['pass'] else 'FAIL'} {name}: speedup {row['speedup']:.2f}x = {t['value']:.0%} of the "
              f"memory-bound limit {t['memory_bound_limit']:.2f}x at batch {t['batch']} (>= {t['limit']:.0%}; "
              f"H100 {row['limits']['h100']['memory_bound_limit']:.2f}x at {row['limits']['h100']['batch']}, "
              f"H200 {row['limits']['h200']['memory_bound_limit']:.2f}x at {row['limits']['h200']['batch']})",
              flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {len(rows)} lines to {args.out} in {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
