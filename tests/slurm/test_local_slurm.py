"""``sbatch slurm/train_tiny_cpu.sh`` on a real (local, single-node) Slurm: 2 tasks, gloo, TP=2.

1. A short run completes: the job ends COMPLETED, ``metrics.jsonl`` holds every step, each rank logged
   to its own file in the per-job run folder.
2. The time-limit warning (USR1 to the batch shell, as ``#SBATCH --signal=B:USR1@60`` sends it) mid-run
   reaches the trainer, which checkpoints after its current step and exits 3; the launcher requeues the
   job, and the next attempt (same job id, same run folder) resumes from that checkpoint and runs the
   remaining steps: ``metrics.jsonl`` holds each step once.

Runs the real trainer, so it takes ~1-2 minutes on an idle 2-core machine. Every wait is bounded, with
limits sized for a machine shared with other jobs (the daemons' own timeouts: scripts/ci_slurm_setup.sh).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WRAPPER = REPO_ROOT / "slurm" / "train_tiny_cpu.sh"
JOB_NAME = "sparrow-tiny-cpu"  # the wrapper's --job-name
#: steps of the requeue test
STEPS = 8
#: a few-second version of the tiny smoke recipe (the warm-start is cached for the module)
FAST = (
    "warmstart.steps=20",
    "grpo.prompts_per_step=2",
    "evaluation.num_prompts=4",
    "logging.plots=false",
)


#: seconds one Slurm command may take (slurmctld answers slowly when it waits for a core)
COMMAND_TIMEOUT = 180
#: seconds for a job or a requeue step (one tiny run takes ~30 s on an idle machine, 5-10x under load)
JOB_TIMEOUT = 1200


def _slurm(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert done.returncode == 0, f"{' '.join(args)} failed: {done.stderr}"
    return done.stdout


def _job_field(env: dict[str, str], job: str, name: str) -> str:
    text = _slurm(env, "scontrol", "show", "job", job)
    match = re.search(rf"\b{name}=(\S*)", text)
    assert match, f"no {name} in scontrol show job {job}:\n{text}"
    return match.group(1)


def _node_idle(env: dict[str, str]) -> bool:
    return _slurm(env, "sinfo", "--noheader", "--format=%T").strip() == "idle"


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every second; a Slurm command failing meanwhile (a controller too busy to answer
    in time) counts as "not yet" and is named if the wait times out."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            if condition():
                return
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            last_error = f" (last Slurm error: {' '.join(str(exc).split())[:300]})"
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{last_error}")
        time.sleep(1.0)


def _attempt_gone(job: str, run: Path) -> bool:
    """No process of the job's previous attempt is left on this machine: no training task (each has the run folder
    on its command line) and no ``slurmstepd: [<job>.batch]`` / ``[<job>.0]`` (the batch shell, which may still
    be between ``scontrol requeue`` and its exit, and the srun step)."""
    needles = (str(run).encode(), f"slurmstepd: [{job}.".encode())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # the process ended while we looked
            continue
        if any(needle in cmdline for needle in needles):
            return False
    return True


def _steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Submit folder (Slurm's output files), run folders and the shared warm-start cache."""
    return tmp_path_factory.mktemp("slurm_runs")


def _submit(env: dict[str, str], workdir: Path, *overrides: str) -> tuple[str, Path]:
    """Submit the tiny CPU wrapper from ``workdir``; returns (job id, run folder)."""
    job_env = {
        **env,
        "RECIPE": "tiny_cpu_short_smoke",
        "SPARROW_ROOT": str(REPO_ROOT),
        "SPARROW_RUNS": str(workdir / "runs"),
    }
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            str(WRAPPER),
            *FAST,
            f"warmstart.cache_dir={workdir / 'warmstart'}",
            *overrides,
        ],
        cwd=workdir,
        env=job_env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    return job, workdir / "runs" / f"{JOB_NAME}-{job}"


def _diagnostics(env: dict[str, str], workdir: Path, job: str) -> str:
    """The job record, the launcher's output and the end of every rank log and daemon log (for a failure message)."""
    parts = [_slurm(env, "scontrol", "show", "job", job)]
    out = workdir / f"slurm-{JOB_NAME}-{job}.out"
    parts.append(out.read_text() if out.exists() else f"(no {out.name})")
    for log in sorted((workdir / "runs" / f"{JOB_NAME}-{job}" / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-25:]))
    for daemon in ("slurmctld", "slurmd"):  # scripts/ci_slurm_setup.sh writes them beside slurm.conf
        log = Path(env["SLURM_CONF"]).parent / "log" / f"{daemon}.log"
        if log.is_file():
            parts.append(f"--- {daemon}.log\n" + "\n".join(log.read_text().splitlines()[-40:]))
    return "\n".join(parts)


def _wait_finished(env: dict[str, str], workdir: Path, job: str, timeout: float) -> None:
    finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    _wait_until(lambda: _job_field(env, job, "JobState") in finished, timeout, f"job {job} to finish")
    state = _job_field(env, job, "JobState")
    assert state == "COMPLETED", f"job {job} ended {state}:\n{_diagnostics(env, workdir, job)}"


def test_sbatch_tiny_cpu_completes_with_metrics(slurm_env: dict[str, str], workdir: Path) -> None:
    job, run = _submit(slurm_env, workdir, "trainer.max_steps=2")
    _wait_finished(slurm_env, workdir, job, timeout=JOB_TIMEOUT)
    assert _steps(run / "metrics.jsonl") == [0, 1]
    assert (run / "summary.json").is_file()
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["attempt0_rank0.log", "attempt0_rank1.log"]
    # both ranks ran the TP=2 layout the wrapper sets
    config = (run / "config.yaml").read_text()
    assert re.search(r"tensor_model_parallel_size: 2\b", config)
    assert "run folder:" in (run / "logs" / "attempt0_rank0.log").read_text()
    assert _job_field(slurm_env, job, "Restarts") == "0"


def test_time_limit_signal_requeues_and_the_job_finishes(slurm_env: dict[str, str], workdir: Path) -> None:
    # 8 steps, a checkpoint every 2: the signal sent after the first checkpoint still finds 6 steps to run,
    # however late it arrives on a loaded machine (with 2 left it could come after the last step: no requeue)
    job, run = _submit(slurm_env, workdir, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=2")
    first_checkpoint = run / "checkpoints" / "step_00000002" / "trainer_state.json"
    _wait_until(first_checkpoint.is_file, JOB_TIMEOUT, "the step-2 checkpoint")
    # what `#SBATCH --signal=B:USR1@60` does before the time limit: USR1 to the batch shell only
    _slurm(slurm_env, "scancel", "--batch", "--signal=USR1", job)
    _wait_until(
        lambda: _job_field(slurm_env, job, "Restarts") == "1", JOB_TIMEOUT, f"job {job} to be requeued"
    )
    # A requeued job is held ~2 minutes (Slurm's requeue begin-time) so that the previous attempt is fully
    # cleaned up first. Release it early, but only once the node is idle again and no process of the first
    # attempt is left: a next attempt started beside a slow-exiting first one (its batch shell not yet exited,
    # a task still holding the rendezvous port) ends FAILED, at once and with no output (seen in CI).
    _wait_until(
        lambda: (
            _job_field(slurm_env, job, "JobState") == "PENDING"
            and _node_idle(slurm_env)
            and _attempt_gone(job, run)
        ),
        JOB_TIMEOUT,
        f"job {job} pending again on an idle node, its first attempt gone",
    )
    _slurm(slurm_env, "scontrol", "update", f"JobId={job}", "StartTime=now")
    _wait_finished(slurm_env, workdir, job, timeout=JOB_TIMEOUT)

    out = (workdir / f"slurm-{JOB_NAME}-{job}.out").read_text()
    assert "USR1: asking the training tasks to checkpoint" in out
    assert f"requeueing job {job}" in out
    assert f"job {job} attempt 1:" in out  # the second attempt ran, in the same run folder
    logs = sorted(p.name for p in (run / "logs").iterdir())
    assert logs == [f"attempt{a}_rank{r}.log" for a in (0, 1) for r in (0, 1)]
    assert "exited with status 3" in out  # the trainer checkpointed and asked to be requeued
    steps = _steps(run / "metrics.jsonl")
    assert steps == list(range(STEPS)), steps  # resumed, not restarted: every step once, to trainer.max_steps
    assert (run / "summary.json").is_file()
    assert "resumed from" in (run / "logs" / "attempt1_rank0.log").read_text()
