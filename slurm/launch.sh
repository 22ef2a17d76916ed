#!/usr/bin/env bash
# The shared Slurm launcher behind slurm/train_*.sh: runs `sparrow train` on every task of the job.
#
# The train_*.sh wrappers hold the #SBATCH resources and `exec` this script inside the batch job:
#
#   RECIPE=<recipe> exec bash "$SPARROW_ROOT/slurm/launch.sh" [--dry|-t] [fixed overrides] "$@"
#
# What it does, once per attempt of the job (an attempt = the first start or a restart after requeue):
# - rendezvous from Slurm's environment: MASTER_ADDR = first host of SLURM_JOB_NODELIST
#   (`scontrol show hostnames`; the batch script runs there), MASTER_PORT = a port free on it when the attempt
#   starts (a port derived from the job id collided on a shared machine: two private clusters both have
#   a job 2, and a port can still be held by another program);
#   RANK / WORLD_SIZE / LOCAL_RANK come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID in each task
#   (slurm/task.sh), so `srun` starts one process per GPU (or per CPU task) and no torchrun is needed;
# - a run folder named by a stable run name, $SPARROW_RUNS/<run name>, where the run name is SPARROW_RUN_NAME or
#   by default the recipe's name and the user's tag (<recipe>-<SPARROW_TAG>, or <recipe> without a tag): every
#   attempt of a requeued job and every resubmission with the same name continue the same run (a different
#   recipe is refused there by its config hash: pick another tag); per-job, per-attempt, per-rank logs in
#   <run folder>/logs/job<job id>_attempt<N>_rank<R>.log;
# - `sparrow train --config $RECIPE --run-dir <run folder> checkpoint.resume=auto <overrides>`: the
#   overrides given to the wrapper (`sbatch slurm/train_qwen3_8b.sh trainer.max_steps=300`) come last, so
#   they win over the wrapper's fixed ones;
# - srun as sites run it: `--cpus-per-task` passed on (srun does not inherit it from sbatch since Slurm 22.05,
#   and each rank would be bound to one CPU), `--export=ALL` (so a site's SBATCH_EXPORT=NONE does not strip
#   the variables below), and the site's NCCL_* / GLOO_* / TORCH_NCCL_* variables (network interfaces, IB
#   adapters, debug levels: NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, ...) reach every task, inside
#   a container too (pyxis --container-env, so the image's own values do not win); the launcher logs them;
# - container (pyxis/enroot): with SPARROW_IMAGE set, srun gets --container-image, --container-mounts
#   (the repository, the run folder root and SPARROW_MOUNTS) and --container-workdir;
# - time limit and requeue: the wrappers ask for `#SBATCH --signal=B:USR1@<seconds>` and `--requeue`. USR1
#   reaches this batch shell (B: = the batch shell only) before the time limit; its trap forwards it to the
#   training tasks (`scancel --signal=USR1`), which stop within a few decode steps even mid-rollout, save the
#   last completed step and exit with status SPARROW_REQUEUE_EXIT (3). On that status - or on any failure
#   after the warning signal - the launcher runs `scontrol requeue $SLURM_JOB_ID`: the job goes back to the
#   queue with the same id, and the next attempt continues from the newest checkpoint in the run folder
#   (checkpoint.resume=auto). The lead (<seconds>) must cover the stop and a checkpoint's write (see the
#   wrappers). TERM to this shell (scancel, preemption) is forwarded the same way, without a requeue by the
#   launcher (Slurm requeues a preempted job itself with PreemptMode=REQUEUE). At most SPARROW_MAX_RESTARTS
#   restarts (default 20) guard against a requeue loop.
# - `--dry` / `-t` (or SPARROW_DRY_RUN=1): print the srun command and the site variables it passes, start
#   nothing and write nothing; outside a job it shows the command for a stand-in job (id "dry", this host).
#
# Environment (set before sbatch, or in the wrapper; sbatch exports the submitting shell's variables):
#   RECIPE               recipe name or path (required; set by every wrapper)
#   SPARROW_ROOT         repository checkout (default: the sbatch submit directory)
#   SPARROW_RUNS         run folder root (default: $SPARROW_ROOT/runs)
#   SPARROW_TAG          a user tag of the run: run name <recipe>-<tag> (default: no tag, run name <recipe>)
#   SPARROW_RUN_NAME     the run name itself (letters, digits, . _ -), instead of <recipe>[-<tag>]
#   SPARROW_IMAGE        container image for pyxis: a .sqsh file (relative to SPARROW_ROOT or absolute) or a
#                        registry image (nvcr.io#nvidia/...); empty = no container
#   SPARROW_MOUNTS       extra container mounts, comma separated src:dst[,src:dst] (data, checkpoints, caches)
#   SPARROW_PYTHON       python of the tasks (default: python in a container, $SPARROW_ROOT/.venv/bin/python
#                        without one)
#   SPARROW_REQUEUE_EXIT exit status meaning "checkpointed, requeue me" (default 3)
#   SPARROW_MAX_RESTARTS restarts after which a job is not requeued again (default 20)
#   SPARROW_SRUN_ARGS    extra srun arguments (e.g. "--cpu-bind=none")
#   SPARROW_MASTER_PORT  rendezvous port (default: a free one on the first node, picked by python3)
#   SPARROW_DRY_RUN=1    as --dry
#   NCCL_*, GLOO_*, TORCH_NCCL_*  passed to every task as set here
set -euo pipefail

log() {
    echo "[sparrow launch $(date -u +%H:%M:%S)] $*" >&2
}

die() {
    log "error: $*"
    exit 2
}

# The script body is one function, run on the last line: bash has read all of it before it starts, so a
# checkout updated (git pull) while a job runs cannot change what the running batch shell executes.
main() {
    dry=${SPARROW_DRY_RUN:-0}
    overrides=()
    for arg in "$@"; do
        case $arg in
            --dry | -t) dry=1 ;;
            *) overrides+=("$arg") ;;
        esac
    done

    if [[ $dry == 1 ]]; then
        SLURM_JOB_ID=${SLURM_JOB_ID:-dry}
    fi
    [[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job (no SLURM_JOB_ID): submit a wrapper with sbatch, e.g. sbatch slurm/train_tiny_cpu.sh (or add --dry to see the srun line)"
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
    recipe_name=${RECIPE##*/}
    recipe_name=${recipe_name%.yaml}
    RUN_NAME=${SPARROW_RUN_NAME:-$recipe_name${SPARROW_TAG:+-$SPARROW_TAG}}
    [[ $RUN_NAME =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "run name '$RUN_NAME' (SPARROW_RUN_NAME, or RECIPE and SPARROW_TAG): use letters, digits, '.', '_' and '-' only"
    RUN_DIR=$RUNS/$RUN_NAME
    LOG_DIR=$RUN_DIR/logs
    LOG_STEM=job${SLURM_JOB_ID}_attempt${ATTEMPT}

    # (read the whole list: `| head -n 1` could kill scontrol with SIGPIPE, fatal under pipefail)
    if [[ $dry == 1 && -z ${SLURM_JOB_NODELIST:-} ]]; then
        hosts=("$(hostname -s)") # a dry run outside a job: this host stands in for the first node
    else
        mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?}")
    fi
    [[ ${#hosts[@]} -gt 0 ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' listed no host"
    MASTER_ADDR=${hosts[0]}
    free_port() {
        python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
    }
    MASTER_PORT=${SPARROW_MASTER_PORT:-$(free_port)} || die "no free rendezvous port (python3 missing?): set SPARROW_MASTER_PORT"
    export MASTER_ADDR MASTER_PORT
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    export PYTHONUNBUFFERED=1

    # The site's communication variables (network interfaces, IB adapters, timeouts, debug): every task gets them.
    mapfile -t site_vars < <(compgen -e | grep -E '^(NCCL|GLOO|TORCH_NCCL)_' || true)
    site_env=""
    for name in "${site_vars[@]}"; do
        site_env+=" $name=${!name}"
    done

    # Paths as the tasks see them: inside the container the repository is mounted at /workspace/sparrow_nemo
    # and the run folder root at /workspace/runs.
    srun_args=(--kill-on-bad-exit=1 --export=ALL "--output=$LOG_DIR/${LOG_STEM}_rank%t.log")
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
        srun_args+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
    fi
    if [[ -n $IMAGE ]]; then
        TASK_ROOT=/workspace/sparrow_nemo
        TASK_RUN_DIR=/workspace/runs/$RUN_NAME
        mounts="$ROOT:$TASK_ROOT,$RUNS:/workspace/runs${SPARROW_MOUNTS:+,$SPARROW_MOUNTS}"
        srun_args+=("--container-image=$IMAGE" "--container-mounts=$mounts" "--container-workdir=$TASK_ROOT")
        if ((${#site_vars[@]})); then
            srun_args+=("--container-env=$(
                IFS=,
                echo "${site_vars[*]}"
            )")
        fi
        PYTHON=${SPARROW_PYTHON:-python}
    else
        TASK_ROOT=$ROOT
        TASK_RUN_DIR=$RUN_DIR
        PYTHON=${SPARROW_PYTHON:-$ROOT/.venv/bin/python}
    fi
    read -r -a extra_srun <<<"${SPARROW_SRUN_ARGS:-}"
    srun_args+=("${extra_srun[@]}")

    command=(srun "${srun_args[@]}" bash "$TASK_ROOT/slurm/task.sh" "$PYTHON" -m sparrow_nemo.cli train
        --config "$RECIPE" --run-dir "$TASK_RUN_DIR" checkpoint.resume=auto logging.progress_bar=false
        "${overrides[@]}")

    log "job $SLURM_JOB_ID attempt $ATTEMPT: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-1} node(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
    log "recipe $RECIPE, run folder $RUN_DIR, logs $LOG_DIR/${LOG_STEM}_rank*.log${IMAGE:+, container $IMAGE}"
    log "site variables passed to the tasks:${site_env:- none (NCCL_*, GLOO_*, TORCH_NCCL_*)}"
    if [[ $dry == 1 ]]; then
        printf '%q ' "${command[@]}"
        echo
        exit 0
    fi
    mkdir -p "$LOG_DIR"

    # USR1 (the time-limit warning, #SBATCH --signal=B:USR1@...) -> forward to the tasks, remember it (requeue).
    # TERM (scancel, preemption) -> forward too (a signal meant for the batch shell alone still stops the tasks
    # cleanly), no requeue by the launcher. Either way this shell waits for srun: it never dies before the save.
    warned=0
    terminated=0
    # shellcheck disable=SC2317,SC2329  # called through the trap, not unreachable
    forward() {
        log "$1: asking the training tasks to checkpoint and exit (status $REQUEUE_EXIT = requeue)"
        scancel --signal="$1" "$SLURM_JOB_ID" || log "scancel --signal=$1 failed"
    }
    # shellcheck disable=SC2317,SC2329
    on_usr1() {
        warned=1
        forward USR1
    }
    # shellcheck disable=SC2317,SC2329
    on_term() {
        terminated=1
        forward TERM
    }
    trap on_usr1 USR1
    trap on_term TERM

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
    if ((terminated)); then
        log "not requeueing: stopped by TERM (scancel or preemption; Slurm requeues a preempted job itself)"
        exit "$status"
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
    rank0_log="$LOG_DIR/${LOG_STEM}_rank0.log"
    if [[ -f $rank0_log ]]; then
        log "last lines of $rank0_log:"
        tail -n 30 "$rank0_log" >&2
    fi
    exit "$status"
}

main "$@"
