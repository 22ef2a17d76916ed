"""Per-layer decode attention time: Sparrow's fused Triton kernels vs dense and "ideal" torch SDPA.

For every configuration (Qwen3 attention shape, batch, cached length, kept fraction) it measures:
- dense: torch SDPA over the whole contiguous cache [B, Hkv, L, D] (the GQA group as G query rows
  per KV head, so K/V are read once);
- ideal: torch SDPA over a contiguous cache of only the kept length (what perfect sparsity costs);
- sparse, per stage: scoring + selection (``select_pages_paged``), attention (``sparse_decode_split``),
  merge (``merge_splits``), and the whole call (``sparse_decode_attention_paged``; on CUDA also
  replayed from a CUDA graph, which removes Python launch overhead);
- the memory-bound floor: (centroid bytes + selected K/V bytes) / copy bandwidth, the bandwidth
  measured here by a large device-to-device copy (bytes read + bytes written per second).
One JSON line per configuration goes to --out (default benchmarks/results/sparse_attention.jsonl),
with GPU name, driver, torch/triton versions and the date.

GPU:  PYTHONPATH=kernels:. python benchmarks/sparse_attention.py
CPU:  TRITON_INTERPRET=1 PYTHONPATH=kernels:. python benchmarks/sparse_attention.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

from sparrow_nemo.model_shapes import get_shape

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = 16
BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


@dataclass(frozen=True)
class Config:
    """One benchmark point: attention shape (from a Qwen3 preset), batch, cached tokens, kept fraction."""

    model: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    cached_len: int
    kept_fraction: float

    @property
    def kept_tokens(self) -> int:
        """Budget in tokens (whole pages, at least the 3 reserved pages)."""
        return max(round(self.kept_fraction * self.cached_len / PAGE), 3) * PAGE


def full_configs(
    models: list[str], batches: list[int], lengths: list[int], fractions: list[float]
) -> list[Config]:
    """The issue's grid: Qwen3 shapes x batch x cached length x kept fraction."""
    out = []
    for name, batch, length, frac in itertools.product(models, batches, lengths, fractions):
        shape = get_shape(name)
        out.append(Config(name, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim, batch,
                          length, frac))  # fmt: skip
    return out


def tiny_configs() -> list[Config]:
    """CPU sizes for the interpreter (seconds, not a measurement of anything real)."""
    return [Config("tiny", 4, 2, 32, 2, 256, 0.25), Config("tiny", 8, 2, 32, 2, 512, 0.10)]


def make_timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    """fn -> mean milliseconds per call (triton's do_bench with L2 flush on CUDA; wall clock on CPU)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=reps))

    def wall(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3

    return wall


def copy_bandwidth(
    device: torch.device, nbytes: int, timer: Callable[[Callable[[], object]], float]
) -> float:
    """Device copy bandwidth in bytes/s, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def graph_timer(fn: Callable[[], object], timer: Callable[[Callable[[], object]], float]) -> float | None:
    """Time fn replayed from a CUDA graph (no Python/launch overhead); None when capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timer(graph.replay)
    except RuntimeError as exc:
        print(f"  CUDA graph capture failed: {exc}", file=sys.stderr)
        return None


def sdpa_ms(cfg: Config, length: int, dtype: torch.dtype, device: torch.device, timer) -> float:
    """torch SDPA for one decode step over a contiguous [B, Hkv, length, D] cache."""
    group = cfg.num_q_heads // cfg.num_kv_heads
    q = torch.randn(cfg.batch, cfg.num_kv_heads, group, cfg.head_dim, dtype=dtype, device=device)
    k = torch.randn(cfg.batch, cfg.num_kv_heads, length, cfg.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    ms = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    return ms


def load_kernels(device: torch.device) -> ModuleType:
    """Import sparrow_kernels, in interpreter mode for CPU (the mode is fixed at first import)."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import sparrow_kernels

    if not sparrow_kernels.available(device):
        raise SystemExit(f"sparrow_kernels cannot run on {device} (CUDA, or CPU with TRITON_INTERPRET=1)")
    return sparrow_kernels


def sweep_attention(sk: ModuleType, args: tuple, timer) -> list[dict]:
    """Attention-stage time over launch knobs (splits, pages per iteration, warps), fastest first."""
    rows = []
    for splits, ppi, warps in itertools.product((1, 2, 4, 8, 16), (2, 4, 8), (4, 8)):
        ms = timer(functools.partial(sk.sparse_decode_split, *args, num_splits=splits, pages_per_iter=ppi,
                                     num_warps=warps))  # fmt: skip
        rows.append({"num_splits": splits, "pages_per_iter": ppi, "num_warps": warps, "attention_ms": ms})
    return sorted(rows, key=lambda r: r["attention_ms"])


def bench_config(sk: ModuleType, cfg: Config, dtype: torch.dtype, device: torch.device, timer, bandwidth: float,
                 num_splits: int | None, sweep: bool) -> dict:  # fmt: skip
    """All timings of one configuration, as a JSON-ready dict (milliseconds, bytes, ratios)."""
    dense = sdpa_ms(cfg, cfg.cached_len, dtype, device, timer)
    ideal = sdpa_ms(cfg, cfg.kept_tokens, dtype, device, timer)

    batch, hkv, d = cfg.batch, cfg.num_kv_heads, cfg.head_dim
    max_pages = -(-cfg.cached_len // PAGE)
    gen = torch.Generator(device=device).manual_seed(0)
    k_pages = torch.randn(batch * max_pages, hkv, PAGE, d, dtype=dtype, device=device, generator=gen)
    v_pages = torch.randn_like(k_pages)
    centroids = torch.randn(batch * max_pages, hkv, d, dtype=torch.float32, device=device, generator=gen)
    block_table = torch.randperm(batch * max_pages, device=device, generator=gen).view(batch, max_pages)
    block_table = block_table.to(torch.int32)
    seq_len = torch.full((batch,), cfg.cached_len, dtype=torch.int32, device=device)
    budget = torch.full((batch,), cfg.kept_tokens, dtype=torch.int32, device=device)
    q = torch.randn(batch, cfg.num_q_heads, d, dtype=dtype, device=device, generator=gen)

    page_idx, counts = sk.select_pages_paged(q, centroids, block_table, seq_len, budget)
    split_args = (q, k_pages, v_pages, block_table, seq_len, page_idx, counts)
    o_part, lse_part = sk.sparse_decode_split(*split_args, num_splits=num_splits)
    total = lambda: sk.sparse_decode_attention_paged(q, k_pages, v_pages, centroids, block_table, seq_len, budget,
                                                     num_splits=num_splits)  # fmt: skip
    out = total()
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError(f"non-finite sparse attention output for {cfg}")
    select = timer(lambda: sk.select_pages_paged(q, centroids, block_table, seq_len, budget))
    attention = timer(lambda: sk.sparse_decode_split(*split_args, num_splits=num_splits))
    merge = timer(lambda: sk.merge_splits(o_part, lse_part, dtype))
    total_ms = timer(total)
    graph_ms = graph_timer(total, timer) if device.type == "cuda" else None
    knobs = sweep_attention(sk, split_args, timer) if sweep else None
    kept_pages = int(counts[0, 0])

    centroid_bytes = batch * hkv * max_pages * d * 4
    kv_bytes = batch * hkv * kept_pages * PAGE * d * BYTES[dtype] * 2
    floor = (centroid_bytes + kv_bytes) / bandwidth * 1e3
    stages = select + attention + merge
    best_total = min(x for x in (total_ms, graph_ms, stages) if x is not None)
    return {
        **asdict(cfg),
        "kept_tokens": cfg.kept_tokens,
        "kept_pages": kept_pages,
        "num_splits": o_part.shape[2],
        "dtype": str(dtype).removeprefix("torch."),
        "dense_sdpa_ms": dense,
        "ideal_sdpa_ms": ideal,
        "select_ms": select,
        "attention_ms": attention,
        "merge_ms": merge,
        "stages_sum_ms": stages,
        "sparse_total_ms": total_ms,
        "sparse_total_graph_ms": graph_ms,
        "centroid_bytes": centroid_bytes,
        "selected_kv_bytes": kv_bytes,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "floor_ms": floor,
        "speedup_vs_dense": dense / best_total,
        "stages_speedup_vs_dense": dense / stages,
        "stages_over_floor": stages / floor,
        "attention_sweep": knobs,
    }


def environment(sk: ModuleType, device: torch.device) -> dict:
    """GPU name, driver, library versions and the date (UTC) for every JSON line."""
    import triton

    driver = None
    if device.type == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            driver = None
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreted": sk.INTERPRETED,
        # timezone.utc, not datetime.UTC (3.11+): GPU images may run an older Python.
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
    }


def check_targets(rows: list[dict]) -> list[str]:
    """The issue's H200 targets, as PASS/FAIL lines (only for configurations that were run)."""
    lines = []
    for row in rows:
        key = (row["model"], row["batch"], row["cached_len"], row["kept_fraction"])
        if key == ("qwen3-8b", 64, 32768, 0.1):
            ok = row["stages_speedup_vs_dense"] >= 5 and row["stages_over_floor"] <= 1.3
            lines.append(f"{'PASS' if ok else 'FAIL'} 8B b64 32K 10%: {row['stages_speedup_vs_dense']:.2f}x dense "
                         f"(>= 5), {row['stages_over_floor']:.2f}x floor (<= 1.3)")  # fmt: skip
        if key == ("qwen3-8b", 64, 32768, 0.25):
            ok = row["stages_speedup_vs_dense"] >= 3
            lines.append(
                f"{'PASS' if ok else 'FAIL'} 8B b64 32K 25%: {row['stages_speedup_vs_dense']:.2f}x dense (>= 3)"
            )
        if row["cached_len"] == 4096 and row["speedup_vs_dense"] < 1:
            lines.append(f"FAIL 4K slower than dense: {key} {row['speedup_vs_dense']:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (native Triton) or cpu (TRITON_INTERPRET=1)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    parser.add_argument("--models", default="qwen3-8b,qwen3-1.7b,qwen3-14b", help="8B first: the targets")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--fractions", default="0.1,0.25")
    parser.add_argument("--num-splits", type=int, default=None, help="override the split heuristic")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sweep", action="store_true", help="also sweep the attention kernel's launch knobs")
    parser.add_argument(
        "--reps", type=int, default=None, help="ms of timing per measurement on CUDA, calls on CPU"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file (overwritten)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    sk = load_kernels(device)
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        configs = tiny_configs()
    else:
        configs = full_configs(args.models.split(","), [int(x) for x in args.batches.split(",")],
                               [int(x) for x in args.lengths.split(",")], [float(x) for x in args.fractions.split(",")])  # fmt: skip
    reps = args.reps or (50 if device.type == "cuda" else 2)
    timer = make_timer(device, reps)
    bandwidth = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (32 << 20), timer)
    env = environment(sk, device)
    out_path = args.out or RESULTS / (
        "sparse_attention_tiny.jsonl" if args.tiny else "sparse_attention.jsonl"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with out_path.open("w") as f:
        for cfg in configs:
            row = {
                **bench_config(sk, cfg, dtype, device, timer, bandwidth, args.num_splits, args.sweep),
                **env,
            }
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{cfg.model:11s} B={cfg.batch:<4d} L={cfg.cached_len:<6d} kept={cfg.kept_fraction:.2f} "
                  f"dense {row['dense_sdpa_ms']:.3f} ideal {row['ideal_sdpa_ms']:.3f} | select {row['select_ms']:.3f} "
                  f"attn {row['attention_ms']:.3f} merge {row['merge_ms']:.3f} total {row['sparse_total_ms']:.3f} "
                  f"graph {row['sparse_total_graph_ms'] or float('nan'):.3f} | floor {row['floor_ms']:.3f} ms "
                  f"-> {row['speedup_vs_dense']:.2f}x dense, stages {row['stages_over_floor']:.2f}x floor", flush=True)  # fmt: skip
            if row["attention_sweep"]:
                best = row["attention_sweep"][0]
                print(f"  fastest attention launch: {best} (default {row['attention_ms']:.3f} ms)")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; wrote {len(rows)} lines to {out_path}")
    for line in check_targets(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
