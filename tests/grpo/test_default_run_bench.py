"""benchmarks/default_run.py at a tiny size: the README command's logic, not its numbers.

One `sparrow train` of the default recipe from an empty cache (the shipped warm-start copied and hash-checked),
cut down by overrides to one short step: the JSON line carries the command, the machine, the wall time and the
run's summary, and the table reads it (accuracies, median length, speedup, the rule's and the paper's tails).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

TINY = [
    "trainer.max_steps=1",
    "control.calibrate=false",
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "evaluation.num_prompts=2",
    "rollout.max_new_tokens=96",
    "checkpoint.enabled=false",
    "logging.plots=false",
    "logging.progress_bar=false",
]


def test_one_seed_writes_its_summary_and_the_table_reads_it(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("default_run_bench", REPO / "benchmarks" / "default_run.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "default_run.jsonl"
    argv = ["--seeds", "3", "--jobs", "1", "--out", str(out)]
    (row,) = bench.main([*argv, *(f"--override={o}" for o in TINY)])
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert line == json.loads(json.dumps(row))
    assert line["command"].startswith("sparrow train rollout.seed=3 trainer.max_steps=1"), line["command"]
    assert line["wall_s"] > 0 and line["torch_threads"] >= 1 and "date" in line
    summary = line["summary"]
    assert summary["steps"] == 1 and summary["tail_statistic"] == "p1"
    for key in ("accuracy_start", "accuracy_end", "accuracy_start_dense", "accuracy_end_dense"):
        assert 0.0 <= summary[key] <= 1.0, key
    assert summary["measured_rollout_speedup"] > 0
    table = capsys.readouterr().out
    assert "rule tail ok  p5 ok" in table and "mean: sparse" in table and f"wrote 1 lines to {out}" in table
