#!/usr/bin/env bash
# The shared Slurm launcher behind slurm/train_*.sh: runs `sparrow train` on every task of the job.
#
# The train_*.sh wrappers hold the #SBATCH resources and `exec` this script inside the batch job:
#
#   RECIPE=<recipe> exec bash "$SPARROW_ROOT/slurm/launch.sh" [fixed overrides] "$@"
#
# What it does, once per attempt of the job (an attempt = the first start or a restart after requeue):
# - rendezvous from Slurm's environment: MASTER_ADDR = first host of SLURM_JOB_NODELIST
#   (`scontrol show hostnames`; the batch script runs there), MASTER_PORT = a port free on it when the attempt
#   starts (a port derived from the job id collided on a shared machine: two private clusters both have
#   a job 2, and a port can still be held by another program);
#   RANK / WORLD_SIZE / LOCAL_RANK come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID in each task
#   (slurm/task.sh), so `srun` starts one process per GPU (or per CPU task) and no torchrun is needed;
# - a run folder per job id, $SPARROW_RUNS/<job name>-<job id>, the same for every attempt, with
#   per-attempt, per-rank logs in <run folder>/logs/attempt<N>_rank<R>.log;
# - `sparrow train --config $RECIPE --run-dir <run folder> checkpoint.resume=auto <overrides>`: the
#   overrides given to the wrapper (`sbatch slurm/train_qwen3_8b.sh trainer.max_steps=300`) come last, so
#   they win over the wrapper's fixed ones;
# - container (pyxis/enroot): with SPARROW_IMAGE set, srun gets --container-image, --container-mounts
#   (the repository, the run folder root and SPARROW_MOUNTS) and --container-workdir;
# - requeue: the wrappers ask for `#SBATCH --signal=B:USR1@<seconds>` and `--requeue`. USR1 reaches this
#   shell before the time limit; it is forwarded to the training tasks (`scancel --signal=USR1`), which
#   are expected to checkpoint and exit with status SPARROW_REQUEUE_EXIT (3). On that status - or on any
#   failure after the warning signal - the launcher runs `scontrol requeue $SLURM_JOB_ID`: the job goes
#   back to the queue with the same id, so the next attempt reuses the run folder and
#   checkpoint.resume=auto continues from the newest checkpoint in it. Preemption by Slurm
#   (PreemptMode=REQUEUE) and `scontrol requeue` by hand restart the job the same way.
#   At most SPARROW_MAX_RESTARTS restarts (default 20) guard against a requeue loop.
#
# Environment (set before sbatch, or in the wrapper; sbatch exports the submitting shell's variables):
#   RECIPE               recipe name or path (required; set by every wrapper)
#   SPARROW_ROOT         repository checkout (default: the sbatch submit directory)
#   SPARROW_RUNS         run folder root (default: $SPARROW_ROOT/runs)
#   SPARROW_IMAGE        container image for pyxis: a .sqsh file (relative to SPARROW_ROOT or absolute) or a
#                        registry image (nvcr.io#nvidia/...); empty = no container
#   SPARROW_MOUNTS       extra container mounts, comma separated src:dst[,src:dst] (data, checkpoints, caches)
#   SPARROW_PYTHON       python of the tasks (default: python in a container, $SPARROW_ROOT/.venv/bin/python
#                        without one)
#   SPARROW_REQUEUE_EXIT exit status meaning "checkpointed, requeue me" (default 3)
#   SPARROW_MAX_RESTARTS restarts after which a job is not requeued again (default 20)
#   SPARROW_SRUN_ARGS    extra srun arguments (e.g. "--cpu-bind=none")
#   SPARROW_MASTER_PORT  rendezvous port (default: a free one on the first node, picked by python3)
#   SPARROW_DRY_RUN=1    print the srun command instead of running it
set -euo pipefail

log() {
    echo "[sparrow launch $(date -u +%H:%M:%S)] $*" >&2
}

die() {
    log "error: $*"
    exit 2
}

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job (no SLURM_JOB_ID): submit a wrapper with sbatch, e.g. sbatch slurm/train_tiny_cpu.sh"
[[ -n ${RECIPE:-} ]] || die "RECIPE is not set (the train_*.sh wrappers set it; e.g. RECIPE=qwen3_8b_math)"

ROOT=$(cd "${SPARROW_ROOT:-${SLURM_SUBMIT_DIR:-.}}" && pwd)
[[ -f $ROOT/slurm/task.sh ]] || die "SPARROW_ROOT=$ROOT is not a sparrow_nemo checkout (no slurm/task.sh); submit from the repository root or set SPARROW_ROOT"
RUNS=${SPARROW_RUNS:-$ROOT/runs}
IMAGE=${SPARROW_IMAGE:-}
if [[ $IMAGE == *.sqsh ]]; then
    [[ $IMAGE == /* ]] || IMAGE=$ROOT/$IMAGE
    [[ -f $IMAGE ]] || die "container image $IMAGE not found: build it (docker build -f docker/Dockerfile -t sparrow-nemo . && enroot import -o $IMAGE dockerd://sparrow-nemo), point SPARROW_IMAGE at one, or set SPARROW_IMAGE= to run without a container"
fi
REQUEUE_EXIT=${SPARROW_REQUEUE_EXIT:-3}
MAX_RESTARTS=${SPARROW_MAX_RESTARTS:-20}
ATTEMPT=${SLURM_RESTART_COUNT:-0}
NAME=${SLURM_JOB_NAME:-sparrow}
RUN_DIR=$RUNS/$NAME-$SLURM_JOB_ID
LOG_DIR=$RUN_DIR/logs
mkdir -p "$LOG_DIR"

# (read the whole list: `| head -n 1` could kill scontrol with SIGPIPE, fatal under pipefail)
mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?}")
[[ ${#hosts[@]} -gt 0 ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' listed no host"
MASTER_ADDR=${hosts[0]}
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}
MASTER_PORT=${SPARROW_MASTER_PORT:-$(free_port)} || die "no free rendezvous port (python3 missing?): set SPARROW_MASTER_PORT"
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONUNBUFFERED=1

# Paths as the tasks see them: inside the container the repository is mounted at /workspace/sparrow_nemo
# and the run folder root at /workspace/runs.
srun_args=(--kill-on-bad-exit=1 "--output=$LOG_DIR/attempt${ATTEMPT}_rank%t.log")
if [[ -n $IMAGE ]]; then
    TASK_ROOT=/workspace/sparrow_nemo
    TASK_RUN_DIR=/workspace/runs/$NAME-$SLURM_JOB_ID
    mounts="$ROOT:$TASK_ROOT,$RUNS:/workspace/runs${SPARROW_MOUNTS:+,$SPARROW_MOUNTS}"
    srun_args+=("--container-image=$IMAGE" "--container-mounts=$mounts" "--container-workdir=$TASK_ROOT")
    PYTHON=${SPARROW_PYTHON:-python}
else
    TASK_ROOT=$ROOT
    TASK_RUN_DIR=$RUN_DIR
    PYTHON=${SPARROW_PYTHON:-$ROOT/.venv/bin/python}
fi
read -r -a extra_srun <<<"${SPARROW_SRUN_ARGS:-}"
srun_args+=("${extra_srun[@]}")

command=(srun "${srun_args[@]}" bash "$TASK_ROOT/slurm/task.sh" "$PYTHON" -m sparrow_nemo.cli train
    --config "$RECIPE" --run-dir "$TASK_RUN_DIR" checkpoint.resume=auto logging.progress_bar=false "$@")

log "job $SLURM_JOB_ID attempt $ATTEMPT: $SLURM_NTASKS tasks on ${SLURM_JOB_NUM_NODES:-1} node(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
log "recipe $RECIPE, run folder $RUN_DIR, logs $LOG_DIR/attempt${ATTEMPT}_rank*.log${IMAGE:+, container $IMAGE}"
if [[ ${SPARROW_DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi

# USR1 (the time-limit warning, #SBATCH --signal=B:USR1@...) -> forward to the tasks, remember it.
warned=0
# shellcheck disable=SC2317,SC2329  # called through the trap, not unreachable
on_usr1() {
    warned=1
    log "USR1: asking the training tasks to checkpoint and exit (status $REQUEUE_EXIT = requeue)"
    scancel --signal=USR1 "$SLURM_JOB_ID" || log "scancel --signal=USR1 failed"
}
trap on_usr1 USR1

cd "$ROOT"
"${command[@]}" &
srun_pid=$!
# `wait` returns early (status > 128) when a trapped signal arrives: wait again until srun is gone.
while true; do
    status=0
    wait "$srun_pid" || status=$?
    if ((status > 128)) && kill -0 "$srun_pid" 2>/dev/null; then
        continue
    fi
    break
done
log "training step exited with status $status"

if ((status == 0)); then
    exit 0
fi
if ((status == REQUEUE_EXIT || warned)); then
    if ((ATTEMPT >= MAX_RESTARTS)); then
        log "not requeueing: $ATTEMPT restarts already (SPARROW_MAX_RESTARTS=$MAX_RESTARTS)"
        exit "$status"
    fi
    log "requeueing job $SLURM_JOB_ID (attempt $((ATTEMPT + 1)) resumes from the newest checkpoint in $RUN_DIR)"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
rank0_log="$LOG_DIR/attempt${ATTEMPT}_rank0.log"
if [[ -f $rank0_log ]]; then
    log "last lines of $rank0_log:"
    tail -n 30 "$rank0_log" >&2
fi
exit "$status"
