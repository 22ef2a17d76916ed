#!/usr/bin/env bash
# A throwaway single-node Slurm (slurmctld + slurmd + munged) in a private state folder, for the
# local-Slurm tests (tests/slurm/) and for trying the sbatch scripts on a developer machine.
#
#   scripts/ci_slurm_setup.sh start STATE_DIR   install slurm-wlm + munge if missing (apt-get, root),
#                                                write STATE_DIR/slurm.conf, start the daemons, wait
#                                                until the node is idle
#   scripts/ci_slurm_setup.sh stop STATE_DIR    stop the daemons started by `start` (by their pid files)
#
# After `start`, point the Slurm commands at the private cluster with
#   export SLURM_CONF=STATE_DIR/slurm.conf
# Nothing outside STATE_DIR is written (apart from the apt-get install): munged gets its own key, socket,
# pid and log files there, and slurm.conf points Slurm at that socket (AuthInfo=socket=...).
# The ports are picked free at start. Daemons run as root (SlurmUser=root): the node is a sandbox.
#
# Exit status: 0 when the cluster is up (start) or down (stop); 1 with a one-line reason on stderr
# otherwise (the tests skip with that reason). Every wait is bounded (SPARROW_SLURM_START_TIMEOUT, s).
#
# Timeouts are sized for a loaded 2-core machine, not Slurm's defaults (which assume an idle controller):
# RPCs (MessageTimeout 10 s, TCPTimeout 2 s) time out when slurmctld/slurmd wait for a core, a batch script
# that takes over BatchStartTimeout (10 s) to start is declared missing, and tasks that take over KillWait
# (10 s) / UnkillableStepTimeout (60 s) to exit (a trainer writing its checkpoint) are killed and the node
# drained: any of these ends a job FAILED although nothing in it failed.
set -euo pipefail

die() {
    echo "ci_slurm_setup: $*" >&2
    exit 1
}

usage() {
    die "usage: $0 start|stop STATE_DIR"
}

[[ $# -eq 2 ]] || usage
ACTION=$1
STATE=$2
TIMEOUT=${SPARROW_SLURM_START_TIMEOUT:-180}

# Install slurm-wlm and munge with apt-get when a daemon binary is missing (root only).
install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    [[ $(id -u) -eq 0 ]] || die "slurmctld/slurmd/munged are not installed and installing them needs root"
    command -v apt-get >/dev/null || die "slurmctld/slurmd/munged are not installed and there is no apt-get"
    echo "ci_slurm_setup: installing slurm-wlm and munge with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -q >/dev/null 2>&1 \
        || die "apt-get update failed (no network to the Debian mirror?)"
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
        || die "apt-get install slurm-wlm munge failed"
}

# A TCP port nobody listens on (the kernel picks it).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Wait up to TIMEOUT seconds for a command to succeed.
wait_for() {
    local what=$1
    shift
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
    echo "ci_slurm_setup: $what" >&2
}

node_idle() {
    [[ $(SLURM_CONF="$STATE/slurm.conf" sinfo --noheader --format=%T 2>/dev/null) == idle* ]]
}

start() {
    [[ $(id -u) -eq 0 ]] || die "the daemons run as root here (SlurmdUser=root) and you are not root"
    install_packages
    mkdir -p "$STATE"/{munge,spool,state,log}
    chmod 700 "$STATE/munge"
    local host cpus ctld_port slurmd_port
    host=$(hostname -s)
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS; the node has them all
    ctld_port=$(free_port)
    slurmd_port=$(free_port)

    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/munge/munge.key"
    munged --force \
        --key-file="$STATE/munge/munge.key" \
        --socket="$STATE/munge/munge.socket" \
        --pid-file="$STATE/munge/munged.pid" \
        --log-file="$STATE/log/munged.log" \
        --seed-file="$STATE/munge/munged.seed" \
        || die "munged did not start (see $STATE/log/munged.log)"
    wait_for "munged is up" munge --socket="$STATE/munge/munge.socket" --no-input \
        || die "munged did not answer within ${TIMEOUT}s (see $STATE/log/munged.log)"

    cat >"$STATE/slurm.conf" <<EOF
# written by scripts/ci_slurm_setup.sh: a single-node sandbox cluster
ClusterName=sparrow-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
MessageTimeout=60
TCPTimeout=15
BatchStartTimeout=120
KillWait=60
UnkillableStepTimeout=300
SlurmdTimeout=600
SlurmctldTimeout=600
MinJobAge=600
SchedulerType=sched/backfill
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$STATE/slurm.conf"
    slurmctld || die "slurmctld did not start (see $STATE/log/slurmctld.log)"
    slurmd || die "slurmd did not start (see $STATE/log/slurmd.log)"
    wait_for "node $host is idle (export SLURM_CONF=$SLURM_CONF)" node_idle \
        || die "node $host not idle within ${TIMEOUT}s (see $STATE/log/slurmctld.log and slurmd.log)"
}

# Stop one daemon by its pid file; SIGKILL after a bounded wait.
stop_daemon() {
    local pidfile=$1 pid
    [[ -f $pidfile ]] || return 0
    pid=$(<"$pidfile")
    kill "$pid" 2>/dev/null || return 0
    local deadline=$((SECONDS + TIMEOUT))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            kill -9 "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
}

stop() {
    [[ -d $STATE ]] || die "no state folder $STATE"
    stop_daemon "$STATE/slurmd.pid"
    stop_daemon "$STATE/slurmctld.pid"
    stop_daemon "$STATE/munge/munged.pid"
}

case $ACTION in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
