"""slurm/launch.sh decisions with stand-ins for srun/scontrol/scancel and the trainer (no Slurm daemons).

The stand-ins log their arguments; the fake trainer logs the torch.distributed variables it sees and
exits with a chosen status. Covered: rendezvous variables, the run folder by run name (the same for another
job id), override order, srun as sites run it (--cpus-per-task, --export=ALL, NCCL_* / GLOO_* reaching the
tasks and the container), requeue on the "checkpointed" status (3) and not otherwise nor after TERM, the restart
cap, the pyxis container flags, the dry mode, and the clear errors. The real Slurm run is
tests/slurm/test_local_slurm.py.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

LAUNCH = REPO_ROOT / "slurm" / "launch.sh"
JOB_ID = "4242"

FAKES = {
    "scontrol": """#!/usr/bin/env bash
if [[ $1 == show && $2 == hostnames ]]; then printf 'node-a\\nnode-b\\n'; exit 0; fi
echo "scontrol $*" >> "$FAKE_LOG"
""",
    "scancel": """#!/usr/bin/env bash
echo "scancel $*" >> "$FAKE_LOG"
""",
    # srun: log the options, then run the command once as task 0 of 2
    "srun": """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
while [[ $1 == --* ]]; do shift; done
SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_LOCALID=0 SLURM_NTASKS_PER_NODE=2 exec "$@"
""",
    "trainer": """#!/usr/bin/env bash
echo "env RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK MASTER=$MASTER_ADDR:$MASTER_PORT" >> "$FAKE_LOG"
echo "site NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}" >> "$FAKE_LOG"
echo "trainer $*" >> "$FAKE_LOG"
sleep "${FAKE_SLEEP:-0}"
exit "$FAKE_EXIT"
""",
}


@pytest.fixture
def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """Environment of a batch job of 2 tasks on node-a,node-b with the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text(body)
        path.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "FAKE_EXIT": "0",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NAME": "sparrow-test",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "12",
        "RECIPE": "qwen3_8b_math",
        "SPARROW_ROOT": str(REPO_ROOT),
        "SPARROW_RUNS": str(tmp_path / "runs"),
        "SPARROW_PYTHON": str(bin_dir / "trainer"),
    }


def _launch(env: dict[str, str], *overrides: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    done = subprocess.run(
        ["bash", str(LAUNCH), *overrides], env=env, capture_output=True, text=True, timeout=60
    )
    log = Path(env["FAKE_LOG"])
    return done, log.read_text().splitlines() if log.exists() else []


def _line(calls: list[str], prefix: str) -> str:
    found = [c for c in calls if c.startswith(prefix)]
    assert found, f"no '{prefix}' call in {calls}"
    return found[0]


def test_rendezvous_run_folder_and_override_order(fake_slurm: dict[str, str]) -> None:
    done, calls = _launch(fake_slurm, "policy.tensor_model_parallel_size=2", "trainer.max_steps=7")
    assert done.returncode == 0, done.stderr
    env_line = _line(calls, "env")
    assert env_line.startswith("env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER=node-a:")
    assert (
        1024 <= int(env_line.rsplit(":", 1)[1]) <= 65535
    )  # a free port of the first node, picked per attempt
    run_dir = f"{fake_slurm['SPARROW_RUNS']}/qwen3_8b_math"  # the run name: the recipe (no tag)
    assert _line(calls, "trainer") == (
        f"trainer -m sparrow_nemo.cli train --config qwen3_8b_math --run-dir {run_dir} "
        "checkpoint.resume=auto logging.progress_bar=false policy.tensor_model_parallel_size=2 trainer.max_steps=7"
    )
    srun = _line(calls, "srun").split()
    assert f"--output={run_dir}/logs/job{JOB_ID}_attempt0_rank%t.log" in srun
    assert "--cpus-per-task=12" in srun and "--export=ALL" in srun  # as sites run it (Slurm >= 22.05)
    assert not any(word.startswith("--container") for word in srun)
    assert not any(c.startswith("scontrol") for c in calls)  # finished: no requeue


def test_the_run_name_is_stable_across_jobs_and_takes_a_tag(fake_slurm: dict[str, str]) -> None:
    runs = fake_slurm["SPARROW_RUNS"]
    for job, env in (("100", {}), ("200", {}), ("300", {"SPARROW_TAG": "lr3e-6"})):
        log = str(Path(fake_slurm["FAKE_LOG"]).with_name(f"job{job}.log"))
        done, calls = _launch({**fake_slurm, **env, "SLURM_JOB_ID": job, "FAKE_LOG": log})
        assert done.returncode == 0, done.stderr
        name = "qwen3_8b_math-lr3e-6" if env else "qwen3_8b_math"  # a resubmission resumes the same folder
        assert f"--run-dir {runs}/{name} " in _line(calls, "trainer")
        assert f"--output={runs}/{name}/logs/job{job}_attempt0_rank%t.log" in _line(calls, "srun")
    path_recipe = {**fake_slurm, "RECIPE": "/site/recipes/my_recipe.yaml", "SPARROW_DRY_RUN": "1"}
    assert f"--run-dir {runs}/my_recipe " in _launch(path_recipe)[0].stdout
    named = {**fake_slurm, "SPARROW_RUN_NAME": "exp-7", "SPARROW_DRY_RUN": "1"}
    assert f"--run-dir {runs}/exp-7 " in _launch(named)[0].stdout
    done, _ = _launch({**fake_slurm, "SPARROW_TAG": "a/../b"})
    assert done.returncode == 2 and "run name 'qwen3_8b_math-a/../b'" in done.stderr
    assert "letters, digits" in done.stderr


def test_site_network_variables_reach_the_tasks_and_the_container(fake_slurm: dict[str, str]) -> None:
    site = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    done, calls = _launch({**fake_slurm, **site})
    assert done.returncode == 0, done.stderr
    assert "site NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth1" in calls  # what the task saw
    assert (
        "site variables passed to the tasks: GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=ib0 " in done.stderr
    )
    container = {**fake_slurm, **site, "SPARROW_IMAGE": "nvcr.io#nvidia/x:1", "SPARROW_DRY_RUN": "1"}
    words = shlex.split(_launch(container)[0].stdout)
    env_flag = [w for w in words if w.startswith("--container-env=")]
    assert env_flag and set(env_flag[0].split("=", 1)[1].split(",")) == set(site)
    done, _ = _launch(fake_slurm)
    assert "site variables passed to the tasks: none" in done.stderr


@pytest.mark.parametrize("flag", ["--dry", "-t"])
def test_dry_mode_prints_the_srun_line_and_writes_nothing(fake_slurm: dict[str, str], flag: str) -> None:
    outside = {k: v for k, v in fake_slurm.items() if k not in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST")}
    done, calls = _launch(outside, "trainer.max_steps=3", flag)
    assert done.returncode == 0, done.stderr
    assert calls == [] and not Path(fake_slurm["SPARROW_RUNS"]).exists()  # nothing started, nothing written
    words = shlex.split(done.stdout)
    assert words[0] == "srun" and "--cpus-per-task=12" in words
    assert words[-2:] == ["logging.progress_bar=false", "trainer.max_steps=3"]  # the flag is not an override
    assert "job dry attempt 0" in done.stderr


def test_rendezvous_port_is_free_or_given(fake_slurm: dict[str, str]) -> None:
    import socket

    held = socket.socket()
    held.bind(("", 0))
    held.listen()  # a port taken by another program: the launcher must not pick it
    try:
        _, calls = _launch(fake_slurm)
        assert not _line(calls, "env").endswith(f":{held.getsockname()[1]}")
    finally:
        held.close()
    log = str(Path(fake_slurm["FAKE_LOG"]).with_name("given_port.log"))
    _, calls = _launch({**fake_slurm, "SPARROW_MASTER_PORT": "29512", "FAKE_LOG": log})
    assert _line(calls, "env").endswith("MASTER=node-a:29512")


def test_checkpointed_status_requeues_the_job(fake_slurm: dict[str, str]) -> None:
    done, calls = _launch({**fake_slurm, "FAKE_EXIT": "3", "SLURM_RESTART_COUNT": "2"})
    assert done.returncode == 0, done.stderr
    assert f"scontrol requeue {JOB_ID}" in calls
    assert f"job{JOB_ID}_attempt2_rank%t.log" in _line(calls, "srun")  # logs of this attempt kept apart
    assert "attempt 3 resumes from the newest checkpoint" in done.stderr


@pytest.mark.parametrize(("signal_name", "requeued"), [("USR1", True), ("TERM", False)])
def test_a_signal_to_the_batch_shell_reaches_the_tasks(
    fake_slurm: dict[str, str], signal_name: str, requeued: bool
) -> None:
    """``--signal=B:USR1@...`` (and a TERM meant for the batch shell) reach only the launcher: it forwards the
    signal to the tasks, waits for them, and requeues on USR1 only (a TERM is a cancel or Slurm's own preemption)."""
    env = {**fake_slurm, "FAKE_EXIT": "3", "FAKE_SLEEP": "3"}
    launcher = subprocess.Popen(
        ["bash", str(LAUNCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log = Path(env["FAKE_LOG"])
    deadline = time.monotonic() + 60
    while not (log.exists() and "trainer" in log.read_text()):  # the task runs: the trap is set
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    launcher.send_signal(getattr(signal, f"SIG{signal_name}"))
    _, err = launcher.communicate(timeout=60)
    calls = log.read_text().splitlines()
    assert f"scancel --signal={signal_name} {JOB_ID}" in calls
    assert (
        "training step exited with status 3" in err
    )  # the launcher outlived the signal until the tasks ended
    assert (f"scontrol requeue {JOB_ID}" in calls) == requeued
    assert launcher.returncode == (0 if requeued else 3)


def test_a_checkout_updated_while_the_job_runs_does_not_change_the_running_launcher(
    fake_slurm: dict[str, str], tmp_path: Path
) -> None:
    """bash reads a script as it runs it; the launcher's body is one function, read whole before it starts."""
    copy = tmp_path / "launch.sh"
    copy.write_text(LAUNCH.read_text())
    env = {**fake_slurm, "FAKE_EXIT": "3", "FAKE_SLEEP": "2"}
    launcher = subprocess.Popen(["bash", str(copy)], env=env, stderr=subprocess.PIPE, text=True)
    log = Path(env["FAKE_LOG"])
    deadline = time.monotonic() + 60
    while not (log.exists() and "trainer" in log.read_text()):
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    copy.write_text("#!/usr/bin/env bash\n" + "echo edited; exit 9 (\n" * 200)  # a `git pull` mid-job
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert f"scontrol requeue {JOB_ID}" in log.read_text().splitlines()


def test_a_failure_is_not_requeued(fake_slurm: dict[str, str]) -> None:
    done, calls = _launch({**fake_slurm, "FAKE_EXIT": "1"})
    assert done.returncode == 1
    assert not any(c.startswith("scontrol") for c in calls)


def test_restart_cap_stops_a_requeue_loop(fake_slurm: dict[str, str]) -> None:
    env = {**fake_slurm, "FAKE_EXIT": "3", "SLURM_RESTART_COUNT": "5", "SPARROW_MAX_RESTARTS": "5"}
    done, calls = _launch(env)
    assert done.returncode == 3
    assert not any(c.startswith("scontrol") for c in calls)
    assert "not requeueing: 5 restarts already" in done.stderr


def test_container_flags_and_task_paths(fake_slurm: dict[str, str]) -> None:
    env = {
        **fake_slurm,
        "SPARROW_IMAGE": "nvcr.io#nvidia/tensorrt-llm/release:1.2.0",
        "SPARROW_MOUNTS": "/lustre/data:/workspace/sparrow_nemo/data",
        "SPARROW_DRY_RUN": "1",
    }
    del env["SPARROW_PYTHON"]
    done, calls = _launch(env, "trainer.max_steps=3")
    assert done.returncode == 0, done.stderr
    assert calls == []  # dry run: nothing started
    mounts = (
        f"{REPO_ROOT}:/workspace/sparrow_nemo,{fake_slurm['SPARROW_RUNS']}:/workspace/runs,"
        "/lustre/data:/workspace/sparrow_nemo/data"
    )
    words = shlex.split(done.stdout)  # the launcher prints the command shell-quoted
    assert words[0] == "srun"
    assert "--container-image=nvcr.io#nvidia/tensorrt-llm/release:1.2.0" in words
    assert f"--container-mounts={mounts}" in words
    assert "--container-workdir=/workspace/sparrow_nemo" in words
    start = words.index("/workspace/sparrow_nemo/slurm/task.sh")
    assert words[start + 1 : start + 5] == ["python", "-m", "sparrow_nemo.cli", "train"]
    assert "/workspace/runs/qwen3_8b_math" in words
    assert words[-1] == "trainer.max_steps=3"


def test_missing_image_file_is_a_clear_error(fake_slurm: dict[str, str]) -> None:
    done, _ = _launch({**fake_slurm, "SPARROW_IMAGE": "images/none.sqsh"})
    assert done.returncode == 2
    assert f"container image {REPO_ROOT}/images/none.sqsh not found" in done.stderr
    assert "docker build -f docker/Dockerfile" in done.stderr


def test_outside_a_job_is_a_clear_error(fake_slurm: dict[str, str]) -> None:
    env = {k: v for k, v in fake_slurm.items() if k != "SLURM_JOB_ID"}
    done, _ = _launch(env)
    assert done.returncode == 2
    assert "not inside a Slurm job" in done.stderr and "sbatch" in done.stderr


def test_task_env_needs_the_rendezvous(fake_slurm: dict[str, str]) -> None:
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "slurm" / "task.sh"), "true"],
        env={**fake_slurm, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "MASTER_ADDR is not set" in done.stderr
