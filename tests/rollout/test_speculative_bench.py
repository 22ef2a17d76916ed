"""benchmarks/speculative_rollout.py at a tiny size: the README command's logic, not its numbers.

The run writes one complete JSON line per arm (machine, load, date, configuration, decode tokens/s, speedup
over the same run's dense arm) with consistent draft statistics for the speculative arms; the sparse schedule
grows with the cached length in whole pages. Timing values are only checked to be positive.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ._helpers import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("speculative_rollout")


def test_fraction_schedule_grows_in_whole_pages(bench) -> None:
    schedule = bench.fraction_schedule(0.1, 2176, 256, 16)
    assert len(schedule.budgets) == 9 and schedule.budgets[0] == 64  # the 4-page floor
    assert schedule.budgets[-1] == 16 * -(-int(0.1 * 9 * 256) // 16)
    assert all(b % 16 == 0 for b in schedule.budgets) and list(schedule.budgets) == sorted(schedule.budgets)


def test_tiny_run_writes_one_consistent_line_per_arm(bench, tmp_path: Path) -> None:
    out = tmp_path / "spec.jsonl"
    args = ["--shape", "tiny-test", "--batch", "2", "--prompt-len", "40", "--gen-len", "12", "--ks", "2", "5"]
    args += [
        "--draft-budgets",
        "8",
        "--bin-tokens",
        "16",
        "--page-size",
        "4",
        "--repeats",
        "2",
        "--group",
        "2",
    ]
    args += ["--warmup-tokens", "3"]
    rows = bench.main([*args, "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    arms = [
        "dense",
        "sparse",
        "speculative k=2",
        "speculative k=2 draft=8",
        "speculative k=5",
        "speculative k=5 draft=8",
    ]
    assert [r["arm"] for r in lines] == arms == [r["arm"] for r in rows]
    assert (
        lines[3]["schedule"] == [8] and lines[2]["schedule"] == lines[1]["schedule"]
    )  # what each arm drafted with
    for r in lines:
        assert {"host", "date", "load_avg_1m", "load_avg_1m_after", "batch", "prompt_len", "gen_len"} <= set(
            r
        )
        assert r["decode_tokens_per_s"] > 0 and len(r["decode_s"]) == len(r["decode_cpu_s"]) == 2
        assert r["decode_tokens_per_cpu_s"] > 0
    assert lines[0]["speedup_vs_dense"] == lines[0]["speedup_vs_dense_cpu"] == 1.0
    assert lines[0]["predicted_speedup_fitted"] == pytest.approx(1.0)  # dense over itself
    assert all(
        r["predicted_speedup_fitted"] > 0 and r["fitted_hardware"]["name"] == "cpu (fitted)" for r in lines
    )
    assert lines[0]["target"] is None and lines[0]["warmup_s"] > 0 and lines[0]["group"] == 2
    for r in lines[1:]:  # per GPU kind, the batch that fits at this context and the arm's memory-bound limit
        assert set(r["limits"]) == {"h100", "h200", "ran"} and r["limits"]["ran"]["batch"] == 2
        assert r["limits"]["h200"]["batch"] >= r["limits"]["h100"]["batch"] > 0
        limit = r["limits"]["ran"]["memory_bound_limit"]
        assert limit > 0 and r["target"]["value"] == pytest.approx(r["speedup_vs_dense"] / limit)
        assert r["target"]["pass"] == (r["target"]["value"] >= 0.8)
    for r in lines[2:]:
        assert 0.0 <= r["alpha"] <= 1.0 + 1e-6 and 0.0 <= r["accept_rate"] <= 1.0
        assert 1.0 <= r["tokens_per_verify"] <= r["k"] + 1
        assert 1.0 <= r["predicted_tokens_per_verify"] <= r["k"] + 1


def test_gpu_lines_carry_the_driver_and_library_versions(bench) -> None:
    """A GPU run's lines add sparse_attention.environment's fields (here on the CPU device: no driver)."""
    env = bench._gpu_environment(torch.device("cpu"))
    assert {"gpu", "driver", "cuda", "torch", "triton", "interpreted", "date"} <= set(env)
    assert env["driver"] is None and env["device"] == "cpu"
