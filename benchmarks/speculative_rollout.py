"""Dense vs scheduled sparse vs speculative rollout on the CPU at long context, measured in one run.

The torch rollout engine over random weights of a Qwen3 shape preset generates ``--gen-len`` tokens after
prompts of ``--prompt-len`` tokens (so the cached length runs from prompt-len to prompt-len + gen-len), batch
``--batch``, sampling at temperature 1 (as RL rollouts), no stop token. Arms, interleaved ``--repeats`` times
(each arm once per repeat; the median decode time counts, so load changes hit every arm alike):

- ``dense``: every layer reads the whole cache each step;
- ``sparse``: the paper's scheduled sparse rollout: per bin of ``--bin-tokens`` cached tokens, a budget of
  ``--fraction`` of the bin's upper end (rounded up to whole pages, at least 4 pages), non-decreasing;
- ``speculative k=K``: the same schedule drafts K tokens per dense verify (lossless: dense-distributed);
  with ``--draft-budgets``, also ``speculative k=K draft=N``: drafts under a fixed N-token budget instead.

Decode tokens/s excludes the prefill (the same work in every arm), twice: per second of wall time, and per
second of this process's CPU time (one torch thread: the CPU time of a generate minus the median over the
repeats of a 1-token generate of the same prompts, so that one slow probe cannot turn a repeat negative), which
a shared, loaded machine disturbs much less; the
speedups over dense are medians over the repeats of each repeat's ratio. Each arm is one JSON line appended to
``benchmarks/results/speculative_rollout.jsonl`` with the machine, the 1-minute load average before and after the run,
the date, the speedup over dense of the same run, and for the speculative arms the measured acceptance
(exact sum_v min(p, q) of the tested drafts), accept rate, tokens per verify and the tokens per verify the
acceptance predicts, E = (1 - alpha^(k+1)) / (1 - alpha).

On a GPU (``--device cuda --dtype bf16``; benchmarks/gpu_window.sh runs it at the 1.7B shape with 32K-token
contexts) the weights are drawn on the device and the engine takes the fused Triton kernels: dense and sparse
arms decode from a CUDA graph, the speculative arms run eagerly with the Triton verify kernel; the cost model
is the GPU's preset (``rollout_hardware("auto", ...)``) and there is no CPU-time column. Weights are random,
so alpha is that of a random model at this context, not a trained one's. ``--group G`` makes the batch
``batch / G`` prompts of ``G`` samples each (the engine prefills a GRPO group's prompt once);
``--warmup-tokens N`` runs each arm once untimed first (Triton compiles, the first prefill). Each arm's line
is written as soon as its last repeat finishes, with per GPU kind the batch that fits at this context and the
memory-bound limit of the arm there (:mod:`gpu_targets`: the cost model without its compute term, with the
measured alpha), and the arm's target on the GPU it ran on (speedup >= 80 % of the limit at its batch).

Example (docs/results.md's numbers):
    python benchmarks/speculative_rollout.py --batch 32 --prompt-len 1920 --gen-len 256 --ks 4 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_targets import KINDS, commit, fitting_batch, judge, memory_bound_model
from rollout_throughput import machine_info

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.tools.cost_fit import engine_cost_model, fit_cpu_hardware, rollout_hardware
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule
from sparrow_nemo.sparse.speculative_cost import (
    SpeculativeCostModel,
    SpeculativePlan,
    expected_tokens_per_verify,
)

RESULTS = Path(__file__).resolve().parent / "results" / "speculative_rollout.jsonl"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", help="Qwen3 shape preset (sparrow_nemo.model_shapes.PRESETS)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1920)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--ks", type=int, nargs="+", default=[4, 8], help="draft tokens per verify (one arm each)")
    p.add_argument("--draft-budgets", type=int, nargs="*", default=[],
                   help="fixed draft budgets (tokens, whole pages): one more speculative arm per k and budget")  # fmt: skip
    p.add_argument("--fraction", type=float, default=0.1, help="sparse budget, fraction of the bin's length")
    p.add_argument("--bin-tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="weights and KV cache")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="decode attention (auto: triton on CUDA, torch on the CPU; triton on the CPU needs TRITON_INTERPRET=1)")  # fmt: skip
    p.add_argument("--group", type=int, default=1, help="samples per prompt (batch / group distinct prompts)")
    p.add_argument("--warmup-tokens", type=int, default=0, help="tokens of each arm's untimed first generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    return p.parse_args(argv)


def fraction_schedule(fraction: float, max_len: int, bin_tokens: int, page_size: int) -> BudgetSchedule:
    """Budget per bin = ``fraction`` of the bin's upper end, whole pages, >= 4 pages, non-decreasing."""
    budgets = []
    for i in range(math.ceil(max_len / bin_tokens)):
        pages = max(4, math.ceil(fraction * (i + 1) * bin_tokens / page_size))
        budgets.append(max(pages * page_size, budgets[-1] if budgets else 0))
    return BudgetSchedule(bin_tokens, tuple(budgets), page_size, name=f"fraction:{fraction:g}")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    shape, dtype, device = PRESETS[args.shape], DTYPES[args.dtype], torch.device(args.device)
    if device.type == "cuda":  # drawn on the device: a CPU generator takes minutes at 8B
        from rollout_speedup import random_decoder

        decoder = random_decoder(shape, dtype, device, args.seed)
    else:
        decoder = Qwen3Decoder.random(shape, seed=args.seed, dtype=dtype, device=device)
    engine = TorchRolloutEngine(decoder, dense_layers=args.dense_layers, page_size=args.page_size,
                                attention_backend=args.backend, prefill_chunk_tokens=512)  # fmt: skip
    on_cpu = engine.device.type == "cpu"  # CPU time per arm is measured only there
    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.shape.vocab_size
    distinct = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
                for _ in range(math.ceil(args.batch / args.group))]  # fmt: skip
    prompts = [distinct[i // args.group] for i in range(args.batch)]
    sampling = SamplingParams(
        max_new_tokens=args.gen_len, temperature=1.0, seed=args.seed + 1, stop_token_ids=()
    )
    schedule = fraction_schedule(
        args.fraction, args.prompt_len + args.gen_len, args.bin_tokens, args.page_size
    )
    dense = BudgetSchedule.dense(args.bin_tokens, args.page_size)
    arms = {"dense": (dense, None), "sparse": (schedule, None)}
    for k in args.ks:
        arms[f"speculative k={k}"] = (schedule, SpeculativeConfig(draft_tokens=(k,)))
        for n in args.draft_budgets:
            draft = BudgetSchedule(args.bin_tokens, (n,), args.page_size, name=f"fixed:{n}")
            arms[f"speculative k={k} draft={n}"] = (schedule, SpeculativeConfig((k,), draft_schedule=draft))

    # the decode cost model of this engine (sparrow_nemo.rollout.tools.cost_fit): fitted to this CPU, or the GPU's preset
    hardware = (
        fit_cpu_hardware(engine, batch=args.batch, seed=args.seed)
        if on_cpu
        else rollout_hardware("auto", engine)
    )
    fitted = engine_cost_model(engine, hardware)
    first_token = replace(sampling, max_new_tokens=1)
    times: dict[str, list[float]] = {name: [] for name in arms}
    generate_cpu: dict[str, list[float]] = {name: [] for name in arms}  # a generate's CPU seconds, prefill in
    prefill_cpu: list[float] = []  # per repeat, a 1-token generate's: the prefill's CPU time, to subtract
    stats: dict[str, dict] = {}
    started = time.perf_counter()
    for sched, spec in arms.values() if args.warmup_tokens else ():
        engine.generate(
            prompts, replace(sampling, max_new_tokens=args.warmup_tokens), sched, speculative=spec
        )
    warmup_s = time.perf_counter() - started
    meta = {
        **machine_info(args.device),
        **({} if on_cpu else _gpu_environment(engine.device)),
        "dtype": args.dtype,
        "backend": engine.backend,
        "load_avg_1m": load,
        "benchmark": "speculative_rollout",
        "shape": args.shape,
        "warmup_s": warmup_s,
        "commit": commit(),
    }
    config = {k: getattr(args, k) for k in ("batch", "group", "prompt_len", "gen_len", "fraction", "bin_tokens",
                                             "page_size", "dense_layers", "repeats", "warmup_tokens")}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        if on_cpu:
            c0 = time.process_time()
            engine.generate(prompts, first_token, dense)
            prefill_cpu.append(time.process_time() - c0)
        for name, (sched, spec) in arms.items():
            c0 = time.process_time()
            out = engine.generate(prompts, sampling, sched, speculative=spec)
            if on_cpu:
                generate_cpu[name].append(time.process_time() - c0)
            times[name].append(out.decode_s)
            if spec is not None and repeat == 0:
                stats[name] = _draft_stats(out.samples, spec.draft_tokens[0])
            decode_cpu = generate_cpu[name][-1] - statistics.median(prefill_cpu) if on_cpu else 0.0
            per_cpu = f", {out.num_response_tokens / decode_cpu:.0f} tok/s CPU" if on_cpu else ""
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {out.num_response_tokens / out.decode_s:.0f} tok/s wall"
                  f"{per_cpu} ({time.perf_counter() - started:.0f} s elapsed)", file=sys.stderr)  # fmt: skip
            if repeat == args.repeats - 1:  # the arm's line, written at once (a killed run keeps it)
                rows.append(_arm_row(name, sched, spec, times, generate_cpu, prefill_cpu, stats, fitted, args, meta,
                                     config))  # fmt: skip
                with args.out.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    print(f"{'arm':<30} {'tok/s':>8} {'vs dense':>9} {'CPU tok/s':>9} {'vs dense':>9} {'fitted':>7} {'alpha':>6} "
          f"{'tok/verify':>10} {'predicted':>9}")  # fmt: skip
    for r in rows:
        extra = (
            f"{r['alpha']:>6.3f} {r['tokens_per_verify']:>10.2f} {r['predicted_tokens_per_verify']:>9.2f}"
            if "alpha" in r
            else ""
        )
        per_cpu = (
            f"{r['decode_tokens_per_cpu_s']:>9.0f} {r['speedup_vs_dense_cpu']:>8.2f}x"
            if on_cpu
            else f"{'-':>9} {'-':>9}"
        )
        print(f"{r['arm']:<30} {r['decode_tokens_per_s']:>8.0f} {r['speedup_vs_dense']:>8.2f}x {per_cpu} "
              f"{r['predicted_speedup_fitted']:>6.2f}x {extra}")  # fmt: skip
        if r["target"] is not None:
            t = r["target"]
            print(f"  {'PASS' if t['pass'] else 'FAIL'} {r['arm']}: {t['value']:.0%} of the memory-bound limit "
                  f"{t['memory_bound_limit']:.2f}x at batch {t['batch']} (>= 80%; H100 "
                  f"{r['limits']['h100']['memory_bound_limit']:.2f}x at {r['limits']['h100']['batch']}, H200 "
                  f"{r['limits']['h200']['memory_bound_limit']:.2f}x at {r['limits']['h200']['batch']})")  # fmt: skip
    print(f"wrote {len(rows)} lines to {args.out} (load average {load:.1f} before the run, "
          f"{rows[-1]['load_avg_1m_after']:.1f} after)", file=sys.stderr)  # fmt: skip
    return rows


def _arm_row(name, sched, spec, times, generate_cpu, prefill_cpu, stats, fitted, args, meta, config) -> dict:
    """One arm's JSON line once its last repeat finished (dense's are all in: it runs first in every repeat)."""
    on_cpu = bool(prefill_cpu)
    tokens = args.batch * args.gen_len
    prefill = statistics.median(prefill_cpu) if on_cpu else 0.0
    cpu = {
        arm: [c - prefill for c in raw] for arm, raw in generate_cpu.items() if raw
    }  # the decodes' CPU seconds
    drafted = sched if spec is None else spec.schedule_for(sched)
    speedup = statistics.median(d / t for d, t in zip(times["dense"], times[name]))
    shape = PRESETS[args.shape]
    bound = memory_bound_model(shape, args.dense_layers)
    limits = {}
    for kind in KINDS:
        fit = fitting_batch(shape, kind, args.prompt_len + args.gen_len)
        limit = _predicted_speedup(bound, sched, spec, stats.get(name), args, fit) if fit else float("nan")
        limits[kind] = {"batch": fit, "memory_bound_limit": limit}
    limits["ran"] = {"batch": args.batch,
                     "memory_bound_limit": _predicted_speedup(bound, sched, spec, stats.get(name), args, args.batch)}  # fmt: skip
    target = None
    if name != "dense":
        target = judge(speedup / limits["ran"]["memory_bound_limit"], 0.8, ">=")
        target.update(
            gpu_kind=meta.get("gpu_kind"),
            batch=args.batch,
            memory_bound_limit=limits["ran"]["memory_bound_limit"],
        )
    return {
        **meta, **config, "arm": name, "schedule": list(drafted.budgets), "load_avg_1m_after": os.getloadavg()[0],
        "decode_tokens_per_s": tokens / statistics.median(times[name]),
        "decode_tokens_per_cpu_s": tokens / statistics.median(cpu[name]) if on_cpu else None,
        "decode_s": times[name], "decode_cpu_s": cpu[name] if on_cpu else None,
        "speedup_vs_dense": speedup,
        "speedup_vs_dense_cpu": (
            statistics.median(d / t for d, t in zip(cpu["dense"], cpu[name])) if on_cpu else None
        ),
        "predicted_speedup_fitted": _predicted_speedup(fitted, sched, spec, stats.get(name), args, args.batch),
        "fitted_hardware": asdict(fitted.hardware), "limits": limits, "target": target,
        **stats.get(name, {}),
    }  # fmt: skip


def _predicted_speedup(model: DecodeCostModel, schedule, spec, stats: dict | None, args, batch: int) -> float:
    """A cost model's speedup over dense for an arm at ``batch``: a schedule, or speculation with its measured alpha."""
    lengths, prompt = [args.gen_len] * batch, args.prompt_len
    if spec is None:
        return model.predicted_speedup(schedule, lengths, prompt)
    draft = spec.schedule_for(schedule)
    bins = (prompt + args.gen_len) // args.bin_tokens + 1
    plan = SpeculativePlan(
        args.bin_tokens,
        tuple(draft.budgets[min(b, len(draft.budgets) - 1)] for b in range(bins)),
        (spec.draft_tokens[0],) * bins,
    )
    return SpeculativeCostModel(model, args.page_size).predicted_speedup(
        plan, [stats["alpha"]], lengths, prompt
    )


def _gpu_environment(device: torch.device) -> dict:
    """Driver, CUDA and Triton versions for a GPU run (sparse_attention.environment's fields)."""
    import sparrow_kernels
    from sparse_attention import environment

    return environment(sparrow_kernels, device)


def _draft_stats(samples, k: int) -> dict[str, float]:
    logs = [s.draft for s in samples]
    alpha = float(torch.cat([d.alpha for d in logs]).double().mean())
    accepted = sum(int(d.accepted.sum()) for d in logs)
    verifies = sum(d.verifies for d in logs)
    emitted = sum(s.response_ids.numel() - 1 for s in samples)
    return {
        "k": k,
        "alpha": alpha,
        "accept_rate": accepted / sum(d.accepted.numel() for d in logs),
        "tokens_per_verify": emitted / verifies,
        "predicted_tokens_per_verify": float(expected_tokens_per_verify(alpha, k)),
    }


if __name__ == "__main__":
    main()
