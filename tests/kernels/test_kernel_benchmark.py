"""The benchmark script and the one-shot GPU check, rehearsed in their CPU modes (TRITON_INTERPRET=1).

On a GPU machine these are skipped: there benchmarks/gpu_check.sh runs the real thing. The dry run
goes through every stage of the GPU script with tiny shapes: the compile (warm-up) pass, the rows
with their verify case and the launch-knob sweep, per-stage timings and the copy to $OUT.
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
@pytest.mark.slow  # ~30 s of interpreter work; CI runs it (the rehearsal of the GPU script)
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "RESULTS_DIR": str(tmp_path / "results"), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable}  # fmt: skip
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    log = (out / "gpu_check_dry.log").read_text()
    assert "summary: imports=0 tests=0 compile=0 benchmark=0" in log
    assert "imports ok; INTERPRETED = True" in log
    stages = [json.loads(line) for line in (out / "gpu_check_dry_stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == ["imports", "tests", "compile", "benchmark"]
    assert all(s["rc"] == 0 and 0 <= s["seconds"] <= s["limit_s"] for s in stages)

    bench = _load_benchmark()
    tiny = bench.tiny_configs()
    warm = [json.loads(line) for line in (out / "gpu_check_dry_warmup.jsonl").read_text().splitlines()]
    assert [w["stage"] for w in warm] == ["warmup"] * len(tiny) + ["warmup_total"]
    assert all(w["compile_s"] > 0 for w in warm[:-1])
    rows = [json.loads(line) for line in (out / "gpu_check_dry_bench.jsonl").read_text().splitlines()]
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
        assert {"gpu", "driver", "torch", "triton", "date"} <= row.keys()
    sweep = rows[0]["attention_sweep"]
    assert {s["num_splits"] for s in sweep} == {1, 2} and all(s["attention_ms"] > 0 for s in sweep)
    assert rows[1]["attention_sweep"] is None
