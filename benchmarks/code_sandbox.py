"""What the code reward's isolation costs: seconds per reward, OS sandbox vs no isolation, side by side.

For three problem shapes (a HumanEval-style check, three asserts, three stdin/stdout cases) it scores an
honest solution ``--repeats`` times with ``reward.options.sandbox=os`` (bubblewrap; the tests in a checker
sandbox, the program in a fresh one per case) and with ``unsafe_local`` (plain child processes), in
alternation, and writes one JSON line per shape to --out (default benchmarks/results/code_sandbox.jsonl)
with the medians, their ratio, the machine (CPUs, load average, kernel) and the UTC date.

    .venv/bin/python benchmarks/code_sandbox.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

from sparrow_nemo.rewards.code import code_reward

RESULTS = Path(__file__).resolve().parent / "results"
ADD = "def add(a, b):\n    return a + b\n"
SHAPES = {
    "humaneval_1_case": (
        ADD,
        {
            "format": "humaneval",
            "prompt": 'def add(a, b):\n    """a + b"""\n',
            "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
            "entry_point": "add",
        },
    ),
    "asserts_3_cases": (ADD, ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]),
    "stdio_3_cases": (
        "print(sum(map(int, input().split())))\n",
        {"format": "stdio", "inputs": ["2 3\n", "-1 1\n", "0 0\n"], "outputs": ["5", "0", "0"]},
    ),
}


def _seconds(program: str, spec: object, sandbox: str) -> float:
    start = time.perf_counter()
    assert code_reward(program, spec, sandbox=sandbox) == 1.0
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "code_sandbox.jsonl")
    args = parser.parse_args()
    machine = {
        "cpus": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, (program, spec) in SHAPES.items():
        times: dict[str, list[float]] = {"os": [], "unsafe_local": []}
        for _ in range(args.repeats):
            for sandbox in times:  # alternating: both see the same machine load
                times[sandbox].append(_seconds(program, spec, sandbox))
        row = {
            "shape": name,
            "repeats": args.repeats,
            "os_median_s": statistics.median(times["os"]),
            "unsafe_local_median_s": statistics.median(times["unsafe_local"]),
        }
        row["os_over_unsafe"] = row["os_median_s"] / row["unsafe_local_median_s"]
        row |= machine
        print(json.dumps(row))
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
