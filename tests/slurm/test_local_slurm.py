"""``sbatch slurm/train_tiny_cpu.sh`` on a real (local, single-node) Slurm: 2 tasks, gloo, TP=2.

1. A short run completes: the job ends COMPLETED, ``metrics.jsonl`` holds every step, each rank logged
   to its own file in the run folder named by the run name.
2. A time limit mid-rollout: once step 0 is saved (step 1's rollout running, on a tensor-parallel engine of
   both ranks), the job's limit is cut to 1-2 minutes ahead (``scontrol update TimeLimit``) and the
   time-limit warning arrives (USR1 to the batch shell, as ``#SBATCH --signal=B:USR1@60`` sends it; sent
   by the test at that moment instead of at Slurm's next 30-second check, so that it lands in the rollout
   however loaded the machine). Both ranks abandon the rollout between decode steps, save step 0's end
   and exit 3 before the limit; the launcher requeues the job, and the next attempt (same job id, same run
   folder) resumes and finishes: ``metrics.jsonl`` holds each step once, and the final weights
   (``sparrow export`` of both runs) equal those of the same run submitted without a limit.

Runs the real trainer, so it takes a few minutes on an idle 2-core machine. Every wait is bounded, with
limits sized for a machine shared with other jobs (the daemons' own timeouts: scripts/ci_slurm_setup.sh).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

WRAPPER = REPO_ROOT / "slurm" / "train_tiny_cpu.sh"
JOB_NAME = "sparrow-tiny-cpu"  # the wrapper's --job-name
#: steps of the time-limit test
STEPS = 3
#: the time-limit test's run: responses always run to the cap (no stop token), so each rollout is hundreds of
#: decode steps on an engine over both ranks; a checkpoint after every step
LIMITED = (
    "warmstart.enabled=false",
    "rollout.stop_token_ids=[]",
    "rollout.max_new_tokens=384",
    "rollout.tensor_parallel_size=2",
    f"trainer.max_steps={STEPS}",
    "checkpoint.every_n_steps=1",
    "evaluation.num_prompts=2",
)
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


def _submit(env: dict[str, str], workdir: Path, tag: str, *overrides: str) -> tuple[str, Path]:
    """Submit the tiny CPU wrapper from ``workdir`` with run name ``tiny_cpu_short_smoke-<tag>``; returns (job
    id, run folder)."""
    job_env = {
        **env,
        "RECIPE": "tiny_cpu_short_smoke",
        "SPARROW_TAG": tag,
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
    return job, workdir / "runs" / f"tiny_cpu_short_smoke-{tag}"


def _diagnostics(env: dict[str, str], workdir: Path, job: str) -> str:
    """The job record, the launcher's output and the end of every rank log and daemon log (for a failure message)."""
    parts = [_slurm(env, "scontrol", "show", "job", job)]
    out = workdir / f"slurm-{JOB_NAME}-{job}.out"
    parts.append(out.read_text() if out.exists() else f"(no {out.name})")
    for log in sorted((workdir / "runs").glob(f"*/logs/job{job}_*.log")):
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
    job, run = _submit(slurm_env, workdir, "short", "trainer.max_steps=2")
    _wait_finished(slurm_env, workdir, job, timeout=JOB_TIMEOUT)
    assert _steps(run / "metrics.jsonl") == [0, 1]
    assert (run / "summary.json").is_file()
    logs = sorted(p.name for p in (run / "logs").iterdir())
    assert logs == [f"job{job}_attempt0_rank0.log", f"job{job}_attempt0_rank1.log"]
    # both ranks ran the TP=2 layout the wrapper sets
    config = (run / "config.yaml").read_text()
    assert re.search(r"tensor_model_parallel_size: 2\b", config)
    assert "run folder:" in (run / "logs" / logs[0]).read_text()
    assert _job_field(slurm_env, job, "Restarts") == "0"


def _minutes(duration: str) -> int:
    """Whole minutes, rounded up, of a Slurm duration ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``)."""
    days, _, clock = duration.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    seconds = sum(v * 60**i for i, v in enumerate(reversed(parts))) + int(days or 0) * 86400
    return -(-seconds // 60)


def _export(run: Path, out: Path) -> dict[str, object]:
    """The run's final policy weights: ``sparrow export`` on 2 gloo ranks (its TP=2 layout)."""
    from policy._helpers import free_port

    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "sparrow_nemo.cli"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run(
        [*command, "export", "--run-dir", str(run), "--out", str(out)],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(out / "model.safetensors")


def test_a_time_limit_mid_rollout_saves_requeues_and_ends_as_an_uninterrupted_run(
    slurm_env: dict[str, str], workdir: Path
) -> None:
    straight_job, straight = _submit(slurm_env, workdir, "straight", *LIMITED)
    _wait_finished(slurm_env, workdir, straight_job, timeout=JOB_TIMEOUT)

    job, run = _submit(slurm_env, workdir, "limited", *LIMITED)
    step0_saved = run / "checkpoints" / "step_00000001" / "trainer_state.json"
    _wait_until(step0_saved.is_file, JOB_TIMEOUT, "the step-0 checkpoint (step 1's rollout then runs)")
    # the job now ends 1-2 minutes from here, and the warning `--signal=B:USR1@60` gives comes now
    limit = _minutes(_job_field(slurm_env, job, "RunTime")) + 1
    _slurm(slurm_env, "scontrol", "update", f"JobId={job}", f"TimeLimit={limit}")
    _slurm(slurm_env, "scancel", "--batch", "--signal=USR1", job)
    _wait_until(
        lambda: _job_field(slurm_env, job, "Restarts") == "1", JOB_TIMEOUT, f"job {job} to be requeued"
    )
    # A requeued job is held ~2 minutes (Slurm's requeue begin-time) so that the previous attempt is fully
    # cleaned up first. Release it early, with the time limit back, but only once the node is idle again and
    # no process of the first attempt is left: a next attempt started beside a slow-exiting first one (its batch
    # shell not yet exited, a task still holding the rendezvous port) ends FAILED, at once and with no output.
    _wait_until(
        lambda: (
            _job_field(slurm_env, job, "JobState") == "PENDING"
            and _node_idle(slurm_env)
            and _attempt_gone(job, run)
        ),
        JOB_TIMEOUT,
        f"job {job} pending again on an idle node, its first attempt gone",
    )
    _slurm(slurm_env, "scontrol", "update", f"JobId={job}", "TimeLimit=30")
    _slurm(slurm_env, "scontrol", "update", f"JobId={job}", "StartTime=now")
    _wait_finished(slurm_env, workdir, job, timeout=JOB_TIMEOUT)

    out = (workdir / f"slurm-{JOB_NAME}-{job}.out").read_text()
    assert "USR1: asking the training tasks to checkpoint" in out
    assert "exited with status 3" in out  # the trainer saved and asked to be requeued, before the limit
    assert f"requeueing job {job}" in out and f"job {job} attempt 1:" in out
    logs = run / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        f"job{job}_attempt{a}_rank{r}.log" for a in (0, 1) for r in (0, 1)
    ]
    for rank in (0, 1):  # both ranks of the engine left the rollout between decode steps, at the same one
        assert (
            "rollout abandoned between decode steps"
            in (logs / f"job{job}_attempt0_rank{rank}.log").read_text()
        )
    assert "resumed from" in (logs / f"job{job}_attempt1_rank0.log").read_text()
    assert _steps(run / "metrics.jsonl") == list(
        range(STEPS)
    )  # step 1 was dropped and redone, each step once
    assert _steps(straight / "metrics.jsonl") == list(range(STEPS))

    limited_weights, straight_weights = (
        _export(run, workdir / "limited_hf"),
        _export(straight, workdir / "straight_hf"),
    )
    assert limited_weights.keys() == straight_weights.keys()
    for name, weight in straight_weights.items():
        assert weight.equal(limited_weights[name]), f"{name} differs from the uninterrupted run's"
