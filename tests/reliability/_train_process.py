"""``sparrow train`` as a subprocess (the way Slurm runs it), for the kill / signal / resume tests.

The runs use the smoke recipe cut down to a few seconds per step. Its warm-start is the recipe's own, so
it comes from the shared cache (``~/.cache/sparrow_nemo/warmstart`` or ``$SPARROW_CACHE``) once trained.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sparrow_nemo.grpo.world import env_without_launcher

#: a few-second-per-step version of the smoke recipe
FAST = (
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "evaluation.num_prompts=2",
    "logging.plots=false",
    "checkpoint.keep_last=2",
)
#: wall-clock bound of one training subprocess, seconds
TIMEOUT = 600


def command(run_dir: Path, *overrides: str) -> list[str]:
    """``python -m sparrow_nemo.cli train`` on the smoke recipe into ``run_dir``."""
    return [
        sys.executable,
        "-m",
        "sparrow_nemo.cli",
        "train",
        "--config",
        "tiny_cpu_short_smoke",
        "--run-dir",
        str(run_dir),
        *FAST,
        *overrides,
    ]


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """Run training to its end; returns the finished process (stderr holds the log)."""
    return subprocess.run(
        command(run_dir, *overrides),
        env=env_without_launcher(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def start(run_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """Start training in the background, stdout and stderr to ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            command(run_dir, *overrides), env=env_without_launcher(), stdout=out, stderr=subprocess.STDOUT
        )


def run_on_small_disk(command: list[str], mount: str, size: int) -> tuple[list[str], str]:
    """Run ``command`` with a ``size``-byte tmpfs at ``mount`` (bubblewrap, a private mount namespace; the rest
    of the file system is the host's); returns (stdout lines: ``exit=<status>`` then the tmpfs's entries,
    stderr). Skips the test where bubblewrap is missing or cannot make the namespace."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("needs bubblewrap (apt-get install bubblewrap) to mount a tiny file system")
    wrap = [bwrap, "--dev-bind", "/", "/", "--size", str(size), "--tmpfs", mount, "--"]
    done = subprocess.run(
        [*wrap, "sh", "-c", f'"$@"; echo "exit=$?"; ls -A {mount}', "sh", *command],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env_without_launcher(),
    )
    if "Creating new namespace failed" in done.stderr:
        pytest.skip(f"bubblewrap cannot make a mount namespace here: {done.stderr.strip()}")
    return done.stdout.splitlines(), done.stderr


def wait_for(process: subprocess.Popen, condition: Callable[[], bool], what: str, log: Path) -> None:
    """Poll until ``condition()``; fails (with the log's tail) if the process ends first or time runs out."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if process.poll() is not None:
            raise AssertionError(
                f"training ended ({process.returncode}) before {what}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` (complete lines only)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


#: metrics that measure this machine's speed, not the computation (``timing/*``: seconds per phase); the
#: predicted speedups are the cost model's on constants each fresh run fits to the CPU (a resumed run reads its
#: folder's: tests/rollout/test_cost_fit.py)
WALL_CLOCK = ("time", "rollout/tokens_per_s", "sparsity/predicted_speedup")


def computed(row: dict) -> dict:
    """A metrics row without its wall-clock entries: what two runs of the same seed must agree on."""
    return {k: v for k, v in row.items() if k not in WALL_CLOCK and not k.startswith("timing/")}


def checkpoint_state(folder: Path) -> dict:
    """The policy state of a checkpoint folder, whole: ``model`` (weights by key), ``optimizer`` (``state``: each
    sharded optimizer tensor by key, as ``{"value": tensor}``) and ``step`` (the manifest's)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder / "policy", Path(scratch) / "whole.pt")
        tensors = torch.load(Path(scratch) / "whole.pt", map_location="cpu", weights_only=True)
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    optimizer = {k: {"value": v} for k, v in tensors.items() if k.startswith("optimizer.")}
    step = json.loads((folder / "manifest.json").read_text())["step"]
    return {"model": model, "optimizer": {"state": optimizer}, "step": step}
