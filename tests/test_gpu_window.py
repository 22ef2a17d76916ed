"""benchmarks/gpu_window.sh rehearsed on the CPU (--dry, what CI runs), and its $OUT read by gpu_results.py.

The dry run goes through every stage of the GPU call (the tests collected, tiny torch runs of the benchmarks,
the megatron training step at the tiny shape) and writes what the device call would bring back; a stage made
to time out (WINDOW_STAGE_LIMITS) makes the window exit non-zero while the later stages still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STAGES = ["env", "correctness", "kernels", "rollout", "speculative", "train"]
RESULTS = {"kernels": "kernels.jsonl", "rollout": "rollout.jsonl", "speculative": "speculative.jsonl",
           "train": "train_step.jsonl"}  # fmt: skip
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU rehearsal; a GPU runs the call itself"
)


def window(out: Path, *args: str, limits: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "WINDOW_STAGE_LIMITS", "TRITON_INTERPRET")}
    env.update(OUT=str(out), PYTHON=sys.executable)
    if limits is not None:
        env["WINDOW_STAGE_LIMITS"] = limits
    cmd = ["bash", str(REPO / "benchmarks" / "gpu_window.sh"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_stage_limits_fit_one_window(tmp_path: Path) -> None:
    proc = window(tmp_path, "--limits")
    assert proc.returncode == 0, proc.stderr
    limits = [line.split() for line in proc.stdout.splitlines()]
    assert [name for name, _ in limits] == STAGES  # priority order
    assert sum(int(s) for _, s in limits) <= 480


def benchmark(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_targets_per_gpu_kind_follow_the_batch_that_fits() -> None:
    """At 32K an H100 holds about half an H200's rows, so its memory-bound limit is lower: for the 8B shape
    below the paper's 2.06x (the issue's 1.81x), above it on an H200."""
    from sparrow_nemo.model_shapes import get_shape
    from sparrow_nemo.sparse.schedule import BudgetSchedule

    targets = benchmark("gpu_targets")
    assert targets.kind_of("NVIDIA H200") == "h200" and targets.kind_of("NVIDIA H100 80GB HBM3") == "h100"
    assert targets.kind_of("NVIDIA A100-SXM4-80GB") is None
    shape = get_shape("qwen3-8b")
    h100, h200 = (targets.fitting_batch(shape, kind, 32768) for kind in ("h100", "h200"))
    assert 8 <= h100 < h200 <= 2.5 * h100
    reach = targets.paper_reachable("qwen3-8b", shape, BudgetSchedule.from_preset("qwen3-8b-0.86"))
    assert reach["paper_speedup"] == 2.06
    assert not reach["h100"]["reachable"] and reach["h100"]["limit_32k"] == pytest.approx(1.81, abs=0.02)
    assert reach["h200"]["reachable"] and reach["h200"]["limit_32k"] > 2.06
    assert targets.spread([5, 1, 3, 2, 4], 3) == [1, 3, 5] and targets.spread([7], 4) == [7] * 4


def test_readme_gpu_list_is_what_the_reader_makes_of_the_committed_file() -> None:
    reader = benchmark("gpu_results")
    lines = reader.read_jsonl(REPO / "benchmarks" / "results" / "gpu_window.jsonl")
    text = (REPO / "README.md").read_text()
    block = text.split(reader.START)[1].split(reader.END)[0]
    assert block == f"\n{reader.readme_block(lines)}\n"


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("window")
    return out, window(out, "--dry", "--commit", "c0ffee")


@cpu_only
@pytest.mark.slow  # ~90 s: every stage at tiny shapes
def test_dry_window_runs_every_stage_into_out(dry) -> None:
    out, proc = dry
    assert proc.returncode == 0, (out / "window.log").read_text()[-4000:]
    stages = jsonl(out / "stages.jsonl")
    assert [s["stage"] for s in stages] == STAGES
    assert all(s["rc"] == 0 and 0 <= s["seconds"] <= s["limit_s"] and s["commit"] == "c0ffee" for s in stages)
    files = {p.name for p in out.iterdir()}
    assert files == {"window.log", "stages.jsonl", "env.json", "correctness.xml", *RESULTS.values()}  # <= 8
    env = json.loads((out / "env.json").read_text())
    assert env["commit"] == "c0ffee" and env["mode"] == "dry" and env["interpreted"] is True
    for name in RESULTS.values():  # the commit passed in is in every results line
        rows = jsonl(out / name)
        assert rows and all(r.get("commit") == "c0ffee" for r in rows), name
    (rollout,) = jsonl(out / "rollout.jsonl")
    assert set(rollout["limits"]) == {"h100", "h200", "ran"} and rollout["limits"]["ran"]["batch"] == 2
    assert rollout["target"]["value"] == pytest.approx(
        rollout["speedup"] / rollout["limits"]["ran"]["memory_bound_limit"]
    )
    assert rollout["requests"] == 4 and all(a["warmup_s"] > 0 for a in (rollout["dense"], rollout["sparse"]))
    assert "stop_token" in rollout["dense"]["finish_reasons"]  # EOS honoured: responses end before the cap
    speculative = jsonl(out / "speculative.jsonl")
    assert [r["arm"] for r in speculative] == ["dense", "sparse", "speculative k=4"]
    train = jsonl(out / "train_step.jsonl")
    assert [r["benchmark"] for r in train] == ["train_step", "train_step", "refit_sleep_wake"]
    assert [r["seq_len"] for r in train[:2]] == [128, 256] and all(r["updated"] for r in train[:2])
    assert all(r["plan"]["total"] > 0 for r in train[:2])
    assert train[2]["weights_match"] and train[2]["target"]["pass"]


@cpu_only
@pytest.mark.slow  # ~90 s
def test_a_failing_stage_fails_the_window(tmp_path: Path) -> None:
    proc = window(tmp_path, "--dry", "--commit", "c0ffee", limits="kernels=1")
    assert proc.returncode != 0
    stages = {s["stage"]: s for s in jsonl(tmp_path / "stages.jsonl")}
    assert list(stages) == STAGES  # the later stages still ran
    assert stages["kernels"]["rc"] in (124, 137) and stages["kernels"]["limit_s"] == 1  # timed out
    assert all(s["rc"] == 0 for name, s in stages.items() if name != "kernels")


@cpu_only
@pytest.mark.slow
def test_results_reader_commits_a_window_once(dry, tmp_path: Path) -> None:
    out, proc = dry
    assert proc.returncode == 0
    results, readme = tmp_path / "gpu_window.jsonl", tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- gpu-window:start -->\nnothing yet\n<!-- gpu-window:end -->\n\nafter\n")
    reader = [sys.executable, str(REPO / "benchmarks" / "gpu_results.py"), str(out), "--results", str(results),
              "--readme", str(readme)]  # fmt: skip
    refused = subprocess.run(reader, capture_output=True, text=True)
    assert refused.returncode == 1 and "a dry rehearsal" in refused.stderr and not results.exists()
    for _ in range(2):  # the second read adds nothing
        done = subprocess.run([*reader, "--allow-cpu"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    lines = jsonl(results)
    window_line = lines[0]
    assert window_line["record"] == "window" and [r["record"] for r in lines].count("window") == 1
    assert {"gpu", "driver", "torch", "triton", "commit"} <= window_line.keys()
    assert window_line["stages"]["train"]["rc"] == 0 and window_line["correctness"]["tests"] >= 0
    stages = {r["window_stage"] for r in lines[1:]}
    assert stages == set(RESULTS) and all(r["commit"] == "c0ffee" for r in lines)
    text = readme.read_text()
    assert "nothing yet" not in text and text.endswith("<!-- gpu-window:end -->\n\nafter\n")
    assert (
        "commit `c0ffee`" in text and "  - rollout: tiny-test 2 rows" in text and "memory-bound H100" in text
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        (bad / f.name).write_text(f.read_text())
    rows = jsonl(bad / "rollout.jsonl")
    (bad / "rollout.jsonl").write_text(json.dumps({**rows[0], "commit": "another"}) + "\n")
    wrong = subprocess.run(
        [*reader[:2], str(bad), *reader[3:], "--allow-cpu"], capture_output=True, text=True
    )
    assert (
        wrong.returncode == 1 and "rollout.jsonl:1: commit another is not the window's c0ffee" in wrong.stderr
    )
