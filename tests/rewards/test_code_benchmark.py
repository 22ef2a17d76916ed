"""benchmarks/code_sandbox.py runs and writes one JSON line per problem shape with machine and date."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_sandbox_benchmark_writes_its_lines(sandbox: None, tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    script = REPO / "benchmarks" / "code_sandbox.py"
    subprocess.run(
        [sys.executable, str(script), "--repeats", "1", "--out", str(out)], check=True, timeout=300
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["shape"] for r in rows] == ["humaneval_1_case", "asserts_3_cases", "stdio_3_cases"]
    assert all(r["os_median_s"] > 0 and r["os_over_unsafe"] > 0 and "date" in r and r["cpus"] for r in rows)
