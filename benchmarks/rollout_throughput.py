"""Rollout throughput of the torch rollout engine: dense vs sparse schedules, one JSON line per configuration.

Random weights of a Qwen3 shape preset, random prompts, EOS ignored. Each configuration (batch size x
schedule, the dense run included) is appended as one JSON object to
``benchmarks/results/rollout_throughput.jsonl`` with the machine, date and library versions.

Examples:
    python benchmarks/rollout_throughput.py --shape tiny --batch 8 --prompt-len 64 --gen-len 512 \
        --schedules fixed:64 --threads 1
    python benchmarks/rollout_throughput.py --shape qwen3-1.7b --device cuda --dtype bf16 --batch 64 \
        --prompt-len 512 --gen-len 4096 --schedules qwen3-1.7b-0.86 fixed:1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

from sparrow_nemo.rollout.tools.bench import bench_rollout, make_engine

RESULTS = Path(__file__).resolve().parent / "results" / "rollout_throughput.jsonl"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def machine_info(device: str) -> dict[str, str | int | None]:
    """Where the numbers were measured: host, OS, CPU count, GPU name, library versions, UTC date."""
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", help="Qwen3 shape preset (sparrow_nemo.model_shapes.PRESETS)")
    p.add_argument("--batch", type=int, nargs="+", default=[8], help="batch sizes (one configuration each)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument(
        "--schedules",
        nargs="+",
        default=["fixed:64"],
        help="schedules besides dense: presets or schedule YAML files",
    )
    p.add_argument("--bin-tokens", type=int, default=None, help="bin width of the acceptance tail")
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="JSONL file to append to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = machine_info(args.device)
    rows = []
    engine = make_engine(
        args.shape,
        device=args.device,
        dtype=DTYPES[args.dtype],
        seed=args.seed,
        dense_layers=args.dense_layers,
        attention_backend=args.backend,
    )
    for batch in args.batch:
        rows += bench_rollout(
            engine,
            batch=batch,
            prompt_len=args.prompt_len,
            gen_len=args.gen_len,
            schedules=args.schedules,
            seed=args.seed,
            tail_bin_tokens=args.bin_tokens,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(
                json.dumps({"benchmark": "rollout_throughput", "shape": args.shape, **meta, **row}) + "\n"
            )
    print(f"wrote {len(rows)} lines to {args.out}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
