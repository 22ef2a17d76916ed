"""The benchmark script and the one-shot GPU check, in their CPU modes (TRITON_INTERPRET=1).

On a GPU machine these are skipped: there benchmarks/gpu_check.sh runs the real thing.
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
    torch.cuda.is_available(), reason="CPU-mode tooling; the GPU runs gpu_check.sh itself"
)


def _load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "sparse_attention_bench", REPO / "benchmarks" / "sparse_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@cpu_only
def test_tiny_benchmark_writes_one_line_per_config(tmp_path: Path, device: torch.device) -> None:
    bench = _load_benchmark()
    out = tmp_path / "bench.jsonl"
    assert bench.main(["--tiny", "--device", "cpu", "--reps", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(bench.tiny_configs())
    for row, cfg in zip(rows, bench.tiny_configs()):
        assert row["model"] == cfg.model and row["batch"] == cfg.batch and row["cached_len"] == cfg.cached_len
        assert row["kept_pages"] == cfg.kept_tokens // 16
        for key in (
            "dense_sdpa_ms",
            "ideal_sdpa_ms",
            "select_ms",
            "attention_ms",
            "merge_ms",
            "sparse_total_ms",
        ):
            assert row[key] > 0, key
        assert (
            row["centroid_bytes"] == cfg.batch * cfg.num_kv_heads * (cfg.cached_len // 16) * cfg.head_dim * 4
        )
        assert (
            row["selected_kv_bytes"]
            == cfg.batch * cfg.num_kv_heads * row["kept_pages"] * 16 * cfg.head_dim * 2 * 2
        )
        floor = (row["centroid_bytes"] + row["selected_kv_bytes"]) / (row["copy_bandwidth_GBps"] * 1e9) * 1e3
        assert row["floor_ms"] == pytest.approx(floor)
        assert {"gpu", "driver", "torch", "triton", "date"} <= row.keys() and row["interpreted"] is True


def test_target_lines() -> None:
    bench = _load_benchmark()
    base = {"model": "qwen3-8b", "batch": 64, "cached_len": 32768}
    rows = [
        {**base, "kept_fraction": 0.1, "stages_speedup_vs_dense": 5.5, "stages_over_floor": 1.2, "speedup_vs_dense": 5.6},
        {**base, "kept_fraction": 0.25, "stages_speedup_vs_dense": 2.5, "stages_over_floor": 1.1, "speedup_vs_dense": 2.5},
        {**base, "cached_len": 4096, "kept_fraction": 0.25, "stages_speedup_vs_dense": 0.9, "stages_over_floor": 2.0,
         "speedup_vs_dense": 0.9},
    ]  # fmt: skip
    lines = bench.check_targets(rows)
    assert lines[0].startswith("PASS 8B b64 32K 10%")
    assert lines[1].startswith("FAIL 8B b64 32K 25%")
    assert lines[2].startswith("FAIL 4K slower than dense")


@cpu_only
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "RESULTS_DIR": str(tmp_path / "results"), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "out" / "gpu_check_dry.log").read_text()
    assert "summary: imports=0 tests=0 benchmark=0" in log
    assert "imports ok; INTERPRETED = True" in log
    lines = (tmp_path / "out" / "gpu_check_dry_bench.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["interpreted"] is True
