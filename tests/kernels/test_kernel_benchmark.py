"""The attention benchmark script in its CPU mode (TRITON_INTERPRET=1, tiny shapes).

On a GPU machine these are skipped: there the GPU window (benchmarks/gpu_window.sh) runs the real thing. The
tiny run goes through the compile (warm-up) pass and the rows with their verify case and the launch-knob sweep.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-mode tooling; the GPU runs gpu_window.sh itself"
)


def _load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "sparse_attention_bench", REPO / "benchmarks" / "sparse_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_target_points_come_first_and_targets_are_judged_per_row() -> None:
    bench = _load_benchmark()
    configs = bench.full_configs(["qwen3-1.7b", "qwen3-8b"], [64], [4096, 32768], [0.1, 0.25])
    assert [c.key for c in configs[:4]] == bench.TARGET_POINTS
    assert len({c.key for c in configs}) == len(configs) == 8
    base = {"model": "qwen3-8b", "batch": 64, "cached_len": 32768, "verify_over_dense_decode": 1.2}
    row = {**base, "kept_fraction": 0.1, "stages_speedup_vs_dense": 5.5, "stages_over_floor": 1.35,
           "speedup_vs_dense": 5.6}  # fmt: skip
    targets = bench.check_targets(row)
    assert targets["32K_10pct_speedup"]["pass"] and not targets["32K_10pct_over_floor"]["pass"]
    assert targets["verify_k8_over_dense_decode"]["pass"]
    row = {**base, "kept_fraction": 0.25, "stages_speedup_vs_dense": 2.5, "speedup_vs_dense": 2.6}
    assert list(bench.check_targets(row)) == ["32K_25pct_speedup"]
    row = {**base, "cached_len": 4096, "kept_fraction": 0.25, "speedup_vs_dense": 0.9}
    lines = bench.target_lines({**row, "targets": bench.check_targets(row)})
    assert lines == ["FAIL 4K_25pct_not_slower (qwen3-8b b64 4096 25%): 0.90 >= 1.0"]
    assert bench.check_targets({**row, "model": "qwen3-14b", "cached_len": 16384}) == {}


@cpu_only
@pytest.mark.slow  # ~30 s of interpreter work
def test_tiny_cpu_run_warms_up_then_measures_every_row(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO / 'kernels'}:{REPO}"}
    base = [
        sys.executable,
        str(REPO / "benchmarks" / "sparse_attention.py"),
        "--tiny",
        "--device",
        "cpu",
        "--sweep",
    ]
    for extra, name in ((["--warmup-only"], "warmup"), (["--reps", "1"], "bench")):
        proc = subprocess.run([*base, *extra, "--out", str(tmp_path / f"{name}.jsonl")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path
    bench = _load_benchmark()
    tiny = bench.tiny_configs()
    warm = [json.loads(line) for line in (out / "warmup.jsonl").read_text().splitlines()]
    assert [w["stage"] for w in warm] == ["warmup"] * len(tiny) + ["warmup_total"]
    assert all(w["compile_s"] > 0 for w in warm[:-1])
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert rows[-1]["stage"] == "summary" and rows[-1]["rows"] == len(tiny)
    for row, cfg in zip(rows, tiny):
        assert (row["model"], row["batch"], row["cached_len"]) == (cfg.model, cfg.batch, cfg.cached_len)
        assert row["kept_pages"] == cfg.kept_tokens // 16 and row["interpreted"] is True
        for key in ("dense_sdpa_ms", "ideal_sdpa_ms", "select_ms", "attention_ms", "sparse_total_ms",
                    "dense_decode_kernel_ms", "verify_kernel_ms", "verify_sdpa_ms", "first_call_s"):  # fmt: skip
            assert row[key] > 0, key
        # The floor counts the centroids in their real dtype (the cache's: bf16 here), not float32.
        assert row["centroid_dtype"] == row["dtype"] == "bfloat16"
        assert (
            row["centroid_bytes"] == cfg.batch * cfg.num_kv_heads * (cfg.cached_len // 16) * cfg.head_dim * 2
        )
        assert (
            row["selected_kv_bytes"]
            == cfg.batch * cfg.num_kv_heads * row["kept_pages"] * 16 * cfg.head_dim * 4
        )
        floor = (row["centroid_bytes"] + row["selected_kv_bytes"]) / (row["copy_bandwidth_GBps"] * 1e9) * 1e3
        assert row["floor_ms"] == pytest.approx(floor)
        assert {"gpu", "driver", "torch", "triton", "date", "commit", "gpu_kind"} <= row.keys()
        # one layer's bytes dense / sparse: the same limit on either GPU kind
        dense = cfg.batch * cfg.num_kv_heads * cfg.cached_len * cfg.head_dim * 2 * 2
        assert row["memory_bound_limit"] == pytest.approx(
            dense / (row["centroid_bytes"] + row["selected_kv_bytes"])
        )
        assert (
            row["limits"]["h100"]
            == row["limits"]["h200"]
            == {"batch": 2, "memory_bound_limit": row["memory_bound_limit"]}
        )
    sweep = rows[0]["attention_sweep"]
    assert {s["num_splits"] for s in sweep} == {1, 2} and all(s["attention_ms"] > 0 for s in sweep)
    assert rows[1]["attention_sweep"] is None
